"""Row loads and stores shared by the fused norm + quantization rows (:mod:`moefuse.quant.fused`):
exact FP32 widening of the activations (BF16 with one instruction per element on the GPU), the
FP32 ``h`` of an optional residual add, and stores masked only when asked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moefuse._device import widen_bf16_pairs
from moefuse.norm.triton import ld, ld_raw


@triton.jit
def ld32(ptrs, mask, MASKED: tl.constexpr, STREAM: tl.constexpr, PTX: tl.constexpr):
    """norm.triton ``ld`` (load, widen exactly to FP32); BF16 on the GPU widens with one
    instruction per element (``widen_bf16_pairs``)."""
    if PTX and ptrs.dtype.element_ty == tl.bfloat16:
        return widen_bf16_pairs(ld_raw(ptrs, mask, MASKED, STREAM))
    else:
        return ld(ptrs, mask, MASKED, STREAM)


@triton.jit
def _load_h(
    x_ptr,
    res_ptr,
    x_row,
    r_row,
    cols,
    mask,
    MASKED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
):
    """f32(x), or f32(x) + f32(res) (FP32, unrounded) when HAS_RESIDUAL."""
    h = ld32(x_ptr + x_row + cols[None, :], mask, MASKED, EVICT_FIRST, PTX)
    if HAS_RESIDUAL:
        h += ld32(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST, PTX)
    return h


@triton.jit
def widen_h(x, r, HAS_RESIDUAL: tl.constexpr):
    """f32(x) [+ f32(res)]: the FP32 h of ``_load_h`` from raw loads."""
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        h += r.to(tl.float32)
    return h


@triton.jit
def widen_x(x, r):
    """``COMBINE`` hook (:func:`moefuse.norm.row_loop.one_pass_rows`) of rows without a
    residual: f32(x), :func:`widen_h` without the residual."""
    return widen_h(x, r, False)


@triton.jit
def widen_sum(x, r):
    """``COMBINE`` hook (:func:`moefuse.norm.row_loop.one_pass_rows`) of rows with a residual:
    f32(x) + f32(res), :func:`widen_h` with the residual."""
    return widen_h(x, r, True)


@triton.jit
def _st_maybe(ptrs, v, mask, MASKED: tl.constexpr):
    """tl.store, with ``mask`` only when MASKED."""
    if MASKED:
        tl.store(ptrs, v, mask=mask)
    else:
        tl.store(ptrs, v)
