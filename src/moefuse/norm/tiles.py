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
#: persistent row loop (one-pass tiles only): programs per SM for a tile of PERSISTENT_TILE_ELEMENTS
#: (larger tiles get proportionally fewer, at least 1), and whether each program issues the loads of
#: its next row tile before reducing the current one. H200 (notes/gpu-logs/
#: sweep-occupancy-2026-11-29.log): rmsnorm_quant 16384 x 4096 took 68.6 us with one program per
#: row and 50.6 us (= an SM copy of the same bytes) with 4 prefetching programs per SM; without the
#: prefetch the same loop took 63 us. 0 programs per SM = one program per row tile.
#: The full sweep (90f68c0:scripts/sweep_persistent.py,
#: notes/gpu-logs/sweep-persistent-2026-11-29.log, bitwise equal everywhere) found the loop slower
#: for every op that writes as much as it reads (rmsnorm 16384 x 4096: 73.2 vs 66.3 us; fused_add
#: 143.4 vs 136.0; sigmoid gate 69.7 vs 50.8; gated ops at 8192: 1.6-1.8 x slower at 2-4 programs
#: per SM), so the module default is off and only rmsnorm_quant (quant/fused.py QUANT_POLICY) turns
#: it on.
PROGRAMS_PER_SM = 0
PREFETCH = True
PERSISTENT_TILE_ELEMENTS = 4096
MULTI_ROW_PROGRAMS_PER_SM = 2
#: registers per SM (sm_90): persistent launches cap registers per thread at
#: REGISTERS_PER_SM / (programs_per_sm x threads) so that all programs of an SM are resident
REGISTERS_PER_SM = 65536
#: stepped rows (gated ops, see norm/gated.py; rmsnorm and fused_add_rmsnorm at some widths): rows
#: of at most STEP_UNROLL_MAX_STEPS steps run unrolled (the row in registers) below a row count,
#: looped otherwise (same bits): STEP_LOOP_MIN_ROWS for the gated ops, RMSNORM_LOOP_MIN_ROWS and
#: FUSED_ADD_LOOP_MIN_ROWS for the other two
STEP_UNROLL_MAX_STEPS = 4
STEP_LOOP_MIN_ROWS = 512
RMSNORM_LOOP_MIN_ROWS = 4096
FUSED_ADD_LOOP_MIN_ROWS = 4096


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class RowTile:
    block: int  # columns per chunk (power of two)
    num_chunks: int  # chunks per row; 1 = whole row in registers, one pass over memory
    rows: int  # rows per program
    num_warps: int
    #: persistent grid: min(row tiles, programs_per_sm x SMs) programs, each looping over the row
    #: tiles pid, pid + grid, ...; 0 = one program per row tile. Neither field changes a row's
    #: arithmetic (same tile, warps and tree): they only choose which program computes a row.
    programs_per_sm: int = 0
    prefetch: bool = False
    #: cap registers (ptxas maxnreg) so that programs_per_sm programs fit on one SM
    fit_registers: bool = True
    #: stepped row (gated ops): one row per program walked in num_chunks steps of block columns,
    #: per-thread FP32 accumulation over the steps, one tl.sum (see norm/gated.py)
    stepped: bool = False

    def even(self, width: int) -> bool:
        """True when ``width`` fills every chunk exactly (no column mask needed)."""
        return width == self.block * self.num_chunks

    def grid(self, n_rows: int) -> tuple[int]:
        return ((n_rows + self.rows - 1) // self.rows,)

    def persistent_grid(self, n_tiles: int, sm_count: int) -> tuple[int]:
        """Programs for ``n_tiles`` row tiles; the grid is a runtime value (no recompilation)."""
        if self.programs_per_sm <= 0 or self.num_chunks > 1:
            return (n_tiles,)
        return (max(1, min(n_tiles, self.programs_per_sm * sm_count)),)

    def max_registers(self) -> int | None:
        """Register cap of a persistent launch (None = no cap needed or asked)."""
        if self.programs_per_sm <= 0 or self.num_chunks > 1 or not self.fit_registers:
            return None
        cap = REGISTERS_PER_SM // (self.programs_per_sm * self.num_warps * 32) // 8 * 8
        return cap if cap < 255 else None


@dataclass(frozen=True)
class TilePolicy:
    """Per-op limits (None = the module default); register-heavy ops hold less of a row."""

    max_single: int | None = None
    chunk: int | None = None
    max_warps: int | None = None
    #: persistent loop: programs per SM for a PERSISTENT_TILE_ELEMENTS tile (0 = off) and prefetch
    programs_per_sm: int | None = None
    prefetch: bool | None = None
    #: blocks above this run one tile per program (register limits)
    persistent_max_block: int | None = None
    #: rows wider than step_min_width (None = never) and at most step_max_width (None = any) are
    #: stepped: steps of 32 x step_warps x step_vec columns
    step_min_width: int | None = None
    step_max_width: int | None = None
    #: ... and whose columns fill at least this fraction of their steps (the last step is masked)
    step_min_fill: float = 0.0
    step_warps: int = 16
    step_vec: int = 4


#: gated ops: rows up to 2048 wide are one-pass [ROWS, BLOCK] tiles with 4 warps (the old layout);
#: wider rows are stepped, 16 warps x 4 columns per step (STEP 2048), unrolled at small M and
#: looped at large M (see norm/gated.py). H200 (90f68c0:scripts/sweep_stepped.py, notes/norm.md):
#: the one-pass 4-warp tile of 8192 columns needed 255 registers (2 CTAs per SM) and ran 16384 x
#: 8192 at 349 / 440 us (gated / gated_next) vs compile's 326 / 403; the looped stepped kernel
#: (32-40 registers) ran 325 / 405 us. torch.compile's own kernel has the same shape (16 warps,
#: 2048).
GATED_POLICY = TilePolicy(max_warps=4, programs_per_sm=0, step_min_width=2048)
#: fused_add_rmsnorm: rows of 4096 and of 6554-8192 columns (stepped widths filling >= 80 % of
#: their 4096-column steps) are stepped, 16 warps x 8 columns per step, the residual stored before
#: the row's sum, unrolled below FUSED_ADD_LOOP_MIN_ROWS rows and looped from there; other widths
#: keep the one-pass tile. H200 (90f68c0:scripts/sweep_stepped_norms.py, notes/gpu-logs/
#: sweep-stepped-fused-add-early-2026-11-30.log), us, stepped vs one-pass, H = 4096 / 7168 / 8192:
#: M = 1 1.34 vs 1.27 / 1.62 vs 1.68 / 1.68 vs 1.76; M = 1024 9.59 vs 9.59 / 16.99 vs 16.42 /
#: 18.71 vs 18.80; M = 16384 127.6 vs 135.1 / 222.9 vs 231.2 / 257.9 vs 267.1 (compile 127.2 /
#: 221.2 / 255.4). At 2880 and 5120 stepped rows lost (sweep-stepped-norms-2026-11-30.log).
#: (Persistent loop: at 4 programs per SM the prefetching one-pass kernel spilled at H = 4096 and
#: at 3 it ran 143.4 vs 136.0 us at 16384 x 4096, so it stays off.)
FUSED_ADD_POLICY = TilePolicy(
    programs_per_sm=0,
    step_min_width=4095,
    step_max_width=8192,
    step_min_fill=0.8,
    step_warps=16,
    step_vec=8,
)
#: rmsnorm_sigmoid_gate: the gate doubles the loads; 2 prefetching programs per SM ran 69.7 us vs
#: 50.8 us for one program per tile (16384 x 32 x 64): off
SIGMOID_GATE_POLICY = TilePolicy(programs_per_sm=0)
#: rmsnorm / gemma_rmsnorm: rows of 6145-8192 columns are stepped, 16 warps x 8 columns per step
#: (STEP 4096, two steps), unrolled below RMSNORM_LOOP_MIN_ROWS rows and looped from there. H200
#: (90f68c0:scripts/sweep_stepped_norms.py, notes/gpu-logs/sweep-stepped-norms-2026-11-30.log), us
#: against the one-pass 8-warp tile at H = 8192 / 7168: M = 16384 126.8 vs 130.1 / 112.0 vs 114.3
#: (compile 128.2 / 111.9), M = 128 2.55 vs 2.80 / 2.33 vs 2.63, M = 1024 9.08 vs 8.69 / 8.22 vs
#: 8.44. Narrower rows keep the one-pass tile (stepped lost 5-30 % at 2880-5120 for M >= 1024);
#: wider ones were not measured.
RMSNORM_POLICY = TilePolicy(step_min_width=6144, step_max_width=8192, step_warps=16, step_vec=8)


def row_tile(width: int, policy: TilePolicy = TilePolicy()) -> RowTile:
    """The tile for rows of ``width`` elements (see module docstring for why it ignores M)."""
    max_single = policy.max_single or MAX_SINGLE_BLOCK
    chunk = policy.chunk or CHUNK_BLOCK
    max_warps = policy.max_warps or MAX_WARPS
    if width < 1:
        raise ValueError(f"row width must be >= 1, got {width}")
    step = 32 * policy.step_warps * policy.step_vec
    steps = -(-width // step)
    if (
        policy.step_min_width is not None
        and width > policy.step_min_width
        and (policy.step_max_width is None or width <= policy.step_max_width)
        and width >= policy.step_min_fill * steps * step
    ):
        return RowTile(
            block=step, num_chunks=steps, rows=1, num_warps=policy.step_warps, stepped=True
        )
    if width <= max_single:
        block, chunks = next_pow2(width), 1
    else:
        block = min(chunk, max_single)
        chunks = (width + block - 1) // block
    rows = max(1, TILE_ELEMENTS // block)
    warps = (rows * block) // (32 * ELEMS_PER_THREAD)
    warps = max(1, min(max_warps, next_pow2(warps)))
    per_sm = PROGRAMS_PER_SM if policy.programs_per_sm is None else policy.programs_per_sm
    prefetch = PREFETCH if policy.prefetch is None else policy.prefetch
    if per_sm > 0 and rows * block > PERSISTENT_TILE_ELEMENTS:
        per_sm = max(1, per_sm * PERSISTENT_TILE_ELEMENTS // (rows * block))
    if rows > 1:
        # several rows per tile: per-row addressing lives across the loop; at 3-4 programs per SM
        # (<= 80 registers) the loops of rmsnorm / sigmoid gate / FP8 spill 40-210 B at H = 64, 128
        per_sm = min(per_sm, MULTI_ROW_PROGRAMS_PER_SM)
    if chunks > 1 or (policy.persistent_max_block or block) < block:
        per_sm = 0  # the chunked (wide-row) path keeps one program per row tile
    if per_sm == 0:
        prefetch = False
    return RowTile(
        block=block,
        num_chunks=chunks,
        rows=rows,
        num_warps=warps,
        programs_per_sm=per_sm,
        prefetch=prefetch,
    )
