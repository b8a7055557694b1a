"""Tile shapes of the row kernels — a function of the row width alone.

The reduction tree of a row is fixed by (BLOCK, NUM_CHUNKS, ROWS, num_warps); choosing all four from
the width H (never from the token count) is what makes every op batch-invariant: a row's output
bits are the same alone or inside a batch of 16384, and a new token count never recompiles.
This module imports no triton so that the custom-op layer can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

#: widest row held in registers in one pass; wider rows loop over chunks of CHUNK_BLOCK
MAX_SINGLE_BLOCK = 16384
CHUNK_BLOCK = 8192
#: small rows are packed several to a program so each program moves about this many elements
TILE_ELEMENTS = 2048
#: elements each thread owns per row chunk (8 x 16-bit = one 16-byte vector)
ELEMS_PER_THREAD = 8
MAX_WARPS = 8


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class RowTile:
    block: int  # columns per chunk (power of two)
    num_chunks: int  # chunks per row; 1 = whole row in registers, one pass over memory
    rows: int  # rows per program
    num_warps: int

    def even(self, width: int) -> bool:
        """True when ``width`` fills every chunk exactly (no column mask needed)."""
        return width == self.block * self.num_chunks

    def grid(self, n_rows: int) -> tuple[int]:
        return ((n_rows + self.rows - 1) // self.rows,)


@dataclass(frozen=True)
class TilePolicy:
    """Per-op limits (None = the module default); register-heavy ops hold less of a row."""

    max_single: int | None = None
    chunk: int | None = None
    max_warps: int | None = None


#: the gated ops keep an FP32 stream and three FP32 parameter vectors live: measured on H200
#: (scripts/sweep_norm_tiles.py, notes/norm.md), 16384 x 8192 with 8 warps ran at 3.2-3.3 TB/s
#: (183 registers, one CTA per SM); with 4 warps and the row in one pass gated_residual_next runs
#: 389 us (4.1 TB/s) and gated_residual 351 us. Two 4096 chunks were 4 % faster for
#: gated_residual at M = 16384 (337 us) but 1.6 x slower at M <= 128 (3.6 vs 2.2 us at M = 1),
#: so both ops hold rows up to 8192 in registers.
GATED_POLICY = TilePolicy(max_single=8192, chunk=4096, max_warps=4)


def row_tile(width: int, policy: TilePolicy = TilePolicy()) -> RowTile:
    """The tile for rows of ``width`` elements (see module docstring for why it ignores M)."""
    max_single = policy.max_single or MAX_SINGLE_BLOCK
    chunk = policy.chunk or CHUNK_BLOCK
    max_warps = policy.max_warps or MAX_WARPS
    if width < 1:
        raise ValueError(f"row width must be >= 1, got {width}")
    if width <= max_single:
        block, chunks = next_pow2(width), 1
    else:
        block = min(chunk, max_single)
        chunks = (width + block - 1) // block
    rows = max(1, TILE_ELEMENTS // block)
    warps = (rows * block) // (32 * ELEMS_PER_THREAD)
    warps = max(1, min(max_warps, next_pow2(warps)))
    return RowTile(block=block, num_chunks=chunks, rows=rows, num_warps=warps)
