"""The row code of the RMSNorm family (spec: Norms): device functions and launch helpers.

Every kernel works on a ``[ROWS, BLOCK]`` tile of rows (see :mod:`moefuse.norm.tiles`): row sums
are ``tl.sum`` over a tile whose shape depends on the width only, so the reduction tree is fixed per
width. Rows wider than one block loop over ``NUM_CHUNKS`` chunks in ascending order, accumulating an
FP32 ``[ROWS, BLOCK]`` partial before the one ``tl.sum`` (re-reading the row from memory for the
second pass). Rows are addressed as ``(row // HEADS) * stride_t + (row % HEADS) * stride_h`` so 2-D
and 3-D inputs with any row strides share one kernel.

Sums of products are written as explicit ``tl.fma``: if contraction were left to the compiler, a
value that Triton recomputes in a second register layout could be contracted differently from
the first, so one element would have two values (seen on H200: ffn_input != cast(router_input)).

PDL: parameters (weights, gates of the model) are loaded before ``gdc_wait``; activations, which
the previous kernel may still be writing, after it. ``gdc_launch_dependents`` follows the last load
of the previous kernel's data.

Public device functions (no leading underscore) are the row functions that the all-gather family
(``moefuse.comm.all_gather.decode``) reuses, so that its fused kernels load, sum and store a row
exactly as these kernels do (same tree, same bits): ``row_base``, ``ld_raw``, ``ld``, ``ldp``,
``tile_rows``, ``step_cols``, ``step_params``, ``no_aux``, ``st_cast``, ``norm_unrolled_row``,
``norm_stepped``, ``rms_load``, ``rms_tile`` and ``add_load``. Changing one changes both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import rcp_fast, round_to, rsqrt_fast
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs, sm_count
from moefuse.norm import tiles
from moefuse.norm.tiles import RowTile

LOG2E = 1.4426950408889634
#: evict-first cache hint on activation loads; measured slower on H200 by 1-4 % (notes/norm.md),
#: so off, kept as a switch for other GPUs
STREAM_EVICT_FIRST = False


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def row_base(rows, HEADS, stride_t, stride_h):
    """Element offset of row ``rows`` of a [tokens, HEADS, H] view (HEADS = 1: [M, H]):
    ``(rows // HEADS) * stride_t + (rows % HEADS) * stride_h``. The division runs in the rows'
    own 32-bit type (a 64-bit division is a long software routine that also cost the short-row
    tiles of the sigmoid gate ~40 registers); the products run in 64 bits."""
    token = rows // HEADS
    head = rows - token * HEADS
    return token.to(tl.int64) * stride_t + head.to(tl.int64) * stride_h


@triton.jit
def ld_raw(ptrs, mask, MASKED: tl.constexpr, STREAM: tl.constexpr):
    """Load in the stored dtype; STREAM marks data read exactly once (evict-first cache hint)."""
    if STREAM:
        if MASKED:
            return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
        else:
            return tl.load(ptrs, eviction_policy="evict_first")
    else:
        if MASKED:
            return tl.load(ptrs, mask=mask, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def ld(ptrs, mask, MASKED: tl.constexpr, STREAM: tl.constexpr):
    """Load as FP32 (exact widening of the stored dtype)."""
    return ld_raw(ptrs, mask, MASKED, STREAM).to(tl.float32)


@triton.jit
def _st(ptrs, value, mask, MASKED: tl.constexpr, PTX: tl.constexpr):
    value = round_to(value, ptrs.dtype.element_ty, PTX)
    if MASKED:
        tl.store(ptrs, value, mask=mask)
    else:
        tl.store(ptrs, value)


@triton.jit
def _inv_rms(sumsq, Hf, eps):
    """``rsqrt(sumsq / H + eps)`` with an IEEE division (the spec's mean_sq) and rsqrt.approx.

    ``Hf`` is the width as a float argument: an int width of 1 would be specialised to a constant.
    """
    return rsqrt_fast(tl.math.div_rn(sumsq, Hf) + eps)


@triton.jit
def _tile(pid, chunk, n_rows, H, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Row indices [ROWS], column indices [BLOCK] and the [ROWS, BLOCK] validity mask."""
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    return rows, cols, mask


@triton.jit
def tile_rows(t, cols, n_rows, H, ROWS: tl.constexpr):
    """Rows [ROWS] of row tile ``t`` and the [ROWS, BLOCK] mask (``_tile`` with given columns).

    The persistent loops keep ``cols`` out of the loop-carried values: a carried ``tl.arange``
    loses its contiguity information and every load would become scalar.
    """
    rows = t * ROWS + tl.arange(0, ROWS)
    return rows, (rows < n_rows)[:, None] & (cols < H)[None, :]


@triton.jit
def _pf_mask(rows, mask, n_rows, MASKED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Mask of a prefetch load: row-masked even for unmasked tiles (the tile after a program's
    last one does not exist; its loads must read nothing)."""
    if MASKED:
        return mask
    else:
        return tl.broadcast_to((rows < n_rows)[:, None], (ROWS, BLOCK))


# ----------------------------------------------------------------------------- stepped rows
# A stepped row (tiles.RowTile.stepped; norm/gated.py describes the layout) is walked in [1, STEP]
# steps; each thread accumulates its columns' squares over the steps in ascending order and one
# tl.sum ends the row, so the unrolled mode (row in registers) and the looped mode (two passes,
# the second re-reading the row from L2) give the same bits.
@triton.jit
def ldp(ptrs, mask, MASKED: tl.constexpr, POLICY: tl.constexpr):
    """FP32 load with an L2 eviction policy ("" = default, "evict_last", "evict_first")."""
    if MASKED:
        v = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY)
    else:
        v = tl.load(ptrs, eviction_policy=POLICY)
    return v.to(tl.float32)


@triton.jit
def step_cols(k, H, STEP: tl.constexpr):
    """Columns [1, STEP] of step ``k`` and their mask."""
    cols = k * STEP + tl.arange(0, STEP)[None, :]
    return cols, cols < H


@triton.jit
def _param(ptr, cols, cm, center, MASKED: tl.constexpr, PRESENT: tl.constexpr):
    """FP32 parameter vector [+ center] of a step (1.0 when the op has none)."""
    if PRESENT:
        return ldp(ptr + cols, cm, MASKED, "") + center
    else:
        return 1.0


@triton.jit
def step_params(
    ptr,
    H,
    center,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    MASKED: tl.constexpr,
    PRESENT: tl.constexpr,
):
    """Every step's FP32 parameter vector [+ center] (1.0 when absent) as a tuple: the unrolled
    mode loads its parameters before gdc_wait."""
    ps = ()
    for k in tl.static_range(STEPS):
        cols, cm = step_cols(k, H, STEP)
        ps = ps + (_param(ptr, cols, cm, center, MASKED, PRESENT),)
    return ps


@triton.jit
def _weighted_sumsq(xs, ws, STEP: tl.constexpr, STEPS: tl.constexpr, HAS_W: tl.constexpr):
    """(x [* w] per step, [1, 1] statistic): per-thread ``fma(x, x, acc)`` over the steps in
    ascending order, then one tl.sum (the looped mode's order, see _branch_sumsq_loop)."""
    acc = tl.zeros([1, STEP], dtype=tl.float32)
    xws = ()
    for k in tl.static_range(STEPS):
        x = xs[k]
        if HAS_W:
            x = x * ws[k]
        xws = xws + (x,)
        acc = tl.fma(x, x, acc)
    return xws, tl.sum(acc, axis=1)[:, None]


@triton.jit
def _step_in(
    a_ptr,
    b_ptr,
    a_row,
    b_row,
    cols,
    cm,
    MASKED: tl.constexpr,
    POLICY: tl.constexpr,
    ADD: tl.constexpr,
):
    """One step's FP32 input: f32(a), or f32(a) + f32(b) when ADD (fused_add's h)."""
    v = ldp(a_ptr + a_row + cols, cm, MASKED, POLICY)
    if ADD:
        v += ldp(b_ptr + b_row + cols, cm, MASKED, POLICY)
    return v


@triton.jit
def no_aux(aux_ptr):
    """AUX hook of the plain norms (no per-call value)."""
    return 0.0


@triton.jit
def st_cast(ptrs, y, aux, mask, MASKED: tl.constexpr, PTX: tl.constexpr):
    """OUT hook of the plain norms: store y rounded to the output's dtype."""
    _st(ptrs, y, mask, MASKED, PTX)


@triton.jit
def norm_unrolled_row(
    vs,
    ws,
    out_ptr,
    o_row,
    H,
    Hf,
    eps,
    aux_ptr,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    MASKED: tl.constexpr,
    PTX: tl.constexpr,
    AUX: tl.constexpr,
    OUT: tl.constexpr,
):
    """The statistic and outputs of an unrolled stepped row from its FP32 steps ``vs`` and
    weights ``ws`` (``step_params``): ``norm_stepped``'s code, also run by the fused
    all-gather decode kernel on steps read from its slots (comm/all_gather/decode.py)."""
    aux = AUX(aux_ptr)
    _, ss = _weighted_sumsq(vs, ws, STEP, STEPS, False)
    r = _inv_rms(ss, Hf, eps)
    for k in tl.static_range(STEPS):
        cols, cm = step_cols(k, H, STEP)
        OUT(out_ptr + o_row + cols, (vs[k] * r) * ws[k], aux, cm, MASKED, PTX)


@triton.jit
def norm_stepped(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    x_row,
    r_row,
    o_row,
    H,
    Hf,
    eps,
    gc,
    aux_ptr,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    UNROLL: tl.constexpr,
    MASKED: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    ADD: tl.constexpr,
    POLICY: tl.constexpr,
    AUX: tl.constexpr,
    OUT: tl.constexpr,
):
    """One stepped row of rmsnorm (out <- cast((x * r) * (f32(w) + gc))) or, when ADD, of
    fused_add_rmsnorm (h = f32(x) + f32(res); res <- cast(h); out <- cast((h * r) * (f32(w) +
    gc)), out = x). Unrolled: weights before gdc_wait, every load in flight at once (``POLICY``),
    the residual stored before the row's sum; looped: a first pass accumulates the statistic
    (loads keep the row in L2), a second re-reads each step (its inputs are still unmodified:
    out may be x) and stores.

    Output hooks (device functions passed as constexprs; ``no_aux`` / ``st_cast`` give the norm):
    ``aux = AUX(aux_ptr)`` is evaluated once after gdc_wait, and each step's FP32 ``y = (h * r) *
    g`` goes out through ``OUT(ptrs, y, aux, mask, MASKED, PTX)`` (quant.fused: FP8 codes of
    ``y * (1 / scale)``)."""
    if UNROLL:
        ws = step_params(w_ptr, H, gc, STEP, STEPS, MASKED, True)
        if USE_PDL:
            gdc_wait()
        vs = ()
        for k in tl.static_range(STEPS):
            cols, cm = step_cols(k, H, STEP)
            vs = vs + (_step_in(x_ptr, res_ptr, x_row, r_row, cols, cm, MASKED, POLICY, ADD),)
        if USE_PDL:
            gdc_launch_dependents()
        if ADD:
            for k in tl.static_range(STEPS):
                cols, cm = step_cols(k, H, STEP)
                _st(res_ptr + r_row + cols, vs[k], cm, MASKED, PTX)
        norm_unrolled_row(
            vs, ws, out_ptr, o_row, H, Hf, eps, aux_ptr, STEP, STEPS, MASKED, PTX, AUX, OUT
        )
    else:
        if USE_PDL:
            gdc_wait()
        aux = AUX(aux_ptr)
        acc = tl.zeros([1, STEP], dtype=tl.float32)
        for k in tl.range(0, STEPS):
            cols, cm = step_cols(k, H, STEP)
            v = _step_in(x_ptr, res_ptr, x_row, r_row, cols, cm, MASKED, "evict_last", ADD)
            acc = tl.fma(v, v, acc)
        r = _inv_rms(tl.sum(acc, axis=1)[:, None], Hf, eps)
        for k in tl.range(0, STEPS):
            cols, cm = step_cols(k, H, STEP)
            v = _step_in(x_ptr, res_ptr, x_row, r_row, cols, cm, MASKED, "evict_first", ADD)
            if ADD:
                _st(res_ptr + r_row + cols, v, cm, MASKED, PTX)
            OUT(
                out_ptr + o_row + cols,
                (v * r) * _param(w_ptr, cols, cm, gc, MASKED, True),
                aux,
                cm,
                MASKED,
                PTX,
            )
        if USE_PDL:
            gdc_launch_dependents()


# ----------------------------------------------------------------------------- per-tile helpers
# One-pass tiles: ``*_load`` issues a tile's activation loads (stored dtype), ``*_tile`` does the
# tile's arithmetic and stores from the FP32 values. The straight-line kernel (PERSISTENT = False)
# and the persistent loop call the same two helpers, so a row's arithmetic is one piece of code.
@triton.jit
def rms_load(
    x_ptr,
    gate_ptr,
    rows,
    cols,
    mask,
    HEADS,
    x_st,
    x_sh,
    g_st,
    g_sh,
    MASKED: tl.constexpr,
    STREAM: tl.constexpr,
    HAS_GATE: tl.constexpr,
):
    x = ld_raw(
        x_ptr + row_base(rows, HEADS, x_st, x_sh)[:, None] + cols[None, :], mask, MASKED, STREAM
    )
    g = x
    if HAS_GATE:
        g = ld_raw(
            gate_ptr + row_base(rows, HEADS, g_st, g_sh)[:, None] + cols[None, :],
            mask,
            MASKED,
            STREAM,
        )
    return x, g


@triton.jit
def rms_tile(
    x,
    g,
    w,
    rows,
    cols,
    mask,
    out_ptr,
    HEADS,
    o_st,
    o_sh,
    Hf,
    eps,
    MASKED: tl.constexpr,
    HAS_GATE: tl.constexpr,
    PTX: tl.constexpr,
):
    """out = cast((x * r) * w); w = sigmoid(g) when HAS_GATE (x, g FP32)."""
    if HAS_GATE:
        w = rcp_fast(tl.math.exp2(-g * 1.4426950408889634) + 1.0, PTX)
    r = _inv_rms(tl.sum(x * x, axis=1), Hf, eps)[:, None]
    o_row = row_base(rows, HEADS, o_st, o_sh)[:, None]
    _st(out_ptr + o_row + cols[None, :], (x * r) * w, mask, MASKED, PTX)


@triton.jit
def add_load(
    a_ptr, b_ptr, rows, cols, mask, a_st, b_st, MASKED: tl.constexpr, STREAM: tl.constexpr
):
    """Two activation tiles of one 2-D row block (input + residual, or branch + stream)."""
    r64 = rows.to(tl.int64)[:, None]
    a = ld_raw(a_ptr + r64 * a_st + cols[None, :], mask, MASKED, STREAM)
    b = ld_raw(b_ptr + r64 * b_st + cols[None, :], mask, MASKED, STREAM)
    return a, b


@triton.jit
def _add_tile(
    h,
    w,
    rows,
    cols,
    mask,
    x_ptr,
    res_ptr,
    x_st,
    r_st,
    Hf,
    eps,
    MASKED: tl.constexpr,
    PTX: tl.constexpr,
):
    """res <- cast(h); x <- cast((h * r) * w), r from the FP32 h."""
    r64 = rows.to(tl.int64)[:, None]
    _st(res_ptr + r64 * r_st + cols[None, :], h, mask, MASKED, PTX)
    r = _inv_rms(tl.sum(h * h, axis=1), Hf, eps)[:, None]
    _st(x_ptr + r64 * x_st + cols[None, :], (h * r) * w, mask, MASKED, PTX)


# ----------------------------------------------------------------------------- launchers
def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(rows, stride_t, stride_h) of a [M, H] or [M, heads, H] tensor; HEADS = 1 for 2-D."""
    if t.dim() == 2:
        return t.shape[0], t.stride(0), 0
    return t.shape[0] * t.shape[1], t.stride(0), t.stride(1)


def _grid(tile: RowTile, n_tiles: int, device: torch.device) -> tuple[int]:
    """min(n_tiles, programs_per_sm x SMs) programs (n_tiles when not persistent); a runtime value,
    so a new M never recompiles. The SM count is only looked up for persistent tiles."""
    if not _persistent(tile):
        return (n_tiles,)
    return tile.persistent_grid(n_tiles, sm_count(device))


def _persistent(tile: RowTile) -> bool:
    """One-pass tiles with programs_per_sm > 0 run the persistent loop; others (stepped rows
    included: one program per row) the straight-line one-tile-per-program kernel (fewer
    registers: nothing lives across tiles)."""
    return tile.programs_per_sm > 0 and tile.num_chunks == 1 and not tile.stepped


def _prefetch(tile: RowTile) -> bool:
    return tile.prefetch and _persistent(tile)


def _launch_kwargs(tile: RowTile, use_pdl: bool) -> dict:
    """PDL and, for persistent launches, the register cap that keeps programs_per_sm resident."""
    out = pdl_launch_kwargs(use_pdl)
    cap = tile.max_registers()
    if cap is not None and not interpreter_active():
        out = {**out, "maxnreg": cap}
    return out


def _unroll(tile: RowTile, n_rows: int, unroll: bool | None, loop_min_rows: int) -> bool:
    """Unrolled stepped mode for this launch. ``unroll=None``: rows of at most
    tiles.STEP_UNROLL_MAX_STEPS steps and fewer than ``loop_min_rows`` rows (the op's threshold);
    True forces it (ValueError beyond STEP_UNROLL_MAX_STEPS: the row would not fit in
    registers)."""
    if not tile.stepped:
        return False
    fits = tile.num_chunks <= tiles.STEP_UNROLL_MAX_STEPS
    if unroll is None:
        return fits and n_rows < loop_min_rows
    if unroll and not fits:
        raise ValueError(
            f"unrolled stepped rows: {tile.num_chunks} steps > {tiles.STEP_UNROLL_MAX_STEPS}"
        )
    return unroll


def _compiled(kernel) -> int:
    """Kernels Triton has compiled so far for ``kernel``, all devices (its own cache)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def _launch(kernel, grid, args, consts, tile: RowTile, other_mode=None) -> None:
    """Launch; for stepped rows, a launch that had to compile also compiles the other mode
    (unrolled / looped) of the same specialisation, so that a later token count crossing the
    op's loop threshold never triggers a compilation (serving changes M every step). Cost on a
    cached launch: two looks at the size of Triton's kernel cache. ``other_mode()`` gives the
    other mode's constexprs where they differ in more than ``UNROLL`` (default: ``consts``
    with ``UNROLL`` flipped)."""
    warm = (
        tile.stepped and not interpreter_active() and tile.num_chunks <= tiles.STEP_UNROLL_MAX_STEPS
    )
    before = _compiled(kernel) if warm else 0
    launch(kernel, grid, *args, **consts)
    if warm and _compiled(kernel) > before:
        other = other_mode() if other_mode else {**consts, "UNROLL": not consts["UNROLL"]}
        kernel.warmup(*args, grid=grid, **other)


def _row_consts(
    tile: RowTile, width: int, n_rows: int, unroll: bool | None, loop_min_rows: int, use_pdl: bool
) -> dict:
    """Constexprs and launch options every row kernel of the family takes (rmsnorm, fused_add,
    both gated ops): tile shape and masking, launch mode (persistent loop; stepped rows unrolled
    below ``loop_min_rows`` rows or looped), PDL, warps and the persistent register cap."""
    return dict(
        BLOCK=tile.block,
        NUM_CHUNKS=tile.num_chunks,
        ROWS=tile.rows,
        MASKED=tile.rows > 1 or not tile.even(width),
        EVICT_FIRST=STREAM_EVICT_FIRST,
        PTX=not interpreter_active(),
        USE_PDL=use_pdl,
        PERSISTENT=_persistent(tile),
        PREFETCH=_prefetch(tile),
        STEPPED=tile.stepped,
        UNROLL=_unroll(tile, n_rows, unroll, loop_min_rows),
        num_warps=tile.num_warps,
        **_launch_kwargs(tile, use_pdl),
    )
