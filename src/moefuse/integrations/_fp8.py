"""transformers' block-scaled FP8 layers on moefuse (``FineGrainedFP8Config`` models, FP8
checkpoints such as DeepSeek-V3 or Qwen3-*-FP8).

transformers swaps every ``nn.Linear`` for ``FP8Linear`` and every experts module for
``FP8Experts`` (``replace_with_fp8_linear``): E4M3 weights with one scale per 128 x 128 block
(``weight_scale_inv`` [ceil(N/128), ceil(K/128)]; ``gate_up_proj_scale_inv`` /
``down_proj_scale_inv`` per expert), activations quantized per token and 128-channel group at run
time. It runs them through kernels it downloads from the Hub at the first forward
(``kernels-community/finegrained-fp8``, DeepGEMM): without Hub access the forward raises. Here:

* :func:`fp8_experts_forward` is the ``"moefuse"`` entry of transformers'
  ``ALL_FP8_EXPERTS_FUNCTIONS`` (registered by
  :func:`moefuse.integrations.transformers.register`): covered modules run
  :func:`moefuse.moe_experts` on the FP8 weights and their scales (gate|up rows stacked, as
  ``FP8Experts._apply_gate`` splits them).
* :func:`patch_fp8_linears` points the forward of every covered ``FP8Linear`` at
  :func:`moefuse.fp8_linear` (same formula: per-token-group activation quantization inside the
  op, block-scaled FP32 accumulation, output in the input's dtype, bias added).
* In the patched decoder layers, the normalized rows that every attention input projection reads
  (q, k, v) are quantized once (:func:`share_quantization`) and each projection multiplies those
  codes: one quantization launch instead of three, the same bits. Every patched linear passes
  one zeroed workspace per device (:func:`linear_workspace`) in which a launch whose K chunks
  run as programs of their own can count its tiles (no bit depends on it).

Covered: E4M3 weights, 128 x 128 blocks, dynamic activation scales, FP32 or UE8M0
(``float8_e8m0fnu``) weight scales, BF16/FP16 activations, no autograd; experts with a SiLU
gate (no clamp, softcap or SwiGLU-OAI variant), a gate projection and no biases. Anything else
(static activation scales, FP4 weights, other block sizes, per-tensor scales, grouped linears)
keeps transformers' path, announced once per reason through the ``moefuse`` logger.
"""

from __future__ import annotations

import inspect
import types

import torch

from moefuse._runtime import log_once
from moefuse.moe.experts import moe_experts
from moefuse.moe.linear import fp8_linear
from moefuse.moe.tiles import LINEAR_FP8_WORKSPACE
from moefuse.quant.group_api import per_token_group_quant_8bit

#: the instance attribute holding a patched module's state (shared with
#: :mod:`moefuse.integrations.transformers`, whose ``unpatch`` restores every such module)
STATE = "_moefuse_patch"
#: instance attribute of an experts module holding the ``impl`` its moefuse ops run with
IMPL_ATTR = "_moefuse_impl"
#: see :data:`moefuse.integrations._experts.SHARED_ATTR`
SHARED_ATTR = "_moefuse_shared_output"
#: the weight block moefuse's FP8 ops take (transformers' ``weight_block_size`` default)
BLOCK = (128, 128)
_HALF = (torch.bfloat16, torch.float16)


def _scale_dtypes() -> tuple[torch.dtype, ...]:
    e8m0 = getattr(torch, "float8_e8m0fnu", None)
    return (torch.float32,) if e8m0 is None else (torch.float32, e8m0)


def _format_reason(weight, scale, block_size, module) -> str | None:
    """Why moefuse does not cover this FP8 weight format (None: covered)."""
    if weight.dtype != torch.float8_e4m3fn:
        return f"{weight.dtype} weights" + (" (FP4)" if weight.dtype == torch.int8 else "")
    if block_size is None:
        return "per-tensor weight scales"
    if tuple(block_size) != BLOCK:
        return f"weight blocks of {tuple(block_size)} (moefuse takes {BLOCK})"
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        return "static activation scales"
    if not isinstance(scale, torch.Tensor) or scale.dtype not in _scale_dtypes():
        return f"{getattr(scale, 'dtype', None)} weight scales"
    return None


# ----------------------------------------------------------------------------- linear layers
def fp8_linear_reason(module) -> str | None:
    """None when :func:`moefuse.fp8_linear` computes this ``FP8Linear``, else why not."""
    if type(module).__name__ != "FP8Linear":
        return f"{type(module).__name__} (not a plain FP8Linear)"
    if getattr(module, "activation_scale", None) is not None:
        return "static activation scales"
    weight = module.weight
    if weight.is_meta:
        return "weights on the meta device"
    return _format_reason(weight, module.weight_scale_inv, module.block_size, module)


class _LinearState:
    __slots__ = ("forward", "saved", "impl", "pending", "workspace")

    def __init__(self, forward, saved, impl, workspace):
        self.forward, self.saved, self.impl, self.pending = forward, saved, impl, None
        self.workspace = workspace


#: device -> the zeroed int32 counters every patched FP8Linear on it passes to ``fp8_linear``
#: (``workspace``: each launch leaves them zeroed; the patched model runs on one stream)
_WORKSPACES: dict[torch.device, torch.Tensor] = {}


def linear_workspace(device: torch.device) -> torch.Tensor:
    """The patched FP8 linears' ``fp8_linear`` workspace on ``device`` (created once, zeroed, its
    address marked static for compiled CUDA graphs, which then read it in place)."""
    ws = _WORKSPACES.get(device)
    if ws is None:
        ws = torch.zeros(LINEAR_FP8_WORKSPACE, dtype=torch.int32, device=device)
        if device.type == "cuda":
            from torch._dynamo import mark_static_address

            mark_static_address(ws)
        _WORKSPACES[device] = ws
    return ws


def _fp8_linear_forward(self, input: torch.Tensor) -> torch.Tensor:
    """Patched ``FP8Linear.forward``: :func:`moefuse.fp8_linear` on the module's FP8 weight and
    block scales, on the codes and scales :func:`share_quantization` left for exactly this input
    tensor if any (identity check, no data read); the original forward for FP32 inputs or while
    autograd records."""
    st = self.__dict__[STATE]
    pending = st.pending
    ws = st.workspace if st.workspace.device == self.weight.device else None
    if pending is not None:
        st.pending = None
        if pending[0] is input:
            out = input.new_empty(*input.shape[:-1], self.weight.shape[0])
            return fp8_linear(
                pending[1],
                self.weight,
                self.weight_scale_inv,
                self.bias,
                block_size=BLOCK,
                input_scale=pending[2],
                out=out,
                workspace=ws,
                impl=st.impl,
            )
    if input.dtype not in _HALF or (torch.is_grad_enabled() and input.requires_grad):
        return st.forward(input)
    return fp8_linear(
        input,
        self.weight,
        self.weight_scale_inv,
        self.bias,
        block_size=BLOCK,
        workspace=ws,
        impl=st.impl,
    )


#: attention projections that read the normalized hidden states, per attention class family
#: (q / k / v; DeepSeek's low-rank query and joint key-value projections)
INPUT_PROJECTIONS = (
    ("q_proj", "k_proj", "v_proj"),
    ("q_a_proj", "kv_a_proj_with_mqa"),
    ("q_proj", "kv_a_proj_with_mqa"),
)


def input_projections(attention) -> tuple | None:
    """The patched FP8 linears of ``attention`` that all read its input (the first of
    :data:`INPUT_PROJECTIONS` whose modules it has, all patched), or None."""
    for names in INPUT_PROJECTIONS:
        mods = tuple(getattr(attention, n, None) for n in names)
        if all(m is not None for m in mods):
            return mods if all(STATE in m.__dict__ for m in mods) else None
    return None


def share_quantization(projections: tuple, x: torch.Tensor) -> None:
    """Quantize ``x`` once (:func:`moefuse.per_token_group_quant_8bit`, groups of 128: the
    quantization :func:`moefuse.fp8_linear` runs on its input) for every projection in
    ``projections`` that will read it: each then multiplies the same codes instead of
    quantizing ``x`` again. Same bits as without (the same quantization of the same tensor)."""
    if x.dtype not in _HALF or x.stride(-1) != 1 or torch.is_grad_enabled():
        return
    st = projections[0].__dict__[STATE]
    xq, xs = per_token_group_quant_8bit(x, BLOCK[1], impl=st.impl)
    for m in projections:
        m.__dict__[STATE].pending = (x, xq, xs)


def patch_fp8_linears(model, impl: str) -> int:
    """Patch every covered ``FP8Linear`` of ``model`` (:func:`fp8_linear_reason`); the others
    keep transformers' forward, each reason announced once. Returns how many were patched."""
    n = 0
    for module in model.modules():
        if not type(module).__name__.startswith("FP8") or not hasattr(module, "weight_scale_inv"):
            continue
        if STATE in module.__dict__:
            n += 1
            continue
        reason = fp8_linear_reason(module)
        if reason is not None:
            log_once("fp8_linear", f"{type(module).__name__} keeps transformers' path: {reason}")
            continue
        ws = linear_workspace(module.weight.device)
        module.__dict__[STATE] = _LinearState(
            module.forward, module.__dict__.get("forward"), impl, ws
        )
        module.forward = types.MethodType(_fp8_linear_forward, module)
        n += 1
    return n


# ----------------------------------------------------------------------------- experts
def fp8_experts_reason(module, hidden_states: torch.Tensor) -> str | None:
    """None when :func:`moefuse.moe_experts` computes this ``FP8Experts`` module, else why not."""
    if not getattr(module, "has_gate", True) or not hasattr(module, "gate_up_proj"):
        return "experts without a gate projection"
    if getattr(module, "has_bias", False):
        return "expert biases"
    if not getattr(module, "is_concatenated", True) or getattr(module, "is_transposed", False):
        return "interleaved or transposed expert weights"
    act = getattr(getattr(module, "config", None), "hidden_act", None)
    if act not in ("silu", "swish"):
        return f"activation {act!r}"
    for attr in ("swiglu_alpha", "limit", "swiglu_limit", "gate_softcap", "up_softcap"):
        if getattr(module, attr, None) is not None:
            return f"a gate with {attr}"
    reason = _format_reason(
        module.gate_up_proj, module.gate_up_proj_scale_inv, module.block_size, module
    )
    if reason is None:
        reason = _format_reason(
            module.down_proj, module.down_proj_scale_inv, module.block_size, module
        )
    if reason is not None:
        return reason
    if hidden_states.dtype not in _HALF:
        return f"{hidden_states.dtype} activations (the finalize is BF16/FP16)"
    if torch.is_grad_enabled() and hidden_states.requires_grad:
        return "autograd (the moefuse ops have no backward)"
    return None


def _fp8_fallback(module, hidden_states, top_k_index, top_k_weights, reason: str):
    """transformers' own path: its FP8 ``grouped_mm`` function, or the module's per-expert loop
    for static activation scales (which ``grouped_mm`` rejects)."""
    log_once("experts", f"{type(module).__name__} keeps transformers' path: {reason}")
    if getattr(module, "activation_scheme", "dynamic") == "static":
        # the undecorated FP8Experts.forward (the class's forward dispatches on the config)
        forward = inspect.unwrap(type(module).forward)
        out = forward(module, hidden_states, top_k_index, top_k_weights)
    else:
        from transformers.integrations.finegrained_fp8 import fp8_grouped_mm_experts_forward

        out = fp8_grouped_mm_experts_forward(module, hidden_states, top_k_index, top_k_weights)
    shared = module.__dict__.get(SHARED_ATTR)
    return out if shared is None else out + shared


def fp8_experts_forward(
    self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The ``"moefuse"`` FP8 experts function: ``moe_experts`` on the module's E4M3 weights with
    ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv`` (gate rows, then up rows); transformers'
    path for what it does not cover (module docstring). Returns a fresh [T, H] tensor."""
    reason = fp8_experts_reason(self, hidden_states)
    if reason is not None:
        return _fp8_fallback(self, hidden_states, top_k_index, top_k_weights, reason)
    x = hidden_states if hidden_states.stride(-1) == 1 else hidden_states.contiguous()
    return moe_experts(
        x,
        self.gate_up_proj,
        self.down_proj,
        top_k_index,
        top_k_weights,
        gate_up_proj_scale_inv=self.gate_up_proj_scale_inv,
        down_proj_scale_inv=self.down_proj_scale_inv,
        block_size=BLOCK,
        gate_up_layout="stacked",
        shared_expert_output=self.__dict__.get(SHARED_ATTR),
        impl=self.__dict__.get(IMPL_ATTR, "auto"),
    )
