"""FP8 routed experts and ``fp8_linear`` on an SM90+ GPU at the Qwen3-MoE, Mixtral and DeepSeek-V3
shapes: the kernels against the FP64 reference of the formula, bitwise batch invariance (a token
alone, in batches of 64 and 256, every token tile, plan kernel or inline plan, a second run),
CUDA-graph replay, PDL on and off, UE8M0 scales, and torch.compile (fullgraph, dynamic)."""

import os

import pytest
import torch

import moefuse
from moefuse.bench.experts_setup import SHAPES, make_routing
from moefuse.bench.fp8_linear import make_weight
from moefuse.bench.moe_experts_fp8 import make_fp8_weights
from moefuse.moe.experts_fp8 import launch_moe_experts_fp8
from moefuse.moe.linear_triton import launch_fp8_linear
from moefuse.moe.tiles import (
    EXPERTS_FP8_TMA,
    EXPERTS_FP8_TMA64,
    EXPERTS_FP8_TMA64_NARROW_GATE_UP,
    LINEAR_FP8_TMA,
    LINEAR_FP8_TMA_NARROW,
)
from moefuse.testing import (
    assert_bitwise_equal,
    assert_fused_activation_quant,
    capture_graph,
    poison_,
)

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
#: relative RMS difference from the FP64 evaluation of the formula that the tests allow, per
#: MOEFUSE_FP8_ACCUMULATION mode (the benchmark reports the issue's 2^-8 bar itself). Measured on
#: H100 (2026-12-06) at T = 64: block 4.6-5.2e-3 (Hopper's FP8 MMA accumulates a block's k32
#: steps narrower than FP32, and one ulp of a rounded activation then moves an E4M3 code by 1/16
#: now and then), 8.3e-3 for the one DeepSeek-V3 token of this test at T = 1; k32 3.1-3.6e-3;
#: fp16 (exact products, FP32 sums) 1.4-2.6e-4.
TOL = {"block": 2**-6, "k32": 2**-7, "fp16": 2**-10}[
    os.environ.get("MOEFUSE_FP8_ACCUMULATION") or "block"
]
_W = {}


def weights(name):
    if name not in _W:
        _W.clear()
        torch.cuda.empty_cache()
        _W[name] = make_fp8_weights(SHAPES[name], DEV, seed=3)
    return _W[name]


def rel(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm())


def call(name, x, idx, w, **kw):
    gq, gs, dq, ds, _, _ = weights(name)
    return moefuse.moe_experts(
        x, gq, dq, idx, w, gate_up_proj_scale_inv=gs, down_proj_scale_inv=ds, **kw
    )


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp8_experts_reference_and_invariance(name):
    shape = SHAPES[name]
    gq, gs, dq, ds, _, _ = weights(name)
    for t in (1, 5, 64):
        x, idx, w = make_routing(t, shape, DEV, seed=t)
        if t == 5:
            idx[::2, -1] = shape["experts"] + 3  # expert-parallel sentinels
        out = poison_(torch.empty_like(x))
        got = call(name, x, idx, w, out=out, impl="triton")
        want = call(name, x, idx, w, impl="reference")
        assert torch.isfinite(got.float()).all()
        assert rel(got, want) < TOL, (name, t, rel(got, want))
    x, idx, w = make_routing(256, shape, DEV, seed=99)
    full = call(name, x, idx, w)
    b64 = call(name, x[:64], idx[:64], w[:64])
    assert_bitwise_equal(call(name, x, idx, w), full, "second run")
    for j in (0, 17, 63):
        alone = call(name, x[j : j + 1], idx[j : j + 1], w[j : j + 1])
        assert_bitwise_equal(alone[0], b64[j], f"token {j} alone vs 64")
        assert_bitwise_equal(alone[0], full[j], f"token {j} alone vs 256")
    for bt in (16, 32, 64, 128):
        for tile in ({"inline_plan_slots": 0}, {"tail_tile": 0, "inline_plan_slots": 0}):
            out = poison_(torch.empty_like(x))
            launch_moe_experts_fp8(
                x, gq, gs, dq, ds, idx, w, out, None, None, 1.0, False, True, tile=tile,
                token_tile=bt,
            )  # fmt: skip
            assert_bitwise_equal(out, full, f"token tile {bt} {tile}")


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp8_fused_activation_quant_bytes(name):
    """The gate|up kernel's quantization of the activation writes per_token_group_quant_8bit's
    bytes (valid slots' rows; T = 1, 5 with sentinels, 64, 256; the row tiles 32 and 64 of I),
    and the experts' output is bitwise the same with it on and off."""
    shape = SHAPES[name]
    gq, gs, dq, ds, _, _ = weights(name)
    tiles = ({"fuse_act_quant": True}, {"fuse_act_quant": True, "bn_gate_up": 64})
    for t in (1, 5, 64, 256):
        x, idx, w = make_routing(t, shape, DEV, seed=t + 7)
        if t == 5:
            idx[::2, -1] = shape["experts"] + 3
        assert_fused_activation_quant(x, (gq, gs, dq, ds), idx, w, tiles, True, f"{name} T={t}")


#: the decode placements of the two group quantizations besides their own launches and the
#: gate|up kernel's fused activation quantization (test_fp8_fused_activation_quant_bytes):
#: moefuse.moe.tiles.experts_fp8_decode_tile chooses among them, each must give the same bits
QUANT_PLACEMENTS = (
    {"fuse_tokens_quant": True, "fuse_act_quant": False},
    {"fuse_tokens_quant": True, "fuse_act_quant": True},
    {"fuse_tokens_quant": True, "down_act_quant": True},
    {"fuse_tokens_quant": False, "down_act_quant": True},
    # the weight rows requested from the L2 before each program's gdc_wait (whole rows, or
    # their first 512 bytes), with the down kernel launched right after gate|up's wait
    {"prefetch": 1 << 20},
    {"prefetch": 1 << 20, "early_dependents": True, "fuse_act_quant": True},
    {"prefetch": 512, "early_dependents": True, "fuse_act_quant": False},
    # each gate|up program asks the L2 for its slice of its expert's down weights
    {"prefetch_down": True},
)


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp8_quant_placements_bitwise(name):
    """The tokens quantized per K-block inside the gate|up programs, the activation inside the
    gate|up kernel's last programs or per K-block inside the down programs: the experts' output
    bitwise the default's (T = 1 with PDL on and off, 5 with sentinels, 16), and the gate|up
    kernel's activation bytes per_token_group_quant_8bit's with the tokens quantized in it."""
    shape = SHAPES[name]
    gq, gs, dq, ds, _, _ = weights(name)
    for t in (1, 5, 16):
        x, idx, w = make_routing(t, shape, DEV, seed=t + 11)
        if t == 5:
            idx[::2, -1] = shape["experts"] + 3
        want = call(name, x, idx, w)
        for tile in QUANT_PLACEMENTS:
            for pdl in (True, False) if t == 1 else (True,):
                out = poison_(torch.empty_like(x))
                launch_moe_experts_fp8(
                    x, gq, gs, dq, ds, idx, w, out, None, None, 1.0, False, pdl, tile=tile
                )
                assert_bitwise_equal(out, want, f"{name} T={t} {tile} PDL {pdl}")
        tiles = ({"fuse_act_quant": True, "fuse_tokens_quant": True},)
        assert_fused_activation_quant(x, (gq, gs, dq, ds), idx, w, tiles, True, f"{name} T={t}")


#: the ``tma`` launches of the experts' GEMMs (tokens on the MMA's M side, weight tiles by TMA,
#: moefuse.moe.experts_fp8_tma) that the benchmarks time, each with its token tile
_GATE_UP_64_8W = {"tma": True, "bn_gate_up": 64, "bn_down": 128, "warps": 8, "stages": 3}
EXPERTS_TMA_TILES = (
    ({**_GATE_UP_64_8W, "fuse_act_quant": False}, 128),  # (64 rows hold half a group)
    (dict(EXPERTS_FP8_TMA), 128),  # the default at 128 slots: gate|up quantizes the activation
    (dict(EXPERTS_FP8_TMA64), 64),  # the defaults at 64 slots (128 / 64 gate|up rows)
    ({**EXPERTS_FP8_TMA64, **EXPERTS_FP8_TMA64_NARROW_GATE_UP}, 64),
    ({**EXPERTS_FP8_TMA, "gate_up_persistent": 1, "down_persistent": 1}, 128),  # persistent grids
    ({**EXPERTS_FP8_TMA64, **EXPERTS_FP8_TMA64_NARROW_GATE_UP, "down_persistent": 2}, 64),
    ({**EXPERTS_FP8_TMA, "down_wgmma": True}, 128),  # the Gluon down GEMM
    ({**EXPERTS_FP8_TMA64, **EXPERTS_FP8_TMA64_NARROW_GATE_UP, "down_wgmma": True}, 64),
)


#: the pointer kernels' tile at many tokens (what the policy takes where TMA cannot run)
POINTER_TILE = {"tma": False, "bn_gate_up": 32, "bn_down": 64, "warps": 4, "stages": 4}


@pytest.mark.parametrize("name", list(SHAPES))
def test_fp8_experts_tma_bitwise(name):
    """The ``tma`` launches (the policy's default at these token counts among them) give the
    pointer kernels' bits (T = 300 with sentinels and short items, 2,048; PDL on and off), and
    they ran (not the other launch). The interleaved layout: the CPU test."""
    import moefuse.moe.experts_fp8 as ef
    import moefuse.moe.experts_fp8_wgmma as ew

    shape = SHAPES[name]
    gq, gs, dq, ds, _, _ = weights(name)
    for t, pdl in ((300, True), (300, False), (2048, True)):
        x, idx, w = make_routing(t, shape, DEV, seed=t + 3)
        if t == 300:
            idx[::3, -1] = shape["experts"] + 3
        want = poison_(torch.empty_like(x))
        launch_moe_experts_fp8(x, gq, gs, dq, ds, idx, w, want, None, None, 1.0, False, pdl,
                               tile=POINTER_TILE, token_tile=128)  # fmt: skip
        for tile, bt in EXPERTS_TMA_TILES:
            ran = []
            real = (ef.launch_gate_up_fp8_tma, ef.launch_down_fp8_tma, ew.launch_down_fp8_wgmma)
            ef.launch_gate_up_fp8_tma = lambda *a, **k: ran.append(1) or real[0](*a, **k)
            ef.launch_down_fp8_tma = lambda *a, **k: ran.append(2) or real[1](*a, **k)
            ew.launch_down_fp8_wgmma = lambda *a, **k: ran.append(3) or real[2](*a, **k)
            try:
                out = poison_(torch.empty_like(x))
                launch_moe_experts_fp8(x, gq, gs, dq, ds, idx, w, out, None, None, 1.0, False,
                                       pdl, tile=tile, token_tile=bt)  # fmt: skip
            finally:
                ef.launch_gate_up_fp8_tma, ef.launch_down_fp8_tma = real[:2]
                ew.launch_down_fp8_wgmma = real[2]
            assert ran == [1, 3 if tile.get("down_wgmma") else 2], (name, t, tile, ran)
            assert_bitwise_equal(out, want, f"{name} T={t} PDL {pdl} {tile}")


def test_fp8_experts_graph_pdl_e8m0_compile():
    name = "qwen3"
    shape = SHAPES[name]
    gq, gs, dq, ds, _, _ = weights(name)
    x, idx, w = make_routing(4, shape, DEV, seed=5)
    eager = call(name, x, idx, w)
    for pdl in (False, True):
        assert_bitwise_equal(call(name, x, idx, w, enable_pdl=pdl), eager, f"PDL {pdl}")
    out = poison_(torch.empty_like(x))
    graph = capture_graph(lambda: call(name, x, idx, w, out=out))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, eager, "CUDA-graph replay")
    # power-of-two scales as UE8M0 bytes: the same values, the same bits
    p2 = {k: torch.exp2(torch.round(torch.log2(s))) for k, s in (("g", gs), ("d", ds))}
    e8 = {k: v.to(torch.float8_e8m0fnu) for k, v in p2.items()}
    a = moefuse.moe_experts(x, gq, dq, idx, w, gate_up_proj_scale_inv=p2["g"],
                            down_proj_scale_inv=p2["d"])  # fmt: skip
    b = moefuse.moe_experts(x, gq, dq, idx, w, gate_up_proj_scale_inv=e8["g"],
                            down_proj_scale_inv=e8["d"])  # fmt: skip
    assert_bitwise_equal(b, a, "UE8M0 scales")

    def f(x, idx, w):
        return call(name, x, idx, w) * 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True)
    for t in (3, 9):
        xt, it, wt = make_routing(t, shape, DEV, seed=t)
        assert_bitwise_equal(compiled(xt, it, wt), f(xt, it, wt), f"compiled, {t} tokens")


@pytest.mark.parametrize("n,k", [(7168, 16384), (4096, 2048), (576, 7168)])
def test_fp8_linear(n, k):
    wq, ws, _ = make_weight(n, k, DEV, seed=4)
    g = torch.Generator(device=DEV).manual_seed(n)
    bias = torch.randn(n, generator=g, device=DEV).to(torch.bfloat16)
    for m in (1, 16, 300, 600):  # 600: LINEAR_FP8_TMA_NARROW by the policy
        x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
        out = poison_(torch.empty(m, n, device=DEV, dtype=torch.bfloat16))
        got = moefuse.fp8_linear(x, wq, ws, bias, out=out)
        want = moefuse.fp8_linear(x, wq, ws, bias, impl="reference")
        assert rel(got, want) < TOL, (m, rel(got, want))
        j = m // 2
        assert_bitwise_equal(moefuse.fp8_linear(x[j : j + 1], wq, ws, bias)[0], got[j], "alone")
        for tile in (
            {"split_programs": True},
            {"split_programs": True, "fused_reduce": True},
            {"split_programs": False},
            {"bt": 64},
            {"prefetch": 1024},
            {"prefetch": 1 << 20, "split_programs": False},
            dict(LINEAR_FP8_TMA, split_programs=False),
            dict(LINEAR_FP8_TMA_NARROW, split_programs=False),
            {"tma": True, "bn": 64, "bt": 64, "warps": 4, "stages": 4, "split_programs": False},
        ):
            o = poison_(torch.empty_like(got))
            launch_fp8_linear(x, wq, ws, bias, None, o, True, tile=tile)
            assert_bitwise_equal(o, got, f"M={m} {tile}")
        outs = [poison_(torch.empty_like(got)) for _ in range(16)]
        for o in outs:  # back to back: each tile's last program reads every chunk sum
            tile = {"split_programs": True, "fused_reduce": True}
            launch_fp8_linear(x, wq, ws, bias, None, o, True, tile=tile)
        for i, o in enumerate(outs):
            assert_bitwise_equal(o, got, f"M={m} split launch {i} of 16")
        q, qs = moefuse.per_token_group_quant_8bit(x, 128)
        workspace = torch.zeros(132, dtype=torch.int32, device=DEV)
        for inp, scales in ((q, qs), (x, None), (q, qs)):  # the caller's counters, reused
            o = poison_(torch.empty_like(got))
            tile = {"split_programs": True, "fused_reduce": True}
            launch_fp8_linear(inp, wq, ws, bias, scales, o, True, tile=tile, workspace=workspace)
            assert_bitwise_equal(o, got, f"M={m} workspace, pre-quantized {scales is not None}")
        assert not workspace.any()
    out = poison_(torch.empty(2, n, device=DEV, dtype=torch.bfloat16))
    x = x[:2]
    graph = capture_graph(lambda: moefuse.fp8_linear(x, wq, ws, bias, out=out))
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise_equal(out, moefuse.fp8_linear(x, wq, ws, bias), "CUDA-graph replay")


@pytest.mark.parametrize("n,k", [(7168, 16384), (4096, 2048), (1000, 1040)])
def test_fp8_linear_wgmma_bits(n, k):
    """The Gluon launch (tile key ``wgmma``: each block's MMA in flight while the block before is
    scaled) writes the TMA launch's bits: odd N, a partial last K-block, rows past a tile, bias,
    FP32 and UE8M0 scales, one chunk or several."""
    wq, ws, _ = make_weight(n, k, DEV, seed=8)
    g = torch.Generator(device=DEV).manual_seed(k)
    bias = torch.randn(n, generator=g, device=DEV).to(torch.bfloat16)
    e8m0 = torch.exp2(torch.ceil(torch.log2(ws))).to(torch.float8_e8m0fnu)
    for scale in (ws, e8m0):
        for m in (5, 300, 2100):
            x = torch.randn(m, k, generator=g, device=DEV).to(torch.bfloat16)
            want = poison_(torch.empty(m, n, device=DEV, dtype=torch.bfloat16))
            launch_fp8_linear(
                x,
                wq,
                scale,
                bias,
                None,
                want,
                False,
                tile=dict(LINEAR_FP8_TMA, split_programs=False),
            )
            for bn, bt, warps, stages in ((128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 3)):
                tile = dict(LINEAR_FP8_TMA, split_programs=False, wgmma=True)
                tile.update(bn=bn, bt=bt, warps=warps, stages=stages)
                got = poison_(torch.empty_like(want))
                launch_fp8_linear(x, wq, scale, bias, None, got, False, tile=tile)
                assert_bitwise_equal(got, want, f"M={m} {tile} {scale.dtype}")


def test_fp8_linear_tma_plan_replays(monkeypatch):
    """With the TMA launch as the policy, an eager call's launch plan replays it: the recorded
    descriptors are rebuilt over the next call's tensors (moefuse._fastpath), same bits as the
    slow path on fresh inputs, also under a CUDA graph."""
    import moefuse.moe.linear_triton as lt
    from moefuse import _fastpath as fp

    policy = lt.linear_fp8_plan
    monkeypatch.setattr(
        lt, "linear_fp8_plan", lambda m, n, k: dict(policy(m, n, k), **LINEAR_FP8_TMA)
    )
    fp.clear()
    wq, ws, _ = make_weight(4096, 2048, DEV, seed=6)
    g = torch.Generator(device=DEV).manual_seed(6)
    try:
        for _ in range(3):
            x = torch.randn(300, 2048, generator=g, device=DEV).to(torch.bfloat16)
            got = moefuse.fp8_linear(x, wq, ws)
            fp.ENABLED[0] = False
            try:
                want = moefuse.fp8_linear(x, wq, ws)
            finally:
                fp.ENABLED[0] = True
            assert_bitwise_equal(got, want, "TMA launch replayed by its plan")
        assert fp.plan_count(moefuse.fp8_linear) == 1, fp.refusals(moefuse.fp8_linear)
        out = poison_(torch.empty(300, 4096, device=DEV, dtype=torch.bfloat16))
        graph = capture_graph(lambda: moefuse.fp8_linear(x, wq, ws, out=out))
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise_equal(out, want, "CUDA-graph replay")
    finally:
        fp.clear()
