"""RMSNorm family API contract on CPU: bad input raises ValueError naming the argument and writes
nothing; custom ops pass opcheck and trace under torch.compile(fullgraph=True)."""

import pytest
import torch

import moefuse
from moefuse.norm import ops
from moefuse.testing import assert_bitwise_equal, expect_value_error

pytestmark = pytest.mark.interpreter


def _rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_rmsnorm_bad_inputs(impl):
    x, w = _rand(4, 64), _rand(64)
    out = torch.full_like(x, 3.0)
    call = lambda **kw: moefuse.rmsnorm(**{"input": x, "weight": w, "out": out, "impl": impl, **kw})
    expect_value_error(lambda: call(input=x.float()), "input", out)
    expect_value_error(lambda: call(weight=_rand(63)), "weight", out)
    expect_value_error(lambda: call(out=torch.empty(4, 64, dtype=torch.float16)), "out", x)
    expect_value_error(lambda: call(out=torch.empty(3, 64, dtype=torch.bfloat16)), "out", x)
    expect_value_error(lambda: call(input=_rand(64, 4).t()), "input", out)  # stride(-1) != 1
    meta_w = torch.empty(64, dtype=torch.bfloat16, device="meta")
    expect_value_error(lambda: call(weight=meta_w), "weight", out)
    expect_value_error(lambda: call(input=_rand(64)), "input", out)  # 1-D
    expect_value_error(lambda: call(eps=-1.0), "eps", out)
    buf = _rand(5, 64)
    expect_value_error(
        lambda: moefuse.rmsnorm(buf[1:], w, out=buf[:4], impl=impl), "out", buf
    )  # partial overlap


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fused_add_bad_inputs(impl):
    x, r, w = _rand(4, 64), _rand(4, 64), _rand(64)
    expect_value_error(
        lambda: moefuse.fused_add_rmsnorm(x, r.half(), w, impl=impl), "residual", x, r
    )
    expect_value_error(lambda: moefuse.fused_add_rmsnorm(x, x, w, impl=impl), "residual", x)
    expect_value_error(
        lambda: moefuse.fused_add_rmsnorm(x, _rand(4, 65), w, impl=impl), "residual", x
    )


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_gated_bad_inputs(impl):
    b, r, a = _rand(4, 64), torch.randn(4, 64), torch.rand(64)
    out = torch.zeros(4, 64)
    expect_value_error(
        lambda: moefuse.gated_residual_rmsnorm(b, r.bfloat16(), None, a, a, impl=impl),
        "residual",
        r,
    )
    expect_value_error(
        lambda: moefuse.gated_residual_rmsnorm(b, r, None, a.double(), a, impl=impl), "alpha", r
    )
    expect_value_error(
        lambda: moefuse.gated_residual_rmsnorm(b, r, None, a, a[:63], impl=impl), "beta", r
    )
    alias = torch.zeros(4, 64)
    expect_value_error(
        lambda: moefuse.gated_residual_rmsnorm(
            alias.view(torch.bfloat16)[:, :64], r, None, a, a, out=alias, impl=impl
        ),
        "out",
        alias,
    )
    expect_value_error(
        lambda: moefuse.gated_residual_next_rmsnorm(b, r, _rand(64), "1", a, impl=impl), "alpha", r
    )
    expect_value_error(
        lambda: moefuse.gated_residual_next_rmsnorm(
            b, r, _rand(64), 1.0, a, ffn_input=torch.empty(4, 64), impl=impl
        ),
        "ffn_input",
        r,
    )
    expect_value_error(
        lambda: moefuse.gated_residual_next_rmsnorm(
            b, r, _rand(64), 1.0, a, residual_out=r[:, :32], impl=impl
        ),
        "residual_out",
        r,
        out,
    )


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_sigmoid_gate_bad_inputs(impl):
    x = _rand(2, 4, 64)
    expect_value_error(lambda: moefuse.rmsnorm_sigmoid_gate(x, x, impl=impl), "gate", x)
    expect_value_error(
        lambda: moefuse.rmsnorm_sigmoid_gate(x, _rand(2, 4, 32), impl=impl), "gate", x
    )
    expect_value_error(lambda: moefuse.rmsnorm_sigmoid_gate(x, x.clone(), impl="cuda"), "impl", x)


def test_bad_impl_name():
    x, w = _rand(2, 8), _rand(8)
    with pytest.raises(ValueError, match="impl"):
        moefuse.rmsnorm(x, w, impl="cuda")


def _op_cases():
    h = 48
    b, r32, a = _rand(3, h), torch.randn(3, h), torch.rand(h)
    x, w = _rand(3, h), _rand(h)
    return [
        (ops.rmsnorm_op, (x, w, torch.empty_like(x), 1e-6, 0.0, False)),
        (ops.fused_add_rmsnorm_op, (x.clone(), _rand(3, h), w, 1e-6, 1.0, False)),
        (ops.gated_residual_rmsnorm_op, (b, r32, w, a, a, torch.empty(3, h), 1e-6, 0.0, False)),
        (ops.gated_residual_rmsnorm_op, (b, r32, None, a, a, torch.empty(3, h), 1e-6, 0.0, False)),
        (
            ops.gated_residual_next_rmsnorm_op,
            (
                b,
                r32,
                w,
                a,
                1.0,
                a,
                w,
                torch.empty(3, h),
                torch.empty_like(b),
                torch.empty(3, h),
                1e-6,
                1e-6,
                0.0,
                1.0,
                False,
            ),
        ),
        (
            ops.gated_residual_next_rmsnorm_op,
            (
                b,
                r32,
                w,
                None,
                0.5,
                a,
                None,
                torch.empty(3, h),
                torch.empty_like(b),
                None,
                1e-6,
                1e-6,
                0.0,
                0.0,
                False,
            ),
        ),
        (ops.rmsnorm_sigmoid_gate_op, (_rand(2, 4, 16), _rand(2, 4, 16), 1e-5, False)),
    ]


@pytest.mark.parametrize("case", range(7))
def test_opcheck(case):
    op, args = _op_cases()[case]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_traces_the_custom_ops():
    """fullgraph tracing (aot_eager backend: no C++ compiler needed on CI) runs the kernels."""
    h = 48
    x, r, w = _rand(5, h), _rand(5, h), _rand(h)
    b, r32, a = _rand(5, h), torch.randn(5, h), torch.rand(h)

    def layer(x, r, w, b, r32, a):
        moefuse.fused_add_rmsnorm(x, r, w, impl="triton")
        y = moefuse.rmsnorm(x, w, impl="triton")
        ro, ffn = moefuse.gated_residual_next_rmsnorm(b, r32, w, a, a, impl="triton")
        return y, ro, ffn

    args = (x, r, w, b, r32, a)
    eager_args = [t.clone() for t in args]
    expected = layer(*eager_args)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got = compiled(*[t.clone() for t in args])
    for g, e in zip(got, expected):
        assert_bitwise_equal(g, e, "compiled == eager")
