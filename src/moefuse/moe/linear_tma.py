"""``fp8_linear``'s many-row launch with the tokens on the MMA's M side and both operands loaded
by the Tensor Memory Accelerator (tile key ``tma``, :func:`moefuse.moe.tiles.linear_fp8_plan`).

The product and its order are :mod:`moefuse.moe.linear_triton`'s: per K-block ``b`` ascending,
``dot_b`` of the block's E4M3 codes from a zero accumulator (:func:`fp8_block_dot`), then
``acc = fma(dot_b, xs[t, b] * Ws[n / 128, b], acc)``, the chunk sums added in ascending order
from +0.0, then the bias. What changes is the program's shape:

* ``BT`` token rows x ``BN`` weight rows per program, the tokens as the MMA's M operand (the
  other launch puts the weight rows there, which the decode sizes need: M = 1 fills no 64-row
  MMA). A thread then holds two token rows of the accumulator, so the per-token scales cost two
  registers instead of one per column it holds: a 128 x 128 tile compiles to ~150 registers
  where the weight-row orientation needs all 255 (sm_90a, ptxas).
* The tiles of codes arrive by TMA (host-side descriptors over the codes and the weight):
  no address registers, no per-thread copies; rows and columns past M, N and K read as zeros,
  as the masked loads of the other launch do.

The FP8 MMA's ``dot_b`` of a (token, weight row) pair has the same bits whichever operand is
the M side (H100, block accumulation: a probe of the two orientations, bitwise equal at
2,048 x 7,168 x 16,384 and 2,048 x 4,096 x 2,048), so a row's bits still do not depend on M or
on which launch ran. The launch needs 16-byte aligned codes and weight rows (``K`` a multiple
of 16): :func:`tma_ready`. The descriptors are host-side (``TensorDescriptor``: Triton's
launcher fills each CUtensorMap at launch), so launch plans replay these launches with the next
call's addresses (:mod:`moefuse._fastpath`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from moefuse._device import fma_rn, round_to, widen_f32
from moefuse._fastpath import launch
from moefuse._runtime import pdl_launch_kwargs
from moefuse.moe.fp8_device import fp8_block_dot, scale_f32


def fp8_linear_metadata(grid, kernel, args):
    """Profiler name and weight bytes of an ``fp8_linear`` launch (both of its kernels)."""
    return {
        "name": f"{kernel.name} N={args['N']} K={args['KDIM']} BN={args['BN']} BT={args['BT']}",
        "bytes": args["N"] * args["KDIM"],
    }


@triton.jit(launch_metadata=fp8_linear_metadata)
def _fp8_linear_tma_kernel(
    x_desc,
    w_desc,
    xs_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    m_rows,
    strides,
    N: tl.constexpr,
    KDIM: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,
    CHUNK: tl.constexpr,
    STAGES: tl.constexpr,
    ACCUM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    E8M0: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``out[t, n]`` for ``BT`` token rows from ``program_id(1) * BT`` and ``BN`` (<= 128, a
    divisor of 128) weight rows from ``program_id(0) * BN``; ``strides`` = (x-scale row, weight
    scale row, out row). ``CHUNK`` > 0: the sum restarts from +0.0 every ``CHUNK`` blocks and
    the chunk sums are added in ascending order from +0.0."""
    xs_st, s_st, out_st = strides
    n0 = tl.program_id(0) * BN
    t0 = tl.program_id(1) * BT
    n = n0 + tl.arange(0, BN)
    t = t0 + tl.arange(0, BT)
    n_in = n < N
    r_in = t < m_rows
    t64 = t.to(tl.int64)
    xs_rows = xs_ptr + t64 * xs_st
    s_row = s_ptr + (n0 // 128).to(tl.int64) * s_st
    n_blocks: tl.constexpr = (KDIM + 127) // 128
    if USE_PDL:
        gdc_wait()
    acc = tl.zeros([BT, BN], dtype=tl.float32)
    total = tl.zeros([BT, BN], dtype=tl.float32)
    for b in tl.range(0, n_blocks, num_stages=STAGES):
        q = x_desc.load([t0, b * 128])
        w = w_desc.load([n0, b * 128])
        part = fp8_block_dot(q, tl.trans(w), ACCUM, PTX)
        xs = tl.load(xs_rows + b, mask=r_in, other=0.0)
        ws = scale_f32(tl.load(s_row + b), E8M0)
        acc = fma_rn(part, (xs * ws)[:, None], acc, PTX)
        if CHUNK > 0:
            if ((b + 1) % CHUNK == 0) | (b + 1 == n_blocks):
                total = total + acc
                acc = tl.zeros([BT, BN], dtype=tl.float32)
    if CHUNK > 0:
        acc = total
    if USE_PDL:
        gdc_launch_dependents()
    if HAS_BIAS:
        acc = acc + widen_f32(tl.load(bias_ptr + n, mask=n_in, other=0.0), PTX)[None, :]
    ptrs = out_ptr + t64[:, None] * out_st + n[None, :]
    tl.store(ptrs, round_to(acc, out_ptr.dtype.element_ty, PTX), mask=r_in[:, None] & n_in[None, :])


def tma_ready(codes: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the codes [M, K] and the weight [N, K] can be read by TMA: unit last stride,
    16-byte aligned bases and row strides."""
    return all(
        t.stride(-1) == 1 and t.stride(0) % 16 == 0 and t.data_ptr() % 16 == 0
        for t in (codes, weight)
    )


def launch_fp8_linear_tma(
    x, xs, weight, scale, bias, out, cfg: dict, e8m0: bool, ptx: bool, use_pdl: bool, chunk: int
) -> None:
    """``out`` [M, N] from the codes ``x`` [M, K] (E4M3, or uint8 in the interpreter) with
    their scales ``xs`` [M, ceil(K/128)], the weight codes [N, K] and its block scales ``scale``
    (FP32 or UE8M0 bytes, unit stride along K); ``chunk`` > 0: the chunk order of a split (N, K).
    ``cfg``: ``bn`` (64 or 128: the caller's check, ``linear_triton._tma_launch``), ``bt``,
    ``warps``, ``stages``."""
    m, k = x.shape
    n = weight.shape[0]
    bn, bt = cfg["bn"], cfg["bt"]
    x_desc = TensorDescriptor.from_tensor(x, [bt, 128])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, 128])
    launch(
        _fp8_linear_tma_kernel,
        (triton.cdiv(n, bn), triton.cdiv(m, bt)),
        x_desc,
        w_desc,
        xs,
        scale,
        bias if bias is not None else out,
        out,
        m,
        (xs.stride(0), scale.stride(0), out.stride(0)),
        N=n,
        KDIM=k,
        BN=bn,
        BT=bt,
        CHUNK=chunk,
        STAGES=cfg["stages"],
        ACCUM=cfg["accumulation"],
        HAS_BIAS=bias is not None,
        E8M0=e8m0,
        PTX=ptx,
        USE_PDL=use_pdl,
        num_warps=cfg["warps"],
        enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
    )
