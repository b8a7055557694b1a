"""moefuse inside Hugging Face transformers (>= 5) models: ``register()``, ``patch(model)``,
``unpatch(model)``. transformers is an optional extra (``pip install moefuse[transformers]``) and
is imported only when one of these functions runs.

* :func:`register` adds the ``"moefuse"`` experts implementation to
  ``transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS`` (see :mod:`moefuse.integrations._experts`
  for its dataflow: sort_by_expert -> moe_permute -> grouped GEMM (gate|up) -> ``_apply_gate`` ->
  grouped GEMM (down) -> moe_finalize). Select it with
  ``model.set_experts_implementation("moefuse")`` or
  ``from_pretrained(..., experts_implementation="moefuse")``.
* :func:`patch` registers, selects the experts implementation, and moves the model's RMSNorms onto
  moefuse: every module whose class name ends in ``RMSNorm`` and which behaves as
  ``w * norm(x)`` (or Gemma's ``(1 + w) * norm(x)``, checked numerically on a probe row at patch
  time) runs :func:`moefuse.rmsnorm` / :func:`moefuse.gemma_rmsnorm` — hidden-size norms and the
  per-head q/k norms alike. In the pre-norm decoder layers listed in :data:`FUSABLE_LAYERS`, the
  residual add after attention and the ``post_attention_layernorm`` run as one
  :func:`moefuse.fused_add_rmsnorm`, and the residual add after the MLP / MoE block is fused with
  the NEXT norm (the next layer's ``input_layernorm``, or the final ``norm`` after the last layer):
  the layer returns the residual stream as usual and hands the normalized row to that norm, which
  uses it only when it is called with that very tensor (identity check, no data read).
* Softmax top-k routers (:data:`SOFTMAX_TOPK_ROUTERS`): after the router's linear, the softmax,
  top-k, renormalization and cast run as one :func:`moefuse.router_topk` launch. The semantics
  (renormalized or not, weights in the logits' dtype or FP32) are read from the original forward
  on probe rows at patch time and checked against the reference; a router that disagrees keeps
  its forward. Ties between equal scores go to the lower expert id.
* MoE blocks with shared experts (:data:`SHARED_EXPERT_BLOCKS`, DeepSeek-V3): the shared-expert
  output is added inside the ``"moefuse"`` finalize (FP32, before its one rounding) instead of by
  a separate BF16 add after it.
* :func:`unpatch` restores every forward and the previous experts implementation.

Numerics: moefuse's norms round once (``bf16((x * r) * w)``) where transformers rounds twice
(``w * bf16(x * r)``), and the fused adds normalize the FP32 sum before rounding it; outputs
differ from the unpatched model in the last bits and are closer to an FP32 evaluation
(tests/test_integrations_transformers.py). Inference only: whenever autograd is recording, every
patched module runs its original forward. Tensors that are not BF16/FP16 (an FP32 model) run the
original forwards as well.
"""

from __future__ import annotations

import types

import torch

from moefuse._runtime import IMPLS
from moefuse.integrations._experts import IMPL_ATTR, NAME, SHARED_ATTR, moefuse_experts_forward
from moefuse.integrations._fp8 import STATE as _STATE
from moefuse.integrations._fp8 import (
    fp8_experts_forward,
    input_projections,
    patch_fp8_linears,
    share_quantization,
)
from moefuse.moe.reference import router_topk_reference
from moefuse.moe.router import router_topk
from moefuse.norm.api import (
    fused_add_rmsnorm,
    gemma_fused_add_rmsnorm,
    gemma_rmsnorm,
    rmsnorm,
)

#: decoder layers whose forward is exactly the pre-norm pattern
#: ``r = x; x = attn(input_layernorm(x)); x = r + x; r = x; x = mlp(post_attention_layernorm(x));
#: return r + x`` (read in transformers 5.x); only these get the fused residual adds.
FUSABLE_LAYERS = frozenset(
    {
        "Qwen3MoeDecoderLayer",
        "Qwen2MoeDecoderLayer",
        "MixtralDecoderLayer",
        "DeepseekV3DecoderLayer",
        "DeepseekV2DecoderLayer",
        "Qwen3DecoderLayer",
        "LlamaDecoderLayer",
        "MistralDecoderLayer",
    }
)
#: MoE blocks computing ``experts(x) + shared_experts(x)`` (read in transformers 5.x); with the
#: "moefuse" experts the shared output is added inside the finalize (FP32, one rounding)
SHARED_EXPERT_BLOCKS = frozenset({"DeepseekV3MoE"})
#: top-k routers whose forward is ``logits = F.linear(x, weight)``, an FP32 softmax, ``topk``, an
#: optional renormalization (``norm_topk_prob``) and the weights in the logits' dtype or FP32
#: (read in transformers 5.x); patched ones run :func:`moefuse.router_topk` after the linear
SOFTMAX_TOPK_ROUTERS = frozenset(
    {
        "Qwen3MoeTopKRouter",
        "Qwen2MoeTopKRouter",
        "Qwen3NextTopKRouter",
        "Qwen3VLMoeTextTopKRouter",
        "OlmoeTopKRouter",
        "MixtralTopKRouter",
    }
)
_HALF = (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- register
def register() -> None:
    """Add the ``"moefuse"`` experts implementation to transformers (idempotent): to
    ``ALL_EXPERTS_FUNCTIONS`` and, where the installed transformers has block-scaled FP8 experts,
    to ``ALL_FP8_EXPERTS_FUNCTIONS`` (:func:`moefuse.integrations._fp8.fp8_experts_forward`)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if ALL_EXPERTS_FUNCTIONS._global_mapping.get(NAME) is not moefuse_experts_forward:
        ALL_EXPERTS_FUNCTIONS.register(NAME, moefuse_experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without FP8 experts
        return
    if ALL_FP8_EXPERTS_FUNCTIONS._global_mapping.get(NAME) is not fp8_experts_forward:
        ALL_FP8_EXPERTS_FUNCTIONS.register(NAME, fp8_experts_forward)


# ----------------------------------------------------------------------------- norms
def _norm_eps(module) -> float | None:
    for attr in ("variance_epsilon", "eps", "epsilon"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


@torch.no_grad()
def _probe_gain_center(module, eps: float) -> float | None:
    """0.0 when ``module(x) ~= w * norm(x)``, 1.0 when ``~= (1 + w) * norm(x)``, None otherwise.
    Evaluated once at patch time on two random rows (within 2e-2: BF16 weights and outputs)."""
    w = module.weight
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, w.shape[0], generator=g).to(device=w.device)
    try:
        got = module.forward(x.to(w.dtype if w.dtype in _HALF else torch.float32)).float()
    except Exception:
        return None
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    n = n.to(w.dtype if w.dtype in _HALF else torch.float32).float()  # what the module sees
    for center in (0.0, 1.0):
        want = n * (w.float() + center)
        if got.shape == want.shape and torch.allclose(got, want, rtol=2e-2, atol=2e-2):
            return center
    return None


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Patched RMSNorm forward: the fused-add result when a preceding layer left one for exactly
    this tensor, else moefuse.rmsnorm over the last dim (any leading shape)."""
    st = self.__dict__[_STATE]
    pending = st.pending
    if pending is not None:
        st.pending = None
        if pending[0] is hidden_states:
            return pending[1]
    if (
        hidden_states.dtype not in _HALF
        or hidden_states.stride(-1) != 1
        or (torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad))
    ):
        return st.forward(hidden_states)
    x2 = hidden_states.reshape(-1, hidden_states.shape[-1])
    fn = gemma_rmsnorm if st.center else rmsnorm
    return fn(x2, self.weight, st.eps, impl=st.impl).view(hidden_states.shape)


class _NormState:
    """What a patched norm needs: its original forward (fallback and unpatch), eps, gain center,
    the instance-level forward it had before (restored by unpatch) and the pending fused result."""

    __slots__ = ("forward", "eps", "center", "saved", "impl", "pending")

    def __init__(self, forward, eps, center, saved, impl):
        self.forward, self.eps, self.center, self.saved = forward, eps, center, saved
        self.impl, self.pending = impl, None


def _patch_norm(module, impl: str) -> bool:
    if _STATE in module.__dict__:
        return True
    weight = getattr(module, "weight", None)
    eps = _norm_eps(module)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None:
        return False
    if weight.is_meta:
        return False
    center = _probe_gain_center(module, eps)
    if center is None:
        return False
    module.__dict__[_STATE] = _NormState(
        module.forward, eps, center, module.__dict__.get("forward"), impl
    )
    module.forward = types.MethodType(_norm_forward, module)
    return True


def _restore_forward(module, saved) -> None:
    del module.__dict__[_STATE]
    if saved is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = saved


# ----------------------------------------------------------------------------- shared experts
class _BlockState:
    __slots__ = ("forward", "saved")

    def __init__(self, forward, saved):
        self.forward, self.saved = forward, saved


def _shared_block_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``experts(x) + shared_experts(x)`` with the add inside the moefuse finalize; the original
    forward whenever the experts do not run the "moefuse" implementation or autograd records."""
    st = self.__dict__[_STATE]
    experts = self.experts
    if (
        getattr(experts.config, "_experts_implementation", None) != NAME
        or hidden_states.dtype not in _HALF
        or torch.is_grad_enabled()
    ):
        return st.forward(hidden_states)
    shape = hidden_states.shape
    _, topk_weights, topk_indices = self.gate(hidden_states)
    shared = self.shared_experts(hidden_states).reshape(-1, shape[-1])
    experts.__dict__[SHARED_ATTR] = shared
    try:
        out = experts(hidden_states.reshape(-1, shape[-1]), topk_indices, topk_weights)
    finally:
        experts.__dict__.pop(SHARED_ATTR, None)
    return out.view(shape)


def _patch_shared_blocks(model) -> int:
    n = 0
    for module in model.modules():
        if type(module).__name__ in SHARED_EXPERT_BLOCKS and _STATE not in module.__dict__:
            if all(hasattr(module, a) for a in ("experts", "gate", "shared_experts")):
                module.__dict__[_STATE] = _BlockState(
                    module.forward, module.__dict__.get("forward")
                )
                module.forward = types.MethodType(_shared_block_forward, module)
                n += 1
    return n


# ----------------------------------------------------------------------------- routers
class _RouterState:
    __slots__ = ("forward", "saved", "renormalize", "weights_dtype", "impl")

    def __init__(self, forward, saved, renormalize, weights_dtype, impl):
        self.forward, self.saved, self.impl = forward, saved, impl
        self.renormalize, self.weights_dtype = renormalize, weights_dtype


def _router_forward(self, hidden_states: torch.Tensor):
    """Patched top-k router: ``(router_logits, weights, ids)`` as the original returns them, the
    softmax, top-k and renormalization in one :func:`moefuse.router_topk` launch; the original
    forward for FP32 inputs or while autograd records."""
    st = self.__dict__[_STATE]
    weight = self.weight
    if (
        hidden_states.dtype not in _HALF
        or weight.dtype != hidden_states.dtype
        or (torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad))
    ):
        return st.forward(hidden_states)
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, weight.shape[1]), weight)
    weights, ids = router_topk(
        logits,
        self.top_k,
        renormalize=st.renormalize,
        weights_dtype=st.weights_dtype,
        ids_dtype=torch.int64,
        impl=st.impl,
    )
    return logits, weights, ids


@torch.no_grad()
def _probe_router(module) -> tuple[bool, torch.dtype] | None:
    """``(renormalize, weights dtype)`` of a router in :data:`SOFTMAX_TOPK_ROUTERS`, read from its
    original forward on probe rows and checked against :func:`router_topk_reference` (the chosen
    scores equal, the weights within a rounding); None when they disagree."""
    weight, top_k = getattr(module, "weight", None), getattr(module, "top_k", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.is_meta:
        return None
    if weight.dtype not in _HALF or not isinstance(top_k, int) or not 1 <= top_k <= weight.shape[0]:
        return None
    g = torch.Generator(device=weight.device).manual_seed(0)
    x = torch.randn(4, weight.shape[1], generator=g, device=weight.device).to(weight.dtype)
    out = module.forward(x)
    if not (isinstance(out, tuple) and len(out) == 3):
        return None
    logits, w, ids = out
    if w.shape != (4, top_k) or ids.shape != (4, top_k) or ids.dtype != torch.int64:
        return None
    renormalize = bool(torch.allclose(w.float().sum(-1), torch.ones(4, device=w.device), atol=2e-2))
    ref_w, ref_ids = router_topk_reference(logits, top_k, "softmax", renormalize, w.dtype)
    scores = torch.softmax(logits.float(), dim=-1)
    same_choice = torch.equal(
        scores.gather(1, ids).sort(-1).values, scores.gather(1, ref_ids.long()).sort(-1).values
    )
    close = torch.allclose(w.float().sort(-1).values, ref_w.float().sort(-1).values, rtol=1e-2)
    return (renormalize, w.dtype) if same_choice and close else None


def _patch_routers(model, impl: str) -> int:
    n = 0
    for module in model.modules():
        if type(module).__name__ not in SOFTMAX_TOPK_ROUTERS or _STATE in module.__dict__:
            continue
        semantics = _probe_router(module)
        if semantics is None:
            continue
        module.__dict__[_STATE] = _RouterState(
            module.forward, module.__dict__.get("forward"), *semantics, impl
        )
        module.forward = types.MethodType(_router_forward, module)
        n += 1
    return n


# ----------------------------------------------------------------------------- decoder layers
class _LayerState:
    __slots__ = ("forward", "saved", "next_norm", "fp8_inputs")

    def __init__(self, forward, saved, next_norm, fp8_inputs=None):
        self.forward, self.saved, self.next_norm = forward, saved, next_norm
        self.fp8_inputs = fp8_inputs  # patched FP8 projections reading the normalized input


def _add_norm(norm, x: torch.Tensor, residual: torch.Tensor) -> None:
    """``residual <- x + residual``; ``x <- norm(x + residual)`` (in place, one kernel)."""
    st = norm.__dict__[_STATE]
    fn = gemma_fused_add_rmsnorm if st.center else fused_add_rmsnorm
    fn(
        x.view(-1, x.shape[-1]),
        residual.view(-1, residual.shape[-1]),
        norm.weight,
        st.eps,
        impl=st.impl,
    )


def _fusable_input(x: torch.Tensor) -> bool:
    grad = torch.is_grad_enabled() and x.requires_grad
    return x.dtype in _HALF and x.is_contiguous() and not grad


def _layer_forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """Pre-norm decoder layer with fused residual adds (module docstring). Same arguments and
    result as the original forward, which runs instead whenever a precondition fails."""
    st = self.__dict__[_STATE]
    if args or not _fusable_input(hidden_states):
        return st.forward(hidden_states, *args, **kwargs)
    normed = self.input_layernorm(hidden_states)
    if st.fp8_inputs is not None:  # quantized once for every FP8 projection that reads it
        share_quantization(st.fp8_inputs, normed)
    attn = self.self_attn(hidden_states=normed, **kwargs)
    attn = attn[0] if isinstance(attn, tuple) else attn
    if not (attn.is_contiguous() and attn.dtype == hidden_states.dtype):
        attn = attn.contiguous().to(hidden_states.dtype)
    # the caller's tensor (an embedding, a recorded hidden state) is never written: the residual
    # stream of this layer lives in a fresh buffer from here on
    residual = hidden_states.clone()
    _add_norm(self.post_attention_layernorm, attn, residual)  # attn <- post-attention norm
    out = self.mlp(attn)
    nxt = st.next_norm
    if nxt is None or not (out.is_contiguous() and out.dtype == residual.dtype):
        return residual + out
    _add_norm(nxt, out, residual)  # residual <- layer output; out <- next norm's result
    nxt.__dict__[_STATE].pending = (residual, out)
    return residual


def _decoder_stacks(model):
    """(layers ModuleList, final norm or None) of every decoder stack in ``model``."""
    for module in model.modules():
        layers = getattr(module, "layers", None)
        if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
            yield layers, getattr(module, "norm", None)


def _patch_layers(model) -> int:
    fused = 0
    for layers, final_norm in _decoder_stacks(model):
        for i, layer in enumerate(layers):
            if type(layer).__name__ not in FUSABLE_LAYERS or _STATE in layer.__dict__:
                continue
            norms = (
                getattr(layer, "input_layernorm", None),
                getattr(layer, "post_attention_layernorm", None),
            )
            if not all(n is not None and _STATE in n.__dict__ for n in norms):
                continue
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
            if nxt is not None and _STATE not in getattr(nxt, "__dict__", {}):
                nxt = None
            fp8_inputs = input_projections(getattr(layer, "self_attn", None))
            layer.__dict__[_STATE] = _LayerState(
                layer.forward, layer.__dict__.get("forward"), nxt, fp8_inputs
            )
            layer.forward = types.MethodType(_layer_forward, layer)
            fused += 1
    return fused


# ----------------------------------------------------------------------------- patch / unpatch
def patch(
    model,
    *,
    experts: bool = True,
    routers: bool = True,
    norms: bool = True,
    fuse_residual: bool = True,
    linears: bool = True,
    impl: str = "auto",
) -> dict:
    """Run ``model`` (a transformers ``PreTrainedModel``) on moefuse; returns what runs now:
    ``{"experts_running": "moefuse" or None, "experts_replaced": the implementation it replaced
    (transformers' name, e.g. "grouped_mm") or None, "routers": n, "norms": n,
    "fused_layers": n, "fp8_linears": n, "shared_expert_blocks": n}`` (the counts: modules now
    on moefuse; the experts keys are None where the model has no experts implementation to
    select).

    ``experts``: register and select the ``"moefuse"`` experts implementation, and add the shared
    experts of :data:`SHARED_EXPERT_BLOCKS` inside its finalize. ``routers``: the softmax top-k
    routers of :data:`SOFTMAX_TOPK_ROUTERS` onto :func:`moefuse.router_topk` (each checked on
    probe rows against its original forward at patch time). ``norms``: RMSNorm
    modules onto :func:`moefuse.rmsnorm`. ``fuse_residual`` (needs ``norms``): residual adds of
    :data:`FUSABLE_LAYERS` as :func:`moefuse.fused_add_rmsnorm`. ``linears``: transformers'
    block-scaled ``FP8Linear`` layers onto :func:`moefuse.fp8_linear` (FP8 experts run
    :func:`moefuse.moe_experts` through the experts implementation; what moefuse does not cover
    keeps transformers' path: :mod:`moefuse.integrations._fp8`). Patching twice is a no-op;
    :func:`unpatch` undoes everything. ``impl`` ("auto" | "triton" | "reference", DESIGN.md) is
    passed to every moefuse op the patched modules call (``"triton"`` on CPU tensors runs the
    kernels in Triton's interpreter). Raises ``ValueError`` for an object that is not a
    ``torch.nn.Module`` or an unknown ``impl``.
    """
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"moefuse.patch: argument 'model' must be a torch.nn.Module, got {type(model).__name__}"
        )
    if impl not in IMPLS:
        raise ValueError(f"moefuse.patch: argument 'impl' must be one of {IMPLS}, got {impl!r}")
    report = {"experts_running": None, "experts_replaced": None}
    report.update(routers=0, norms=0, fused_layers=0, fp8_linears=0)
    if experts and hasattr(model, "set_experts_implementation"):
        register()
        previous = model.config._experts_implementation
        if previous != NAME:
            model.set_experts_implementation(NAME)
            model.__dict__.setdefault("_moefuse_previous_experts", previous)
        for module in model.modules():
            if hasattr(module, "gate_up_proj") and hasattr(module, "down_proj"):
                module.__dict__[IMPL_ATTR] = impl
        report["shared_expert_blocks"] = _patch_shared_blocks(model)
        report["experts_running"] = model.config._experts_implementation
        report["experts_replaced"] = model.__dict__.get("_moefuse_previous_experts")
    if routers:
        report["routers"] = _patch_routers(model, impl)
    if linears:
        report["fp8_linears"] = patch_fp8_linears(model, impl)
    if norms:
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm") and _patch_norm(module, impl):
                report["norms"] += 1
        if fuse_residual:
            report["fused_layers"] = _patch_layers(model)
    return report


def unpatch(model) -> None:
    """Undo :func:`patch`: original forwards, previous experts implementation."""
    for module in model.modules():
        st = module.__dict__.get(_STATE)
        if st is not None:
            _restore_forward(module, st.saved)
        module.__dict__.pop(IMPL_ATTR, None)
    previous = model.__dict__.pop("_moefuse_previous_experts", None)
    if previous is not None:
        model.set_experts_implementation(previous)


def is_patched(model) -> bool:
    """True when any module of ``model`` runs a moefuse forward."""
    return any(_STATE in m.__dict__ for m in model.modules())
