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
