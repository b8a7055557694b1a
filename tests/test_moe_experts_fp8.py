"""Block-scaled FP8 routed experts and ``fp8_linear`` on CPU: the scale-row convention against
transformers' own FP8 quantizer, the reference's formula, the gate|up layouts, bad input; the
Triton kernels in the interpreter against the reference (odd H and I with partial blocks, K =
1..8, sentinels, both layouts and scale dtypes, poisoned outputs), bitwise batch invariance,
custom ops, torch.compile and launch plans."""

import json
import os
import subprocess
import sys

import pytest
import torch

import moefuse
from moefuse.moe import reference as ref
from moefuse.moe import reference_fp8 as r8
from moefuse.testing import (
    assert_bitwise_equal,
    assert_fused_activation_quant,
    expect_value_error,
    naming_launch,
    poison_,
)

pytestmark = pytest.mark.interpreter
E8M0 = torch.float8_e8m0fnu


def rel_rms(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def fp8_case(tokens, hidden, inter, experts, top_k, *, seed=0, scale_dtype=torch.float32):
    """BF16 inputs, FP32 master weights and their block-quantized FP8 form."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    gu = torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    dn = torch.randn(experts, hidden, inter, generator=g) * inter**-0.5
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=g)
    gq, gs = r8.quantize_weight_blocks(gu, scale_dtype)
    dq, ds = r8.quantize_weight_blocks(dn, scale_dtype)
    return x, (gu, dn), (gq, gs, dq, ds), idx, w


def interleave(gu):
    e, two_i, h = gu.shape
    return torch.stack([gu[:, : two_i // 2], gu[:, two_i // 2 :]], 2).reshape(e, two_i, h)


@pytest.mark.parametrize("inter", [192, 256, 64])
def test_scale_rows_follow_transformers_quantizer(inter):
    """transformers' FP8 quantizer block-quantizes the fused gate|up matrix as one [2I, H]
    matrix: row r takes scale row r // 128, also where I % 128 != 0 (I = 192: the middle block
    holds gate and up rows). Its codes and scales, dequantized by the reference, are its own
    dequantization, and the reference's quantizer writes the same bytes."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")

    class Quantizer:
        class quantization_config:  # noqa: N801 (transformers' attribute name)
            weight_block_size = (128, 128)
            scale_fmt = "float"

    w = torch.randn(3, 2 * inter, 256, generator=torch.Generator().manual_seed(inter))
    got = fp8.Fp8Quantize(Quantizer())._quantize_one("mlp.experts.gate_up_proj", w)
    q, s = got["mlp.experts.gate_up_proj"], got["mlp.experts.gate_up_proj_scale_inv"]
    assert s.shape == (3, r8.cdiv(2 * inter, 128), 2)
    theirs = fp8._dequantize_fp8_weight(q, s, [128, 128], torch.float32)
    assert torch.equal(r8.dequantize_weight_f64(q, s).float(), theirs)
    mq, ms = r8.quantize_weight_blocks(w)
    assert torch.equal(ms, s)
    assert torch.equal(mq.view(torch.uint8), q.view(torch.uint8))


def test_reference_formula_and_layouts():
    """The reference against an independent evaluation of the formula (per-token group
    quantization, per-block dots in FP64, scaled, summed; silu; group quantization of ``a``);
    the interleaved layout and UE8M0 scales give the same bits as their counterparts."""
    x, _master, (gq, gs, dq, ds), idx, w = fp8_case(3, 200, 192, 4, 2, seed=1)
    got = ref.moe_experts_reference(
        x, gq, dq, idx, w, gate_up_proj_scale_inv=gs, down_proj_scale_inv=ds
    )

    def block_product(v, wq, ws):  # v [H] rounded activation, wq [N, K] codes, ws [nb, kb]
        q, s = r8.per_token_group_quant_8bit_reference(v[None], 128)
        acc = torch.zeros(wq.shape[0], dtype=torch.float64)
        for b in range(r8.cdiv(wq.shape[1], 128)):
            ks = slice(128 * b, 128 * (b + 1))
            dot = wq[:, ks].double() @ q[0, ks].double()
            rows = torch.arange(wq.shape[0]) // 128
            acc += dot * s[0, b].double() * ws[rows, b].double()
        return acc.float()

    want = torch.zeros(3, 200)
    for t in range(3):
        acc = torch.zeros(200)
        for k in range(2):
            e = int(idx[t, k])
            h = block_product(x[t], gq[e], gs[e])
            g, u = h[:192], h[192:]
            a = (g * torch.sigmoid(g) * u).to(torch.bfloat16)
            y = block_product(a, dq[e], ds[e])
            acc = ref.fma_ftz_f32(y, w[t, k].expand(200), acc)
        want[t] = acc
    assert rel_rms(got, want.to(torch.bfloat16)) < 2**-8
    # interleaved storage: with one scale per expert, the codes permuted with their rows are the
    # same matrix, so the same bits; UE8M0 scales of the same values too
    one = gs[:, :1, :1].expand_as(gs).contiguous()
    kw = dict(down_proj_scale_inv=ds)
    st = ref.moe_experts_reference(x, gq, dq, idx, w, gate_up_proj_scale_inv=one, **kw)
    il = ref.moe_experts_reference(
        x, interleave(gq), dq, idx, w, gate_up_proj_scale_inv=one, gate_up_layout="interleaved",
        **kw,
    )  # fmt: skip
    assert_bitwise_equal(il, st, "interleaved layout")
    p2 = torch.full_like(one, 2.0**-7)
    a = ref.moe_experts_reference(x, gq, dq, idx, w, gate_up_proj_scale_inv=p2, **kw)
    b = ref.moe_experts_reference(x, gq, dq, idx, w, gate_up_proj_scale_inv=p2.to(E8M0), **kw)
    assert_bitwise_equal(b, a, "UE8M0 scales")


def _call_kwargs(x, fp8, idx, w, out):
    gq, gs, dq, ds = fp8
    return dict(
        hidden_states=x,
        gate_up_proj=gq,
        down_proj=dq,
        top_k_index=idx,
        top_k_weights=w,
        gate_up_proj_scale_inv=gs,
        down_proj_scale_inv=ds,
        out=out,
    )


def test_accumulation_knob_picks_one_mode_for_every_tile(monkeypatch):
    """MOEFUSE_FP8_ACCUMULATION sets the MMA accumulation of the FP8 experts and fp8_linear tiles
    at every token count (one mode, so the bits never follow the batch); a bad value is named."""
    from moefuse.moe import tiles

    for value, code in (("block", 0), ("k32", 1), ("fp16", 2), ("", 0)):
        monkeypatch.setenv("MOEFUSE_FP8_ACCUMULATION", value)
        for tokens in (1, 16, 64, 4096):
            assert tiles.experts_fp8_tile(2048, 768, tokens, tokens * 8)["accumulation"] == code
            assert tiles.linear_fp8_plan(tokens, 4096, 7168)["accumulation"] == code
    monkeypatch.setenv("MOEFUSE_FP8_ACCUMULATION", "fast")
    with pytest.raises(ValueError, match="MOEFUSE_FP8_ACCUMULATION"):
        tiles.experts_fp8_tile(2048, 768, 1, 8)


def test_fp8_bad_inputs_raise_and_write_nothing():
    x, _m, fp8, idx, w = fp8_case(3, 200, 192, 4, 2)
    gq, gs, dq, ds = fp8
    out = poison_(torch.empty(3, 200, dtype=torch.bfloat16))

    def call(**change):
        args = _call_kwargs(x, fp8, idx, w, out)
        args.update(change)
        return lambda: moefuse.moe_experts(**args)

    for name, change in (
        ("gate_up_proj_scale_inv", dict(gate_up_proj_scale_inv=None)),
        ("gate_up_proj_scale_inv", dict(gate_up_proj_scale_inv=gs[:, :2])),
        ("gate_up_proj_scale_inv", dict(gate_up_proj_scale_inv=gs.half())),
        ("gate_up_proj_scale_inv", dict(gate_up_proj_scale_inv=torch.ones(4, 4, 2))),
        ("down_proj_scale_inv", dict(down_proj_scale_inv=ds[:, :, :1])),
        ("down_proj_scale_inv", dict(down_proj_scale_inv=None)),
        ("down_proj", dict(down_proj=dq.to(torch.bfloat16))),
        ("block_size", dict(block_size=(64, 64))),
        ("transposed", dict(transposed=True)),
        ("gate_up_layout", dict(gate_up_layout="paired")),
        ("hidden_states", dict(hidden_states=x.to(torch.float8_e4m3fn))),
        ("out", dict(out=torch.empty(3, 200, dtype=torch.float8_e4m3fn))),
    ):
        expect_value_error(call(**change), name, out)
    bf = x.new_zeros(4, 384, 200), x.new_zeros(4, 200, 192)
    with pytest.raises(ValueError, match="gate_up_proj_scale_inv"):
        moefuse.moe_experts(x, *bf, idx, w, gate_up_proj_scale_inv=gs)
    # transformers allocates two scale rows for a gate|up matrix of fewer than 128 rows
    x2, _m2, (gq2, gs2, dq2, ds2), idx2, w2 = fp8_case(2, 130, 40, 3, 2)
    assert gs2.shape[1] == 1
    two = torch.cat([gs2, torch.full_like(gs2, float("nan"))], 1)
    a = moefuse.moe_experts(x2, gq2, dq2, idx2, w2, gate_up_proj_scale_inv=gs2,
                            down_proj_scale_inv=ds2, impl="reference")  # fmt: skip
    b = moefuse.moe_experts(x2, gq2, dq2, idx2, w2, gate_up_proj_scale_inv=two,
                            down_proj_scale_inv=ds2, impl="reference")  # fmt: skip
    assert_bitwise_equal(b, a, "an unused second scale row")


def test_fp8_linear_reference_and_bad_inputs():
    from moefuse.moe.linear import fp8_linear

    g = torch.Generator().manual_seed(5)
    w = torch.randn(300, 200, generator=g) * 200**-0.5
    wq, ws = r8.quantize_weight_blocks(w)
    x = torch.randn(2, 3, 200, generator=g).to(torch.bfloat16)
    bias = torch.randn(300, generator=g).to(torch.bfloat16)
    y = fp8_linear(x, wq, ws, bias, impl="reference")
    assert y.shape == (2, 3, 300) and y.dtype == torch.bfloat16
    exact = x.float() @ w.T + bias.float()
    assert rel_rms(y, exact) < 2**-4
    q, s = r8.per_token_group_quant_8bit_reference(x, 128)
    pre = fp8_linear(q, wq, ws, bias, input_scale=s, impl="reference")
    assert_bitwise_equal(pre, y, "pre-quantized input")
    out = poison_(torch.empty(2, 3, 300, dtype=torch.bfloat16))
    for name, change in (
        ("weight", dict(weight=w)),
        ("weight_scale_inv", dict(weight_scale_inv=ws[:, :1])),
        ("input", dict(input=x[..., :100])),
        ("input_scale", dict(input=q, input_scale=s[..., :1])),
        ("bias", dict(bias=bias[:10])),
        ("block_size", dict(block_size=(128, 64))),
        ("out", dict(out=torch.empty(2, 3, 300))),
    ):
        args = dict(input=x, weight=wq, weight_scale_inv=ws, bias=bias, out=out)
        args.update(change)
        expect_value_error(lambda a=args: fp8_linear(**a), name, out)


# ----------------------------------------------------------------------------- kernels
def poison_unrouted(fp8, idx):
    """NaN codes (0x7F) and NaN scales in every expert no slot routes to: never read."""
    gq, gs, dq, ds = (t.clone() for t in fp8)
    used = set(idx[(idx >= 0) & (idx < gq.shape[0])].tolist())
    for e in range(gq.shape[0]):
        if e not in used:
            for q, s in ((gq, gs), (dq, ds)):
                q[e].view(torch.uint8).fill_(0x7F)
                s[e] = float("nan")
    return gq, gs, dq, ds


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,layout,scale_dtype", [
    (1, 200, 100, 6, 1, "stacked", torch.float32),
    (3, 130, 192, 5, 4, "interleaved", E8M0),
    (4, 256, 72, 9, 8, "stacked", E8M0),
    (4, 72, 136, 4, 2, "interleaved", torch.float32),
])  # fmt: skip
def test_fp8_kernels_match_reference(tokens, hidden, inter, experts, top_k, layout, scale_dtype):
    """Odd H and I (partial 128-blocks in both GEMMs, I % 128 != 0 so a scale block holds gate
    and up rows), K = 1..8, sentinels, both layouts and scale dtypes; unrouted experts' codes and
    scales NaN, the output poisoned: the kernels within 2^-8 relative RMS of the reference; the
    plan kernel (with and without tail tiles), the inline plan and the quantizations placed
    inside the GEMM programs (the tokens per K-block in gate|up, with the activation then
    quantized by the gate|up kernel's last programs or per K-block in down) give the same
    bits."""
    from moefuse.moe.experts_fp8 import launch_moe_experts_fp8

    x, (gu, dn), _fp8, idx, w = fp8_case(tokens, hidden, inter, experts, top_k, seed=tokens)
    if layout == "interleaved":
        gu = interleave(gu)
    fp8 = (*r8.quantize_weight_blocks(gu, scale_dtype), *r8.quantize_weight_blocks(dn, scale_dtype))
    if top_k > 1:
        idx[0, -1] = experts + 2  # expert-parallel sentinels
        idx[-1, 0] = -1
    gq, gs, dq, ds = poison_unrouted(fp8, idx)
    kw = dict(gate_up_proj_scale_inv=gs, down_proj_scale_inv=ds, gate_up_layout=layout)
    want = moefuse.moe_experts(x, gq, dq, idx, w, impl="reference", **kw)
    assert torch.isfinite(want.float()).all()
    out = poison_(torch.empty_like(x))
    got = moefuse.moe_experts(x, gq, dq, idx, w, out=out, impl="triton", **kw)
    assert got is out and rel_rms(got, want) < 2**-8, rel_rms(got, want)
    for tile in (
        {"inline_plan_slots": 0},
        {"inline_plan_slots": 0, "tail_tile": 16},
        {"fuse_tokens_quant": True, "fuse_act_quant": False},
        {"fuse_tokens_quant": True, "fuse_act_quant": True},
        {"fuse_tokens_quant": True, "down_act_quant": True, "inline_plan_slots": 0},
    ):
        out = poison_(torch.empty_like(x))
        launch_moe_experts_fp8(
            x, gq, gs, dq, ds, idx, w, out, None, None, 1.0, layout == "interleaved", False,
            tile=tile,
        )  # fmt: skip
        assert_bitwise_equal(out, got, f"{tile}")


def test_fp8_batch_invariance_and_extensions():
    """A token's bits alone == inside the batch, at token tiles of 16 and 32 and with the plan
    kernel (the interpreter's block dots are exact, so its bits are a fixed function of the
    codes); bias, shared expert output and routed scaling factor as in the BF16 op."""
    from moefuse.moe.experts_fp8 import launch_moe_experts_fp8

    x, _m, (gq, gs, dq, ds), idx, w = fp8_case(12, 160, 96, 5, 3, seed=11)
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(5, 160, generator=g).to(torch.bfloat16)
    shared = torch.randn(12, 160, generator=g).to(torch.bfloat16)
    kw = dict(bias=bias, shared_expert_output=shared, routed_scaling_factor=1.5)
    full = moefuse.moe_experts(
        x, gq, dq, idx, w, gate_up_proj_scale_inv=gs, down_proj_scale_inv=ds, impl="triton", **kw
    )
    want = ref.moe_experts_reference(
        x, gq, dq, idx, w, gate_up_proj_scale_inv=gs, down_proj_scale_inv=ds, **kw
    )
    assert rel_rms(full, want) < 2**-8
    for j in (0, 7):
        alone = moefuse.moe_experts(
            x[j : j + 1], gq, dq, idx[j : j + 1], w[j : j + 1], gate_up_proj_scale_inv=gs,
            down_proj_scale_inv=ds, impl="triton", bias=bias,
            shared_expert_output=shared[j : j + 1], routed_scaling_factor=1.5,
        )  # fmt: skip
        assert_bitwise_equal(alone[0], full[j], f"token {j} alone")
    for bt, tile in ((16, {"inline_plan_slots": 0}), (32, {"fuse_finalize_slots": 0})):
        out = poison_(torch.empty_like(full))
        launch_moe_experts_fp8(
            x, gq, gs, dq, ds, idx, w, out, bias, shared, 1.5, False, False, tile=tile,
            token_tile=bt,
        )  # fmt: skip
        assert_bitwise_equal(out, full, f"token tile {bt}")


@pytest.mark.parametrize("layout,scale_dtype,tile", [
    ("stacked", torch.float32, {"bn_gate_up": 64, "bn_down": 128, "stages": 2}),
    ("interleaved", E8M0, {"bn_gate_up": 32, "bn_down": 64, "stages": 3, "tail_tile": 16}),
    ("stacked", E8M0, {"bn_gate_up": 128, "bn_down": 128, "stages": 2, "fuse_act_quant": True}),
    ("stacked", torch.float32, {"bn_gate_up": 64, "bn_down": 64, "down_persistent": 2}),
    ("stacked", E8M0, {"bn_gate_up": 128, "fuse_act_quant": True, "gate_up_persistent": 2}),
])  # fmt: skip
def test_fp8_experts_tma_launch(monkeypatch, layout, scale_dtype, tile):
    """The ``tma`` launches (tokens on the MMA's M side, weight tiles by TMA; experts_fp8_tma)
    give the default launches' bits with the plan kernel's work items, sentinels, partial
    K-blocks (H = 144) and partial last row tiles (down's 128-row tile of H = 144, interleaved
    gate|up's 32-row tile of I = 200: the next expert's rows read and dropped); down runs there
    only where I % 16 == 0 (interleaved: I = 200, the other launch). With ``fuse_act_quant``
    and 128 gate|up rows the gate|up program writes the activation's group codes and scales
    itself ("+quant"): the standalone quantization's bytes. ``down_persistent`` /
    ``gate_up_persistent``: the down / gate|up tiles on a persistent grid (off CUDA one SM: 2
    programs walk every item's row tiles)."""
    import moefuse.moe.experts_fp8 as ef
    from moefuse.moe import tiles

    ran = []
    for fn in ("launch_gate_up_fp8_tma", "launch_down_fp8_tma"):
        real = getattr(ef, fn)

        def spy(*a, _r=real, _n=fn, **k):
            ran.append(_n + ("+quant" if len(a) > 10 and a[10] is not None else ""))
            return _r(*a, **k)

        monkeypatch.setattr(ef, fn, spy)
    inter = 256 if layout == "stacked" else 200
    x, (gu, dn), _fp8, idx, w = fp8_case(40, 144, inter, 3, 4, seed=5)
    if layout == "interleaved":
        gu = interleave(gu)
    gq, gs = r8.quantize_weight_blocks(gu, scale_dtype)
    dq, ds = r8.quantize_weight_blocks(dn, scale_dtype)
    idx[0, -1] = 5  # an expert-parallel sentinel
    il = layout == "interleaved"
    want = poison_(torch.empty_like(x))
    base = {"inline_plan_slots": 0}
    # the pointer kernels (the policy would take the 64-slot TMA items at this mean load)
    pointer = dict(base, **tiles.EXPERTS_FP8_NARROW, tma=False, fuse_act_quant=False)
    ef.launch_moe_experts_fp8(x, gq, gs, dq, ds, idx, w, want, None, None, 1.0, il, False,
                              tile=pointer, token_tile=64)  # fmt: skip
    assert not ran
    out = poison_(torch.empty_like(x))
    tma = dict(base, tma=True, warps=4, **tile)
    ef.launch_moe_experts_fp8(x, gq, gs, dq, ds, idx, w, out, None, None, 1.0, il, False,
                              tile=tma, token_tile=64)  # fmt: skip
    assert_bitwise_equal(out, want, f"{layout} {tma}")
    gate_up = "launch_gate_up_fp8_tma" + ("+quant" if tile.get("fuse_act_quant") else "")
    assert ran == [gate_up] + (["launch_down_fp8_tma"] if not il else []), ran


def test_fp8_experts_tma_default_and_fallbacks(monkeypatch):
    """The policy takes the ``tma`` tile (the activation quantized by the gate|up programs) at
    the widest token tile above the decode slots only. With that tile, a GEMM its launch cannot
    run takes the pointer kernel on the narrow rows and warps and the activation's own launch
    (stacked I = 200: gate|up tiles across the scale block at I, down K % 16 != 0; an
    interleaved gate|up: 128-row tiles across scale blocks), its down GEMM the TMA launch; every
    case with the default's bits."""
    import moefuse.moe.experts_fp8 as ef
    from moefuse.moe import tiles

    many = tiles.experts_fp8_tile(2048, 768, 128, 16384)
    assert many["tma"] and many["fuse_act_quant"]  # the TMA gate|up quantizes the activation
    assert not ef._pointer_tile(many)["fuse_act_quant"]  # the pointer kernel's launch stays
    for token_tile, slots in ((128, 512), (32, 16384)):
        assert "tma" not in tiles.experts_fp8_tile(2048, 768, token_tile, slots)
    # 64-slot items up to a mean load of 128 slots per expert above the decode slots (any load
    # from 128 experts), at the decode slots from a mean load of 16; gate|up 64 rows (the
    # activation's own launch) where 2I or the 128-row grid is small, 128 rows otherwise
    assert tiles.experts_fp8_token_tile(512, 128) == tiles.experts_token_tile(512, 128)  # decode
    assert tiles.experts_fp8_token_tile(8 * 2048, 128) == 64  # Qwen3 T = 2048: mean load 128
    assert tiles.experts_fp8_token_tile(8 * 8192, 128) == 64  # Qwen3 T = 8192: 128 experts
    assert tiles.experts_fp8_token_tile(8 * 1024, 32) == 128  # mean load 256, 32 experts
    assert tiles.experts_fp8_token_tile(2 * 1024, 8) == 128  # Mixtral T = 1024: mean load 256
    assert tiles.experts_fp8_token_tile(2 * 256, 8) == 64  # Mixtral T = 256: mean load 64
    assert tiles.experts_fp8_token_tile(2 * 64, 8) == 64  # Mixtral T = 64: mean load 16
    assert tiles.experts_fp8_token_tile(2 * 32, 8) == tiles.experts_token_tile(64, 8)
    qwen3 = tiles.experts_fp8_tile(2048, 768, 64, 8 * 2048, 128)
    assert qwen3["tma"] and qwen3["warps"] == 4 and qwen3["bn_gate_up"] == 64
    assert not qwen3["fuse_act_quant"]
    for experts in (0, 256):  # DeepSeek-V3 T = 2048: 16,256 programs of 128 rows
        dsv3 = tiles.experts_fp8_tile(7168, 2048, 64, 8 * 2048, experts)
        assert dsv3["tma"] and dsv3["bn_gate_up"] == 128 and dsv3["fuse_act_quant"]
    dsv3 = tiles.experts_fp8_tile(7168, 2048, 64, 8 * 256, 256)  # T = 256: 9,088 programs
    assert dsv3["tma"] and dsv3["bn_gate_up"] == 64 and not dsv3["fuse_act_quant"]
    mixtral = tiles.experts_fp8_tile(4096, 14336, 64, 2 * 256, 8)  # at the decode slots
    assert mixtral["tma"] and mixtral["bn_gate_up"] == 64
    assert tiles.experts_fp8_decode_tile(4096, 14336, 64, 2 * 256) == {}
    assert "tma" not in tiles.experts_fp8_tile(4096, 14336, 64, 2 * 32, 8)  # mean load 8
    # the launcher keeps the 64-slot items only where their gate|up takes the TMA launch on a
    # stacked layout: not interleaved (untimed on a GPU), not I % 128 != 0, not unaligned rows
    without = tiles.experts_fp8_token_tile(600, 8, tma64=False)
    assert tiles.experts_fp8_token_tile(600, 8) == 64 != without
    cases = ((128, 64, False, 64), (128, 64, True, without), (200, 64, False, without))
    for inter, hidden, il, want in (*cases, (128, 72, False, without)):
        weight = torch.zeros(8, 2 * inter, hidden, dtype=torch.uint8)
        assert ef.policy_token_tile(600, 8, weight, inter, il) == want, (inter, hidden, il)
    ran, pointer = [], []
    for fn in ("launch_gate_up_fp8_tma", "launch_down_fp8_tma"):
        real = getattr(ef, fn)
        monkeypatch.setattr(ef, fn, lambda *a, _r=real, _n=fn: ran.append((_n, a[7])) or _r(*a))
    real_launch = ef.launch
    monkeypatch.setattr(ef, "launch", lambda k, g, *a, **c: pointer.append(
        (k.fn.__name__, g[1], c["num_warps"])) or real_launch(k, g, *a, **c))  # fmt: skip
    for layout, inter in (("stacked", 200), ("interleaved", 256)):
        il = layout == "interleaved"
        x, (gu, dn), _fp8, idx, w = fp8_case(24, 144, inter, 3, 4, seed=9)
        gq, gs = r8.quantize_weight_blocks(interleave(gu) if il else gu, torch.float32)
        dq, ds = r8.quantize_weight_blocks(dn, torch.float32)
        want = poison_(torch.empty_like(x))
        base = {"inline_plan_slots": 0, "fuse_act_quant": False}  # the many-slot keys
        ef.launch_moe_experts_fp8(x, gq, gs, dq, ds, idx, w, want, None, None, 1.0, il, False,
                                  tile=base, token_tile=128)  # fmt: skip
        ran.clear(), pointer.clear()
        out = poison_(torch.empty_like(x))
        tma = {**base, **tiles.EXPERTS_FP8_TMA}
        ef.launch_moe_experts_fp8(x, gq, gs, dq, ds, idx, w, out, None, None, 1.0, il, False,
                                  tile=tma, token_tile=128)  # fmt: skip
        assert_bitwise_equal(out, want, layout)
        gemms = [p for p in pointer if "gate_up" in p[0] or "down" in p[0]]
        narrow = tiles.EXPERTS_FP8_NARROW
        gate_up = (
            "_experts_fp8_gate_up_kernel",
            -(-inter // narrow["bn_gate_up"]),
            narrow["warps"],
        )
        down = ("_experts_fp8_down_kernel", -(-144 // narrow["bn_down"]), narrow["warps"])
        if il:
            assert [n for n, _ in ran] == ["launch_down_fp8_tma"] and gemms == [gate_up], (
                ran,
                gemms,
            )
        else:
            assert not ran and sorted(gemms) == sorted([gate_up, down]), (ran, gemms)


def _plan_replays_match_slow_path(call, inputs) -> None:
    """``call(x)`` for each of ``inputs`` in turn (the first records a launch plan, the next ones
    replay it on fresh inputs) gives the bits of the same call with plans off."""
    from moefuse import _fastpath as fp

    for x in inputs:
        got = call(x)
        fp.ENABLED[0] = False
        try:
            assert_bitwise_equal(got, call(x), "plan")
        finally:
            fp.ENABLED[0] = True


def test_fp8_linear_kernel(monkeypatch):
    """fp8_linear in the interpreter: within 2^-8 of the reference with bias and UE8M0 scales,
    partial blocks in N and K; the split launch (its chunk sums added by each tile's last
    program, or by the reduce kernel), the in-register chunks and the wide tile give the same
    bits; a row alone == in the batch; pre-quantized input (per_token_group_quant_8bit's codes
    and scales, added by the reduce kernel: nothing zeroes counters before) == the op's own
    quantization."""
    import moefuse.moe.experts_fp8_quant as efq
    import moefuse.moe.linear_triton as lt
    import moefuse.quant.group_triton as gt
    from moefuse.moe.linear_triton import launch_fp8_linear

    g = torch.Generator().manual_seed(21)
    n, k = 200, 520  # 5 K-blocks: split into chunks (the last one short)
    w = torch.randn(n, k, generator=g) * k**-0.5
    wq, ws = r8.quantize_weight_blocks(w, E8M0)
    x = torch.randn(5, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g).to(torch.bfloat16)
    out = poison_(torch.empty(5, n, dtype=torch.bfloat16))
    got = moefuse.fp8_linear(x, wq, ws, bias, out=out, impl="triton")
    want = moefuse.fp8_linear(x, wq, ws, bias, impl="reference")
    assert got is out and rel_rms(got, want) < 2**-8
    kernels = []
    for mod in (lt, efq, gt):  # every launch of the op, by kernel name
        monkeypatch.setattr(mod, "launch", naming_launch(mod.launch, kernels))
    one = ["_group_quant_kernel", "_fp8_linear_kernel"]
    split = ["_tokens_quant_kernel", "_fp8_linear_kernel"]  # the chunks added by the last program
    reduce = [*one, "_fp8_linear_reduce_kernel"]
    for tile, ran in (
        ({"split_programs": False}, one),
        ({"split_programs": True, "fused_reduce": True}, split),
        ({"split_programs": True, "fused_reduce": False}, reduce),
        ({"split_programs": True, "fused_reduce": True, "bn": 64, "bt": 16}, split),  # 4 row tiles
        ({"bn": 128, "bt": 128, "warps": 8, "split_programs": False}, one),
    ):
        o = poison_(torch.empty_like(got))
        kernels.clear()
        launch_fp8_linear(x, wq, ws, bias, None, o, False, tile=tile)
        assert_bitwise_equal(o, got, f"{tile}")
        assert kernels == ran, (tile, kernels)
    alone = moefuse.fp8_linear(x[3:4], wq, ws, bias, impl="triton")
    assert_bitwise_equal(alone[0], got[3], "a row alone")
    q, s = moefuse.per_token_group_quant_8bit(x, 128, impl="reference")
    kernels.clear()
    o = poison_(torch.empty_like(got))
    pre = moefuse.fp8_linear(q, wq, ws, bias, input_scale=s, impl="triton", out=o)
    assert_bitwise_equal(pre, got, "pre-quantized input")
    assert kernels == reduce[1:], kernels
    o = poison_(torch.empty_like(got))
    kernels.clear()  # no launch of the op's own before it to zero counters: the reduce kernel
    tile = {"split_programs": True, "fused_reduce": True}
    launch_fp8_linear(q, wq, ws, bias, s, o, False, tile=tile)
    assert_bitwise_equal(o, got, "pre-quantized input, fused_reduce")
    assert kernels == reduce[1:], kernels
    workspace = torch.zeros(132, dtype=torch.int32)  # counters of the caller's: left zeroed
    for inp, scales, ran in ((q, s, one[1:]), (x, None, one), (q, s, one[1:])):
        o = poison_(torch.empty_like(got))
        kernels.clear()
        launch_fp8_linear(inp, wq, ws, bias, scales, o, False, tile=tile, workspace=workspace)
        assert_bitwise_equal(o, got, f"workspace, pre-quantized {scales is not None}")
        assert kernels == ran and not workspace.any(), (kernels, workspace)


def test_fp8_experts_prefetch_down_slices():
    """Tile key ``prefetch_down``: the chunk bytes each gate|up program asks the L2 for, 16
    chunks per program, cover its expert's down weights (a multiple of 16 bytes each); none in
    the interpreter, without the key, or where an expert is not one aligned contiguous run. In
    the interpreter the launch with the key gives the default's bits."""
    from moefuse.moe.experts_fp8 import _prefetch_down_bytes

    key = {"prefetch_down": True}
    down = torch.empty(4, 2048, 768, dtype=torch.float8_e4m3fn)  # Qwen3: 24 programs per item
    chunk = _prefetch_down_bytes(key, down, 24, True)
    assert chunk == 4096 and chunk % 16 == 0 and 24 * 16 * chunk >= 2048 * 768
    assert _prefetch_down_bytes(key, down, 7, True) * 7 * 16 >= 2048 * 768
    assert _prefetch_down_bytes({}, down, 24, True) == 0
    assert _prefetch_down_bytes(key, down, 24, False) == 0
    assert _prefetch_down_bytes(key, down[:, :, :700], 24, True) == 0  # rows not contiguous
    g = torch.Generator().manual_seed(31)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)  # H 256, I 128, E 4, K 2
    gq, gs = r8.quantize_weight_blocks(torch.randn(4, 256, 256, generator=g) * 0.06, E8M0)
    dq, ds = r8.quantize_weight_blocks(torch.randn(4, 256, 128, generator=g) * 0.09, E8M0)
    idx = torch.tensor([[0, 2], [1, 3], [2, 0]])
    w = torch.rand(3, 2, generator=g)
    kw = dict(gate_up_proj_scale_inv=gs, down_proj_scale_inv=ds, impl="triton")
    want = moefuse.moe_experts(x, gq, dq, idx, w, **kw)
    from moefuse.moe.experts_fp8 import launch_moe_experts_fp8

    got = poison_(torch.empty_like(want))
    launch_moe_experts_fp8(x, gq, gs, dq, ds, idx, w, got, None, None, 1.0, False, False, tile=key)
    assert_bitwise_equal(got, want, "prefetch_down")


def test_fp8_linear_fused_reduce_knob(monkeypatch):
    """``MOEFUSE_FP8_LINEAR_FUSED_REDUCE`` sets the split launch's ``fused_reduce``; unset, the
    policy's constant decides."""
    from moefuse.moe import tiles

    for value, want in (("1", True), ("0", False), ("", tiles.LINEAR_FP8_FUSED_REDUCE)):
        monkeypatch.setenv("MOEFUSE_FP8_LINEAR_FUSED_REDUCE", value)
        assert tiles.linear_fp8_plan(1, 4096, 2048)["fused_reduce"] is want, value


def test_fp8_linear_fused_reduce_plan_replays(monkeypatch):
    """With ``fused_reduce`` as the policy, a launch plan of the split launch replays its
    counters' allocation, the quantization launch that zeroes them and the product on fresh
    inputs, with the slow path's bits and no reduce kernel; without bias, FP32 scales."""
    import moefuse.moe.linear_triton as lt
    from moefuse import _fastpath as fp

    policy = lt.linear_fp8_plan
    monkeypatch.setattr(
        lt, "linear_fp8_plan", lambda m, n, k: dict(policy(m, n, k), fused_reduce=True)
    )
    kernels = []
    monkeypatch.setattr(lt, "launch", naming_launch(lt.launch, kernels))
    fp.clear()
    g = torch.Generator().manual_seed(23)
    wq, ws = r8.quantize_weight_blocks(torch.randn(200, 520, generator=g) * 0.05, torch.float32)
    try:
        _plan_replays_match_slow_path(
            lambda x: moefuse.fp8_linear(
                x, wq, ws, out=poison_(torch.empty(3, 200, dtype=x.dtype)), impl="triton"
            ),
            [torch.randn(3, 520, generator=g).to(torch.bfloat16) for _ in range(3)],
        )
        assert fp.plan_count(moefuse.fp8_linear) == 1, fp.refusals(moefuse.fp8_linear)
        assert kernels == ["_fp8_linear_kernel"] * 4, kernels  # the recording, three slow calls
        assert policy(3, 200, 520)["split_programs"]
    finally:
        fp.clear()


def test_fp8_linear_tma_launch(monkeypatch):
    """The ``tma`` tile (tokens on the MMA's M side, TMA loads; linear_tma) gives the default
    launch's bits with partial blocks in M, N and K, chunks, bias and UE8M0 scales; it runs
    only where the operands are TMA-readable (K % 16 == 0); a launch plan replays it with its
    descriptors over the next call's tensors, with the slow path's bits."""
    import moefuse.moe.linear_triton as lt
    from moefuse import _fastpath as fp

    ran = []
    real = lt.launch_fp8_linear_tma
    monkeypatch.setattr(lt, "launch_fp8_linear_tma", lambda *a: ran.append(a[-1]) or real(*a))
    g = torch.Generator().manual_seed(22)
    tma = {"tma": True, "bn": 64, "bt": 16, "warps": 4, "stages": 2, "split_programs": False}
    for m, n, k, scale_dtype in ((19, 200, 400, E8M0), (3, 130, 1040, torch.float32)):
        w = torch.randn(n, k, generator=g) * k**-0.5
        wq, ws = r8.quantize_weight_blocks(w, scale_dtype)
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        bias = torch.randn(n, generator=g).to(torch.bfloat16)
        want = moefuse.fp8_linear(x, wq, ws, bias, impl="triton")
        for tile in (tma, dict(tma, bn=128, bt=32)):
            o = poison_(torch.empty_like(want))
            lt.launch_fp8_linear(x, wq, ws, bias, None, o, False, tile=tile)
            assert_bitwise_equal(o, want, f"M={m} N={n} K={k} {tile}")
    assert ran == [2, 2, 3, 3], ran  # chunks: (200, 400) 2 of its 4 blocks, (130, 1040) 3 of 9
    x = torch.randn(4, 520, generator=g).to(torch.bfloat16)  # K % 16 != 0: the other launch
    wq, ws = r8.quantize_weight_blocks(torch.randn(70, 520, generator=g) * 0.05, torch.float32)
    lt.launch_fp8_linear(x, wq, ws, None, None, torch.empty(4, 70, dtype=x.dtype), False, tile=tma)
    assert len(ran) == 4
    policy = lt.linear_fp8_plan
    monkeypatch.setattr(lt, "linear_fp8_plan", lambda m, n, k: dict(policy(m, n, k), **tma))
    fp.clear()
    wq, ws = r8.quantize_weight_blocks(torch.randn(70, 256, generator=g) * 0.05, torch.float32)
    _plan_replays_match_slow_path(
        lambda x: moefuse.fp8_linear(x, wq, ws, impl="triton"),
        [torch.randn(5, 256, generator=g).to(torch.bfloat16) for _ in range(3)],
    )
    assert fp.plan_count(moefuse.fp8_linear) == 1, fp.refusals(moefuse.fp8_linear)
    assert len(ran) == 4 + 4  # the recording and three slow calls: the replays skip the launcher
    fp.clear()


def offline_gluon_compile(module: str, *args) -> dict:
    """``module.compile_offline(*args)`` (a Gluon kernel for sm_90a) in a fresh Python process
    without the interpreter: its PTX, shared bytes and ptxas's report. In this process an
    interpreter launch before it leaves Triton's frontend unable to compile Gluon (``gl.fma``
    called without ``_semantic``, seen whenever the compile misses Triton's cache)."""
    from moefuse.tools.ptxas import PTXAS

    if not os.path.exists(PTXAS):
        pytest.skip("no ptxas bundled with this Triton")
    code = (
        "import json, sys\n"
        "from importlib import import_module\n"
        "from moefuse.tools.ptxas import ptxas_report\n"
        "kernel = import_module(sys.argv[1]).compile_offline(*json.loads(sys.argv[2]))\n"
        "report = ptxas_report(kernel.asm['ptx'])\n"
        "print(json.dumps(dict(ptx=kernel.asm['ptx'], shared=kernel.metadata.shared,\n"
        "    regs=report.regs, spills=report.spills, rc=report.returncode, log=report.log)))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code, module, json.dumps(args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize(
    "n,k,tile,chunk,e8m0",
    [
        (7168, 16384, {"bt": 128, "bn": 128, "warps": 8, "stages": 3}, 64, False),
        (1000, 1040, {"bt": 128, "bn": 128, "warps": 8, "stages": 4}, 0, True),
        (4096, 2048, {"bt": 64, "bn": 128, "warps": 4, "stages": 3}, 4, False),
    ],
)
def test_fp8_linear_wgmma_compiles_for_sm90(n, k, tile, chunk, e8m0):
    """The Gluon launch (tile key ``wgmma``; the interpreter cannot run Gluon, the GPU tests
    compare its bits with the TMA launch's) compiles for sm_90a with the bundled ptxas: no
    spills, its shared memory within the H100's, and the loop waits with one MMA still in
    flight (block b runs while block b - 1 is scaled)."""
    kernel = offline_gluon_compile("moefuse.moe.linear_wgmma", n, k, tile, chunk, e8m0)
    ptx = kernel["ptx"]
    assert kernel["rc"] == 0 and kernel["spills"] == 0, kernel["log"]
    assert kernel["shared"] <= 227 * 1024
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "griddepcontrol.wait" in ptx


@pytest.mark.parametrize(
    "hidden,inter,bt,stages,e8m0", [(2048, 768, 64, 4, False), (7168, 2048, 128, 3, True)]
)
def test_fp8_experts_down_wgmma_compiles_for_sm90(hidden, inter, bt, stages, e8m0):
    """The experts' Gluon down GEMM (tile key ``down_wgmma``) compiles for sm_90a: no spills,
    16-byte ``cp.async`` copies of the gathered activation rows, one MMA left in flight."""
    args = (hidden, inter, bt, 128, stages, e8m0)
    kernel = offline_gluon_compile("moefuse.moe.experts_fp8_wgmma", *args)
    ptx = kernel["ptx"]
    assert kernel["rc"] == 0 and kernel["spills"] == 0, kernel["log"]
    assert kernel["shared"] <= 227 * 1024
    assert "cp.async.cg.shared.global" in ptx and "cp.async.ca.shared.global" not in ptx
    assert "wgmma.wait_group.sync.aligned 1;" in ptx


def test_fp8_linear_tma_policy_and_fallback(monkeypatch):
    """From LINEAR_FP8_TMA_MIN_ROWS rows the plan takes the ``tma`` tile where its row tiles
    fill the GPU, else from LINEAR_FP8_TMA_NARROW_MIN_ROWS the 64-row one (from
    LINEAR_FP8_TMA_FEW_MIN_ROWS where that one's grid has enough programs), and keeps the pointer
    kernel's plan beside it; operands TMA cannot read (K % 16 != 0) run that pointer tile, with
    the default's bits."""
    import moefuse.moe.linear_triton as lt
    from moefuse.moe import tiles

    wide, narrow = tiles.LINEAR_FP8_TMA, tiles.LINEAR_FP8_TMA_NARROW
    big = tiles.linear_fp8_plan(tiles.LINEAR_FP8_TMA_MIN_ROWS, 7168, 16384)
    assert big["tma"] and (big["bn"], big["bt"]) == (wide["bn"], wide["bt"]), big
    assert not big["pointer_tile"].get("tma")
    for m, n, k in ((tiles.LINEAR_FP8_TMA_MIN_ROWS - 1, 7168, 16384),
                    (tiles.LINEAR_FP8_TMA_NARROW_MIN_ROWS, 4096, 2048),
                    (tiles.LINEAR_FP8_TMA_MIN_ROWS, 512, 2048)):  # fmt: skip
        mid = tiles.linear_fp8_plan(m, n, k)  # (k/v projection: 128 wide tiles, under the GPU)
        assert mid["tma"] and (mid["bt"], mid["warps"]) == (narrow["bt"], narrow["warps"]), mid
        assert not mid["split_programs"] and not mid["pointer_tile"].get("tma")
    few = tiles.LINEAR_FP8_TMA_FEW_MIN_ROWS  # below the narrow tile's rows: where it fills
    assert tiles.linear_fp8_plan(few, 4096, 2048).get("tma")  # 32 x 2 programs
    below = ((few - 1, 7168, 16384), (few, 2048, 4096))
    for m, n, k in (*below, (tiles.LINEAR_FP8_TMA_NARROW_MIN_ROWS - 1, 512, 2048)):
        assert "tma" not in tiles.linear_fp8_plan(m, n, k), (m, n, k)
    g = torch.Generator().manual_seed(23)
    x = torch.randn(4, 520, generator=g).to(torch.bfloat16)
    wq, ws = r8.quantize_weight_blocks(torch.randn(70, 520, generator=g) * 0.05, torch.float32)
    want = moefuse.fp8_linear(x, wq, ws, impl="triton")
    policy = lt.linear_fp8_plan
    tma = {"tma": True, "bn": 128, "bt": 64, "warps": 8, "stages": 2, "split_programs": False}
    monkeypatch.setattr(
        lt,
        "linear_fp8_plan",
        lambda m, n, k: {**policy(m, n, k), **tma, "pointer_tile": policy(m, n, k)},
    )
    tiles_run = []
    real_launch = lt.launch

    def spy(kernel, grid, *args, **consts):
        tiles_run.append(consts.get("BN"))
        real_launch(kernel, grid, *args, **consts)

    monkeypatch.setattr(lt, "launch", spy)
    out = poison_(torch.empty_like(want))
    lt.launch_fp8_linear(x, wq, ws, None, None, out, False)
    assert tiles_run[0] == policy(4, 70, 520)["bn"], tiles_run  # then its chunks' reduce
    assert_bitwise_equal(out, want, "pointer tile")


def test_fp8_linear_plans_fit_shared_memory():
    """Every fp8_linear launch plan at the benchmarked weights and token counts pipelines at most
    what an SM90 program's shared memory holds (227 KiB): ``stages`` x (the weight tile's and
    the token tile's E4M3 bytes of one 128-wide K-block). The wide token tile once met the
    decode stages at M = 4 on a 24,576-row weight and asked for 327 KiB."""
    from moefuse.bench.fp8_linear import ROWS, SHAPES
    from moefuse.moe.tiles import linear_fp8_plan

    for n, k in SHAPES.values():
        for m in sorted({*ROWS, 2, 8, 32, 128, 255, 256, 512, 4096, 65536}):
            cfg = linear_fp8_plan(m, n, k)
            smem = cfg["stages"] * 128 * (cfg["bn"] + cfg["bt"])
            assert smem <= 227 * 1024, (n, k, m, cfg)


def test_fp8_linear_bench_rotates_small_weights():
    """The fp8-linear benchmark rotates a weight over copies spanning twice the L2 (at most 8),
    so a replayed call reads it from DRAM: a 37.8 MB weight on a 50 MiB L2 once timed below the
    datasheet floor."""
    from moefuse.bench.fp8_linear import weight_copies

    l2 = 50 << 20
    assert weight_copies(37_748_736, l2) == 3
    assert weight_copies(8 << 20, l2) == 8  # at most 8
    assert weight_copies(117 << 20, l2) == 1
    assert weight_copies(100 << 20, l2) == 1


def test_fp8_custom_ops_compile_and_plans():
    """opcheck of both custom ops (kernel and reference backends), launch plans replaying the
    eager bits, and torch.compile(fullgraph=True, dynamic=True): one graph for 3 and 6 tokens."""
    from moefuse import _fastpath
    from moefuse.moe import ops

    x, _m, (gq, gs, dq, ds), idx, w = fp8_case(6, 136, 72, 4, 2, seed=31)
    out = torch.empty_like(x)
    # (opcheck's schema test multiplies inputs, which torch does not implement for FP8; the
    # reference backend has the kernel's schema and fake)
    for backend in ("triton",):
        torch.library.opcheck(
            ops.moe_experts_fp8_op,
            (x, gq, gs, dq, ds, idx, w, out, None, None, 1.0, False, False, backend),
            test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
        )
    wq, ws = r8.quantize_weight_blocks(torch.randn(136, 200) * 0.1)
    xl = torch.randn(3, 200).to(torch.bfloat16)
    ol = torch.empty(3, 136, dtype=torch.bfloat16)
    for backend, workspace in (("triton", None), ("triton", torch.zeros(132, dtype=torch.int32))):
        torch.library.opcheck(
            ops.fp8_linear_op,
            (xl, wq, ws, None, None, ol, workspace, False, backend),
            test_utils=("test_faketensor", "test_aot_dispatch_dynamic"),
        )
    kw = dict(gate_up_proj_scale_inv=gs, down_proj_scale_inv=ds, impl="triton")
    eager = moefuse.moe_experts(x, gq, dq, idx, w, **kw)
    again = moefuse.moe_experts(x, gq, dq, idx, w, **kw)
    assert _fastpath.plan_count(moefuse.moe_experts) >= 1
    assert_bitwise_equal(again, eager, "launch plan replay")

    def f(x, idx, w, xl):
        y = moefuse.moe_experts(x, gq, dq, idx, w, **kw) * 1
        return y, moefuse.fp8_linear(xl, wq, ws, impl="triton") * 1

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, dynamic=True, backend="aot_eager")
    for t in (3, 6):
        got = compiled(x[:t], idx[:t], w[:t], xl[: t // 3 + 1])
        want = f(x[:t], idx[:t], w[:t], xl[: t // 3 + 1])
        assert_bitwise_equal(got[0], want[0], f"compiled experts, {t} tokens")
        assert_bitwise_equal(got[1], want[1], f"compiled fp8_linear, {t} tokens")


def test_fp8_fused_activation_quant_is_the_group_quant_op():
    """The gate|up kernel's own quantization of the activation (the last program of each
    128-column group of I) writes the bytes per_token_group_quant_8bit's kernel writes for the
    valid slots' rows, at every tile that changes which programs share a group (32, 64 and 128
    rows of I; a partial last group, I = 136; tails, plan kernel and inline plan; the tokens
    quantized by the gate|up programs themselves), and the experts' output does not change a
    bit with it on or off."""
    x, _m, (gq, gs, dq, ds), idx, w = fp8_case(7, 200, 136, 5, 3, seed=41)
    idx[2, 1] = 9  # an expert-parallel sentinel: its slot's rows are never read
    base = {"inline_plan_slots": 0, "fuse_act_quant": True}
    tiles = (
        {"fuse_act_quant": True},
        base,
        {**base, "tail_tile": 16},
        {**base, "bn_gate_up": 64},
        {**base, "bn_gate_up": 128},
        {"fuse_act_quant": True, "fuse_tokens_quant": True},
    )
    assert_fused_activation_quant(x, (gq, gs, dq, ds), idx, w, tiles, False)


def test_prefetch_only_where_the_work_item_is_known_before_the_wait():
    """The L2 prefetch of the weight rows runs before a program's ``gdc_wait``: only with PDL,
    with inline work items (``plan.sp`` > 0: read from ``top_k_index``, complete once the
    tokens' quantization kernel launched its dependents), never with the tokens quantized in
    the gate|up programs (no kernel of ours before them), on 16-byte aligned rows; the byte
    count is cut to the row and to a multiple of 16."""
    from types import SimpleNamespace

    from moefuse.moe.experts_fp8 import _prefetch_bytes
    from moefuse.moe.linear_triton import _prefetch_bytes as linear_prefetch_bytes

    w = torch.empty(4, 256, 1024, dtype=torch.float8_e4m3fn)
    inline, planned = SimpleNamespace(sp=32), SimpleNamespace(sp=0)
    on = {"prefetch": 1 << 20}
    assert _prefetch_bytes(on, inline, w, True, True) == 1024
    assert _prefetch_bytes({"prefetch": 500}, inline, w, True, True) == 496
    assert _prefetch_bytes({}, inline, w, True, True) == 0
    assert _prefetch_bytes(on, planned, w, True, True) == 0
    assert _prefetch_bytes(on, inline, w, False, True) == 0  # no PDL
    assert _prefetch_bytes(on, inline, w, True, False) == 0  # interpreter
    assert _prefetch_bytes({**on, "fuse_tokens_quant": True}, inline, w, True, True) == 0
    odd = torch.empty(4, 256, 1032, dtype=torch.float8_e4m3fn)[:, :, :1000]
    assert _prefetch_bytes(on, inline, odd, True, True) == 0  # rows of 1000 bytes
    lin = torch.empty(512, 2048, dtype=torch.float8_e4m3fn)
    assert linear_prefetch_bytes({"prefetch": 2050}, lin, True) == 2048
    assert linear_prefetch_bytes({"prefetch": 2048}, lin, False) == 0
    assert linear_prefetch_bytes({"prefetch": 2048}, lin[:, 8:], True) == 0  # 8-byte offset
