"""Public ops of the RMSNorm family (spec: Norms), under FlashInfer's names and argument names.

Every op: validates its arguments (``ValueError`` naming the argument, nothing written; the ops
are for inference, so a written tensor that requires grad is refused while autograd records),
allocates missing outputs, picks the implementation (``impl="auto" | "triton" | "reference"``, see
DESIGN.md) and runs it. ``enable_pdl=None`` turns programmatic dependent launch on where the device
supports it. Shapes: ``[M, H]`` (and ``[M, heads, H]`` where stated), any H >= 1 (rows wider
than one block loop over column chunks); M = 0 is a no-op. Norm weights may be BF16, FP16 or FP32
whatever the activation dtype (read as FP32).
"""

from __future__ import annotations

import torch

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, kernel_device_reason, resolve_pdl
from moefuse.norm import ops
from moefuse.norm import reference as ref

HALF = v.FLOAT16S
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
F32 = (torch.float32,)


# ----------------------------------------------------------------------------- validation
def _check_vector(op: str, name: str, t, width: int, dtypes, device) -> None:
    v.check_tensor(op, name, t, dtypes=dtypes, shape=(width,), device=device)


def _check_rmsnorm(op, input, weight, out, eps) -> None:
    v.check_tensor(op, "input", input, dtypes=HALF, ndims=(2, 3))
    width = input.shape[-1]
    _check_vector(op, "weight", weight, width, WEIGHT_DTYPES, input.device)
    if out is not None:
        v.check_tensor(
            op, "out", out, dtypes=(input.dtype,), shape=input.shape, device=input.device
        )
        v.check_alias_exact_or_disjoint(op, "out", out, "input", input)
        v.check_no_overlap(op, "out", out, "weight", weight)
    v.check_eps(op, "eps", eps)


def _as_rows(op: str, name: str, t: torch.Tensor) -> torch.Tensor:
    """[M, H] view of a 2-D or uniformly strided 3-D tensor."""
    if t.dim() == 3:
        v.check_rows_addressable(op, name, t)
        return t.view(-1, t.shape[-1])  # a view, never a copy: in-place ops write through it
    return t


def _check_fused_add(op, input, residual, weight, eps) -> None:
    v.check_tensor(op, "input", input, dtypes=HALF, ndims=(2, 3))
    v.check_tensor(
        op, "residual", residual, dtypes=(input.dtype,), shape=input.shape, device=input.device
    )
    _check_vector(op, "weight", weight, input.shape[-1], WEIGHT_DTYPES, input.device)
    v.check_rows_addressable(op, "input", input)
    v.check_rows_addressable(op, "residual", residual)
    v.check_no_overlap(op, "residual", residual, "input", input)
    v.check_no_overlap(op, "input", input, "weight", weight)
    v.check_no_overlap(op, "residual", residual, "weight", weight)
    v.check_eps(op, "eps", eps)


def _device_reason(t: torch.Tensor) -> str | None:
    return kernel_device_reason(t.device)


def _supported(check, *args) -> bool:
    """``check(*args)`` passes and the kernel can run on the first tensor argument's device."""
    return v.accepts(check, *args) and _device_reason(args[1]) is None


# ----------------------------------------------------------------------------- rmsnorm
def _rmsnorm(op, input, weight, eps, out, enable_pdl, impl, gain_center):
    _check_rmsnorm(op, input, weight, out, eps)
    if out is None:
        out = torch.empty_like(input)
    if input.numel() == 0:
        return out
    if choose_impl(op, impl, input.device, _device_reason(input)) == "reference":
        out.copy_(ref.rmsnorm_reference(input, weight, eps, gain_center))
        return out
    use_pdl = resolve_pdl(enable_pdl, input.device)
    ops.rmsnorm_op(input, weight, out, float(eps), float(gain_center), use_pdl)
    return out


@fast_op
@v.checked(writes=("out",))
def rmsnorm(input, weight, eps: float = 1e-6, out=None, enable_pdl=None, *, impl: str = "auto"):
    """RMSNorm per row: ``out = cast((x * rsqrt(mean(x^2) + eps)) * f32(weight))``.

    ``input`` [M, H] or [M, heads, H] BF16/FP16 (last dim contiguous, any row strides);
    ``weight`` [H]; ``out`` like ``input`` (may be ``input`` itself: in place). Returns ``out``.
    """
    return _rmsnorm("rmsnorm", input, weight, eps, out, enable_pdl, impl, 0.0)


@fast_op
@v.checked(writes=("out",))
def gemma_rmsnorm(
    input, weight, eps: float = 1e-6, out=None, enable_pdl=None, *, impl: str = "auto"
):
    """Gemma-style RMSNorm: as :func:`rmsnorm` with gain ``1 + f32(weight)`` (FP32)."""
    return _rmsnorm("gemma_rmsnorm", input, weight, eps, out, enable_pdl, impl, 1.0)


def supports_rmsnorm(input, weight, out=None, eps: float = 1e-6) -> bool:
    """True when the Triton kernel can run these tensors on their device (no side effects)."""
    return _supported(_check_rmsnorm, "rmsnorm", input, weight, out, eps)


# ----------------------------------------------------------------------------- fused add
def _fused_add(op, input, residual, weight, eps, enable_pdl, impl, gain_center):
    _check_fused_add(op, input, residual, weight, eps)
    if input.numel() == 0:
        return None
    if choose_impl(op, impl, input.device, _device_reason(input)) == "reference":
        normed, res_out = ref.fused_add_rmsnorm_reference(input, residual, weight, eps, gain_center)
        residual.copy_(res_out)
        input.copy_(normed)
        return None
    use_pdl = resolve_pdl(enable_pdl, input.device)
    x2 = _as_rows(op, "input", input)
    r2 = _as_rows(op, "residual", residual)
    ops.fused_add_rmsnorm_op(x2, r2, weight, float(eps), float(gain_center), use_pdl)
    return None


@fast_op
@v.checked(writes=("input", "residual"))
def fused_add_rmsnorm(
    input, residual, weight, eps: float = 1e-6, enable_pdl=None, *, impl: str = "auto"
) -> None:
    """Residual add + RMSNorm, in place on both inputs (spec: fused_add_rmsnorm)::

        h = f32(input) + f32(residual);  residual <- cast(h)
        input <- cast((h * rsqrt(mean(h^2) + eps)) * f32(weight))   # statistic of the FP32 h

    ``input``, ``residual`` [M, H] (or uniformly strided [M, heads, H]) BF16/FP16, same dtype, not
    aliasing each other; ``weight`` [H]. Returns None.
    """
    return _fused_add("fused_add_rmsnorm", input, residual, weight, eps, enable_pdl, impl, 0.0)


@fast_op
@v.checked(writes=("input", "residual"))
def gemma_fused_add_rmsnorm(
    input, residual, weight, eps: float = 1e-6, enable_pdl=None, *, impl: str = "auto"
) -> None:
    """As :func:`fused_add_rmsnorm` with gain ``1 + f32(weight)``."""
    return _fused_add(
        "gemma_fused_add_rmsnorm", input, residual, weight, eps, enable_pdl, impl, 1.0
    )


def supports_fused_add_rmsnorm(input, residual, weight, eps: float = 1e-6) -> bool:
    return _supported(_check_fused_add, "fused_add_rmsnorm", input, residual, weight, eps)


# ----------------------------------------------------------------------------- gated residual
def _check_gated_common(op, branch, residual, alpha, beta, alpha_may_be_scalar=False) -> None:
    v.check_tensor(op, "branch", branch, dtypes=HALF, ndims=(2,))
    m, width = branch.shape
    v.check_tensor(op, "residual", residual, dtypes=F32, shape=(m, width), device=branch.device)
    if alpha_may_be_scalar and not isinstance(alpha, torch.Tensor):
        v.check_real(op, "alpha", alpha)
    else:
        _check_vector(op, "alpha", alpha, width, F32, branch.device)
    _check_vector(op, "beta", beta, width, F32, branch.device)


def _check_gated(op, branch, residual, weight, alpha, beta, eps, out) -> None:
    _check_gated_common(op, branch, residual, alpha, beta)
    width = branch.shape[1]
    if weight is not None:
        _check_vector(op, "weight", weight, width, WEIGHT_DTYPES, branch.device)
    if out is not None:
        v.check_tensor(op, "out", out, dtypes=F32, shape=branch.shape, device=branch.device)
        v.check_no_overlap(op, "out", out, "branch", branch)
        v.check_alias_exact_or_disjoint(op, "out", out, "residual", residual)
        for name, t in (("alpha", alpha), ("beta", beta), ("weight", weight)):
            if t is not None:
                v.check_no_overlap(op, "out", out, name, t)
    v.check_eps(op, "eps", eps)


@fast_op
@v.checked(writes=("out",), reals=("gain_center",))
def gated_residual_rmsnorm(
    branch,
    residual,
    weight,
    alpha,
    beta,
    eps: float = 1e-6,
    gain_center: float = 0.0,
    out=None,
    enable_pdl=True,
    *,
    impl: str = "auto",
):
    """Gated residual update of an FP32 stream with a normalized branch (spec)::

        x = f32(branch) [* (f32(weight) + gain_center)]
        out = alpha * residual + beta * (x * rsqrt(mean(x^2) + eps))      # FP32

    ``branch`` [M, H] BF16/FP16; ``residual`` [M, H] FP32; ``weight`` [H] or None; ``alpha``,
    ``beta`` [H] FP32. ``out`` [M, H] FP32 is allocated when None and may be ``residual`` itself
    (in-place stream update) but must not alias ``branch``. Returns ``out``.
    """
    op = "gated_residual_rmsnorm"
    _check_gated(op, branch, residual, weight, alpha, beta, eps, out)
    if out is None:
        out = torch.empty_like(residual)
    if branch.numel() == 0:
        return out
    if choose_impl(op, impl, branch.device, _device_reason(branch)) == "reference":
        out.copy_(
            ref.gated_residual_rmsnorm_reference(
                branch, residual, weight, alpha, beta, eps, gain_center
            )
        )
        return out
    use_pdl = resolve_pdl(enable_pdl, branch.device)
    ops.gated_residual_rmsnorm_op(
        branch, residual, weight, alpha, beta, out, float(eps), float(gain_center), use_pdl
    )
    return out


def supports_gated_residual_rmsnorm(branch, residual, weight, alpha, beta) -> bool:
    return _supported(
        _check_gated, "gated_residual_rmsnorm", branch, residual, weight, alpha, beta, 1e-6, None
    )


def _check_gated_next(
    op,
    branch,
    residual,
    next_weight,
    alpha,
    beta,
    post_eps,
    next_eps,
    residual_out,
    ffn_input,
    post_weight,
    router_input,
) -> None:
    _check_gated_common(op, branch, residual, alpha, beta, alpha_may_be_scalar=True)
    m, width = branch.shape
    dev = branch.device
    _check_vector(op, "next_weight", next_weight, width, WEIGHT_DTYPES, dev)
    if post_weight is not None:
        _check_vector(op, "post_weight", post_weight, width, WEIGHT_DTYPES, dev)
    params = [("next_weight", next_weight), ("beta", beta), ("post_weight", post_weight)]
    if isinstance(alpha, torch.Tensor):
        params.append(("alpha", alpha))
    outs = []
    if residual_out is not None:
        v.check_tensor(op, "residual_out", residual_out, dtypes=F32, shape=(m, width), device=dev)
        v.check_alias_exact_or_disjoint(op, "residual_out", residual_out, "residual", residual)
        v.check_no_overlap(op, "residual_out", residual_out, "branch", branch)
        outs.append(("residual_out", residual_out))
    if ffn_input is not None:
        v.check_tensor(
            op, "ffn_input", ffn_input, dtypes=(branch.dtype,), shape=(m, width), device=dev
        )
        for name, t in (("branch", branch), ("residual", residual)):
            v.check_no_overlap(op, "ffn_input", ffn_input, name, t)
        outs.append(("ffn_input", ffn_input))
    if router_input is not None:
        v.check_tensor(op, "router_input", router_input, dtypes=F32, shape=(m, width), device=dev)
        for name, t in (("branch", branch), ("residual", residual)):
            v.check_no_overlap(op, "router_input", router_input, name, t)
        outs.append(("router_input", router_input))
    for i, (name_a, a) in enumerate(outs):
        for name_b, b in outs[i + 1 :]:
            v.check_no_overlap(op, name_a, a, name_b, b)
        for name_p, p in params:
            if p is not None:
                v.check_no_overlap(op, name_a, a, name_p, p)
    v.check_eps(op, "post_eps", post_eps)
    v.check_eps(op, "next_eps", next_eps)


@fast_op
@v.checked(
    writes=("residual_out", "ffn_input", "router_input"),
    reals=("next_gain_center", "post_gain_center"),
)
def gated_residual_next_rmsnorm(
    branch,
    residual,
    next_weight,
    alpha,
    beta,
    post_eps: float = 1e-6,
    next_eps: float = 1e-6,
    next_gain_center: float = 0.0,
    residual_out=None,
    ffn_input=None,
    *,
    post_weight=None,
    post_gain_center: float = 0.0,
    router_input=None,
    enable_pdl=True,
    impl: str = "auto",
):
    """Gated residual update followed by the next block's RMSNorm, in one pass (spec)::

        b = f32(branch) [* (f32(post_weight) + post_gain_center)]
        residual_out = u + (beta * b) * rsqrt(mean(b^2) + post_eps)    # u = alpha * residual
        y = (residual_out * rsqrt(mean(residual_out^2) + next_eps)) * (f32(next_weight) + c_next)
        ffn_input = cast(y);  router_input = y (FP32, optional output)

    ``alpha`` is an FP32 [H] tensor or a Python scalar (1.0 = ungated stream). ``residual_out``
    [M, H] FP32 may be ``residual`` (in place); ``ffn_input`` [M, H] has the branch dtype;
    ``router_input`` [M, H] FP32 is written only when given. Returns ``(residual_out, ffn_input)``.
    """
    op = "gated_residual_next_rmsnorm"
    _check_gated_next(
        op,
        branch,
        residual,
        next_weight,
        alpha,
        beta,
        post_eps,
        next_eps,
        residual_out,
        ffn_input,
        post_weight,
        router_input,
    )
    if residual_out is None:
        residual_out = torch.empty_like(residual)
    if ffn_input is None:
        ffn_input = torch.empty_like(branch)
    if branch.numel() == 0:
        return residual_out, ffn_input
    if choose_impl(op, impl, branch.device, _device_reason(branch)) == "reference":
        ro, ffn, router = ref.gated_residual_next_rmsnorm_reference(
            branch,
            residual,
            next_weight,
            alpha,
            beta,
            post_eps,
            next_eps,
            next_gain_center,
            post_weight,
            post_gain_center,
        )
        residual_out.copy_(ro)
        ffn_input.copy_(ffn)
        if router_input is not None:
            router_input.copy_(router)
        return residual_out, ffn_input
    alpha_t = alpha if isinstance(alpha, torch.Tensor) else None
    alpha_scalar = 1.0 if alpha_t is not None else float(alpha)
    ops.gated_residual_next_rmsnorm_op(
        branch,
        residual,
        next_weight,
        alpha_t,
        alpha_scalar,
        beta,
        post_weight,
        residual_out,
        ffn_input,
        router_input,
        float(post_eps),
        float(next_eps),
        float(next_gain_center),
        float(post_gain_center),
        resolve_pdl(enable_pdl, branch.device),
    )
    return residual_out, ffn_input


def supports_gated_residual_next_rmsnorm(
    branch, residual, next_weight, alpha, beta, *, post_weight=None
) -> bool:
    return _supported(
        _check_gated_next,
        "gated_residual_next_rmsnorm",
        branch,
        residual,
        next_weight,
        alpha,
        beta,
        1e-6,
        1e-6,
        None,
        None,
        post_weight,
        None,
    )


# ----------------------------------------------------------------------------- sigmoid gate
def _check_sigmoid_gate(op, input, gate, eps) -> None:
    v.check_tensor(op, "input", input, dtypes=HALF, ndims=(2, 3))
    v.check_tensor(op, "gate", gate, dtypes=(input.dtype,), shape=input.shape, device=input.device)
    v.check_no_overlap(op, "gate", gate, "input", input)
    v.check_eps(op, "eps", eps)


@fast_op
@v.checked(writes=("input",))
def rmsnorm_sigmoid_gate(input, gate, eps: float = 1e-5, *, enable_pdl=None, impl: str = "auto"):
    """Per-head RMSNorm times a sigmoid gate, in place on ``input`` (spec: rmsnorm_sigmoid_gate)::

        input <- cast((x * rsqrt(mean(x^2) + eps)) * sigmoid(f32(gate)))   # per row of length D

    ``input``, ``gate`` [rows, D] or [tokens, heads, D] BF16/FP16 (last dim contiguous, any row
    strides). The kernel evaluates the sigmoid as ``rcp.approx(exp2(-g * log2 e) + 1)``. Returns
    ``input``.
    """
    op = "rmsnorm_sigmoid_gate"
    _check_sigmoid_gate(op, input, gate, eps)
    if input.numel() == 0:
        return input
    if choose_impl(op, impl, input.device, _device_reason(input)) == "reference":
        input.copy_(ref.rmsnorm_sigmoid_gate_reference(input, gate, eps))
        return input
    ops.rmsnorm_sigmoid_gate_op(input, gate, float(eps), resolve_pdl(enable_pdl, input.device))
    return input


def supports_rmsnorm_sigmoid_gate(input, gate=None, eps: float = 1e-5) -> bool:
    """Strides and dtypes are part of the answer (FlashInfer checks them only at call time)."""
    return _supported(
        _check_sigmoid_gate,
        "rmsnorm_sigmoid_gate",
        input,
        gate if gate is not None else input.new_empty(input.shape),
        eps,
    )
