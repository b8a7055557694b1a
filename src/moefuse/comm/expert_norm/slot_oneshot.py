"""The slot one-shot kernel of ``tp_moe_finalize_rmsnorm`` (``_tp_slot_oneshot_kernel``, Lamport,
decode; launched by :mod:`moefuse.comm.expert_norm.tp_kernels`) and its device functions: one
CTA per (token, slot) row on every rank pushes the row to every peer, sums the ranks in order,
stores the row rounded to BF16 with its norm statistic, and counts it in the token's arrival word;
the token's K rows are then folded into its output row (by the CTA that completes the token, or a
column slice per CTA: the split fold). Argument groups as in
:mod:`moefuse.comm.expert_norm.slot_math` (``src``, ``wait``).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from moefuse._device import round_to, widen_f32
from moefuse.comm import device as D
from moefuse.comm.expert_norm.slot_math import (
    _load_row,
    _norm_apply,
    _norm_rstd,
    _push_slot,
    _route,
    _slot_sum,
    _store_out,
)


@triton.jit
def _close_group(out, gsum, k: tl.constexpr, B: tl.constexpr):
    """Canonical grouping before slot ``k``: at a group boundary (``k % B == 0``, k > 0) the open
    group sum joins ``out`` and a new group starts from +0.0. Compile-time condition."""
    if (k > 0) & (k % B == 0):
        out = out + gsum
        gsum = tl.zeros_like(gsum)
    return out, gsum


@triton.jit
def _token_routes(idx_ptr, idx_st, w_ptr, w_st, t64, R, K: tl.constexpr):
    """(valid flags, weights as FP32) of token t's K slots, as two tuples of K scalars: the fold
    picks slot k's entries by position, with no cross-thread reduction (and a decode launch
    issues the 2K independent loads before its grid-dependency wait, so the fold needs no
    routing round trip of its own). Weights of invalid slots are not read."""
    valids = ()
    weights = ()
    for k in tl.static_range(K):
        p = tl.load(idx_ptr + t64 * idx_st + k)
        valid = (p >= 0) & (p < R)
        valids = valids + (valid,)
        weights = weights + (tl.load(w_ptr + t64 * w_st + k, mask=valid, other=0.0).to(tl.float32),)
    return valids, weights


@triton.jit
def _fold_local(
    x_tok,
    r_tok,
    g,
    valids,
    weights,
    cols,
    cmask,
    H,
    K: tl.constexpr,
    B: tl.constexpr,
    WBN: tl.constexpr,
    PTX: tl.constexpr,
):
    """``sum_{j asc} G_j`` of token t from its K rank-summed BF16 rows at ``x_tok`` (``[K, H]``)
    and their FP32 reciprocal RMS at ``r_tok`` (``[K]``), both local and written by other CTAs of
    this launch (read through L2 with ``.cg``); ``y_k`` is rebuilt with :func:`_norm_apply` (the
    same products as :func:`_expert_norm`: same bits, half the bytes of FP32 rows). The slots'
    validity and weights are :func:`_token_routes`' tuples. Branch-free: the K row loads are
    independent (all in flight at once); an invalid slot's row, statistic and weight are masked
    off and its FMA is not applied (``where``): the other algorithms' chain."""
    out = tl.zeros(cols.shape, tl.float32)
    gsum = tl.zeros(cols.shape, tl.float32)
    for k in tl.static_range(K):
        out, gsum = _close_group(out, gsum, k, B)
        valid = valids[k]
        w = weights[k]
        r = tl.load(r_tok + k, mask=valid, other=0, cache_modifier=".cg")
        xk = tl.load(x_tok + k * H + cols, mask=cmask & valid, other=0, cache_modifier=".cg")
        yk = _norm_apply(
            widen_f32(xk.to(tl.bfloat16, bitcast=True), PTX),
            g,
            r.to(tl.float32, bitcast=True),
            WBN,
        )
        gsum = tl.where(valid, tl.fma(yk, w, gsum), gsum)
    return out + gsum


@triton.jit
def _arrive_token(cnt_ptr, missing, K: tl.constexpr):
    """One (token, slot) row of this CTA is done (its normalized row stored, or ``missing``):
    count it in the token's arrival word (acq_rel, GPU scope, after a CTA barrier so every
    thread's row stores are part of the release). Returns (``last``: this CTA brought the count
    to K, ``fold``: ``last`` and no row timed out). The last CTA resets the word for the next
    call (nothing else touches it until this launch ends). A timed-out row adds 2^16, so no CTA
    folds a token with a hole. Also returns the word as this arrival left it (for
    :func:`_await_token`)."""
    tl.debug_barrier()
    inc = tl.where(missing != 0, 65537, 1)
    new = tl.atomic_add(cnt_ptr, inc, sem="acq_rel", scope="gpu") + inc
    done = (new & 0xFFFF) == K
    if done:
        tl.store(cnt_ptr, 0)
    return done, done & ((new >> 16) == 0), new


@triton.jit
def _await_token(cnt_ptr, seen, deadline, clock_ptr, K: tl.constexpr, PTX: tl.constexpr):
    """Spin (acquire, GPU scope) until every CTA of the token has arrived: the arrival word reads
    K in its low half, or 0 (the last CTA reset it after bringing it to K; this CTA has arrived,
    so 0 cannot mean "nobody yet"), starting from ``seen`` (the value this CTA's own arrival
    produced); bounded by ``deadline`` (:func:`moefuse.comm.device.wait_bound`: also ends when a
    peer gave up). Returns the word last read (its high half counts rows that timed out; 0 also
    when the wait ended first, see the caller)."""
    c = seen
    expired = 0
    while ((c & 0xFFFF) != K) & (c != 0) & (expired == 0):
        c = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        expired = D.ended(deadline, clock_ptr, PTX)
    return tl.where(((c & 0xFFFF) == K) | (c == 0), c, 1 << 16)


@triton.jit
def _fold_slices(
    xdec,
    rdec,
    nw_ptr,
    gain_center,
    out_ptr,
    out_st,
    t64,
    k,
    valids,
    weights,
    H,
    K: tl.constexpr,
    KP: tl.constexpr,
    B: tl.constexpr,
    WBN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PTX: tl.constexpr,
):
    """Slot ``k``'s share of token t's fold: column slices ``k, k + K, ...`` of the KP slices of
    ``BLOCK_H // KP`` columns (:func:`_fold_local` on each: per column the same FMA chain over
    the K rows, so the same bits as one CTA folding the whole row)."""
    FW: tl.constexpr = BLOCK_H // KP
    sl = k
    while sl < KP:
        cols = sl * FW + tl.arange(0, FW)
        cmask = cols < H
        g = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + gain_center
        out = _fold_local(
            xdec + t64 * K * H,
            rdec + t64 * K,
            g,
            valids,
            weights,
            cols,
            cmask,
            H,
            K,
            B,
            WBN,
            PTX,
        )
        _store_out(
            out_ptr,
            out_st,
            t64,
            D.as_bits(round_to(out, tl.bfloat16, PTX), 16),
            cols,
            cmask,
        )
        sl += K


@triton.jit
def _fold_token(
    xdec,
    rdec,
    g,
    out_ptr,
    out_st,
    src,
    t64,
    t0,
    valids0,
    weights0,
    cols,
    cmask,
    H,
    R,
    K: tl.constexpr,
    B: tl.constexpr,
    WBN: tl.constexpr,
    PTX: tl.constexpr,
):
    """Slot one-shot, the CTA that completed token ``t64``: fold its K normalized rows
    (``xdec`` / ``rdec``, :func:`_fold_local`) and write its output row. The routes of the CTA's
    first token ``t0`` (``valids0``, ``weights0``) are reused; another token's are loaded."""
    rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st = src
    valids, weights = valids0, weights0
    if t64 != t0:
        valids, weights = _token_routes(idx_ptr, idx_st, w_ptr, w_st, t64, R, K)
    out = _fold_local(
        xdec + t64 * K * H,
        rdec + t64 * K,
        g,
        valids,
        weights,
        cols,
        cmask,
        H,
        K,
        B,
        WBN,
        PTX,
    )
    _store_out(
        out_ptr,
        out_st,
        t64,
        D.as_bits(round_to(out, tl.bfloat16, PTX), 16),
        cols,
        cmask,
    )


@triton.jit
def _reduce_slot_row(
    own,
    k,
    t64,
    region,
    mine16,
    rank,
    dec,
    norm,
    cols,
    cmask,
    H,
    wait,
    K: tl.constexpr,
    P: tl.constexpr,
    WBN: tl.constexpr,
    PTX: tl.constexpr,
):
    """Slot (t, k)'s rank-order sum (this rank's row ``own``, the peers' from their Lamport
    slots), rounded once to BF16 and stored with its 1/RMS at ``xdec`` / ``rdec`` (``[M, K, H]``
    and ``[M, K]``, local; ``dec`` = (xdec, rdec)) for the fold; ``norm`` = (g, nw_ptr,
    gain_center, Hf, eps). Returns the mask of peers that never arrived."""
    xdec, rdec = dec
    g, nw_ptr, gain_center, Hf, eps = norm
    acc, missing = _slot_sum(
        own, k, t64, region, mine16, rank, cols, cmask, H, wait, K, P, False, PTX
    )
    xb = round_to(acc, tl.bfloat16, PTX)
    rstd = _norm_rstd(widen_f32(xb, PTX), g, cmask, Hf, eps, WBN)
    tl.store(xdec + (t64 * K + k) * H + cols, D.as_bits(xb, 16), mask=cmask)
    tl.store(rdec + t64 * K + k, D.as_bits(rstd, 32))
    return missing


@triton.jit
def _fold_arrived(
    fold,
    seen,
    cnt,
    dec,
    norm,
    out,
    src,
    first,
    t64,
    k,
    cols,
    cmask,
    H,
    R,
    wait,
    K: tl.constexpr,
    KP: tl.constexpr,
    B: tl.constexpr,
    WBN: tl.constexpr,
    BLOCK_H: tl.constexpr,
    SPLIT_FOLD: tl.constexpr,
    PTX: tl.constexpr,
):
    """Fold token t once slot (t, k)'s row has been counted in its arrival word ``cnt + t``
    (:func:`_arrive_token` gave ``fold``, ``seen``): SPLIT_FOLD, every CTA of the token its
    column slices once all K rows are in (:func:`_fold_slices`); else the CTA that completed the
    token, the whole row (:func:`_fold_token`). ``dec`` = (xdec, rdec); ``norm`` = (g, nw_ptr,
    gain_center, Hf, eps); ``out`` = (out_ptr, out_st); ``first`` = (t0, valids0, weights0), the
    routes of the CTA's first token; ``wait`` = (deadline, clock_ptr, empty row)."""
    xdec, rdec = dec
    g, nw_ptr, gain_center, Hf, eps = norm
    out_ptr, out_st = out
    t0, valids0, weights0 = first
    deadline, clock_ptr, empty16 = wait
    if SPLIT_FOLD:  # one row per CTA (M * K <= grid): the token's K CTAs fold a slice each
        c = _await_token(cnt + t64, seen, deadline, clock_ptr, K, PTX)
        if (c >> 16) == 0:
            _fold_slices(
                xdec,
                rdec,
                nw_ptr,
                gain_center,
                out_ptr,
                out_st,
                t64,
                k,
                valids0,
                weights0,
                H,
                K,
                KP,
                B,
                WBN,
                BLOCK_H,
                PTX,
            )
    elif fold:
        _fold_token(
            xdec,
            rdec,
            g,
            out_ptr,
            out_st,
            src,
            t64,
            t0,
            valids0,
            weights0,
            cols,
            cmask,
            H,
            R,
            K,
            B,
            WBN,
            PTX,
        )


@triton.jit
def _cta_columns(nw_ptr, gain_center, H, BLOCK_H: tl.constexpr):
    """(program, programs, columns, column mask, gain ``f32(w) + gain_center``), with no
    grid-dependency wait (the kernel reads the first row's routing before it)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + gain_center
    return pid, G, cols, cmask, g


@triton.jit
def _push_slot_row(x, r, t64, slots, cols, cmask, H, K: tl.constexpr, P: tl.constexpr):
    """Phase 1, row ``r = t*K + k``: push this rank's partial row ``x`` of slot (t, k) into slot
    ``[gen, t, k, sender]`` of every peer. ``slots`` = (table_ptr, rows_off16, region, rank,
    dists): where the slot rows live, ``dists`` the table entries read early."""
    table_ptr, rows_off16, region, rank, dists = slots
    for q in tl.static_range(P):
        if q != rank:
            _push_slot(
                x, q, r % K, t64, region, rank, table_ptr, rows_off16, cols, cmask, H, K, P, dists
            )


@triton.jit
def _local_regions(ws, rank, dists):
    """This rank's regions of the kernel's workspace tuple ``ws``: (its Lamport slot rows
    ``xn_rows`` as BF16 bits, ``dec`` = (the rank-summed rows ``xn_xdec`` [M, K, H] as BF16 bits,
    their 1/RMS ``xn_rdec`` [M, K] as FP32 bits), the tokens' arrival words ``xn_cnt`` [M])."""
    table_ptr, rows_off16, x_off16, r_off16, cnt_off16, ctrl_ptr, clock_ptr = ws
    mine16 = D.peer_base(table_ptr, rank, rows_off16, 16, dists)
    xdec = D.peer_base(table_ptr, rank, x_off16, 16, dists)
    rdec = D.peer_base(table_ptr, rank, r_off16, 32, dists)
    cnt = D.peer_base(table_ptr, rank, cnt_off16, 32, dists)
    return mine16, (xdec, rdec), cnt


@triton.jit
def _finish_slot_oneshot(
    ctrl_ptr,
    table_ptr,
    rank,
    gen,
    missing,
    completed,
    M,
    pid,
    G,
    P: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    """End of the slot one-shot kernel (:func:`moefuse.comm.device.oneshot_finish`). One token
    (decode): every CTA has a row of it (G <= K rows), so the CTA that completes the token's
    count (``completed``) is the last to have read the control words: it alone advances the
    generation, without the launch-wide arrival atomic. Otherwise every CTA arrives."""
    one_token = M == 1
    D.oneshot_finish(
        ctrl_ptr,
        table_ptr,
        rank,
        gen,
        missing,
        ctrl_ptr,
        M,
        M,
        0,
        pid,
        G,
        P,
        0,
        0,
        16,
        USE_PDL,
        PTX,
        completed | (M != 1),
        tl.where(one_token, 1, 0),
    )


# ----------------------------------------------------------------------------- kernel
@triton.jit(do_not_specialize=["M", "R", "rank"])
def _tp_slot_oneshot_kernel(
    rows_ptr, w_ptr, idx_ptr, nw_ptr, out_ptr, strides, ws, M, R, H, Hf, rank, cap, eps,
    gain_center, timeout_us,
    P: tl.constexpr, K: tl.constexpr, B: tl.constexpr, NG: tl.constexpr,
    BLOCK_H: tl.constexpr, WBN: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
    SPLIT_FOLD: tl.constexpr = False, KP: tl.constexpr = 8,
):  # fmt: skip
    """Decode, one NVLink hop; row ``r = t*K + k`` belongs to CTA ``r mod G``. Phase 1: push each
    valid partial row into slot ``[gen, t, k, sender]`` of every peer. Phase 2: per row, sum the
    ranks in order, round, store ``x_k`` and its 1/RMS (``xn_xdec``, ``xn_rdec``) and count it in
    the token's arrival word; the CTA completing a token folds it. CTA j waits only on CTA j of
    the peers. ``strides`` = (row_st, w_st, idx_st, out_st); ``ws`` = (table_ptr, rows_off16,
    x_off16, r_off16, cnt_off16, ctrl_ptr, clock_ptr)."""
    row_st, w_st, idx_st, out_st = strides
    table_ptr, rows_off16, x_off16, r_off16, cnt_off16, ctrl_ptr, clock_ptr = ws
    pid, G, cols, cmask, g = _cta_columns(nw_ptr, gain_center, H, BLOCK_H)
    n_rows = M * K
    # The first row's routing is read before the grid-dependency wait (it is complete long before
    # the preceding GEMM; so is the table), the row itself and the control words after it.
    t0 = (pid // K).to(tl.int64)
    p0, valid0 = _route(idx_ptr, idx_st, t0, pid % K, R)
    valids0, weights0 = _token_routes(idx_ptr, idx_st, w_ptr, w_st, t0, R, K)
    dists = D.table_dists(table_ptr, P)
    if USE_PDL:
        gdc_wait()
    x0 = tl.load(rows_ptr + p0 * row_st + cols, mask=cmask & valid0 & (pid < n_rows), other=0.0)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, n_rows, pid, G, cap, P, PTX, dists
    )
    slots = (table_ptr, rows_off16, region, rank, dists)
    i = 0
    while i < n_mine:
        r = pid + i * G
        t64 = (r // K).to(tl.int64)
        if i == 0:
            p, valid = p0, valid0
        else:
            p, valid = _route(idx_ptr, idx_st, t64, r % K, R)
        if valid:
            if i == 0:
                x = x0
            else:
                x = _load_row(rows_ptr, row_st, p, cols, cmask)
            _push_slot_row(x, r, t64, slots, cols, cmask, H, K, P)
        i += 1
    mine16, dec, cnt = _local_regions(ws, rank, dists)
    wait = (deadline, clock_ptr, D.empty_row(BLOCK_H, 16))
    src = (rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st)
    first, norm, out = (t0, valids0, weights0), (g, nw_ptr, gain_center, Hf, eps), (out_ptr, out_st)
    missing = tl.full([], 0, tl.int32)  # a tensor: it is reassigned inside run-time branches
    completed = pid < 0  # this CTA brought a token's count to K (a tensor, as above)
    i = 0
    while (i < n_mine) & (missing == 0):
        r = pid + i * G
        t64 = (r // K).to(tl.int64)
        k = r % K
        if i == 0:
            p, valid = p0, valid0
        else:
            p, valid = _route(idx_ptr, idx_st, t64, k, R)
        if valid:
            if i == 0:
                own = widen_f32(x0, PTX)
            else:
                own = widen_f32(_load_row(rows_ptr, row_st, p, cols, cmask), PTX)
            missing = _reduce_slot_row(
                own, k, t64, region, mine16, rank, dec, norm, cols, cmask, H, wait, K, P, WBN, PTX
            )
        last, fold, seen = _arrive_token(cnt + t64, missing, K)
        completed = completed | last
        _fold_arrived(
            fold,
            seen,
            cnt,
            dec,
            norm,
            out,
            src,
            first,
            t64,
            k,
            cols,
            cmask,
            H,
            R,
            wait,
            K,
            KP,
            B,
            WBN,
            BLOCK_H,
            SPLIT_FOLD,
            PTX,
        )
        i += 1
    _finish_slot_oneshot(
        ctrl_ptr, table_ptr, rank, gen, missing, completed, M, pid, G, P, USE_PDL, PTX
    )
