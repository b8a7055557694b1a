"""The FP8 experts' quantization launches: per_token_group_quant_8bit of rows (E4M3 codes, one
FP32 scale per 128 channels, eps 1e-10, the quotients from one reciprocal per group), as the
tokens' launch (which also zeroes the counters of the gate|up kernel's fused activation
quantization) and as the activation's launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moefuse._device import widen_f32
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs
from moefuse.moe.fp8_device import GROUP_EPS, fp8_codes
from moefuse.quant.group_triton import (
    _group_quant_kernel,
    group_quant_tile,
    group_tile,
    store_scales,
)


@triton.jit
def store_slot_group_codes(v, live, r_in, s64, cols, grp, codes, scales, eps, PTX: tl.constexpr):
    """per_token_group_quant_8bit of one 128-channel group of slot rows, inside a GEMM kernel:
    ``v`` [BT, 128] (``live``: in use; ``r_in`` [BT]: valid slots, rows ``s64``), the columns
    ``cols`` of group ``grp``; writes the E4M3 codes and the FP32 scale with the standalone
    kernel's device function (:func:`moefuse.quant.group_triton.group_quant_tile`: the same
    lanes, eps and division, so that kernel's bytes). ``codes`` / ``scales`` = (pointer, row
    stride)."""
    codes_ptr, codes_st = codes
    scales_ptr, scales_st = scales
    q, sc = group_quant_tile(widen_f32(v, PTX), live, eps, 128, 448.0, False, False, PTX)
    tl.store(codes_ptr + s64[:, None] * codes_st + cols[None, :], q, mask=live)
    store_scales(scales_ptr + s64[:, None] * scales_st + grp, sc, r_in[:, None], False)


@triton.jit(do_not_specialize=["n_rows", "n_count"])
def _tokens_quant_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    count_ptr,
    n_rows,
    H,
    G,
    x_st,
    s_st,
    eps,
    n_count,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """per_token_group_quant_8bit of the tokens (its kernel's body, called as a device function:
    the same codes and scales), then zeroes ``n_count`` counters of
    :func:`moefuse.moe.experts_fp8._quantize_group_if_last` (after the body's ``gdc_wait``: the
    gate|up kernel, next in the stream, waits for this grid)."""
    _group_quant_kernel(
        x_ptr,
        q_ptr,
        s_ptr,
        n_rows,
        H,
        G,
        1,
        x_st,
        0,
        s_st,
        0,
        1,
        eps,
        BLOCK_M,
        BLOCK_N,
        128,
        448.0,
        False,
        False,
        False,
        True,  # RCP: the quotients from one reciprocal per group (eps is 1e-10)
        PTX,
        USE_PDL,
    )
    p = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    step = tl.num_programs(0) * tl.num_programs(1) * 128
    c0 = p * 128
    while c0 < n_count:
        cs = c0 + tl.arange(0, 128)
        tl.store(count_ptr + cs, tl.zeros([128], tl.int32), mask=cs < n_count)
        c0 += step


def group_quant_rows(rows: torch.Tensor, use_pdl: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 codes [R, W] as the kernels read them, FP32 group scales [R, ceil(W/128)]) of
    ``rows`` by per_token_group_quant_8bit's kernel (:func:`group_quant_columns` computes the
    same codes)."""
    from moefuse.quant.group_triton import launch_group_quant

    r, w = rows.shape
    codes = torch.empty(r, w, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(r, triton.cdiv(w, 128), dtype=torch.float32, device=rows.device)
    launch_group_quant(rows, codes, scales, 128, GROUP_EPS, False, False, use_pdl)
    return fp8_codes(codes), scales


def tokens_quant(
    rows: torch.Tensor, counters: torch.Tensor, n_count: int, use_pdl: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`group_quant_rows` of the tokens (the same codes and scales,
    per_token_group_quant_8bit's tile) by :func:`_tokens_quant_kernel`, which also zeroes
    ``counters[:n_count]``."""
    r, w = rows.shape
    codes = torch.empty(r, w, dtype=torch.uint8, device=rows.device)
    scales = torch.empty(r, triton.cdiv(w, 128), dtype=torch.float32, device=rows.device)
    bm, bn, warps = group_tile(w, 128, r)
    launch(
        _tokens_quant_kernel,
        (triton.cdiv(r, bm), triton.cdiv(w, bn)),
        rows,
        codes,
        scales,
        counters,
        r,
        w,
        scales.shape[1],
        rows.stride(0),
        scales.stride(0),
        GROUP_EPS,
        n_count,
        BLOCK_M=bm,
        BLOCK_N=bn,
        PTX=not interpreter_active(),
        USE_PDL=use_pdl,
        num_warps=warps,
        **pdl_launch_kwargs(use_pdl),
    )
    return fp8_codes(codes), scales
