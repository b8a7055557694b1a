"""The one-shot all-reduce kernels (Lamport slots; launched by
:func:`moefuse.comm.all_reduce.kernels.launch_allreduce_fusion`, whose module describes the
protocol): ``_oneshot_kernel`` reads each input row when it pushes it and again when it reduces
it; ``_oneshot_prefetch_kernel`` pipelines a CTA's rows through registers (each input row read
once). Same slots, generation protocol and bits; the epilogue is
:func:`moefuse.comm.all_reduce.rows._epilogue`.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse.comm import device as D
from moefuse.comm.all_reduce.rows import _epilogue, _receive


@triton.jit
def _push_row(x_ptr, x_st, t, cols, cmask, lam, H, P: tl.constexpr, BITS: tl.constexpr, dists):
    """Load row ``t`` of this rank's input and push it (:func:`moefuse.comm.device.push_vals`);
    ``lam`` = (table_ptr, lam_off16, region, rank): the Lamport slots of this generation."""
    table_ptr, lam_off16, region, rank = lam
    x = tl.load(x_ptr + t.to(tl.int64) * x_st + cols, mask=cmask, other=0.0)
    D.push_vals(x, t, cols, cmask, table_ptr, lam_off16, region, rank, H, P, BITS, dists)


@triton.jit(do_not_specialize=["rows", "rank"])
def _oneshot_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, rout_ptr, nout_ptr, q_ptr, sf_ptr, scale_ptr,
    strides, table_ptr, lam_off16, ctrl_ptr, clock_ptr,
    rows, H, Hf, rank, cap, n_kcols, norm, timeout_us,
    P: tl.constexpr, BLOCK_H: tl.constexpr, BITS: tl.constexpr, PATTERN: tl.constexpr,
    WRITE_NORM: tl.constexpr, LAYOUT: tl.constexpr, KP_BLOCK: tl.constexpr,
    FP32_ACC: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """One-shot all-reduce (+ residual, RMSNorm, FP8 / NVFP4) over the Lamport slots.
    ``strides`` = (x_st, res_st, out_st, rout_st, nout_st, q_st) row strides, ``rows`` =
    (M, M_pad) (not specialised), ``norm`` = (eps, weight_bias)."""
    x_st, res_st, out_st, rout_st, nout_st, q_st = strides
    M, M_pad = rows
    eps, weight_bias = norm
    T: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = D.load_gain(w_ptr, cols, cmask, weight_bias, PATTERN)
    dists = D.table_dists(table_ptr, P)  # constant workspace metadata: before the wait
    if USE_PDL:
        gdc_wait()
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, pid, G, cap, P, PTX, dists
    )

    # The first row's activations stay in registers: a CTA with one row has then read all of the
    # previous kernel's data before it starts waiting, and lets dependents launch (PDL) early.
    # (Masked by pid < M, not by the status word. They still issue after the control words'
    # CTA-wide reduction, a barrier; requesting them before it measured no different on
    # 2 x H200 at M = 1 / 8 / 64 — 3.79 / 4.47 / 5.82 against 3.75 / 4.63 / 5.94 µs —
    # unlike the MoE fusions' expert rows: moefuse.comm.moe_reduction.producer._first_loads.)
    first = cmask & (pid < M)
    x0 = tl.load(x_ptr + pid.to(tl.int64) * x_st + cols, mask=first, other=0.0)
    if PATTERN != 0:
        res0 = tl.load(res_ptr + pid.to(tl.int64) * res_st + cols, mask=first, other=0.0)
        res0 = res0.to(tl.float32)
    else:
        res0 = tl.zeros([BLOCK_H], tl.float32)

    # Iteration i pushes row i and receives row i - 1: the peers pushed row i - 1 one iteration
    # earlier, so NVLink traffic of one row overlaps the local epilogue of the previous one.
    mine = D.peer_base(table_ptr, rank, lam_off16, BITS, dists)
    empty = D.empty_row(BLOCK_H, BITS)
    lam = (table_ptr, lam_off16, region, rank)
    wait = (deadline, clock_ptr, empty)
    epi = (g, cols, cmask, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols)
    outs = (out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr)
    missing = 0
    i = 0
    while (i <= n_mine) & (missing == 0):
        if i < n_mine:
            _push_row(x_ptr, x_st, pid + i * G, cols, cmask, lam, H, P, BITS, dists)
            if USE_PDL:
                if n_mine == 1:
                    gdc_launch_dependents()
        if i > 0:
            t = (pid + (i - 1) * G).to(tl.int64)
            if i == 1:
                x = x0
                res = res0
            else:
                x = tl.load(x_ptr + t * x_st + cols, mask=cmask, other=0.0)
                if PATTERN != 0:
                    res = tl.load(res_ptr + t * res_st + cols, mask=cmask, other=0.0)
                    res = res.to(tl.float32)
                else:
                    res = res0
            s, miss = _receive(x, t, mine, lam, wait, cols, cmask, H, T, P, BITS, FP32_ACC, PTX)
            missing = missing | miss
            _epilogue(s, res, t, epi, outs, T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)
        i += 1
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
    )


# ----------------------------------------------------------------------------- one-shot, prefetch
@triton.jit
def _load_row(x_ptr, res_ptr, x_st, res_st, t, M, cols, cmask, PATTERN: tl.constexpr):
    """Row ``t``'s input and residual in their own dtypes (zeros past M; residual zeros when
    PATTERN 0 has none). Depends on nothing but ``t``: the loads issue at once."""
    m = cmask & (t < M)
    t64 = t.to(tl.int64)
    x = tl.load(x_ptr + t64 * x_st + cols, mask=m, other=0.0)
    if PATTERN != 0:
        r = tl.load(res_ptr + t64 * res_st + cols, mask=m, other=0.0)
    else:
        r = tl.zeros_like(x)
    return x, r


@triton.jit(do_not_specialize=["rows", "rank"])
def _oneshot_prefetch_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, rout_ptr, nout_ptr, q_ptr, sf_ptr, scale_ptr,
    strides, table_ptr, lam_off16, ctrl_ptr, clock_ptr,
    rows, H, Hf, rank, cap, n_kcols, norm, timeout_us,
    P: tl.constexpr, BLOCK_H: tl.constexpr, BITS: tl.constexpr, PATTERN: tl.constexpr,
    WRITE_NORM: tl.constexpr, LAYOUT: tl.constexpr, KP_BLOCK: tl.constexpr,
    FP32_ACC: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """``_oneshot_kernel`` with a software pipeline over this CTA's rows (same slots, same
    generation protocol, same bits). Rows ``a`` (current), ``b`` (next), ``c`` (after next) live
    in registers: iteration i pushes row i+1 (loaded one iteration earlier, so the store never
    waits on a load), issues the loads of row i+2, then polls row i and runs its epilogue from
    the registers (each input row is read from HBM once, not three times). Arguments as
    ``_oneshot_kernel``'s."""
    x_st, res_st, out_st, rout_st, nout_st, q_st = strides
    M, M_pad = rows
    eps, weight_bias = norm
    T: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = D.load_gain(w_ptr, cols, cmask, weight_bias, PATTERN)
    if USE_PDL:
        gdc_wait()
    # rows pid and pid + G: issued with the control-word loads, not behind them
    xa, ra = _load_row(x_ptr, res_ptr, x_st, res_st, pid, M, cols, cmask, PATTERN)
    xb, rb = _load_row(x_ptr, res_ptr, x_st, res_st, pid + G, M, cols, cmask, PATTERN)
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, pid, G, cap, P, PTX
    )
    if n_mine > 0:
        D.push_vals(xa, pid, cols, cmask, table_ptr, lam_off16, region, rank, H, P, BITS)
        if USE_PDL:
            if n_mine == 1:  # every input of the previous kernel is in registers
                gdc_launch_dependents()

    mine = D.peer_base(table_ptr, rank, lam_off16, BITS)
    empty = D.empty_row(BLOCK_H, BITS)
    lam = (table_ptr, lam_off16, region, rank)
    wait = (deadline, clock_ptr, empty)
    epi = (g, cols, cmask, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols)
    outs = (out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr)
    missing = 0
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if i + 1 < n_mine:
            D.push_vals(xb, t + G, cols, cmask, table_ptr, lam_off16, region, rank, H, P, BITS)
        xc, rc = _load_row(x_ptr, res_ptr, x_st, res_st, t + 2 * G, M, cols, cmask, PATTERN)
        t64 = t.to(tl.int64)
        s, miss = _receive(xa, t64, mine, lam, wait, cols, cmask, H, T, P, BITS, FP32_ACC, PTX)
        missing = missing | miss
        res = ra.to(tl.float32)
        _epilogue(s, res, t64, epi, outs, T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)
        xa, ra, xb, rb = xb, rb, xc, rc
        i += 1
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
    )
