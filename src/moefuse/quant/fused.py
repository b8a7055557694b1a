"""Fused RMSNorm (+ residual add) + quantization kernels and launchers (spec: Quantization).

The row structure is the norm family's (``moefuse.norm.triton`` / ``moefuse.norm.tiles``): a
``[ROWS, BLOCK]`` tile chosen from the width alone, the row in registers when it fits in one block,
otherwise two ascending passes over chunks (the second re-reads the row); fused_add_rmsnorm_quant
at 4096 and 6554-8192 columns runs the norm's stepped row (``norm.triton.norm_stepped``) with
FP8 output hooks. The quantization is the epilogue from :mod:`moefuse.quant.device`, so the
numbers are those of the standalone quantizers:

* FP8 (``rmsnorm_quant``, ``fused_add_rmsnorm_quant``): ``q = e8(((x * r) * g) * inv)`` of the
  UNROUNDED FP32 norm output, ``inv = 1/scale`` one IEEE division per program.
* NVFP4 (``rmsnorm_fp4_quantize``, ``fused_add_rmsnorm_fp4_quantize``): ``y = cast((x * r) * g)``
  rounded to the activation dtype first (the unfused pipeline's numbers), then the NVFP4 recipe on
  each 16-element block of ``y``; ``y`` itself is stored only when ``norm_out`` is requested.
  The grid covers the layout's PADDED rows, and every program also zero-fills its rows' padding
  block columns: the kernel writes every scale byte.

With a residual (the ``fused_add_*`` ops) ``h = f32(x) + f32(res)``, ``res <- cast(h)`` and the
statistic and normalization use the unrounded FP32 ``h`` (spec); ``input`` is not written.

This module holds the tile policies and the launchers; the kernels are in
:mod:`moefuse.quant.fused_fp8` and :mod:`moefuse.quant.fused_fp4`, the shared row loads and stores
in :mod:`moefuse.quant.fused_rows`. Public device functions (no leading underscore), importable
from here: ``ld32``, ``widen_h``, ``fp8_tile`` and ``fp4_tile``, the rows that the
all-gather family (``moefuse.comm.all_gather.decode``) reuses for its fused FP8 / NVFP4 ops (same
tree, same bits).
"""

from __future__ import annotations

import sys

from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active
from moefuse.norm.tiles import RowTile, TilePolicy, row_tile
from moefuse.norm.triton import _grid, _launch, _launch_kwargs, _persistent, _prefetch, _row_consts
from moefuse.quant.formats import LAYOUTS, RECIPES, scale_layout_shape
from moefuse.quant.fused_fp4 import _rmsnorm_fp4_kernel
from moefuse.quant.fused_fp4 import fp4_tile as fp4_tile
from moefuse.quant.fused_fp8 import _rmsnorm_fp8_kernel
from moefuse.quant.fused_fp8 import fp8_tile as fp8_tile
from moefuse.quant.fused_rows import ld32 as ld32
from moefuse.quant.fused_rows import widen_h as widen_h

#: tile policy of the fused norm + quant kernels (the norm family's default today); the benchmark's
#: ``--sweep`` times alternatives so that this can be set from H200 measurements. One-pass rows run
#: the persistent loop with prefetch (4 programs per SM): on H200 rmsnorm_quant
#: 16384 x 4096 went from 68.6 us to 50.6 us (= SM copy) with 8 warps and 4 programs per SM.
#: The H200 sweep (notes/gpu-logs/sweep-persistent-2026-11-29.log) confirmed it: 16384 x 4096
#: 54.95 vs 68.89 us, 2048 x 4096 9.33 vs 11.26 us, 16384 x 8192 108.3 vs 130.9 us (bitwise equal).
QUANT_POLICY = TilePolicy(programs_per_sm=4, prefetch=True)
#: fused_add_rmsnorm_quant: rows of 4096 and of 6554-8192 columns are stepped (the norm's stepped
#: row, ``norm_stepped``, with the FP8 output hooks), 16 warps x 8 columns per step, as
#: fused_add_rmsnorm (norm.tiles.FUSED_ADD_POLICY); other widths keep one row per program (the
#: prefetching persistent loop spilled at 3-4 programs per SM and was no faster at 2). H200
#: (scripts/sweep_stepped_fp8.py, notes/gpu-logs/sweep-stepped-fp8-2026-11-30.log), us, one-pass
#: -> stepped, M = 1 / 128 / 2048 / 4096 / 16384: H = 4096 1.52 -> 1.46, 2.96 -> 2.71, 17.32 ->
#: 15.77, 31.73 -> 28.63, 118.86 -> 109.03 (compile 111.14); H = 8192 2.27 -> 1.96, 4.26 -> 3.90,
#: 32.87 -> 30.28, 62.39 -> 56.39, 237.60 -> 222.15 (compile 221.74); H = 7168 (masked last
#: step, looped from FP8_LOOP_MIN_ROWS) 2.16 -> 1.99, 4.47 -> 3.86, 29.62 -> 29.71, 54.92 ->
#: 53.59, 207.42 -> 193.70 (compile 192.45).
QUANT_ADD_POLICY = TilePolicy(
    programs_per_sm=0,
    step_min_width=4095,
    step_max_width=8192,
    step_min_fill=0.8,
    step_warps=16,
    step_vec=8,
)
#: NVFP4 kernels (rmsnorm_fp4_quantize, fused_add_rmsnorm_fp4_quantize): instruction-bound, one
#: tile per program. The persistent loop needs far more registers here (H = 4096, 8 warps: 64 ->
#: 115 / 128 with prefetch; 4 warps: 128 -> 225 / 255), so at 2-4 programs per SM it spills
#: (ptx_check.py registers quant); 90f68c0:scripts/sweep_persistent.py times it anyway. 4 warps (32
#: elements per thread: per-program work amortised over twice the elements) beat 8 on H200:
#: rmsnorm_fp4_quantize 16384 x 4096 75.5 vs 90.0 us, 2048 x 4096 12.2 vs 13.9, 16384 x 8192
#: 155.4 vs 165.5 (sweep-persistent-2026-11-29.log; the residual variant stays at 8 warps there:
#: its sweep only timed 8)
QUANT_FP4_POLICY = TilePolicy(programs_per_sm=0, max_warps=4)
#: stepped FP8 rows whose last step is masked run looped (two passes, the second re-reading the
#: row from L2) from this many rows and unrolled below (the same bits). Rows of whole steps stay
#: unrolled at every M: on H200 unrolled was as fast or faster up to M = 16384 at 4096 and 8192
#: columns (109.0 vs 111.5 and 222.2 vs 221.6 us), while at 7168 unrolled lost from M = 2048
#: (32.9 vs 29.7 us; 231.6 vs 193.7 at 16384; sweep-stepped-fp8-2026-11-30.log).
FP8_LOOP_MIN_ROWS = 2048


def fp8_loop_min_rows(tile: RowTile, width: int) -> int:
    """Row count from which a stepped FP8 row of ``width`` columns runs looped (never for rows of
    whole steps)."""
    return FP8_LOOP_MIN_ROWS if width % tile.block else sys.maxsize


QUANT_FP4_ADD_POLICY = TilePolicy(programs_per_sm=0)


def quant_row_tile(width: int, residual: bool = False) -> RowTile:
    """The row tile of the fused FP8 kernels: a function of the width only (batch invariance)."""
    return row_tile(width, QUANT_ADD_POLICY if residual else QUANT_POLICY)


def quant_fp4_row_tile(width: int, residual: bool = False) -> RowTile:
    """The row tile of the fused NVFP4 kernels (width only, like ``quant_row_tile``)."""
    return row_tile(width, QUANT_FP4_ADD_POLICY if residual else QUANT_FP4_POLICY)


def _evict(tile) -> bool:
    """Activations are read once when the row fits one block (evict-first hint); the chunked
    path re-reads each row, so it keeps the default policy."""
    return tile.num_chunks == 1


def _rows_of(t) -> tuple[int, int, int, int]:
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


# ----------------------------------------------------------------------------- launchers
def launch_rmsnorm_fp8(
    input,
    residual,
    weight,
    scale,
    out,
    fmt: int,
    eps: float,
    gain_center: float,
    use_pdl: bool,
    tile: RowTile | None = None,
    unroll: bool | None = None,
) -> None:
    """``input`` (and ``residual``, same shape) 2-D/3-D; ``out`` uint8 (FP8 bits of format
    ``fmt``) of the same shape. ``tile`` / ``unroll`` override the width's tile and the stepped
    mode (tests and benchmark sweeps; ``unroll`` changes no bit)."""
    n_rows, heads, x_st, x_sh = _rows_of(input)
    width = input.shape[-1]
    if n_rows == 0:
        return
    _, _, q_st, q_sh = _rows_of(out)
    r_st, r_sh = _rows_of(residual)[2:] if residual is not None else (0, 0)
    tile = tile or quant_row_tile(width, residual is not None)
    args = (
        input, residual if residual is not None else input, weight, scale, out,
        n_rows, width, float(width), heads,
        x_st, x_sh, r_st, r_sh, q_st, q_sh,
        eps, gain_center,
    )  # fmt: skip
    consts = {
        **_row_consts(tile, width, n_rows, unroll, fp8_loop_min_rows(tile, width), use_pdl),
        "EVICT_FIRST": _evict(tile),
        "HAS_RESIDUAL": residual is not None,
        "FMT": fmt,
    }
    _launch(
        _rmsnorm_fp8_kernel, _grid(tile, tile.grid(n_rows)[0], input.device), args, consts, tile
    )


def launch_rmsnorm_fp4(
    input,
    residual,
    weight,
    global_scale,
    packed,
    scales,
    norm_out,
    eps: float,
    gain_center: float,
    layout: str,
    recipe: str,
    use_pdl: bool,
    tile: RowTile | None = None,
) -> None:
    """``input`` [M, H] (H % 16 == 0); ``norm_out`` [M, H] of the input dtype or None.
    ``tile`` overrides the width's tile (benchmark sweeps only)."""
    m, width = input.shape
    kb = width // 16
    rows_p, n_kcols = scale_layout_shape(m, kb, layout)
    if rows_p == 0:
        return
    tile = tile or quant_fp4_row_tile(width, residual is not None)
    grid = _grid(tile, (rows_p + tile.rows - 1) // tile.rows, input.device)
    y = norm_out if norm_out is not None else input  # dtype carrier when not stored
    args = (
        input, residual if residual is not None else input, weight, global_scale, packed,
        scales, y,
        m, rows_p, width, float(width), kb, n_kcols,
        input.stride(0), residual.stride(0) if residual is not None else 0, packed.stride(0),
        y.stride(0),
        eps, gain_center,
    )  # fmt: skip
    launch(
        _rmsnorm_fp4_kernel,
        grid,
        *args,
        BLOCK=tile.block,
        NUM_CHUNKS=tile.num_chunks,
        ROWS=tile.rows,
        HAS_RESIDUAL=residual is not None,
        HAS_NORM_OUT=norm_out is not None,
        RECIPE=RECIPES[recipe],
        LAYOUT=LAYOUTS[layout],
        EVICT_FIRST=_evict(tile),
        PTX=not interpreter_active(),
        PERSISTENT=_persistent(tile),
        PREFETCH=_prefetch(tile),
        USE_PDL=use_pdl,
        MASKED=tile.rows > 1 or not tile.even(width),
        num_warps=tile.num_warps,
        **_launch_kwargs(tile, use_pdl),
    )
