"""One-shot kernels of the MoE-reduction family (:mod:`moefuse.comm.moe_reduction.kernels` picks
and launches them): Lamport, same slots, generations and control words as the all-reduce
``_oneshot_kernel`` (the workspace is shared with the all-reduce fusions).

* ``_moe_oneshot_kernel`` — iteration i produces and pushes row i, then polls row i - 1 (its own
  partial kept in registers), sums ranks in ascending order and runs the shared epilogue.
* ``_moe_split_kernel`` — a column-split producer (decode): C CTAs per row each produce and push
  1/C of the row (into the peers' Lamport slots and a local Lamport row), the row's last CTA
  polls every rank's whole row and runs the epilogue.

Arguments are grouped as the producer's device functions take them
(:mod:`moefuse.comm.moe_reduction.producer`): ``src`` / ``src_sts`` the producer's pointers and
strides, ``PROD`` its constexprs, ``norm`` / ``outs`` / ``EPI`` the epilogue's.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import widen_f32
from moefuse.comm import device as D
from moefuse.comm.moe_reduction.producer import (
    _finish_row,
    _first_loads,
    _partial_from_first,
    _partial_row,
    _rank_step,
    _slot_meta,
)


@triton.jit
def _receive_rows(
    x,
    t64,
    lam,
    rank,
    cols,
    cmask,
    H,
    wait,
    T: tl.constexpr,
    RECV,
    own_ptr=None,
    OWN_SLOT: tl.constexpr = False,
):
    """Rank-order sum of row ``t64`` (this rank's ``x`` in its place, peers polled from their
    Lamport slots, each slot re-armed once consumed). ``lam`` = (this rank's Lamport base, region
    of this generation), ``wait`` = (deadline, clock_ptr, empty row), constexprs ``RECV`` = (P,
    BITS, STEPWISE, PTX). Returns (sum, mask of late peers).

    OWN_SLOT (column-split kernel): this rank's partial is not in registers but polled, like a
    peer's, from its local Lamport row ``own_ptr`` (``x`` unused); a late local row sets bit
    ``rank``. The scrubbed -0.0 of that row cannot change the sum (the running sum starts at +0
    and is never -0: ``a + (-0) == a + (+0)`` for every other ``a``)."""
    mine, region = lam
    deadline, clock_ptr, empty = wait
    P, BITS, STEPWISE, PTX = RECV
    acc = tl.zeros(cols.shape, tl.float32)
    missing = 0
    for q in tl.static_range(P):
        if q == rank:
            if OWN_SLOT:
                bits, pending = D.poll_row(own_ptr + cols, cmask, deadline, clock_ptr, BITS, PTX)
                tl.store(own_ptr + cols, empty, mask=cmask)
                missing = missing | tl.where(pending != 0, 1 << q, 0)
                v = widen_f32(bits.to(T, bitcast=True), PTX)
            else:
                v = x
        else:
            slot = q - (q > rank).to(tl.int32)
            ptr = mine + ((region + t64) * (P - 1) + slot) * H + cols
            bits, pending = D.poll_row(ptr, cmask, deadline, clock_ptr, BITS, PTX)
            tl.store(ptr, empty, mask=cmask)
            missing = missing | tl.where(pending != 0, 1 << q, 0)
            v = widen_f32(bits.to(T, bitcast=True), PTX)
        acc = _rank_step(acc, v, T, STEPWISE, PTX)
    return acc, missing


@triton.jit
def _finish_oneshot(
    ctrl_ptr,
    table_ptr,
    rank,
    gen,
    missing,
    sf_ptr,
    rows,
    n_kcols,
    pid,
    G,
    P: tl.constexpr,
    FIN,
    arrive=True,
    n_arrive=0,
):
    """:func:`moefuse.comm.device.oneshot_finish` with the kernels' grouped arguments: ``rows``
    = (M, M_pad), constexprs ``FIN`` = (PATTERN, LAYOUT, KP_BLOCK, USE_PDL, PTX)."""
    M, M_pad = rows
    PATTERN, LAYOUT, KP_BLOCK, USE_PDL, PTX = FIN
    D.oneshot_finish(
        ctrl_ptr,
        table_ptr,
        rank,
        gen,
        missing,
        sf_ptr,
        M,
        M_pad,
        n_kcols,
        pid,
        G,
        P,
        PATTERN,
        LAYOUT,
        KP_BLOCK,
        USE_PDL,
        PTX,
        arrive,
        n_arrive,
    )


@triton.jit(do_not_specialize=["rows", "rank", "counts"])
def _moe_oneshot_kernel(
    ptrs, strides, ws, rows, H, Hf, rank, cap, n_kcols, counts, scal, timeout_us,
    P: tl.constexpr, BLOCK_H: tl.constexpr, BITS: tl.constexpr, PATTERN: tl.constexpr,
    LAYOUT: tl.constexpr, KP_BLOCK: tl.constexpr, K: tl.constexpr, KB: tl.constexpr,
    DENSE: tl.constexpr, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RSF: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    STEPWISE: tl.constexpr, WRITE_AR: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """Fused one-shot: produce, push and finish one row per iteration. ``ptrs``: the producer's
    pointers (``producer_args``), then residual, gain and outputs; ``strides``: the producer's
    then the outputs' row strides; ``ws`` = (table_ptr, lam_off16, ctrl_ptr, clock_ptr);
    ``rows`` = (M, M_pad), ``counts`` = (n_rows, n_experts) (both not specialised); ``scal`` =
    (eps, weight_bias, rsf)."""
    (src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr, res_ptr, gw_ptr, arout_ptr, rout_ptr,
     nout_ptr, q_ptr, sf_ptr, scale_ptr) = ptrs  # fmt: skip
    (src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st, res_st, arout_st, rout_st,
     nout_st, q_st) = strides  # fmt: skip
    table_ptr, lam_off16, ctrl_ptr, clock_ptr = ws
    M, M_pad = rows
    n_rows, n_experts = counts
    eps, weight_bias, rsf = scal
    T: tl.constexpr = res_ptr.dtype.element_ty
    src = (src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr)
    src_sts = (src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st)
    outs = (arout_ptr, arout_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr)
    PROD: tl.constexpr = (K, KB, DENSE, HAS_W, HAS_BIAS, HAS_RSF, HAS_SHARED, STEPWISE, PTX)
    EPI: tl.constexpr = (BLOCK_H, PATTERN, LAYOUT, WRITE_AR, PTX)
    norm = (H, Hf, eps, n_kcols)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = D.load_gain(gw_ptr, cols, cmask, weight_bias, PATTERN)
    # Row pid (grid <= M: always a real token). Its routing data (index map, weights, expert
    # ids) is read before the grid-dependency wait: routing is complete long before the GEMM
    # that precedes the fusion (as in moefuse.moe.triton), so at decode that round trip overlaps
    # the previous kernel. After the wait, the state words and the residual are requested
    # together with the expert rows, so a one-row CTA pays one memory round trip before its push.
    meta0 = _slot_meta(pid, src, src_sts, counts, PROD)
    dists = D.table_dists(table_ptr, P)  # constant workspace metadata: before the wait
    if USE_PDL:
        gdc_wait()
    # the first row's expert rows, shared row and residual are requested before the state words:
    # their CTA-wide reduction is a barrier that no later load passes, so a decode CTA waits for
    # one memory round trip before its push, not two
    first0 = _first_loads(meta0, pid, cols, cmask, sh_ptr, sh_st, KB, HAS_BIAS, HAS_SHARED, PTX)
    # rows carried across iterations stay in T (exact: the partials are T-rounded; the residual
    # is T): half the registers of FP32 — at H = 7168 (16 warps, 128 registers) that is what
    # keeps the loop from spilling
    res0 = tl.load(res_ptr + pid.to(tl.int64) * res_st + cols, mask=cmask, other=0.0)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, pid, G, cap, P, PTX, dists
    )
    p0 = _partial_from_first(meta0, first0, cols, cmask, rsf, T, PROD).to(T)
    scales = D.quant_scales(scale_ptr, PATTERN, PTX)
    lam = (D.peer_base(table_ptr, rank, lam_off16, BITS, dists), region)  # this rank's Lamport rows
    wait = (deadline, clock_ptr, D.empty_row(BLOCK_H, BITS))
    RECV: tl.constexpr = (P, BITS, STEPWISE, PTX)
    missing = 0
    if n_mine > 0:
        D.push_vals(p0, pid, cols, cmask, table_ptr, lam_off16, region, rank, H, P, BITS, dists)
        if USE_PDL:
            if n_mine == 1:
                gdc_launch_dependents()
    prev = p0
    # iteration i produces + pushes row i and receives row i - 1 (pushed by the peers one
    # iteration earlier): NVLink traffic of one row overlaps the epilogue of the previous one
    i = 1
    while (i <= n_mine) & (missing == 0):
        cur = prev
        if i < n_mine:
            t = pid + i * G
            cur = _partial_row(t, cols, cmask, src, src_sts, counts, rsf, T, PROD).to(T)
            D.push_vals(cur, t, cols, cmask, table_ptr, lam_off16, region, rank, H, P, BITS, dists)
        t64 = (pid + (i - 1) * G).to(tl.int64)
        if i == 1:
            res = widen_f32(res0, PTX)
        else:
            res = widen_f32(tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0), PTX)
        x = widen_f32(prev, PTX)
        s, miss = _receive_rows(x, t64, lam, rank, cols, cmask, H, wait, T, RECV)
        missing = missing | miss
        _finish_row(s, res, t64, cols, cmask, g, norm, scales, outs, T, EPI)
        prev = cur
        i += 1
    FIN: tl.constexpr = (PATTERN, LAYOUT, KP_BLOCK, USE_PDL, PTX)
    _finish_oneshot(ctrl_ptr, table_ptr, rank, gen, missing, sf_ptr, rows, n_kcols, pid, G, P, FIN)


# ----------------------------------------------------------------------------- one-shot, split
@triton.jit
def _push_own(x, t, wcols, wmask, table_ptr, own_off16, rank, H, BITS: tl.constexpr, dists=None):
    """Store columns ``wcols`` of this rank's partial row ``t`` (``x``, -0.0 scrubbed) into the
    local Lamport row ``t`` of region ``own_off16``, where the row's epilogue CTA polls it."""
    bits = D.scrub(D.as_bits(x, BITS), BITS)
    dst = D.peer_base(table_ptr, rank, own_off16, BITS, dists) + t.to(tl.int64) * H + wcols
    tl.store(dst, bits, mask=wmask)


@triton.jit(do_not_specialize=["rows", "rank", "counts"])
def _moe_split_kernel(
    ptrs, strides, ws, rows, H, Hf, rank, cap, n_kcols, counts, scal, timeout_us,
    P: tl.constexpr, BLOCK_H: tl.constexpr, BITS: tl.constexpr, PATTERN: tl.constexpr,
    LAYOUT: tl.constexpr, KP_BLOCK: tl.constexpr, K: tl.constexpr, KB: tl.constexpr,
    DENSE: tl.constexpr, HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RSF: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    STEPWISE: tl.constexpr, WRITE_AR: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
    C: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    """One-shot with a column-split producer (decode): C CTAs per row group. CTA ``c`` of group
    ``grp`` produces columns ``[c * BLOCK_W, (c + 1) * BLOCK_W)`` of this rank's partial of rows
    ``grp, grp + R, ...`` (R = grid / C groups; same producer function, elementwise in columns,
    hence the same bits) and pushes that slice into every peer's Lamport slot and into the
    local Lamport row (region ``own_off16``). The group's last CTA (``c == C - 1``) is also the
    epilogue CTA: one iteration behind its own production it polls the whole row of every rank,
    its own included, and runs the shared epilogue over the full row (the same reduction tree as
    ``_moe_oneshot_kernel``). Producers never wait, so the only waits are on the peers' CTAs of
    the same group and on this launch's producers of lower index (Triton's interpreter runs CTAs
    in index order: they have finished). Same slots, generations and control words as the
    other one-shot kernels. Arguments as ``_moe_oneshot_kernel``'s; ``ws`` = (table_ptr,
    lam_off16, own_off16, ctrl_ptr, clock_ptr)."""
    (src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr, res_ptr, gw_ptr, arout_ptr, rout_ptr,
     nout_ptr, q_ptr, sf_ptr, scale_ptr) = ptrs  # fmt: skip
    (src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st, res_st, arout_st, rout_st,
     nout_st, q_st) = strides  # fmt: skip
    table_ptr, lam_off16, own_off16, ctrl_ptr, clock_ptr = ws
    M, M_pad = rows
    n_rows, n_experts = counts
    eps, weight_bias, rsf = scal
    T: tl.constexpr = res_ptr.dtype.element_ty
    src = (src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr)
    src_sts = (src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st)
    outs = (arout_ptr, arout_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr)
    PROD: tl.constexpr = (K, KB, DENSE, HAS_W, HAS_BIAS, HAS_RSF, HAS_SHARED, STEPWISE, PTX)
    EPI: tl.constexpr = (BLOCK_H, PATTERN, LAYOUT, WRITE_AR, PTX)
    norm = (H, Hf, eps, n_kcols)
    pid = tl.program_id(0)
    R = tl.num_programs(0) // C
    grp = pid // C
    c = pid % C
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    wcols = c * BLOCK_W + tl.arange(0, BLOCK_W)
    wmask = wcols < H
    epi = c == C - 1
    g = D.load_gain(gw_ptr, cols, cmask, weight_bias, PATTERN)
    meta0 = _slot_meta(grp, src, src_sts, counts, PROD)
    dists = D.table_dists(table_ptr, P)  # constant workspace metadata: before the wait
    if USE_PDL:
        gdc_wait()
    # the first row's slice (and, in the epilogue CTA, its residual) is requested before the
    # state words (their CTA-wide reduction is a barrier no later load passes) and outside the
    # row loop (whose trip count waits for them): one memory round trip before the push, as in
    # _moe_oneshot_kernel
    first0 = _first_loads(meta0, grp, wcols, wmask, sh_ptr, sh_st, KB, HAS_BIAS, HAS_SHARED, PTX)
    res0 = tl.load(res_ptr + grp.to(tl.int64) * res_st + cols, mask=cmask & epi, other=0.0)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, grp, R, cap, P, PTX, dists
    )
    p0 = _partial_from_first(meta0, first0, wcols, wmask, rsf, T, PROD).to(T)
    scales = D.quant_scales(scale_ptr, PATTERN, PTX)
    own = D.peer_base(table_ptr, rank, own_off16, BITS, dists)
    if n_mine > 0:
        D.push_vals(p0, grp, wcols, wmask, table_ptr, lam_off16, region, rank, H, P, BITS, dists)
        _push_own(p0, grp, wcols, wmask, table_ptr, own_off16, rank, H, BITS, dists)
        if USE_PDL:
            if n_mine == 1:
                gdc_launch_dependents()
    lam = (D.peer_base(table_ptr, rank, lam_off16, BITS, dists), region)  # this rank's Lamport rows
    wait = (deadline, clock_ptr, D.empty_row(BLOCK_H, BITS))
    RECV: tl.constexpr = (P, BITS, STEPWISE, PTX)
    missing = 0
    # iteration i produces + pushes slice c of row i; the epilogue CTA then finishes row i - 1
    i = 1
    while (i <= n_mine) & (missing == 0):
        if i < n_mine:
            t = grp + i * R
            p = _partial_row(t, wcols, wmask, src, src_sts, counts, rsf, T, PROD).to(T)
            D.push_vals(p, t, wcols, wmask, table_ptr, lam_off16, region, rank, H, P, BITS, dists)
            _push_own(p, t, wcols, wmask, table_ptr, own_off16, rank, H, BITS, dists)
        if epi:
            t64 = (grp + (i - 1) * R).to(tl.int64)
            if i == 1:
                res = widen_f32(res0, PTX)
            else:
                res = widen_f32(tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0), PTX)
            own_row = own + t64 * H
            s, miss = _receive_rows(
                res, t64, lam, rank, cols, cmask, H, wait, T, RECV, own_row, True
            )
            missing = missing | miss
            _finish_row(s, res, t64, cols, cmask, g, norm, scales, outs, T, EPI)
        i += 1
    # only the R epilogue CTAs arrive: one that finishes has polled its group's own rows, so
    # every producer of the group has read the state words; at R = 1 (decode) no atomic at all
    FIN: tl.constexpr = (PATTERN, LAYOUT, KP_BLOCK, USE_PDL, PTX)
    G = tl.num_programs(0)
    _finish_oneshot(
        ctrl_ptr, table_ptr, rank, gen, missing, sf_ptr, rows, n_kcols, pid, G, P, FIN, epi, R
    )
