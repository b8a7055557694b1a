"""Public all-gather + norm fusions (spec: all_gather_gated_residual_next_rmsnorm,
all_gather_rmsnorm_fp4_quantize): after a column-sharded projection each of the P ranks holds
``shard`` [M, S], its columns ``[rank*S, (rank+1)*S)`` of every token row (H = P * S). Each op
gathers the rows (in rank order) and applies a single-GPU op to them:

* :func:`all_gather_rmsnorm` -> :func:`moefuse.rmsnorm` (BF16/FP16 out; ``gain_center`` 1.0 =
  Gemma),
* :func:`all_gather_rmsnorm_fp8` -> :func:`moefuse.rmsnorm_quant` (static FP8),
* :func:`all_gather_rmsnorm_fp4_quantize` -> :func:`moefuse.rmsnorm_fp4_quantize` (NVFP4),
* :func:`all_gather_gated_residual_next_rmsnorm` -> :func:`moefuse.gated_residual_next_rmsnorm`
  (the branch is sharded; ``residual`` and every parameter are replicated, full width).

Results are bitwise equal to gathering the shards and calling the single-GPU op on the same
device (the fused path runs that op's own kernel on the gathered rows), identical on every rank,
and independent of ``algorithm``.

Collective over ``workspace``, an :class:`AllReduceWorkspace` created with
``extra_regions=allgather_regions(max_tokens, hidden_size)`` (``hidden_size`` = H, the full
width); every rank calls with the same M, in the same order. Common keyword arguments:
``algorithm`` "auto" (peer buffers when the workspace has them and M <= max_tokens, else torch)
| "oneshot" (Lamport over NVLink; raises if it cannot run) | "torch" (torch.distributed
all-gather, then the single-GPU kernel); ``enable_pdl`` (None: where supported); ``impl``
"auto" | "triton" | "reference" (DESIGN.md; "reference" gathers with torch.distributed and runs
the single-GPU op's reference). Outputs are allocated when None. M = 0 is a no-op.
"""

from __future__ import annotations

import torch

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, kernel_device_reason, resolve_pdl
from moefuse.comm.all_gather import ops
from moefuse.comm.workspace import AllReduceWorkspace
from moefuse.quant import formats as F

HALF = v.FLOAT16S
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
F32 = (torch.float32,)


# ----------------------------------------------------------------------------- validation
def _check_common(op, shard, workspace, algorithm, shard_name="shard") -> int:
    """Checks shared by every op; returns the full width H."""
    if not isinstance(workspace, AllReduceWorkspace):
        raise ValueError(
            f"moefuse.{op}: argument 'workspace' must be an AllReduceWorkspace, "
            f"got {type(workspace).__name__}"
        )
    v.check_tensor(op, shard_name, shard, dtypes=HALF, ndims=(2,), device=workspace.device)
    h = shard.shape[1] * workspace.world_size
    if h != workspace.hidden_size:
        raise ValueError(
            f"moefuse.{op}: argument '{shard_name}' has {shard.shape[1]} columns; "
            f"the workspace expects hidden_size / world_size = "
            f"{workspace.hidden_size} / {workspace.world_size}"
        )
    if algorithm not in ops.ALGORITHMS:
        raise ValueError(
            f"moefuse.{op}: argument 'algorithm' must be one of {ops.ALGORITHMS}, got {algorithm!r}"
        )
    return h


def _check_scalar_tensor(op, name, t, device) -> None:
    v.check_tensor(op, name, t, dtypes=F32, shape=(1,), device=device)


def _check_outs(op, outs, inputs, in_place=()) -> None:
    """No output overlaps another or an input, except the exact in-place pairs ``in_place``."""
    outs = [(n, t) for n, t in outs if t is not None]
    for i, (name_a, a) in enumerate(outs):
        for name_b, b in outs[i + 1 :]:
            v.check_no_overlap(op, name_a, a, name_b, b)
        for name_i, t in inputs:
            if t is None or not isinstance(t, torch.Tensor):
                continue
            if (name_a, name_i) in in_place:
                v.check_alias_exact_or_disjoint(op, name_a, a, name_i, t)
            else:
                v.check_no_overlap(op, name_a, a, name_i, t)


def _check_norm(op, shard, weight, workspace, eps, gain_center, algorithm) -> int:
    h = _check_common(op, shard, workspace, algorithm)
    v.check_tensor(op, "weight", weight, dtypes=WEIGHT_DTYPES, shape=(h,), device=shard.device)
    v.check_eps(op, "eps", eps)
    v.check_real(op, "gain_center", gain_center)
    return h


def _out(op, name, t, shape, dtype, device, contiguous=False) -> None:
    if t is None:
        return
    v.check_tensor(op, name, t, dtypes=(dtype,), shape=shape, device=device)
    if contiguous and not t.is_contiguous():
        raise ValueError(f"moefuse.{op}: argument '{name}' must be contiguous")


def _reason(workspace, shard) -> str | None:
    """Why the Triton backend cannot run (None when it can): workspace health, then device."""
    if workspace.closed:
        return "the workspace is closed"
    if workspace._failure is not None:
        return f"the workspace failed: {workspace._failure}"
    return kernel_device_reason(shard.device)


def _backend(op, impl, shard, workspace) -> str:
    return choose_impl(op, impl, shard.device, _reason(workspace, shard))


def _fused_reason(workspace, shard) -> str | None:
    """Why the fused peer-memory path cannot run (None when it can)."""
    reason = _reason(workspace, shard)
    if reason is None and not workspace.peer_access:
        reason = "the workspace has no peer buffers"
    if reason is None and shard.shape[0] > workspace.max_tokens:
        reason = f"{shard.shape[0]} tokens > workspace max_tokens {workspace.max_tokens}"
    return reason if reason is not None else ops.region_reason(workspace)


# ----------------------------------------------------------------------------- rmsnorm
@fast_op(guards=("workspace",))
@v.checked(writes=("out",))
def all_gather_rmsnorm(
    shard,
    weight,
    *,
    workspace,
    eps: float = 1e-6,
    gain_center: float = 0.0,
    out=None,
    algorithm: str = "auto",
    enable_pdl=None,
    impl: str = "auto",
):
    """``out = rmsnorm(concat_r shard_r, weight, eps)``: ``cast((x * r) * (f32(w) + c))``.

    ``shard`` [M, H/P] BF16/FP16; ``weight`` [H]; ``out`` [M, H] of the shard dtype. Returns
    ``out``."""
    op = "all_gather_rmsnorm"
    h = _check_norm(op, shard, weight, workspace, eps, gain_center, algorithm)
    m = shard.shape[0]
    _out(op, "out", out, (m, h), shard.dtype, shard.device)
    _check_outs(op, [("out", out)], [("shard", shard), ("weight", weight)])
    if out is None:
        out = torch.empty((m, h), dtype=shard.dtype, device=shard.device)
    if m == 0:
        return out
    backend = _backend(op, impl, shard, workspace)
    ops.all_gather_rmsnorm_op(
        shard,
        weight,
        out,
        workspace.id,
        float(eps),
        float(gain_center),
        algorithm,
        resolve_pdl(enable_pdl, shard.device),
        backend,
    )
    return out


def supports_all_gather_rmsnorm(shard, weight, *, workspace) -> bool:
    """Local answer (no side effects): can the fused peer-memory kernels run? Combine across
    ranks with ``workspace.vote`` before CUDA-graph capture."""
    return (
        v.accepts(_check_norm, "all_gather_rmsnorm", shard, weight, workspace, 1e-6, 0.0, "auto")
        and _fused_reason(workspace, shard) is None
    )


# ----------------------------------------------------------------------------- FP8
def _check_fp8(op, shard, weight, scale, workspace, eps, gain_center, dtype, algorithm) -> int:
    h = _check_norm(op, shard, weight, workspace, eps, gain_center, algorithm)
    _check_scalar_tensor(op, "scale", scale, shard.device)
    if dtype is not None and dtype not in F.FP8_DTYPES:
        raise ValueError(
            f"moefuse.{op}: argument 'dtype' must be one of {F.FP8_DTYPES}, got {dtype!r}"
        )
    return h


@fast_op(guards=("workspace",))
@v.checked(writes=("out",))
def all_gather_rmsnorm_fp8(
    shard,
    weight,
    scale,
    *,
    workspace,
    eps: float = 1e-6,
    gain_center: float = 0.0,
    dtype=None,
    out=None,
    algorithm: str = "auto",
    enable_pdl=None,
    impl: str = "auto",
):
    """``out = rmsnorm_quant(concat_r shard_r, weight, scale, eps)``: FP8 (E4M3 or E5M2,
    ``dtype``; None: the dtype of ``out`` when given, else E4M3) of the unrounded FP32 norm output
    times ``1/scale`` (spec: rmsnorm, FP8 E4M3).

    ``scale`` [1] FP32 (dequantization scale); ``out`` [M, H] FP8 of ``dtype``. Returns ``out``."""
    op = "all_gather_rmsnorm_fp8"
    h = _check_fp8(op, shard, weight, scale, workspace, eps, gain_center, dtype, algorithm)
    m = shard.shape[0]
    if out is not None:
        v.check_tensor(
            op,
            "out",
            out,
            dtypes=F.FP8_DTYPES if dtype is None else (dtype,),
            shape=(m, h),
            device=shard.device,
        )
    if dtype is None:
        dtype = out.dtype if out is not None else torch.float8_e4m3fn
    _check_outs(op, [("out", out)], [("shard", shard), ("weight", weight), ("scale", scale)])
    if out is None:
        out = torch.empty((m, h), dtype=dtype, device=shard.device)
    if m == 0:
        return out
    backend = _backend(op, impl, shard, workspace)
    ops.all_gather_rmsnorm_fp8_op(
        shard,
        weight,
        scale,
        out.view(torch.uint8),
        F.FP8_CODE[dtype],
        workspace.id,
        float(eps),
        float(gain_center),
        algorithm,
        resolve_pdl(enable_pdl, shard.device),
        backend,
    )
    return out


def supports_all_gather_rmsnorm_fp8(shard, weight, scale, *, workspace, dtype=None) -> bool:
    return (
        v.accepts(
            _check_fp8,
            "all_gather_rmsnorm_fp8",
            shard,
            weight,
            scale,
            workspace,
            1e-6,
            0.0,
            dtype,
            "auto",
        )
        and _fused_reason(workspace, shard) is None
    )


# ----------------------------------------------------------------------------- NVFP4
def _check_fp4(
    op, shard, weight, global_scale, workspace, eps, gain_center, layout, recipe, algorithm
) -> int:
    h = _check_norm(op, shard, weight, workspace, eps, gain_center, algorithm)
    if h % 16 != 0:
        raise ValueError(
            f"moefuse.{op}: argument 'shard' gathers rows of {h} columns; NVFP4 needs "
            "a multiple of 16"
        )
    _check_scalar_tensor(op, "global_scale", global_scale, shard.device)
    if layout not in F.LAYOUTS:
        raise ValueError(
            f"moefuse.{op}: argument 'layout' must be one of {tuple(F.LAYOUTS)}, got {layout!r}"
        )
    if recipe not in F.RECIPES:
        raise ValueError(
            f"moefuse.{op}: argument 'recipe' must be one of {tuple(F.RECIPES)}, got {recipe!r}"
        )
    return h


@fast_op(guards=("workspace",))
@v.checked(writes=("out", "scale_out"))
def all_gather_rmsnorm_fp4_quantize(
    shard,
    weight,
    global_scale,
    *,
    workspace,
    eps: float = 1e-6,
    gain_center: float = 0.0,
    layout: str = "linear",
    recipe: str = "fast",
    out=None,
    scale_out=None,
    algorithm: str = "auto",
    enable_pdl=None,
    impl: str = "auto",
):
    """``rmsnorm_fp4_quantize(concat_r shard_r, weight, global_scale, eps)`` (the spec's
    all_gather_rmsnorm_fp4_quantize): the norm output rounded to the shard dtype, then NVFP4 (recipe
    "fast" by default, as FlashInfer's all-gather kernel). H % 16 == 0. ``layout`` "linear" (spec
    default) | "swizzled_128x4" | "swizzled_8x4"; padding scale bytes are written as 0.

    Returns ``(out uint8 [M, H/2], scale_out uint8 scale_layout_shape(M, H/16, layout))``."""
    op = "all_gather_rmsnorm_fp4_quantize"
    h = _check_fp4(
        op, shard, weight, global_scale, workspace, eps, gain_center, layout, recipe, algorithm
    )
    m = shard.shape[0]
    sf_shape = F.scale_layout_shape(m, h // 16, layout)
    _out(op, "out", out, (m, h // 2), torch.uint8, shard.device, contiguous=True)
    _out(op, "scale_out", scale_out, sf_shape, torch.uint8, shard.device, contiguous=True)
    _check_outs(
        op,
        [("out", out), ("scale_out", scale_out)],
        [("shard", shard), ("weight", weight), ("global_scale", global_scale)],
    )
    if out is None:
        out = torch.empty((m, h // 2), dtype=torch.uint8, device=shard.device)
    if scale_out is None:
        scale_out = torch.empty(sf_shape, dtype=torch.uint8, device=shard.device)
    if m == 0:
        return out, scale_out
    backend = _backend(op, impl, shard, workspace)
    ops.all_gather_rmsnorm_fp4_quantize_op(
        shard,
        weight,
        global_scale,
        out,
        scale_out,
        workspace.id,
        float(eps),
        float(gain_center),
        layout,
        recipe,
        algorithm,
        resolve_pdl(enable_pdl, shard.device),
        backend,
    )
    return out, scale_out


def supports_all_gather_rmsnorm_fp4_quantize(
    shard, weight, global_scale, *, workspace, layout="linear", recipe="fast"
) -> bool:
    return (
        v.accepts(
            _check_fp4,
            "all_gather_rmsnorm_fp4_quantize",
            shard,
            weight,
            global_scale,
            workspace,
            1e-6,
            0.0,
            layout,
            recipe,
            "auto",
        )
        and _fused_reason(workspace, shard) is None
    )


# ----------------------------------------------------------------------------- gated dual norm
def _check_gated(
    op,
    branch_shard,
    residual,
    alpha,
    beta,
    next_weight,
    workspace,
    post_eps,
    next_eps,
    next_gain_center,
    post_weight,
    post_gain_center,
    algorithm,
) -> int:
    h = _check_common(op, branch_shard, workspace, algorithm, "branch_shard")
    m, dev = branch_shard.shape[0], branch_shard.device
    v.check_tensor(op, "residual", residual, dtypes=F32, shape=(m, h), device=dev)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float, torch.Tensor)):
        raise ValueError(
            f"moefuse.{op}: argument 'alpha' must be an FP32 [H] tensor or a float, "
            f"got {type(alpha).__name__}"
        )
    if isinstance(alpha, torch.Tensor):
        v.check_tensor(op, "alpha", alpha, dtypes=F32, shape=(h,), device=dev)
    v.check_tensor(op, "beta", beta, dtypes=F32, shape=(h,), device=dev)
    v.check_tensor(op, "next_weight", next_weight, dtypes=WEIGHT_DTYPES, shape=(h,), device=dev)
    if post_weight is not None:
        v.check_tensor(op, "post_weight", post_weight, dtypes=WEIGHT_DTYPES, shape=(h,), device=dev)
    v.check_eps(op, "post_eps", post_eps)
    v.check_eps(op, "next_eps", next_eps)
    v.check_real(op, "next_gain_center", next_gain_center)
    v.check_real(op, "post_gain_center", post_gain_center)
    return h


@fast_op(guards=("workspace",))
@v.checked(writes=("residual_out", "ffn_input", "router_input"))
def all_gather_gated_residual_next_rmsnorm(
    branch_shard,
    residual,
    alpha,
    beta,
    next_weight,
    *,
    workspace,
    post_eps: float = 1e-6,
    next_eps: float = 1e-6,
    next_gain_center: float = 0.0,
    post_weight=None,
    post_gain_center: float = 0.0,
    residual_out=None,
    ffn_input=None,
    router_input=None,
    algorithm: str = "auto",
    enable_pdl=None,
    impl: str = "auto",
):
    """``gated_residual_next_rmsnorm(concat_r branch_shard_r, residual, next_weight, alpha, beta)``
    (spec: all_gather_gated_residual_next_rmsnorm on gated_residual_next_rmsnorm)::

        b = f32(branch) [* (f32(post_weight) + post_gain_center)]
        residual_out = alpha * residual + (beta * b) * rsqrt(mean(b^2) + post_eps)
        router_input = (residual_out * rsqrt(mean(residual_out^2) + next_eps))
                       * (f32(next_weight) + next_gain_center)
        ffn_input = cast(router_input)

    ``branch_shard`` [M, H/P] BF16/FP16 (this rank's columns); ``residual`` [M, H] FP32
    (replicated); ``alpha`` FP32 [H] tensor or a Python float (1.0 = ungated); ``beta`` FP32 [H];
    ``next_weight`` / ``post_weight`` [H]. Outputs: ``residual_out`` FP32 [M, H] (may be
    ``residual``: in place), ``ffn_input`` [M, H] of the branch dtype, ``router_input`` FP32
    [M, H] written only when given. Returns ``(residual_out, ffn_input)``."""
    op = "all_gather_gated_residual_next_rmsnorm"
    h = _check_gated(
        op,
        branch_shard,
        residual,
        alpha,
        beta,
        next_weight,
        workspace,
        post_eps,
        next_eps,
        next_gain_center,
        post_weight,
        post_gain_center,
        algorithm,
    )
    m, dev = branch_shard.shape[0], branch_shard.device
    _out(op, "residual_out", residual_out, (m, h), torch.float32, dev)
    _out(op, "ffn_input", ffn_input, (m, h), branch_shard.dtype, dev)
    _out(op, "router_input", router_input, (m, h), torch.float32, dev)
    inputs = [
        ("branch_shard", branch_shard),
        ("residual", residual),
        ("alpha", alpha),
        ("beta", beta),
        ("next_weight", next_weight),
        ("post_weight", post_weight),
    ]
    _check_outs(
        op,
        [("residual_out", residual_out), ("ffn_input", ffn_input), ("router_input", router_input)],
        inputs,
        {("residual_out", "residual")},
    )
    if residual_out is None:
        residual_out = torch.empty((m, h), dtype=torch.float32, device=dev)
    if ffn_input is None:
        ffn_input = torch.empty((m, h), dtype=branch_shard.dtype, device=dev)
    if m == 0:
        return residual_out, ffn_input
    backend = _backend(op, impl, branch_shard, workspace)
    alpha_t = alpha if isinstance(alpha, torch.Tensor) else None
    alpha_scalar = 1.0 if alpha_t is not None else float(alpha)
    ops.all_gather_gated_residual_next_rmsnorm_op(
        branch_shard,
        residual,
        next_weight,
        alpha_t,
        alpha_scalar,
        beta,
        post_weight,
        residual_out,
        ffn_input,
        router_input,
        workspace.id,
        float(post_eps),
        float(next_eps),
        float(next_gain_center),
        float(post_gain_center),
        algorithm,
        resolve_pdl(enable_pdl, dev),
        backend,
    )
    return residual_out, ffn_input


def supports_all_gather_gated_residual_next_rmsnorm(
    branch_shard, residual, alpha, beta, next_weight, *, workspace, post_weight=None
) -> bool:
    return (
        v.accepts(
            _check_gated,
            "all_gather_gated_residual_next_rmsnorm",
            branch_shard,
            residual,
            alpha,
            beta,
            next_weight,
            workspace,
            1e-6,
            1e-6,
            0.0,
            post_weight,
            0.0,
            "auto",
        )
        and _fused_reason(workspace, branch_shard) is None
    )
