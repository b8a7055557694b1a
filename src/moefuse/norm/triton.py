"""Triton kernels of the RMSNorm family (SPEC §1) and their launchers.

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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import rcp_fast, round_to, rsqrt_fast
from moefuse._runtime import interpreter_active
from moefuse.norm.tiles import GATED_POLICY, row_tile

LOG2E = 1.4426950408889634
#: evict-first cache hint on activation loads; measured slower on H200 by 1-4 % (notes/norm.md),
#: so off, kept as a switch for other GPUs
STREAM_EVICT_FIRST = False


# ----------------------------------------------------------------------------- device helpers
@triton.jit
def _row_base(rows, HEADS, stride_t, stride_h):
    rows = rows.to(tl.int64)
    return (rows // HEADS) * stride_t + (rows % HEADS) * stride_h


@triton.jit
def _ld(ptrs, mask, MASKED: tl.constexpr, STREAM: tl.constexpr):
    """Load as FP32; STREAM marks data read exactly once (evict-first cache hint)."""
    if STREAM:
        if MASKED:
            return tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(
                tl.float32
            )
        else:
            return tl.load(ptrs, eviction_policy="evict_first").to(tl.float32)
    else:
        if MASKED:
            return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        else:
            return tl.load(ptrs).to(tl.float32)


@triton.jit
def _st(ptrs, value, mask, MASKED: tl.constexpr, PTX: tl.constexpr):
    value = round_to(value, ptrs.dtype.element_ty, PTX)
    if MASKED:
        tl.store(ptrs, value, mask=mask)
    else:
        tl.store(ptrs, value)


@triton.jit
def _inv_rms(sumsq, Hf, eps):
    """``rsqrt(sumsq / H + eps)`` with an IEEE division (SPEC mean_sq) and rsqrt.approx.

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


# ----------------------------------------------------------------------------- kernels
@triton.jit(do_not_specialize=["n_rows"])
def _rmsnorm_kernel(
    x_ptr, w_ptr, gate_ptr, out_ptr,
    n_rows, H, Hf, HEADS,
    x_st, x_sh, g_st, g_sh, o_st, o_sh,
    eps, gain_center,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    HAS_GATE: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """out = cast((x * r) * m), m = f32(w) + gain_center, or sigmoid(gate) when HAS_GATE."""
    pid = tl.program_id(0)
    rows, cols, mask = _tile(pid, 0, n_rows, H, ROWS, BLOCK)
    x_row = _row_base(rows, HEADS, x_st, x_sh)[:, None]
    o_row = _row_base(rows, HEADS, o_st, o_sh)[:, None]
    g_row = _row_base(rows, HEADS, g_st, g_sh)[:, None]
    if NUM_CHUNKS == 1:
        if not HAS_GATE:
            w = _ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        if USE_PDL:
            gdc_wait()
        x = _ld(x_ptr + x_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        if HAS_GATE:
            g = _ld(gate_ptr + g_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            w = rcp_fast(tl.math.exp2(-g * 1.4426950408889634) + 1.0, PTX)
        if USE_PDL:
            gdc_launch_dependents()
        r = _inv_rms(tl.sum(x * x, axis=1), Hf, eps)[:, None]
        _st(out_ptr + o_row + cols[None, :], (x * r) * w, mask, MASKED, PTX)
    else:
        if USE_PDL:
            gdc_wait()
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            x = _ld(x_ptr + x_row + cols[None, :], mask, MASKED, False)
            acc += x * x
        r = _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None]
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            x = _ld(x_ptr + x_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            if HAS_GATE:
                g = _ld(gate_ptr + g_row + cols[None, :], mask, MASKED, EVICT_FIRST)
                w = rcp_fast(tl.math.exp2(-g * 1.4426950408889634) + 1.0, PTX)
            else:
                w = _ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
            _st(out_ptr + o_row + cols[None, :], (x * r) * w, mask, MASKED, PTX)
        if USE_PDL:
            gdc_launch_dependents()


@triton.jit(do_not_specialize=["n_rows"])
def _fused_add_rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr,
    n_rows, H, Hf,
    x_st, r_st,
    eps, gain_center,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """h = f32(x) + f32(res); res <- cast(h); x <- cast((h * r) * g), r from the FP32 h."""
    pid = tl.program_id(0)
    rows, cols, mask = _tile(pid, 0, n_rows, H, ROWS, BLOCK)
    x_row = rows.to(tl.int64)[:, None] * x_st
    r_row = rows.to(tl.int64)[:, None] * r_st
    if NUM_CHUNKS == 1:
        w = _ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        if USE_PDL:
            gdc_wait()
        h = _ld(x_ptr + x_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        h += _ld(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        if USE_PDL:
            gdc_launch_dependents()
        _st(res_ptr + r_row + cols[None, :], h, mask, MASKED, PTX)
        r = _inv_rms(tl.sum(h * h, axis=1), Hf, eps)[:, None]
        _st(x_ptr + x_row + cols[None, :], (h * r) * w, mask, MASKED, PTX)
    else:
        if USE_PDL:
            gdc_wait()
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            h = _ld(x_ptr + x_row + cols[None, :], mask, MASKED, False)
            h += _ld(res_ptr + r_row + cols[None, :], mask, MASKED, False)
            acc += h * h
        r = _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None]
        # second pass recomputes the same FP32 h (both inputs are still unmodified for this chunk)
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            h = _ld(x_ptr + x_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            h += _ld(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            w = _ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
            _st(res_ptr + r_row + cols[None, :], h, mask, MASKED, PTX)
            _st(x_ptr + x_row + cols[None, :], (h * r) * w, mask, MASKED, PTX)
        if USE_PDL:
            gdc_launch_dependents()


@triton.jit(do_not_specialize=["n_rows"])
def _gated_residual_kernel(
    b_ptr, res_ptr, w_ptr, alpha_ptr, beta_ptr, out_ptr,
    n_rows, H, Hf,
    b_st, r_st, o_st,
    eps, gain_center,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """x = f32(branch) [* (f32(w) + c)]; out = alpha * residual + beta * (x * r)  (all FP32)."""
    pid = tl.program_id(0)
    rows, cols, mask = _tile(pid, 0, n_rows, H, ROWS, BLOCK)
    b_row = rows.to(tl.int64)[:, None] * b_st
    r_row = rows.to(tl.int64)[:, None] * r_st
    o_row = rows.to(tl.int64)[:, None] * o_st
    if NUM_CHUNKS == 1:
        cmask = cols < H
        a = _ld(alpha_ptr + cols, cmask, MASKED, False)[None, :]
        be = _ld(beta_ptr + cols, cmask, MASKED, False)[None, :]
        if HAS_WEIGHT:
            w = _ld(w_ptr + cols, cmask, MASKED, False)[None, :] + gain_center
        if USE_PDL:
            gdc_wait()
        x = _ld(b_ptr + b_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        res = _ld(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        if USE_PDL:
            gdc_launch_dependents()
        if HAS_WEIGHT:
            x = x * w
        r = _inv_rms(tl.sum(x * x, axis=1), Hf, eps)[:, None]
        _st(out_ptr + o_row + cols[None, :], tl.fma(a, res, be * (x * r)), mask, MASKED, PTX)
    else:
        if USE_PDL:
            gdc_wait()
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            x = _ld(b_ptr + b_row + cols[None, :], mask, MASKED, False)
            if HAS_WEIGHT:
                x = x * (_ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center)
            acc += x * x
        r = _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None]
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            cmask = cols < H
            x = _ld(b_ptr + b_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            if HAS_WEIGHT:
                x = x * (_ld(w_ptr + cols, cmask, MASKED, False)[None, :] + gain_center)
            res = _ld(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            a = _ld(alpha_ptr + cols, cmask, MASKED, False)[None, :]
            be = _ld(beta_ptr + cols, cmask, MASKED, False)[None, :]
            _st(out_ptr + o_row + cols[None, :], tl.fma(a, res, be * (x * r)), mask, MASKED, PTX)
        if USE_PDL:
            gdc_launch_dependents()


@triton.jit
def _stream_update(res, b, a_ptr, be_ptr, cols, cmask, alpha_scalar, r1,
                   ALPHA_MODE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """residual_out = u + (beta * b) * r1; u = residual, scalar * residual or alpha * residual."""
    if ALPHA_MODE == 1:
        res = alpha_scalar * res
    elif ALPHA_MODE == 2:
        res = _ld(a_ptr + cols, cmask, MASKED, False)[None, :] * res
    be = _ld(be_ptr + cols, cmask, MASKED, False)[None, :]
    # explicit FMA: left to the compiler, contraction can differ between copies of the expression
    # that Triton rematerialises for different layouts, giving two values of one element
    return tl.fma(be * b, r1, res)


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
        y = _ld(router_ptrs, mask, MASKED, False)
    _st(ffn_ptrs, y, mask, MASKED, PTX)


@triton.jit(do_not_specialize=["n_rows"])
def _gated_residual_next_kernel(
    b_ptr, res_ptr, nw_ptr, alpha_ptr, beta_ptr, pw_ptr, rout_ptr, ffn_ptr, router_ptr,
    n_rows, H, Hf,
    b_st, r_st, ro_st, f_st, rt_st,
    alpha_scalar, post_eps, next_eps, next_gain_center, post_gain_center,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    ALPHA_MODE: tl.constexpr, HAS_POST_WEIGHT: tl.constexpr, HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """SPEC §1.4: gated stream update, then the next RMSNorm of the stored FP32 residual_out.

    ALPHA_MODE: 0 = scalar 1.0 (u = residual), 1 = other scalar, 2 = per-channel tensor.
    """
    pid = tl.program_id(0)
    rows, cols, mask = _tile(pid, 0, n_rows, H, ROWS, BLOCK)
    b_row = rows.to(tl.int64)[:, None] * b_st
    r_row = rows.to(tl.int64)[:, None] * r_st
    ro_row = rows.to(tl.int64)[:, None] * ro_st
    f_row = rows.to(tl.int64)[:, None] * f_st
    rt_row = rows.to(tl.int64)[:, None] * rt_st
    if NUM_CHUNKS == 1:
        cmask = cols < H
        nw = _ld(nw_ptr + cols, cmask, MASKED, False)[None, :] + next_gain_center
        if HAS_POST_WEIGHT:
            pw = _ld(pw_ptr + cols, cmask, MASKED, False)[None, :] + post_gain_center
        if USE_PDL:
            gdc_wait()
        b = _ld(b_ptr + b_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        res = _ld(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        if USE_PDL:
            gdc_launch_dependents()
        if HAS_POST_WEIGHT:
            b = b * pw
        r1 = _inv_rms(tl.sum(b * b, axis=1), Hf, post_eps)[:, None]
        ro = _stream_update(res, b, alpha_ptr, beta_ptr, cols, cmask, alpha_scalar, r1,
                            ALPHA_MODE, MASKED)  # fmt: skip
        _st(rout_ptr + ro_row + cols[None, :], ro, mask, MASKED, PTX)
        # padded columns hold ro = 0 (b = res = 0 there), so they add nothing to the sum
        r2 = _inv_rms(tl.sum(ro * ro, axis=1), Hf, next_eps)[:, None]
        _store_ffn(ffn_ptr + f_row + cols[None, :], router_ptr + rt_row + cols[None, :],
                   (ro * r2) * nw, mask, MASKED, HAS_ROUTER, PTX)  # fmt: skip
    else:
        if USE_PDL:
            gdc_wait()
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            b = _ld(b_ptr + b_row + cols[None, :], mask, MASKED, False)
            if HAS_POST_WEIGHT:
                b = b * (_ld(pw_ptr + cols, cols < H, MASKED, False)[None, :] + post_gain_center)
            acc += b * b
        r1 = _inv_rms(tl.sum(acc, axis=1), Hf, post_eps)[:, None]
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            cmask = cols < H
            b = _ld(b_ptr + b_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            if HAS_POST_WEIGHT:
                b = b * (_ld(pw_ptr + cols, cmask, MASKED, False)[None, :] + post_gain_center)
            res = _ld(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            ro = _stream_update(res, b, alpha_ptr, beta_ptr, cols, cmask, alpha_scalar, r1,
                                ALPHA_MODE, MASKED)  # fmt: skip
            _st(rout_ptr + ro_row + cols[None, :], ro, mask, MASKED, PTX)
            acc += ro * ro
        if USE_PDL:
            gdc_launch_dependents()
        r2 = _inv_rms(tl.sum(acc, axis=1), Hf, next_eps)[:, None]
        # make this program's residual_out stores visible to all of its threads before re-reading
        tl.debug_barrier()
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            nw = _ld(nw_ptr + cols, cols < H, MASKED, False)[None, :] + next_gain_center
            ro = _ld(rout_ptr + ro_row + cols[None, :], mask, MASKED, False)
            _store_ffn(ffn_ptr + f_row + cols[None, :], router_ptr + rt_row + cols[None, :],
                       (ro * r2) * nw, mask, MASKED, HAS_ROUTER, PTX)  # fmt: skip


# ----------------------------------------------------------------------------- launchers
def _row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(rows, stride_t, stride_h) of a [M, H] or [M, heads, H] tensor; HEADS = 1 for 2-D."""
    if t.dim() == 2:
        return t.shape[0], t.stride(0), 0
    return t.shape[0] * t.shape[1], t.stride(0), t.stride(1)


def _pdl_kwargs(use_pdl: bool) -> dict:
    # the interpreter ignores unknown launch options, but only pass it when it is on
    return {"launch_pdl": True} if use_pdl else {}


def launch_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor | None,
    out: torch.Tensor,
    eps: float,
    gain_center: float,
    use_pdl: bool,
    gate: torch.Tensor | None = None,
) -> None:
    """rmsnorm / gemma_rmsnorm (``weight``) or rmsnorm_sigmoid_gate (``gate``) over [.., H]."""
    width = input.shape[-1]
    n_rows, x_st, x_sh = _row_strides(input)
    if n_rows == 0:
        return
    heads = input.shape[1] if input.dim() == 3 else 1
    _, o_st, o_sh = _row_strides(out)
    g_st, g_sh = (_row_strides(gate)[1:] if gate is not None else (0, 0))
    tile = row_tile(width)
    masked = tile.rows > 1 or not tile.even(width)
    _rmsnorm_kernel[tile.grid(n_rows)](
        input, weight if weight is not None else input, gate if gate is not None else input, out,
        n_rows, width, float(width), heads,
        x_st, x_sh, g_st, g_sh, o_st, o_sh,
        eps, gain_center,
        BLOCK=tile.block, NUM_CHUNKS=tile.num_chunks, ROWS=tile.rows, MASKED=masked,
        EVICT_FIRST=STREAM_EVICT_FIRST,
        HAS_GATE=gate is not None, PTX=not interpreter_active(), USE_PDL=use_pdl,
        num_warps=tile.num_warps, **_pdl_kwargs(use_pdl),
    )  # fmt: skip


def launch_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gain_center: float,
    use_pdl: bool,
) -> None:
    """In place on ``input`` and ``residual`` ([M, H] each, row strides free)."""
    n_rows, width = input.shape
    if n_rows == 0:
        return
    tile = row_tile(width)
    masked = tile.rows > 1 or not tile.even(width)
    _fused_add_rmsnorm_kernel[tile.grid(n_rows)](
        input, residual, weight,
        n_rows, width, float(width),
        input.stride(0), residual.stride(0),
        eps, gain_center,
        BLOCK=tile.block, NUM_CHUNKS=tile.num_chunks, ROWS=tile.rows, MASKED=masked,
        EVICT_FIRST=STREAM_EVICT_FIRST,
        PTX=not interpreter_active(), USE_PDL=use_pdl,
        num_warps=tile.num_warps, **_pdl_kwargs(use_pdl),
    )  # fmt: skip


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
) -> None:
    n_rows, width = branch.shape
    if n_rows == 0:
        return
    tile = row_tile(width, GATED_POLICY)
    masked = tile.rows > 1 or not tile.even(width)
    _gated_residual_kernel[tile.grid(n_rows)](
        branch, residual, weight if weight is not None else alpha, alpha, beta, out,
        n_rows, width, float(width),
        branch.stride(0), residual.stride(0), out.stride(0),
        eps, gain_center,
        BLOCK=tile.block, NUM_CHUNKS=tile.num_chunks, ROWS=tile.rows, MASKED=masked,
        EVICT_FIRST=STREAM_EVICT_FIRST,
        HAS_WEIGHT=weight is not None, PTX=not interpreter_active(), USE_PDL=use_pdl,
        num_warps=tile.num_warps, **_pdl_kwargs(use_pdl),
    )  # fmt: skip


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
) -> None:
    n_rows, width = branch.shape
    if n_rows == 0:
        return
    tile = row_tile(width, GATED_POLICY)
    masked = tile.rows > 1 or not tile.even(width)
    alpha_mode = 2 if alpha is not None else (0 if alpha_scalar == 1.0 else 1)
    router = router_input if router_input is not None else residual_out
    _gated_residual_next_kernel[tile.grid(n_rows)](
        branch, residual, next_weight, alpha if alpha is not None else beta, beta,
        post_weight if post_weight is not None else next_weight,
        residual_out, ffn_input, router,
        n_rows, width, float(width),
        branch.stride(0), residual.stride(0), residual_out.stride(0), ffn_input.stride(0),
        router.stride(0),
        alpha_scalar, post_eps, next_eps, next_gain_center, post_gain_center,
        BLOCK=tile.block, NUM_CHUNKS=tile.num_chunks, ROWS=tile.rows, MASKED=masked,
        EVICT_FIRST=STREAM_EVICT_FIRST,
        ALPHA_MODE=alpha_mode, HAS_POST_WEIGHT=post_weight is not None,
        HAS_ROUTER=router_input is not None, PTX=not interpreter_active(), USE_PDL=use_pdl,
        num_warps=tile.num_warps, **_pdl_kwargs(use_pdl),
    )  # fmt: skip
