"""Public ops of the MoE finalize family (spec: MoE): the deterministic finalize, its scatter-add
baseline and the permute (gather) of activations into expert-sorted order.

Every op validates its arguments (``ValueError`` naming the argument, nothing written), allocates
a missing output, picks the implementation (``impl="auto" | "triton" | "reference"``, DESIGN.md)
and runs it. ``enable_pdl=None`` uses the measured default (``moefuse.moe.tiles.pdl_default``)
where the device supports it. M = 0 (and H = 0) is a no-op that returns the (empty) output.
"""

from __future__ import annotations

import torch

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, kernel_device_reason, resolve_pdl
from moefuse.moe import ops
from moefuse.moe import reference as ref
from moefuse.moe.tiles import pdl_default

HALF = v.FLOAT16S
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EXTRA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32,)
EXPERT_ID_DTYPES = (torch.int32, torch.int64)
#: CUDA's limit on grid.x (the kernels use a 1-D grid of rows x column tiles)
MAX_PROGRAMS = 2**31 - 1


# ----------------------------------------------------------------------------- validation
def check_expert_bias(op, bias, expert_ids, hidden: int, ids_shape: tuple, device) -> None:
    """``bias`` [E, H] and ``expert_ids`` (``ids_shape``, the routing map's) come together: both
    or neither, the dtypes of :data:`EXTRA_DTYPES` / :data:`EXPERT_ID_DTYPES`, on ``device``."""
    if (bias is None) != (expert_ids is None):
        missing = "expert_ids" if expert_ids is None else "bias"
        raise ValueError(
            f"moefuse.{op}: argument '{missing}' is required when the other of "
            "'bias' / 'expert_ids' is given"
        )
    if bias is not None:
        v.check_tensor(op, "bias", bias, dtypes=EXTRA_DTYPES, ndims=(2,), device=device)
        v.check_tensor(op, "bias", bias, shape=(-1, hidden))
        v.check_tensor(
            op, "expert_ids", expert_ids, dtypes=EXPERT_ID_DTYPES, shape=ids_shape, device=device
        )


def _check_finalize(
    op, permuted_input, idx_map, topk_scales, out, bias, expert_ids, rsf, shared, expanded
) -> None:
    v.check_tensor(op, "permuted_input", permuted_input, dtypes=HALF, ndims=(2,))
    dev = permuted_input.device
    n_rows, hidden = permuted_input.shape
    v.check_tensor(
        op, "expanded_idx_to_permuted_idx", idx_map, dtypes=INDEX_DTYPES, ndims=(2,), device=dev
    )
    m, top_k = idx_map.shape
    v.check_tensor(
        op, "topk_scales", topk_scales, dtypes=SCALE_DTYPES, shape=(m, top_k), device=dev
    )
    if not isinstance(expanded, bool):
        raise ValueError(f"moefuse.{op}: argument 'input_is_expanded' must be a bool")
    if expanded and n_rows < m * top_k:
        raise ValueError(
            f"moefuse.{op}: argument 'permuted_input' needs at least M*K = {m * top_k} rows when "
            f"input_is_expanded=True, got {n_rows}"
        )
    check_expert_bias(op, bias, expert_ids, hidden, (m, top_k), dev)
    v.check_real(op, "routed_scaling_factor", rsf)
    if shared is not None:
        v.check_tensor(
            op, "shared_expert_output", shared, dtypes=EXTRA_DTYPES, shape=(m, hidden), device=dev
        )
    if out is not None:
        v.check_tensor(
            op, "out", out, dtypes=(permuted_input.dtype,), shape=(m, hidden), device=dev
        )
        for name, t in (
            ("permuted_input", permuted_input),
            ("expanded_idx_to_permuted_idx", idx_map),
            ("topk_scales", topk_scales),
            ("bias", bias),
            ("expert_ids", expert_ids),
            ("shared_expert_output", shared),
        ):
            if t is not None:
                v.check_no_overlap(op, "out", out, name, t)


def _grid_reason(rows: int, hidden: int) -> str | None:
    from moefuse.moe.tiles import finalize_tile

    block, _ = finalize_tile(hidden) if hidden > 0 else (1, 1)
    if rows * ((hidden + block - 1) // block) > MAX_PROGRAMS:
        return f"{rows} rows x {hidden} columns exceed one launch grid ({MAX_PROGRAMS} programs)"
    return None


def _kernel_reason(t: torch.Tensor, rows: int, hidden: int) -> str | None:
    return kernel_device_reason(t.device) or _grid_reason(rows, hidden)


def _supported(check, reason, *args) -> bool:
    """``check(*args)`` passes and ``reason()`` finds nothing stopping the kernel."""
    return v.accepts(check, *args) and reason() is None


# ----------------------------------------------------------------------------- moe_finalize
@fast_op
@v.checked(writes=("out",))
def moe_finalize(
    permuted_input: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    topk_scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    expert_ids: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    shared_expert_output: torch.Tensor | None = None,
    input_is_expanded: bool = False,
    enable_pdl: bool | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Deterministic MoE finalize (spec: moe_finalize): per token t and column j::

        acc = +0.0                                                   # FP32
        for k = 0 .. K-1 (ascending), skipping invalid slots (their rows are never read):
            x = f32(permuted_input[row(t, k), j]) [+ f32(bias[expert_ids[t, k], j])]
            acc = fma.rn.ftz.f32(x, f32(topk_scales[t, k]), acc)
        acc = acc * routed_scaling_factor        (FP32, skipped when 1.0)
        acc = acc + f32(shared_expert_output[t, j])   (FP32, when given)
        out[t, j] = cast(acc)                    (round to nearest even: the only rounding)

    ``row(t, k)`` is ``expanded_idx_to_permuted_idx[t, k]`` (invalid when < 0 or >= R), or with
    ``input_is_expanded=True`` the expanded index ``t*K + k`` (invalid when the map value is < 0;
    needs R >= M*K). Fully masked tokens write +0.0 (plus the shared expert). A bias row is added
    only for expert ids inside [0, E).

    Shapes / dtypes: ``permuted_input`` [R, H] BF16/FP16 (last dim contiguous, any row stride);
    ``expanded_idx_to_permuted_idx`` [M, K] int32; ``topk_scales`` [M, K] FP32/BF16/FP16;
    ``bias`` [E, H] and ``expert_ids`` [M, K] int32/int64 (both or neither);
    ``shared_expert_output`` [M, H]; ``out`` [M, H] of the input dtype, not aliasing any input
    (allocated when None). Any H >= 1 and K >= 0 (K = 0: every token is fully masked); 16-byte
    vector loads when H % 8 == 0.

    Determinism: every output element is one sequential FP32 FMA chain over ascending k, so the
    result is bitwise identical across runs, launch geometries, batch sizes and compositions, and
    equal to :func:`moefuse.moe.reference.moe_finalize_reference` (the ``impl="reference"`` path).
    Returns ``out``.
    """
    op = "moe_finalize"
    _check_finalize(
        op,
        permuted_input,
        expanded_idx_to_permuted_idx,
        topk_scales,
        out,
        bias,
        expert_ids,
        routed_scaling_factor,
        shared_expert_output,
        input_is_expanded,
    )
    m = expanded_idx_to_permuted_idx.shape[0]
    hidden = permuted_input.shape[1]
    if out is None:
        out = torch.empty(m, hidden, dtype=permuted_input.dtype, device=permuted_input.device)
    if m == 0 or hidden == 0:
        return out
    rsf = float(routed_scaling_factor)
    reason = _kernel_reason(permuted_input, m, hidden)
    if choose_impl(op, impl, permuted_input.device, reason) == "reference":
        out.copy_(
            ref.moe_finalize_reference(
                permuted_input,
                expanded_idx_to_permuted_idx,
                topk_scales,
                bias=bias,
                expert_ids=expert_ids,
                routed_scaling_factor=rsf,
                shared_expert_output=shared_expert_output,
                input_is_expanded=input_is_expanded,
            )
        )
        return out
    use_pdl = resolve_pdl(
        enable_pdl, permuted_input.device, pdl_default(out.shape[0], out.shape[1])
    )
    ops.moe_finalize_op(
        permuted_input,
        expanded_idx_to_permuted_idx,
        topk_scales,
        out,
        bias,
        expert_ids,
        rsf,
        shared_expert_output,
        input_is_expanded,
        use_pdl,
    )
    return out


def supports_moe_finalize(
    permuted_input: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    topk_scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    expert_ids: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    shared_expert_output: torch.Tensor | None = None,
    input_is_expanded: bool = False,
) -> bool:
    """True when the Triton kernel can run these arguments on their device (no side effects)."""
    args = (
        permuted_input,
        expanded_idx_to_permuted_idx,
        topk_scales,
        out,
        bias,
        expert_ids,
        routed_scaling_factor,
        shared_expert_output,
        input_is_expanded,
    )
    return _supported(
        lambda: _check_finalize("moe_finalize", *args),
        lambda: _kernel_reason(
            permuted_input, expanded_idx_to_permuted_idx.shape[0], permuted_input.shape[1]
        ),
    )


# ----------------------------------------------------------------------------- scatter-add
def _check_scatter(op, permuted_input, inv, topk_scales, out, rsf) -> None:
    v.check_tensor(op, "permuted_input", permuted_input, dtypes=HALF, ndims=(2,))
    dev = permuted_input.device
    v.check_tensor(
        op,
        "permuted_idx_to_expanded_idx",
        inv,
        dtypes=INDEX_DTYPES,
        shape=(permuted_input.shape[0],),
        device=dev,
    )
    v.check_tensor(op, "topk_scales", topk_scales, dtypes=SCALE_DTYPES, ndims=(2,), device=dev)
    v.check_real(op, "routed_scaling_factor", rsf)
    if out is not None:
        v.check_tensor(
            op,
            "out",
            out,
            dtypes=(permuted_input.dtype,),
            shape=(topk_scales.shape[0], permuted_input.shape[1]),
            device=dev,
        )
        for name, t in (
            ("permuted_input", permuted_input),
            ("topk_scales", topk_scales),
            ("permuted_idx_to_expanded_idx", inv),
        ):
            v.check_no_overlap(op, "out", out, name, t)


@fast_op
@v.checked(writes=("out",))
def moe_finalize_scatter_add(
    permuted_input: torch.Tensor,
    permuted_idx_to_expanded_idx: torch.Tensor,
    topk_scales: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    enable_pdl: bool | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Scatter-add finalize — the non-deterministic GEMM-epilogue style, kept as a baseline::

        buf = zeros(M, H) FP32
        for every permuted row p with e = permuted_idx_to_expanded_idx[p] in [0, M*K):
            buf[e // K] += f32(permuted_input[p]) * f32(topk_scales[e // K, e % K])   (atomics)
        out = cast(buf * routed_scaling_factor)

    The FP32 additions happen in arrival order, so the bits can change from run to run (and
    differ from :func:`moe_finalize` in the last place); the values agree to FP32 rounding.
    Shapes: ``permuted_input`` [R, H] BF16/FP16, ``permuted_idx_to_expanded_idx`` [R] int32
    (negative = padding row), ``topk_scales`` [M, K]; ``out`` [M, H]. Returns ``out``.
    """
    op = "moe_finalize_scatter_add"
    _check_scatter(
        op, permuted_input, permuted_idx_to_expanded_idx, topk_scales, out, routed_scaling_factor
    )
    m, hidden = topk_scales.shape[0], permuted_input.shape[1]
    if out is None:
        out = torch.empty(m, hidden, dtype=permuted_input.dtype, device=permuted_input.device)
    if m == 0 or hidden == 0:
        return out
    rsf = float(routed_scaling_factor)
    reason = _kernel_reason(permuted_input, permuted_input.shape[0], hidden)
    if choose_impl(op, impl, permuted_input.device, reason) == "reference":
        out.copy_(
            ref.moe_finalize_scatter_add_reference(
                permuted_input, permuted_idx_to_expanded_idx, topk_scales, routed_scaling_factor=rsf
            )
        )
        return out
    use_pdl = resolve_pdl(enable_pdl, permuted_input.device)
    ops.moe_finalize_scatter_add_op(
        permuted_input, permuted_idx_to_expanded_idx, topk_scales, out, rsf, use_pdl
    )
    return out


def supports_moe_finalize_scatter_add(
    permuted_input, permuted_idx_to_expanded_idx, topk_scales, *, out=None
) -> bool:
    return _supported(
        lambda: _check_scatter(
            "moe_finalize_scatter_add",
            permuted_input,
            permuted_idx_to_expanded_idx,
            topk_scales,
            out,
            1.0,
        ),
        lambda: _kernel_reason(permuted_input, permuted_input.shape[0], permuted_input.shape[1]),
    )


# ----------------------------------------------------------------------------- permute
def _check_permute(op, input, inv, top_k, out) -> None:
    v.check_tensor(op, "input", input, dtypes=HALF + (torch.float32,), ndims=(2,))
    v.check_tensor(
        op,
        "permuted_idx_to_expanded_idx",
        inv,
        dtypes=INDEX_DTYPES,
        ndims=(1,),
        device=input.device,
    )
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"moefuse.{op}: argument 'top_k' must be an int >= 1, got {top_k!r}")
    if out is not None:
        v.check_tensor(
            op,
            "out",
            out,
            dtypes=(input.dtype,),
            shape=(inv.shape[0], input.shape[1]),
            device=input.device,
        )
        v.check_no_overlap(op, "out", out, "input", input)
        v.check_no_overlap(op, "out", out, "permuted_idx_to_expanded_idx", inv)


@fast_op
@v.checked(writes=("out",))
def moe_permute(
    input: torch.Tensor,
    permuted_idx_to_expanded_idx: torch.Tensor,
    top_k: int,
    *,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Gather activations into expert-sorted order: ``out[p] = input[e // top_k]`` with
    ``e = permuted_idx_to_expanded_idx[p]``; rows with ``e`` outside ``[0, M*top_k)`` (padding)
    are written as zeros. A bit copy (no arithmetic). ``input`` [M, H] BF16/FP16/FP32,
    ``permuted_idx_to_expanded_idx`` [R] int32 (see :func:`moefuse.moe.routing.sort_by_expert`),
    ``out`` [R, H] of the input dtype. Returns ``out``.
    """
    op = "moe_permute"
    _check_permute(op, input, permuted_idx_to_expanded_idx, top_k, out)
    n_rows, hidden = permuted_idx_to_expanded_idx.shape[0], input.shape[1]
    if out is None:
        out = torch.empty(n_rows, hidden, dtype=input.dtype, device=input.device)
    if n_rows == 0 or hidden == 0:
        return out
    reason = _kernel_reason(input, n_rows, hidden)
    if choose_impl(op, impl, input.device, reason) == "reference":
        out.copy_(ref.moe_permute_reference(input, permuted_idx_to_expanded_idx, top_k))
        return out
    use_pdl = resolve_pdl(enable_pdl, input.device, pdl_default(input.shape[0], hidden))
    ops.moe_permute_op(input, permuted_idx_to_expanded_idx, top_k, out, use_pdl)
    return out


def supports_moe_permute(input, permuted_idx_to_expanded_idx, top_k: int, *, out=None) -> bool:
    return _supported(
        lambda: _check_permute("moe_permute", input, permuted_idx_to_expanded_idx, top_k, out),
        lambda: _kernel_reason(input, permuted_idx_to_expanded_idx.shape[0], input.shape[1]),
    )
