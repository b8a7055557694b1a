"""Triton kernels of the MoE-reduction family (the spec's MoE-reduction and MoE-finalize all-reduce
fusions) and their launcher.

Each kernel is an all-reduce kernel of :mod:`moefuse.comm.all_reduce.kernels` with a *producer*
stage in front: instead of loading this rank's partial row from an ``[M, H]`` input, it computes it
from the MoE inputs (:mod:`moefuse.comm.moe_reduction.producer`) — K expert rows gathered through
the index map (finalize) or the E_loc rows ``x[e, t]`` (reduction), weighted, summed in
ascending slot order, scaled, plus the shared-expert / token row. The partial never exists in
HBM on the peer paths:

* ``_moe_oneshot_kernel`` — Lamport, same slots, generations and control words as
  ``_oneshot_kernel`` (the workspace is shared with the all-reduce fusions): iteration i produces
  and pushes row i, then polls row i - 1 (its own partial kept in registers), sums ranks in
  ascending order and runs the shared epilogue (:func:`moefuse.comm.device.epilogue_row`).
* ``_moe_split_kernel`` — the one-shot with a column-split producer (decode; variant "split" of
  :func:`oneshot_variant`): C CTAs per row each produce and push 1/C of the row (into the peers'
  Lamport slots and a local Lamport row), the row's last CTA polls every rank's whole row and
  runs the epilogue.
* ``_moe_twoshot_kernel`` — reduce-scatter + all-gather: phase 1 produces every row and stores it
  into its owner's staging slot ``[rank]`` (the owner's own rows locally), phase 2 sums the staged
  rows in rank order and pushes the sum into every peer's gather buffer (FP32 bits when
  ``accumulate="fp32"``: the sum is rounded only together with the residual), phase 3 finishes the
  other owners' rows.
* ``_moe_partial_kernel`` + ``_moe_gathered_kernel`` — the torch.distributed path: partials
  written to [M, H], all-gathered, summed and finished.

All three produce the same partial (same device function) and the same rank-order sum handed to
the same epilogue, hence the same bits. FMA contraction is off (``enable_fp_fusion=False``): the
spec rounds between the multiply by the routed scaling factor and the shared-expert add; the one
FMA that is wanted (the FP32 finalize chain) is the explicit ``fma.rn.ftz``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse import knobs
from moefuse._device import widen_f32
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active
from moefuse.comm import device as D
from moefuse.comm.moe_reduction.producer import (
    _finish_row,
    _first_loads,
    _partial_from_first,
    _partial_row,
    _rank_step,
    _slot_meta,
)
from moefuse.comm.moe_reduction.workspace import fp32_gather_region
from moefuse.comm.tiles import CommTile, comm_tile

_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


# ----------------------------------------------------------------------------- one-shot
@triton.jit
def _receive_rows(x, t64, mine, region, rank, cols, cmask, H, deadline, clock_ptr, empty,
                  T: tl.constexpr, P: tl.constexpr, BITS: tl.constexpr, STEPWISE: tl.constexpr,
                  PTX: tl.constexpr, own_ptr=None, OWN_SLOT: tl.constexpr = False):  # fmt: skip
    """Rank-order sum of row ``t64`` (this rank's ``x`` in its place, peers polled from their
    Lamport slots, each slot re-armed once consumed). Returns (sum, mask of late peers).

    OWN_SLOT (column-split kernel): this rank's partial is not in registers but polled, like a
    peer's, from its local Lamport row ``own_ptr`` (``x`` unused); a late local row sets bit
    ``rank``. The scrubbed -0.0 of that row cannot change the sum (the running sum starts at +0
    and is never -0: ``a + (-0) == a + (+0)`` for every other ``a``)."""
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
     nout_ptr, q_ptr, sf_ptr, scale_ptr) = ptrs
    (src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st, res_st, arout_st, rout_st,
     nout_st, q_st) = strides
    table_ptr, lam_off16, ctrl_ptr, clock_ptr = ws
    M, M_pad = rows
    n_rows, n_experts = counts
    eps, weight_bias, rsf = scal
    T: tl.constexpr = res_ptr.dtype.element_ty
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
    meta0 = _slot_meta(pid, src_ptr, map_ptr, w_ptr, b_ptr, e_ptr, n_rows, n_experts, src_st,
                       src_kst, map_st, w_tst, w_kst, b_st, e_st, K, DENSE, HAS_W, HAS_BIAS,
                       PTX)  # fmt: skip
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
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, pid, G, cap, P, PTX,
        dists)  # fmt: skip
    p0 = _partial_from_first(meta0, first0, cols, cmask, rsf, T, K, KB, HAS_W, HAS_BIAS,
                             HAS_RSF, HAS_SHARED, STEPWISE, PTX).to(T)  # fmt: skip
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    mine = D.peer_base(table_ptr, rank, lam_off16, BITS, dists)
    empty = D.empty_row(BLOCK_H, BITS)
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
            cur = _partial_row(t, cols, cmask, src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr,
                               n_rows, n_experts, src_st, src_kst, map_st, w_tst, w_kst, sh_st,
                               b_st, e_st, rsf, T, K, KB, DENSE, HAS_W, HAS_BIAS,
                               HAS_RSF, HAS_SHARED, STEPWISE, PTX).to(T)  # fmt: skip
            D.push_vals(cur, t, cols, cmask, table_ptr, lam_off16, region, rank, H, P, BITS,
                       dists)  # fmt: skip
        t64 = (pid + (i - 1) * G).to(tl.int64)
        if i == 1:
            res = widen_f32(res0, PTX)
        else:
            res = widen_f32(tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0), PTX)
        s, miss = _receive_rows(widen_f32(prev, PTX), t64, mine, region, rank, cols, cmask, H,
                                deadline, clock_ptr, empty, T, P, BITS, STEPWISE,
                                PTX)  # fmt: skip
        missing = missing | miss
        _finish_row(s, res, t64, cols, cmask, g, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols,
                    arout_ptr, arout_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st,
                    sf_ptr, T, BLOCK_H, PATTERN, LAYOUT, WRITE_AR, PTX)  # fmt: skip
        prev = cur
        i += 1
    D.oneshot_finish(ctrl_ptr, table_ptr, rank, gen, missing, sf_ptr, M, M_pad, n_kcols, pid, G, P,
                    PATTERN, LAYOUT, KP_BLOCK, USE_PDL, PTX)  # fmt: skip


# ----------------------------------------------------------------------------- one-shot, split
@triton.jit
def _push_own(x, t, wcols, wmask, table_ptr, own_off16, rank, H, BITS: tl.constexpr,
              dists=None):  # fmt: skip
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
     nout_ptr, q_ptr, sf_ptr, scale_ptr) = ptrs
    (src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st, res_st, arout_st, rout_st,
     nout_st, q_st) = strides
    table_ptr, lam_off16, own_off16, ctrl_ptr, clock_ptr = ws
    M, M_pad = rows
    n_rows, n_experts = counts
    eps, weight_bias, rsf = scal
    T: tl.constexpr = res_ptr.dtype.element_ty
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
    meta0 = _slot_meta(grp, src_ptr, map_ptr, w_ptr, b_ptr, e_ptr, n_rows, n_experts, src_st,
                       src_kst, map_st, w_tst, w_kst, b_st, e_st, K, DENSE, HAS_W, HAS_BIAS,
                       PTX)  # fmt: skip
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
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, grp, R, cap, P, PTX,
        dists)  # fmt: skip
    p0 = _partial_from_first(meta0, first0, wcols, wmask, rsf, T, K, KB, HAS_W, HAS_BIAS,
                             HAS_RSF, HAS_SHARED, STEPWISE, PTX).to(T)  # fmt: skip
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    own = D.peer_base(table_ptr, rank, own_off16, BITS, dists)
    if n_mine > 0:
        D.push_vals(p0, grp, wcols, wmask, table_ptr, lam_off16, region, rank, H, P, BITS, dists)
        _push_own(p0, grp, wcols, wmask, table_ptr, own_off16, rank, H, BITS, dists)
        if USE_PDL:
            if n_mine == 1:
                gdc_launch_dependents()
    mine = D.peer_base(table_ptr, rank, lam_off16, BITS, dists)
    empty = D.empty_row(BLOCK_H, BITS)
    missing = 0
    # iteration i produces + pushes slice c of row i; the epilogue CTA then finishes row i - 1
    i = 1
    while (i <= n_mine) & (missing == 0):
        if i < n_mine:
            t = grp + i * R
            p = _partial_row(t, wcols, wmask, src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr,
                             n_rows, n_experts, src_st, src_kst, map_st, w_tst, w_kst, sh_st,
                             b_st, e_st, rsf, T, K, KB, DENSE, HAS_W, HAS_BIAS,
                             HAS_RSF, HAS_SHARED, STEPWISE, PTX).to(T)  # fmt: skip
            D.push_vals(p, t, wcols, wmask, table_ptr, lam_off16, region, rank, H, P, BITS,
                       dists)  # fmt: skip
            _push_own(p, t, wcols, wmask, table_ptr, own_off16, rank, H, BITS, dists)
        if epi:
            t64 = (grp + (i - 1) * R).to(tl.int64)
            if i == 1:
                res = widen_f32(res0, PTX)
            else:
                res = widen_f32(tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0),
                                PTX)  # fmt: skip
            s, miss = _receive_rows(res, t64, mine, region, rank, cols, cmask, H, deadline,
                                    clock_ptr, empty, T, P, BITS, STEPWISE, PTX, own + t64 * H,
                                    True)  # fmt: skip
            missing = missing | miss
            _finish_row(s, res, t64, cols, cmask, g, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols,
                        arout_ptr, arout_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st,
                        sf_ptr, T, BLOCK_H, PATTERN, LAYOUT, WRITE_AR, PTX)  # fmt: skip
        i += 1
    # only the R epilogue CTAs arrive: one that finishes has polled its group's own rows, so
    # every producer of the group has read the state words; at R = 1 (decode) no atomic at all
    D.oneshot_finish(ctrl_ptr, table_ptr, rank, gen, missing, sf_ptr, M, M_pad, n_kcols, pid,
                    tl.num_programs(0), P, PATTERN, LAYOUT, KP_BLOCK, USE_PDL, PTX, epi,
                    R)  # fmt: skip


# ----------------------------------------------------------------------------- two-shot
@triton.jit
def _push_sum(acc, table_ptr, rank, gather_off16, t64, H, cols, cmask, T: tl.constexpr,
              BITS: tl.constexpr, P: tl.constexpr, STEPWISE: tl.constexpr):  # fmt: skip
    """Two-shot phase 2: push an owned row's sum into every peer's gather buffer (stepwise: in
    the activation dtype; else the FP32 sum as int32 bits, into an FP32-sized region)."""
    for q in tl.static_range(P):
        if q != rank:
            if STEPWISE:
                dst = D.peer_base(table_ptr, q, gather_off16, BITS) + t64 * H + cols
                tl.store(dst, D.as_bits(acc.to(T), BITS), mask=cmask)
            else:
                dst = D.peer_base(table_ptr, q, gather_off16, 32) + t64 * H + cols
                tl.store(dst, acc.to(tl.int32, bitcast=True), mask=cmask)


@triton.jit
def _gathered_sum(table_ptr, rank, gather_off16, t64, H, cols, cmask, T: tl.constexpr,
                  BITS: tl.constexpr, STEPWISE: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Two-shot phase 3: row ``t64``'s all-reduced sum from this rank's gather buffer, as FP32
    (stepwise: the activation dtype's bits; else the FP32 sum's bits)."""
    if STEPWISE:
        src = D.peer_base(table_ptr, rank, gather_off16, BITS) + t64 * H + cols
        bits = tl.load(src, mask=cmask, other=0, cache_modifier=".cg")
        s = widen_f32(bits.to(T, bitcast=True), PTX)
    else:
        src = D.peer_base(table_ptr, rank, gather_off16, 32) + t64 * H + cols
        bits = tl.load(src, mask=cmask, other=0, cache_modifier=".cg")
        s = bits.to(tl.float32, bitcast=True)
    return s


@triton.jit(do_not_specialize=["rows", "rank", "counts"])
def _moe_twoshot_kernel(
    ptrs, strides, ws, rows, H, Hf, rank, chunk_cap, n_kcols, counts, scal, timeout_us,
    P: tl.constexpr, PP: tl.constexpr, NSLOT: tl.constexpr, BLOCK_H: tl.constexpr,
    BITS: tl.constexpr, PATTERN: tl.constexpr, LAYOUT: tl.constexpr, KP_BLOCK: tl.constexpr,
    K: tl.constexpr, KB: tl.constexpr, DENSE: tl.constexpr, HAS_W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RSF: tl.constexpr, HAS_SHARED: tl.constexpr, STEPWISE: tl.constexpr, WRITE_AR: tl.constexpr,
    USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """Two-shot: produce and stage at the owners, reduce the owned rows, gather. Arguments as
    ``_moe_oneshot_kernel``'s; ``ws`` = (table_ptr, flags_off16, stage_off16, gather_off16,
    ctrl_ptr, clock_ptr)."""
    (src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr, res_ptr, gw_ptr, arout_ptr, rout_ptr,
     nout_ptr, q_ptr, sf_ptr, scale_ptr) = ptrs
    (src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st, res_st, arout_st, rout_st,
     nout_st, q_st) = strides
    table_ptr, flags_off16, stage_off16, gather_off16, ctrl_ptr, clock_ptr = ws
    M, M_pad = rows
    n_rows, n_experts = counts
    eps, weight_bias, rsf = scal
    T: tl.constexpr = res_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = D.load_gain(gw_ptr, cols, cmask, weight_bias, PATTERN)
    if USE_PDL:
        gdc_wait()
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    deadline = D.wait_bound(clock_ptr, timeout_us, table_ptr, rank, PTX)
    epoch = tl.load(ctrl_ptr + D.CTRL_EPOCH)
    healthy = D.healthy(ctrl_ptr, table_ptr, rank, P, PTX)
    n_mine = tl.where(healthy, (M - pid + G - 1) // G, 0)
    chunk = (M + P - 1) // P

    # phase 1: produce every row of this CTA and stage it at its owner (slot [rank])
    i = 0
    while i < n_mine:
        t = pid + i * G
        o = t // chunk
        p = _partial_row(t, cols, cmask, src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr, n_rows,
                         n_experts, src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st, rsf,
                         T, K, KB, DENSE, HAS_W, HAS_BIAS, HAS_RSF,
                         HAS_SHARED, STEPWISE, PTX)  # fmt: skip
        row = (rank * chunk_cap + (t - o * chunk)).to(tl.int64)
        dst = D.peer_base(table_ptr, o, stage_off16, BITS) + row * H + cols
        tl.store(dst, D.as_bits(p.to(T), BITS), mask=cmask)
        i += 1
    if USE_PDL:
        gdc_launch_dependents()  # every input of the previous kernels but the residual is read
    missing = 0
    if healthy:
        D.signal_peers(table_ptr, flags_off16, pid, rank, epoch, P, PP)
        missing = D.wait_peers(table_ptr, flags_off16, pid, rank, epoch, deadline, clock_ptr,
                               P, PP, PTX)  # fmt: skip

    # phase 2: owned rows: rank-order sum of the staged partials, pushed to every peer, finished
    stage = D.peer_base(table_ptr, rank, stage_off16, BITS)
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t // chunk == rank:
            t64 = t.to(tl.int64)
            acc = tl.zeros([BLOCK_H], tl.float32)
            for q in tl.static_range(P):
                row = (q * chunk_cap + (t - rank * chunk)).to(tl.int64)
                bits = tl.load(stage + row * H + cols, mask=cmask, other=0, cache_modifier=".cg")
                acc = _rank_step(acc, widen_f32(bits.to(T, bitcast=True), PTX), T, STEPWISE, PTX)
            _push_sum(acc, table_ptr, rank, gather_off16, t64, H, cols, cmask, T, BITS, P,
                      STEPWISE)  # fmt: skip
            res = widen_f32(tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0), PTX)
            _finish_row(acc, res, t64, cols, cmask, g, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols,
                        arout_ptr, arout_st, rout_ptr, rout_st, nout_ptr,
                        nout_st, q_ptr, q_st, sf_ptr, T, BLOCK_H, PATTERN, LAYOUT, WRITE_AR,
                        PTX)  # fmt: skip
        i += 1
    if healthy & (missing == 0):
        D.signal_peers(table_ptr, flags_off16, NSLOT + pid, rank, epoch, P, PP)
        missing = D.wait_peers(table_ptr, flags_off16, NSLOT + pid, rank, epoch, deadline,
                               clock_ptr, P, PP, PTX)  # fmt: skip

    # phase 3: rows owned by other ranks, from the local gather buffer
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t // chunk != rank:
            t64 = t.to(tl.int64)
            s = _gathered_sum(table_ptr, rank, gather_off16, t64, H, cols, cmask, T, BITS,
                              STEPWISE, PTX)  # fmt: skip
            res = widen_f32(tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0), PTX)
            _finish_row(s, res, t64, cols, cmask, g, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols,
                        arout_ptr, arout_st, rout_ptr, rout_st, nout_ptr,
                        nout_st, q_ptr, q_st, sf_ptr, T, BLOCK_H, PATTERN, LAYOUT, WRITE_AR,
                        PTX)  # fmt: skip
        i += 1
    last = D.finish(ctrl_ptr, table_ptr, rank, D.CTRL_ARRIVE_2S, missing, sf_ptr, M, M_pad, n_kcols,
                   pid, G, P, PATTERN, LAYOUT, KP_BLOCK, False, PTX)  # fmt: skip
    if last:
        tl.store(ctrl_ptr + D.CTRL_ARRIVE_2S, 0)
        tl.store(ctrl_ptr + D.CTRL_EPOCH, epoch % D.EPOCH_WRAP + 1)


# ----------------------------------------------------------------------------- torch path
@triton.jit(do_not_specialize=["M", "n_rows", "n_experts"])
def _moe_partial_kernel(
    src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr, out_ptr,
    src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st, out_st, M, H, n_rows, n_experts, rsf,
    BLOCK_H: tl.constexpr, K: tl.constexpr, KB: tl.constexpr, DENSE: tl.constexpr,
    HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RSF: tl.constexpr, HAS_SHARED: tl.constexpr,
    STEPWISE: tl.constexpr,
    USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """This rank's partial rows, materialised ([M, H], T) for the all-gather of the torch path."""
    T: tl.constexpr = out_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    if USE_PDL:
        gdc_wait()
    t = pid
    while t < M:
        p = _partial_row(t, cols, cmask, src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr, n_rows,
                         n_experts, src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st, rsf,
                         T, K, KB, DENSE, HAS_W, HAS_BIAS, HAS_RSF,
                         HAS_SHARED, STEPWISE, PTX)  # fmt: skip
        tl.store(out_ptr + t.to(tl.int64) * out_st + cols, p.to(T), mask=cmask)
        t += G
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit(do_not_specialize=["M", "M_pad"])
def _moe_gathered_kernel(
    g_ptr, res_ptr, gw_ptr, arout_ptr, rout_ptr, nout_ptr, q_ptr, sf_ptr, scale_ptr,
    res_st, arout_st, rout_st, nout_st, q_st, M, M_pad, H, Hf, n_kcols, eps, weight_bias,
    P: tl.constexpr, BLOCK_H: tl.constexpr, PATTERN: tl.constexpr, LAYOUT: tl.constexpr,
    KP_BLOCK: tl.constexpr, STEPWISE: tl.constexpr, WRITE_AR: tl.constexpr,
    USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """``g_ptr``: all ranks' partials, contiguous [P, M, H]; rank-order sum + epilogue."""
    T: tl.constexpr = g_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = D.load_gain(gw_ptr, cols, cmask, weight_bias, PATTERN)
    if USE_PDL:
        gdc_wait()
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    t = pid
    while t < M:
        t64 = t.to(tl.int64)
        acc = tl.zeros([BLOCK_H], tl.float32)
        for q in tl.static_range(P):
            v = widen_f32(tl.load(g_ptr + (q * M + t64) * H + cols, mask=cmask, other=0.0), PTX)
            acc = _rank_step(acc, v, T, STEPWISE, PTX)
        res = widen_f32(tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0), PTX)
        _finish_row(acc, res, t64, cols, cmask, g, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols,
                    arout_ptr, arout_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr,
                    q_st, sf_ptr, T, BLOCK_H, PATTERN, LAYOUT, WRITE_AR, PTX)  # fmt: skip
        t += G
    if USE_PDL:
        gdc_launch_dependents()
    if PATTERN == 3:
        D.zero_scale_rows(sf_ptr, M + pid, M_pad, G, n_kcols, LAYOUT, KP_BLOCK)


# ----------------------------------------------------------------------------- launcher
#: tests only: force the producer's rows per batch (must divide K), to cover batching at small H
ROWS_PER_BATCH_OVERRIDE: int | None = None


#: the fused one-shot kernel runs 2 CTAs per SM from this many tokens at widths up to
#: TWO_CTAS_MAX_WIDTH. MEASURED on 2 x H200 (90f68c0:scripts/bench_moe_reduction_variants.py,
#: bench/results/sweeps/moe-reduction-variants-h200-p2.json; P = 2, H = 4096, K = 8, µs 1 vs 2
#: CTAs per SM): M = 64 8.65 vs 8.80, M = 512 35.39 vs 24.61, M = 2048 136.57 vs 84.02 — one
#: CTA loads a token's K rows while the other waits on NVLink, despite the register cap's
#: spills. Wider rows (16 warps at H = 7168: a 64-register cap, 0.4-1.2 KB spilled) MEASURED in
#: 2 x H200 (`bench moe-reduction --hidden 7168`, bench/results/moe-reduction-h200-p2.json, MoE
#: finalize, µs 1 vs 2 CTAs per SM): M = 64 11.53 vs 12.01, 512 44.35 vs 47.05, 2048 160.57 vs
#: 147.97, 16384 1231.61 vs 1093.49 (the unfused chain: 159.53 / 1168.79): 2 from
#: WIDE_TWO_CTAS_MIN_TOKENS. Not for the MoE reduction (dense rows): at 2 CTAs, M = 2048 / 16384,
#: stepwise 174.04 / 1312.92 against 174.94 / 1325.94 at 1, and accumulate="fp32" 173.84 / 1346.84
#: against 155.51 / 1210.22.
TWO_CTAS_MIN_TOKENS = 65
TWO_CTAS_MAX_WIDTH = 4096
WIDE_TWO_CTAS_MIN_TOKENS = 2048
#: the two-shot kernel runs 2 CTAs per SM from this many tokens, at every width and for both
#: ops. MEASURED in loopback only (2 rank threads on one H200, 66 SMs each;
#: notes/comm-moe-reduction.md "Large-M two-shot at 2 CTAs per SM"; K = 8, stepwise, µs at 1 vs
#: 2 CTAs per SM): MoE
#: reduction H = 7168 M = 2048 269-276 vs 226-227, M = 16384 1999-2005 vs 1728; H = 4096 M = 2048
#: 194 vs 146; MoE finalize H = 7168 M = 2048 252 vs 215, M = 16384 1941 vs 1643; H = 4096 M = 2048
#: 194 vs 138 — as for the one-shot, one CTA loads rows while the other waits on its peer. ptxas at
#: 2 CTAs (scripts/compile_check_moe_reduction.py): H = 7168 dense 216 B spilled (32 B at 1), H =
#: 4096 80 B. Not yet timed on 2 GPUs (first on the list of notes/comm-moe-reduction.md).
TWOSHOT_TWO_CTAS_MIN_TOKENS = 2048


def ctas_per_sm(m: int | None = None, h: int | None = None, dense: bool = False,
                algorithm: str = "oneshot") -> int:
    """Co-resident CTAs per SM of the peer kernels (grid cap = SMs x this; the register budget
    of :func:`rows_per_batch` shrinks with it). MOEFUSE_MOE_COMM_CTAS_PER_SM (1, 2 or 4) when
    set; else (``m`` tokens of width ``h`` given; ``dense``: the MoE reduction) 2 where the
    tables above measured it faster — the fused one-shot kernel (``algorithm`` "oneshot") and
    the two-shot kernel ("twoshot") — and 1 (all K rows of a token in flight). Read at every
    launch: it must be the same on every rank."""
    value = knobs.get("MOEFUSE_MOE_COMM_CTAS_PER_SM")
    if value is not None:
        return value
    if m is None or h is None:
        return 1
    if algorithm == "twoshot":
        return 2 if m >= TWOSHOT_TWO_CTAS_MIN_TOKENS else 1
    if h <= TWO_CTAS_MAX_WIDTH:
        return 2 if m >= TWO_CTAS_MIN_TOKENS else 1
    # wider rows: the MoE reduction (dense) measured no faster with 2 (above): it keeps 1
    return 2 if not dense and m >= WIDE_TWO_CTAS_MIN_TOKENS else 1


def rows_per_batch(k: int, tile, ctas: int = 1, bias: bool = False) -> int:
    """Expert rows loaded together by the producer: all K when they fit in registers next to
    the rest of the kernel (~96 registers: ptxas -v of the one-shot kernel, H = 4096, K = 8, used
    238 of 248 with all 8 rows; scripts/compile_check_moe_reduction.py), else fewer. With ``ctas``
    co-resident CTAs per SM a thread may use 65536 / (threads x ctas) registers (at most 255); a
    bias row doubles the registers per slot. Always a divisor of K (no ragged static batch);
    never changes the bits."""
    if ROWS_PER_BATCH_OVERRIDE is not None:
        return ROWS_PER_BATCH_OVERRIDE
    threads = 32 * tile.num_warps
    per_thread = tile.block // threads  # elements of a row per thread
    regs = min(255, 65536 // (threads * ctas))
    budget = max(1, min(k, (regs - 96) // max(1, per_thread * (2 if bias else 1))))
    return max(d for d in range(1, budget + 1) if k % d == 0)  # a divisor of K: no ragged batch


#: one-shot variants (MOEFUSE_MOE_COMM_VARIANT; all give the same bits):
#: "fused" — ``_moe_oneshot_kernel``, one CTA produces, pushes and finishes a row;
#: "split" — ``_moe_split_kernel``, C CTAs per row produce column slices (decode).
#: (A third variant, partial kernel + one-shot all-reduce of the partial, was deleted: it never
#: won, bench/results/sweeps/moe-reduction-variants-h200-p2.json, numbers below.)
ONESHOT_VARIANTS = ("fused", "split")
#: "auto" (the variable unset): (up to M tokens, variant). MEASURED on 2 x H200
#: (90f68c0:scripts/bench_moe_reduction_variants.py,
#: bench/results/sweeps/moe-reduction-variants-h200-p2.json; P = 2, H = 4096, K = 8, stepwise, µs
#: fused / split / two kernels): M = 1 6.49 / 4.90 / 7.25, M = 8 7.48 / 5.31 / 8.18, M = 64 8.65 /
#: 7.58 / 11.39; M = 512 fused at 2 CTAs per SM 24.61 against two kernels 36.26, M = 2048 84.02
#: against 114.99. Two kernels never won.
AUTO_ONESHOT_VARIANTS: tuple[tuple[int | None, str], ...] = ((64, "split"), (None, "fused"))
#: most CTAs per row of the split variant (default); MOEFUSE_MOE_COMM_SPLIT_CTAS overrides.
#: MEASURED (2 x H200, P = 2, H = 4096, K = 8, two runs of
#: 90f68c0:scripts/bench_moe_reduction_variants.py): one token, 16 CTAs 4.70 / 4.34 µs against 8
#: CTAs 5.07 / 4.47; at 8 tokens the two counts traded places (5.52 / 5.49 against 5.40 / 5.58), so
#: 16 only for a single token
SPLIT_MAX_CTAS = 8
SPLIT_MAX_CTAS_ONE_TOKEN = 16


def oneshot_variant(m: int, ws) -> str:
    """The one-shot variant for ``m`` tokens: MOEFUSE_MOE_COMM_VARIANT ("auto" / unset: the
    :data:`AUTO_ONESHOT_VARIANTS` table). "split" needs the workspace's "lamport_own" rows
    (``ws.own_slot_tokens``) and falls back to "fused" above them. Read at every launch: it
    must be the same on every rank (launch plans record it: ``moefuse._fastpath.clear()`` after
    changing it)."""
    name = knobs.get("MOEFUSE_MOE_COMM_VARIANT")
    if name == "auto":
        name = next(v for limit, v in AUTO_ONESHOT_VARIANTS if limit is None or m <= limit)
    if name == "split" and m > getattr(ws, "own_slot_tokens", 0):
        return "fused"
    return name


def split_ctas(m: int, tile, capacity: int) -> int:
    """CTAs per row of the split variant: MOEFUSE_MOE_COMM_SPLIT_CTAS (a power of two that
    divides the tile), else the largest power of two <= SPLIT_MAX_CTAS with at least one warp's
    worth of columns per slice and ``m`` rows x C CTAs <= ``capacity`` (all resident); the
    bound is SPLIT_MAX_CTAS_ONE_TOKEN for a single token."""
    env = knobs.get("MOEFUSE_MOE_COMM_SPLIT_CTAS")
    if env:
        if tile.block % env:
            raise ValueError("MOEFUSE_MOE_COMM_SPLIT_CTAS must be a power of two dividing the "
                             f"row tile ({tile.block}), got {env}")  # fmt: skip
        return env
    most = SPLIT_MAX_CTAS_ONE_TOKEN if m == 1 else SPLIT_MAX_CTAS
    c = max(1, min(most, tile.block // (32 * tile.num_warps), capacity // max(1, m)))
    return 1 << (c.bit_length() - 1)


def _launch_split(ws, tile, k, has_bias, outs, pstrides, ostrides, scalars, tail, producer,
                  consts) -> None:  # fmt: skip
    """``_moe_split_kernel``: R row groups x C CTAs, R = min(M, capacity // C). Every CTA of the
    grid must be resident (a group's epilogue CTA waits on its producers, and on the peers' CTAs
    of the same group): the grid is capped by :func:`ctas_per_sm` CTAs per SM with a matching
    register cap (default 1 CTA per SM, 248 registers: no spill at H = 4096, K = 8, C = 2-16;
    scripts/compile_check_moe_reduction.py)."""
    m = scalars[0][0]
    resident = ctas_per_sm()
    capacity = ws.num_sms * resident
    c = split_ctas(m, tile, capacity)
    if c > capacity and consts["PTX"]:  # (the interpreter runs CTAs one after another)
        raise ValueError(f"MOEFUSE_MOE_COMM_SPLIT_CTAS={c} exceeds the {capacity} co-resident "
                         "CTAs of this GPU: the row's epilogue CTA would wait on CTAs that "
                         "cannot start")  # fmt: skip
    groups = max(1, min(m, capacity // c))
    width = CommTile(block=tile.block // c, num_warps=tile.num_warps, kp_block=1)
    producer = dict(producer, KB=rows_per_batch(k, width, resident, has_bias))
    if consts["PTX"]:
        consts = dict(consts, maxnreg=min(255, 65536 // (32 * tile.num_warps * resident)) // 8 * 8)
    launch(_moe_split_kernel, (groups * c,),
        outs, (*pstrides, *ostrides), (ws.table, ws.offset16("lamport"),
        ws.offset16("lamport_own"), ws.ctrl, ws.clock), *scalars, ws.rank, ws.oneshot_max_tokens,
        *tail, C=c,
        BLOCK_W=tile.block // c, **producer, **consts,
    )  # fmt: skip


def producer_args(dense: bool, src, idx_map, weights, shared, bias=None, expert_ids=None):
    """(pointer tensors, strides, K, (n_rows, n_experts)) of the producer stage."""
    if dense:  # src [E, M, H], weights [E, M] FP32, shared = token input [M, H]
        k = src.shape[0]
        strides = (src.stride(1), src.stride(0), 0, weights.stride(1), weights.stride(0),
                   shared.stride(0), 0, 0)  # fmt: skip
        return (src, src, weights, shared, src, src), strides, k, (0, 0)
    k = idx_map.shape[1]
    w = weights if weights is not None else idx_map
    sh = shared if shared is not None else src
    b = bias if bias is not None else src
    e = expert_ids if expert_ids is not None else idx_map
    strides = (src.stride(0), 0, idx_map.stride(0),
               weights.stride(0) if weights is not None else 0,
               weights.stride(1) if weights is not None else 0,
               shared.stride(0) if shared is not None else 0,
               bias.stride(0) if bias is not None else 0,
               expert_ids.stride(0) if expert_ids is not None else 0)  # fmt: skip
    n_experts = bias.shape[0] if bias is not None else 0
    return (src, idx_map, w, sh, b, e), strides, k, (src.shape[0], n_experts)


def launch_moe_reduction(ws, algorithm: str, pattern: int, *, dense: bool, src, idx_map, weights,
                      shared, rsf: float, bias=None, expert_ids=None, residual, weight,
                      residual_out, norm_out,
                      allreduce_out=None, quant_out=None, scale_out=None, scale=None,
                      layout: int = 0, eps: float = 1e-6, weight_bias: float = 0.0,
                      stepwise: bool = True, use_pdl: bool = False) -> None:  # fmt: skip
    """One MoE fusion on ``ws`` with ``algorithm`` in "oneshot" | "twoshot" | "torch".

    ``pattern``: 1 residual + RMSNorm, 2 + FP8, 3 + NVFP4 (recipe "fast"); ``norm_out`` is always
    written, ``allreduce_out`` when given. Outputs are allocated and validated by the caller."""
    m, h = residual.shape
    if m == 0:
        return
    tile = comm_tile(h, pattern)
    ptx = not interpreter_active()
    (s_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr), pstrides, k, counts = producer_args(
        dense, src, idx_map, weights, shared, bias, expert_ids)
    has_w = dense or weights is not None
    has_shared = dense or shared is not None
    has_rsf = (not dense) and float(rsf) != 1.0
    dummy = residual
    ao = allreduce_out if allreduce_out is not None else dummy
    qo = quant_out.view(torch.uint8) if quant_out is not None else dummy
    so = scale_out.view(torch.uint8) if scale_out is not None else dummy
    sc = scale if scale is not None else dummy
    n_kcols = scale_out.shape[-1] if (pattern == 3 and scale_out.dim() == 2) else 0
    m_pad = scale_out.shape[0] if scale_out is not None else m
    ostrides = (residual.stride(0), ao.stride(0), residual_out.stride(0), norm_out.stride(0),
                qo.stride(0))  # fmt: skip
    fused_peer = algorithm == "twoshot" or (algorithm == "oneshot"
                                            and oneshot_variant(m, ws) == "fused")  # fmt: skip
    ctas = (ctas_per_sm(m, h, bool(dense), algorithm) if fused_peer
            else ctas_per_sm() if algorithm == "oneshot" else 1)  # fmt: skip
    kb = rows_per_batch(k, tile, ctas, bias is not None)
    producer = dict(K=k, KB=kb, DENSE=bool(dense), HAS_W=has_w,
                    HAS_BIAS=bias is not None,
                    HAS_RSF=has_rsf, HAS_SHARED=has_shared, STEPWISE=bool(stepwise))  # fmt: skip
    common = dict(BLOCK_H=tile.block, PATTERN=pattern, LAYOUT=layout, KP_BLOCK=tile.kp_block,
                  WRITE_AR=allreduce_out is not None, USE_PDL=bool(use_pdl), PTX=ptx,
                  num_warps=tile.num_warps, enable_fp_fusion=False)  # fmt: skip
    if use_pdl:
        common["launch_pdl"] = True
    outs = (s_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr, residual, weight, ao, residual_out,
            norm_out, qo, so,
            sc)  # fmt: skip
    rows = (m, max(m_pad, m))
    scalars = (rows, h, float(h))
    if algorithm == "torch":
        from moefuse.comm.fallback import gather_stacked

        part = torch.empty_like(residual)
        grid = (max(1, min(m, ws.max_ctas(tile.num_warps))),)
        launch(_moe_partial_kernel, grid,
            s_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr, part, *pstrides, part.stride(0), m, h,
            *counts,
            float(rsf), BLOCK_H=tile.block, USE_PDL=bool(use_pdl), PTX=ptx,
            num_warps=tile.num_warps, enable_fp_fusion=False,
            **({"launch_pdl": True} if use_pdl else {}), **producer,
        )  # fmt: skip
        gathered = gather_stacked(part, ws)
        launch(_moe_gathered_kernel, grid,
            gathered, residual, weight, ao, residual_out, norm_out, qo, so, sc, *ostrides,
            *rows, h, float(h), n_kcols, float(eps), float(weight_bias), P=ws.world_size,
            STEPWISE=bool(stepwise), **common,
        )  # fmt: skip
        return
    ws.refresh_clock()
    bits = _BITS[residual.dtype]
    if ptx:  # cap registers so that ctas CTAs per SM are resident (CTA j waits on CTA j)
        common["maxnreg"] = min(255, 65536 // (32 * tile.num_warps * ctas)) // 8 * 8
    # peer kernels: ctas_per_sm() CTAs per SM (the register budget of rows_per_batch), so that
    # every CTA of the grid is resident at once: CTA j waits on CTA j of the peers
    if algorithm == "oneshot":
        variant = oneshot_variant(m, ws)
        peer = dict(P=ws.world_size, BITS=bits)
        tail = (n_kcols, counts, (float(eps), float(weight_bias), float(rsf)), ws.timeout_us)
        if variant == "split":
            _launch_split(ws, tile, k, bias is not None, outs, pstrides, ostrides, scalars, tail,
                          producer, dict(common, **peer))  # fmt: skip
            return
        grid = (max(1, min(m, ws.num_sms * ctas)),)
        launch(_moe_oneshot_kernel, grid,
            outs, (*pstrides, *ostrides), (ws.table, ws.offset16("lamport"), ws.ctrl, ws.clock),
            *scalars, ws.rank, ws.oneshot_max_tokens, *tail, **peer, **producer, **common,
        )  # fmt: skip
    elif algorithm == "twoshot":
        grid = (max(1, min(m, ws.num_sms * ctas, ws.num_flag_slots)),)
        launch(_moe_twoshot_kernel, grid,
            outs, (*pstrides, *ostrides), (ws.table, ws.offset16("flags"), ws.offset16("stage"),
            ws.offset16("gather" if stepwise else fp32_gather_region(ws)), ws.ctrl, ws.clock),
            *scalars, ws.rank, ws.chunk_cap, n_kcols,
            counts, (float(eps), float(weight_bias), float(rsf)), ws.timeout_us,
            P=ws.world_size, PP=triton.next_power_of_2(ws.world_size), NSLOT=ws.num_flag_slots,
            BITS=bits, **producer, **common,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
