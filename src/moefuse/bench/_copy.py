"""SM copy kernel: the bandwidth ceiling of the benchmarks (bytes read + written per second)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


#: (elements per program, warps) tried by the ceiling measurement; the best one is the ceiling
COPY_CONFIGS = ((2048, 4), (4096, 4), (8192, 8), (16384, 8), (16384, 16))


def sm_copy(src: torch.Tensor, dst: torch.Tensor, block: int = 8192, num_warps: int = 8) -> None:
    n = src.numel()
    _copy_kernel[(triton.cdiv(n, block),)](src, dst, n, BLOCK=block, num_warps=num_warps)
