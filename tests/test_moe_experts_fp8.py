"""Block-scaled FP8 routed experts and ``fp8_linear`` on CPU: the scale-row convention against
transformers' own FP8 quantizer, the reference's formula, the gate|up layouts, bad input; the
Triton kernels in the interpreter against the reference (odd H and I with partial blocks, K =
1..8, sentinels, both layouts and scale dtypes, poisoned outputs), bitwise batch invariance,
custom ops, torch.compile and launch plans."""

import pytest
import torch

import moefuse
from moefuse.moe import reference as ref
from moefuse.moe import reference_fp8 as r8
from moefuse.testing import assert_bitwise_equal, expect_value_error, poison_

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
