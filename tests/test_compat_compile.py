"""FlashInfer-named single-GPU calls (``moefuse.compat.flashinfer``) under
``torch.compile(fullgraph=True)``, static and dynamic shapes (``aot_eager``): the mapping code
(layout flags, scale reshapes, FlashInfer's output-first argument orders, ``num_tokens``) adds no
graph break, one graph serves two token counts, and the compiled results equal the eager ones
bit for bit. The communication names need ranks: their files call them eagerly."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from moefuse.compat import flashinfer as fi
from test_compile_ops import _assert_compiled_equals_eager

pytestmark = pytest.mark.interpreter
BF16 = torch.bfloat16
H, K = 64, 2


def _inputs(m: int) -> dict:
    g = torch.Generator().manual_seed(m)

    def rand(*shape, dtype=BF16):
        return torch.randn(*shape, generator=g).to(dtype)

    slots = torch.randperm(m * K, generator=g).to(torch.int32).reshape(m, K)
    return dict(
        x=rand(m, H),
        r=rand(m, H),
        w=rand(H),
        w32=rand(H, dtype=torch.float32),
        s32=rand(m, H, dtype=torch.float32),
        alpha=torch.rand(H, generator=g),
        beta=torch.rand(H, generator=g),
        heads=rand(m, 2, 32),
        gate=rand(m, 2, 32),
        gs=torch.tensor([120.0]),
        scale=torch.tensor([0.05]),
        rows=rand(m * K, H),
        slots=slots,
        weights=torch.rand(m, K, generator=g),
    )


def every_call(t: dict) -> dict:
    """One call of each single-GPU FlashInfer name; the written tensors are made here."""
    x, r, w, gs = t["x"], t["r"], t["w"], t["gs"]
    m = x.shape[0]
    out = {"rmsnorm": fi.rmsnorm(x, w, 1e-6), "gemma_rmsnorm": fi.gemma_rmsnorm(x, w, 1e-6)}
    for name in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm"):
        a, b = x.clone(), r.clone()
        assert getattr(fi, name)(a, b, w, 1e-6) is None
        out[name] = (a, b)
    out["gated_residual_rmsnorm"] = fi.gated_residual_rmsnorm(x, t["s32"], w, t["alpha"], t["beta"])
    out["gated_residual_next_rmsnorm"] = fi.gated_residual_next_rmsnorm(
        x, t["s32"], t["w32"], 1.0, t["beta"], post_weight=t["w32"], post_gain_center=1.0
    )
    heads = t["heads"].clone()
    fi.rmsnorm_sigmoid_gate(heads, t["gate"])
    out["rmsnorm_sigmoid_gate"] = heads
    unpermuted = torch.zeros(m, H, dtype=BF16)
    fi.moe_unpermute(t["rows"], unpermuted, t["slots"], t["weights"], m, K)
    out["moe_unpermute"] = unpermuted
    out["fp4_quantize"] = fi.fp4_quantize(x, gs)
    packed, scales = fi.nvfp4_quantize(x, gs, fi.SfLayout.layout_128x4)
    out["nvfp4_quantize"] = (packed, scales)
    out["e2m1_and_ufp8sf_scale_to_float"] = fi.e2m1_and_ufp8sf_scale_to_float(
        packed, scales.reshape(-1), gs
    )
    fp8 = torch.empty(x.shape, dtype=torch.float8_e4m3fn)
    fi.rmsnorm_quant(fp8, x, w, t["scale"])
    out["rmsnorm_quant"] = fp8.view(torch.uint8)
    fp8, b = torch.empty(x.shape, dtype=torch.float8_e4m3fn), r.clone()
    fi.fused_add_rmsnorm_quant(fp8, x, b, w, t["scale"])
    out["fused_add_rmsnorm_quant"] = (fp8.view(torch.uint8), b)
    out["rmsnorm_fp4quant"] = fi.rmsnorm_fp4quant(x, w, global_scale=gs)
    b = r.clone()
    out["add_rmsnorm_fp4quant"] = (*fi.add_rmsnorm_fp4quant(x, b, w, global_scale=gs), b)
    q, s = fi.per_token_group_quant_8bit(x, 32, 1e-10, None, True, True)
    out["per_token_group_quant_8bit"] = (q.view(torch.uint8), s)
    return out


def test_every_single_gpu_name_is_called():
    names = {n for n in fi.__all__ if not n.startswith("supports_") and n[0].islower()}
    ranks_needed = {
        "trtllm_allreduce_fusion",
        "trtllm_moe_allreduce_fusion",
        "trtllm_moe_finalize_allreduce_fusion",
        "all_gather_gated_residual_next_rmsnorm",
        "all_gather_rmsnorm_fp4_quantize",
        "init_tp_moe_finalize_rmsnorm",
        "moe_finalize_rmsnorm_allreduce",
        "tp_moe_finalize_rmsnorm",
    }
    assert set(every_call(_inputs(3))) == names - ranks_needed


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@torch.no_grad()
def test_flashinfer_names_compile_fullgraph(dynamic):
    counters.clear()
    torch._dynamo.reset()
    compiled = torch.compile(every_call, fullgraph=True, dynamic=dynamic, backend="aot_eager")
    for m in (5, 37) if dynamic else (5,):
        want, got = every_call(_inputs(m)), compiled(_inputs(m))
        _assert_compiled_equals_eager(got, want, f"{m} rows", "aot_eager")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
