"""FlashInfer's all-gather + norm call styles (spec: All-gather fusions) mapped onto moefuse.comm.

``moefuse.compat.flashinfer`` re-exports these names. Differences from FlashInfer:

* The workspaces wrap a :class:`moefuse.comm.AllReduceWorkspace` (``.workspace``) with the
  all-gather region; unicast peer stores, no multicast, SM90+. ``tuning`` is accepted and
  ignored (tiles are functions of H). The group must be a torch.distributed group (keyword
  ``group``, None = WORLD); ``device`` (keyword, moefuse extension) defaults to the current CUDA
  device, or ``cpu`` without CUDA (then the kernels run in Triton's interpreter).
* ``compile(...)`` records the constants and allocates the per-dtype buffer (moefuse kernels are
  specialised by Triton at the first call); calls whose constants differ from the compiled ones
  raise ``ValueError`` naming the argument, as calling a differently compiled FlashInfer kernel
  would be wrong.
* Any H with ``H % P == 0`` (NVFP4: also ``H % 16 == 0``), any M up to ``max_token_num``.
"""

from __future__ import annotations

import torch

from moefuse import comm

__all__ = [
    "MNNVLCuteDSLAllGatherDualNormWorkspace",
    "MNNVLCuteDSLAllGatherNormQuantWorkspace",
    "all_gather_gated_residual_next_rmsnorm",
    "all_gather_rmsnorm_fp4_quantize",
    "supports_all_gather_gated_residual_next_rmsnorm",
    "supports_all_gather_rmsnorm_fp4_quantize",
]


class _AllGatherWorkspace:
    """Collective; ``destroy()`` is required (collective too)."""

    _NAME = "MNNVLCuteDSLAllGatherWorkspace"

    def __init__(
        self,
        tp_size: int,
        tp_rank: int,
        max_token_num: int,
        hidden_dim: int,
        *,
        group=None,
        tuning=None,
        device=None,
    ):
        import torch.distributed as dist

        group = group if group is not None else dist.group.WORLD
        if not isinstance(tp_size, int) or tp_size < 2 or tp_size != dist.get_world_size(group):
            raise ValueError(
                f"{self._NAME}: argument 'tp_size' must be the group size "
                f"{dist.get_world_size(group)} (>= 2), got {tp_size!r}"
            )
        if tp_rank != dist.get_rank(group):
            raise ValueError(
                f"{self._NAME}: argument 'tp_rank' must be this rank's group rank "
                f"{dist.get_rank(group)}, got {tp_rank!r}"
            )
        if not isinstance(hidden_dim, int) or hidden_dim < 1 or hidden_dim % tp_size:
            raise ValueError(
                f"{self._NAME}: argument 'hidden_dim' must be a positive multiple of "
                f"tp_size, got {hidden_dim!r}"
            )
        if device is None:
            device = (
                torch.device("cuda", torch.cuda.current_device())
                if torch.cuda.is_available()
                else torch.device("cpu")
            )
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.max_token_num, self.hidden_dim = max_token_num, hidden_dim
        self.tuning = tuning
        self.workspace = comm.AllReduceWorkspace(
            group,
            max_token_num,
            hidden_dim,
            torch.bfloat16,
            device,
            oneshot_max_tokens=1,
            extra_regions=comm.allgather_regions(max_token_num, hidden_dim),
        )
        self.compiled: dict | None = None

    def _compile(self, **constants) -> None:
        comm.prepare_allgather(self.workspace, torch.bfloat16)
        self.compiled = dict(constants)

    def _check_compiled(self, op: str, **constants) -> None:
        if self.compiled is None:
            return
        for name, value in constants.items():
            if self.compiled.get(name, value) != value:
                raise ValueError(
                    f"{op}: argument '{name}' is {value!r} but the workspace was "
                    f"compiled with {self.compiled[name]!r}"
                )

    def check_support(self) -> bool:
        """True when the fused peer-memory path can run here (collective vote of all ranks)."""
        ws = self.workspace
        ok = ws.peer_access and comm.all_gather.ops.region_reason(ws) is None
        return ws.vote(ok)

    def fits(self, shard: torch.Tensor) -> bool:
        return (
            isinstance(shard, torch.Tensor)
            and shard.dim() == 2
            and 1 <= shard.shape[0] <= self.max_token_num
            and shard.shape[1] * self.tp_size == self.hidden_dim
        )

    def destroy(self) -> None:
        self.workspace.close()


class MNNVLCuteDSLAllGatherDualNormWorkspace(_AllGatherWorkspace):
    """Workspace of :func:`all_gather_gated_residual_next_rmsnorm` (spec: All-gather fusions)."""

    _NAME = "MNNVLCuteDSLAllGatherDualNormWorkspace"

    def compile(
        self,
        post_eps: float,
        next_eps: float,
        next_gain_center: float = 0.0,
        has_post_weight: bool = False,
        post_gain_center: float = 0.0,
    ) -> None:
        self._compile(
            post_eps=float(post_eps),
            next_eps=float(next_eps),
            next_gain_center=float(next_gain_center),
            has_post_weight=bool(has_post_weight),
            post_gain_center=float(post_gain_center),
        )


class MNNVLCuteDSLAllGatherNormQuantWorkspace(_AllGatherWorkspace):
    """Workspace of :func:`all_gather_rmsnorm_fp4_quantize` (spec: All-gather fusions)."""

    _NAME = "MNNVLCuteDSLAllGatherNormQuantWorkspace"

    def compile(self, eps: float, gain_center: float = 0.0) -> None:
        self._compile(eps=float(eps), gain_center=float(gain_center))


def _ws(op: str, workspace, cls) -> comm.AllReduceWorkspace:
    if not isinstance(workspace, cls):
        raise ValueError(
            f"{op}: argument 'workspace' must be a {cls.__name__}, got {type(workspace).__name__}"
        )
    return workspace.workspace


def all_gather_gated_residual_next_rmsnorm(
    branch_shard,
    residual,
    alpha,
    beta,
    next_weight,
    workspace,
    *,
    post_eps: float,
    next_eps: float,
    next_gain_center: float = 0.0,
    post_weight=None,
    post_gain_center: float = 0.0,
    impl: str = "auto",
):
    """FlashInfer's call: returns freshly allocated ``(residual_out FP32, ffn_input BF16)``."""
    op = "all_gather_gated_residual_next_rmsnorm"
    ws = _ws(op, workspace, MNNVLCuteDSLAllGatherDualNormWorkspace)
    workspace._check_compiled(
        op,
        post_eps=float(post_eps),
        next_eps=float(next_eps),
        next_gain_center=float(next_gain_center),
        has_post_weight=post_weight is not None,
        post_gain_center=float(post_gain_center),
    )
    return comm.all_gather_gated_residual_next_rmsnorm(
        branch_shard,
        residual,
        alpha,
        beta,
        next_weight,
        workspace=ws,
        post_eps=post_eps,
        next_eps=next_eps,
        next_gain_center=next_gain_center,
        post_weight=post_weight,
        post_gain_center=post_gain_center,
        impl=impl,
    )


def supports_all_gather_gated_residual_next_rmsnorm(
    workspace, branch_shard, residual, alpha, beta, next_weight, post_weight=None
) -> bool:
    if not isinstance(workspace, MNNVLCuteDSLAllGatherDualNormWorkspace):
        return False
    return comm.supports_all_gather_gated_residual_next_rmsnorm(
        branch_shard,
        residual,
        alpha,
        beta,
        next_weight,
        workspace=workspace.workspace,
        post_weight=post_weight,
    )


def all_gather_rmsnorm_fp4_quantize(
    shard,
    weight,
    global_scale,
    workspace,
    *,
    eps: float,
    gain_center: float = 0.0,
    impl: str = "auto",
):
    """FlashInfer's call: returns ``(packed uint8 [M, H/2], scales uint8 [M, H/16])``, LINEAR
    scales, recipe "fast" (spec: All-gather fusions)."""
    op = "all_gather_rmsnorm_fp4_quantize"
    ws = _ws(op, workspace, MNNVLCuteDSLAllGatherNormQuantWorkspace)
    workspace._check_compiled(op, eps=float(eps), gain_center=float(gain_center))
    return comm.all_gather_rmsnorm_fp4_quantize(
        shard,
        weight,
        global_scale,
        workspace=ws,
        eps=eps,
        gain_center=gain_center,
        layout="linear",
        recipe="fast",
        impl=impl,
    )


def supports_all_gather_rmsnorm_fp4_quantize(workspace, shard, weight, global_scale) -> bool:
    if not isinstance(workspace, MNNVLCuteDSLAllGatherNormQuantWorkspace):
        return False
    return comm.supports_all_gather_rmsnorm_fp4_quantize(
        shard, weight, global_scale, workspace=workspace.workspace
    )
