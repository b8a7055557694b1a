"""rmsnorm / gemma_rmsnorm / rmsnorm_sigmoid_gate and fused_add_rmsnorm: kernels and launchers
(spec: Norms).

The row code (tile shapes, loads, the one ``tl.sum`` per row, stores, stepped rows) is
:mod:`moefuse.norm.triton`'s, shared with the gated norms, the fused quantizers and the
all-gather family; this module holds the two kernels built from it and their launchers. Each
kernel has three row modes, chosen per launch by constexprs: stepped rows (``STEPPED``,
``norm_stepped``), one-pass tiles (``NUM_CHUNKS == 1``, straight-line or persistent) and
two-pass chunked rows (the row does not fit in one block). The one-pass modes are
:func:`moefuse.norm.row_loop.one_pass_rows` (shared with the gated norms) around each kernel's
tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import rcp_fast
from moefuse.norm import tiles
from moefuse.norm.row_loop import add_pair, head_pair, keep_pair, one_pass_rows, widen_pair
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
    _row_consts,
    _row_strides,
    _st,
    _tile,
    ld,
    no_aux,
    norm_stepped,
    rms_tile,
    row_base,
    st_cast,
)


# ----------------------------------------------------------------------------- rmsnorm
# ``ptrs`` = (x, w, gate, out) and ``strides`` = (x_st, x_sh, g_st, g_sh, o_st, o_sh): the
# kernel's arguments, grouped for its row-mode device functions.
@triton.jit
def _rms_tile_at(pair, rows, cols, mask, args):
    """:func:`rms_tile` of the (x, gate) tile ``pair`` (stored dtypes or FP32) into the out tile
    at ``rows``: the ``TILE`` of :func:`moefuse.norm.row_loop.one_pass_rows`. ``args`` = ((w,
    out_ptr, Hf, eps), (HEADS, o_st, o_sh), MASKED, HAS_GATE, PTX); the integers are read by
    index (an unpacking assignment would turn one that the launch specialised to 1 into a
    tensor)."""
    w, out_ptr, Hf, eps = args[0]
    MASKED: tl.constexpr = args[2]
    HAS_GATE: tl.constexpr = args[3]
    PTX: tl.constexpr = args[4]
    rms_tile(
        pair[0].to(tl.float32),
        pair[1].to(tl.float32),
        w,
        rows,
        cols,
        mask,
        out_ptr,
        args[1][0],
        args[1][1],
        args[1][2],
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
    """Rows that fit one block: the weight row (before ``gdc_wait``), then :func:`rms_tile` of
    this program's tile or of its tiles of the persistent loop. The one tile of a program is
    widened after ``gdc_launch_dependents``; the loop widens each tile before it (a prefetched
    one before the next tile's loads are issued)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    w = 1.0  # replaced by sigmoid(gate) per tile when HAS_GATE
    if not HAS_GATE:
        w = ld(ptrs[1] + cols, cols < H, MASKED, False)[None, :] + gain_center
    one_pass_rows(
        head_pair,
        ((ptrs[0], ptrs[2]), (HEADS, strides[0], strides[1], strides[2], strides[3]), HAS_GATE),
        widen_pair if PERSISTENT else keep_pair,
        _rms_tile_at,
        ((w, ptrs[3], Hf, eps), (HEADS, strides[4], strides[5]), MASKED, HAS_GATE, PTX),
        pid,
        cols,
        n_rows,
        H,
        ROWS,
        BLOCK,
        MASKED,
        EVICT_FIRST,
        USE_PDL,
        PERSISTENT,
        PREFETCH,
        True,
    )


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
def _add_f32(x, res):
    """``COMBINE`` hook of fused_add_rmsnorm: h = f32(x) + f32(res), computed before
    ``gdc_launch_dependents``."""
    h = x.to(tl.float32)
    h += res.to(tl.float32)
    return h


@triton.jit
def _fused_add_tile(h, rows, cols, mask, args):
    """:func:`_add_tile` of the FP32 tile ``h``: the ``TILE`` of
    :func:`moefuse.norm.row_loop.one_pass_rows`. ``args`` = ((w, x_ptr, res_ptr, Hf, eps),
    (x_st, r_st), MASKED, PTX); the strides are read by index (an unpacking assignment would
    turn one that the launch specialised to 1 into a tensor)."""
    w, x_ptr, res_ptr, Hf, eps = args[0]
    MASKED: tl.constexpr = args[2]
    PTX: tl.constexpr = args[3]
    _add_tile(h, w, rows, cols, mask, x_ptr, res_ptr, args[1][0], args[1][1], Hf, eps, MASKED, PTX)


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
    """Rows that fit one block: the weight row (before ``gdc_wait``), then
    :func:`_fused_add_tile` of this program's tile or of its tiles of the persistent loop."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    w = ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
    one_pass_rows(
        add_pair,
        (x_ptr, res_ptr, x_st, r_st),
        _add_f32,
        _fused_add_tile,
        ((w, x_ptr, res_ptr, Hf, eps), (x_st, r_st), MASKED, PTX),
        pid,
        cols,
        n_rows,
        H,
        ROWS,
        BLOCK,
        MASKED,
        EVICT_FIRST,
        USE_PDL,
        PERSISTENT,
        PREFETCH,
        False,
    )


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
