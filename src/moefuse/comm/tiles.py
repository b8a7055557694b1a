"""Row tiles of the communication kernels — functions of the hidden size alone (no triton import).

One program handles one token row at a time in registers (``BLOCK`` = next power of two of H, at
least 64 so that an NVFP4 row always covers its padded scale columns). The row statistic's
reduction tree therefore depends on H only, never on the token count or the grid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: widest row the kernels hold in registers (wider rows use the reference path)
MAX_HIDDEN = 32768
MIN_BLOCK = 64


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class CommTile:
    block: int  # columns held per row (power of two >= H)
    num_warps: int
    kp_block: int  # scale columns covered per row (NVFP4): block // 16 >= round_up(H/16, 4)


#: Tuning knobs read once at import (same value on every rank, or grids would differ):
#: MOEFUSE_COMM_ELEMS_PER_THREAD (default 16) sets num_warps = BLOCK / (32 * it), within [4, 32];
#: MOEFUSE_COMM_CTAS_PER_SM overrides the co-resident CTA estimate that caps the grids.
ELEMS_PER_THREAD = int(os.environ.get("MOEFUSE_COMM_ELEMS_PER_THREAD", "16"))
CTAS_PER_SM = int(os.environ.get("MOEFUSE_COMM_CTAS_PER_SM", "0"))


def comm_tile(hidden: int, pattern: int = 1) -> CommTile:
    """~16 elements per thread: 4 warps up to H = 2048, 8 at 4096, 16 at 8192, 32 beyond."""
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be in [1, {MAX_HIDDEN}], got {hidden}")
    block = max(MIN_BLOCK, next_pow2(hidden))
    warps = min(32, max(4, block // (32 * ELEMS_PER_THREAD)))
    return CommTile(block=block, num_warps=warps, kp_block=block // 16)


def resident_ctas_per_sm(num_warps: int) -> int:
    """A conservative count of co-resident CTAs per SM (2048 threads, 64K registers at <= 128 per
    thread): the grids of the peer algorithms never exceed what can run at once."""
    if CTAS_PER_SM > 0:
        return CTAS_PER_SM
    return max(1, min(4, 16 // num_warps))
