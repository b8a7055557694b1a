"""moefuse inside transformers models on one GPU (Triton kernels, torch._grouped_mm): the CPU
file's checks with the CUDA code paths, plus the issue's block shapes and CUDA-graph capture of
the ``"moefuse"`` experts implementation (no host synchronisation)."""

from __future__ import annotations

import copy

import pytest
import torch

tf = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install moefuse[transformers])"
)

from moefuse.integrations import transformers as mt  # noqa: E402
from moefuse.testing import assert_bitwise_equal, assert_close  # noqa: E402
from test_integrations_transformers import VOCAB, build, token_error  # noqa: E402

pytestmark = pytest.mark.gpu
KINDS = ("qwen3_moe", "mixtral", "deepseek_v3")


def cuda_copies(kind, seed, hidden=128):
    bf16 = build(kind, seed, hidden=hidden).to(device="cuda", dtype=torch.bfloat16)
    patched = copy.deepcopy(bf16)
    report = mt.patch(patched)  # impl="auto": the Triton kernels on an SM90+ GPU
    assert report["fused_layers"] == 2 and report["norms"] > 0, report
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(seed))
    return copy.deepcopy(bf16).float(), bf16, patched, ids.cuda()


def logits_and_routing(model, ids):
    """(logits [B, T, V], routed [B, T] bool: for each token, the sorted top-k expert ids of every
    MoE layer, as one tuple per token). A pre-hook on every experts module (the modules holding
    ``gate_up_proj``) reads the ``top_k_index`` [B*T, K] it is called with."""
    seen = []

    def hook(module, args, kwargs):
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        seen.append(index.sort(-1).values.reshape(*ids.shape, -1).cpu())

    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True)
        for m in model.modules()
        if hasattr(m, "gate_up_proj") and not isinstance(m, torch.nn.Linear)
    ]
    try:
        logits = model(ids).logits
    finally:
        for h in handles:
            h.remove()
    assert seen, "no experts module was called"
    return logits, torch.cat(seen, -1)


@pytest.mark.parametrize("kind", KINDS)
@torch.no_grad()
def test_logits_gpu(kind):
    """Tolerance row vs unpatched on every token routed to the same experts in both models (a
    near-tie between two experts may flip with any BF16 rounding difference, and then the token
    takes another expert: at most 2 such tokens of 48 per seed); bitwise run to run; closer to
    the FP32 copy (median token error summed over 4 seeds, so one seed's flip does not decide)."""
    e_patched = e_unpatched = 0.0
    for seed in range(4):
        fp32, bf16, patched, ids = cuda_copies(kind, seed)
        want32 = fp32(ids).logits
        unpatched, route_unpatched = logits_and_routing(bf16, ids)
        got, route_patched = logits_and_routing(patched, ids)
        same = (route_unpatched == route_patched).all(-1).to(got.device)
        assert int((~same).sum()) <= 2, (kind, seed, int((~same).sum()))
        assert_close(got[same], unpatched[same], "bf16_model_logits", f"{kind} seed {seed}")
        assert_bitwise_equal(patched(ids).logits, got, f"{kind} seed {seed}: run to run")
        e_patched += float(token_error(got, want32).median())
        e_unpatched += float(token_error(unpatched, want32).median())
    assert e_patched <= e_unpatched, (kind, e_patched, e_unpatched)


def _agree(a, b) -> int:
    """Length of the common prefix of two token rows."""
    diff = (a != b).nonzero()
    return int(diff[0, -1]) if diff.numel() else a.shape[-1]


@torch.no_grad()
def test_greedy_generation_gpu():
    """16 greedy tokens: the patched BF16 models follow the FP32 models' continuation at least
    as far as the unpatched BF16 models do (common-prefix lengths summed over models and seeds:
    random tiny models have near-ties that any BF16 rounding may break)."""
    kw = dict(
        max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0, eos_token_id=None
    )
    agree_patched = agree_unpatched = 0
    for kind in KINDS:
        for seed in range(3):
            fp32, bf16, patched, ids = cuda_copies(kind, seed)
            prompt = ids[:1, :5]
            want = fp32.generate(prompt, **kw)
            agree_patched += _agree(patched.generate(prompt, **kw), want)
            agree_unpatched += _agree(bf16.generate(prompt, **kw), want)
    assert agree_patched >= agree_unpatched, (agree_patched, agree_unpatched)


@pytest.mark.parametrize("tokens", [1, 37, 512])
@torch.inference_mode()
def test_qwen3_block_shapes_and_graph(tokens):
    """Qwen3-MoE block shapes (H 2048, E 128, K 8, I 768): "moefuse" vs "grouped_mm" (BF16
    pipelines with other rounding points), then the block captured in a CUDA graph and replayed
    4 times: bitwise equal to eager (fails if the path synchronises with the host)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    mt.register()
    cfg = tf.Qwen3MoeConfig(
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block = block.to(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, tokens, 2048, device="cuda", dtype=torch.bfloat16)
    cfg._experts_implementation = "grouped_mm"
    want = block(x).float()
    cfg._experts_implementation = "moefuse"
    eager = block(x)
    err = float((eager.float() - want).abs().max()) / float(want.abs().max())
    assert err <= 3e-2, err
    assert_bitwise_equal(block(x), eager, "run to run")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(x)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = block(x)
    for _ in range(4):
        out.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, eager, "graph replay")
