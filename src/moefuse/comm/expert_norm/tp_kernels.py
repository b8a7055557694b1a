"""Triton kernels of the per-expert-norm MoE finalize fusions (spec: tp_moe_finalize_rmsnorm,
moe_finalize_rmsnorm_allreduce) and launchers.

TP (``tp_moe_finalize_rmsnorm``): every rank holds a partial GEMM2 row per (token, slot); the P
partials of a slot are summed in rank order (FP32, one BF16 rounding) BEFORE the per-expert
RMSNorm. Three algorithms, same bits:

* ``_tp_slot_oneshot_kernel`` (Lamport, decode): one CTA per (token, slot) row on EVERY rank;
  each rank pushes every partial row to every peer (one hop), sums, rounds and normalizes each
  row itself, and the CTA that completes a token's K rows folds them (no second hop); or, when
  every CTA has one row (:func:`split_fold`), the token's K CTAs wait for each other and fold a
  column slice each.
* ``_tp_expert_owner_kernel`` (Lamport, small M). Slot group j (``B = ceil(K/P)`` slots) belongs
  to rank j. Phase 1: every rank pushes its partial rows of the slots it does not own into the
  owner's BF16 slot ``[gen, t, k, sender]``. Phase 2: the owner polls them, sums ranks in order,
  rounds, normalizes, and folds its group with FMAs into an FP32 group sum ``G_j``, which it
  stores into slot ``[gen, t, j]`` of EVERY rank's FP32 region (its own too). Phase 3: every rank
  polls the groups and adds them in ascending j from +0.0, rounds once, writes the output.
* ``_tp_token_owner_kernel`` (Lamport, larger M). Rank ``t mod P`` owns token t: every other rank
  pushes all K partial rows of t to it; the owner computes the token exactly as above (same group
  sums, same order), writes its output row and pushes the BF16 row to every peer, which copies it.
* ``_tp_staged_kernel`` (push + flags, large M): the token-owner decomposition with plain stores
  into single-buffered staging / gather regions and two flag barriers per CTA (as the all-reduce
  two-shot kernel): no sentinels to poll or re-arm, one generation of memory instead of three.
* ``_tp_gathered_kernel`` — the torch.distributed path: all ranks' rows all-gathered into
  ``[P, R, H]``, then the same per-token math locally.

All three evaluate ``out = sum_{j asc} G_j`` with ``G_j = fma chain over group j's valid slots``
from the same device helpers, so a token's bits depend on (H, K, P) only — not on M, on the
algorithm that "auto" picks for M, or on the grid (batch invariance across the path switch).

EP (``moe_finalize_rmsnorm_allreduce``): :mod:`moefuse.comm.expert_norm.ep_kernels` (it reuses
the per-slot helpers of this module).

Invalid slots (index < 0 or >= R) are never loaded, normalized or weighted (their weight is not
read either). Lamport conventions, generations, bounded waits and the status word are those of
:mod:`moefuse.comm.device` (:func:`oneshot_state` / :func:`oneshot_finish`, shared control
words): the output is written with -0.0 as +0.0 on every path, because a BF16 row that travels as
Lamport payload must be scrubbed and all ranks must agree bitwise.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from moefuse import knobs
from moefuse._device import round_to, rsqrt_fast, widen_f32
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active
from moefuse.comm import device as D
from moefuse.comm.tiles import comm_tile


# ----------------------------------------------------------------------------- per-slot math
@triton.jit
def _norm_rstd(x, g, cmask, Hf, eps, WBN: tl.constexpr):
    """Reciprocal RMS of one expert row ``x`` (FP32, BF16-exact values; of ``x * g`` when WBN).
    The statistic is an FP64 sum of exact squares rounded once to FP32 (same convention as
    ``moefuse.comm.device.epilogue_row``)."""
    if WBN:
        z = x * g
    else:
        z = x
    zd = tl.where(cmask, z, 0.0).to(tl.float64)
    sumsq = tl.sum(zd * zd, axis=0).to(tl.float32)
    return rsqrt_fast(tl.math.div_rn(sumsq, Hf) + eps)


@triton.jit
def _norm_apply(x, g, r, WBN: tl.constexpr):
    """The normalized row from ``x`` and its :func:`_norm_rstd` ``r`` (products only: nothing
    for the compiler to contract, so a row rebuilt from (x, r) elsewhere has the same bits)."""
    if WBN:
        y = (x * g) * r
    else:
        y = (x * r) * g
    return y


@triton.jit
def _expert_norm(x, g, cmask, Hf, eps, WBN: tl.constexpr):
    """RMSNorm of one expert row ``x`` (FP32, BF16-exact values)."""
    return _norm_apply(x, g, _norm_rstd(x, g, cmask, Hf, eps, WBN), WBN)


@triton.jit
def _slot_y(acc, g, cmask, Hf, eps, WBN: tl.constexpr, PTX: tl.constexpr):
    """FP32 rank sum ``acc`` of a slot -> one BF16 rounding -> normalized FP32 row."""
    x = widen_f32(round_to(acc, tl.bfloat16, PTX), PTX)
    return _expert_norm(x, g, cmask, Hf, eps, WBN)


@triton.jit
def _prologue(nw_ptr, gain_center, H, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """(program, programs, columns, column mask, gain ``f32(w) + gain_center``); the gain is a
    model parameter, loaded before the grid-dependency wait (PDL)."""
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + gain_center
    if USE_PDL:
        gdc_wait()
    return tl.program_id(0), tl.num_programs(0), cols, cmask, g


@triton.jit
def _route(idx_ptr, idx_st, t64, k, R):
    """(row index as int64, valid) of slot (t, k)."""
    p = tl.load(idx_ptr + t64 * idx_st + k)
    valid = (p >= 0) & (p < R)
    return p.to(tl.int64), valid


@triton.jit
def _weight(w_ptr, w_st, t64, k):
    return tl.load(w_ptr + t64 * w_st + k).to(tl.float32)


@triton.jit
def _load_row(rows_ptr, row_st, p64, cols, cmask):
    return tl.load(rows_ptr + p64 * row_st + cols, mask=cmask, other=0.0)


@triton.jit
def _store_out(out_ptr, out_st, t64, o, cols, cmask):
    """Store a BF16 row with -0.0 written as +0.0 (``o`` given as int16 bits)."""
    tl.store(out_ptr + t64 * out_st + cols, D.scrub(o, 16).to(tl.bfloat16, bitcast=True),
             mask=cmask)  # fmt: skip


@triton.jit
def _slot_off(region, t64, k, s, H, K: tl.constexpr, P: tl.constexpr):
    """Element offset of BF16 row slot [gen region + t, k, sender slot s] ([3, L, K, P-1, H])."""
    return (((region + t64) * K + k) * (P - 1) + s) * H


@triton.jit
def _push_slot(x, q, k, t64, region, rank, table_ptr, rows_off16, cols, cmask, H,
               K: tl.constexpr, P: tl.constexpr, dists=None):  # fmt: skip
    """Store this rank's partial row ``x`` of slot (t, k) into its slot of rank ``q``'s buffer
    (sender ``s`` uses slot ``s - (s > q)``; a rank never sends to itself). ``dists``: the
    table entries read early (``D.table_dists``)."""
    s = rank - (rank > q).to(tl.int32)
    dst = D.peer_base(table_ptr, q, rows_off16, 16, dists) + _slot_off(region, t64, k, s, H, K,
                                                                       P)  # fmt: skip
    tl.store(dst + cols, D.scrub(D.as_bits(x, 16), 16), mask=cmask)


@triton.jit
def _slot_sum(own, k, t64, region, mine16, rank, cols, cmask, H, deadline, clock_ptr, empty16,
              K: tl.constexpr, P: tl.constexpr, STAGED: tl.constexpr,
              PTX: tl.constexpr):  # fmt: skip
    """FP32 rank-order sum (from +0.0) of slot (t, k): this rank's row ``own`` (FP32) in its
    place, each peer's row polled from this rank's Lamport slot and the slot re-armed (or, when
    STAGED, read from the staging region after the flag barrier). Returns (sum, bit mask of
    peers that never arrived)."""
    acc = tl.zeros(own.shape, tl.float32)
    missing = 0
    for q in tl.static_range(P):
        if q == rank:
            v = own
        else:
            s = q - (q > rank).to(tl.int32)
            ptr = mine16 + _slot_off(region, t64, k, s, H, K, P) + cols
            if STAGED:  # .cg: written by a peer over NVLink, never cached in this SM's L1
                bits = tl.load(ptr, mask=cmask, other=0, cache_modifier=".cg")
            else:
                bits, pending = D.poll_row(ptr, cmask, deadline, clock_ptr, 16, PTX)
                tl.store(ptr, empty16, mask=cmask)  # re-arm the slot just consumed
                missing = missing | tl.where(pending != 0, 1 << q, 0)
            v = widen_f32(bits.to(tl.bfloat16, bitcast=True), PTX)
        acc = acc + v
    return acc, missing


@triton.jit
def _owned_token(rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st, t64, region, mine16, rank, g,
                 cols, cmask, H, Hf, R, eps, deadline, clock_ptr, empty16, j_lo, j_hi,
                 K: tl.constexpr, B: tl.constexpr, NG: tl.constexpr, P: tl.constexpr,
                 WBN: tl.constexpr, STAGED: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """``sum_{j in [j_lo, j_hi) asc} G_j`` for token t (FP32 from +0.0), every slot's peer rows
    from this rank's Lamport slots (or staging region). Returns (sum, missing peers)."""
    out = tl.zeros(cols.shape, tl.float32)
    gsum = tl.zeros(cols.shape, tl.float32)
    missing = 0
    for k in tl.static_range(K):
        if k > 0:
            if k % B == 0:  # group boundary (compile time): close the previous group
                out = out + gsum
                gsum = tl.zeros(cols.shape, tl.float32)
        if (k // B >= j_lo) & (k // B < j_hi):
            p, valid = _route(idx_ptr, idx_st, t64, k, R)
            if valid:
                own = widen_f32(_load_row(rows_ptr, row_st, p, cols, cmask), PTX)
                acc, miss = _slot_sum(own, k, t64, region, mine16, rank, cols, cmask, H,
                                      deadline, clock_ptr, empty16, K, P, STAGED,
                                      PTX)  # fmt: skip
                missing = missing | miss
                y = _slot_y(acc, g, cmask, Hf, eps, WBN, PTX)
                gsum = tl.fma(y, _weight(w_ptr, w_st, t64, k), gsum)
    out = out + gsum
    return out, missing


@triton.jit
def _push_foreign_tokens(rows_ptr, row_st, idx_ptr, idx_st, pid, G, n_mine, R, region, rank,
                         table_ptr, off16, cols, cmask, H, K: tl.constexpr,
                         P: tl.constexpr):  # fmt: skip
    """Token-owner phase 1: every valid slot row of this CTA's tokens owned by other ranks
    (owner ``t mod P``) into the owner's slot (never waits)."""
    i = 0
    while i < n_mine:
        t = pid + i * G
        o = t % P
        if o != rank:
            t64 = t.to(tl.int64)
            for k in tl.static_range(K):
                p, valid = _route(idx_ptr, idx_st, t64, k, R)
                if valid:
                    x = _load_row(rows_ptr, row_st, p, cols, cmask)
                    _push_slot(x, o, k, t64, region, rank, table_ptr, off16, cols, cmask, H, K, P)
        i += 1


# ----------------------------------------------------------------------------- TP expert owner
@triton.jit(do_not_specialize=["M", "R", "rank"])
def _tp_expert_owner_kernel(
    rows_ptr, w_ptr, idx_ptr, nw_ptr, out_ptr, row_st, w_st, idx_st, out_st,
    table_ptr, rows_off16, gsum_off16, ctrl_ptr, clock_ptr,
    M, R, H, Hf, rank, cap, eps, gain_center, timeout_us,
    P: tl.constexpr, K: tl.constexpr, B: tl.constexpr, NG: tl.constexpr,
    BLOCK_H: tl.constexpr, WBN: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    pid, G, cols, cmask, g = _prologue(nw_ptr, gain_center, H, BLOCK_H, USE_PDL)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, pid, G, cap, P, PTX)  # fmt: skip
    # phase 1: push the partial rows of slots owned by other ranks (never waits)
    i = 0
    while i < n_mine:
        t64 = (pid + i * G).to(tl.int64)
        for k in tl.static_range(K):
            o = k // B
            if o != rank:
                p, valid = _route(idx_ptr, idx_st, t64, k, R)
                if valid:
                    x = _load_row(rows_ptr, row_st, p, cols, cmask)
                    _push_slot(x, o, k, t64, region, rank, table_ptr, rows_off16, cols, cmask, H,
                               K, P)  # fmt: skip
        i += 1
    # phase 2: the owned group's sum, published to every rank (own buffer included)
    mine16 = D.peer_base(table_ptr, rank, rows_off16, 16)
    empty16 = D.empty_row(BLOCK_H, 16)
    missing = 0
    i = 0
    while (i < n_mine) & (missing == 0) & (rank < NG):
        t64 = (pid + i * G).to(tl.int64)
        gsum, miss = _owned_token(rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st, t64, region,
                                  mine16, rank, g, cols, cmask, H, Hf, R, eps, deadline,
                                  clock_ptr, empty16, rank, rank + 1, K, B, NG, P, WBN,
                                  False, PTX)  # fmt: skip
        missing = missing | miss
        bits = D.scrub(D.as_bits(gsum, 32), 32)
        for q in tl.static_range(P):
            dst = D.peer_base(table_ptr, q, gsum_off16, 32) + ((region + t64) * NG + rank) * H
            tl.store(dst + cols, bits, mask=cmask)
        i += 1
    # phase 3: every rank adds the group sums in ascending group order
    mine32 = D.peer_base(table_ptr, rank, gsum_off16, 32)
    empty32 = D.empty_row(BLOCK_H, 32)
    i = 0
    while (i < n_mine) & (missing == 0):
        t64 = (pid + i * G).to(tl.int64)
        out = tl.zeros([BLOCK_H], tl.float32)
        for j in tl.static_range(NG):
            ptr = mine32 + ((region + t64) * NG + j) * H + cols
            bits, pending = D.poll_row(ptr, cmask, deadline, clock_ptr, 32, PTX)
            tl.store(ptr, empty32, mask=cmask)
            missing = missing | tl.where(pending != 0, 1 << j, 0)
            out = out + bits.to(tl.float32, bitcast=True)
        _store_out(out_ptr, out_st, t64, D.as_bits(round_to(out, tl.bfloat16, PTX), 16), cols,
                   cmask)  # fmt: skip
        i += 1
    D.oneshot_finish(ctrl_ptr, table_ptr, rank, gen, missing, ctrl_ptr, M, M, 0, pid, G, P, 0,
                    0, 16, USE_PDL, PTX)  # fmt: skip


# ----------------------------------------------------------------------------- TP slot one-shot
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
def _fold_local(x_tok, r_tok, g, valids, weights, cols, cmask, H, K: tl.constexpr,
                B: tl.constexpr, WBN: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
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
        yk = _norm_apply(widen_f32(xk.to(tl.bfloat16, bitcast=True), PTX), g,
                         r.to(tl.float32, bitcast=True), WBN)  # fmt: skip
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
def _fold_slices(xdec, rdec, nw_ptr, gain_center, out_ptr, out_st, t64, k, valids, weights, H,
                 K: tl.constexpr, KP: tl.constexpr, B: tl.constexpr, WBN: tl.constexpr,
                 BLOCK_H: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Slot ``k``'s share of token t's fold: column slices ``k, k + K, ...`` of the KP slices of
    ``BLOCK_H // KP`` columns (:func:`_fold_local` on each: per column the same FMA chain over
    the K rows, so the same bits as one CTA folding the whole row)."""
    FW: tl.constexpr = BLOCK_H // KP
    sl = k
    while sl < KP:
        cols = sl * FW + tl.arange(0, FW)
        cmask = cols < H
        g = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + gain_center
        out = _fold_local(xdec + t64 * K * H, rdec + t64 * K, g, valids, weights, cols, cmask, H,
                          K, B, WBN, PTX)  # fmt: skip
        _store_out(out_ptr, out_st, t64, D.as_bits(round_to(out, tl.bfloat16, PTX), 16), cols,
                   cmask)  # fmt: skip
        sl += K


@triton.jit
def _fold_token(xdec, rdec, g, out_ptr, out_st, idx_ptr, idx_st, w_ptr, w_st, t64, t0, valids0,
                weights0, cols, cmask, H, R, K: tl.constexpr, B: tl.constexpr,
                WBN: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Slot one-shot, the CTA that completed token ``t64``: fold its K normalized rows
    (``xdec`` / ``rdec``, :func:`_fold_local`) and write its output row. The routes of the CTA's
    first token ``t0`` (``valids0``, ``weights0``) are reused; another token's are loaded."""
    valids, weights = valids0, weights0
    if t64 != t0:
        valids, weights = _token_routes(idx_ptr, idx_st, w_ptr, w_st, t64, R, K)
    out = _fold_local(xdec + t64 * K * H, rdec + t64 * K, g, valids, weights, cols, cmask, H, K,
                      B, WBN, PTX)  # fmt: skip
    _store_out(out_ptr, out_st, t64, D.as_bits(round_to(out, tl.bfloat16, PTX), 16), cols,
               cmask)  # fmt: skip


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
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + gain_center
    n_rows = M * K
    # The first row's token routing (index map, weights) is read before the grid-dependency
    # wait, as moe_finalize and the MoE-finalize fusion do (routing is complete long before the GEMM
    # that precedes this op): at decode neither the row load nor the fold waits for a routing
    # round trip. The row itself (GEMM2's output) and the control words come after the wait.
    t0 = (pid // K).to(tl.int64)
    p0, valid0 = _route(idx_ptr, idx_st, t0, pid % K, R)
    valids0, weights0 = _token_routes(idx_ptr, idx_st, w_ptr, w_st, t0, R, K)
    dists = D.table_dists(table_ptr, P)  # constant workspace metadata, as the routing
    if USE_PDL:
        gdc_wait()
    x0 = tl.load(rows_ptr + p0 * row_st + cols, mask=cmask & valid0 & (pid < n_rows), other=0.0)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, n_rows, pid, G, cap, P, PTX,
        dists)  # fmt: skip
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
            for q in tl.static_range(P):
                if q != rank:
                    _push_slot(x, q, r % K, t64, region, rank, table_ptr, rows_off16, cols,
                               cmask, H, K, P, dists)  # fmt: skip
        i += 1
    mine16 = D.peer_base(table_ptr, rank, rows_off16, 16, dists)
    xdec = D.peer_base(table_ptr, rank, x_off16, 16, dists)
    rdec = D.peer_base(table_ptr, rank, r_off16, 32, dists)
    cnt = D.peer_base(table_ptr, rank, cnt_off16, 32, dists)
    empty16 = D.empty_row(BLOCK_H, 16)
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
            acc, missing = _slot_sum(own, k, t64, region, mine16, rank, cols, cmask, H, deadline,
                                     clock_ptr, empty16, K, P, False, PTX)  # fmt: skip
            xb = round_to(acc, tl.bfloat16, PTX)
            rstd = _norm_rstd(widen_f32(xb, PTX), g, cmask, Hf, eps, WBN)
            tl.store(xdec + (t64 * K + k) * H + cols, D.as_bits(xb, 16), mask=cmask)
            tl.store(rdec + t64 * K + k, D.as_bits(rstd, 32))
        last, fold, seen = _arrive_token(cnt + t64, missing, K)
        completed = completed | last
        if SPLIT_FOLD:  # one row per CTA (M * K <= grid): the token's K CTAs fold a slice each
            c = _await_token(cnt + t64, seen, deadline, clock_ptr, K, PTX)
            if (c >> 16) == 0:
                _fold_slices(xdec, rdec, nw_ptr, gain_center, out_ptr, out_st, t64, k, valids0,
                             weights0, H, K, KP, B, WBN, BLOCK_H, PTX)  # fmt: skip
        elif fold:
            _fold_token(xdec, rdec, g, out_ptr, out_st, idx_ptr, idx_st, w_ptr, w_st, t64, t0,
                        valids0, weights0, cols, cmask, H, R, K, B, WBN, PTX)  # fmt: skip
        i += 1
    # One token (decode): every CTA has a row of it (G <= K rows), so the CTA that completes the
    # token's count is the last to have read the control words: it alone advances the
    # generation, without the launch-wide arrival atomic. Otherwise every CTA arrives.
    one_token = M == 1
    D.oneshot_finish(ctrl_ptr, table_ptr, rank, gen, missing, ctrl_ptr, M, M, 0, pid, G, P, 0,
                    0, 16, USE_PDL, PTX, completed | (M != 1),
                    tl.where(one_token, 1, 0))  # fmt: skip


# ----------------------------------------------------------------------------- TP token owner
@triton.jit(do_not_specialize=["M", "R", "rank"])
def _tp_token_owner_kernel(
    rows_ptr, w_ptr, idx_ptr, nw_ptr, out_ptr, row_st, w_st, idx_st, out_st,
    table_ptr, rows_off16, res_off16, ctrl_ptr, clock_ptr,
    M, R, H, Hf, rank, cap, eps, gain_center, timeout_us,
    P: tl.constexpr, K: tl.constexpr, B: tl.constexpr, NG: tl.constexpr,
    BLOCK_H: tl.constexpr, WBN: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    pid, G, cols, cmask, g = _prologue(nw_ptr, gain_center, H, BLOCK_H, USE_PDL)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, pid, G, cap, P, PTX)  # fmt: skip
    # phase 1: push every valid slot row of tokens owned by other ranks to their owner
    _push_foreign_tokens(rows_ptr, row_st, idx_ptr, idx_st, pid, G, n_mine, R, region, rank,
                         table_ptr, rows_off16, cols, cmask, H, K, P)  # fmt: skip
    # phase 2: owned tokens: whole token here, output row pushed to every peer
    mine16 = D.peer_base(table_ptr, rank, rows_off16, 16)
    empty16 = D.empty_row(BLOCK_H, 16)
    missing = 0
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t % P == rank:
            t64 = t.to(tl.int64)
            out, miss = _owned_token(rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st, t64, region,
                                     mine16, rank, g, cols, cmask, H, Hf, R, eps, deadline,
                                     clock_ptr, empty16, 0, NG, K, B, NG, P, WBN, False,
                                     PTX)  # fmt: skip
            missing = missing | miss
            o = D.scrub(D.as_bits(round_to(out, tl.bfloat16, PTX), 16), 16)
            _store_out(out_ptr, out_st, t64, o, cols, cmask)
            for q in tl.static_range(P):
                if q != rank:
                    dst = D.peer_base(table_ptr, q, res_off16, 16) + (region + t64) * H
                    tl.store(dst + cols, o, mask=cmask)
        i += 1
    # phase 3: copy the rows owned by other ranks
    mine_res = D.peer_base(table_ptr, rank, res_off16, 16)
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t % P != rank:
            t64 = t.to(tl.int64)
            ptr = mine_res + (region + t64) * H + cols
            bits, pending = D.poll_row(ptr, cmask, deadline, clock_ptr, 16, PTX)
            tl.store(ptr, empty16, mask=cmask)
            missing = missing | tl.where(pending != 0, 1 << (t % P), 0)
            _store_out(out_ptr, out_st, t64, bits, cols, cmask)
        i += 1
    D.oneshot_finish(ctrl_ptr, table_ptr, rank, gen, missing, ctrl_ptr, M, M, 0, pid, G, P, 0,
                    0, 16, USE_PDL, PTX)  # fmt: skip


# ----------------------------------------------------------------------------- TP staged
@triton.jit(do_not_specialize=["M", "R", "rank"])
def _tp_staged_kernel(
    rows_ptr, w_ptr, idx_ptr, nw_ptr, out_ptr, strides,
    table_ptr, flags_off16, stage_off16, gather_off16, ctrl_ptr, clock_ptr,
    M, R, H, Hf, rank, eps, gain_center, timeout_us,
    P: tl.constexpr, PP: tl.constexpr, NSLOT: tl.constexpr, K: tl.constexpr, B: tl.constexpr,
    NG: tl.constexpr, BLOCK_H: tl.constexpr, WBN: tl.constexpr, USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):  # fmt: skip
    """Token owner with push + flags instead of Lamport slots (larger M): single-buffered
    staging ``[t, k, sender]`` and gather ``[t]`` regions, two flag barriers per CTA (phase,
    CTA, sender; device-resident epoch), as ``comm.triton._twoshot_kernel``. Safe single
    buffering: a peer writes call e+1 only after this rank's CTA signalled it consumed call e.
    ``strides`` = (row_st, w_st, idx_st, out_st)."""
    row_st, w_st, idx_st, out_st = strides
    pid, G, cols, cmask, g = _prologue(nw_ptr, gain_center, H, BLOCK_H, USE_PDL)
    deadline = D.wait_bound(clock_ptr, timeout_us, table_ptr, rank, PTX)
    epoch = tl.load(ctrl_ptr + D.CTRL_EPOCH)
    healthy = D.healthy(ctrl_ptr, table_ptr, rank, P, PTX)
    n_mine = tl.where(healthy, (M - pid + G - 1) // G, 0)
    # phase 1: stage every valid slot row of tokens owned by other ranks at their owner
    _push_foreign_tokens(rows_ptr, row_st, idx_ptr, idx_st, pid, G, n_mine, R, 0, rank,
                         table_ptr, stage_off16, cols, cmask, H, K, P)  # fmt: skip
    missing = 0
    if healthy:
        D.signal_peers(table_ptr, flags_off16, pid, rank, epoch, P, PP)
        missing = D.wait_peers(table_ptr, flags_off16, pid, rank, epoch, deadline, clock_ptr, P,
                               PP, PTX)  # fmt: skip
    # phase 2: owned tokens from the staged rows; output row pushed into every peer's gather
    stage = D.peer_base(table_ptr, rank, stage_off16, 16)
    empty16 = D.empty_row(BLOCK_H, 16)
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t % P == rank:
            t64 = t.to(tl.int64)
            out, miss = _owned_token(rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st, t64, 0,
                                     stage, rank, g, cols, cmask, H, Hf, R, eps, deadline,
                                     clock_ptr, empty16, 0, NG, K, B, NG, P, WBN, True,
                                     PTX)  # fmt: skip
            o = D.scrub(D.as_bits(round_to(out, tl.bfloat16, PTX), 16), 16)
            _store_out(out_ptr, out_st, t64, o, cols, cmask)
            for q in tl.static_range(P):
                if q != rank:
                    dst = D.peer_base(table_ptr, q, gather_off16, 16) + t64 * H
                    tl.store(dst + cols, o, mask=cmask)
        i += 1
    if healthy & (missing == 0):
        D.signal_peers(table_ptr, flags_off16, NSLOT + pid, rank, epoch, P, PP)
        missing = D.wait_peers(table_ptr, flags_off16, NSLOT + pid, rank, epoch, deadline,
                               clock_ptr, P, PP, PTX)  # fmt: skip
    # phase 3: copy the rows owned by other ranks from the local gather region
    gathered = D.peer_base(table_ptr, rank, gather_off16, 16)
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t % P != rank:
            t64 = t.to(tl.int64)
            bits = tl.load(gathered + t64 * H + cols, mask=cmask, other=0, cache_modifier=".cg")
            _store_out(out_ptr, out_st, t64, bits, cols, cmask)
        i += 1
    last = D.finish(ctrl_ptr, table_ptr, rank, D.CTRL_ARRIVE_2S, missing, ctrl_ptr, M, M, 0, pid, G,
                   P, 0, 0, 16, USE_PDL, PTX)  # fmt: skip
    if last:
        tl.store(ctrl_ptr + D.CTRL_ARRIVE_2S, 0)
        tl.store(ctrl_ptr + D.CTRL_EPOCH, epoch % D.EPOCH_WRAP + 1)


# ----------------------------------------------------------------------------- TP gathered
@triton.jit(do_not_specialize=["M", "R"])
def _tp_gathered_kernel(
    g_ptr, w_ptr, idx_ptr, nw_ptr, out_ptr, w_st, idx_st, out_st,
    M, R, H, Hf, eps, gain_center,
    P: tl.constexpr, K: tl.constexpr, B: tl.constexpr, NG: tl.constexpr,
    BLOCK_H: tl.constexpr, WBN: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """``g_ptr``: every rank's rows, contiguous ``[P, R, H]``."""
    pid, G, cols, cmask, g = _prologue(nw_ptr, gain_center, H, BLOCK_H, USE_PDL)
    t = pid
    while t < M:
        t64 = t.to(tl.int64)
        out = tl.zeros([BLOCK_H], tl.float32)
        gsum = tl.zeros([BLOCK_H], tl.float32)
        for k in tl.static_range(K):
            if k > 0:
                if k % B == 0:
                    out = out + gsum
                    gsum = tl.zeros([BLOCK_H], tl.float32)
            p, valid = _route(idx_ptr, idx_st, t64, k, R)
            if valid:
                acc = tl.zeros([BLOCK_H], tl.float32)
                for q in tl.static_range(P):
                    v = _load_row(g_ptr + (q * R).to(tl.int64) * H, H, p, cols, cmask)
                    acc = acc + widen_f32(v, PTX)
                y = _slot_y(acc, g, cmask, Hf, eps, WBN, PTX)
                gsum = tl.fma(y, _weight(w_ptr, w_st, t64, k), gsum)
        out = out + gsum
        _store_out(out_ptr, out_st, t64, D.as_bits(round_to(out, tl.bfloat16, PTX), 16), cols,
                   cmask)  # fmt: skip
        t += G


# ----------------------------------------------------------------------------- launchers
def _common(h: int, use_pdl: bool) -> tuple[dict, int]:
    tile = comm_tile(h, 1)
    kw = dict(BLOCK_H=tile.block, USE_PDL=bool(use_pdl), PTX=not interpreter_active(),
              num_warps=tile.num_warps)  # fmt: skip
    if use_pdl:
        kw["launch_pdl"] = True
    return kw, tile.num_warps


def launch_tp_moe_finalize_rmsnorm(xws, algorithm: str, rows, weights, idx, norm_weight, out, *,
                                   eps: float, gain_center: float, weight_before_norm: bool,
                                   use_pdl: bool = False, gathered=None) -> None:  # fmt: skip
    """Run tp_moe_finalize_rmsnorm on ``xws``
    (:class:`moefuse.comm.expert_norm.api.ExpertNormWorkspace`) with
    ``algorithm`` in "slot_oneshot" | "expert_owner" | "token_owner" | "staged" | "torch"
    (``gathered`` [P, R, H]).

    Peer algorithms run in chunks of at most ``xws.capacity`` tokens (one launch each; a
    token's math does not depend on its chunk). Nothing is validated here."""
    m, k = idx.shape
    if m == 0:
        return
    ws = xws.ar
    h = norm_weight.shape[0]
    p = ws.world_size
    block = xws.group_size
    ng = -(-k // block)
    common, warps = _common(h, use_pdl)
    consts = dict(K=k, B=block, NG=ng, WBN=bool(weight_before_norm), **common)
    r = rows.shape[0]
    if algorithm == "torch":
        grid = (max(1, min(m, ws.max_ctas(warps))),)
        launch(_tp_gathered_kernel, grid,
            gathered, weights, idx, norm_weight, out, weights.stride(0), idx.stride(0),
            out.stride(0), m, r, h, float(h), float(eps), float(gain_center), P=p, **consts,
        )  # fmt: skip
        return
    if algorithm == "staged":
        for c0 in range(0, m, xws.capacity):
            mc = min(xws.capacity, m - c0)
            ws.refresh_clock()
            grid = (max(1, min(mc, ws.num_sms, ws.num_flag_slots)),)
            launch(_tp_staged_kernel, grid,
                rows, weights[c0:], idx[c0:], norm_weight, out[c0:], (rows.stride(0),
                weights.stride(0), idx.stride(0), out.stride(0)),
                ws.table, ws.offset16("flags"), ws.offset16("xn_stage"),
                ws.offset16("xn_gather"), ws.ctrl, ws.clock, mc, r, h, float(h), ws.rank,
                float(eps), float(gain_center), ws.timeout_us, P=p,
                PP=triton.next_power_of_2(p), NSLOT=ws.num_flag_slots, **consts,
            )  # fmt: skip
        return
    if algorithm == "slot_oneshot":
        _launch_slot_oneshot(xws, rows, weights, idx, norm_weight, out, eps, gain_center, p,
                             consts)  # fmt: skip
        return
    if algorithm == "expert_owner":
        kernel, res_off = _tp_expert_owner_kernel, ws.offset16("xn_gsum")
    elif algorithm == "token_owner":
        kernel, res_off = _tp_token_owner_kernel, ws.offset16("xn_out")
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
    cap = xws.capacity
    for c0 in range(0, m, cap):
        mc = min(cap, m - c0)
        ws.refresh_clock()
        # one CTA per SM: ~170 registers per thread (ptxas, sm_90a, H = 4096, K = 8) leave room
        # for one 8-warp CTA, and a CTA's peer (same index on every rank) must be resident
        grid = (max(1, min(mc, ws.num_sms)),)
        launch(kernel, grid,
            rows, weights[c0:], idx[c0:], norm_weight, out[c0:], rows.stride(0),
            weights.stride(0), idx.stride(0), out.stride(0),
            ws.table, ws.offset16("xn_rows"), res_off, ws.ctrl, ws.clock,
            mc, r, h, float(h), ws.rank, cap, float(eps), float(gain_center), ws.timeout_us,
            P=p, **consts,
        )  # fmt: skip


def _launch_slot_oneshot(xws, rows, weights, idx, norm_weight, out, eps, gain_center, p,
                         consts) -> None:  # fmt: skip
    """Algorithm "slot_oneshot": chunks of ``xws.slot_capacity`` tokens (the local ``xn_xdec``
    rows); one CTA per (token, slot) row up to one CTA per SM (CTA j waits on CTA j of the peers,
    which must be resident; the interpreter runs CTAs one after another, 2 "SMs" on the CPU)."""
    ws = xws.ar
    m, k = idx.shape
    r = rows.shape[0]
    h = norm_weight.shape[0]
    for c0 in range(0, m, xws.slot_capacity):
        mc = min(xws.slot_capacity, m - c0)
        ws.refresh_clock()
        grid = (max(1, min(mc * k, ws.num_sms)),)
        split = split_fold(mc * k, grid[0])  # (the same on every rank: M, K, SMs, environment)
        launch(_tp_slot_oneshot_kernel, grid,
            rows, weights[c0:], idx[c0:], norm_weight, out[c0:], (rows.stride(0),
            weights.stride(0), idx.stride(0), out.stride(0)),
            (ws.table, ws.offset16("xn_rows"), ws.offset16("xn_xdec"), ws.offset16("xn_rdec"),
             ws.offset16("xn_cnt"), ws.ctrl, ws.clock),
            mc, r, h, float(h), ws.rank, xws.capacity, float(eps), float(gain_center),
            ws.timeout_us, P=p, SPLIT_FOLD=split,
            KP=triton.next_power_of_2(k), **consts,
        )  # fmt: skip


SPLIT_FOLD_ENV = "MOEFUSE_TP_SPLIT_FOLD"


def split_fold(n_rows: int, grid: int) -> bool:
    """Whether slot_oneshot's CTAs fold their token together (each a column slice, after
    waiting for the token's K rows: :func:`_await_token`) instead of the last CTA folding the
    whole row: only when every CTA has one row (``n_rows <= grid``: a token's K CTAs are all
    resident) and on the GPU (the interpreter runs CTAs one after another, so a CTA cannot wait
    for a later one); ``MOEFUSE_TP_SPLIT_FOLD=0`` (the same on every rank) turns it off.

    MEASURED on one H200 as two loopback ranks (PDL on, 4 alternating rounds,
    notes/comm-expert-norm.md "Split fold"), µs one folding CTA -> split fold, K = 8: H = 4096
    M = 1 6.97-9.43 -> 5.35-5.58, M = 8 7.51-8.43 -> 6.83-7.04; H = 7168 M = 1 8.90-9.26 ->
    6.99-7.40, M = 8 9.80-10.13 -> 9.74-9.89. The hop it shortens (one CTA reading the K
    normalized rows, 64 KiB at H = 4096, from L2) is local on 2 x H200 as well."""
    return knobs.get(SPLIT_FOLD_ENV) and n_rows <= grid and not interpreter_active()
