"""Communication fusions (SPEC §3): the peer-memory workspace and the all-reduce + residual +
RMSNorm (+ FP8 / NVFP4) family, one function per FlashInfer pattern."""

from moefuse.comm.api import (
    allreduce,
    allreduce_residual_rmsnorm,
    allreduce_residual_rmsnorm_fp8,
    allreduce_residual_rmsnorm_nvfp4,
    allreduce_residual_rmsnorm_out_fp8,
    allreduce_residual_rmsnorm_out_nvfp4,
    supports_allreduce,
    supports_allreduce_residual_rmsnorm,
    supports_allreduce_residual_rmsnorm_fp8,
    supports_allreduce_residual_rmsnorm_nvfp4,
)
from moefuse.comm.workspace import AllReduceWorkspace

__all__ = [
    "AllReduceWorkspace",
    "allreduce",
    "allreduce_residual_rmsnorm",
    "allreduce_residual_rmsnorm_fp8",
    "allreduce_residual_rmsnorm_out_fp8",
    "allreduce_residual_rmsnorm_nvfp4",
    "allreduce_residual_rmsnorm_out_nvfp4",
    "supports_allreduce",
    "supports_allreduce_residual_rmsnorm",
    "supports_allreduce_residual_rmsnorm_fp8",
    "supports_allreduce_residual_rmsnorm_nvfp4",
]

# MoE communication fusions (SPEC §3.2, §3.3)
from moefuse.comm.moe_fusion_api import (  # noqa: E402
    moe_allreduce_residual_rmsnorm,
    moe_finalize_allreduce_residual_rmsnorm,
    supports_moe_allreduce_residual_rmsnorm,
    supports_moe_finalize_allreduce_residual_rmsnorm,
)

__all__ += [
    "moe_allreduce_residual_rmsnorm",
    "moe_finalize_allreduce_residual_rmsnorm",
    "supports_moe_allreduce_residual_rmsnorm",
    "supports_moe_finalize_allreduce_residual_rmsnorm",
]
