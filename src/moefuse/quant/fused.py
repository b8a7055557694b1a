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

Public device functions (no leading underscore): ``ld32``, ``widen_h``, ``fp8_load``,
``fp8_tile`` and ``fp4_tile``, the rows that the all-gather family
(``moefuse.comm.all_gather.decode``) reuses for its fused FP8 / NVFP4 ops (same tree, same bits).
"""

from __future__ import annotations

import sys

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import rcp_fast, round_to, widen_bf16_pairs
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active
from moefuse.norm.tiles import RowTile, TilePolicy, row_tile
from moefuse.norm.triton import (
    _grid,
    _inv_rms,
    _launch,
    _launch_kwargs,
    _persistent,
    _pf_mask,
    _prefetch,
    _row_consts,
    _st,
    ld,
    ld_raw,
    norm_stepped,
    row_base,
    tile_rows,
)
from moefuse.quant import device as D
from moefuse.quant.formats import LAYOUTS, RECIPES, scale_layout_shape

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
QUANT_ADD_POLICY = TilePolicy(programs_per_sm=0, step_min_width=4095, step_max_width=8192,
                              step_min_fill=0.8, step_warps=16, step_vec=8)  # fmt: skip
#: NVFP4 kernels (rmsnorm_fp4_quantize, fused_add_rmsnorm_fp4_quantize): instruction-bound, one
#: tile per program. The persistent loop needs far more registers here (H = 4096, 8 warps: 64 ->
#: 115 / 128 with prefetch; 4 warps: 128 -> 225 / 255), so at 2-4 programs per SM it spills
#: (scripts/compile_check.py); 90f68c0:scripts/sweep_persistent.py times it anyway. 4 warps (32
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


def _fp8_metadata(grid, kernel, args):
    n, h = args["n_rows"], args["H"]
    elem = args["x_ptr"].element_size() * (3 if args["HAS_RESIDUAL"] else 1)
    return {"name": f"rmsnorm_fp8 M={n} H={h}", "bytes": n * h * (elem + 1)}


def _fp4_metadata(grid, kernel, args):
    n, h = args["n_rows"], args["H"]
    e = args["x_ptr"].element_size()
    elem = e * (3 if args["HAS_RESIDUAL"] else 1) + (e if args["HAS_NORM_OUT"] else 0)
    scales = args["n_rows_padded"] * args["n_kcols"]
    return {"name": f"rmsnorm_fp4 M={n} H={h}", "bytes": n * h * elem + n * h // 2 + scales}


@triton.jit
def ld32(ptrs, mask, MASKED: tl.constexpr, STREAM: tl.constexpr, PTX: tl.constexpr):
    """norm.triton ``ld`` (load, widen exactly to FP32); BF16 on the GPU widens with one
    instruction per element (``widen_bf16_pairs``)."""
    if PTX and ptrs.dtype.element_ty == tl.bfloat16:
        return widen_bf16_pairs(ld_raw(ptrs, mask, MASKED, STREAM))
    else:
        return ld(ptrs, mask, MASKED, STREAM)


@triton.jit
def _load_h(x_ptr, res_ptr, x_row, r_row, cols, mask, MASKED: tl.constexpr,
            HAS_RESIDUAL: tl.constexpr, EVICT_FIRST: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """f32(x), or f32(x) + f32(res) (FP32, unrounded) when HAS_RESIDUAL."""
    h = ld32(x_ptr + x_row + cols[None, :], mask, MASKED, EVICT_FIRST, PTX)
    if HAS_RESIDUAL:
        h += ld32(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST, PTX)
    return h


@triton.jit
def fp8_load(x_ptr, res_ptr, rows, cols, mask, HEADS, x_st, x_sh, r_st, r_sh,
             MASKED: tl.constexpr, STREAM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """The activation loads of one tile (stored dtype); the residual is ``x`` when absent."""
    x = ld_raw(x_ptr + row_base(rows, HEADS, x_st, x_sh)[:, None] + cols[None, :], mask, MASKED,
                STREAM)  # fmt: skip
    r = x
    if HAS_RESIDUAL:
        r = ld_raw(res_ptr + row_base(rows, HEADS, r_st, r_sh)[:, None] + cols[None, :], mask,
                    MASKED, STREAM)  # fmt: skip
    return x, r


@triton.jit
def widen_h(x, r, HAS_RESIDUAL: tl.constexpr):
    """f32(x) [+ f32(res)]: the FP32 h of ``_load_h`` from raw loads."""
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        h += r.to(tl.float32)
    return h


@triton.jit
def fp8_tile(h, w, inv, rows, cols, mask, res_ptr, q_ptr, HEADS, r_st, r_sh, q_st, q_sh, Hf, eps,
             MASKED: tl.constexpr, HAS_RESIDUAL: tl.constexpr, FMT: tl.constexpr,
             PTX: tl.constexpr, PACKED: tl.constexpr):  # fmt: skip
    """One-pass tile: [res <- cast(h)]; q = e8(((h * r) * w) * inv). PACKED: fp8_encode's
    four-element E4M3 path (the persistent loop passes False: with it, rmsnorm_quant 16384 x 4096
    under PDL ran 60.6 against 53.8 us on H200, notes/gpu-logs/
    ab-e4m3-encoder-rmsnorm-quant-2026-11-30.log, although one tile per program gains)."""
    if HAS_RESIDUAL:
        _st(res_ptr + row_base(rows, HEADS, r_st, r_sh)[:, None] + cols[None, :], h, mask,
            MASKED, PTX)  # fmt: skip
    r = _inv_rms(tl.sum(h * h, axis=1), Hf, eps)[:, None]
    q = D.fp8_encode(((h * r) * w) * inv, FMT, PTX, PACKED)
    _st_maybe(q_ptr + row_base(rows, HEADS, q_st, q_sh)[:, None] + cols[None, :], q, mask, MASKED)


# ----------------------------------------------------------------------------- FP8
# hooks of norm.triton.norm_stepped for the stepped FP8 rows: q = e8(y * (1 / scale))
@triton.jit
def _inv_scale(scale_ptr):
    """AUX hook: 1 / scale, one IEEE division (after gdc_wait: the scale may come from the
    previous kernel)."""
    return tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))


@triton.jit
def _st_fp8(ptrs, y, inv, mask, MASKED: tl.constexpr, FMT: tl.constexpr, PTX: tl.constexpr):
    _st_maybe(ptrs, D.fp8_encode(y * inv, FMT, PTX), mask, MASKED)


@triton.jit
def _st_e4m3(ptrs, y, inv, mask, MASKED: tl.constexpr, PTX: tl.constexpr):
    """OUT hook: E4M3 codes of ``y * inv``."""
    _st_fp8(ptrs, y, inv, mask, MASKED, 0, PTX)


@triton.jit
def _st_e5m2(ptrs, y, inv, mask, MASKED: tl.constexpr, PTX: tl.constexpr):
    """OUT hook: E5M2 codes of ``y * inv``."""
    _st_fp8(ptrs, y, inv, mask, MASKED, 1, PTX)


@triton.jit(do_not_specialize=["n_rows"], launch_metadata=_fp8_metadata)
def _rmsnorm_fp8_kernel(
    x_ptr, res_ptr, w_ptr, scale_ptr, q_ptr,
    n_rows, H, Hf, HEADS,
    x_st, x_sh, r_st, r_sh, q_st, q_sh,
    eps, gain_center,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, FMT: tl.constexpr, EVICT_FIRST: tl.constexpr, PTX: tl.constexpr,
    USE_PDL: tl.constexpr, PERSISTENT: tl.constexpr, PREFETCH: tl.constexpr,
    STEPPED: tl.constexpr = False, UNROLL: tl.constexpr = False,
):  # fmt: skip
    """q = e8(((h * r) * g) * (1/scale)); h = f32(x) [+ f32(res), res <- cast(h)].
    STEPPED: one row per program in NUM_CHUNKS steps of BLOCK columns (norm.triton
    ``norm_stepped`` with the FP8 output hooks)."""
    pid = tl.program_id(0)
    if STEPPED:
        x_row = row_base(pid, HEADS, x_st, x_sh)
        r_row = row_base(pid, HEADS, r_st, r_sh)
        q_row = row_base(pid, HEADS, q_st, q_sh)
        if FMT == 0:
            norm_stepped(x_ptr, res_ptr, w_ptr, q_ptr, x_row, r_row, q_row, H, Hf, eps,
                          gain_center, scale_ptr, BLOCK, NUM_CHUNKS, UNROLL, MASKED, PTX, USE_PDL,
                          HAS_RESIDUAL, "", _inv_scale, _st_e4m3)  # fmt: skip
        else:  # (a hook cannot be chosen into a variable: Triton only passes it as an argument)
            norm_stepped(x_ptr, res_ptr, w_ptr, q_ptr, x_row, r_row, q_row, H, Hf, eps,
                          gain_center, scale_ptr, BLOCK, NUM_CHUNKS, UNROLL, MASKED, PTX, USE_PDL,
                          HAS_RESIDUAL, "", _inv_scale, _st_e5m2)  # fmt: skip
    elif NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK)
        w = ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        if USE_PDL:
            gdc_wait()
        inv = tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))
        if not PERSISTENT:
            rows, mask = tile_rows(pid, cols, n_rows, H, ROWS)
            xr, rr = fp8_load(x_ptr, res_ptr, rows, cols, mask, HEADS, x_st, x_sh, r_st, r_sh,
                               MASKED, EVICT_FIRST, HAS_RESIDUAL)  # fmt: skip
            h = widen_h(xr, rr, HAS_RESIDUAL)
            if USE_PDL:
                gdc_launch_dependents()
            fp8_tile(h, w, inv, rows, cols, mask, res_ptr, q_ptr, HEADS, r_st, r_sh, q_st, q_sh,
                      Hf, eps, MASKED, HAS_RESIDUAL, FMT, PTX, True)  # fmt: skip
        else:
            # persistent row loop, optional prefetch of the next tile: see moefuse.norm.triton
            nprog = tl.num_programs(0)
            n_tiles = tl.cdiv(n_rows, ROWS)
            t = pid
            if PREFETCH:
                rows0, mask0 = tile_rows(t, cols, n_rows, H, ROWS)
                x_nx, r_nx = fp8_load(x_ptr, res_ptr, rows0, cols, mask0, HEADS, x_st, x_sh,
                                       r_st, r_sh, MASKED, EVICT_FIRST, HAS_RESIDUAL)  # fmt: skip
            while t < n_tiles:
                rows, mask = tile_rows(t, cols, n_rows, H, ROWS)
                if PREFETCH:
                    h = widen_h(x_nx, r_nx, HAS_RESIDUAL)
                    rows_n, mask_n = tile_rows(t + nprog, cols, n_rows, H, ROWS)
                    mask_n = _pf_mask(rows_n, mask_n, n_rows, MASKED, ROWS, BLOCK)
                    x_nx, r_nx = fp8_load(x_ptr, res_ptr, rows_n, cols, mask_n, HEADS, x_st,
                                           x_sh, r_st, r_sh, True, EVICT_FIRST,
                                           HAS_RESIDUAL)  # fmt: skip
                else:
                    xr, rr = fp8_load(x_ptr, res_ptr, rows, cols, mask, HEADS, x_st, x_sh, r_st,
                                       r_sh, MASKED, EVICT_FIRST, HAS_RESIDUAL)  # fmt: skip
                    h = widen_h(xr, rr, HAS_RESIDUAL)
                if USE_PDL:
                    if t + nprog >= n_tiles:
                        gdc_launch_dependents()
                fp8_tile(h, w, inv, rows, cols, mask, res_ptr, q_ptr, HEADS, r_st, r_sh, q_st,
                          q_sh, Hf, eps, MASKED, HAS_RESIDUAL, FMT, PTX, False)  # fmt: skip
                t += nprog
    else:
        rows = pid * ROWS + tl.arange(0, ROWS)
        rmask = (rows < n_rows)[:, None]
        x_row = row_base(rows, HEADS, x_st, x_sh)[:, None]
        r_row = row_base(rows, HEADS, r_st, r_sh)[:, None]
        q_row = row_base(rows, HEADS, q_st, q_sh)[:, None]
        if USE_PDL:
            gdc_wait()
        inv = tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in tl.static_range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = rmask & (cols < H)[None, :]
            h = _load_h(x_ptr, res_ptr, x_row, r_row, cols, mask, MASKED, HAS_RESIDUAL,
                        EVICT_FIRST, PTX)  # fmt: skip
            acc += h * h
        r = _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None]
        # second pass: recompute the same FP32 h (the residual is written only now, chunk by
        # chunk, after this chunk's read)
        for c in tl.static_range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = rmask & (cols < H)[None, :]
            h = _load_h(x_ptr, res_ptr, x_row, r_row, cols, mask, MASKED, HAS_RESIDUAL,
                        EVICT_FIRST, PTX)  # fmt: skip
            w = ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
            if HAS_RESIDUAL:
                _st(res_ptr + r_row + cols[None, :], h, mask, MASKED, PTX)
            q = D.fp8_encode(((h * r) * w) * inv, FMT, PTX)
            tl.store(q_ptr + q_row + cols[None, :], q, mask=mask)
        if USE_PDL:
            gdc_launch_dependents()


def launch_rmsnorm_fp8(input, residual, weight, scale, out, fmt: int, eps: float,
                       gain_center: float, use_pdl: bool, tile: RowTile | None = None,
                       unroll: bool | None = None) -> None:  # fmt: skip
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
    consts = {**_row_consts(tile, width, n_rows, unroll, fp8_loop_min_rows(tile, width), use_pdl),
              "EVICT_FIRST": _evict(tile), "HAS_RESIDUAL": residual is not None, "FMT": fmt}
    _launch(_rmsnorm_fp8_kernel, _grid(tile, tile.grid(n_rows)[0], input.device), args, consts,
            tile)  # fmt: skip


# ----------------------------------------------------------------------------- NVFP4
@triton.jit
def _fp4_epilogue(y, gs, rcp_gs, rows, live_rows, chunk, p_ptr, p_row, s_ptr, y_ptr, y_row,
                  H, KB, n_kcols, n_rows_padded, BLOCK: tl.constexpr, RECIPE: tl.constexpr,
                  LAYOUT: tl.constexpr, HAS_NORM_OUT: tl.constexpr, PTX: tl.constexpr,
                  MASKED: tl.constexpr = True):  # fmt: skip
    """Round ``y`` to the activation dtype, store it if asked, NVFP4-quantize and store one chunk.

    Rows that are padding (``live_rows`` False) quantize zeros: scale 0 and no packed store.
    MASKED False (caller's guarantee: one live row, H == BLOCK) stores without masks.
    """
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = live_rows & (cols < H)[None, :]
    yq = round_to(y, y_ptr.dtype.element_ty, PTX)
    if HAS_NORM_OUT:
        _st_maybe(y_ptr + y_row + cols[None, :], yq, mask, MASKED)
    # masked-off lanes hold 0 already (loads read 0 and the caller zeroes r of padding rows), so
    # padding rows quantize to scale 0; blocks past H are never stored
    packed, sf = D.nvfp4_quantize_rows(yq.to(tl.float32), gs, rcp_gs, BLOCK, RECIPE, PTX)
    pcols = chunk * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
    _st_maybe(p_ptr + p_row + pcols[None, :], packed, live_rows & (pcols < H // 2)[None, :],
              MASKED)  # fmt: skip
    ks = chunk * (BLOCK // 16) + tl.arange(0, BLOCK // 16)
    r64 = rows.to(tl.int64)[:, None]
    off = D.scale_offset(r64, ks[None, :].to(tl.int64), n_kcols, LAYOUT)
    _st_maybe(s_ptr + off, sf, (rows < n_rows_padded)[:, None] & (ks < KB)[None, :], MASKED)


@triton.jit
def _st_maybe(ptrs, v, mask, MASKED: tl.constexpr):
    """tl.store, with ``mask`` only when MASKED."""
    if MASKED:
        tl.store(ptrs, v, mask=mask)
    else:
        tl.store(ptrs, v)


@triton.jit
def _fp4_zero_scale_rows(s_ptr, rows, r64, KB, n_kcols, n_rows_padded, BLOCK: tl.constexpr,
                         ROWS: tl.constexpr, LAYOUT: tl.constexpr):  # fmt: skip
    """Zero scale bytes for a tile of padding rows only (e.g. rows M..127 of SWIZZLED_128x4):
    its first KB block columns of the rows below ``n_rows_padded``."""
    ks = tl.arange(0, BLOCK // 16)
    off = D.scale_offset(r64, ks[None, :].to(tl.int64), n_kcols, LAYOUT)
    tl.store(s_ptr + off, tl.zeros((ROWS, BLOCK // 16), dtype=tl.uint8),
             mask=(rows < n_rows_padded)[:, None] & (ks < KB)[None, :])


@triton.jit
def _fp4_pad_scales(s_ptr, rows, r64, KB, n_kcols, n_rows_padded, ROWS: tl.constexpr,
                    LAYOUT: tl.constexpr):  # fmt: skip
    """Zero the padding block columns [KB, n_kcols) of ``rows`` (fewer than 4)."""
    kpad = KB + tl.arange(0, 4)
    pad_off = D.scale_offset(r64, kpad[None, :].to(tl.int64), n_kcols, LAYOUT)
    pad_mask = (rows < n_rows_padded)[:, None] & (kpad < n_kcols)[None, :]
    tl.store(s_ptr + pad_off, tl.zeros((ROWS, 4), dtype=tl.uint8), mask=pad_mask)


@triton.jit
def _rmsnorm_fp4_rows(x_ptr, res_ptr, w_ptr, gs_ptr, p_ptr, s_ptr, y_ptr, pid, n_rows,
                      n_rows_padded, H, Hf, KB, n_kcols, x_st, r_st, p_st, y_st, eps,
                      gain_center, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                      HAS_RESIDUAL: tl.constexpr, HAS_NORM_OUT: tl.constexpr,
                      RECIPE: tl.constexpr, LAYOUT: tl.constexpr, EVICT_FIRST: tl.constexpr,
                      PTX: tl.constexpr, USE_PDL: tl.constexpr,
                      PREFETCH: tl.constexpr):  # fmt: skip
    """One-pass rows of ``_rmsnorm_fp4_kernel``: a persistent loop over the row tiles of the
    PADDED rows (t = pid, pid + nprog, ...); tiles of padding rows only store zero scale bytes.
    With PREFETCH the next tile's activations are loaded (row-masked: nothing for padding rows or
    past the last tile) before the current tile is reduced."""
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows_padded, ROWS)
    # parameters before the grid-dependency wait; activations and every store after it
    cols = tl.arange(0, BLOCK)
    w = ld(w_ptr + cols, cols < H, True, False)[None, :] + gain_center
    if USE_PDL:
        gdc_wait()
    gs = tl.load(gs_ptr).to(tl.float32)
    t = pid
    if PREFETCH:
        rows0, mask0 = tile_rows(t, cols, n_rows, H, ROWS)
        x_nx = ld_raw(x_ptr + rows0.to(tl.int64)[:, None] * x_st + cols[None, :], mask0, True,
                       EVICT_FIRST)  # fmt: skip
        if HAS_RESIDUAL:
            r_nx = ld_raw(res_ptr + rows0.to(tl.int64)[:, None] * r_st + cols[None, :], mask0,
                           True, EVICT_FIRST)  # fmt: skip
    while t < n_tiles:
        rows, mask = tile_rows(t, cols, n_rows, H, ROWS)
        live_rows = (rows < n_rows)[:, None]
        r64 = rows.to(tl.int64)[:, None]
        if PREFETCH:
            h = x_nx.to(tl.float32)
            if HAS_RESIDUAL:
                h += r_nx.to(tl.float32)
            rows_n, mask_n = tile_rows(t + nprog, cols, n_rows, H, ROWS)
            x_nx = ld_raw(x_ptr + rows_n.to(tl.int64)[:, None] * x_st + cols[None, :], mask_n,
                           True, EVICT_FIRST)  # fmt: skip
            if HAS_RESIDUAL:
                r_nx = ld_raw(res_ptr + rows_n.to(tl.int64)[:, None] * r_st + cols[None, :],
                               mask_n, True, EVICT_FIRST)  # fmt: skip
            if USE_PDL:
                if t + nprog >= n_tiles:
                    gdc_launch_dependents()
        _fp4_pad_scales(s_ptr, rows, r64, KB, n_kcols, n_rows_padded, ROWS, LAYOUT)
        if t * ROWS >= n_rows:
            _fp4_zero_scale_rows(s_ptr, rows, r64, KB, n_kcols, n_rows_padded, BLOCK, ROWS,
                                 LAYOUT)  # fmt: skip
        else:
            if not PREFETCH:
                h = _load_h(x_ptr, res_ptr, r64 * x_st, r64 * r_st, cols, mask, True,
                            HAS_RESIDUAL, EVICT_FIRST, PTX)  # fmt: skip
                if USE_PDL:
                    if t + nprog >= n_tiles:
                        gdc_launch_dependents()
            if HAS_RESIDUAL:
                _st(res_ptr + r64 * r_st + cols[None, :], h, mask, True, PTX)
            # r = 0 on padding rows: y = 0 there even when eps = 0 makes rsqrt(0) infinite
            r = tl.where(live_rows, _inv_rms(tl.sum(h * h, axis=1), Hf, eps)[:, None], 0.0)
            _fp4_epilogue((h * r) * w, gs, rcp_fast(gs, PTX), rows, live_rows, 0, p_ptr,
                          r64 * p_st, s_ptr, y_ptr, r64 * y_st, H, KB, n_kcols, n_rows_padded,
                          BLOCK, RECIPE, LAYOUT, HAS_NORM_OUT, PTX)  # fmt: skip
        t += nprog


@triton.jit(do_not_specialize=["n_rows", "n_rows_padded"], launch_metadata=_fp4_metadata)
def _rmsnorm_fp4_kernel(
    x_ptr, res_ptr, w_ptr, gs_ptr, p_ptr, s_ptr, y_ptr,
    n_rows, n_rows_padded, H, Hf, KB, n_kcols,
    x_st, r_st, p_st, y_st,
    eps, gain_center,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_NORM_OUT: tl.constexpr, RECIPE: tl.constexpr,
    LAYOUT: tl.constexpr, EVICT_FIRST: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr, PREFETCH: tl.constexpr, MASKED: tl.constexpr = True,
):  # fmt: skip
    """y = cast((h * r) * g); (packed, scales) = nvfp4(y); grid over the padded rows.
    MASKED False (one row per tile, H == BLOCK): the one-pass tile loads and stores unmasked.

    PERSISTENT one-pass rows run the loop of ``_rmsnorm_fp4_rows``; otherwise one tile per
    program (the code below)."""
    pid = tl.program_id(0)
    if NUM_CHUNKS == 1 and PERSISTENT:
        _rmsnorm_fp4_rows(x_ptr, res_ptr, w_ptr, gs_ptr, p_ptr, s_ptr, y_ptr, pid, n_rows,
                          n_rows_padded, H, Hf, KB, n_kcols, x_st, r_st, p_st, y_st, eps,
                          gain_center, BLOCK, ROWS, HAS_RESIDUAL, HAS_NORM_OUT, RECIPE, LAYOUT,
                          EVICT_FIRST, PTX, USE_PDL, PREFETCH)  # fmt: skip
    elif NUM_CHUNKS == 1:
        # parameters before the grid-dependency wait; activations and every store after it
        cols = tl.arange(0, BLOCK)
        w = ld32(w_ptr + cols, cols < H, MASKED, False, PTX)[None, :] + gain_center
        if USE_PDL:
            gdc_wait()
        fp4_tile(pid, w, x_ptr, res_ptr, gs_ptr, p_ptr, s_ptr, y_ptr, n_rows, n_rows_padded, H,
                  Hf, KB, n_kcols, x_st, r_st, p_st, y_st, eps, BLOCK, ROWS, HAS_RESIDUAL,
                  HAS_NORM_OUT, RECIPE, LAYOUT, EVICT_FIRST, PTX, USE_PDL, MASKED)  # fmt: skip
    else:
        rows = pid * ROWS + tl.arange(0, ROWS)
        live_rows = (rows < n_rows)[:, None]
        r64 = rows.to(tl.int64)[:, None]
        x_row = r64 * x_st
        r_row = r64 * r_st
        p_row = r64 * p_st
        y_row = r64 * y_st
        if USE_PDL:
            gdc_wait()
        # padding block columns [KB, n_kcols) of every row this program owns (fewer than 4)
        _fp4_pad_scales(s_ptr, rows, r64, KB, n_kcols, n_rows_padded, ROWS, LAYOUT)
        if pid * ROWS >= n_rows:
            # a program of padding rows only (e.g. rows M..127 of SWIZZLED_128x4): zero scale bytes,
            # no loads, no math
            smask_rows = (rows < n_rows_padded)[:, None]
            for c in tl.static_range(NUM_CHUNKS):
                ks = c * (BLOCK // 16) + tl.arange(0, BLOCK // 16)
                off = D.scale_offset(r64, ks[None, :].to(tl.int64), n_kcols, LAYOUT)
                tl.store(s_ptr + off, tl.zeros((ROWS, BLOCK // 16), dtype=tl.uint8),
                         mask=smask_rows & (ks < KB)[None, :])  # fmt: skip
        else:
            gs = tl.load(gs_ptr).to(tl.float32)
            acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
            for c in tl.static_range(NUM_CHUNKS):
                cols = c * BLOCK + tl.arange(0, BLOCK)
                mask = live_rows & (cols < H)[None, :]
                h = _load_h(x_ptr, res_ptr, x_row, r_row, cols, mask, True, HAS_RESIDUAL,
                            EVICT_FIRST, PTX)  # fmt: skip
                acc += h * h
            r = tl.where(live_rows, _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None], 0.0)
            rcp_gs = rcp_fast(gs, PTX)
            for c in tl.static_range(NUM_CHUNKS):
                cols = c * BLOCK + tl.arange(0, BLOCK)
                mask = live_rows & (cols < H)[None, :]
                h = _load_h(x_ptr, res_ptr, x_row, r_row, cols, mask, True, HAS_RESIDUAL,
                            EVICT_FIRST, PTX)  # fmt: skip
                w = ld(w_ptr + cols, cols < H, True, False)[None, :] + gain_center
                if HAS_RESIDUAL:
                    _st(res_ptr + r_row + cols[None, :], h, mask, True, PTX)
                _fp4_epilogue((h * r) * w, gs, rcp_gs, rows, live_rows, c, p_ptr, p_row, s_ptr,
                              y_ptr, y_row, H, KB, n_kcols, n_rows_padded, BLOCK, RECIPE, LAYOUT,
                              HAS_NORM_OUT, PTX)  # fmt: skip
            if USE_PDL:
                gdc_launch_dependents()


@triton.jit
def fp4_tile(t, w, x_ptr, res_ptr, gs_ptr, p_ptr, s_ptr, y_ptr, n_rows, n_rows_padded, H, Hf,
             KB, n_kcols, x_st, r_st, p_st, y_st, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr,
             HAS_RESIDUAL: tl.constexpr, HAS_NORM_OUT: tl.constexpr, RECIPE: tl.constexpr,
             LAYOUT: tl.constexpr, EVICT_FIRST: tl.constexpr, PTX: tl.constexpr,
             USE_PDL: tl.constexpr, MASKED: tl.constexpr, x_in=None,
             GIVEN_X: tl.constexpr = False):  # fmt: skip
    """One-pass row tile ``t`` of ``_rmsnorm_fp4_kernel`` (one tile per program), after the
    grid-dependency wait; ``w`` = f32(weight) + gain_center [1, BLOCK]. Zeroes the padding block
    columns of its rows, then either zero scale bytes (a tile of padding rows only) or norm +
    NVFP4 of the tile. Also the tile of the fused all-gather kernels (comm/all_gather/decode.py):
    one piece of code, so the same bits. ``GIVEN_X``: the tile's input rows are ``x_in``
    [ROWS, BLOCK] (stored dtype, masked elements 0; no residual) instead of loads of ``x_ptr``."""
    rows = t * ROWS + tl.arange(0, ROWS)
    live_rows = (rows < n_rows)[:, None]
    r64 = rows.to(tl.int64)[:, None]
    _fp4_pad_scales(s_ptr, rows, r64, KB, n_kcols, n_rows_padded, ROWS, LAYOUT)
    if t * ROWS >= n_rows:  # no loads, no math
        _fp4_zero_scale_rows(s_ptr, rows, r64, KB, n_kcols, n_rows_padded, BLOCK, ROWS, LAYOUT)
    else:
        cols = tl.arange(0, BLOCK)
        mask = live_rows & (cols < H)[None, :]
        gs = tl.load(gs_ptr).to(tl.float32)
        if GIVEN_X:
            h = x_in.to(tl.float32)
        else:
            h = _load_h(x_ptr, res_ptr, r64 * x_st, r64 * r_st, cols, mask, MASKED, HAS_RESIDUAL,
                        EVICT_FIRST, PTX)  # fmt: skip
        if USE_PDL:
            gdc_launch_dependents()
        if HAS_RESIDUAL:
            _st(res_ptr + r64 * r_st + cols[None, :], h, mask, MASKED, PTX)
        # r = 0 on padding rows: y = 0 there even when eps = 0 makes rsqrt(0) infinite
        r = tl.where(live_rows, _inv_rms(tl.sum(h * h, axis=1), Hf, eps)[:, None], 0.0)
        _fp4_epilogue((h * r) * w, gs, rcp_fast(gs, PTX), rows, live_rows, 0, p_ptr, r64 * p_st,
                      s_ptr, y_ptr, r64 * y_st, H, KB, n_kcols, n_rows_padded, BLOCK, RECIPE,
                      LAYOUT, HAS_NORM_OUT, PTX, MASKED)  # fmt: skip


def launch_rmsnorm_fp4(input, residual, weight, global_scale, packed, scales, norm_out,
                       eps: float, gain_center: float, layout: str, recipe: str,
                       use_pdl: bool, tile: RowTile | None = None) -> None:  # fmt: skip
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
    launch(_rmsnorm_fp4_kernel, grid,
        input, residual if residual is not None else input, weight, global_scale, packed,
        scales, y,
        m, rows_p, width, float(width), kb, n_kcols,
        input.stride(0), residual.stride(0) if residual is not None else 0, packed.stride(0),
        y.stride(0),
        eps, gain_center,
        BLOCK=tile.block, NUM_CHUNKS=tile.num_chunks, ROWS=tile.rows,
        HAS_RESIDUAL=residual is not None, HAS_NORM_OUT=norm_out is not None,
        RECIPE=RECIPES[recipe], LAYOUT=LAYOUTS[layout], EVICT_FIRST=_evict(tile),
        PTX=not interpreter_active(), PERSISTENT=_persistent(tile), PREFETCH=_prefetch(tile),
        USE_PDL=use_pdl, MASKED=tile.rows > 1 or not tile.even(width),
        num_warps=tile.num_warps, **_launch_kwargs(tile, use_pdl),
    )  # fmt: skip
