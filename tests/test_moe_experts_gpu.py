"""Fused routed experts on an SM90+ GPU at the Qwen3-MoE, Mixtral and DeepSeek-V3 expert shapes:
the kernels against the reference, batch invariance (a token alone, in batches of 64 and 256,
at every token-tile width), CUDA-graph replay, PDL on and off, transposed storage, the
extensions, and the integration's decode path."""

import pytest
import torch

import moefuse
from moefuse.moe import reference as ref
from moefuse.moe.experts_triton import launch_moe_experts
from moefuse.moe.tiles import EXPERTS_TOKEN_TILES, EXPERTS_WIDE, EXPERTS_WIDE_ROWS
from moefuse.testing import assert_bitwise_equal, capture_graph, poison_

pytestmark = pytest.mark.gpu
DEV = "cuda"
SHAPES = {  # (H, I, E, K)
    "qwen3": (2048, 768, 128, 8),
    "mixtral": (4096, 14336, 8, 2),
    "deepseek_v3": (7168, 2048, 256, 8),
}
_WEIGHTS = {}


def weights(name):
    if name not in _WEIGHTS:
        _WEIGHTS.clear()
        h, i, e, _ = SHAPES[name]
        g = torch.Generator(device=DEV).manual_seed(1)
        gu = torch.randn(e, 2 * i, h, device=DEV, dtype=torch.bfloat16, generator=g).mul_(h**-0.5)
        dn = torch.randn(e, h, i, device=DEV, dtype=torch.bfloat16, generator=g).mul_(i**-0.5)
        _WEIGHTS[name] = (gu, dn)
    return _WEIGHTS[name]


def routing(name, tokens, seed, sentinels=False):
    h, _, e, k = SHAPES[name]
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(tokens, h, device=DEV, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, e, device=DEV, generator=g)
    w, idx = torch.topk(logits, k, dim=-1)
    if sentinels:
        idx[::3, -1] = e + 5  # expert-parallel sentinels: skipped
        idx[1::5, 0] = -1
    return x, idx, torch.softmax(w, -1)


def rel_err(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.mark.parametrize("name", list(SHAPES))
def test_matches_reference(name):
    gu, dn = weights(name)
    for tokens, sent in ((1, False), (5, True), (64, False)):
        x, idx, w = routing(name, tokens, seed=tokens, sentinels=sent)
        out = poison_(torch.empty(tokens, SHAPES[name][0], device=DEV, dtype=torch.bfloat16))
        got = moefuse.moe_experts(x, gu, dn, idx, w, out=out, impl="triton")
        want = ref.moe_experts_reference(x, gu, dn, idx, w)
        assert torch.isfinite(got.float()).all()
        assert rel_err(got, want) < 5e-3, (name, tokens, rel_err(got, want))


@pytest.mark.parametrize("name", list(SHAPES))
def test_batch_invariant_bits(name):
    """A token's bits alone == inside batches of 64 and 256, at every token-tile width and with
    tail tiles."""
    gu, dn = weights(name)
    h = SHAPES[name][0]
    x, idx, w = routing(name, 256, seed=7, sentinels=True)
    full = moefuse.moe_experts(x, gu, dn, idx, w, impl="triton")
    b64 = moefuse.moe_experts(x[:64], gu, dn, idx[:64], w[:64], impl="triton")
    for j in (0, 3, 17, 63):
        alone = moefuse.moe_experts(
            x[j : j + 1], gu, dn, idx[j : j + 1], w[j : j + 1], impl="triton"
        )
        assert_bitwise_equal(alone[0], b64[j], f"{name} token {j}: alone vs batch of 64")
        assert_bitwise_equal(alone[0], full[j], f"{name} token {j}: alone vs batch of 256")
    for bt in EXPERTS_TOKEN_TILES:
        out = poison_(torch.empty(64, h, device=DEV, dtype=torch.bfloat16))
        launch_moe_experts(
            x[:64], gu, dn, idx[:64], w[:64], out, None, None, 1.0, False, False, token_tile=bt
        )
        assert_bitwise_equal(out, b64, f"{name}: token tile {bt}")
    # tail tiles: an item of at most BR slots runs BR columns (mixed with full items at 256
    # tokens: 16, 64 and 8 slots per expert on average over the three shapes)
    # and the 256-row wide tile (EXPERTS_WIDE_ROWS) with and without a tail
    rows = {**EXPERTS_WIDE, **EXPERTS_WIDE_ROWS}
    for bt, br, more in (
        (32, 16, {}),
        (128, 64, {}),
        (256, 128, {}),
        (128, 32, rows),
        (128, 0, rows),
    ):
        out = poison_(torch.empty(256, h, device=DEV, dtype=torch.bfloat16))
        launch_moe_experts(
            x,
            gu,
            dn,
            idx,
            w,
            out,
            None,
            None,
            1.0,
            False,
            False,
            tile={"tail_tile": br, **more},
            token_tile=bt,
        )
        assert_bitwise_equal(out, full, f"{name}: token tile {bt}, tail tile {br}, {more}")
    rolled = moefuse.moe_experts(x.roll(5, 0), gu, dn, idx.roll(5, 0), w.roll(5, 0))
    assert_bitwise_equal(rolled.roll(-5, 0), full, f"{name}: batch order")


def test_graph_pdl_transposed_extensions():
    name = "qwen3"
    gu, dn = weights(name)
    h, _, e, _ = SHAPES[name]
    x, idx, w = routing(name, 16, seed=3, sentinels=True)
    g = torch.Generator(device=DEV).manual_seed(4)
    bias = torch.randn(e, h, device=DEV, generator=g).to(torch.bfloat16)
    shared = torch.randn(16, h, device=DEV, generator=g).to(torch.bfloat16)
    kw = dict(bias=bias, shared_expert_output=shared, routed_scaling_factor=2.5)
    eager = moefuse.moe_experts(x, gu, dn, idx, w, impl="triton", enable_pdl=False, **kw)
    want = ref.moe_experts_reference(x, gu, dn, idx, w, **kw)
    assert rel_err(eager, want) < 5e-3
    pdl = moefuse.moe_experts(x, gu, dn, idx, w, impl="triton", enable_pdl=True, **kw)
    assert_bitwise_equal(pdl, eager, "PDL on vs off")
    out = poison_(torch.empty_like(eager))
    graph = capture_graph(lambda: moefuse.moe_experts(x, gu, dn, idx, w, out=out, **kw))
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, eager, "graph replay")
    gu_t, dn_t = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
    tr = moefuse.moe_experts(x, gu_t, dn_t, idx, w, transposed=True, impl="triton", **kw)
    assert rel_err(tr, eager) < 5e-3


def test_compiled_fullgraph():
    gu, dn = weights("qwen3")
    x, idx, w = routing("qwen3", 4, seed=5)

    def f(x, idx, w):
        return moefuse.moe_experts(x, gu, dn, idx, w, impl="triton") * 1

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, idx, w)
    assert_bitwise_equal(got, f(x, idx, w), "torch.compile(fullgraph=True)")
