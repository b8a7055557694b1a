"""References of the all-gather + norm fusions (spec: all_gather_gated_residual_next_rmsnorm,
all_gather_rmsnorm_fp4_quantize), and the column all-gather of the torch.distributed path.

Each reference gathers the column shards with torch.distributed (exact: no arithmetic) and runs
the single-GPU op's reference on the full rows, which is the definition of these ops: "concat
the shards in rank order along dim 1, then gated_residual_next_rmsnorm / rmsnorm /
rmsnorm_fp4_quantize". Collective: every rank calls them with the same M. Runs on CPU (gloo) and on
GPU (NCCL).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moefuse._fastpath import note_impure
from moefuse.norm import reference as norm_ref
from moefuse.quant import reference as quant_ref


def gather_columns(shard: torch.Tensor, workspace, out: torch.Tensor | None = None) -> torch.Tensor:
    """All-gather every rank's ``shard`` [M, S] into the rows ``[M, P*S]`` (rank r's columns at
    ``[r*S, (r+1)*S)``). ``out``, when given, is an [M, P*S] tensor with contiguous rows that
    receives them (else a new contiguous tensor)."""
    x = shard.contiguous()
    m, s = x.shape
    p = workspace.world_size
    stacked = torch.empty((p, m, s), dtype=x.dtype, device=x.device)
    backend = str(dist.get_backend(workspace.group)).lower()
    note_impure("a torch.distributed all-gather")
    if x.is_cuda and "nccl" in backend:
        dist.all_gather_into_tensor(stacked, x, group=workspace.group)
    else:
        dist.all_gather(list(stacked.unbind(0)), x, group=workspace.group)
    rows = stacked.permute(1, 0, 2).reshape(m, p * s) if out is None else None
    if out is None:
        return rows.contiguous()
    out.view(m, p, s).copy_(stacked.permute(1, 0, 2))
    return out


def all_gather_rmsnorm_reference(shard, weight, *, workspace, eps=1e-6, gain_center=0.0):
    """``rmsnorm_reference(gather(shard), weight, eps, gain_center)``, in the shard dtype."""
    return norm_ref.rmsnorm_reference(gather_columns(shard, workspace), weight, eps, gain_center)


def all_gather_rmsnorm_fp8_reference(
    shard, weight, scale, *, workspace, eps=1e-6, gain_center=0.0, dtype=torch.float8_e4m3fn
):
    """``rmsnorm_quant_reference`` of the gathered rows (FP8 of the unrounded norm output)."""
    return quant_ref.rmsnorm_quant_reference(
        gather_columns(shard, workspace), weight, scale, eps, dtype, gain_center
    )


def all_gather_rmsnorm_fp4_quantize_reference(
    shard,
    weight,
    global_scale,
    *,
    workspace,
    eps=1e-6,
    gain_center=0.0,
    layout="linear",
    recipe="fast",
):
    """``rmsnorm_fp4_quantize_reference`` of the gathered rows: ``(packed, scales, norm_out)``."""
    return quant_ref.rmsnorm_fp4_quantize_reference(
        gather_columns(shard, workspace), weight, global_scale, eps, layout, recipe, gain_center
    )


def all_gather_gated_residual_next_rmsnorm_reference(
    branch_shard,
    residual,
    alpha,
    beta,
    next_weight,
    *,
    workspace,
    post_eps=1e-6,
    next_eps=1e-6,
    next_gain_center=0.0,
    post_weight=None,
    post_gain_center=0.0,
):
    """``gated_residual_next_rmsnorm_reference`` of the gathered branch (``residual`` and the
    parameters are replicated, full width).

    Returns ``(residual_out FP32, ffn_input, router_input FP32)``."""
    return norm_ref.gated_residual_next_rmsnorm_reference(
        gather_columns(branch_shard, workspace),
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
