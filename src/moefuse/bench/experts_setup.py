"""What the routed-experts benchmarks share: the model shapes, a stand-in experts module, random
weights and routing, the weight bytes behind a floor and per-kernel device times
(``bench moe-experts`` in BF16 and FP8, the demo, the FP8 GPU tests)."""

from __future__ import annotations

import torch

SHAPES = {
    "qwen3": dict(hidden=2048, inter=768, experts=128, top_k=8),
    "mixtral": dict(hidden=4096, inter=14336, experts=8, top_k=2),
    "deepseek_v3": dict(hidden=7168, inter=2048, experts=256, top_k=8),
}
TOKENS = (1, 4, 16, 64, 256)
BATCHED_MAX_BYTES = 16 << 30
ROUTING_SETS = 8


class FakeExperts(torch.nn.Module):
    """The attributes transformers' experts functions and moefuse's integration read."""

    def __init__(self, gate_up_proj, down_proj):
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.num_experts = gate_up_proj.shape[0]
        self.has_gate, self.has_bias, self.is_transposed = True, False, False
        self.is_concatenated, self.has_post_expert_norm = True, False
        self._is_expert_parallel = False
        self.act_fn = torch.nn.SiLU()

    def _apply_gate(self, gate_up_out):  # transformers' default gate: act(gate) * up
        gate, up = gate_up_out.chunk(2, dim=-1)
        return self.act_fn(gate) * up


def make_weights(shape: dict, device, seed: int = 0):
    """gate_up [E, 2I, H] and down [E, H, I], BF16, scaled so activations stay O(1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    gu = torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16, generator=g)
    gu.mul_(h**-0.5)
    dn = torch.randn(e, h, i, device=device, dtype=torch.bfloat16, generator=g)
    dn.mul_(i**-0.5)
    return gu, dn


def make_routing(tokens: int, shape: dict, device, seed: int):
    """(x [T, H] BF16, top_k_index [T, K] int64, top_k_weights [T, K] FP32): top-k of random
    logits (distinct experts per token), softmax weights."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, shape["hidden"], device=device, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, shape["experts"], device=device, generator=g)
    w, idx = torch.topk(logits, shape["top_k"], dim=-1)
    return x, idx, torch.softmax(w, dim=-1)


def expert_bytes(shape: dict) -> int:
    return 3 * shape["hidden"] * shape["inter"] * 2


def kernel_times(fn, device, calls: int = 5) -> dict[str, float]:
    """Device µs per kernel of one ``fn()`` (mean over ``calls`` eager calls, torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(device)
    times: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.count:
            dev_us = getattr(ev, "device_time_total", None) or ev.cuda_time_total
            times[ev.key[:60]] = dev_us / calls
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))
