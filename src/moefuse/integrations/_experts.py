"""The ``"moefuse"`` experts implementation for transformers' ``use_experts_implementation`` hook.

Modules with SiLU-gated, concatenated gate|up weights (either storage) and no biases run
:func:`moefuse.moe_experts`: the fused Triton kernels, every routed expert's weights read once,
batch-invariant bits (see :func:`_fused_layout`). Other layouts take the composed path below.

Called as ``fn(self, hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``
with the weights of a transformers experts module: ``self.gate_up_proj`` [E, 2I, H] (gate rows
then up rows), ``self.down_proj`` [E, H, I], ``self._apply_gate`` (activation of the gate half
times the up half). Per token t::

    plan = sort_by_expert(top_k_index, E)               # expert-sorted slots, static capacity T*K
                                                        # (its result, from fewer ops: expert_plan)
    xp   = moe_permute(hidden_states, plan)             # [T*K, H]
    h    = grouped GEMM  xp[rows of e] @ gate_up_proj[e].T     # [T*K, 2I]
    a    = self._apply_gate(h)                          # [T*K, I]
    y    = grouped GEMM  a[rows of e] @ down_proj[e].T         # [T*K, H]
    out  = moe_finalize(y, plan, top_k_weights)         # ascending-k FP32 FMA chain, one rounding

Nothing reads a device value on the host (no ``.item()`` / ``.tolist()``, static shapes), so the
function is CUDA-graph capturable. Expert ids outside ``[0, E)`` (expert-parallel sentinels) are
skipped by the finalize. The grouped GEMMs use ``torch._grouped_mm`` on CUDA where it runs (probed
once per dtype/device by :func:`moefuse.moe.layer.grouped_mm_available`), else a loop-free
gather + ``bmm`` (CPU CI; memory ``T*K*N*Kd`` elements, fine for small models only).

Modules whose layout the composed path does not cover (biases, transposed or interleaved gate/up
weights, no gate, a post-expert norm, FP32 activations, autograd) run transformers' own
``"grouped_mm"`` function instead, announced once through the ``moefuse`` logger.
"""

from __future__ import annotations

import torch

from moefuse._runtime import log_once
from moefuse.moe.api import moe_finalize, moe_permute
from moefuse.moe.experts import moe_experts
from moefuse.moe.layer import _grouped_mm_torch, grouped_mm_available
from moefuse.moe.routing import RoutingPlan

NAME = "moefuse"
#: instance attribute of an experts module holding the ``impl`` its moefuse ops run with
#: (set by :func:`moefuse.integrations.transformers.patch`; "auto" when absent)
IMPL_ATTR = "_moefuse_impl"
#: instance attribute through which a patched MoE block with shared experts (DeepSeek-V3) hands
#: the shared-expert output [T, H] to this function for the current call: it is added inside
#: the finalize (FP32, before the single rounding) instead of by a separate BF16 add
SHARED_ATTR = "_moefuse_shared_output"
_HALF = (torch.bfloat16, torch.float16)


_ARANGES: dict[tuple, torch.Tensor] = {}


def _arange(n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``torch.arange(n)`` kept per (n, device, dtype): one launch less per call at decode. Never
    written (read-only operands), so sharing it across calls and graphs is safe. Not cached
    while torch.compile traces (the arange is then a graph node, which inductor folds into its
    consumers; the capture query below would break the graph) or while a CUDA graph is being
    captured (the tensor would live in the graph's private pool)."""
    if torch.compiler.is_compiling():
        return torch.arange(n, device=device, dtype=dtype)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.arange(n, device=device, dtype=dtype)
    key = (n, device, dtype)
    t = _ARANGES.get(key)
    if t is None:
        if len(_ARANGES) > 256:  # prefill lengths vary: bound what is kept
            _ARANGES.clear()
        t = _ARANGES[key] = torch.arange(n, device=device, dtype=dtype)
    return t


def expert_plan(top_k_index: torch.Tensor, num_experts: int, expert_parallel: bool) -> RoutingPlan:
    """:func:`moefuse.moe.routing.sort_by_expert` ``(top_k_index, num_experts)`` (``pad_to=1``),
    bit for bit, in ~8 device ops instead of ~38: at decode every op is a launch and the host
    time of the routing is most of the block's time.

    Slots are stably sorted by expert id (ascending expanded index within an expert); the offsets
    are a ``searchsorted`` of the expert ids 0..E over the sorted ids. With ``expert_parallel``
    (transformers' ``_is_expert_parallel``) ids outside ``[0, E)`` are sentinels of experts held
    elsewhere: they sort behind every local slot and both maps mark them -1; otherwise the ids
    are trusted to lie in ``[0, E)`` (a router's top-k output).
    """
    ids = top_k_index.reshape(-1)
    n = ids.numel()
    if expert_parallel:
        ids = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    sorted_ids, order = torch.sort(ids, stable=True)
    bounds = _arange(num_experts + 1, sorted_ids.device, sorted_ids.dtype)
    offsets = torch.searchsorted(sorted_ids, bounds, out_int32=True)
    rows = _arange(n, ids.device, torch.int32)
    perm_to_exp = order.to(torch.int32)
    exp_to_perm = torch.empty_like(rows).scatter_(0, order, rows)
    if expert_parallel:
        perm_to_exp = torch.where(sorted_ids < num_experts, perm_to_exp, -1)
        exp_to_perm = torch.where(ids < num_experts, exp_to_perm, -1)
    return RoutingPlan(exp_to_perm.view(top_k_index.shape), perm_to_exp, offsets, n)


def _grouped_linear_gather(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[p] = w[e(p)] @ a[p]`` for rows p of expert e(p) (``offsets`` [E + 1] int32), without
    a Python loop over experts or a host read: every row gathers its expert's matrix."""
    rows = torch.arange(a.shape[0], device=a.device, dtype=offsets.dtype)
    # expert of row p = number of expert END offsets <= p; rows past offsets[E] (unused capacity)
    # are clamped onto the last expert: their values are never read by the finalize
    eid = torch.searchsorted(offsets[1:].contiguous(), rows, right=True).clamp_(max=w.shape[0] - 1)
    return torch.bmm(w[eid], a.unsqueeze(-1)).squeeze(-1)


#: routed rows (T * K) up to which the experts run as a gather of each row's expert matrix + bmm
#: instead of ``torch._grouped_mm``. MEASURED on H200 (bench/results/hf_moe-h200.json, Qwen3-MoE
#: block H = 2048, E = 128, K = 8, I = 768): at T = 1 (8 rows) the gather-and-bmm scheme
#: (transformers' "batched_mm") took 411 us against 659 for this function's grouped GEMMs; at
#: T = 16 (128 rows) 904 against 678. Up to this many rows the whole function also skips the
#: routing plan and the permute (:func:`_experts_by_slot`): at decode every op is a host launch.
GATHER_MAX_ROWS = 8


def grouped_linear(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped ``a[rows of e] @ w[e].T``: ``a`` [R, Kd], ``w`` [E, N, Kd], ``offsets`` [E + 1]."""
    if (
        a.shape[0] > GATHER_MAX_ROWS
        and a.is_cuda
        and a.shape[1] % 8 == 0
        and w.shape[1] % 8 == 0
        and w.is_contiguous()
        and grouped_mm_available(a.dtype, a.device)
    ):
        return _grouped_mm_torch(a.contiguous(), w, offsets)
    return _grouped_linear_gather(a, w, offsets)


def _experts_by_slot(self, x, top_k_index, top_k_weights, impl, expert_parallel: bool):
    """The experts at decode (T * K <= :data:`GATHER_MAX_ROWS`) in routing-slot order, with no
    sort and no permute: slot ``s = t*K + k`` multiplies token t by expert ``top_k_index[t, k]``'s
    matrices (gathered per slot, then ``bmm``: the same per-row products as the gather path of
    :func:`grouped_linear`), and ``moe_finalize`` reads slot s for (t, k) through the identity
    map (-1 for expert-parallel sentinels, which it skips). Seven device ops instead of ~20."""
    tokens, top_k = top_k_index.shape
    num_experts = self.gate_up_proj.shape[0]
    slots = _arange(tokens * top_k, x.device, torch.int32).view(tokens, top_k)
    ids = top_k_index.reshape(-1)
    if expert_parallel:
        local = (top_k_index >= 0) & (top_k_index < num_experts)
        slots = torch.where(local, slots, -1)
        ids = ids.clamp(0, num_experts - 1)
    rows = x.expand(top_k, -1) if tokens == 1 else x.repeat_interleave(top_k, dim=0)
    h = torch.bmm(self.gate_up_proj[ids], rows.unsqueeze(-1)).squeeze(-1)
    act = self._apply_gate(h)
    if act.dtype != x.dtype:
        act = act.to(x.dtype)
    y = torch.bmm(self.down_proj[ids], act.unsqueeze(-1)).squeeze(-1)
    return moe_finalize(
        y, slots, top_k_weights, impl=impl, shared_expert_output=self.__dict__.get(SHARED_ATTR)
    )


#: modules whose layout :func:`moefuse.moe_experts` covers run it (the fused kernels, one op);
#: False keeps the composed path below (plan, permute, GEMMs, finalize) for them too
FUSED = True


def _fused_layout(module, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> bool:
    """``moe_experts`` computes this module's experts: SiLU-gated concatenated gate|up weights
    (either storage) with transformers' default gate (``act(gate) * up``), no biases or
    post-expert norm, BF16/FP16, no autograd."""
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    gate = getattr(type(module), "_apply_gate", None)
    return (
        FUSED
        and act in ("silu", "swish")
        and (gate is None or getattr(gate, "__name__", "") == "_default_apply_gate")
        and top_k_index.dim() == 2
        and _unsupported_reason(module, hidden_states, allow_transposed=True) is None
    )


def _unsupported_reason(module, hidden_states: torch.Tensor, allow_transposed=False) -> str | None:
    if getattr(module, "has_bias", False):
        return "expert biases"
    if getattr(module, "is_transposed", False) and not allow_transposed:
        return "transposed expert weights"
    if not getattr(module, "is_concatenated", True):
        return "interleaved gate/up weights"
    if not getattr(module, "has_gate", True):
        return "experts without a gate projection"
    if getattr(module, "has_post_expert_norm", False):
        return "a post-expert norm"
    if hidden_states.dtype not in _HALF:
        return f"{hidden_states.dtype} activations (the finalize is BF16/FP16)"
    if torch.is_grad_enabled() and (
        hidden_states.requires_grad or module.gate_up_proj.requires_grad
    ):
        return "autograd (the moefuse ops have no backward)"
    return None


def _fallback(module, hidden_states, top_k_index, top_k_weights, reason: str) -> torch.Tensor:
    from transformers.integrations.moe import grouped_mm_experts_forward

    log_once("experts", f"running transformers' grouped_mm for {type(module).__name__}: {reason}")
    out = grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    shared = module.__dict__.get(SHARED_ATTR)
    return out if shared is None else out + shared


def moefuse_experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The registered experts function (module docstring); returns a fresh [T, H] tensor."""
    if _fused_layout(self, hidden_states, top_k_index):
        x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
        return moe_experts(
            x,
            self.gate_up_proj,
            self.down_proj,
            top_k_index,
            top_k_weights,
            transposed=bool(getattr(self, "is_transposed", False)),
            shared_expert_output=self.__dict__.get(SHARED_ATTR),
            impl=self.__dict__.get(IMPL_ATTR, "auto"),
        )
    reason = _unsupported_reason(self, hidden_states)
    if reason is not None:
        return _fallback(self, hidden_states, top_k_index, top_k_weights, reason)
    impl = self.__dict__.get(IMPL_ATTR, "auto")
    top_k = top_k_index.shape[-1]
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    expert_parallel = bool(getattr(self, "_is_expert_parallel", False))
    if top_k_index.numel() <= GATHER_MAX_ROWS and top_k_index.dim() == 2:
        return _experts_by_slot(self, x, top_k_index, top_k_weights, impl, expert_parallel)
    plan = expert_plan(top_k_index, self.gate_up_proj.shape[0], expert_parallel)
    xp = moe_permute(x, plan.permuted_idx_to_expanded_idx, top_k, impl=impl)
    h = grouped_linear(xp, self.gate_up_proj, plan.expert_offsets)
    act = self._apply_gate(h)
    if act.dtype != xp.dtype:  # an activation that upcasts must not change the GEMM dtype
        act = act.to(xp.dtype)
    y = grouped_linear(act, self.down_proj, plan.expert_offsets)
    return moe_finalize(
        y,
        plan.expanded_idx_to_permuted_idx,
        top_k_weights,
        impl=impl,
        shared_expert_output=self.__dict__.get(SHARED_ATTR),
    )
