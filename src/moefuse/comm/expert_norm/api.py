"""Public per-expert-norm MoE finalize fusions (spec: tp_moe_finalize_rmsnorm,
moe_finalize_rmsnorm_allreduce) and the TP workspace.

* :func:`tp_moe_finalize_rmsnorm` (TP): every rank holds partial GEMM2 rows ``[R, >=H]``
  (its shard of the intermediate dimension, permuted); each valid slot's P partial rows are summed
  in rank order (FP32, one BF16 rounding), RMS-normalized per expert, weighted and accumulated in
  FP32 in the canonical grouped order (groups of ``ceil(K/P)`` slots, ascending: depends on K and
  P only, never on M); output BF16 ``[M, H]`` replicated on every rank.
* :func:`moe_finalize_rmsnorm_allreduce` (EP): each rank normalizes, weights and sums its
  LOCAL routes (non-local: index < 0 or >= R, never loaded), rounds to BF16, and the ``[M, H]``
  partials are all-reduced in rank order (FP32, one rounding).

Both are collective: every rank calls with the same M, in the same order, never overlapping on one
workspace (CUDA-graph replays included). Common keywords: ``eps``, ``gain_center`` (0.0 plain,
1.0 for ``1 + w``), ``weight_before_norm`` (norm of ``x * g``; else ``(x * r) * g``),
``enable_pdl`` (None: where supported), ``impl`` ("auto" | "triton" | "reference", DESIGN.md).
``output`` is written (allocated when None) and returned; it must not overlap any input.
-0.0 results are written as +0.0 on every path (Lamport payloads cannot carry -0.0, and all
ranks and algorithms must agree bitwise).

Workspaces. tp_moe_finalize_rmsnorm uses an :class:`ExpertNormWorkspace` (an
:class:`AllReduceWorkspace` plus three peer regions): pass ``workspace=``, or call
:func:`init_tp_moe_finalize_rmsnorm` once (collective, FlashInfer's style) and the op creates and
keeps one per (H, K) at its first call — collectively, so warm every shape up before CUDA-graph
capture. moe_finalize_rmsnorm_allreduce takes an :class:`AllReduceWorkspace` (BF16, hidden H)
directly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, kernel_device_reason, resolve_pdl
from moefuse.comm.expert_norm import ops
from moefuse.comm.expert_norm.workspace import (  # noqa: F401 (public here as before)
    EXPERT_OWNER_MAX_TOKENS,
    SLOT_ONESHOT_MAX_ROWS,
    TOKEN_OWNER_LAMPORT_MAX_TOKENS,
    TP_ALGORITHMS,
    TP_DEFAULT_CAPACITY,
    TP_LAMPORT_BUDGET_BYTES,
    TP_SLOT_CAPACITY,
    ExpertNormWorkspace,
    expert_owner_max_tokens,
    get_expert_norm_workspace,
    slot_oneshot_max_rows,
)
from moefuse.comm.tiles import MAX_HIDDEN
from moefuse.comm.workspace import ALGORITHMS, AllReduceWorkspace, _collective_device

WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ----------------------------------------------------------------------------- process-wide
_TP_STATE: dict = {"group": None, "ok": False, "device": None, "options": {}, "spaces": {}}


def init_tp_moe_finalize_rmsnorm(group=None, *, device=None, **options) -> bool:
    """Collective, process-wide set-up of :func:`tp_moe_finalize_rmsnorm` (FlashInfer's call).

    Returns the same verdict on every rank (MIN vote): False unless the group has P >= 2 ranks and
    every rank can run the Triton kernels on ``device`` (default: the current CUDA device, else
    CPU). Workspaces are then created per (H, K) at the first call of each shape (collective:
    warm up before capture). ``options`` go to :class:`ExpertNormWorkspace` (``max_tokens``,
    ``timeout_s``, ``peer_access``, ``transport``). Calling again with the same group returns the
    first verdict; another group raises ``ValueError``."""
    if not dist.is_available() or not dist.is_initialized():
        return False
    group = group if group is not None else dist.group.WORLD
    if _TP_STATE["group"] is not None:
        if _TP_STATE["group"] is not group:
            raise ValueError(
                "moefuse.init_tp_moe_finalize_rmsnorm: already initialised with "
                "another group; call shutdown_tp_moe_finalize_rmsnorm() first"
            )
        return _TP_STATE["ok"]
    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    device = torch.device(device)
    local = dist.get_world_size(group) >= 2 and kernel_device_reason(device) is None
    t = torch.tensor(
        [1 if local else 0], dtype=torch.int32, device=_collective_device(group, device)
    )
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    _TP_STATE.update(
        group=group, ok=bool(t.item()), device=device, options=dict(options), spaces={}
    )
    return _TP_STATE["ok"]


def shutdown_tp_moe_finalize_rmsnorm() -> None:
    """Collective: close the process-wide workspaces and forget the group."""
    for xws in _TP_STATE["spaces"].values():
        xws.close()
    _TP_STATE.update(group=None, ok=False, device=None, options={}, spaces={})


def _process_workspace(op: str, hidden: int, top_k: int) -> ExpertNormWorkspace:
    if _TP_STATE["group"] is None:
        raise RuntimeError(
            f"moefuse.{op}: pass workspace= or call init_tp_moe_finalize_rmsnorm(group) first"
        )
    key = (hidden, top_k)
    xws = _TP_STATE["spaces"].get(key)
    if xws is None:
        dev = _TP_STATE["device"]
        # a trace cannot create it (collectives): dynamo then runs the frame eagerly (or fails
        # under fullgraph=True); once made, traced calls only look it up
        if torch.compiler.is_compiling() or (
            dev.type == "cuda" and torch.cuda.is_current_stream_capturing()
        ):
            raise RuntimeError(
                f"moefuse.{op}: first call for H={hidden}, K={top_k} during CUDA "
                "graph capture or torch.compile tracing; warm every shape up "
                "eagerly first"
            )
        xws = ExpertNormWorkspace(_TP_STATE["group"], hidden, top_k, dev, **_TP_STATE["options"])
        _TP_STATE["spaces"][key] = xws
    return xws


# ----------------------------------------------------------------------------- validation
def _check_routes(
    op, rows, weights, idx, norm_weight, output, eps, gain_center, wbn, rows_name, w_name, idx_name
) -> None:
    v.check_tensor(op, rows_name, rows, dtypes=(torch.bfloat16,), ndims=(2,))
    dev = rows.device
    v.check_tensor(op, idx_name, idx, dtypes=(torch.int32,), ndims=(2,), device=dev)
    m, k = idx.shape
    if k < 1:
        raise ValueError(f"moefuse.{op}: argument '{idx_name}' must have K >= 1 columns")
    v.check_tensor(op, w_name, weights, dtypes=WEIGHT_DTYPES, shape=(m, k), device=dev)
    v.check_tensor(op, "norm_weight", norm_weight, dtypes=(torch.bfloat16,), ndims=(1,), device=dev)
    h = norm_weight.shape[0]
    if h < 1 or h > MAX_HIDDEN:
        raise ValueError(
            f"moefuse.{op}: argument 'norm_weight' must have 1 <= H <= {MAX_HIDDEN}, got {h}"
        )
    if rows.shape[1] < h:
        raise ValueError(
            f"moefuse.{op}: argument '{rows_name}' must have at least H={h} "
            f"columns, got {tuple(rows.shape)}"
        )
    if output is not None:
        v.check_tensor(op, "output", output, dtypes=(torch.bfloat16,), shape=(m, h), device=dev)
        for name, t in (
            (rows_name, rows),
            (w_name, weights),
            (idx_name, idx),
            ("norm_weight", norm_weight),
        ):
            v.check_no_overlap(op, "output", output, name, t)
    v.check_eps(op, "eps", eps)
    v.check_real(op, "gain_center", gain_center)
    if not isinstance(wbn, bool):
        raise ValueError(f"moefuse.{op}: argument 'weight_before_norm' must be a bool, got {wbn!r}")


def _check_tp(
    op,
    gemm2_permuted,
    expert_weights,
    idx,
    norm_weight,
    output,
    eps,
    gain_center,
    wbn,
    workspace,
    algorithm,
) -> None:
    _check_routes(
        op,
        gemm2_permuted,
        expert_weights,
        idx,
        norm_weight,
        output,
        eps,
        gain_center,
        wbn,
        "gemm2_permuted",
        "expert_weights",
        "expanded_idx_to_permuted_idx",
    )
    if algorithm not in TP_ALGORITHMS:
        raise ValueError(
            f"moefuse.{op}: argument 'algorithm' must be one of {TP_ALGORITHMS}, got {algorithm!r}"
        )
    if workspace is not None:
        _check_tp_workspace(
            op, workspace, norm_weight.shape[0], idx.shape[1], gemm2_permuted.device
        )


def _check_tp_workspace(op, workspace, hidden, top_k, device) -> None:
    if not isinstance(workspace, ExpertNormWorkspace):
        raise ValueError(
            f"moefuse.{op}: argument 'workspace' must be an ExpertNormWorkspace, "
            f"got {type(workspace).__name__}"
        )
    if (workspace.hidden_size, workspace.top_k) != (hidden, top_k):
        raise ValueError(
            f"moefuse.{op}: argument 'workspace' was created for (H, K) = "
            f"({workspace.hidden_size}, {workspace.top_k}), got ({hidden}, "
            f"{top_k})"
        )
    if workspace.device != device:
        raise ValueError(
            f"moefuse.{op}: argument 'workspace' is on {workspace.device}, the tensors on {device}"
        )


# --------------------------------------------------------------------- tp_moe_finalize_rmsnorm (TP)
@fast_op(guards=("workspace",))
@v.checked(writes=("output",))
def tp_moe_finalize_rmsnorm(
    gemm2_permuted,
    expert_weights,
    expanded_idx_to_permuted_idx,
    norm_weight,
    output=None,
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
    workspace=None,
    algorithm: str = "auto",
    enable_pdl=None,
    impl: str = "auto",
):
    """TP MoE finalize with a per-expert RMSNorm (the spec's tp_moe_finalize_rmsnorm); returns
    ``output``.

    Shapes/dtypes: ``gemm2_permuted`` [R, >=H] BF16 (this rank's partial rows; only the first H
    columns are read; last dim contiguous), ``expert_weights`` [M, K] BF16/FP16/FP32,
    ``expanded_idx_to_permuted_idx`` [M, K] int32 (invalid: < 0 or >= R, rows never read),
    ``norm_weight`` [H] BF16, ``output`` [M, H] BF16 (written; replicated). Math (per token)::

        x_k = f32(bf16(sum_r f32(partial_r[idx[t,k], :H])))       rank order, FP32, one rounding
        y_k = per-expert RMSNorm of x_k (weight_before_norm: norm of x_k * g, g = w + gain_center)
        out = sum_{groups j asc} (fma chain over group j's valid slots of y_k * w[t,k])
        output[t] = bf16(out)                                       (B = ceil(K/P) per group)

    ``algorithm``: "auto" ("slot_oneshot" while M * K <= :data:`SLOT_ONESHOT_MAX_ROWS`[P], expert
    owner for M <= :data:`EXPERT_OWNER_MAX_TOKENS`, Lamport token owner up to
    :data:`TOKEN_OWNER_LAMPORT_MAX_TOKENS`, staged above), "slot_oneshot" (one CTA per (token,
    slot) row, one-shot push to every peer, token folded locally), "expert_owner",
    "token_owner" (Lamport peer stores), "staged" (token owner, push + flag barriers) or "torch"
    (all-gather of the rows + local kernel); all give the same bits. ``workspace``: an
    :class:`ExpertNormWorkspace`, or None for the process-wide one of
    :func:`init_tp_moe_finalize_rmsnorm`.
    """
    op = "tp_moe_finalize_rmsnorm"
    idx = expanded_idx_to_permuted_idx
    _check_tp(
        op,
        gemm2_permuted,
        expert_weights,
        idx,
        norm_weight,
        output,
        eps,
        gain_center,
        weight_before_norm,
        workspace,
        algorithm,
    )
    m, h = idx.shape[0], norm_weight.shape[0]
    if output is None:
        output = torch.empty((m, h), dtype=torch.bfloat16, device=gemm2_permuted.device)
    if m == 0:
        return output
    if workspace is None:
        workspace = _process_workspace(op, h, idx.shape[1])
        _check_tp_workspace(op, workspace, h, idx.shape[1], gemm2_permuted.device)
    backend = choose_impl(op, impl, gemm2_permuted.device, workspace.unsupported_reason())
    ops.tp_moe_finalize_rmsnorm_op(
        gemm2_permuted,
        expert_weights,
        idx,
        norm_weight,
        output,
        workspace.id,
        float(eps),
        float(gain_center),
        weight_before_norm,
        algorithm,
        resolve_pdl(enable_pdl, gemm2_permuted.device),
        backend,
    )
    return output


def supports_tp_moe_finalize_rmsnorm(
    gemm2_permuted,
    expert_weights,
    expanded_idx_to_permuted_idx,
    norm_weight,
    output=None,
    *,
    workspace=None,
) -> bool:
    """Local answer, no side effects (combine across ranks with a MIN vote before capture): the
    arguments are acceptable, a workspace exists (``workspace=`` or a successful
    :func:`init_tp_moe_finalize_rmsnorm`) and the Triton kernels can run on the device."""
    op = "tp_moe_finalize_rmsnorm"
    if not v.accepts(
        _check_tp,
        op,
        gemm2_permuted,
        expert_weights,
        expanded_idx_to_permuted_idx,
        norm_weight,
        output,
        1e-6,
        0.0,
        True,
        workspace,
        "auto",
    ):
        return False
    if workspace is None:
        if not _TP_STATE["ok"] or _TP_STATE["device"] != gemm2_permuted.device:
            return False
        return kernel_device_reason(gemm2_permuted.device) is None
    return workspace.unsupported_reason() is None


# -------------------------------------------------------------- moe_finalize_rmsnorm_allreduce (EP)
def _check_ep(
    op,
    routed_rows,
    route_weights,
    permuted_idx,
    norm_weight,
    output,
    workspace,
    eps,
    gain_center,
    wbn,
    algorithm,
) -> None:
    _check_routes(
        op,
        routed_rows,
        route_weights,
        permuted_idx,
        norm_weight,
        output,
        eps,
        gain_center,
        wbn,
        "routed_rows",
        "route_weights",
        "permuted_idx",
    )
    if not isinstance(workspace, AllReduceWorkspace):
        raise ValueError(
            f"moefuse.{op}: argument 'workspace' must be an AllReduceWorkspace, "
            f"got {type(workspace).__name__}"
        )
    if workspace.dtype != torch.bfloat16 or workspace.hidden_size != norm_weight.shape[0]:
        raise ValueError(
            f"moefuse.{op}: argument 'workspace' must be a BF16 workspace of hidden "
            f"size {norm_weight.shape[0]}, got {workspace.dtype} / "
            f"{workspace.hidden_size}"
        )
    if workspace.device != routed_rows.device:
        raise ValueError(
            f"moefuse.{op}: argument 'workspace' is on {workspace.device}, the "
            f"tensors on {routed_rows.device}"
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"moefuse.{op}: argument 'algorithm' must be one of {ALGORITHMS}, got {algorithm!r}"
        )


@fast_op(guards=("workspace",))
@v.checked(writes=("output",))
def moe_finalize_rmsnorm_allreduce(
    routed_rows,
    route_weights,
    permuted_idx,
    norm_weight,
    output=None,
    *,
    workspace,
    eps: float,
    gain_center: float = 0.0,
    weight_before_norm: bool = True,
    algorithm: str = "auto",
    enable_pdl=None,
    impl: str = "auto",
):
    """EP MoE finalize with a per-expert RMSNorm, then all-reduce (the spec's
    moe_finalize_rmsnorm_allreduce); returns ``output``.

    ``routed_rows`` [R, >=H] BF16 (this rank's local expert rows, permuted), ``route_weights``
    [M, K] BF16/FP16/FP32, ``permuted_idx`` [M, K] int32 (routes of other ranks are < 0 or >= R
    here: skipped, never loaded), ``norm_weight`` [H] BF16, ``output`` [M, H] BF16 (written,
    replicated). Per rank ``partial = scrub(bf16(fma chain over local valid slots of
    y_k * w[t,k]))``; ``output = bf16(sum_r f32(partial_r))`` (rank order, FP32, one rounding).
    ``workspace``: a BF16 :class:`AllReduceWorkspace` of hidden size H; ``algorithm`` is its
    all-reduce algorithm ("auto" | "oneshot" | "twoshot" | "torch", same bits).
    """
    op = "moe_finalize_rmsnorm_allreduce"
    _check_ep(
        op,
        routed_rows,
        route_weights,
        permuted_idx,
        norm_weight,
        output,
        workspace,
        eps,
        gain_center,
        weight_before_norm,
        algorithm,
    )
    m, h = permuted_idx.shape[0], norm_weight.shape[0]
    if output is None:
        output = torch.empty((m, h), dtype=torch.bfloat16, device=routed_rows.device)
    if m == 0:
        return output
    backend = choose_impl(op, impl, routed_rows.device, workspace.unsupported_reason(output))
    ops.moe_finalize_rmsnorm_allreduce_op(
        routed_rows,
        route_weights,
        permuted_idx,
        norm_weight,
        output,
        workspace.id,
        float(eps),
        float(gain_center),
        weight_before_norm,
        algorithm,
        resolve_pdl(enable_pdl, routed_rows.device),
        backend,
    )
    return output


def supports_moe_finalize_rmsnorm_allreduce(
    workspace, routed_rows, route_weights, permuted_idx, norm_weight, output
) -> bool:
    """Local answer, no side effects (FlashInfer's argument order): ``1 <= M <= max_tokens``,
    shapes/dtypes as :func:`moe_finalize_rmsnorm_allreduce`, on the workspace device, kernels
    runnable there. Combine across ranks with ``workspace.vote``."""
    op = "moe_finalize_rmsnorm_allreduce"
    if not v.accepts(
        _check_ep,
        op,
        routed_rows,
        route_weights,
        permuted_idx,
        norm_weight,
        output,
        workspace,
        1e-6,
        0.0,
        True,
        "auto",
    ):
        return False
    if output is None or output.shape[0] < 1:
        return False
    return workspace.unsupported_reason(output) is None
