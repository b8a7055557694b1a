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

# all-gather + norm fusions (SPEC §3.6, §3.7; issue 17)
from moefuse.comm.allgather_api import (  # noqa: E402
    all_gather_gated_residual_next_rmsnorm,
    all_gather_rmsnorm,
    all_gather_rmsnorm_fp4_quantize,
    all_gather_rmsnorm_fp8,
    supports_all_gather_gated_residual_next_rmsnorm,
    supports_all_gather_rmsnorm,
    supports_all_gather_rmsnorm_fp4_quantize,
    supports_all_gather_rmsnorm_fp8,
)
from moefuse.comm.allgather_ops import allgather_regions, prepare_allgather  # noqa: E402

__all__ += [
    "all_gather_gated_residual_next_rmsnorm",
    "all_gather_rmsnorm",
    "all_gather_rmsnorm_fp4_quantize",
    "all_gather_rmsnorm_fp8",
    "allgather_regions",
    "prepare_allgather",
    "supports_all_gather_gated_residual_next_rmsnorm",
    "supports_all_gather_rmsnorm",
    "supports_all_gather_rmsnorm_fp4_quantize",
    "supports_all_gather_rmsnorm_fp8",
]

# per-expert-norm MoE finalize fusions (SPEC §3.4, §3.5; issue 16 part B)
from moefuse.comm.expert_norm_api import (  # noqa: E402
    ExpertNormWorkspace,
    init_tp_moe_finalize_rmsnorm,
    moe_finalize_rmsnorm_allreduce,
    shutdown_tp_moe_finalize_rmsnorm,
    supports_moe_finalize_rmsnorm_allreduce,
    supports_tp_moe_finalize_rmsnorm,
    tp_moe_finalize_rmsnorm,
)

__all__ += [
    "ExpertNormWorkspace",
    "init_tp_moe_finalize_rmsnorm",
    "moe_finalize_rmsnorm_allreduce",
    "shutdown_tp_moe_finalize_rmsnorm",
    "supports_moe_finalize_rmsnorm_allreduce",
    "supports_tp_moe_finalize_rmsnorm",
    "tp_moe_finalize_rmsnorm",
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
