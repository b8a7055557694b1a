"""Triton kernels of the MoE finalize family (spec: MoE) and their launchers.

Kernels (one program per (row, column tile); the tile is a function of H alone):
* ``_moe_finalize_kernel`` — the deterministic gather-reduce: for token t, slots k ascending,
  ``acc = fma_ftz(f32(row), f32(w), acc)`` in FP32, then the optional extensions and one rounding.
  Each output element has its own sequential chain of K FMAs, so neither the tile, the grid nor the
  token count can change a bit of the result.
* ``_moe_scatter_add_kernel`` — the scatter-add (GEMM-epilogue style) baseline: each permuted row
  adds ``f32(row) * w`` into an FP32 buffer with atomics (order = arrival order, not reproducible).
* ``_moe_permute_kernel`` — the gather of activations into expert-sorted order (a pure copy).

Numerics in the interpreter: Triton's interpreter converts FP32 -> BF16 by truncation and
mis-widens BF16 subnormals, so off the PTX path both conversions are done on the bits here (RNE);
on the GPU the hardware ``cvt`` instructions give the same bits. FMA contraction is switched off
for the finalize (``enable_fp_fusion=False``) because the spec orders "multiply by the routed
scaling factor, round, add the shared expert" — the one FMA that is wanted is explicit.

PDL: the finalize reads the routing data (index map, scales, expert ids) before ``gdc_wait`` — as
FlashInfer's deterministic finalize does, routing is complete long before GEMM2 signals — and the
expert rows, bias and shared-expert rows after it. The scatter-add and permute kernels wait before
every load. ``gdc_launch_dependents`` follows the last load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import fma_ftz, round_to, widen_f32
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs
from moefuse.moe.tiles import MAX_UNROLL_K, finalize_tile, vec_width


# launch metadata: only evaluated while a profiler hook is installed (e.g. proton), so that the
# profile shows the bytes each launch must move
def _finalize_metadata(grid, kernel, args):
    m, k = grid[0] // args["n_tiles"], args["top_k"]
    h = args["H_V"] * args["VEC"]
    elem = args["in_ptr"].element_size()
    return {
        "name": f"moe_finalize M={m} K={k} H={h}",
        "bytes": (m * k + m) * h * elem + m * k * (4 + args["scale_ptr"].element_size()),
    }


def _rows_metadata(grid, kernel, args):
    rows = grid[0] // args["n_tiles"]
    h = args["H"] if "H" in args else args["H_V"] * args["VEC"]
    ptr = args["in_ptr"] if "in_ptr" in args else args["x_ptr"]
    return {"name": f"{kernel.name} R={rows} H={h}", "bytes": 2 * rows * h * ptr.element_size()}


# ----------------------------------------------------------------------------- device helpers
# The finalize kernel's arguments, grouped for its device functions: ``routing`` = (map, scale,
# eid) pointers and ``routing_st`` their row strides; ``rows_in`` = (in, bias, in_st, bias_st) and
# ``out_rows`` = (shared, out, shared_st_v, out_st_v): pointers and row strides (in elements;
# ``out_rows``'s divided by VEC).
@triton.jit
def _slot_meta(
    k,
    t,
    routing,
    routing_st,
    n_rows,
    n_experts,
    top_k,
    EXPANDED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PTX: tl.constexpr,
):
    """Routing data of slot k of token t: ``(valid, row, weight, bias_valid, expert)``."""
    map_ptr, scale_ptr, eid_ptr = routing
    map_st, scale_st, eid_st = routing_st
    idx = tl.load(map_ptr + t * map_st + k)
    if EXPANDED:
        valid = idx >= 0
        row = t * top_k + k
    else:
        valid = (idx >= 0) & (idx < n_rows)
        row = idx.to(tl.int64)
    w = widen_f32(tl.load(scale_ptr + t * scale_st + k), PTX)
    if HAS_BIAS:
        e = tl.load(eid_ptr + t * eid_st + k)
        has_b = valid & (e >= 0) & (e < n_experts)
        e = e.to(tl.int64)
    else:
        has_b = valid
        e = row
    return valid, row, w, has_b, e


@triton.jit
def _slot_metas(
    t,
    routing,
    routing_st,
    n_rows,
    n_experts,
    UNROLL: tl.constexpr,
    EXPANDED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PTX: tl.constexpr,
):
    """:func:`_slot_meta` of slots 0 .. UNROLL-1 of token t (``top_k`` = UNROLL), as five
    tuples ``(valids, rows, weights, bias_valids, experts)``."""
    valids = ()
    rows = ()
    ws = ()
    has_bs = ()
    es = ()
    for k in tl.static_range(UNROLL):
        valid, row, w, has_b, e = _slot_meta(
            k, t, routing, routing_st, n_rows, n_experts, UNROLL, EXPANDED, HAS_BIAS, PTX
        )
        valids = valids + (valid,)
        rows = rows + (row,)
        ws = ws + (w,)
        has_bs = has_bs + (has_b,)
        es = es + (e,)
    return valids, rows, ws, has_bs, es


@triton.jit
def _slot_row(
    valid,
    row,
    has_b,
    e,
    cols,
    cmask,
    rows_in,
    EVEN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PTX: tl.constexpr,
):
    """``f32(row) [+ f32(bias[e])]`` of one slot; ``cmask`` is ignored when EVEN."""
    in_ptr, bias_ptr, in_st, bias_st = rows_in
    # the validity predicate masks the load itself: rows behind invalid indices are never read
    if EVEN:
        x_mask = valid
        b_mask = has_b
    else:
        x_mask = cmask & valid
        b_mask = cmask & has_b
    x_ptrs = in_ptr + row * in_st + cols
    x = widen_f32(tl.load(x_ptrs, mask=x_mask, other=0.0, eviction_policy="evict_first"), PTX)
    if HAS_BIAS:
        b = widen_f32(tl.load(bias_ptr + e * bias_st + cols, mask=b_mask, other=0.0), PTX)
        x = tl.where(has_b, x + b, x)
    return x


@triton.jit
def _finalize_store(
    acc,
    t,
    cols,
    cmask,
    out_rows,
    rsf,
    VEC: tl.constexpr,
    EVEN: tl.constexpr,
    HAS_RSF: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The finalize's tail: ``out[t, cols] = cast((acc [* rsf]) [+ f32(shared[t, cols])])``
    (the shared row read before ``gdc_launch_dependents``)."""
    shared_ptr, out_ptr, shared_st_v, out_st_v = out_rows
    if HAS_SHARED:
        sh_ptrs = shared_ptr + t * (shared_st_v * VEC) + cols
        if EVEN:
            sh = widen_f32(tl.load(sh_ptrs), PTX)
        else:
            sh = widen_f32(tl.load(sh_ptrs, mask=cmask, other=0.0), PTX)
    if USE_PDL:
        gdc_launch_dependents()
    if HAS_RSF:
        acc = acc * rsf
    if HAS_SHARED:
        acc = acc + sh
    out_ptrs = out_ptr + t * (out_st_v * VEC) + cols
    if EVEN:
        tl.store(out_ptrs, round_to(acc, out_ptr.dtype.element_ty, PTX))
    else:
        tl.store(out_ptrs, round_to(acc, out_ptr.dtype.element_ty, PTX), mask=cmask)


# ----------------------------------------------------------------------------- kernels
@triton.jit(launch_metadata=_finalize_metadata)
def _moe_finalize_kernel(
    in_ptr,
    map_ptr,
    scale_ptr,
    bias_ptr,
    eid_ptr,
    shared_ptr,
    out_ptr,
    n_rows,
    n_experts,
    top_k,
    n_tiles,
    H_V,
    in_st_v,
    map_st,
    scale_st,
    bias_st_v,
    eid_st,
    shared_st_v,
    out_st_v,
    rsf,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    UNROLL: tl.constexpr,
    EVEN: tl.constexpr,
    EXPANDED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RSF: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[t, tile] = cast(((Σ_k fma_ftz) * rsf) + shared) (spec); see module docstring.

    Widths and row strides arrive divided by VEC (8 when 16-byte aligned) and are multiplied back
    by the constexpr here, so the compiler can prove 16-byte alignment and vectorise; the token
    count is not an argument at all (grid only), so a new M never recompiles.

    K <= MAX_UNROLL_K runs in three unrolled phases — routing data of all slots, then all K row
    loads (so they are in flight together), then the FMA chain in ascending k — with the routing
    data read before the PDL wait (see :func:`moefuse.moe.api.moe_finalize`). Larger K loops.
    """
    pid = tl.program_id(0)
    t = (pid // n_tiles).to(tl.int64)
    cols = (pid % n_tiles) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H_V * VEC  # unused when EVEN: no column predicate at all
    routing = (map_ptr, scale_ptr, eid_ptr)
    routing_st = (map_st, scale_st, eid_st)
    rows_in = (in_ptr, bias_ptr, in_st_v * VEC, bias_st_v * VEC)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    if UNROLL > 0:
        valids, rows, ws, has_bs, es = _slot_metas(
            t, routing, routing_st, n_rows, n_experts, UNROLL, EXPANDED, HAS_BIAS, PTX
        )
        if USE_PDL:
            gdc_wait()  # permuted_input (and bias / shared) may still be in flight before this
        xs = ()
        for k in tl.static_range(UNROLL):
            x = _slot_row(
                valids[k], rows[k], has_bs[k], es[k], cols, cmask, rows_in, EVEN, HAS_BIAS, PTX
            )
            xs = xs + (x,)
        for k in tl.static_range(UNROLL):
            acc = tl.where(valids[k], fma_ftz(xs[k], ws[k], acc, PTX), acc)
    else:
        if USE_PDL:
            gdc_wait()
        # a while loop, not range(top_k): Triton 3.6's interpreter cannot index a range with a
        # scalar argument under numpy 2 (the compiled loop is the same either way)
        k = 0
        while k < top_k:
            valid, row, w, has_b, e = _slot_meta(
                k, t, routing, routing_st, n_rows, n_experts, top_k, EXPANDED, HAS_BIAS, PTX
            )
            x = _slot_row(valid, row, has_b, e, cols, cmask, rows_in, EVEN, HAS_BIAS, PTX)
            acc = tl.where(valid, fma_ftz(x, w, acc, PTX), acc)
            k += 1
    out_rows = (shared_ptr, out_ptr, shared_st_v, out_st_v)
    _finalize_store(
        acc, t, cols, cmask, out_rows, rsf, VEC, EVEN, HAS_RSF, HAS_SHARED, PTX, USE_PDL
    )


@triton.jit(launch_metadata=_rows_metadata)
def _moe_scatter_add_kernel(
    in_ptr,
    inv_ptr,
    scale_ptr,
    buf_ptr,
    n_expanded,
    top_k,
    n_tiles,
    H,
    in_st,
    scale_st,
    BLOCK: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """buf[t] += f32(row p) * f32(w[t, k]) with FP32 atomics, (t, k) from inv[p] = t*K + k."""
    pid = tl.program_id(0)
    p = (pid // n_tiles).to(tl.int64)
    cols = (pid % n_tiles) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H
    if USE_PDL:
        gdc_wait()
    e = tl.load(inv_ptr + p)
    valid = (e >= 0) & (e < n_expanded)
    e = tl.where(valid, e, 0).to(tl.int64)
    t = e // top_k
    w = widen_f32(tl.load(scale_ptr + t * scale_st + (e - t * top_k), mask=valid, other=0.0), PTX)
    x = widen_f32(tl.load(in_ptr + p * in_st + cols, mask=cmask & valid, other=0.0), PTX)
    if USE_PDL:
        gdc_launch_dependents()
    tl.atomic_add(buf_ptr + t * H + cols, x * w, mask=cmask & valid, sem="relaxed")


@triton.jit(launch_metadata=_rows_metadata)
def _moe_permute_kernel(
    x_ptr,
    inv_ptr,
    out_ptr,
    n_expanded,
    top_k,
    n_tiles,
    H_V,
    x_st_v,
    out_st_v,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """out[p] = x[inv[p] // K] (bit copy); rows with inv[p] outside [0, M*K) are zero-filled."""
    pid = tl.program_id(0)
    p = (pid // n_tiles).to(tl.int64)
    cols = (pid % n_tiles) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < H_V * VEC
    if USE_PDL:
        gdc_wait()
    e = tl.load(inv_ptr + p)
    valid = (e >= 0) & (e < n_expanded)
    t = tl.where(valid, e, 0).to(tl.int64) // top_k
    v = tl.load(x_ptr + t * (x_st_v * VEC) + cols, mask=cmask & valid, other=0.0)
    if USE_PDL:
        gdc_launch_dependents()
    tl.store(out_ptr + p * (out_st_v * VEC) + cols, v, mask=cmask)


# ----------------------------------------------------------------------------- launchers
def launch_moe_finalize(
    permuted_input: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    topk_scales: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    expert_ids: torch.Tensor | None,
    routed_scaling_factor: float,
    shared_expert_output: torch.Tensor | None,
    input_is_expanded: bool,
    use_pdl: bool,
    *,
    block: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Writes ``out`` [M, H]. ``block`` / ``num_warps`` override the tile (benchmark tuning only:
    the result bits do not depend on them)."""
    m, top_k = expanded_idx_to_permuted_idx.shape
    n_rows, hidden = permuted_input.shape
    if m == 0 or hidden == 0:
        return
    tile_block, tile_warps = finalize_tile(hidden)
    block = block or tile_block
    num_warps = num_warps or tile_warps
    n_tiles = triton.cdiv(hidden, block)
    row_strides = [permuted_input.stride(0), out.stride(0)]
    if bias is not None:
        row_strides.append(bias.stride(0))
    if shared_expert_output is not None:
        row_strides.append(shared_expert_output.stride(0))
    vec = vec_width(hidden, *row_strides)
    args = (
        permuted_input, expanded_idx_to_permuted_idx, topk_scales,
        bias if bias is not None else permuted_input,
        expert_ids if expert_ids is not None else expanded_idx_to_permuted_idx,
        shared_expert_output if shared_expert_output is not None else permuted_input,
        out,
        n_rows, bias.shape[0] if bias is not None else 0, top_k, n_tiles, hidden // vec,
        permuted_input.stride(0) // vec, expanded_idx_to_permuted_idx.stride(0),
        topk_scales.stride(0), (bias.stride(0) if bias is not None else 0) // vec,
        expert_ids.stride(0) if expert_ids is not None else 0,
        (shared_expert_output.stride(0) if shared_expert_output is not None else 0) // vec,
        out.stride(0) // vec,
        float(routed_scaling_factor),
    )  # fmt: skip
    launch(
        _moe_finalize_kernel,
        (m * n_tiles,),
        *args,
        VEC=vec,
        BLOCK=block,
        UNROLL=top_k if top_k <= MAX_UNROLL_K else 0,
        EVEN=hidden % block == 0,
        EXPANDED=bool(input_is_expanded),
        HAS_BIAS=bias is not None,
        HAS_RSF=float(routed_scaling_factor) != 1.0,
        HAS_SHARED=shared_expert_output is not None,
        PTX=not interpreter_active(),
        USE_PDL=use_pdl,
        num_warps=num_warps,
        enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
    )


def launch_moe_finalize_scatter_add(
    permuted_input: torch.Tensor,
    permuted_idx_to_expanded_idx: torch.Tensor,
    topk_scales: torch.Tensor,
    out: torch.Tensor,
    routed_scaling_factor: float,
    use_pdl: bool,
) -> None:
    """Zero an FP32 [M, H] buffer, atomically add every permuted row into it, cast into ``out``."""
    m, top_k = topk_scales.shape
    n_rows, hidden = permuted_input.shape
    if m == 0 or hidden == 0:
        return
    buf = torch.zeros(m, hidden, dtype=torch.float32, device=out.device)
    if n_rows > 0:
        block, num_warps = finalize_tile(hidden)
        n_tiles = triton.cdiv(hidden, block)
        args = (
            permuted_input, permuted_idx_to_expanded_idx, topk_scales, buf,
            m * top_k, top_k, n_tiles, hidden, permuted_input.stride(0), topk_scales.stride(0),
        )  # fmt: skip
        launch(
            _moe_scatter_add_kernel,
            (n_rows * n_tiles,),
            *args,
            BLOCK=block,
            PTX=not interpreter_active(),
            USE_PDL=use_pdl,
            num_warps=num_warps,
            **pdl_launch_kwargs(use_pdl),
        )
    if float(routed_scaling_factor) != 1.0:
        buf.mul_(torch.tensor(float(routed_scaling_factor), dtype=torch.float32))
    out.copy_(buf)


def launch_moe_permute(
    x: torch.Tensor,
    permuted_idx_to_expanded_idx: torch.Tensor,
    top_k: int,
    out: torch.Tensor,
    use_pdl: bool,
) -> None:
    """Writes ``out`` [R, H] = rows of ``x`` [M, H] in expert-sorted order (zeros for padding)."""
    n_rows, hidden = out.shape
    if n_rows == 0 or hidden == 0:
        return
    block, num_warps = finalize_tile(hidden)
    n_tiles = triton.cdiv(hidden, block)
    vec = vec_width(hidden, x.stride(0), out.stride(0))
    args = (
        x, permuted_idx_to_expanded_idx, out,
        x.shape[0] * top_k, top_k, n_tiles, hidden // vec, x.stride(0) // vec, out.stride(0) // vec,
    )  # fmt: skip
    launch(
        _moe_permute_kernel,
        (n_rows * n_tiles,),
        *args,
        VEC=vec,
        BLOCK=block,
        USE_PDL=use_pdl,
        num_warps=num_warps,
        **pdl_launch_kwargs(use_pdl),
    )
