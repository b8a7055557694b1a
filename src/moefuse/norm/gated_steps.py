"""Element math and step loads shared by the gated residual RMSNorm rows
(:mod:`moefuse.norm.gated`, :mod:`moefuse.norm.gated_residual`): the gated output and stream
update with their one explicit FMA, the ffn / router stores, and the branch and activation steps
of the stepped layout.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moefuse.norm.triton import _param, _st, ld, ldp, step_cols


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
def _store_ffn(
    ffn_ptrs,
    router_ptrs,
    y,
    mask,
    MASKED: tl.constexpr,
    HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr,
):
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


# ----------------------------------------------------------------------------- steps
@triton.jit
def _branch_step(
    b_ptr,
    b_row,
    w_ptr,
    cols,
    cm,
    gc,
    MASKED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    POLICY: tl.constexpr,
):
    """x = f32(branch) [* (w + c)] of one step (looped mode)."""
    x = ldp(b_ptr + b_row + cols, cm, MASKED, POLICY)
    if HAS_WEIGHT:
        x = x * _param(w_ptr, cols, cm, gc, MASKED, True)
    return x


@triton.jit
def _branch_sumsq_loop(
    b_ptr,
    b_row,
    w_ptr,
    H,
    gc,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
):
    """[1, 1] statistic of x over the row, looped; loads keep the row in L2 for the next pass."""
    acc = tl.zeros([1, STEP], dtype=tl.float32)
    for k in tl.range(0, STEPS):
        cols, cm = step_cols(k, H, STEP)
        x = _branch_step(b_ptr, b_row, w_ptr, cols, cm, gc, MASKED, HAS_WEIGHT, "evict_last")
        acc = tl.fma(x, x, acc)
    return tl.sum(acc, axis=1)[:, None]


@triton.jit
def _load_steps(
    a_ptr, b_ptr, a_row, b_row, H, STEP: tl.constexpr, STEPS: tl.constexpr, MASKED: tl.constexpr
):
    """Every step of two activation rows as FP32 tuples, all loads issued together."""
    xs = ()
    ys = ()
    for k in tl.static_range(STEPS):
        cols, cm = step_cols(k, H, STEP)
        xs = xs + (ldp(a_ptr + a_row + cols, cm, MASKED, "evict_first"),)
        ys = ys + (ldp(b_ptr + b_row + cols, cm, MASKED, "evict_first"),)
    return xs, ys
