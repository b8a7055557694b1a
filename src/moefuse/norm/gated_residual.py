"""The gated_residual_rmsnorm kernel and its launcher (spec: gated_residual_rmsnorm):
``out = alpha * residual + beta * (x * r)``, ``x = f32(branch) [* (f32(w) + c)]``.

Row layouts, modes and PDL order as for gated_residual_next (:mod:`moefuse.norm.gated`
describes them): narrow rows in one-pass ``[ROWS, BLOCK]`` tiles (or the persistent row loop),
wider rows stepped, unrolled at small M and looped at large M (the same bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse.norm import tiles
from moefuse.norm import triton as nt
from moefuse.norm.gated_steps import _branch_step, _branch_sumsq_loop, _gated_out, _load_steps
from moefuse.norm.row_loop import add_pair, keep_pair, one_pass_rows
from moefuse.norm.tiles import GATED_POLICY, RowTile, row_tile
from moefuse.norm.triton import (
    _inv_rms,
    _launch,
    _param,
    _st,
    _weighted_sumsq,
    ld,
    ldp,
    step_cols,
    step_params,
)


# ----------------------------------------------------------------------------- rows
@triton.jit
def _gated_tile(pair, rows, cols, mask, args):
    """out = alpha * res + beta * (x * r), x = branch [* w] (FP32) of one ``[ROWS, BLOCK]`` tile
    from its (branch, residual) ``pair`` (stored dtypes): the ``TILE`` of
    :func:`moefuse.norm.row_loop.one_pass_rows`. ``args`` = ((alpha row, beta row, w row, out_ptr,
    o_st, Hf, eps), MASKED, HAS_WEIGHT, PTX); o_st may be unpacked: :func:`_gated_one_pass`
    has unpacked the kernel's tuple already."""
    a, be, w, out_ptr, o_st, Hf, eps = args[0]
    # constexprs by index: an unpacking assignment would turn them into tensors
    MASKED: tl.constexpr = args[1]
    HAS_WEIGHT: tl.constexpr = args[2]
    PTX: tl.constexpr = args[3]
    x = pair[0].to(tl.float32)
    res = pair[1].to(tl.float32)
    if HAS_WEIGHT:
        x = x * w
    r = tl.broadcast_to(_inv_rms(tl.sum(x * x, axis=1)[:, None], Hf, eps), x.shape)
    o_row = rows.to(tl.int64)[:, None] * o_st
    _st(out_ptr + o_row + cols[None, :], _gated_out(a, res, be, x, r), mask, MASKED, PTX)


@triton.jit
def _gated_stepped(
    b_ptr,
    res_ptr,
    w_ptr,
    alpha_ptr,
    beta_ptr,
    out_ptr,
    row,
    H,
    Hf,
    b_st,
    r_st,
    o_st,
    eps,
    gc,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    UNROLL: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row of _gated_residual_kernel, stepped layout (see the module docstring)."""
    b_row = row * b_st
    r_row = row * r_st
    o_row = row * o_st
    if UNROLL:
        als = step_params(alpha_ptr, H, 0.0, STEP, STEPS, MASKED, True)
        bes = step_params(beta_ptr, H, 0.0, STEP, STEPS, MASKED, True)
        ws = step_params(w_ptr, H, gc, STEP, STEPS, MASKED, HAS_WEIGHT)
        if USE_PDL:
            gdc_wait()
        xs, rs = _load_steps(b_ptr, res_ptr, b_row, r_row, H, STEP, STEPS, MASKED)
        if USE_PDL:
            gdc_launch_dependents()
        xws, ss = _weighted_sumsq(xs, ws, STEP, STEPS, HAS_WEIGHT)
        r = _inv_rms(ss, Hf, eps)
        for k in tl.static_range(STEPS):
            cols, cm = step_cols(k, H, STEP)
            _st(
                out_ptr + o_row + cols,
                _gated_out(als[k], rs[k], bes[k], xws[k], r),
                cm,
                MASKED,
                PTX,
            )
    else:
        if USE_PDL:
            gdc_wait()
        r = _inv_rms(
            _branch_sumsq_loop(b_ptr, b_row, w_ptr, H, gc, STEP, STEPS, MASKED, HAS_WEIGHT), Hf, eps
        )
        for k in tl.range(0, STEPS):
            cols, cm = step_cols(k, H, STEP)
            x = _branch_step(b_ptr, b_row, w_ptr, cols, cm, gc, MASKED, HAS_WEIGHT, "evict_first")
            res = ldp(res_ptr + r_row + cols, cm, MASKED, "evict_first")
            a = _param(alpha_ptr, cols, cm, 0.0, MASKED, True)
            be = _param(beta_ptr, cols, cm, 0.0, MASKED, True)
            _st(out_ptr + o_row + cols, _gated_out(a, res, be, x, r), cm, MASKED, PTX)
        if USE_PDL:
            gdc_launch_dependents()


# ----------------------------------------------------------------------------- one-pass rows
# ``ptrs`` = (b, res, w, alpha, beta, out) pointers and ``strides`` = (b_st, r_st, o_st):
# _gated_residual_kernel's arguments, grouped for its row modes.
@triton.jit
def _gated_one_pass(
    ptrs,
    strides,
    pid,
    n_rows,
    H,
    Hf,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Rows that fit one block: the parameter rows (before ``gdc_wait``), then
    :func:`_gated_tile` of this program's tile or of its tiles of the persistent loop."""
    b_ptr, res_ptr, w_ptr, alpha_ptr, beta_ptr, out_ptr = ptrs
    b_st, r_st, o_st = strides
    cols = tl.arange(0, BLOCK)
    pm = cols < H
    a = ld(alpha_ptr + cols, pm, MASKED, False)[None, :]
    be = ld(beta_ptr + cols, pm, MASKED, False)[None, :]
    w = 1.0
    if HAS_WEIGHT:
        w = ld(w_ptr + cols, pm, MASKED, False)[None, :] + gain_center
    one_pass_rows(
        add_pair,
        (b_ptr, res_ptr, b_st, r_st),
        keep_pair,
        _gated_tile,
        ((a, be, w, out_ptr, o_st, Hf, eps), MASKED, HAS_WEIGHT, PTX),
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


# ----------------------------------------------------------------------------- kernel
# Narrow rows: one [ROWS, BLOCK] tile per program, or the persistent row loop (see norm.triton).
# Stepped rows: one row per program (UNROLL or looped).
@triton.jit(do_not_specialize=["n_rows"])
def _gated_residual_kernel(
    b_ptr,
    res_ptr,
    w_ptr,
    alpha_ptr,
    beta_ptr,
    out_ptr,
    n_rows,
    H,
    Hf,
    b_st,
    r_st,
    o_st,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
    STEPPED: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """x = f32(branch) [* (f32(w) + c)]; out = alpha * residual + beta * (x * r)  (all FP32)."""
    pid = tl.program_id(0)
    if STEPPED:
        _gated_stepped(
            b_ptr,
            res_ptr,
            w_ptr,
            alpha_ptr,
            beta_ptr,
            out_ptr,
            pid.to(tl.int64),
            H,
            Hf,
            b_st,
            r_st,
            o_st,
            eps,
            gain_center,
            BLOCK,
            NUM_CHUNKS,
            UNROLL,
            MASKED,
            HAS_WEIGHT,
            PTX,
            USE_PDL,
        )
    else:
        ptrs = (b_ptr, res_ptr, w_ptr, alpha_ptr, beta_ptr, out_ptr)
        _gated_one_pass(
            ptrs,
            (b_st, r_st, o_st),
            pid,
            n_rows,
            H,
            Hf,
            eps,
            gain_center,
            BLOCK,
            ROWS,
            MASKED,
            EVICT_FIRST,
            HAS_WEIGHT,
            PTX,
            USE_PDL,
            PERSISTENT,
            PREFETCH,
        )


# ----------------------------------------------------------------------------- launcher
def launch_gated_residual_rmsnorm(
    branch: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    gain_center: float,
    use_pdl: bool,
    tile: RowTile | None = None,
    unroll: bool | None = None,
) -> None:
    """gated_residual_rmsnorm on validated tensors: ``out = alpha * residual + beta * (x * r)`` with
    ``x = f32(branch) [* (f32(weight) + gain_center)]``. branch [M, H] BF16/FP16, residual and
    out [M, H] FP32 (row strides free; out may be residual), alpha / beta [H] FP32, weight [H].
    Writes ``out`` only. ``tile`` / ``unroll`` override the width's tile and the stepped mode
    (tests and sweeps; neither changes a bit)."""
    n_rows, width = branch.shape
    if n_rows == 0:
        return
    tile = tile or row_tile(width, GATED_POLICY)
    args = (
        branch, residual, weight if weight is not None else alpha, alpha, beta, out,
        n_rows, width, float(width),
        branch.stride(0), residual.stride(0), out.stride(0),
        eps, gain_center,
    )  # fmt: skip
    consts = nt._row_consts(tile, width, n_rows, unroll, tiles.STEP_LOOP_MIN_ROWS, use_pdl)
    _launch(
        _gated_residual_kernel,
        nt._grid(tile, tile.grid(n_rows)[0], branch.device),
        args,
        {**consts, "HAS_WEIGHT": weight is not None},
        tile,
    )
