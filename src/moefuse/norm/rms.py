"""rmsnorm / gemma_rmsnorm / rmsnorm_sigmoid_gate and fused_add_rmsnorm: kernels and launchers
(spec: Norms).

The row code (tile shapes, loads, the one ``tl.sum`` per row, stores, stepped rows, the
persistent loop) is :mod:`moefuse.norm.triton`'s, shared with the gated norms, the fused
quantizers and the all-gather family; this module holds the two kernels built from it and
their launchers. Each kernel has three row modes, chosen per launch by constexprs: stepped rows
(``STEPPED``, ``norm_stepped``), one-pass tiles (``NUM_CHUNKS == 1``, straight-line or
persistent) and two-pass chunked rows (the row does not fit in one block).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import rcp_fast
from moefuse.norm import tiles
from moefuse.norm.tiles import (
    FUSED_ADD_POLICY,
    RMSNORM_POLICY,
    SIGMOID_GATE_POLICY,
    RowTile,
    row_tile,
)
from moefuse.norm.triton import (
    _add_tile,
    _grid,
    _inv_rms,
    _launch,
    _loop_tile,
    _pf_mask,
    _row_consts,
    _row_strides,
    _st,
    _tile,
    add_load,
    ld,
    no_aux,
    norm_stepped,
    rms_load,
    rms_tile,
    row_base,
    st_cast,
    tile_rows,
)


# ----------------------------------------------------------------------------- rmsnorm
# ``ptrs`` = (x, w, gate, out) and ``strides`` = (x_st, x_sh, g_st, g_sh, o_st, o_sh): the
# kernel's arguments, grouped for its row-mode device functions.
@triton.jit
def _rms_load_at(
    ptrs,
    strides,
    rows,
    cols,
    mask,
    HEADS,
    MASKED: tl.constexpr,
    STREAM: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    """:func:`rms_load` of the x (and gate) tile at ``rows``."""
    return rms_load(
        ptrs[0],
        ptrs[2],
        rows,
        cols,
        mask,
        HEADS,
        strides[0],
        strides[1],
        strides[2],
        strides[3],
        MASKED,
        STREAM,
        HAS_GATE,
    )


@triton.jit
def _rms_tile_at(
    x,
    g,
    w,
    rows,
    cols,
    mask,
    ptrs,
    strides,
    HEADS,
    Hf,
    eps,
    MASKED: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PTX: tl.constexpr,
):
    """:func:`rms_tile` into the out tile at ``rows``."""
    rms_tile(
        x,
        g,
        w,
        rows,
        cols,
        mask,
        ptrs[3],
        HEADS,
        strides[4],
        strides[5],
        Hf,
        eps,
        MASKED,
        HAS_GATE,
        PTX,
    )


@triton.jit
def _rmsnorm_one_pass(
    ptrs,
    strides,
    n_rows,
    H,
    Hf,
    HEADS,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Rows that fit one block: this program's tile, or its tiles of the persistent loop."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    w = 1.0  # replaced by sigmoid(gate) per tile when HAS_GATE
    if not HAS_GATE:
        w = ld(ptrs[1] + cols, cols < H, MASKED, False)[None, :] + gain_center
    if USE_PDL:
        gdc_wait()
    if not PERSISTENT:
        rows, mask = tile_rows(pid, cols, n_rows, H, ROWS)
        x, g = _rms_load_at(ptrs, strides, rows, cols, mask, HEADS, MASKED, EVICT_FIRST, HAS_GATE)
        if USE_PDL:
            gdc_launch_dependents()
        _rms_tile_at(
            x.to(tl.float32),
            g.to(tl.float32),
            w,
            rows,
            cols,
            mask,
            ptrs,
            strides,
            HEADS,
            Hf,
            eps,
            MASKED,
            HAS_GATE,
            PTX,
        )
    else:
        _rmsnorm_persistent(
            ptrs,
            strides,
            w,
            pid,
            cols,
            n_rows,
            H,
            Hf,
            HEADS,
            eps,
            BLOCK,
            ROWS,
            MASKED,
            EVICT_FIRST,
            HAS_GATE,
            PTX,
            USE_PDL,
            PREFETCH,
        )


@triton.jit
def _rmsnorm_persistent(
    ptrs,
    strides,
    w,
    pid,
    cols,
    n_rows,
    H,
    Hf,
    HEADS,
    eps,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The persistent row loop over one-pass tiles (see ``_loop_tile``), optional prefetch of
    the next tile; ``w`` the weight row (loaded before ``gdc_wait``)."""
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    t = pid
    if PREFETCH:
        rows0, mask0 = tile_rows(t, cols, n_rows, H, ROWS)
        x_nx, g_nx = _rms_load_at(
            ptrs, strides, rows0, cols, mask0, HEADS, MASKED, EVICT_FIRST, HAS_GATE
        )
    while t < n_tiles:
        rows, mask = tile_rows(t, cols, n_rows, H, ROWS)
        if PREFETCH:
            x = x_nx.to(tl.float32)
            g = g_nx.to(tl.float32)
            rows_n, mask_n = tile_rows(t + nprog, cols, n_rows, H, ROWS)
            mask_n = _pf_mask(rows_n, mask_n, n_rows, MASKED, ROWS, BLOCK)
            x_nx, g_nx = _rms_load_at(
                ptrs, strides, rows_n, cols, mask_n, HEADS, True, EVICT_FIRST, HAS_GATE
            )
        else:
            x, g = _rms_load_at(
                ptrs, strides, rows, cols, mask, HEADS, MASKED, EVICT_FIRST, HAS_GATE
            )
            x = x.to(tl.float32)
            g = g.to(tl.float32)
        if USE_PDL:
            if t + nprog >= n_tiles:
                gdc_launch_dependents()
        _rms_tile_at(
            x, g, w, rows, cols, mask, ptrs, strides, HEADS, Hf, eps, MASKED, HAS_GATE, PTX
        )
        t += nprog


@triton.jit
def _rmsnorm_two_pass(
    ptrs,
    strides,
    n_rows,
    H,
    Hf,
    HEADS,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Rows wider than one block: the sum of squares over NUM_CHUNKS chunks, then a second pass
    that re-reads each chunk, normalizes and stores it."""
    x_ptr, w_ptr, gate_ptr, out_ptr = ptrs
    x_st, x_sh, g_st, g_sh, o_st, o_sh = strides
    pid = tl.program_id(0)
    rows, cols, mask = _tile(pid, 0, n_rows, H, ROWS, BLOCK)
    x_row = row_base(rows, HEADS, x_st, x_sh)[:, None]
    o_row = row_base(rows, HEADS, o_st, o_sh)[:, None]
    g_row = row_base(rows, HEADS, g_st, g_sh)[:, None]
    if USE_PDL:
        gdc_wait()
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for c in tl.range(NUM_CHUNKS):
        rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
        x = ld(x_ptr + x_row + cols[None, :], mask, MASKED, False)
        acc += x * x
    r = _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None]
    for c in tl.range(NUM_CHUNKS):
        rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
        x = ld(x_ptr + x_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        if HAS_GATE:
            g = ld(gate_ptr + g_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            w = rcp_fast(tl.math.exp2(-g * 1.4426950408889634) + 1.0, PTX)
        else:
            w = ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        _st(out_ptr + o_row + cols[None, :], (x * r) * w, mask, MASKED, PTX)
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_kernel(
    x_ptr,
    w_ptr,
    gate_ptr,
    out_ptr,
    n_rows,
    H,
    Hf,
    HEADS,
    x_st,
    x_sh,
    g_st,
    g_sh,
    o_st,
    o_sh,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
    STEPPED: tl.constexpr = False,
    UNROLL: tl.constexpr = False,
):
    """out = cast((x * r) * m), m = f32(w) + gain_center, or sigmoid(gate) when HAS_GATE.
    STEPPED (no gate): one row per program in NUM_CHUNKS steps of BLOCK columns (norm_stepped)."""
    pid = tl.program_id(0)
    if STEPPED:
        norm_stepped(
            x_ptr,
            x_ptr,
            w_ptr,
            out_ptr,
            row_base(pid, HEADS, x_st, x_sh),
            0,
            row_base(pid, HEADS, o_st, o_sh),
            H,
            Hf,
            eps,
            gain_center,
            x_ptr,
            BLOCK,
            NUM_CHUNKS,
            UNROLL,
            MASKED,
            PTX,
            USE_PDL,
            False,
            "evict_first",
            no_aux,
            st_cast,
        )
    elif NUM_CHUNKS == 1:
        _rmsnorm_one_pass(
            (x_ptr, w_ptr, gate_ptr, out_ptr),
            (x_st, x_sh, g_st, g_sh, o_st, o_sh),
            n_rows,
            H,
            Hf,
            HEADS,
            eps,
            gain_center,
            BLOCK,
            ROWS,
            MASKED,
            EVICT_FIRST,
            HAS_GATE,
            PTX,
            USE_PDL,
            PERSISTENT,
            PREFETCH,
        )
    else:
        _rmsnorm_two_pass(
            (x_ptr, w_ptr, gate_ptr, out_ptr),
            (x_st, x_sh, g_st, g_sh, o_st, o_sh),
            n_rows,
            H,
            Hf,
            HEADS,
            eps,
            gain_center,
            BLOCK,
            NUM_CHUNKS,
            ROWS,
            MASKED,
            EVICT_FIRST,
            HAS_GATE,
            PTX,
            USE_PDL,
        )


# ----------------------------------------------------------------------------- fused_add_rmsnorm
@triton.jit
def _fused_add_one_pass(
    x_ptr,
    res_ptr,
    w_ptr,
    n_rows,
    H,
    Hf,
    x_st,
    r_st,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Rows that fit one block: this program's tile, or its tiles of the persistent loop
    (``_loop_tile``, optional prefetch of the next tile)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    w = ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
    if USE_PDL:
        gdc_wait()
    if not PERSISTENT:
        rows, mask = tile_rows(pid, cols, n_rows, H, ROWS)
        xr, rr = add_load(x_ptr, res_ptr, rows, cols, mask, x_st, r_st, MASKED, EVICT_FIRST)
        h = xr.to(tl.float32)
        h += rr.to(tl.float32)
        if USE_PDL:
            gdc_launch_dependents()
        _add_tile(h, w, rows, cols, mask, x_ptr, res_ptr, x_st, r_st, Hf, eps, MASKED, PTX)
    else:
        nprog = tl.num_programs(0)
        n_tiles = tl.cdiv(n_rows, ROWS)
        t = pid
        x_nx = 0.0  # (unused placeholders without PREFETCH)
        r_nx = 0.0
        if PREFETCH:
            rows0, mask0 = tile_rows(t, cols, n_rows, H, ROWS)
            x_nx, r_nx = add_load(
                x_ptr, res_ptr, rows0, cols, mask0, x_st, r_st, MASKED, EVICT_FIRST
            )
        while t < n_tiles:
            rows, mask, xr, rr, x_nx, r_nx = _loop_tile(
                t,
                nprog,
                x_nx,
                r_nx,
                x_ptr,
                res_ptr,
                cols,
                n_rows,
                H,
                x_st,
                r_st,
                ROWS,
                BLOCK,
                MASKED,
                EVICT_FIRST,
                PREFETCH,
            )
            h = xr.to(tl.float32)
            h += rr.to(tl.float32)
            if USE_PDL:
                if t + nprog >= n_tiles:
                    gdc_launch_dependents()
            _add_tile(h, w, rows, cols, mask, x_ptr, res_ptr, x_st, r_st, Hf, eps, MASKED, PTX)
            t += nprog


@triton.jit
def _fused_add_two_pass(
    x_ptr,
    res_ptr,
    w_ptr,
    n_rows,
    H,
    Hf,
    x_st,
    r_st,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Rows wider than one block: the sum of squares of h over NUM_CHUNKS chunks, then a second
    pass that recomputes h per chunk and stores res and the normalized x."""
    pid = tl.program_id(0)
    rows, cols, mask = _tile(pid, 0, n_rows, H, ROWS, BLOCK)
    x_row = rows.to(tl.int64)[:, None] * x_st
    r_row = rows.to(tl.int64)[:, None] * r_st
    if USE_PDL:
        gdc_wait()
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for c in tl.range(NUM_CHUNKS):
        rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
        h = ld(x_ptr + x_row + cols[None, :], mask, MASKED, False)
        h += ld(res_ptr + r_row + cols[None, :], mask, MASKED, False)
        acc += h * h
    r = _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None]
    # second pass recomputes the same FP32 h (both inputs are still unmodified for this chunk)
    for c in tl.range(NUM_CHUNKS):
        rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
        h = ld(x_ptr + x_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        h += ld(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        w = ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        _st(res_ptr + r_row + cols[None, :], h, mask, MASKED, PTX)
        _st(x_ptr + x_row + cols[None, :], (h * r) * w, mask, MASKED, PTX)
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit(do_not_specialize=["n_rows"])
def _fused_add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    n_rows,
    H,
    Hf,
    x_st,
    r_st,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
    STEPPED: tl.constexpr = False,
    UNROLL: tl.constexpr = False,
):
    """h = f32(x) + f32(res); res <- cast(h); x <- cast((h * r) * g), r from the FP32 h.
    STEPPED: one row per program in NUM_CHUNKS steps of BLOCK columns (norm_stepped)."""
    pid = tl.program_id(0)
    if STEPPED:
        row = pid.to(tl.int64)
        norm_stepped(
            x_ptr,
            res_ptr,
            w_ptr,
            x_ptr,
            row * x_st,
            row * r_st,
            row * x_st,
            H,
            Hf,
            eps,
            gain_center,
            x_ptr,
            BLOCK,
            NUM_CHUNKS,
            UNROLL,
            MASKED,
            PTX,
            USE_PDL,
            True,
            "",
            no_aux,
            st_cast,
        )
    elif NUM_CHUNKS == 1:
        _fused_add_one_pass(
            x_ptr,
            res_ptr,
            w_ptr,
            n_rows,
            H,
            Hf,
            x_st,
            r_st,
            eps,
            gain_center,
            BLOCK,
            ROWS,
            MASKED,
            EVICT_FIRST,
            PTX,
            USE_PDL,
            PERSISTENT,
            PREFETCH,
        )
    else:
        _fused_add_two_pass(
            x_ptr,
            res_ptr,
            w_ptr,
            n_rows,
            H,
            Hf,
            x_st,
            r_st,
            eps,
            gain_center,
            BLOCK,
            NUM_CHUNKS,
            ROWS,
            MASKED,
            EVICT_FIRST,
            PTX,
            USE_PDL,
        )


# ----------------------------------------------------------------------------- launchers
def launch_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    out: torch.Tensor,
    eps: float,
    gain_center: float,
    use_pdl: bool,
    gate: torch.Tensor | None = None,
    tile: RowTile | None = None,
    unroll: bool | None = None,
) -> None:
    """rmsnorm / gemma_rmsnorm (``weight``) or rmsnorm_sigmoid_gate (``gate``) over [.., H].
    ``tile`` / ``unroll`` override the width's tile and the stepped mode (tests and sweeps;
    neither changes a bit)."""
    width = input.shape[-1]
    n_rows, x_st, x_sh = _row_strides(input)
    if n_rows == 0:
        return
    heads = input.shape[1] if input.dim() == 3 else 1
    _, o_st, o_sh = _row_strides(out)
    g_st, g_sh = _row_strides(gate)[1:] if gate is not None else (0, 0)
    tile = tile or row_tile(width, SIGMOID_GATE_POLICY if gate is not None else RMSNORM_POLICY)
    if tile.stepped and gate is not None:
        raise ValueError("stepped rows are not implemented for the sigmoid gate")
    args = (
        input, weight if weight is not None else input, gate if gate is not None else input, out,
        n_rows, width, float(width), heads,
        x_st, x_sh, g_st, g_sh, o_st, o_sh,
        eps, gain_center,
    )  # fmt: skip
    consts = _row_consts(tile, width, n_rows, unroll, tiles.RMSNORM_LOOP_MIN_ROWS, use_pdl)
    _launch(
        _rmsnorm_kernel,
        _grid(tile, tile.grid(n_rows)[0], input.device),
        args,
        {**consts, "HAS_GATE": gate is not None},
        tile,
    )


def launch_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gain_center: float,
    use_pdl: bool,
    tile: RowTile | None = None,
    unroll: bool | None = None,
) -> None:
    """In place on ``input`` and ``residual`` ([M, H] each, row strides free). ``tile`` /
    ``unroll`` override the width's tile and the stepped mode (tests and sweeps; neither changes
    a bit)."""
    n_rows, width = input.shape
    if n_rows == 0:
        return
    tile = tile or row_tile(width, FUSED_ADD_POLICY)
    args = (
        input, residual, weight,
        n_rows, width, float(width),
        input.stride(0), residual.stride(0),
        eps, gain_center,
    )  # fmt: skip
    consts = _row_consts(tile, width, n_rows, unroll, tiles.FUSED_ADD_LOOP_MIN_ROWS, use_pdl)
    _launch(
        _fused_add_rmsnorm_kernel,
        _grid(tile, tile.grid(n_rows)[0], input.device),
        args,
        consts,
        tile,
    )
