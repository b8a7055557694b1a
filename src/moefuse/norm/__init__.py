"""The fused RMSNorm family (spec: Norms): Triton kernels, references and ``supports_*`` helpers."""

from moefuse.norm.api import (
    fused_add_rmsnorm,
    gated_residual_next_rmsnorm,
    gated_residual_rmsnorm,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    rmsnorm,
    rmsnorm_sigmoid_gate,
    supports_fused_add_rmsnorm,
    supports_gated_residual_next_rmsnorm,
    supports_gated_residual_rmsnorm,
    supports_rmsnorm,
    supports_rmsnorm_sigmoid_gate,
)

__all__ = [
    "rmsnorm",
    "gemma_rmsnorm",
    "fused_add_rmsnorm",
    "gemma_fused_add_rmsnorm",
    "gated_residual_rmsnorm",
    "gated_residual_next_rmsnorm",
    "rmsnorm_sigmoid_gate",
    "supports_rmsnorm",
    "supports_fused_add_rmsnorm",
    "supports_gated_residual_rmsnorm",
    "supports_gated_residual_next_rmsnorm",
    "supports_rmsnorm_sigmoid_gate",
]
