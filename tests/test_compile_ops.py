"""Every public single-GPU op (norm, MoE, quantization families) traced by
``torch.compile(fullgraph=True)`` in one function, with ``impl="triton"`` (the custom-op path a GPU
traces; the kernels run in Triton's interpreter) and ``impl="reference"``, with static and with
dynamic shapes: no graph break, the compiled results equal the eager ones bit for bit. The
communication ops need a workspace and ranks; their files compile them (tests/test_comm_*.py),
with static and dynamic shapes too."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import moefuse
from moefuse import moe, norm, quant
from moefuse.testing import assert_bitwise_equal

pytestmark = pytest.mark.interpreter
BF16 = torch.bfloat16
#: public names that are not ops on tensors (types, helpers answering shapes or capabilities)
NOT_OPS = {"RoutingPlan", "MoEWeights", "scale_shape"}
M, H, E, K = 5, 32, 4, 2


def _inputs(seed: int, m: int = M) -> dict:
    """Inputs of :func:`every_op` with ``m`` rows (tokens)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, dtype=BF16):
        return torch.randn(*shape, generator=g).to(dtype)

    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(m)]).to(torch.int32)
    return dict(
        x=rand(m, H),
        r=rand(m, H),
        w=rand(H),
        r32=rand(m, H, dtype=torch.float32),
        a=torch.rand(H, generator=g),
        b=torch.rand(H, generator=g),
        heads=rand(m, 2, 16),
        gate=rand(m, 2, 16),
        logits=rand(m, E, dtype=torch.float32),
        ids=ids,
        scales=torch.rand(m, K, generator=g),
        scale=torch.tensor([0.05]),
        gs=torch.tensor([80.0]),
        w13=rand(E, 16, H),
        w2=rand(E, H, 8),
    )


def every_op(t: dict, impl: str) -> dict:
    """Call every public op once (in-place ops on the tensors of ``t``); returns the results."""
    out = {}
    x, r, w = t["x"], t["r"], t["w"]
    out["rmsnorm"] = moefuse.rmsnorm(x, w, impl=impl)
    out["gemma_rmsnorm"] = moefuse.gemma_rmsnorm(x, w, impl=impl)
    moefuse.fused_add_rmsnorm(x, r, w, impl=impl)
    out["fused_add_rmsnorm"] = (x.clone(), r.clone())
    moefuse.gemma_fused_add_rmsnorm(x, r, w, impl=impl)
    out["gemma_fused_add_rmsnorm"] = (x.clone(), r.clone())
    out["gated_residual_rmsnorm"] = moefuse.gated_residual_rmsnorm(
        x, t["r32"], w, t["a"], t["b"], impl=impl
    )
    out["gated_residual_next_rmsnorm"] = moefuse.gated_residual_next_rmsnorm(
        x, t["r32"], w, t["a"], t["b"], impl=impl
    )
    out["rmsnorm_sigmoid_gate"] = moefuse.rmsnorm_sigmoid_gate(t["heads"], t["gate"], impl=impl)
    weights, ids = moefuse.route_topk(t["logits"], K)
    out["route_topk"] = (weights, ids)
    out["router_topk"] = moefuse.router_topk(
        t["logits"].to(BF16), K, weights_dtype=BF16, ids_dtype=torch.int64, impl=impl
    )
    plan = moefuse.sort_by_expert(t["ids"], E)
    out["sort_by_expert"] = tuple(plan[:3])
    xp = moefuse.moe_permute(x, plan.permuted_idx_to_expanded_idx, K, impl=impl)
    out["moe_permute"] = xp
    out["moe_finalize"] = moefuse.moe_finalize(
        xp, plan.expanded_idx_to_permuted_idx, t["scales"], impl=impl
    )
    out["moe_finalize_scatter_add"] = moefuse.moe_finalize_scatter_add(
        xp, plan.permuted_idx_to_expanded_idx, t["scales"], impl=impl
    )
    out["moe_experts"] = moefuse.moe_experts(x, t["w13"], t["w2"], t["ids"], t["scales"], impl=impl)
    layer_w = moefuse.MoEWeights(t["logits"].new_ones(E, H).to(BF16), t["w13"], t["w2"])
    out["moe_layer"] = moefuse.moe_layer(x, layer_w, K, impl=impl)
    s, gs = t["scale"], t["gs"]
    out["fp8_quantize"] = moefuse.fp8_quantize(x, s, impl=impl).view(torch.uint8)
    q, qs = moefuse.fp8_quantize_per_token(x, impl=impl)
    out["fp8_quantize_per_token"] = (q.view(torch.uint8), qs)
    out["fp8_dequantize"] = moefuse.fp8_dequantize(q, qs, impl=impl)
    packed, sf = moefuse.fp4_quantize(x, gs, impl=impl)
    out["fp4_quantize"] = (packed, sf)
    out["fp4_dequantize"] = moefuse.fp4_dequantize(packed, sf, gs, impl=impl)
    out["rmsnorm_quant"] = moefuse.rmsnorm_quant(x, w, s, impl=impl).view(torch.uint8)
    out["fused_add_rmsnorm_quant"] = (
        moefuse.fused_add_rmsnorm_quant(x, r, w, s, impl=impl).view(torch.uint8),
        r.clone(),
    )
    out["rmsnorm_fp4_quantize"] = moefuse.rmsnorm_fp4_quantize(x, w, gs, impl=impl)
    out["fused_add_rmsnorm_fp4_quantize"] = (
        *moefuse.fused_add_rmsnorm_fp4_quantize(x, r, w, gs, impl=impl),
        r.clone(),
    )
    return out


def test_every_public_op_is_walked():
    public = {
        n
        for n in (*norm.__all__, *moe.__all__, *quant.__all__)
        if not n.startswith("supports_") and n not in NOT_OPS
    }
    assert set(every_op(_inputs(0), "reference")) == public


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("impl", ["triton", "reference"])
@torch.no_grad()
def test_every_public_op_compiles_fullgraph(impl, dynamic):
    """``dynamic=True``: the token count and the float arguments (eps, scaling factors, also
    those left at their defaults) are traced symbolically, as a serving engine compiles; one
    graph then serves 5 and 37 rows."""
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(every_op, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for m in (M, 37) if dynamic else (M,):  # dynamic: one graph for both token counts
        want = every_op(_inputs(1, m), impl)
        got = compiled(_inputs(1, m), impl)
        assert set(got) == set(want)
        for name, value in want.items():
            pairs = zip(value, got[name]) if isinstance(value, tuple) else [(value, got[name])]
            for i, (e, g) in enumerate(pairs):
                assert_bitwise_equal(g, e, f"{name}[{i}] ({impl}, {m} rows): compiled == eager")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
