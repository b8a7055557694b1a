"""Triton kernels and launchers of the standalone quantizers (spec: Quantization).

* ``_fp8_quantize_kernel``: static per-tensor FP8, elementwise over ``[BLOCK_M, BLOCK_N]`` tiles.
* ``_fp8_per_token_kernel``: dynamic per-token E4M3; rows as in the norm kernels (one row in
  registers, or two passes over chunks for very wide rows).
* ``_fp8_dequantize_kernel`` / ``_fp4_dequantize_kernel``: the inverse maps.
* ``_fp4_quantize_kernel``: NVFP4 over ``[BLOCK_M, BLOCK_K, 16]`` tiles whose grid covers the
  PADDED scale matrix, so padding rows/columns quantize masked-off zeros and store scale 0 — the
  kernel itself writes every scale byte, padding included.

All tile shapes are functions of the row width only; the token count is a run-time argument that
never recompiles (``do_not_specialize``). Quantization is per element or per 16-element block, so
no result depends on the grid. PDL: ``gdc_wait`` before the first load of activations (scales are
loaded after it too: they may come from the previous kernel), ``gdc_launch_dependents`` after the
last load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import rcp_fast, round_to
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs
from moefuse.norm.tiles import next_pow2, row_tile
from moefuse.quant import device as D
from moefuse.quant.formats import LAYOUTS, RECIPES, scale_layout_shape

ELEMENTWISE_TILE = 4096  # elements per program of the elementwise kernels


def _ptx() -> bool:
    return not interpreter_active()


def _fp8_metadata(grid, kernel, args):
    n, h = args["n_rows"], args["H"]
    return {
        "name": f"fp8_quantize M={n} H={h}",
        "bytes": n * h * (args["x_ptr"].element_size() + 1),
    }


def _fp4_metadata(grid, kernel, args):
    n, kb = args["n_rows"], args["KB"]
    scales = args["n_rows_padded"] * args["n_kcols"]
    return {
        "name": f"fp4_quantize M={n} H={16 * kb}",
        "bytes": n * kb * 16 * args["x_ptr"].element_size() + n * kb * 8 + scales,
    }


# ----------------------------------------------------------------------------- FP8 static
@triton.jit(do_not_specialize=["n_rows"], launch_metadata=_fp8_metadata)
def _fp8_quantize_kernel(
    x_ptr,
    scale_ptr,
    q_ptr,
    n_rows,
    H,
    HEADS,
    x_st,
    x_sh,
    q_st,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """q[row, col] = e8(f32(x) * (1/scale)); rows addressed (row // HEADS, row % HEADS)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    r64 = rows.to(tl.int64)
    x_row = ((r64 // HEADS) * x_st + (r64 % HEADS) * x_sh)[:, None]
    if USE_PDL:
        gdc_wait()
    inv = tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))
    x = tl.load(
        x_ptr + x_row + cols[None, :], mask=mask, other=0.0, eviction_policy="evict_first"
    ).to(tl.float32)
    if USE_PDL:
        gdc_launch_dependents()
    q = D.fp8_encode(x * inv, FMT, PTX)
    tl.store(q_ptr + r64[:, None] * q_st + cols[None, :], q, mask=mask)


def _elementwise_tile(width: int) -> tuple[int, int, int]:
    block_n = min(next_pow2(width), 1024)
    block_m = max(1, ELEMENTWISE_TILE // block_n)
    return block_m, block_n, 4


def _rows_of(t: torch.Tensor) -> tuple[int, int, int, int]:
    """(rows, heads, stride_t, stride_h) of a 2-D or 3-D tensor viewed as rows of its last dim."""
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def launch_fp8_quantize(
    input, scale, q, fmt: int, use_pdl: bool, tile: tuple[int, int, int] | None = None
) -> None:
    """``input`` 2-D/3-D (last dim contiguous), ``q`` contiguous uint8 (FP8 bits, format ``fmt``)
    of the same shape. ``tile`` = (BLOCK_M, BLOCK_N, warps) overrides the width's tile (sweeps)."""
    n_rows, heads, x_st, x_sh = _rows_of(input)
    width = input.shape[-1]
    if n_rows == 0 or width == 0:
        return
    bm, bn, warps = tile or _elementwise_tile(width)
    grid = (triton.cdiv(n_rows, bm), triton.cdiv(width, bn))
    launch(
        _fp8_quantize_kernel,
        grid,
        input,
        scale,
        q,
        n_rows,
        width,
        heads,
        x_st,
        x_sh,
        width,
        BLOCK_M=bm,
        BLOCK_N=bn,
        FMT=fmt,
        PTX=_ptx(),
        USE_PDL=use_pdl,
        num_warps=warps,
        **pdl_launch_kwargs(use_pdl),
    )


# ----------------------------------------------------------------------------- FP8 per token
@triton.jit(do_not_specialize=["n_rows"])
def _fp8_per_token_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    n_rows,
    H,
    HEADS,
    x_st,
    x_sh,
    q_st,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """s = max(amax/448, 2^-9/448) per row (NaN propagates); q = e4m3(v / s), IEEE division."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rmask = rows < n_rows
    r64 = rows.to(tl.int64)
    x_row = ((r64 // HEADS) * x_st + (r64 % HEADS) * x_sh)[:, None]
    q_row = (r64 * q_st)[:, None]
    if USE_PDL:
        gdc_wait()
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK)
        mask = rmask[:, None] & (cols < H)[None, :]
        x = tl.load(x_ptr + x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if USE_PDL:
            gdc_launch_dependents()
        s = _per_token_scale(x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF)
        tl.store(s_ptr + r64, s, mask=rmask)
        q = D.fp8_encode(tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape)), 0, PTX)
        tl.store(q_ptr + q_row + cols[None, :], q, mask=mask)
    else:
        amax_bits = tl.zeros((ROWS, BLOCK), dtype=tl.uint32)
        for c in tl.static_range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = rmask[:, None] & (cols < H)[None, :]
            x = tl.load(x_ptr + x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax_bits = tl.maximum(amax_bits, x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF)
        s = _per_token_scale(amax_bits)
        tl.store(s_ptr + r64, s, mask=rmask)
        for c in tl.static_range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = rmask[:, None] & (cols < H)[None, :]
            x = tl.load(x_ptr + x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            q = D.fp8_encode(tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape)), 0, PTX)
            tl.store(q_ptr + q_row + cols[None, :], q, mask=mask)
        if USE_PDL:
            gdc_launch_dependents()


@triton.jit
def _per_token_scale(abs_bits):
    """Row scale from ``[ROWS, BLOCK]`` |x| bits: integer max (exact; NaN, the largest pattern,
    propagates), then ``max(amax/448, 2^-9/448)`` with a NaN amax kept as NaN."""
    amax = tl.max(abs_bits, axis=1).to(tl.float32, bitcast=True)
    return tl.where(amax != amax, amax, D.fp8_amax_scale(amax))


def launch_fp8_quantize_per_token(input, q, scales, use_pdl: bool) -> None:
    n_rows, heads, x_st, x_sh = _rows_of(input)
    width = input.shape[-1]
    if n_rows == 0:
        return
    tile = row_tile(max(width, 1))
    launch(
        _fp8_per_token_kernel,
        tile.grid(n_rows),
        input,
        q,
        scales,
        n_rows,
        width,
        heads,
        x_st,
        x_sh,
        width,
        BLOCK=tile.block,
        NUM_CHUNKS=tile.num_chunks,
        ROWS=tile.rows,
        PTX=_ptx(),
        USE_PDL=use_pdl,
        num_warps=tile.num_warps,
        **pdl_launch_kwargs(use_pdl),
    )


# ----------------------------------------------------------------------------- FP8 dequant
@triton.jit(do_not_specialize=["n_rows"])
def _fp8_dequantize_kernel(
    q_ptr,
    scale_ptr,
    out_ptr,
    n_rows,
    H,
    HEADS,
    q_st,
    q_sh,
    o_st,
    s_st,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FMT: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out = cast(f32(q) * scale[row * s_st]) (s_st = 0: one per-tensor scale)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < H)[None, :]
    r64 = rows.to(tl.int64)
    q_row = ((r64 // HEADS) * q_st + (r64 % HEADS) * q_sh)[:, None]
    if USE_PDL:
        gdc_wait()
    s = tl.load(scale_ptr + r64 * s_st, mask=rmask, other=1.0).to(tl.float32)[:, None]
    qb = tl.load(q_ptr + q_row + cols[None, :], mask=mask, other=0)
    if USE_PDL:
        gdc_launch_dependents()
    val = D.fp8_decode(qb, FMT) * s
    tl.store(
        out_ptr + (r64 * o_st)[:, None] + cols[None, :],
        round_to(val, out_ptr.dtype.element_ty, PTX),
        mask=mask,
    )


def launch_fp8_dequantize(input, scale, out, fmt: int, use_pdl: bool) -> None:
    n_rows, heads, q_st, q_sh = _rows_of(input)
    width = input.shape[-1]
    if n_rows == 0 or width == 0:
        return
    bm, bn, warps = _elementwise_tile(width)
    grid = (triton.cdiv(n_rows, bm), triton.cdiv(width, bn))
    launch(
        _fp8_dequantize_kernel,
        grid,
        input,
        scale,
        out,
        n_rows,
        width,
        heads,
        q_st,
        q_sh,
        width,
        0 if scale.numel() == 1 else 1,
        BLOCK_M=bm,
        BLOCK_N=bn,
        FMT=fmt,
        PTX=_ptx(),
        USE_PDL=use_pdl,
        num_warps=warps,
        **pdl_launch_kwargs(use_pdl),
    )


# ----------------------------------------------------------------------------- NVFP4
@triton.jit(do_not_specialize=["n_rows", "n_rows_padded"], launch_metadata=_fp4_metadata)
def _fp4_quantize_kernel(
    x_ptr,
    gs_ptr,
    p_ptr,
    s_ptr,
    n_rows,
    n_rows_padded,
    KB,
    n_kcols,
    x_st,
    p_st,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RECIPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One [BLOCK_M rows, BLOCK_K blocks, 16] tile; the grid covers the padded scale matrix."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    js = tl.arange(0, 16)
    r64 = rows.to(tl.int64)
    live = (rows < n_rows)[:, None] & (ks < KB)[None, :]  # [BM, BK] blocks holding data
    cols = ks[:, None] * 16 + js[None, :]  # [BK, 16]
    if USE_PDL:
        gdc_wait()
    gs = tl.load(gs_ptr).to(tl.float32)
    x = tl.load(
        x_ptr + (r64 * x_st)[:, None, None] + cols[None, :, :],
        mask=live[:, :, None],
        other=0.0,
        eviction_policy="evict_first",
    ).to(tl.float32)
    if USE_PDL:
        gdc_launch_dependents()
    packed, sf = D.nvfp4_quantize_3d(x, gs, rcp_fast(gs, PTX), RECIPE, PTX)
    pcols = ks[:, None] * 8 + tl.arange(0, 8)[None, :]
    tl.store(p_ptr + (r64 * p_st)[:, None, None] + pcols[None, :, :], packed, mask=live[:, :, None])
    off = D.scale_offset(r64[:, None], ks[None, :].to(tl.int64), n_kcols, LAYOUT)
    smask = (rows < n_rows_padded)[:, None] & (ks < n_kcols)[None, :]
    tl.store(s_ptr + off, tl.where(live, sf, 0), mask=smask)


#: fp4_quantize's tile takes up to this many 16-element blocks of a row (512 bytes of BF16), and
#: as many rows as make ELEMENTWISE_TILE elements. H200 (90f68c0:scripts/sweep_quant_tiles.py,
#: notes/gpu-logs/sweep-quant-tiles-2026-11-30.log), us, 32 rows x 8 blocks -> 16 x 16, 4 warps:
#: 16384 x 4096 79.56 -> 62.13, 2048 x 4096 12.53 -> 9.77, 16384 x 7168 146.87 -> 109.38,
#: M = 128 2.61 -> 2.46 (4096), M = 1 1.37 -> 1.39 (4096) and 1.60 -> 1.83 (7168). Whole rows
#: (1 x 256) were slower (63.6 / 119.3 at 16384).
FP4_QUANT_MAX_BLOCKS = 16


def _fp4_tile(kb: int, max_blocks: int = 8) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_K, warps) over ``kb`` 16-element blocks per row: up to ``max_blocks``
    blocks of a row (fp4_quantize: FP4_QUANT_MAX_BLOCKS; the dequantizer keeps 8), 4096
    elements, 4 warps."""
    block_k = min(next_pow2(max(kb, 1)), max_blocks)
    block_m = max(1, ELEMENTWISE_TILE // (16 * block_k))
    return block_m, block_k, 4


def launch_fp4_quantize(
    input,
    global_scale,
    packed,
    scales,
    layout: str,
    recipe: str,
    use_pdl: bool,
    tile: tuple[int, int, int] | None = None,
) -> None:
    """``input`` [M, H] (H % 16 == 0, unit last stride); outputs allocated by the caller.
    ``tile`` = (BLOCK_M, BLOCK_K, warps) overrides the width's tile (sweeps; no bit changes)."""
    m, width = input.shape
    kb = width // 16
    rows_p, n_kcols = scale_layout_shape(m, kb, layout)
    if rows_p == 0 or kb == 0:
        return
    bm, bk, warps = tile or _fp4_tile(kb, FP4_QUANT_MAX_BLOCKS)
    grid = (triton.cdiv(rows_p, bm), triton.cdiv(n_kcols, bk))
    launch(
        _fp4_quantize_kernel,
        grid,
        input,
        global_scale,
        packed,
        scales,
        m,
        rows_p,
        kb,
        n_kcols,
        input.stride(0),
        packed.stride(0),
        BLOCK_M=bm,
        BLOCK_K=bk,
        RECIPE=RECIPES[recipe],
        LAYOUT=LAYOUTS[layout],
        PTX=_ptx(),
        USE_PDL=use_pdl,
        num_warps=warps,
        **pdl_launch_kwargs(use_pdl),
    )


@triton.jit(do_not_specialize=["n_rows"])
def _fp4_dequantize_kernel(
    p_ptr,
    s_ptr,
    gs_ptr,
    out_ptr,
    n_rows,
    KB,
    n_kcols,
    p_st,
    o_st,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LAYOUT: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out = cast((e2m1(code) * f32(sf)) / gs) over [BLOCK_M, BLOCK_K, 16] tiles."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r64 = rows.to(tl.int64)
    live = (rows < n_rows)[:, None] & (ks < KB)[None, :]
    pcols = ks[:, None] * 8 + tl.arange(0, 8)[None, :]
    if USE_PDL:
        gdc_wait()
    gs = tl.load(gs_ptr).to(tl.float32)
    pk = tl.load(
        p_ptr + (r64 * p_st)[:, None, None] + pcols[None, :, :], mask=live[:, :, None], other=0
    ).to(tl.int32)
    off = D.scale_offset(r64[:, None], ks[None, :].to(tl.int64), n_kcols, LAYOUT)
    sf = tl.load(s_ptr + off, mask=live, other=0)
    if USE_PDL:
        gdc_launch_dependents()
    nib = tl.reshape(tl.join(pk & 15, pk >> 4), (BLOCK_M, BLOCK_K, 16))
    prod = D.e2m1_decode(nib) * D.fp8_decode(sf, 0)[:, :, None]
    val = tl.math.div_rn(prod, tl.zeros_like(prod) + gs)
    cols = ks[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(
        out_ptr + (r64 * o_st)[:, None, None] + cols[None, :, :],
        round_to(val, out_ptr.dtype.element_ty, PTX),
        mask=live[:, :, None],
    )


def launch_fp4_dequantize(packed, scales, global_scale, out, layout: str, use_pdl: bool) -> None:
    m, half = packed.shape
    kb = 2 * half // 16
    if m == 0 or kb == 0:
        return
    n_kcols = scale_layout_shape(m, kb, layout)[1]
    bm, bk, warps = _fp4_tile(kb)
    grid = (triton.cdiv(m, bm), triton.cdiv(kb, bk))
    launch(
        _fp4_dequantize_kernel,
        grid,
        packed,
        scales,
        global_scale,
        out,
        m,
        kb,
        n_kcols,
        packed.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_K=bk,
        LAYOUT=LAYOUTS[layout],
        PTX=_ptx(),
        USE_PDL=use_pdl,
        num_warps=warps,
        **pdl_launch_kwargs(use_pdl),
    )


# ----------------------------------------------------------------------------- test helper
@triton.jit
def _rcp_approx_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PTX: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, rcp_fast(tl.load(x_ptr + offs, mask=mask, other=1.0), PTX), mask=mask)


def rcp_approx(x: torch.Tensor) -> torch.Tensor:
    """Elementwise ``rcp_fast`` of an FP32 tensor on its device (``rcp.approx.ftz.f32`` on the GPU,
    IEEE in the interpreter) — the ``rcp`` hook that makes the "fast" reference bit-exact."""
    x = x.float().contiguous()
    y = torch.empty_like(x)
    if x.numel():
        launch(
            _rcp_approx_kernel,
            (triton.cdiv(x.numel(), 1024),),
            x,
            y,
            x.numel(),
            BLOCK=1024,
            PTX=_ptx(),
        )
    return y
