"""Gated residual RMSNorm kernels and their launchers (spec: gated_residual_*).

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
from moefuse.norm.tiles import GATED_POLICY, RowTile, row_tile
from moefuse.norm.triton import (
    _inv_rms,
    _launch,
    _loop_tile,
    _param,
    _st,
    _weighted_sumsq,
    add_load,
    ld,
    ldp,
    step_cols,
    step_params,
    tile_rows,
)


# ----------------------------------------------------------------------------- element math
@triton.jit
def _gated_out(a, res, be, x, r):
    """alpha * residual + beta * (x * r), with the one FMA written out (see norm.triton)."""
    return tl.fma(a, res, be * (x * r))


@triton.jit
def _stream_update(res, b, a, be, alpha_scalar, r1, ALPHA_MODE: tl.constexpr):
    """residual_out = u + (beta * b) * r1; u = residual, scalar * residual or alpha * residual."""
    if ALPHA_MODE == 1:
        res = alpha_scalar * res
    elif ALPHA_MODE == 2:
        res = a * res
    # explicit FMA: left to the compiler, contraction can differ between copies of the expression
    # that Triton rematerialises for different layouts, giving two values of one element
    return tl.fma(be * b, tl.broadcast_to(r1, b.shape), res)


@triton.jit
def _store_ffn(ffn_ptrs, router_ptrs, y, mask, MASKED: tl.constexpr, HAS_ROUTER: tl.constexpr,
               PTX: tl.constexpr):  # fmt: skip
    """ffn_input = cast(y) and, when asked, router_input = y (FP32).

    With a router output, ffn_input is rounded from the stored router values re-read by the same
    threads: Triton may recompute ``y`` in a second register layout for the 16-bit store, and on
    H200 that copy differed from the FP32 one by an ulp now and then (ffn != cast(router)).
    """
    if HAS_ROUTER:
        _st(router_ptrs, y, mask, MASKED, PTX)
        tl.debug_barrier()
        y = ld(router_ptrs, mask, MASKED, False)
    _st(ffn_ptrs, y, mask, MASKED, PTX)


# ----------------------------------------------------------------------------- narrow rows
@triton.jit
def _gated_tile(x, res, a, be, w, rows, cols, mask, out_ptr, o_st, Hf, eps, MASKED: tl.constexpr,
                HAS_WEIGHT: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """out = alpha * res + beta * (x * r), x = branch [* w] (FP32)."""
    if HAS_WEIGHT:
        x = x * w
    r = tl.broadcast_to(_inv_rms(tl.sum(x * x, axis=1)[:, None], Hf, eps), x.shape)
    o_row = rows.to(tl.int64)[:, None] * o_st
    _st(out_ptr + o_row + cols[None, :], _gated_out(a, res, be, x, r), mask, MASKED, PTX)


@triton.jit
def gated_next_tile(b, res, nw, pw, rows, cols, pmask, mask, alpha_ptr, beta_ptr, rout_ptr,
                    ffn_ptr, router_ptr, ro_st, f_st, rt_st, alpha_scalar, Hf, post_eps,
                    next_eps, ALPHA_MODE: tl.constexpr, MASKED: tl.constexpr,
                    HAS_POST_WEIGHT: tl.constexpr, HAS_ROUTER: tl.constexpr,
                    PTX: tl.constexpr):  # fmt: skip
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
    # scripts/probe_batch_invariance.py). Stored last, it leaves both kernels the same layouts
    # and one sum each (moefuse.tools.audit_reduce_trees, tests/test_reduce_trees.py), at no cost
    # (0.88-1.005 x the old router kernel, notes/norm.md).
    _store_ffn(ffn_ptrs, router_ptrs, y, mask, MASKED, HAS_ROUTER, PTX)
    if HAS_ROUTER:
        _st(ro_ptrs, ro, mask, MASKED, PTX)


# ----------------------------------------------------------------------------- stepped rows
@triton.jit
def _branch_step(b_ptr, b_row, w_ptr, cols, cm, gc, MASKED: tl.constexpr,
                 HAS_WEIGHT: tl.constexpr, POLICY: tl.constexpr):  # fmt: skip
    """x = f32(branch) [* (w + c)] of one step (looped mode)."""
    x = ldp(b_ptr + b_row + cols, cm, MASKED, POLICY)
    if HAS_WEIGHT:
        x = x * _param(w_ptr, cols, cm, gc, MASKED, True)
    return x


@triton.jit
def _branch_sumsq_loop(b_ptr, b_row, w_ptr, H, gc, STEP: tl.constexpr, STEPS: tl.constexpr,
                       MASKED: tl.constexpr, HAS_WEIGHT: tl.constexpr):  # fmt: skip
    """[1, 1] statistic of x over the row, looped; loads keep the row in L2 for the next pass."""
    acc = tl.zeros([1, STEP], dtype=tl.float32)
    for k in tl.range(0, STEPS):
        cols, cm = step_cols(k, H, STEP)
        x = _branch_step(b_ptr, b_row, w_ptr, cols, cm, gc, MASKED, HAS_WEIGHT, "evict_last")
        acc = tl.fma(x, x, acc)
    return tl.sum(acc, axis=1)[:, None]


@triton.jit
def _load_steps(a_ptr, b_ptr, a_row, b_row, H, STEP: tl.constexpr, STEPS: tl.constexpr,
                MASKED: tl.constexpr):  # fmt: skip
    """Every step of two activation rows as FP32 tuples, all loads issued together."""
    xs = ()
    ys = ()
    for k in tl.static_range(STEPS):
        cols, cm = step_cols(k, H, STEP)
        xs = xs + (ldp(a_ptr + a_row + cols, cm, MASKED, "evict_first"),)
        ys = ys + (ldp(b_ptr + b_row + cols, cm, MASKED, "evict_first"),)
    return xs, ys


@triton.jit
def _gated_stepped(b_ptr, res_ptr, w_ptr, alpha_ptr, beta_ptr, out_ptr, row, H, Hf, b_st, r_st,
                   o_st, eps, gc, STEP: tl.constexpr, STEPS: tl.constexpr, UNROLL: tl.constexpr,
                   MASKED: tl.constexpr, HAS_WEIGHT: tl.constexpr, PTX: tl.constexpr,
                   USE_PDL: tl.constexpr):  # fmt: skip
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
            _st(out_ptr + o_row + cols, _gated_out(als[k], rs[k], bes[k], xws[k], r), cm, MASKED,
                PTX)  # fmt: skip
    else:
        if USE_PDL:
            gdc_wait()
        r = _inv_rms(_branch_sumsq_loop(b_ptr, b_row, w_ptr, H, gc, STEP, STEPS, MASKED,
                                        HAS_WEIGHT), Hf, eps)  # fmt: skip
        for k in tl.range(0, STEPS):
            cols, cm = step_cols(k, H, STEP)
            x = _branch_step(b_ptr, b_row, w_ptr, cols, cm, gc, MASKED, HAS_WEIGHT, "evict_first")
            res = ldp(res_ptr + r_row + cols, cm, MASKED, "evict_first")
            a = _param(alpha_ptr, cols, cm, 0.0, MASKED, True)
            be = _param(beta_ptr, cols, cm, 0.0, MASKED, True)
            _st(out_ptr + o_row + cols, _gated_out(a, res, be, x, r), cm, MASKED, PTX)
        if USE_PDL:
            gdc_launch_dependents()


@triton.jit
def next_unrolled_row(bs, rs, nws, pws, als, bes, rout_ptr, ffn_ptr, router_ptr, ro_row, f_row,
                      rt_row, H, Hf, alpha_scalar, post_eps, next_eps, STEP: tl.constexpr,
                      STEPS: tl.constexpr, MASKED: tl.constexpr, ALPHA_MODE: tl.constexpr,
                      HAS_POST_WEIGHT: tl.constexpr, HAS_ROUTER: tl.constexpr,
                      PTX: tl.constexpr):  # fmt: skip
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
        _store_ffn(ffn_ptr + f_row + cols, router_ptr + rt_row + cols, (ros[k] * r2) * nws[k],
                   cm, MASKED, HAS_ROUTER, PTX)  # fmt: skip


@triton.jit
def next_stepped(b_ptr, res_ptr, nw_ptr, alpha_ptr, beta_ptr, pw_ptr, rout_ptr, ffn_ptr,
                 router_ptr, row, H, Hf, b_st, r_st, ro_st, f_st, rt_st, alpha_scalar, post_eps,
                 next_eps, ngc, pgc, STEP: tl.constexpr, STEPS: tl.constexpr,
                 UNROLL: tl.constexpr, MASKED: tl.constexpr, ALPHA_MODE: tl.constexpr,
                 HAS_POST_WEIGHT: tl.constexpr, HAS_ROUTER: tl.constexpr, PTX: tl.constexpr,
                 USE_PDL: tl.constexpr):  # fmt: skip
    """One row of _gated_residual_next_kernel, stepped layout: statistic of b, residual_out step
    by step (stored; its statistic accumulated), then ffn / router from residual_out (registers
    when unrolled, the stored FP32 values otherwise: the same bits)."""
    b_row = row * b_st
    r_row = row * r_st
    ro_row = row * ro_st
    f_row = row * f_st
    rt_row = row * rt_st
    acc2 = tl.zeros([1, STEP], dtype=tl.float32)
    if UNROLL:
        nws = step_params(nw_ptr, H, ngc, STEP, STEPS, MASKED, True)
        pws = step_params(pw_ptr, H, pgc, STEP, STEPS, MASKED, HAS_POST_WEIGHT)
        als = step_params(alpha_ptr, H, 0.0, STEP, STEPS, MASKED, ALPHA_MODE == 2)
        bes = step_params(beta_ptr, H, 0.0, STEP, STEPS, MASKED, True)
        if USE_PDL:
            gdc_wait()
        bs, rs = _load_steps(b_ptr, res_ptr, b_row, r_row, H, STEP, STEPS, MASKED)
        if USE_PDL:
            gdc_launch_dependents()
        next_unrolled_row(bs, rs, nws, pws, als, bes, rout_ptr, ffn_ptr, router_ptr, ro_row,
                           f_row, rt_row, H, Hf, alpha_scalar, post_eps, next_eps, STEP, STEPS,
                           MASKED, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER, PTX)  # fmt: skip
    else:
        if USE_PDL:
            gdc_wait()
        r1 = _inv_rms(_branch_sumsq_loop(b_ptr, b_row, pw_ptr, H, pgc, STEP, STEPS, MASKED,
                                         HAS_POST_WEIGHT), Hf, post_eps)  # fmt: skip
        for k in tl.range(0, STEPS):
            cols, cm = step_cols(k, H, STEP)
            b = _branch_step(b_ptr, b_row, pw_ptr, cols, cm, pgc, MASKED, HAS_POST_WEIGHT,
                             "evict_first")  # fmt: skip
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
            _store_ffn(ffn_ptr + f_row + cols, router_ptr + rt_row + cols, (ro * r2) * nw, cm,
                       MASKED, HAS_ROUTER, PTX)  # fmt: skip


# ----------------------------------------------------------------------------- kernels
# Narrow rows: one [ROWS, BLOCK] tile per program, or the persistent row loop (see norm.triton).
# Stepped rows: one row per program (UNROLL or looped).
@triton.jit(do_not_specialize=["n_rows"])
def _gated_residual_kernel(
    b_ptr, res_ptr, w_ptr, alpha_ptr, beta_ptr, out_ptr,
    n_rows, H, Hf,
    b_st, r_st, o_st,
    eps, gain_center,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr, PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr, STEPPED: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    """x = f32(branch) [* (f32(w) + c)]; out = alpha * residual + beta * (x * r)  (all FP32)."""
    pid = tl.program_id(0)
    if STEPPED:
        _gated_stepped(b_ptr, res_ptr, w_ptr, alpha_ptr, beta_ptr, out_ptr, pid.to(tl.int64), H,
                       Hf, b_st, r_st, o_st, eps, gain_center, BLOCK, NUM_CHUNKS, UNROLL, MASKED,
                       HAS_WEIGHT, PTX, USE_PDL)  # fmt: skip
    else:
        cols = tl.arange(0, BLOCK)
        pm = cols < H
        a = ld(alpha_ptr + cols, pm, MASKED, False)[None, :]
        be = ld(beta_ptr + cols, pm, MASKED, False)[None, :]
        w = 1.0
        if HAS_WEIGHT:
            w = ld(w_ptr + cols, pm, MASKED, False)[None, :] + gain_center
        if USE_PDL:
            gdc_wait()
        if not PERSISTENT:
            rows, mask = tile_rows(pid, cols, n_rows, H, ROWS)
            br, rr = add_load(b_ptr, res_ptr, rows, cols, mask, b_st, r_st, MASKED, EVICT_FIRST)
            if USE_PDL:
                gdc_launch_dependents()
            _gated_tile(br.to(tl.float32), rr.to(tl.float32), a, be, w, rows, cols, mask, out_ptr,
                        o_st, Hf, eps, MASKED, HAS_WEIGHT, PTX)  # fmt: skip
        else:
            nprog = tl.num_programs(0)
            n_tiles = tl.cdiv(n_rows, ROWS)
            t = pid
            b_nx = 0.0
            r_nx = 0.0
            if PREFETCH:
                rows0, mask0 = tile_rows(t, cols, n_rows, H, ROWS)
                b_nx, r_nx = add_load(b_ptr, res_ptr, rows0, cols, mask0, b_st, r_st, MASKED,
                                        EVICT_FIRST)  # fmt: skip
            while t < n_tiles:
                rows, mask, br, rr, b_nx, r_nx = _loop_tile(
                    t, nprog, b_nx, r_nx, b_ptr, res_ptr, cols, n_rows, H, b_st, r_st, ROWS,
                    BLOCK, MASKED, EVICT_FIRST, PREFETCH)  # fmt: skip
                if USE_PDL:
                    if t + nprog >= n_tiles:
                        gdc_launch_dependents()
                _gated_tile(br.to(tl.float32), rr.to(tl.float32), a, be, w, rows, cols, mask,
                            out_ptr, o_st, Hf, eps, MASKED, HAS_WEIGHT, PTX)  # fmt: skip
                t += nprog


@triton.jit(do_not_specialize=["n_rows"])
def _gated_residual_next_kernel(
    b_ptr, res_ptr, nw_ptr, alpha_ptr, beta_ptr, pw_ptr, rout_ptr, ffn_ptr, router_ptr,
    n_rows, H, Hf,
    strides, scalars,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    ALPHA_MODE: tl.constexpr, HAS_POST_WEIGHT: tl.constexpr, HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr, USE_PDL: tl.constexpr, PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr, STEPPED: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    """Gated stream update, then the next RMSNorm of the FP32 residual_out.

    ALPHA_MODE: 0 = scalar 1.0 (u = residual), 1 = other scalar, 2 = per-channel tensor.
    ``strides`` and ``scalars`` are tuples, unpacked by name on the first lines (the offline
    compile scripts read these names to type and specialise each element).
    """
    b_st, r_st, ro_st, f_st, rt_st = strides
    alpha_scalar, post_eps, next_eps, next_gain_center, post_gain_center = scalars
    pid = tl.program_id(0)
    if STEPPED:
        next_stepped(b_ptr, res_ptr, nw_ptr, alpha_ptr, beta_ptr, pw_ptr, rout_ptr, ffn_ptr,
                      router_ptr, pid.to(tl.int64), H, Hf, b_st, r_st, ro_st, f_st, rt_st,
                      alpha_scalar, post_eps, next_eps, next_gain_center, post_gain_center,
                      BLOCK, NUM_CHUNKS, UNROLL, MASKED, ALPHA_MODE, HAS_POST_WEIGHT,
                      HAS_ROUTER, PTX, USE_PDL)  # fmt: skip
    else:
        cols = tl.arange(0, BLOCK)
        pm = cols < H
        nw = ld(nw_ptr + cols, pm, MASKED, False)[None, :] + next_gain_center
        pw = 1.0
        if HAS_POST_WEIGHT:
            pw = ld(pw_ptr + cols, pm, MASKED, False)[None, :] + post_gain_center
        if USE_PDL:
            gdc_wait()
        if not PERSISTENT:
            rows, mask = tile_rows(pid, cols, n_rows, H, ROWS)
            br, rr = add_load(b_ptr, res_ptr, rows, cols, mask, b_st, r_st, MASKED, EVICT_FIRST)
            if USE_PDL:
                gdc_launch_dependents()
            gated_next_tile(br.to(tl.float32), rr.to(tl.float32), nw, pw, rows, cols, pm, mask,
                             alpha_ptr, beta_ptr, rout_ptr, ffn_ptr, router_ptr, ro_st, f_st,
                             rt_st, alpha_scalar, Hf, post_eps, next_eps, ALPHA_MODE, MASKED,
                             HAS_POST_WEIGHT, HAS_ROUTER, PTX)  # fmt: skip
        else:
            nprog = tl.num_programs(0)
            n_tiles = tl.cdiv(n_rows, ROWS)
            t = pid
            b_nx = 0.0
            r_nx = 0.0
            if PREFETCH:
                rows0, mask0 = tile_rows(t, cols, n_rows, H, ROWS)
                b_nx, r_nx = add_load(b_ptr, res_ptr, rows0, cols, mask0, b_st, r_st, MASKED,
                                        EVICT_FIRST)  # fmt: skip
            while t < n_tiles:
                rows, mask, br, rr, b_nx, r_nx = _loop_tile(
                    t, nprog, b_nx, r_nx, b_ptr, res_ptr, cols, n_rows, H, b_st, r_st, ROWS,
                    BLOCK, MASKED, EVICT_FIRST, PREFETCH)  # fmt: skip
                if USE_PDL:
                    if t + nprog >= n_tiles:
                        gdc_launch_dependents()
                gated_next_tile(br.to(tl.float32), rr.to(tl.float32), nw, pw, rows, cols, pm,
                                 mask, alpha_ptr, beta_ptr, rout_ptr, ffn_ptr, router_ptr, ro_st,
                                 f_st, rt_st, alpha_scalar, Hf, post_eps, next_eps, ALPHA_MODE,
                                 MASKED, HAS_POST_WEIGHT, HAS_ROUTER, PTX)  # fmt: skip
                t += nprog


# ----------------------------------------------------------------------------- launchers
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
    _launch(_gated_residual_kernel, nt._grid(tile, tile.grid(n_rows)[0], branch.device), args,
            {**consts, "HAS_WEIGHT": weight is not None}, tile)  # fmt: skip


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
    launch_gated_residual_rmsnorm."""
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
    consts.update(ALPHA_MODE=alpha_mode, HAS_POST_WEIGHT=post_weight is not None,
                  HAS_ROUTER=router_input is not None)  # fmt: skip
    _launch(_gated_residual_next_kernel, nt._grid(tile, tile.grid(n_rows)[0], branch.device),
            args, consts, tile)  # fmt: skip
