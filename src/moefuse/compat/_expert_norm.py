"""FlashInfer's per-expert-norm MoE finalize calls mapped onto moefuse (spec: same names).

``moefuse.compat.flashinfer`` re-exports these names.

* ``init_tp_moe_finalize_rmsnorm(group=None)``, ``supports_tp_moe_finalize_rmsnorm(...)``,
  ``tp_moe_finalize_rmsnorm(gemm2_permuted, expert_weights, expanded_idx_to_permuted_idx,
  norm_weight, output, *, eps, gain_center, weight_before_norm)``: moefuse's own functions, whose
  signatures already accept FlashInfer's calls (moefuse adds keywords only). Differences: any H,
  K and P >= 2, SM90+, no multicast, batch-invariant grouping (spec: tp_moe_finalize_rmsnorm).
* :class:`MNNVLCuteDSLMoEFinalizeAllReduceWorkspace` and ``moe_finalize_rmsnorm_allreduce(
  routed_rows, route_weights, permuted_idx, norm_weight, output, workspace, *, eps, ...)``:
  FlashInfer's workspace lifecycle (ctor, ``compile``, ``check_support``, ``destroy``) on top of
  :class:`moefuse.comm.AllReduceWorkspace`. ``hidden_dim`` need not be a multiple of 1024.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moefuse.comm import AllReduceWorkspace
from moefuse.comm.expert_norm import api
from moefuse.comm.expert_norm.api import (
    init_tp_moe_finalize_rmsnorm,
    supports_tp_moe_finalize_rmsnorm,
    tp_moe_finalize_rmsnorm,
)

__all__ = [
    "MNNVLCuteDSLMoEFinalizeAllReduceWorkspace",
    "init_tp_moe_finalize_rmsnorm",
    "moe_finalize_rmsnorm_allreduce",
    "supports_moe_finalize_rmsnorm_allreduce",
    "supports_tp_moe_finalize_rmsnorm",
    "tp_moe_finalize_rmsnorm",
]


class MNNVLCuteDSLMoEFinalizeAllReduceWorkspace:
    """FlashInfer's EP finalize + per-expert RMSNorm + all-reduce workspace (collective).

    ``(tp_size, tp_rank, max_token_num, hidden_dim, top_k, *, group, enable_pdl=True)``; moefuse
    adds ``device`` (default: the current CUDA device, else CPU) and ``timeout_s``. ``tp_size`` and
    ``tp_rank`` must match the group. ``compile(...)`` records the call's constants (moefuse
    compiles per shape lazily; warm up before capture); ``check_support(local)`` is the MIN vote;
    ``destroy()`` = device sync + barrier (required)."""

    def __init__(
        self,
        tp_size: int,
        tp_rank: int,
        max_token_num: int,
        hidden_dim: int,
        top_k: int,
        *,
        group=None,
        enable_pdl: bool = True,
        device=None,
        timeout_s: float | None = None,
    ):
        g = group if group is not None else dist.group.WORLD
        if tp_size < 2 or tp_size != dist.get_world_size(g) or tp_rank != dist.get_rank(g):
            raise ValueError(
                f"MNNVLCuteDSLMoEFinalizeAllReduceWorkspace: tp_size/tp_rank "
                f"({tp_size}, {tp_rank}) do not match the group "
                f"({dist.get_world_size(g)}, {dist.get_rank(g)})"
            )
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(
                f"MNNVLCuteDSLMoEFinalizeAllReduceWorkspace: top_k must be a "
                f"positive int, got {top_k!r}"
            )
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.top_k = top_k
        self.enable_pdl = bool(enable_pdl)
        self.workspace = AllReduceWorkspace(
            g, max_token_num, hidden_dim, torch.bfloat16, device, timeout_s=timeout_s
        )
        self.compiled: dict | None = None

    def compile(
        self,
        row_stride: int,
        weight_dtype: torch.dtype,
        eps: float,
        gain_center: float = 0.0,
        weight_before_norm: bool = True,
    ) -> None:
        if weight_dtype not in api.WEIGHT_DTYPES:
            raise ValueError(
                f"compile: weight_dtype must be one of {api.WEIGHT_DTYPES}, got {weight_dtype}"
            )
        if row_stride < self.workspace.hidden_size:
            raise ValueError(
                f"compile: row_stride {row_stride} < hidden_dim {self.workspace.hidden_size}"
            )
        self.compiled = dict(
            row_stride=int(row_stride),
            weight_dtype=weight_dtype,
            eps=float(eps),
            gain_center=float(gain_center),
            weight_before_norm=bool(weight_before_norm),
        )

    def check_support(self, local_ok: bool) -> bool:
        return self.workspace.vote(bool(local_ok))

    def destroy(self) -> None:
        self.workspace.close()


def _ar_workspace(workspace) -> AllReduceWorkspace:
    if isinstance(workspace, MNNVLCuteDSLMoEFinalizeAllReduceWorkspace):
        return workspace.workspace
    return workspace


def supports_moe_finalize_rmsnorm_allreduce(
    workspace, routed_rows, route_weights, permuted_idx, norm_weight, output
) -> bool:
    return api.supports_moe_finalize_rmsnorm_allreduce(
        _ar_workspace(workspace), routed_rows, route_weights, permuted_idx, norm_weight, output
    )


def moe_finalize_rmsnorm_allreduce(
    routed_rows,
    route_weights,
    permuted_idx,
    norm_weight,
    output,
    workspace,
    *,
    eps=None,
    gain_center=None,
    weight_before_norm=None,
    enable_pdl=None,
):
    """FlashInfer's call; ``eps`` / ``gain_center`` / ``weight_before_norm`` default to the
    values given to ``workspace.compile`` (``eps`` is required one way or the other)."""
    consts = {}
    if isinstance(workspace, MNNVLCuteDSLMoEFinalizeAllReduceWorkspace):
        consts = workspace.compiled or {}
    eps = consts.get("eps") if eps is None else eps
    if eps is None:
        raise ValueError("moe_finalize_rmsnorm_allreduce: argument 'eps' is required")
    gain_center = consts.get("gain_center", 0.0) if gain_center is None else gain_center
    if weight_before_norm is None:
        weight_before_norm = consts.get("weight_before_norm", True)
    if enable_pdl is None and isinstance(workspace, MNNVLCuteDSLMoEFinalizeAllReduceWorkspace):
        enable_pdl = workspace.enable_pdl
    return api.moe_finalize_rmsnorm_allreduce(
        routed_rows,
        route_weights,
        permuted_idx,
        norm_weight,
        output,
        workspace=_ar_workspace(workspace),
        eps=eps,
        gain_center=gain_center,
        weight_before_norm=weight_before_norm,
        enable_pdl=enable_pdl,
    )
