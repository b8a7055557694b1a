"""The gated_residual_next_rmsnorm kernel, its rows and its launcher (spec:
gated_residual_next_rmsnorm); the gated_residual_rmsnorm kernel (:mod:`moefuse.norm.gated_residual`)
has the same layouts and modes.

Two row layouts, chosen from the width alone (:func:`moefuse.norm.tiles.row_tile` with
``GATED_POLICY``), so a row's bits never depend on the token count:

* **Narrow rows** (up to ``GATED_POLICY.step_min_width``): ``[ROWS, BLOCK]`` one-pass tiles like the
  other norms (:mod:`moefuse.norm.triton`); the statistic is ``tl.sum`` of the tile's squares.
* **Stepped rows** (wider): the row is walked in ``[1, STEP]`` steps, STEP = 32 lanes x warps x
  ``step_vec``. Each thread accumulates its columns' squares over the steps in ascending order,
  ``acc = fma(x_k, x_k, acc)`` from ``acc = 0``, and the statistic is one ``tl.sum(acc)``: the tree
  depends on (width, STEP, warps) only. Two launch modes run the same per-step code and give the
  same bits: **unrolled** (small M: the whole row's loads in flight at once, held in registers)
  and **looped** (large M: a runtime loop with few live registers, many programs per SM; the
  row is re-read from L2 for the second pass and, for gated_residual_next, residual_out is
  re-read for the third). Any width: the loop has no register limit.

PDL: parameters are loaded before ``gdc_wait`` where the row is held in registers; activations
after it; ``gdc_launch_dependents`` after the last load of the previous kernel's data.

Public device functions (no leading underscore): ``gated_next_tile``, ``next_unrolled_row`` and
``next_stepped``, the gated_residual_next rows that the all-gather family
(``moefuse.comm.all_gather.decode``) reuses for its fused gated op (same tree, same bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse.norm import tiles
from moefuse.norm import triton as nt
from moefuse.norm.gated_steps import (
    _branch_step,
    _branch_sumsq_loop,
    _load_steps,
    _store_ffn,
    _stream_update,
)
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


# ----------------------------------------------------------------------------- narrow rows
@triton.jit
def gated_next_tile(
    b,
    res,
    nw,
    pw,
    rows,
    cols,
    pmask,
    mask,
    alpha_ptr,
    beta_ptr,
    rout_ptr,
    ffn_ptr,
    router_ptr,
    ro_st,
    f_st,
    rt_st,
    alpha_scalar,
    Hf,
    post_eps,
    next_eps,
    ALPHA_MODE: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_POST_WEIGHT: tl.constexpr,
    HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr,
):
    """One-pass tile of _gated_residual_next_kernel from the FP32 branch and stream (the
    comment at the router row says why its stores come in that order)."""
    r64 = rows.to(tl.int64)[:, None]
    if HAS_POST_WEIGHT:
        b = b * pw
    r1 = _inv_rms(tl.sum(b * b, axis=1)[:, None], Hf, post_eps)
    a = 1.0
    if ALPHA_MODE == 2:
        a = ld(alpha_ptr + cols, pmask, MASKED, False)[None, :]
    be = ld(beta_ptr + cols, pmask, MASKED, False)[None, :]
    ro = _stream_update(res, b, a, be, alpha_scalar, r1, ALPHA_MODE)
    ro_ptrs = rout_ptr + r64 * ro_st + cols[None, :]
    if not HAS_ROUTER:  # with a router row, residual_out is stored last (see below)
        _st(ro_ptrs, ro, mask, MASKED, PTX)
    # padded / masked-off columns hold ro = 0 (b = res = 0 there): they add nothing
    r2 = tl.broadcast_to(_inv_rms(tl.sum(ro * ro, axis=1)[:, None], Hf, next_eps), ro.shape)
    ffn_ptrs = ffn_ptr + r64 * f_st + cols[None, :]
    router_ptrs = router_ptr + r64 * rt_st + cols[None, :]
    y = (ro * r2) * nw
    # With HAS_ROUTER, _store_ffn rounds ffn_input from the stored router row, and residual_out
    # is stored last: that order keeps ffn_input's bits independent of HAS_ROUTER. Triton picks
    # each tensor's register layout from the memory operations around it, and the layout fixes
    # the order of a row sum. With residual_out stored first here too (before 2026-12-02) this
    # kernel summed residual_out^2 with 4 columns per thread and the one without a router row
    # with 8, and ffn_input differed by an ulp in up to 3.9 % of the rows at 2048 columns (H200,
    # 75a3027:scripts/probe_batch_invariance.py). Stored last, both kernels keep the same layouts
    # and one sum each (moefuse.tools.audit_reduce_trees, tests/test_reduce_trees.py), at no cost
    # (0.88-1.005 x the old router kernel, notes/norm.md).
    _store_ffn(ffn_ptrs, router_ptrs, y, mask, MASKED, HAS_ROUTER, PTX)
    if HAS_ROUTER:
        _st(ro_ptrs, ro, mask, MASKED, PTX)


# ----------------------------------------------------------------------------- stepped rows
@triton.jit
def next_unrolled_row(
    bs,
    rs,
    nws,
    pws,
    als,
    bes,
    rout_ptr,
    ffn_ptr,
    router_ptr,
    ro_row,
    f_row,
    rt_row,
    H,
    Hf,
    alpha_scalar,
    post_eps,
    next_eps,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    MASKED: tl.constexpr,
    ALPHA_MODE: tl.constexpr,
    HAS_POST_WEIGHT: tl.constexpr,
    HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr,
):
    """The math and stores of an unrolled stepped row of _gated_residual_next_kernel from its
    steps in registers: branch ``bs`` and residual ``rs`` (FP32 tuples), parameters ``nws`` /
    ``pws`` / ``als`` / ``bes`` (``step_params``). Also run by the fused all-gather decode
    kernel on branch steps read from its slots (comm/all_gather/decode.py): the same bits."""
    acc2 = tl.zeros([1, STEP], dtype=tl.float32)
    bws, ss1 = _weighted_sumsq(bs, pws, STEP, STEPS, HAS_POST_WEIGHT)
    r1 = _inv_rms(ss1, Hf, post_eps)
    ros = ()
    for k in tl.static_range(STEPS):
        cols, cm = step_cols(k, H, STEP)
        ro = _stream_update(rs[k], bws[k], als[k], bes[k], alpha_scalar, r1, ALPHA_MODE)
        _st(rout_ptr + ro_row + cols, ro, cm, MASKED, PTX)
        ros = ros + (ro,)
        acc2 = tl.fma(ro, ro, acc2)
    r2 = _inv_rms(tl.sum(acc2, axis=1)[:, None], Hf, next_eps)
    for k in tl.static_range(STEPS):
        cols, cm = step_cols(k, H, STEP)
        _store_ffn(
            ffn_ptr + f_row + cols,
            router_ptr + rt_row + cols,
            (ros[k] * r2) * nws[k],
            cm,
            MASKED,
            HAS_ROUTER,
            PTX,
        )


# ``ptrs`` = (b, res, nw, alpha, beta, pw, rout, ffn, router) pointers, ``row_offs`` = the row's
# offsets (b, res, residual_out, ffn, router) and ``scalars`` = (alpha_scalar, post_eps,
# next_eps, next_gain_center, post_gain_center): next_stepped's arguments, grouped for its modes.
@triton.jit
def _next_stepped_unrolled(
    ptrs,
    row_offs,
    scalars,
    H,
    Hf,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    MASKED: tl.constexpr,
    ALPHA_MODE: tl.constexpr,
    HAS_POST_WEIGHT: tl.constexpr,
    HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """:func:`next_stepped`'s unrolled mode: parameters before ``gdc_wait``, every step of the
    branch and residual rows in flight together, then :func:`next_unrolled_row`."""
    b_ptr, res_ptr, nw_ptr, alpha_ptr, beta_ptr, pw_ptr, rout_ptr, ffn_ptr, router_ptr = ptrs
    b_row, r_row, ro_row, f_row, rt_row = row_offs
    alpha_scalar, post_eps, next_eps, ngc, pgc = scalars
    nws = step_params(nw_ptr, H, ngc, STEP, STEPS, MASKED, True)
    pws = step_params(pw_ptr, H, pgc, STEP, STEPS, MASKED, HAS_POST_WEIGHT)
    als = step_params(alpha_ptr, H, 0.0, STEP, STEPS, MASKED, ALPHA_MODE == 2)
    bes = step_params(beta_ptr, H, 0.0, STEP, STEPS, MASKED, True)
    if USE_PDL:
        gdc_wait()
    bs, rs = _load_steps(b_ptr, res_ptr, b_row, r_row, H, STEP, STEPS, MASKED)
    if USE_PDL:
        gdc_launch_dependents()
    next_unrolled_row(
        bs,
        rs,
        nws,
        pws,
        als,
        bes,
        rout_ptr,
        ffn_ptr,
        router_ptr,
        ro_row,
        f_row,
        rt_row,
        H,
        Hf,
        alpha_scalar,
        post_eps,
        next_eps,
        STEP,
        STEPS,
        MASKED,
        ALPHA_MODE,
        HAS_POST_WEIGHT,
        HAS_ROUTER,
        PTX,
    )


@triton.jit
def _next_stepped_looped(
    ptrs,
    row_offs,
    scalars,
    H,
    Hf,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    MASKED: tl.constexpr,
    ALPHA_MODE: tl.constexpr,
    HAS_POST_WEIGHT: tl.constexpr,
    HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """:func:`next_stepped`'s looped mode: the branch statistic, then residual_out step by step
    (stored, its statistic accumulated), then ffn / router from the stored residual_out."""
    b_ptr, res_ptr, nw_ptr, alpha_ptr, beta_ptr, pw_ptr, rout_ptr, ffn_ptr, router_ptr = ptrs
    b_row, r_row, ro_row, f_row, rt_row = row_offs
    alpha_scalar, post_eps, next_eps, ngc, pgc = scalars
    acc2 = tl.zeros([1, STEP], dtype=tl.float32)
    if USE_PDL:
        gdc_wait()
    ss1 = _branch_sumsq_loop(b_ptr, b_row, pw_ptr, H, pgc, STEP, STEPS, MASKED, HAS_POST_WEIGHT)
    r1 = _inv_rms(ss1, Hf, post_eps)
    for k in tl.range(0, STEPS):
        cols, cm = step_cols(k, H, STEP)
        b = _branch_step(
            b_ptr, b_row, pw_ptr, cols, cm, pgc, MASKED, HAS_POST_WEIGHT, "evict_first"
        )
        res = ldp(res_ptr + r_row + cols, cm, MASKED, "evict_first")
        a = _param(alpha_ptr, cols, cm, 0.0, MASKED, ALPHA_MODE == 2)
        be = _param(beta_ptr, cols, cm, 0.0, MASKED, True)
        ro = _stream_update(res, b, a, be, alpha_scalar, r1, ALPHA_MODE)
        _st(rout_ptr + ro_row + cols, ro, cm, MASKED, PTX)
        acc2 = tl.fma(ro, ro, acc2)
    if USE_PDL:
        gdc_launch_dependents()
    r2 = _inv_rms(tl.sum(acc2, axis=1)[:, None], Hf, next_eps)
    # this program's residual_out stores visible to all of its threads before the re-read
    tl.debug_barrier()
    for k in tl.range(0, STEPS):
        cols, cm = step_cols(k, H, STEP)
        nw = _param(nw_ptr, cols, cm, ngc, MASKED, True)
        ro = ldp(rout_ptr + ro_row + cols, cm, MASKED, "evict_first")
        ffn_ptrs = ffn_ptr + f_row + cols
        router_ptrs = router_ptr + rt_row + cols
        _store_ffn(ffn_ptrs, router_ptrs, (ro * r2) * nw, cm, MASKED, HAS_ROUTER, PTX)


@triton.jit
def next_stepped(
    b_ptr,
    res_ptr,
    nw_ptr,
    alpha_ptr,
    beta_ptr,
    pw_ptr,
    rout_ptr,
    ffn_ptr,
    router_ptr,
    row,
    H,
    Hf,
    b_st,
    r_st,
    ro_st,
    f_st,
    rt_st,
    alpha_scalar,
    post_eps,
    next_eps,
    ngc,
    pgc,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    UNROLL: tl.constexpr,
    MASKED: tl.constexpr,
    ALPHA_MODE: tl.constexpr,
    HAS_POST_WEIGHT: tl.constexpr,
    HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One row of _gated_residual_next_kernel, stepped layout: statistic of b, residual_out step
    by step (stored; its statistic accumulated), then ffn / router from residual_out (registers
    when unrolled, the stored FP32 values otherwise: the same bits)."""
    ptrs = (b_ptr, res_ptr, nw_ptr, alpha_ptr, beta_ptr, pw_ptr, rout_ptr, ffn_ptr, router_ptr)
    row_offs = (row * b_st, row * r_st, row * ro_st, row * f_st, row * rt_st)
    scalars = (alpha_scalar, post_eps, next_eps, ngc, pgc)
    if UNROLL:
        _next_stepped_unrolled(
            ptrs,
            row_offs,
            scalars,
            H,
            Hf,
            STEP,
            STEPS,
            MASKED,
            ALPHA_MODE,
            HAS_POST_WEIGHT,
            HAS_ROUTER,
            PTX,
            USE_PDL,
        )
    else:
        _next_stepped_looped(
            ptrs,
            row_offs,
            scalars,
            H,
            Hf,
            STEP,
            STEPS,
            MASKED,
            ALPHA_MODE,
            HAS_POST_WEIGHT,
            HAS_ROUTER,
            PTX,
            USE_PDL,
        )


@triton.jit
def _next_tile_at(pair, rows, cols, mask, args):
    """:func:`gated_next_tile` of a (branch, residual) tile ``pair`` in the stored dtypes: the
    ``TILE`` of :func:`moefuse.norm.row_loop.one_pass_rows`. ``args`` = ((nw, pw, pmask) rows,
    (alpha, beta, rout, ffn, router) pointers, (ro_st, f_st, rt_st), (alpha_scalar, Hf,
    post_eps, next_eps), ALPHA_MODE, MASKED, HAS_POST_WEIGHT, HAS_ROUTER, PTX); the strides
    may be unpacked: :func:`_next_one_pass` has unpacked the kernel's tuple already."""
    nw, pw, pm = args[0]
    alpha_ptr, beta_ptr, rout_ptr, ffn_ptr, router_ptr = args[1]
    ro_st, f_st, rt_st = args[2]
    alpha_scalar, Hf, post_eps, next_eps = args[3]
    # constexprs by index: an unpacking assignment would turn them into tensors
    ALPHA_MODE: tl.constexpr = args[4]
    MASKED: tl.constexpr = args[5]
    HAS_POST_WEIGHT: tl.constexpr = args[6]
    HAS_ROUTER: tl.constexpr = args[7]
    PTX: tl.constexpr = args[8]
    gated_next_tile(
        pair[0].to(tl.float32),
        pair[1].to(tl.float32),
        nw,
        pw,
        rows,
        cols,
        pm,
        mask,
        alpha_ptr,
        beta_ptr,
        rout_ptr,
        ffn_ptr,
        router_ptr,
        ro_st,
        f_st,
        rt_st,
        alpha_scalar,
        Hf,
        post_eps,
        next_eps,
        ALPHA_MODE,
        MASKED,
        HAS_POST_WEIGHT,
        HAS_ROUTER,
        PTX,
    )


# ``ptrs`` = (b, res, nw, alpha, beta, pw, rout, ffn, router) pointers, ``strides`` = (b_st, r_st,
# ro_st, f_st, rt_st), ``scalars`` as the kernel's: _gated_residual_next_kernel's arguments.
@triton.jit
def _next_one_pass(
    ptrs,
    strides,
    scalars,
    pid,
    n_rows,
    H,
    Hf,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    ALPHA_MODE: tl.constexpr,
    HAS_POST_WEIGHT: tl.constexpr,
    HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Rows that fit one block: the weight rows (before ``gdc_wait``), then
    :func:`gated_next_tile` of this program's tile or of its tiles of the persistent loop."""
    b_ptr, res_ptr, nw_ptr, alpha_ptr, beta_ptr, pw_ptr, rout_ptr, ffn_ptr, router_ptr = ptrs
    b_st, r_st, ro_st, f_st, rt_st = strides
    alpha_scalar, post_eps, next_eps, next_gain_center, post_gain_center = scalars
    cols = tl.arange(0, BLOCK)
    pm = cols < H
    nw = ld(nw_ptr + cols, pm, MASKED, False)[None, :] + next_gain_center
    pw = 1.0
    if HAS_POST_WEIGHT:
        pw = ld(pw_ptr + cols, pm, MASKED, False)[None, :] + post_gain_center
    # the tile's arguments built in the call: a tuple assigned to a name holds no constexprs
    one_pass_rows(
        add_pair,
        (b_ptr, res_ptr, b_st, r_st),
        keep_pair,
        _next_tile_at,
        (
            (nw, pw, pm),
            (alpha_ptr, beta_ptr, rout_ptr, ffn_ptr, router_ptr),
            (ro_st, f_st, rt_st),
            (alpha_scalar, Hf, post_eps, next_eps),
            ALPHA_MODE,
            MASKED,
            HAS_POST_WEIGHT,
            HAS_ROUTER,
            PTX,
        ),
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
def _gated_residual_next_kernel(
    b_ptr,
    res_ptr,
    nw_ptr,
    alpha_ptr,
    beta_ptr,
    pw_ptr,
    rout_ptr,
    ffn_ptr,
    router_ptr,
    n_rows,
    H,
    Hf,
    strides,
    scalars,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    ALPHA_MODE: tl.constexpr,
    HAS_POST_WEIGHT: tl.constexpr,
    HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
    STEPPED: tl.constexpr,
    UNROLL: tl.constexpr,
):
    """Gated stream update, then the next RMSNorm of the FP32 residual_out.

    ALPHA_MODE: 0 = scalar 1.0 (u = residual), 1 = other scalar, 2 = per-channel tensor.
    ``strides`` and ``scalars`` are tuples, unpacked by name on the first lines (the offline
    compile scripts read these names to type and specialise each element).
    """
    b_st, r_st, ro_st, f_st, rt_st = strides
    alpha_scalar, post_eps, next_eps, next_gain_center, post_gain_center = scalars
    pid = tl.program_id(0)
    if STEPPED:
        next_stepped(
            b_ptr,
            res_ptr,
            nw_ptr,
            alpha_ptr,
            beta_ptr,
            pw_ptr,
            rout_ptr,
            ffn_ptr,
            router_ptr,
            pid.to(tl.int64),
            H,
            Hf,
            b_st,
            r_st,
            ro_st,
            f_st,
            rt_st,
            alpha_scalar,
            post_eps,
            next_eps,
            next_gain_center,
            post_gain_center,
            BLOCK,
            NUM_CHUNKS,
            UNROLL,
            MASKED,
            ALPHA_MODE,
            HAS_POST_WEIGHT,
            HAS_ROUTER,
            PTX,
            USE_PDL,
        )
    else:
        ptrs = (b_ptr, res_ptr, nw_ptr, alpha_ptr, beta_ptr, pw_ptr, rout_ptr, ffn_ptr, router_ptr)
        _next_one_pass(
            ptrs,
            strides,
            scalars,
            pid,
            n_rows,
            H,
            Hf,
            BLOCK,
            ROWS,
            MASKED,
            EVICT_FIRST,
            ALPHA_MODE,
            HAS_POST_WEIGHT,
            HAS_ROUTER,
            PTX,
            USE_PDL,
            PERSISTENT,
            PREFETCH,
        )


# ----------------------------------------------------------------------------- launcher
def launch_gated_residual_next_rmsnorm(
    branch: torch.Tensor,
    residual: torch.Tensor,
    next_weight: torch.Tensor,
    alpha: torch.Tensor | None,
    alpha_scalar: float,
    beta: torch.Tensor,
    post_weight: torch.Tensor | None,
    residual_out: torch.Tensor,
    ffn_input: torch.Tensor,
    router_input: torch.Tensor | None,
    post_eps: float,
    next_eps: float,
    next_gain_center: float,
    post_gain_center: float,
    use_pdl: bool,
    tile: RowTile | None = None,
    unroll: bool | None = None,
) -> None:
    """On validated tensors: residual_out (FP32 [M, H], may be residual) = u +
    (beta * b) * rsqrt(mean_sq(b) + post_eps), b = f32(branch) [* (post_weight + c)], u =
    residual, alpha_scalar * residual or alpha * residual (alpha [H] FP32 when given); then
    router = (residual_out * rsqrt(mean_sq(residual_out) + next_eps)) * (next_weight + c),
    ffn_input = cast(router) in branch's dtype, router_input (FP32) when given. Writes
    residual_out, ffn_input and router_input only. ``tile`` / ``unroll``: see
    :func:`moefuse.norm.gated_residual.launch_gated_residual_rmsnorm`."""
    n_rows, width = branch.shape
    if n_rows == 0:
        return
    tile = tile or row_tile(width, GATED_POLICY)
    alpha_mode = 2 if alpha is not None else (0 if alpha_scalar == 1.0 else 1)
    router = router_input if router_input is not None else residual_out
    args = (
        branch, residual, next_weight, alpha if alpha is not None else beta, beta,
        post_weight if post_weight is not None else next_weight,
        residual_out, ffn_input, router,
        n_rows, width, float(width),
        (branch.stride(0), residual.stride(0), residual_out.stride(0), ffn_input.stride(0),
         router.stride(0)),
        (alpha_scalar, post_eps, next_eps, next_gain_center, post_gain_center),
    )  # fmt: skip
    consts = nt._row_consts(tile, width, n_rows, unroll, tiles.STEP_LOOP_MIN_ROWS, use_pdl)
    consts.update(
        ALPHA_MODE=alpha_mode,
        HAS_POST_WEIGHT=post_weight is not None,
        HAS_ROUTER=router_input is not None,
    )
    _launch(
        _gated_residual_next_kernel,
        nt._grid(tile, tile.grid(n_rows)[0], branch.device),
        args,
        consts,
        tile,
    )
