"""Kernels of the MoE-reduction family's torch.distributed path
(:mod:`moefuse.comm.moe_reduction.kernels` launches them): ``_moe_partial_kernel`` writes this
rank's partial rows to ``[M, H]``, the caller all-gathers them, ``_moe_gathered_kernel`` sums the
ranks' partials in rank order and runs the shared epilogue (same device functions as the peer
kernels, hence the same bits).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import widen_f32
from moefuse.comm import device as D
from moefuse.comm.moe_reduction.producer import _finish_row, _partial_row, _rank_step


@triton.jit(do_not_specialize=["M", "n_rows", "n_experts"])
def _moe_partial_kernel(
    src_ptr,
    map_ptr,
    w_ptr,
    sh_ptr,
    b_ptr,
    e_ptr,
    out_ptr,
    src_st,
    src_kst,
    map_st,
    w_tst,
    w_kst,
    sh_st,
    b_st,
    e_st,
    out_st,
    M,
    H,
    n_rows,
    n_experts,
    rsf,
    BLOCK_H: tl.constexpr,
    K: tl.constexpr,
    KB: tl.constexpr,
    DENSE: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RSF: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    STEPWISE: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    """This rank's partial rows, materialised ([M, H], T) for the all-gather of the torch path."""
    T: tl.constexpr = out_ptr.dtype.element_ty
    src = (src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr)
    src_sts = (src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st)
    counts = (n_rows, n_experts)
    PROD: tl.constexpr = (K, KB, DENSE, HAS_W, HAS_BIAS, HAS_RSF, HAS_SHARED, STEPWISE, PTX)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    if USE_PDL:
        gdc_wait()
    t = pid
    while t < M:
        p = _partial_row(t, cols, cmask, src, src_sts, counts, rsf, T, PROD)
        tl.store(out_ptr + t.to(tl.int64) * out_st + cols, p.to(T), mask=cmask)
        t += G
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit(do_not_specialize=["M", "M_pad"])
def _moe_gathered_kernel(
    g_ptr,
    res_ptr,
    gw_ptr,
    arout_ptr,
    rout_ptr,
    nout_ptr,
    q_ptr,
    sf_ptr,
    scale_ptr,
    res_st,
    arout_st,
    rout_st,
    nout_st,
    q_st,
    M,
    M_pad,
    H,
    Hf,
    n_kcols,
    eps,
    weight_bias,
    P: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PATTERN: tl.constexpr,
    LAYOUT: tl.constexpr,
    KP_BLOCK: tl.constexpr,
    STEPWISE: tl.constexpr,
    WRITE_AR: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    """``g_ptr``: all ranks' partials, contiguous [P, M, H]; rank-order sum + epilogue."""
    T: tl.constexpr = g_ptr.dtype.element_ty
    outs = (arout_ptr, arout_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr)
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
    t = pid
    while t < M:
        t64 = t.to(tl.int64)
        acc = tl.zeros([BLOCK_H], tl.float32)
        for q in tl.static_range(P):
            v = widen_f32(tl.load(g_ptr + (q * M + t64) * H + cols, mask=cmask, other=0.0), PTX)
            acc = _rank_step(acc, v, T, STEPWISE, PTX)
        res = widen_f32(tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0), PTX)
        _finish_row(acc, res, t64, cols, cmask, g, norm, scales, outs, T, EPI)
        t += G
    if USE_PDL:
        gdc_launch_dependents()
    if PATTERN == 3:
        D.zero_scale_rows(sf_ptr, M + pid, M_pad, G, n_kcols, LAYOUT, KP_BLOCK)
