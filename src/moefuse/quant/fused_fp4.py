"""The fused RMSNorm (+ residual add) + NVFP4 kernel (:mod:`moefuse.quant.fused` has the numbers,
the tile policies and the launcher): ``y = cast((h * r) * g)`` rounded to the activation dtype,
then the NVFP4 recipe on each 16-element block of ``y``, over the layout's PADDED rows (every
scale byte written). Also ``fp4_tile``, the one-pass tile the all-gather family reuses.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import rcp_fast, round_to
from moefuse.norm.triton import _inv_rms, _st, ld, ld_raw, tile_rows
from moefuse.quant import device as D
from moefuse.quant.fused_rows import _load_h, _st_maybe, ld32


def _fp4_metadata(grid, kernel, args):
    n, h = args["n_rows"], args["H"]
    e = args["x_ptr"].element_size()
    elem = e * (3 if args["HAS_RESIDUAL"] else 1) + (e if args["HAS_NORM_OUT"] else 0)
    scales = args["n_rows_padded"] * args["n_kcols"]
    return {"name": f"rmsnorm_fp4 M={n} H={h}", "bytes": n * h * elem + n * h // 2 + scales}


# ----------------------------------------------------------------------------- rows
@triton.jit
def _fp4_epilogue(
    y,
    gs,
    rcp_gs,
    rows,
    live_rows,
    chunk,
    p_ptr,
    p_row,
    s_ptr,
    y_ptr,
    y_row,
    H,
    KB,
    n_kcols,
    n_rows_padded,
    BLOCK: tl.constexpr,
    RECIPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    HAS_NORM_OUT: tl.constexpr,
    PTX: tl.constexpr,
    MASKED: tl.constexpr = True,
):
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
    _st_maybe(p_ptr + p_row + pcols[None, :], packed, live_rows & (pcols < H // 2)[None, :], MASKED)
    ks = chunk * (BLOCK // 16) + tl.arange(0, BLOCK // 16)
    r64 = rows.to(tl.int64)[:, None]
    off = D.scale_offset(r64, ks[None, :].to(tl.int64), n_kcols, LAYOUT)
    _st_maybe(s_ptr + off, sf, (rows < n_rows_padded)[:, None] & (ks < KB)[None, :], MASKED)


@triton.jit
def _fp4_zero_scale_rows(
    s_ptr,
    rows,
    r64,
    KB,
    n_kcols,
    n_rows_padded,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    LAYOUT: tl.constexpr,
):
    """Zero scale bytes for a tile of padding rows only (e.g. rows M..127 of SWIZZLED_128x4):
    its first KB block columns of the rows below ``n_rows_padded``."""
    ks = tl.arange(0, BLOCK // 16)
    off = D.scale_offset(r64, ks[None, :].to(tl.int64), n_kcols, LAYOUT)
    tl.store(
        s_ptr + off,
        tl.zeros((ROWS, BLOCK // 16), dtype=tl.uint8),
        mask=(rows < n_rows_padded)[:, None] & (ks < KB)[None, :],
    )


@triton.jit
def _fp4_pad_scales(
    s_ptr, rows, r64, KB, n_kcols, n_rows_padded, ROWS: tl.constexpr, LAYOUT: tl.constexpr
):
    """Zero the padding block columns [KB, n_kcols) of ``rows`` (fewer than 4)."""
    kpad = KB + tl.arange(0, 4)
    pad_off = D.scale_offset(r64, kpad[None, :].to(tl.int64), n_kcols, LAYOUT)
    pad_mask = (rows < n_rows_padded)[:, None] & (kpad < n_kcols)[None, :]
    tl.store(s_ptr + pad_off, tl.zeros((ROWS, 4), dtype=tl.uint8), mask=pad_mask)


# ``ptrs`` = (x, res, w, gs, p, s, y) pointers, ``strides`` = (x_st, r_st, p_st, y_st) and
# ``sizes`` = (n_rows, n_rows_padded, H, Hf, KB, n_kcols): the kernel's arguments, grouped for its
# row modes.
@triton.jit
def _fp4_norm_tile(
    h,
    w,
    gs,
    rows,
    live_rows,
    r64,
    cols,
    mask,
    ptrs,
    strides,
    sizes,
    eps,
    BLOCK: tl.constexpr,
    RECIPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM_OUT: tl.constexpr,
    PTX: tl.constexpr,
    MASKED: tl.constexpr,
):
    """A live one-pass tile from its FP32 ``h``: [res <- cast(h)], ``y = (h * r) * w`` and its
    NVFP4 (:func:`_fp4_epilogue`); ``r`` = 0 on padding rows."""
    x_ptr, res_ptr, w_ptr, gs_ptr, p_ptr, s_ptr, y_ptr = ptrs
    x_st, r_st, p_st, y_st = strides
    n_rows, n_rows_padded, H, Hf, KB, n_kcols = sizes
    if HAS_RESIDUAL:
        _st(res_ptr + r64 * r_st + cols[None, :], h, mask, MASKED, PTX)
    # r = 0 on padding rows: y = 0 there even when eps = 0 makes rsqrt(0) infinite
    r = tl.where(live_rows, _inv_rms(tl.sum(h * h, axis=1), Hf, eps)[:, None], 0.0)
    _fp4_epilogue(
        (h * r) * w,
        gs,
        rcp_fast(gs, PTX),
        rows,
        live_rows,
        0,
        p_ptr,
        r64 * p_st,
        s_ptr,
        y_ptr,
        r64 * y_st,
        H,
        KB,
        n_kcols,
        n_rows_padded,
        BLOCK,
        RECIPE,
        LAYOUT,
        HAS_NORM_OUT,
        PTX,
        MASKED,
    )


@triton.jit
def _ld_rows(ptr, rows, cols, mask, st, STREAM: tl.constexpr):
    """Raw (stored dtype) loads of ``rows`` x ``cols`` at row stride ``st``, masked."""
    return ld_raw(ptr + rows.to(tl.int64)[:, None] * st + cols[None, :], mask, True, STREAM)


@triton.jit
def _rmsnorm_fp4_rows(
    ptrs,
    strides,
    sizes,
    pid,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM_OUT: tl.constexpr,
    RECIPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """One-pass rows of ``_rmsnorm_fp4_kernel``: a persistent loop over the row tiles of the
    PADDED rows (t = pid, pid + nprog, ...); tiles of padding rows only store zero scale bytes.
    With PREFETCH the next tile's activations are loaded (row-masked: nothing for padding rows or
    past the last tile) before the current tile is reduced."""
    x_ptr, res_ptr, w_ptr, gs_ptr, p_ptr, s_ptr, y_ptr = ptrs
    x_st, r_st, p_st, y_st = strides
    n_rows, n_rows_padded, H, Hf, KB, n_kcols = sizes
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
        x_nx = _ld_rows(x_ptr, rows0, cols, mask0, x_st, EVICT_FIRST)
        if HAS_RESIDUAL:
            r_nx = _ld_rows(res_ptr, rows0, cols, mask0, r_st, EVICT_FIRST)
    while t < n_tiles:
        rows, mask = tile_rows(t, cols, n_rows, H, ROWS)
        live_rows = (rows < n_rows)[:, None]
        r64 = rows.to(tl.int64)[:, None]
        if PREFETCH:
            h = x_nx.to(tl.float32)
            if HAS_RESIDUAL:
                h += r_nx.to(tl.float32)
            rows_n, mask_n = tile_rows(t + nprog, cols, n_rows, H, ROWS)
            x_nx = _ld_rows(x_ptr, rows_n, cols, mask_n, x_st, EVICT_FIRST)
            if HAS_RESIDUAL:
                r_nx = _ld_rows(res_ptr, rows_n, cols, mask_n, r_st, EVICT_FIRST)
            if USE_PDL:
                if t + nprog >= n_tiles:
                    gdc_launch_dependents()
        _fp4_pad_scales(s_ptr, rows, r64, KB, n_kcols, n_rows_padded, ROWS, LAYOUT)
        if t * ROWS >= n_rows:
            _fp4_zero_scale_rows(s_ptr, rows, r64, KB, n_kcols, n_rows_padded, BLOCK, ROWS, LAYOUT)
        else:
            if not PREFETCH:
                h = _load_h(
                    x_ptr,
                    res_ptr,
                    r64 * x_st,
                    r64 * r_st,
                    cols,
                    mask,
                    True,
                    HAS_RESIDUAL,
                    EVICT_FIRST,
                    PTX,
                )
                if USE_PDL:
                    if t + nprog >= n_tiles:
                        gdc_launch_dependents()
            _fp4_norm_tile(
                h,
                w,
                gs,
                rows,
                live_rows,
                r64,
                cols,
                mask,
                ptrs,
                strides,
                sizes,
                eps,
                BLOCK,
                RECIPE,
                LAYOUT,
                HAS_RESIDUAL,
                HAS_NORM_OUT,
                PTX,
                True,
            )
        t += nprog


@triton.jit
def fp4_tile(
    t,
    w,
    x_ptr,
    res_ptr,
    gs_ptr,
    p_ptr,
    s_ptr,
    y_ptr,
    n_rows,
    n_rows_padded,
    H,
    Hf,
    KB,
    n_kcols,
    x_st,
    r_st,
    p_st,
    y_st,
    eps,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM_OUT: tl.constexpr,
    RECIPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    MASKED: tl.constexpr,
    x_in=None,
    GIVEN_X: tl.constexpr = False,
):
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
            h = _load_h(
                x_ptr,
                res_ptr,
                r64 * x_st,
                r64 * r_st,
                cols,
                mask,
                MASKED,
                HAS_RESIDUAL,
                EVICT_FIRST,
                PTX,
            )
        if USE_PDL:
            gdc_launch_dependents()
        ptrs = (x_ptr, res_ptr, x_ptr, gs_ptr, p_ptr, s_ptr, y_ptr)  # (no weight pointer: w given)
        sizes = (n_rows, n_rows_padded, H, Hf, KB, n_kcols)
        _fp4_norm_tile(
            h,
            w,
            gs,
            rows,
            live_rows,
            r64,
            cols,
            mask,
            ptrs,
            (x_st, r_st, p_st, y_st),
            sizes,
            eps,
            BLOCK,
            RECIPE,
            LAYOUT,
            HAS_RESIDUAL,
            HAS_NORM_OUT,
            PTX,
            MASKED,
        )


@triton.jit
def _fp4_one_pass(
    ptrs,
    strides,
    sizes,
    pid,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM_OUT: tl.constexpr,
    RECIPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Rows that fit one block: the persistent loop of ``_rmsnorm_fp4_rows``, or this program's
    tile (:func:`fp4_tile`)."""
    if PERSISTENT:
        _rmsnorm_fp4_rows(
            ptrs,
            strides,
            sizes,
            pid,
            eps,
            gain_center,
            BLOCK,
            ROWS,
            HAS_RESIDUAL,
            HAS_NORM_OUT,
            RECIPE,
            LAYOUT,
            EVICT_FIRST,
            PTX,
            USE_PDL,
            PREFETCH,
        )
    else:
        x_ptr, res_ptr, w_ptr, gs_ptr, p_ptr, s_ptr, y_ptr = ptrs
        x_st, r_st, p_st, y_st = strides
        n_rows, n_rows_padded, H, Hf, KB, n_kcols = sizes
        # parameters before the grid-dependency wait; activations and every store after it
        cols = tl.arange(0, BLOCK)
        w = ld32(w_ptr + cols, cols < H, MASKED, False, PTX)[None, :] + gain_center
        if USE_PDL:
            gdc_wait()
        fp4_tile(
            pid,
            w,
            x_ptr,
            res_ptr,
            gs_ptr,
            p_ptr,
            s_ptr,
            y_ptr,
            n_rows,
            n_rows_padded,
            H,
            Hf,
            KB,
            n_kcols,
            x_st,
            r_st,
            p_st,
            y_st,
            eps,
            BLOCK,
            ROWS,
            HAS_RESIDUAL,
            HAS_NORM_OUT,
            RECIPE,
            LAYOUT,
            EVICT_FIRST,
            PTX,
            USE_PDL,
            MASKED,
        )


@triton.jit
def _fp4_two_pass(
    ptrs,
    strides,
    sizes,
    pid,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM_OUT: tl.constexpr,
    RECIPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Rows wider than one block: the sum of squares over NUM_CHUNKS chunks, then a second pass
    that recomputes h and stores the residual, ``y`` and its NVFP4 chunk by chunk."""
    x_ptr, res_ptr, w_ptr, gs_ptr, p_ptr, s_ptr, y_ptr = ptrs
    x_st, r_st, p_st, y_st = strides
    n_rows, n_rows_padded, H, Hf, KB, n_kcols = sizes
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
            tl.store(
                s_ptr + off,
                tl.zeros((ROWS, BLOCK // 16), dtype=tl.uint8),
                mask=smask_rows & (ks < KB)[None, :],
            )
    else:
        gs = tl.load(gs_ptr).to(tl.float32)
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in tl.static_range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = live_rows & (cols < H)[None, :]
            h = _load_h(
                x_ptr, res_ptr, x_row, r_row, cols, mask, True, HAS_RESIDUAL, EVICT_FIRST, PTX
            )
            acc += h * h
        r = tl.where(live_rows, _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None], 0.0)
        rcp_gs = rcp_fast(gs, PTX)
        for c in tl.static_range(NUM_CHUNKS):
            cols = c * BLOCK + tl.arange(0, BLOCK)
            mask = live_rows & (cols < H)[None, :]
            h = _load_h(
                x_ptr, res_ptr, x_row, r_row, cols, mask, True, HAS_RESIDUAL, EVICT_FIRST, PTX
            )
            w = ld(w_ptr + cols, cols < H, True, False)[None, :] + gain_center
            if HAS_RESIDUAL:
                _st(res_ptr + r_row + cols[None, :], h, mask, True, PTX)
            _fp4_epilogue(
                (h * r) * w,
                gs,
                rcp_gs,
                rows,
                live_rows,
                c,
                p_ptr,
                p_row,
                s_ptr,
                y_ptr,
                y_row,
                H,
                KB,
                n_kcols,
                n_rows_padded,
                BLOCK,
                RECIPE,
                LAYOUT,
                HAS_NORM_OUT,
                PTX,
            )
        if USE_PDL:
            gdc_launch_dependents()


# ----------------------------------------------------------------------------- kernel
@triton.jit(do_not_specialize=["n_rows", "n_rows_padded"], launch_metadata=_fp4_metadata)
def _rmsnorm_fp4_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    gs_ptr,
    p_ptr,
    s_ptr,
    y_ptr,
    n_rows,
    n_rows_padded,
    H,
    Hf,
    KB,
    n_kcols,
    x_st,
    r_st,
    p_st,
    y_st,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_NORM_OUT: tl.constexpr,
    RECIPE: tl.constexpr,
    LAYOUT: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
    MASKED: tl.constexpr = True,
):
    """y = cast((h * r) * g); (packed, scales) = nvfp4(y); grid over the padded rows.
    MASKED False (one row per tile, H == BLOCK): the one-pass tile loads and stores unmasked.

    PERSISTENT one-pass rows run the loop of ``_rmsnorm_fp4_rows``; otherwise one tile per
    program (:func:`fp4_tile`, or :func:`_fp4_two_pass` for rows wider than one block)."""
    ptrs = (x_ptr, res_ptr, w_ptr, gs_ptr, p_ptr, s_ptr, y_ptr)
    strides = (x_st, r_st, p_st, y_st)
    sizes = (n_rows, n_rows_padded, H, Hf, KB, n_kcols)
    pid = tl.program_id(0)
    if NUM_CHUNKS == 1:
        _fp4_one_pass(
            ptrs,
            strides,
            sizes,
            pid,
            eps,
            gain_center,
            BLOCK,
            ROWS,
            HAS_RESIDUAL,
            HAS_NORM_OUT,
            RECIPE,
            LAYOUT,
            EVICT_FIRST,
            PTX,
            USE_PDL,
            PERSISTENT,
            PREFETCH,
            MASKED,
        )
    else:
        _fp4_two_pass(
            ptrs,
            strides,
            sizes,
            pid,
            eps,
            gain_center,
            BLOCK,
            NUM_CHUNKS,
            ROWS,
            HAS_RESIDUAL,
            HAS_NORM_OUT,
            RECIPE,
            LAYOUT,
            EVICT_FIRST,
            PTX,
            USE_PDL,
        )
