"""transformers' block-scaled FP8 models patched onto moefuse, on CPU: a tiny Qwen3-MoE whose FP8
modules, weights and scales come from transformers' own ``replace_with_fp8_linear`` and
``Fp8Quantize`` (``moefuse.bench.hf_fp8.quantize_fp8``: no Hub, no GPU). Checks: every patched
FP8 layer computes the W8A8 formula on the weights transformers' own ``Fp8Dequantize`` gives
back (gate|up wiring, scale layout, bias), the patched model never reaches the Hub kernels,
its logits stay near the FP32 evaluation of the quantized model and are bitwise equal run to
run, ``unpatch`` restores transformers' path, and formats moefuse does not cover keep it,
announced once."""

from __future__ import annotations

import logging

import pytest
import torch

tf = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install moefuse[transformers]"
)
fp8_mod = pytest.importorskip("transformers.integrations.finegrained_fp8")

from moefuse import _runtime  # noqa: E402
from moefuse.bench.hf_fp8 import fp32_reference, quantize_fp8  # noqa: E402
from moefuse.integrations import transformers as mt  # noqa: E402
from moefuse.quant.reference import per_token_group_quant_8bit_reference  # noqa: E402
from moefuse.testing import assert_bitwise_equal, naming_launch  # noqa: E402

pytestmark = pytest.mark.interpreter

#: every projection a whole number of 128 x 128 blocks (transformers leaves others unquantized)
SHAPES = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=64)


class Offline(RuntimeError):
    """What the Hub kernel loader raises here (no Hub access, as on the GPU machines)."""


def bf16_model(seed: int = 0, experts: int = 4):
    torch.manual_seed(seed)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        num_experts=experts, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=64, initializer_range=0.1, **SHAPES,
    )  # fmt: skip
    return tf.Qwen3MoeForCausalLM(cfg).eval().to(torch.bfloat16)


@pytest.fixture
def offline(monkeypatch):
    """transformers' FP8 kernels from the Hub (and DeepGEMM) unavailable."""

    def refuse(*_a, **_k):
        raise Offline("finegrained-fp8 kernel unavailable (no Hub access)")

    monkeypatch.setattr(fp8_mod, "load_finegrained_fp8_kernel", refuse)
    monkeypatch.setattr(fp8_mod, "is_deepgemm_loadable", lambda: False, raising=False)
    monkeypatch.setattr(_runtime, "_logged", set())  # log_once: every test logs afresh


def dequantized(weight, scale_inv):
    """transformers' own dequantization of an FP8 weight (FP32): the oracle for the wiring."""
    return fp8_mod.Fp8Dequantize(None)._dequantize_one(weight, scale_inv, torch.float32)


def w8a8(x, w32):
    """The formula of the FP8 ops in FP64: ``x`` quantized per token and 128-channel group."""
    q, s = per_token_group_quant_8bit_reference(x.float(), 128)
    xq = q.double() * s.double().repeat_interleave(128, -1)[..., : x.shape[-1]]
    return xq @ w32.double().T


def record(model, kinds=("FP8Linear", "FP8Experts")):
    """(module, inputs, output) of every call of the modules of ``kinds`` in ``model``, copied
    (the patched layers' fused residual adds write some of them in place later)."""
    calls, hooks = [], []

    def keep(mod, args, out):
        calls.append((mod, [a.clone() for a in args], out.clone()))

    for m in model.modules():
        if type(m).__name__ in kinds:
            hooks.append(m.register_forward_hook(keep))
    return calls, hooks


@torch.no_grad()
def test_patched_fp8_layers_compute_the_formula_on_transformers_weights(offline, monkeypatch):
    fp8 = quantize_fp8(bf16_model())
    report = mt.patch(fp8, impl="triton")  # the kernels, in Triton's interpreter
    assert report["experts_running"] == "moefuse" and report["fp8_linears"] == 8, report
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))
    shared = []
    real_share = mt.share_quantization
    monkeypatch.setattr(mt, "share_quantization", lambda p, x: shared.append(p) or real_share(p, x))
    calls, hooks = record(fp8)
    logits = fp8(ids).logits
    for h in hooks:
        h.remove()
    # q, k and v of each layer multiplied the codes of one quantization of the normed rows ...
    assert [len(p) for p in shared] == [3, 3], shared
    # ... with the bits of three quantizations
    monkeypatch.setattr(mt, "share_quantization", lambda p, x: None)
    assert_bitwise_equal(fp8(ids).logits, logits, "q/k/v input quantized once vs each")
    kinds = [type(m).__name__ for m, _, _ in calls]
    assert kinds.count("FP8Linear") == 8 and kinds.count("FP8Experts") == 2, kinds
    for module, args, out in calls:
        if type(module).__name__ == "FP8Linear":
            want = w8a8(args[0], dequantized(module.weight, module.weight_scale_inv))
        else:  # gate rows then up rows (FP8Experts._apply_gate), a rounded once as in BF16
            x, ids_k, w_k = args
            want = torch.zeros(x.shape, dtype=torch.float64)
            for t, k in torch.cartesian_prod(torch.arange(x.shape[0]), torch.arange(2)).tolist():
                e = int(ids_k[t, k])
                wgu = dequantized(module.gate_up_proj[e], module.gate_up_proj_scale_inv[e])
                gate, up = w8a8(x[t : t + 1], wgu).float().chunk(2, dim=-1)
                a = (torch.nn.functional.silu(gate) * up).to(x.dtype)
                wd = dequantized(module.down_proj[e], module.down_proj_scale_inv[e])
                want[t] += w8a8(a, wd)[0].float().double() * float(w_k[t, k])
        # the op's FP32 block sums against FP64 here, then one rounding to BF16: one BF16 ulp
        torch.testing.assert_close(out.float(), want.float(), rtol=2**-7, atol=1e-5)


@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
@torch.no_grad()
def test_patched_fp8_model_runs_offline_near_its_fp32_evaluation_and_unpatches(offline, scale_fmt):
    fp8 = quantize_fp8(bf16_model(seed=1), scale_fmt=scale_fmt)  # FP32 or power-of-two scales
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    with pytest.raises(Offline):  # as shipped: transformers' FP8 path needs the Hub
        fp8(ids)
    want = fp32_reference(fp8)(ids).logits.float()
    assert fp8.model.layers[0].self_attn.q_proj.weight_scale_inv.dtype == (
        torch.float32 if scale_fmt == "float" else torch.float8_e8m0fnu
    )
    assert mt.patch(fp8)["fp8_linears"] == 8
    got = fp8(ids).logits
    assert_bitwise_equal(fp8(ids).logits, got, "patched FP8 model run to run")
    # BF16 activations quantize to other E4M3 codes than FP32 ones at a few % of the elements,
    # so the logits move by several % of their size; a wiring error (gate and up swapped, the
    # scales of another block) moves them by their whole size
    err = (got.float() - want).abs().mean() / want.abs().mean()
    assert err < 0.15, float(err)
    mt.unpatch(fp8)
    assert not mt.is_patched(fp8) and fp8.config._experts_implementation == "grouped_mm"
    assert all("forward" not in m.__dict__ for m in fp8.modules())
    with pytest.raises(Offline):
        fp8(ids)


@pytest.mark.parametrize("case", ["static", "block64"])
@torch.no_grad()
def test_uncovered_fp8_formats_keep_transformers_path_announced_once(offline, caplog, case):
    kw = {"activation_scheme": "static"} if case == "static" else {"block_size": (64, 64)}
    fp8 = quantize_fp8(bf16_model(), **kw)
    reason = "static activation scales" if case == "static" else "weight blocks of (64, 64)"
    with caplog.at_level(logging.INFO, logger="moefuse"):
        report = mt.patch(fp8)
        assert report["fp8_linears"] == 0 and report["experts_running"] == "moefuse"
        x = torch.randn(3, 128, dtype=torch.bfloat16)
        experts = fp8.model.layers[0].mlp.experts
        for _ in range(2):  # transformers' path (offline: it raises), announced once
            with pytest.raises(Offline):
                experts(x, torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5))
    lines = [r.getMessage() for r in caplog.records if r.name == "moefuse"]
    assert sum(f"FP8Linear keeps transformers' path: {reason}" in m for m in lines) == 1, lines
    assert sum(f"FP8Experts keeps transformers' path: {reason}" in m for m in lines) == 1, lines


@torch.no_grad()
def test_compiled_patched_fp8_model_has_no_graph_break_and_the_eager_bits(offline):
    fp8 = quantize_fp8(bf16_model(seed=2))
    mt.patch(fp8)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    # fullgraph: a graph break raises; dynamic: one graph with a symbolic token count (the static
    # shapes of the decode step and CUDA graphs: bench hf_moe --fp8 --compiled)
    dynamic = torch.compile(fp8, backend="aot_eager", fullgraph=True, dynamic=True)
    for n in (3, 5):
        want = fp8(ids[:, :n], use_cache=False).logits
        assert_bitwise_equal(dynamic(ids[:, :n], use_cache=False).logits, want, f"dynamic {n}")


@torch.no_grad()
def test_patched_fp8_linears_count_split_chunks_in_one_workspace(offline, monkeypatch):
    """With the chunk sums added by each tile's last program (``fused_reduce`` on), the patched
    projections of K = 512 (four K-blocks in two chunks, run as programs of their own) count
    their tiles in the device's one workspace, the pre-quantized q / k / v included, and give
    the bits of the reduce kernel; the workspace is zero again after every call."""
    from moefuse import _fastpath
    from moefuse.integrations import _fp8
    from moefuse.moe import linear_triton, tiles

    torch.manual_seed(3)
    shapes = dict(hidden_size=512, intermediate_size=256, moe_intermediate_size=128, head_dim=64)
    heads = dict(num_attention_heads=2, num_key_value_heads=2, num_experts=2, num_experts_per_tok=1)
    cfg = tf.Qwen3MoeConfig(
        vocab_size=64,
        num_hidden_layers=1,
        max_position_embeddings=16,
        initializer_range=0.1,
        **heads,
        **shapes,
    )
    fp8 = quantize_fp8(tf.Qwen3MoeForCausalLM(cfg).eval().to(torch.bfloat16))
    mt.patch(fp8, impl="triton")  # the kernels, in Triton's interpreter
    ids = torch.randint(0, 64, (1, 3), generator=torch.Generator().manual_seed(3))
    kernels = []
    monkeypatch.setattr(linear_triton, "launch", naming_launch(linear_triton.launch, kernels))
    _fastpath.clear()
    want = fp8(ids, use_cache=False).logits
    assert "_fp8_linear_reduce_kernel" in kernels, kernels  # the chunks run as programs
    kernels.clear()
    workspace = _fp8.linear_workspace(torch.device("cpu"))
    seen = []
    real = linear_triton.launch_fp8_linear

    def spy(*args, **kw):
        seen.append((args[4] is not None, kw.get("workspace") is workspace))
        real(*args, **kw)

    monkeypatch.setattr(linear_triton, "launch_fp8_linear", spy)
    monkeypatch.setattr(tiles, "LINEAR_FP8_FUSED_REDUCE", True)
    _fastpath.clear()
    try:
        for plans in (True, True, False):  # recorded, replayed, then every call a slow one
            _fastpath.ENABLED[0] = plans
            assert_bitwise_equal(fp8(ids, use_cache=False).logits, want, f"plans {plans}")
            assert not workspace.any()
    finally:
        _fastpath.ENABLED[0] = True
        _fastpath.clear()
    # the slow calls: q, k and v on the shared codes, o on its own input, all in the workspace
    assert seen[-4:] == [(True, True)] * 3 + [(False, True)], seen
    assert "_fp8_linear_reduce_kernel" not in kernels and "_fp8_linear_kernel" in kernels
