"""torch.library custom ops of the per-expert-norm MoE finalize fusions (spec:
tp_moe_finalize_rmsnorm, moe_finalize_rmsnorm_allreduce).

Same conventions as :mod:`moefuse.comm.all_reduce.ops`: each op writes the caller-allocated
``output`` and returns nothing (``mutates_args=("output",)``); the workspace travels as its integer
id; ``backend`` ("triton" | "reference") was chosen by :mod:`moefuse.comm.expert_norm.api`, and both
run inside the op, so torch.compile sees one opaque collective. The launchers are imported lazily
(TRITON_INTERPRET must be set before triton is imported).
"""

from __future__ import annotations

import torch

from moefuse._dispatch import custom_op
from moefuse.comm.expert_norm import reference as ref

Tensor = torch.Tensor


def _tp_execute(
    rows,
    weights,
    idx,
    norm_weight,
    output,
    ws_id,
    eps,
    gain_center,
    wbn,
    algorithm,
    use_pdl,
    backend,
) -> None:
    from moefuse.comm.expert_norm.workspace import get_expert_norm_workspace

    xws = get_expert_norm_workspace(ws_id)
    xws.ar.raise_if_unusable()
    if idx.shape[0] == 0:
        return
    if backend == "reference":
        output.copy_(
            ref.tp_moe_finalize_rmsnorm_reference(
                rows,
                weights,
                idx,
                norm_weight,
                group=xws.ar.group,
                world_size=xws.world_size,
                eps=eps,
                gain_center=gain_center,
                weight_before_norm=wbn,
            )
        )
        return
    from moefuse.comm.expert_norm.tp_kernels import launch_tp_moe_finalize_rmsnorm

    algo = xws.choose_algorithm(idx.shape[0], algorithm)
    gathered = None
    if algo == "torch":
        from moefuse.comm.fallback import gather_stacked

        gathered = gather_stacked(rows[:, : norm_weight.shape[0]], xws.ar)
    launch_tp_moe_finalize_rmsnorm(
        xws,
        algo,
        rows,
        weights,
        idx,
        norm_weight,
        output,
        eps=eps,
        gain_center=gain_center,
        weight_before_norm=wbn,
        use_pdl=use_pdl,
        gathered=gathered,
    )
    if xws.ar.check_each_call and algo != "torch":
        xws.ar.poll_status()


@custom_op("moefuse::tp_moe_finalize_rmsnorm", mutates_args=("output",))
def tp_moe_finalize_rmsnorm_op(
    gemm2_permuted: Tensor,
    expert_weights: Tensor,
    idx: Tensor,
    norm_weight: Tensor,
    output: Tensor,
    workspace_id: int,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    _tp_execute(
        gemm2_permuted,
        expert_weights,
        idx,
        norm_weight,
        output,
        workspace_id,
        eps,
        gain_center,
        weight_before_norm,
        algorithm,
        use_pdl,
        backend,
    )


@tp_moe_finalize_rmsnorm_op.register_fake
def _(
    gemm2_permuted,
    expert_weights,
    idx,
    norm_weight,
    output,
    workspace_id,
    eps,
    gain_center,
    weight_before_norm,
    algorithm,
    use_pdl,
    backend,
):
    return None


def _ep_execute(
    rows,
    weights,
    idx,
    norm_weight,
    output,
    ws_id,
    eps,
    gain_center,
    wbn,
    algorithm,
    use_pdl,
    backend,
) -> None:
    from moefuse.comm.workspace import get_workspace

    ws = get_workspace(ws_id)
    ws.raise_if_unusable()
    if idx.shape[0] == 0:
        return
    if backend == "reference":
        output.copy_(
            ref.moe_finalize_rmsnorm_allreduce_reference(
                rows,
                weights,
                idx,
                norm_weight,
                group=ws.group,
                world_size=ws.world_size,
                eps=eps,
                gain_center=gain_center,
                weight_before_norm=wbn,
            )
        )
        return
    from moefuse.comm.expert_norm.ep_kernels import launch_moe_finalize_rmsnorm_allreduce
    from moefuse.comm.fallback import gather_stacked

    algo = ws.choose_algorithm(idx.shape[0], algorithm)
    launch_moe_finalize_rmsnorm_allreduce(
        ws,
        algo,
        rows,
        weights,
        idx,
        norm_weight,
        output,
        eps=eps,
        gain_center=gain_center,
        weight_before_norm=wbn,
        use_pdl=use_pdl,
        gather=lambda x: gather_stacked(x, ws),
    )
    if ws.check_each_call and algo != "torch":
        ws.poll_status()


@custom_op("moefuse::moe_finalize_rmsnorm_allreduce", mutates_args=("output",))
def moe_finalize_rmsnorm_allreduce_op(
    routed_rows: Tensor,
    route_weights: Tensor,
    permuted_idx: Tensor,
    norm_weight: Tensor,
    output: Tensor,
    workspace_id: int,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    _ep_execute(
        routed_rows,
        route_weights,
        permuted_idx,
        norm_weight,
        output,
        workspace_id,
        eps,
        gain_center,
        weight_before_norm,
        algorithm,
        use_pdl,
        backend,
    )


@moe_finalize_rmsnorm_allreduce_op.register_fake
def _(
    routed_rows,
    route_weights,
    permuted_idx,
    norm_weight,
    output,
    workspace_id,
    eps,
    gain_center,
    weight_before_norm,
    algorithm,
    use_pdl,
    backend,
):
    return None
