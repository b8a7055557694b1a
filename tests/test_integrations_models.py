"""``patch(model)`` on transformers MoE families beyond the three of
tests/test_integrations_transformers.py, on CPU (Triton kernels in the interpreter,
``impl="triton"``): a tiny random BF16 model of each family is patched, its eager logits stay
within BF16 noise of the unpatched model's, and ``torch.compile(fullgraph=True)`` of the patched
model (``aot_eager``) counts no graph break and gives its eager logits bit for bit.

The families are picked for the paths they take: Qwen2-MoE (a sigmoid-gated shared expert beside
the "moefuse" experts, softmax top-k routers, fused residual layers), GLM-4.5 MoE (a grouped
sigmoid router with a correction bias and shared experts: experts only), Qwen3-Next (routers and
gated norms of a hybrid model) and GPT-OSS, whose experts have biases: its experts decline the
fused op and run transformers' ``grouped_mm``, announced once through the ``moefuse`` logger, and
must trace under compile as well. A family the installed transformers lacks is skipped."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

tf = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install moefuse[transformers])"
)

from torch._dynamo.utils import counters  # noqa: E402

from moefuse.integrations import transformers as mt  # noqa: E402
from moefuse.testing import assert_bitwise_equal  # noqa: E402
from test_integrations_compile import GraphRecorder, _breaks  # noqa: E402

pytestmark = pytest.mark.interpreter
VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
)
#: model type -> (config fields of a tiny model, moefuse ops its compiled prefill must hold)
FAMILIES = {
    "qwen2_moe": (
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        ),
        {"moe_experts", "router_topk", "fused_add_rmsnorm"},
    ),
    "glm4_moe": (
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            head_dim=16,
        ),
        {"moe_experts", "rmsnorm"},
    ),
    "qwen3_next": (
        dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=16,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention", "full_attention"],
        ),
        {"moe_experts", "router_topk", "rmsnorm"},
    ),
    "gpt_oss": (
        dict(
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            head_dim=16,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        {"rmsnorm"},
    ),
}


def build(model_type: str, seed: int = 0):
    """A tiny random BF16 model of ``model_type`` (skips when transformers lacks the family)."""
    fields, _ = FAMILIES[model_type]
    try:
        cfg = tf.AutoConfig.for_model(model_type, **COMMON, **fields)
    except ValueError as exc:  # an unknown model type
        pytest.skip(f"transformers {tf.__version__} has no {model_type}: {exc}")
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(cfg).eval().to(torch.bfloat16)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
@torch.no_grad()
def test_patched_family_eager_and_compiled(model_type, caplog):
    shipped = build(model_type)
    model = copy.deepcopy(shipped)
    report = mt.patch(model, impl="triton")
    assert model.config._experts_implementation == "moefuse", report
    assert report["norms"] > 0, report
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    want = shipped(ids).logits.float()
    with caplog.at_level(logging.INFO, logger="moefuse"):
        eager = model(ids).logits
    rel = ((eager.float() - want).norm() / want.norm()).item()
    assert rel < 0.03, f"{model_type}: patched logits {rel:.4f} away from the unpatched model's"
    declined = [r.getMessage() for r in caplog.records if "grouped_mm" in r.getMessage()]
    if model_type == "gpt_oss":
        assert declined and "expert biases" in declined[0], caplog.text
    else:
        assert not declined, declined

    counters.clear()
    rec = GraphRecorder()
    got = torch.compile(model, fullgraph=True, backend=rec.backend)(ids).logits
    assert _breaks() == 0, dict(counters["graph_break"])
    seen = rec.ops_seen()
    _, must_hold = FAMILIES[model_type]
    assert must_hold <= seen, (model_type, seen)
    if model_type == "gpt_oss":
        assert "moe_experts" not in seen, seen
    assert_bitwise_equal(got, eager, f"{model_type}: compiled prefill")
