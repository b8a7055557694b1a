"""Two-shot kernel of the MoE-reduction family (:mod:`moefuse.comm.moe_reduction.kernels`
launches it): reduce-scatter + all-gather. Phase 1 produces every row and stores it into its
owner's staging slot ``[rank]`` (the owner's own rows locally), phase 2 sums the staged rows in
rank order and pushes the sum into every peer's gather buffer (FP32 bits when
``accumulate="fp32"``: the sum is rounded only together with the residual), phase 3 finishes the
other owners' rows. Arguments grouped as in :mod:`moefuse.comm.moe_reduction.oneshot`.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import widen_f32
from moefuse.comm import device as D
from moefuse.comm.moe_reduction.producer import _finish_row, _partial_row, _rank_step


@triton.jit
def _push_sum(
    acc,
    table_ptr,
    rank,
    gather_off16,
    t64,
    H,
    cols,
    cmask,
    T: tl.constexpr,
    BITS: tl.constexpr,
    P: tl.constexpr,
    STEPWISE: tl.constexpr,
):
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
def _gathered_sum(
    table_ptr,
    rank,
    gather_off16,
    t64,
    H,
    cols,
    cmask,
    T: tl.constexpr,
    BITS: tl.constexpr,
    STEPWISE: tl.constexpr,
    PTX: tl.constexpr,
):
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


@triton.jit
def _staged_sum(stage, t, rank, chunk, chunk_cap, H, cols, cmask, T: tl.constexpr, RECV):
    """Two-shot phase 2: rank-order sum of owned row ``t``'s partials staged in this rank's
    ``stage`` rows (constexprs ``RECV`` = (P, BITS, STEPWISE, PTX))."""
    P, BITS, STEPWISE, PTX = RECV
    acc = tl.zeros(cols.shape, tl.float32)
    for q in tl.static_range(P):
        row = (q * chunk_cap + (t - rank * chunk)).to(tl.int64)
        bits = tl.load(stage + row * H + cols, mask=cmask, other=0, cache_modifier=".cg")
        acc = _rank_step(acc, widen_f32(bits.to(T, bitcast=True), PTX), T, STEPWISE, PTX)
    return acc


@triton.jit
def _finish_twoshot(
    ctrl_ptr, table_ptr, rank, epoch, missing, sf_ptr, rows, n_kcols, pid, G, P: tl.constexpr, FIN
):
    """:func:`moefuse.comm.device.finish` on the two-shot's arrival counter (``rows`` = (M,
    M_pad), constexprs ``FIN`` = (PATTERN, LAYOUT, KP_BLOCK, PTX)); the CTA that arrives last
    resets the counter and advances the flag epoch."""
    M, M_pad = rows
    PATTERN, LAYOUT, KP_BLOCK, PTX = FIN
    last = D.finish(
        ctrl_ptr,
        table_ptr,
        rank,
        D.CTRL_ARRIVE_2S,
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
        False,
        PTX,
    )
    if last:
        tl.store(ctrl_ptr + D.CTRL_ARRIVE_2S, 0)
        tl.store(ctrl_ptr + D.CTRL_EPOCH, epoch % D.EPOCH_WRAP + 1)


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
     nout_ptr, q_ptr, sf_ptr, scale_ptr) = ptrs  # fmt: skip
    (src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st, res_st, arout_st, rout_st,
     nout_st, q_st) = strides  # fmt: skip
    table_ptr, flags_off16, stage_off16, gather_off16, ctrl_ptr, clock_ptr = ws
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
    if USE_PDL:
        gdc_wait()
    scales = D.quant_scales(scale_ptr, PATTERN, PTX)
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
        p = _partial_row(t, cols, cmask, src, src_sts, counts, rsf, T, PROD)
        row = (rank * chunk_cap + (t - o * chunk)).to(tl.int64)
        dst = D.peer_base(table_ptr, o, stage_off16, BITS) + row * H + cols
        tl.store(dst, D.as_bits(p.to(T), BITS), mask=cmask)
        i += 1
    if USE_PDL:
        gdc_launch_dependents()  # every input of the previous kernels but the residual is read
    missing = 0
    if healthy:
        D.signal_peers(table_ptr, flags_off16, pid, rank, epoch, P, PP)
        missing = D.wait_peers(
            table_ptr, flags_off16, pid, rank, epoch, deadline, clock_ptr, P, PP, PTX
        )

    # phase 2: owned rows: rank-order sum of the staged partials, pushed to every peer, finished
    stage = D.peer_base(table_ptr, rank, stage_off16, BITS)
    RECV: tl.constexpr = (P, BITS, STEPWISE, PTX)
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t // chunk == rank:
            t64 = t.to(tl.int64)
            acc = _staged_sum(stage, t, rank, chunk, chunk_cap, H, cols, cmask, T, RECV)
            _push_sum(acc, table_ptr, rank, gather_off16, t64, H, cols, cmask, T, BITS, P, STEPWISE)
            res = widen_f32(tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0), PTX)
            _finish_row(acc, res, t64, cols, cmask, g, norm, scales, outs, T, EPI)
        i += 1
    if healthy & (missing == 0):
        D.signal_peers(table_ptr, flags_off16, NSLOT + pid, rank, epoch, P, PP)
        missing = D.wait_peers(
            table_ptr, flags_off16, NSLOT + pid, rank, epoch, deadline, clock_ptr, P, PP, PTX
        )

    # phase 3: rows owned by other ranks, from the local gather buffer
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t // chunk != rank:
            t64 = t.to(tl.int64)
            s = _gathered_sum(
                table_ptr, rank, gather_off16, t64, H, cols, cmask, T, BITS, STEPWISE, PTX
            )
            res = widen_f32(tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0), PTX)
            _finish_row(s, res, t64, cols, cmask, g, norm, scales, outs, T, EPI)
        i += 1
    FIN: tl.constexpr = (PATTERN, LAYOUT, KP_BLOCK, PTX)
    _finish_twoshot(
        ctrl_ptr, table_ptr, rank, epoch, missing, sf_ptr, rows, n_kcols, pid, G, P, FIN
    )
