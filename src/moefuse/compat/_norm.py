"""FlashInfer's norm signatures (``flashinfer.norm``) mapped onto moefuse.

FlashInfer's names and positional order are moefuse's own for this family; these wrappers only
drop the ``impl`` keyword (always ``"auto"``) so code written against FlashInfer runs unchanged.
"""

from __future__ import annotations

import moefuse.norm as _norm

__all__ = [
    "rmsnorm",
    "gemma_rmsnorm",
    "fused_add_rmsnorm",
    "gemma_fused_add_rmsnorm",
    "gated_residual_rmsnorm",
    "gated_residual_next_rmsnorm",
    "rmsnorm_sigmoid_gate",
    "supports_gated_residual_rmsnorm",
    "supports_gated_residual_next_rmsnorm",
    "supports_rmsnorm_sigmoid_gate",
]


def rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    return _norm.rmsnorm(input, weight, eps, out, enable_pdl)


def gemma_rmsnorm(input, weight, eps=1e-6, out=None, enable_pdl=None):
    return _norm.gemma_rmsnorm(input, weight, eps, out, enable_pdl)


def fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    _norm.fused_add_rmsnorm(input, residual, weight, eps, enable_pdl)


def gemma_fused_add_rmsnorm(input, residual, weight, eps=1e-6, enable_pdl=None):
    _norm.gemma_fused_add_rmsnorm(input, residual, weight, eps, enable_pdl)


def gated_residual_rmsnorm(
    branch, residual, weight, alpha, beta, eps=1e-6, gain_center=0.0, out=None, enable_pdl=True
):
    return _norm.gated_residual_rmsnorm(
        branch, residual, weight, alpha, beta, eps, gain_center, out, enable_pdl
    )


def gated_residual_next_rmsnorm(
    branch,
    residual,
    next_weight,
    alpha,
    beta,
    post_eps=1e-6,
    next_eps=1e-6,
    next_gain_center=0.0,
    residual_out=None,
    ffn_input=None,
    *,
    post_weight=None,
    post_gain_center=0.0,
    enable_pdl=True,
):
    return _norm.gated_residual_next_rmsnorm(
        branch,
        residual,
        next_weight,
        alpha,
        beta,
        post_eps,
        next_eps,
        next_gain_center,
        residual_out,
        ffn_input,
        post_weight=post_weight,
        post_gain_center=post_gain_center,
        enable_pdl=enable_pdl,
    )


def rmsnorm_sigmoid_gate(input, gate, eps=1e-5, *, enable_pdl=None):
    return _norm.rmsnorm_sigmoid_gate(input, gate, eps, enable_pdl=enable_pdl)


def supports_gated_residual_rmsnorm(branch, residual, weight, alpha, beta):
    return _norm.supports_gated_residual_rmsnorm(branch, residual, weight, alpha, beta)


def supports_gated_residual_next_rmsnorm(
    branch, residual, next_weight, alpha, beta, *, post_weight=None
):
    return _norm.supports_gated_residual_next_rmsnorm(
        branch, residual, next_weight, alpha, beta, post_weight=post_weight
    )


def supports_rmsnorm_sigmoid_gate(dtype, head_dim, device=None) -> bool:
    """FlashInfer's form asks about dtype and head dim only; strides are checked at call time."""
    import torch

    if dtype not in (torch.bfloat16, torch.float16) or head_dim < 1:
        return False
    dev = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    from moefuse._runtime import kernel_device_reason

    return kernel_device_reason(dev) is None
