"""Quantization API contract on CPU: bad input raises ValueError naming the argument and writes
nothing; the custom ops pass opcheck and trace under torch.compile(fullgraph=True); supports_*
and impl selection."""

import pytest
import torch

import moefuse
from moefuse.quant import ops
from moefuse.testing import assert_bitwise_equal, expect_value_error

pytestmark = pytest.mark.interpreter

E4M3 = torch.float8_e4m3fn


def _rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fp8_bad_inputs(impl):
    x, s = _rand(4, 64), torch.tensor([0.1])
    out = torch.zeros(4, 64, dtype=E4M3)
    q = lambda **kw: moefuse.fp8_quantize(
        **{"input": x, "scale": s, "out": out, "impl": impl, **kw}
    )
    expect_value_error(lambda: q(input=x.to(torch.int32)), "input", out)
    expect_value_error(lambda: q(scale=torch.tensor([0.1, 0.2])), "scale", out)
    expect_value_error(lambda: q(scale=torch.tensor([1], dtype=torch.float16)), "scale", out)
    expect_value_error(lambda: q(dtype=torch.float16, out=None), "dtype")
    expect_value_error(lambda: q(out=torch.zeros(4, 63, dtype=E4M3)), "out", x)
    expect_value_error(lambda: q(out=torch.zeros(4, 64, dtype=torch.float8_e5m2)), "out", x)
    expect_value_error(lambda: q(input=_rand(64, 4).t()), "input", out)
    expect_value_error(lambda: q(input=_rand(2, 2, 2, 8)), "input", out)
    alias = torch.zeros(4, 64, dtype=torch.bfloat16)
    expect_value_error(lambda: q(input=alias, out=alias.view(E4M3)[:, :64]), "out", alias)
    o, sc = torch.zeros(4, 64, dtype=E4M3), torch.zeros(4, 1)
    bad_sc = torch.zeros(4)
    expect_value_error(
        lambda: moefuse.fp8_quantize_per_token(x, out=o, scale_out=bad_sc, impl=impl),
        "scale_out",
        o,
    )
    expect_value_error(
        lambda: moefuse.fp8_quantize_per_token(
            x, out=torch.zeros(4, 64, dtype=torch.float8_e5m2), scale_out=sc, impl=impl
        ),
        "out",
        sc,
    )
    expect_value_error(lambda: moefuse.fp8_dequantize(o, torch.ones(3, 1), impl=impl), "scale")
    expect_value_error(lambda: moefuse.fp8_dequantize(x, s, impl=impl), "input")
    expect_value_error(
        lambda: moefuse.fp8_dequantize(o, s, out_dtype=torch.int8, impl=impl), "out_dtype"
    )


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fp4_bad_inputs(impl):
    x, gs = _rand(4, 64), torch.tensor([100.0])
    out, sc = torch.full((4, 32), 7, dtype=torch.uint8), torch.full((128, 4), 7, dtype=torch.uint8)
    q = lambda **kw: moefuse.fp4_quantize(
        **{"input": x, "global_scale": gs, "out": out, "scale_out": sc, "impl": impl, **kw}
    )
    expect_value_error(lambda: q(input=_rand(4, 40), out=None, scale_out=None), "input")
    expect_value_error(lambda: q(input=_rand(2, 4, 64)), "input", out, sc)
    expect_value_error(
        lambda: q(global_scale=torch.tensor(100.0).double()), "global_scale", out, sc
    )
    expect_value_error(lambda: q(layout="swizzled"), "layout", out, sc)
    expect_value_error(lambda: q(recipe="exact"), "recipe", out, sc)
    expect_value_error(lambda: q(scale_out=torch.zeros(4, 4, dtype=torch.uint8)), "scale_out", out)
    expect_value_error(lambda: q(out=torch.zeros(4, 32, dtype=torch.int8)), "out", sc)
    buf = torch.zeros(700, dtype=torch.uint8)
    expect_value_error(
        lambda: q(out=buf[:128].view(4, 32), scale_out=buf[64:576].view(128, 4)), "scale_out", buf
    )
    expect_value_error(
        lambda: moefuse.fp4_dequantize(out, sc, gs, layout="linear", impl=impl), "scales", out
    )
    expect_value_error(lambda: moefuse.fp4_dequantize(out[:, :3], sc, gs, impl=impl), "packed")


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fused_bad_inputs(impl):
    x, r, w = _rand(4, 64), _rand(4, 64), _rand(64)
    s, gs = torch.tensor([0.1]), torch.tensor([100.0])
    out = torch.zeros(4, 64, dtype=E4M3)
    expect_value_error(lambda: moefuse.rmsnorm_quant(x.float(), w, s, impl=impl), "input")
    expect_value_error(lambda: moefuse.rmsnorm_quant(x, w[:63], s, impl=impl), "weight")
    expect_value_error(lambda: moefuse.rmsnorm_quant(x, w, 0.1, impl=impl), "scale")
    expect_value_error(lambda: moefuse.rmsnorm_quant(x, w, s, eps=-1.0, impl=impl), "eps")
    expect_value_error(
        lambda: moefuse.rmsnorm_quant(x, w, s, out=torch.zeros(4, 64), impl=impl), "out"
    )
    expect_value_error(
        lambda: moefuse.rmsnorm_quant(x, w, s, out=out, dtype=torch.float8_e5m2, impl=impl),
        "out",
        out,
    )
    expect_value_error(
        lambda: moefuse.rmsnorm_quant(x, w, s, dtype=torch.bfloat16, impl=impl), "dtype"
    )
    expect_value_error(
        lambda: moefuse.rmsnorm_quant(x, w, s, gain_center="1", impl=impl), "gain_center"
    )
    expect_value_error(
        lambda: moefuse.fused_add_rmsnorm_quant(x, None, w, s, impl=impl), "residual"
    )
    expect_value_error(
        lambda: moefuse.fused_add_rmsnorm_fp4_quantize(x, None, w, gs, impl=impl), "residual"
    )
    expect_value_error(
        lambda: moefuse.fused_add_rmsnorm_quant(x, r.half(), w, s, out=out, impl=impl),
        "residual",
        x,
        out,
    )
    expect_value_error(
        lambda: moefuse.fused_add_rmsnorm_quant(x, x, w, s, out=out, impl=impl), "residual", out
    )
    expect_value_error(
        lambda: moefuse.fused_add_rmsnorm_quant(x, r, w, s, out=r.view(E4M3)[:, :64], impl=impl),
        "out",
        r,
    )
    expect_value_error(
        lambda: moefuse.rmsnorm_fp4_quantize(_rand(4, 40), _rand(40), gs, impl=impl), "input"
    )
    expect_value_error(
        lambda: moefuse.rmsnorm_fp4_quantize(x, w, gs, norm_out=x[:, :32], impl=impl),
        "norm_out",
        x,
    )
    expect_value_error(
        lambda: moefuse.fused_add_rmsnorm_fp4_quantize(x, r, w, gs, norm_out=r, impl=impl),
        "norm_out",
        x,
        r,
    )
    expect_value_error(
        lambda: moefuse.fused_add_rmsnorm_fp4_quantize(x, r, w, gs, layout="8x4", impl=impl),
        "layout",
        x,
        r,
    )


def test_bad_impl_name():
    with pytest.raises(ValueError, match="impl"):
        moefuse.fp8_quantize(_rand(2, 8), torch.tensor([1.0]), impl="cuda")


def _op_cases():
    h = 32
    x, r, w = _rand(3, h), _rand(3, h), _rand(h)
    s, gs = torch.tensor([0.05]), torch.tensor([80.0])
    u8 = lambda *shape: torch.empty(*shape, dtype=torch.uint8)  # noqa: E731
    q8 = u8(3, h)
    return [
        (ops.fp8_quantize_op, (x, s, u8(3, h), 0, False)),
        (ops.fp8_quantize_per_token_op, (x, q8.clone(), torch.empty(3, 1), False)),
        (
            ops.fp8_dequantize_op,
            (torch.randint(0, 256, (3, h), dtype=torch.uint8), s, torch.empty(3, h), 1, False),
        ),
        (ops.fp4_quantize_op, (x, gs, u8(3, h // 2), u8(128, 4), "swizzled_128x4", "fast", False)),
        (
            ops.fp4_dequantize_op,
            (
                torch.randint(0, 256, (3, h // 2), dtype=torch.uint8),
                torch.randint(0, 120, (8, 4), dtype=torch.uint8),
                gs,
                torch.empty(3, h),
                "swizzled_8x4",
                False,
            ),
        ),
        (ops.rmsnorm_quant_op, (x, w, s, q8.clone(), 0, 1e-6, 0.0, False)),
        (ops.fused_add_rmsnorm_quant_op, (x, r.clone(), w, s, q8.clone(), 1, 1e-6, 1.0, False)),
        (
            ops.rmsnorm_fp4_quantize_op,
            (
                x,
                w,
                gs,
                u8(3, h // 2),
                u8(3, 2),
                torch.empty_like(x),
                1e-6,
                0.0,
                "linear",
                "ieee",
                False,
            ),
        ),
        (
            ops.fused_add_rmsnorm_fp4_quantize_op,
            (
                x,
                r.clone(),
                w,
                gs,
                u8(3, h // 2),
                u8(128, 4),
                None,
                1e-6,
                0.0,
                "swizzled_128x4",
                "fast",
                False,
            ),
        ),
    ]


@pytest.mark.parametrize("case", range(9))
def test_opcheck(case):
    op, args = _op_cases()[case]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_traces_the_custom_ops():
    h = 48
    x, r, w = _rand(5, h), _rand(5, h), _rand(h)
    s, gs = torch.tensor([0.05]), torch.tensor([80.0])

    def layer(x, r, w):
        q = moefuse.fused_add_rmsnorm_quant(x, r, w, s, impl="triton")
        p, sc = moefuse.rmsnorm_fp4_quantize(x, w, gs, impl="triton")
        pt, st = moefuse.fp8_quantize_per_token(x, impl="triton")
        back = moefuse.fp4_dequantize(p, sc, gs, impl="triton")
        return q.view(torch.uint8), p, sc, pt.view(torch.uint8), st, back

    expected = layer(x.clone(), r.clone(), w)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    r_c = r.clone()
    got = compiled(x.clone(), r_c, w)
    for g, e in zip(got, expected):
        assert_bitwise_equal(g, e, "compiled == eager")


def test_auto_on_cpu_uses_the_reference(seed):
    x, s = _rand(3, 16), torch.tensor([0.1])
    assert_bitwise_equal(
        moefuse.fp8_quantize(x, s), moefuse.fp8_quantize(x, s, impl="reference"), "auto on CPU"
    )


def test_triton_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, s = _rand(3, 16), torch.tensor([0.1])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        moefuse.fp8_quantize(x, s, impl="triton")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        moefuse.rmsnorm_fp4_quantize(x, _rand(16), s, impl="triton")


def test_supports_helpers():
    x, w, s = _rand(3, 64), _rand(64), torch.tensor([1.0])
    assert moefuse.supports_fp8_quantize(x, s)
    assert moefuse.supports_fp8_quantize_per_token(x)
    assert moefuse.supports_fp4_quantize(x, s)
    assert not moefuse.supports_fp4_quantize(_rand(3, 40), s)
    assert not moefuse.supports_fp4_quantize(x, s, layout="tiled")
    assert moefuse.supports_rmsnorm_quant(x, w, s)
    assert not moefuse.supports_rmsnorm_quant(x.float(), w, s)
    assert moefuse.supports_fused_add_rmsnorm_quant(x, x.clone(), w, s)
    assert not moefuse.supports_fused_add_rmsnorm_quant(x, x, w, s)
    assert moefuse.supports_rmsnorm_fp4_quantize(x, w, s)
    assert moefuse.supports_fused_add_rmsnorm_fp4_quantize(x, x.clone(), w, s, layout="linear")
    assert not moefuse.supports_rmsnorm_fp4_quantize(_rand(3, 24), _rand(24), s)
    q8 = torch.zeros(3, 64, dtype=E4M3)
    assert moefuse.supports_fp8_dequantize(q8, s)
    assert not moefuse.supports_fp8_dequantize(x, s)
    p, sc = torch.zeros(3, 32, dtype=torch.uint8), torch.zeros(128, 4, dtype=torch.uint8)
    assert moefuse.supports_fp4_dequantize(p, sc, s)
    assert not moefuse.supports_fp4_dequantize(p, sc, s, layout="linear")
