"""Communication fusions: the peer-memory workspace and four families of collective ops.

The shared core (``workspace``, ``transport``, ``faults``, ``fallback``, ``tiles`` and the
device functions of ``device``) serves four families, each with ``api`` / ``ops`` / kernels /
``reference`` faces, none importing another:

* ``all_reduce`` — all-reduce, + residual + RMSNorm, + FP8 / NVFP4 quantization;
* ``all_gather`` — all-gather + RMSNorm (+ FP8 / NVFP4, gated residual next norm);
* ``moe_reduction`` — MoE reduction / MoE finalize + all-reduce + residual + RMSNorm (+ quant);
* ``expert_norm`` — MoE finalize with a per-expert RMSNorm, tensor- and expert-parallel.

This package exports the public names only."""

from moefuse.comm.all_reduce.api import (
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

from moefuse.comm.all_gather.api import (  # noqa: E402
    all_gather_gated_residual_next_rmsnorm,
    all_gather_rmsnorm,
    all_gather_rmsnorm_fp4_quantize,
    all_gather_rmsnorm_fp8,
    supports_all_gather_gated_residual_next_rmsnorm,
    supports_all_gather_rmsnorm,
    supports_all_gather_rmsnorm_fp4_quantize,
    supports_all_gather_rmsnorm_fp8,
)
from moefuse.comm.all_gather.ops import allgather_regions, prepare_allgather  # noqa: E402

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

from moefuse.comm.expert_norm.api import (  # noqa: E402
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

from moefuse.comm.moe_reduction.api import (  # noqa: E402
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

# the expert-parallel expert-norm op all-reduces its normed partial rows with the all-reduce
# family's launcher; families do not import each other, so it is handed over here, imported on
# first use (the kernel module imports Triton)
from moefuse.comm import expert_norm as _expert_norm  # noqa: E402


def _launch_allreduce(*args, **kwargs):
    from moefuse.comm.all_reduce.kernels import launch_allreduce_fusion

    return launch_allreduce_fusion(*args, **kwargs)


_expert_norm.ALLREDUCE[0] = _launch_allreduce
del _expert_norm
