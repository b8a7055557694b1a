"""PyTorch reference of the RMSNorm family (spec: Norms) — the oracle and the CPU path.

Row statistics are reduced in FP64 and inverted with an exact ``1/sqrt`` (spec: Tests); everything
is FP32 elementwise math in the order the spec writes it, with one rounding at each store. These
functions are functional: they return new tensors and never mutate their arguments (the public ops
copy results into the in-place targets).
"""

from __future__ import annotations

import torch


def inv_rms(x32: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(row-sum(x*x) / H + eps)`` over the last dim, FP64 sum, as FP32 ``[..., 1]``."""
    h = x32.shape[-1]
    mean_sq = x32.double().square().sum(dim=-1, keepdim=True) / h
    return torch.rsqrt(mean_sq + eps).float()


def gain(weight: torch.Tensor, center: float) -> torch.Tensor:
    """``f32(weight) + center`` in FP32, never re-rounded."""
    return weight.float() + center


def rmsnorm_reference(
    input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, gain_center: float = 0.0
) -> torch.Tensor:
    """``cast((x * r) * (f32(weight) + gain_center))`` per row of ``input`` [..., H]."""
    x = input.float()
    return ((x * inv_rms(x, eps)) * gain(weight, gain_center)).to(input.dtype)


def fused_add_rmsnorm_reference(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    gain_center: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(normed, residual_out)``: ``h = f32(input) + f32(residual)`` (FP32),
    ``residual_out = cast(h)``, ``normed = cast((h * r) * g)`` with ``r`` from the UNROUNDED h."""
    h = input.float() + residual.float()
    normed = ((h * inv_rms(h, eps)) * gain(weight, gain_center)).to(input.dtype)
    return normed, h.to(residual.dtype)


def gated_residual_rmsnorm_reference(
    branch: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    eps: float = 1e-6,
    gain_center: float = 0.0,
) -> torch.Tensor:
    """FP32 ``alpha * residual + beta * (x * r)`` with ``x = f32(branch) [* (f32(weight) + c)]``."""
    x = branch.float()
    if weight is not None:
        x = x * gain(weight, gain_center)
    return alpha.float() * residual.float() + beta.float() * (x * inv_rms(x, eps))


def gated_residual_next_rmsnorm_reference(
    branch: torch.Tensor,
    residual: torch.Tensor,
    next_weight: torch.Tensor,
    alpha: torch.Tensor | float,
    beta: torch.Tensor,
    post_eps: float = 1e-6,
    next_eps: float = 1e-6,
    next_gain_center: float = 0.0,
    post_weight: torch.Tensor | None = None,
    post_gain_center: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(residual_out FP32, ffn_input, router_input FP32)`` (spec)::

    b = f32(branch) [* (f32(post_weight) + post_gain_center)]
    residual_out = u + (beta * b) * rsqrt(mean_sq(b) + post_eps),  u = alpha * residual
    router_input = (residual_out * rsqrt(mean_sq(residual_out) + next_eps)) * g_next
    ffn_input = cast(router_input)                     # the only rounding
    """
    b = branch.float()
    if post_weight is not None:
        b = b * gain(post_weight, post_gain_center)
    res = residual.float()
    if isinstance(alpha, torch.Tensor):
        u = alpha.float() * res
    elif float(alpha) == 1.0:
        u = res
    else:
        u = torch.tensor(float(alpha), dtype=torch.float32) * res
    residual_out = u + (beta.float() * b) * inv_rms(b, post_eps)
    router = (residual_out * inv_rms(residual_out, next_eps)) * gain(next_weight, next_gain_center)
    return residual_out, router.to(branch.dtype), router


def sigmoid_exact(gate: torch.Tensor) -> torch.Tensor:
    """``1 / (1 + exp(-f32(gate)))`` evaluated in FP64, rounded to FP32."""
    return torch.sigmoid(gate.double()).float()


def rmsnorm_sigmoid_gate_reference(
    input: torch.Tensor, gate: torch.Tensor, eps: float = 1e-5
) -> torch.Tensor:
    """``cast((x * r) * sigmoid(gate))`` per head row (last dim D) — new tensor."""
    x = input.float()
    return ((x * inv_rms(x, eps)) * sigmoid_exact(gate)).to(input.dtype)
