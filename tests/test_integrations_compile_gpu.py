"""Patched transformers models compiled on one GPU (inductor, CUDA graphs): static-cache
``generate`` with ``CompileConfig(fullgraph=True)`` (transformers' default mode="reduce-overhead":
the decode step replays a CUDA graph) has no graph break and gives the eager static-cache tokens;
the compiled decode step captured in a CUDA graph replays with the bits of its eager calls; a
``dynamic=True`` compile keeps one graph across prompt lengths."""

from __future__ import annotations

import types

import pytest
import torch

tf = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install moefuse[transformers])"
)

from torch._dynamo.utils import counters  # noqa: E402

from moefuse.integrations import transformers as mt  # noqa: E402
from test_integrations_transformers import SEEDS, VOCAB, build  # noqa: E402

pytestmark = pytest.mark.gpu
GEN = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=None)


def patched_cuda(kind):
    model = build(kind, SEEDS[kind]).to(device="cuda", dtype=torch.bfloat16)
    assert mt.patch(model)["fused_layers"] == 2
    return model


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
@torch.no_grad()
def test_static_cache_generate_compiled_fullgraph_gpu(kind):
    model = patched_cuda(kind)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4)).cuda()
    want = model.generate(prompt, cache_implementation="static", disable_compile=True, **GEN)
    config = tf.CompileConfig(fullgraph=True)  # a graph break raises
    counters.clear()
    got = model.generate(prompt, cache_implementation="static", compile_config=config, **GEN)
    again = model.generate(prompt, cache_implementation="static", compile_config=config, **GEN)
    assert counters["stats"]["unique_graphs"] >= 1, "generate did not compile the decode step"
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert torch.equal(got, want), (got.tolist(), want.tolist())
    assert torch.equal(again, got), "second compiled generate (graph replays)"


@torch.no_grad()
def test_compiled_decode_step_graph_replay_bits():
    """The bench's decode step (moefuse.bench.hf_compiled.Variant): compiled forward of one token
    against a static cache, eager calls bitwise equal to each other and to CUDA-graph replays."""
    from moefuse.bench.hf_compiled import Variant

    model = patched_cuda("qwen3_moe")
    args = types.SimpleNamespace(backend="inductor", cache_len=32, replays=3, samples=1)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(5)).cuda()
    counters.clear()
    row = Variant("patched", model, args, torch.device("cuda")).step(prompt)
    assert row["graph_breaks"] == 0 and row["graphs"] == 1, row
    assert row["eager_runs_equal"] and row["graph_bits_equal"], row


@torch.no_grad()
def test_inductor_dynamic_shapes_one_graph_gpu():
    """``torch.compile(dynamic=True)`` with inductor: one graph for prompt lengths 4, 24 and 60
    (the fused experts' inline plan, then token tiles of 32 and 64 columns picked at run time),
    with no graph break, and every length's compiled call repeats its bits. Inductor reorders
    the model's own torch arithmetic, and in a tiny random model one reordered rounding can move
    a router's choice at a near tie (on CPU, inductor against eager differs by 0.4-4 % for the
    shipped model as for the patched one), so the compiled logits are held to FP32: no further
    from an FP32 copy of the model than the eager BF16 logits are, with BF16 slack."""
    model = patched_cuda("qwen3_moe")
    fp32 = build("qwen3_moe", SEEDS["qwen3_moe"]).cuda()
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for length in (4, 24, 60):
        gen = torch.Generator().manual_seed(length)
        ids = torch.randint(0, VOCAB, (1, length), generator=gen).cuda()
        got = compiled(ids).logits
        assert torch.equal(compiled(ids).logits, got), f"length {length}: compiled run to run"
        exact = fp32(ids).logits

        def off(logits):
            return ((logits.float() - exact).norm() / exact.norm()).item()

        eager = off(model(ids).logits)
        assert off(got) <= 1.5 * eager + 0.01, (
            f"length {length}: compiled {off(got):.4f} from FP32, eager BF16 {eager:.4f}"
        )
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
