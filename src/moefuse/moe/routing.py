"""Routing helpers: the tensors a real MoE layer hands to the expert GEMMs and to the finalize.

All of it is torch (runs on CPU and GPU), deterministic, and free of host synchronisation, so a
whole layer can be captured in one CUDA graph:

* :func:`route_topk` — router logits [M, E] -> top-k weights [M, K] FP32 and expert ids [M, K]
  int32 (softmax or sigmoid scores, optional renormalisation).
* :func:`sort_by_expert` — the expert-sorted permutation of the expanded slots ``e = t*K + k``:
  per-expert row offsets (optionally padded to a multiple of ``pad_to`` rows per expert), the
  permuted -> expanded index of every row and the expanded -> permuted map the finalize reads.
* the permute itself (gather of activations) is :func:`moefuse.moe.api.moe_permute`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moefuse import _validate as v

SCORINGS = ("softmax", "sigmoid")
LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def route_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: ``(topk_weights [M, K] FP32, topk_ids [M, K] int32)``.

    ``scores = softmax(f32(logits))`` or ``sigmoid(f32(logits))`` over the E experts; the K
    highest scores are chosen in descending order, ties broken toward the lower expert id (a
    stable sort, so the choice is deterministic); ``topk_weights`` are their scores, divided by
    their sum when ``renormalize`` (Mixtral / Qwen-MoE style for softmax, DeepSeek-V3 style for
    sigmoid).
    """
    v.check_tensor(
        "route_topk",
        "router_logits",
        router_logits,
        dtypes=LOGIT_DTYPES,
        ndims=(2,),
        last_dim_contiguous=False,
    )
    check_routing("route_topk", router_logits.shape[1], top_k, scoring, renormalize)
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring == "softmax" else torch.sigmoid(logits)
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.gather(scores, 1, order)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, order.to(torch.int32)


def check_routing(op: str, n_experts: int, top_k, scoring, renormalize) -> None:
    """The routing options of :func:`route_topk` for ``n_experts`` experts (``ValueError`` naming
    the argument of ``op``)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= n_experts:
        raise ValueError(
            f"moefuse.{op}: argument 'top_k' must be an int in [1, {n_experts}], got {top_k!r}"
        )
    if not isinstance(scoring, str) or scoring not in SCORINGS:
        raise ValueError(
            f"moefuse.{op}: argument 'scoring' must be one of {SCORINGS}, got {scoring!r}"
        )
    if not isinstance(renormalize, bool):
        raise ValueError(
            f"moefuse.{op}: argument 'renormalize' must be a bool, got {renormalize!r}"
        )


class RoutingPlan(NamedTuple):
    """Where every expanded slot goes in the expert-sorted row buffer.

    * ``expanded_idx_to_permuted_idx`` [M, K] int32: row of slot (t, k), -1 when its expert id is
      outside ``[0, num_experts)`` (an expert that lives elsewhere under expert parallelism).
    * ``permuted_idx_to_expanded_idx`` [num_rows] int32: ``t*K + k`` of each row, -1 for padding
      rows and unused capacity.
    * ``expert_offsets`` [E + 1] int32: first row of each expert; ``expert_offsets[E]`` is the
      number of rows in use. Expert e owns rows ``[offsets[e], offsets[e+1])`` (its slots in
      ascending expanded order, then its padding).
    * ``num_rows``: static row capacity ``M*K`` (``+ E*(pad_to-1)`` with padding), so the plan
      needs no device -> host copy.
    """

    expanded_idx_to_permuted_idx: torch.Tensor
    permuted_idx_to_expanded_idx: torch.Tensor
    expert_offsets: torch.Tensor
    num_rows: int


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, *, pad_to: int = 1) -> RoutingPlan:
    """Expert-sorted permutation of the slots of ``topk_ids`` [M, K] (see :class:`RoutingPlan`).

    Within an expert, slots keep ascending expanded order ``t*K + k`` (a stable sort), so the plan
    is a deterministic function of ``topk_ids``. ``pad_to`` rounds every expert's row count up to a
    multiple (GEMM tile alignment); padding rows map to -1.
    """
    v.check_tensor(
        "sort_by_expert",
        "topk_ids",
        topk_ids,
        dtypes=(torch.int32, torch.int64),
        ndims=(2,),
        last_dim_contiguous=False,
    )
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError("moefuse.sort_by_expert: argument 'num_experts' must be an int >= 1")
    if isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < 1:
        raise ValueError("moefuse.sort_by_expert: argument 'pad_to' must be an int >= 1")
    dev = topk_ids.device
    n = topk_ids.numel()
    ids = topk_ids.reshape(-1).long()
    # slots of non-local experts get key E and sort behind every local slot
    key = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    order = torch.sort(key, stable=True).indices  # expanded indices, grouped by expert
    sorted_key = key[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_experts]
    padded = (counts + pad_to - 1) // pad_to * pad_to
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    dense_start = torch.cumsum(counts, 0) - counts
    local = sorted_key < num_experts
    e = sorted_key.clamp(max=num_experts - 1)
    pos = torch.arange(n, device=dev)
    row = torch.where(local, padded_start[e] + (pos - dense_start[e]), -1)

    exp_to_perm = torch.empty(n, dtype=torch.int64, device=dev)
    exp_to_perm.scatter_(0, order, row)
    capacity = n if pad_to == 1 else n + num_experts * (pad_to - 1)
    # one spare slot absorbs the writes of non-local slots; it is cut off below
    perm_to_exp = torch.full((capacity + 1,), -1, dtype=torch.int64, device=dev)
    perm_to_exp.scatter_(0, torch.where(local, row, capacity), torch.where(local, order, -1))
    offsets = torch.cat([padded_start, padded_end[-1:]])
    return RoutingPlan(
        exp_to_perm.view(topk_ids.shape).to(torch.int32),
        perm_to_exp[:capacity].to(torch.int32),
        offsets.to(torch.int32),
        capacity,
    )
