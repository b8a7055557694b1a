"""Fused RMSNorm (+ residual) + FP8 / NVFP4 on CPU: references against an FP64 oracle, the real
Triton kernels in the interpreter against the references.

FP8 quantizes the unrounded FP32 norm output, which depends on rsqrt and on the row-sum order, so
codes may differ from the reference by one step; everything else is bitwise: the residual, and
the NVFP4 bytes given the kernel's own rounded norm output (``norm_out``)."""

import pytest
import torch

import moefuse
from moefuse.norm import reference as norm_ref
from moefuse.quant import formats as F
from moefuse.quant import reference as ref
from moefuse.testing import assert_bitwise_equal, assert_close, poison_

pytestmark = pytest.mark.interpreter

WIDTHS_FP8 = [1, 7, 48, 200, 20000]  # 20000 > one block: the two-pass chunked path
WIDTHS_FP4 = [16, 48, 208, 20000]
TOKENS = [1, 3, 17]


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


def _assert_within_one_step(got, exp, what):
    d = F.fp8_code_distance(got, exp)
    assert int(d.max()) <= 1, f"{what}: FP8 codes {int(d.max())} steps apart"


# ----------------------------------------------------------------------------- references
def test_fp8_references_match_fp64_oracle(seed):
    x, w, res = _rand(8, 96), _rand(96), _rand(8, 96)
    scale = torch.tensor([0.01])
    for gain_center in (0.0, 1.0):
        h64 = x.double() + res.double()
        y64 = h64 / torch.sqrt(h64.square().mean(-1, keepdim=True) + 1e-6)
        y64 = y64 * (w.double() + gain_center) / 0.01
        q, res_out = ref.fused_add_rmsnorm_quant_reference(
            x, res, w, scale, 1e-6, gain_center=gain_center
        )
        assert_bitwise_equal(res_out, h64.to(torch.bfloat16), "residual = cast(h)")
        _assert_within_one_step(q, F.fp8_bits(y64.float()), "fused add quant ref vs FP64")
        x64 = x.double()
        y64 = x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + 1e-6)
        y64 = y64 * (w.double() + gain_center) / 0.01
        q = ref.rmsnorm_quant_reference(x, w, scale, gain_center=gain_center)
        _assert_within_one_step(q, F.fp8_bits(y64.float()), "rmsnorm quant ref vs FP64")


def test_fp4_references_are_norm_then_quantize(seed):
    x, w, res = _rand(5, 64), _rand(64), _rand(5, 64)
    gs = torch.tensor([200.0])
    packed, scales, y = ref.rmsnorm_fp4_quantize_reference(x, w, gs, 1e-6, "linear", "ieee")
    x64 = x.double()
    y64 = x64 / torch.sqrt(x64.square().mean(-1, keepdim=True) + 1e-6) * w.double()
    assert_close(y, y64.to(torch.bfloat16), "rsqrt_half", "norm_out ref vs FP64")
    nib, sf = F.nvfp4_block_quant(y.float(), gs, "ieee")
    assert_bitwise_equal(packed, F.pack_nibbles(nib), "packed = nvfp4(rounded norm)")
    assert_bitwise_equal(scales, sf, "scales")
    packed, scales, y, res_out = ref.fused_add_rmsnorm_fp4_quantize_reference(
        x, res, w, gs, 1e-6, "linear", "ieee"
    )
    y2, r2 = norm_ref.fused_add_rmsnorm_reference(x, res, w)
    assert_bitwise_equal(y, y2, "fused add norm_out")
    assert_bitwise_equal(res_out, r2, "fused add residual")


# ----------------------------------------------------------------------------- FP8 kernels
@pytest.mark.parametrize("width", WIDTHS_FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("qdtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rmsnorm_quant_kernel(width, dtype, qdtype, seed):
    for m in TOKENS:
        x, w = _rand(m, width, dtype=dtype), _rand(width, dtype=dtype)
        scale = torch.tensor([0.02 if qdtype == torch.float8_e4m3fn else 1e-4])
        out = poison_(torch.empty(m, width, dtype=qdtype))
        gc = float(m % 2)  # plain and Gemma gains
        moefuse.rmsnorm_quant(x, w, scale, out=out, gain_center=gc, impl="triton")
        exp = moefuse.rmsnorm_quant(x, w, scale, dtype=qdtype, gain_center=gc, impl="reference")
        _assert_within_one_step(out, exp, f"rmsnorm_quant {m}x{width}")


@pytest.mark.parametrize("width", WIDTHS_FP8)
def test_fused_add_rmsnorm_quant_kernel(width, seed):
    for m in TOKENS:
        x, res, w = _rand(m, width), _rand(m, width), _rand(width)
        scale = torch.tensor([0.03])
        x_k, res_k = x.clone(), res.clone()
        out = poison_(torch.empty(m, width, dtype=torch.float8_e4m3fn))
        moefuse.fused_add_rmsnorm_quant(x_k, res_k, w, scale, out=out, impl="triton")
        res_r = res.clone()
        exp = moefuse.fused_add_rmsnorm_quant(x.clone(), res_r, w, scale, impl="reference")
        assert_bitwise_equal(x_k, x, "input untouched")
        assert_bitwise_equal(res_k, res_r, "residual = cast(h)")
        _assert_within_one_step(out, exp, f"fused_add_rmsnorm_quant {m}x{width}")


def test_fp8_fused_3d_strided_rows(seed):
    base, rbase = _rand(4, 6, 80), _rand(4, 6, 80)
    x = base[:, 1:4, :64]
    w, scale = _rand(64), torch.tensor([0.02])
    got = moefuse.rmsnorm_quant(x, w, scale, impl="triton")
    _assert_within_one_step(got, moefuse.rmsnorm_quant(x, w, scale, impl="reference"), "3-D")
    r_k, r_r = rbase.clone(), rbase.clone()
    got = moefuse.fused_add_rmsnorm_quant(x, r_k[:, 2:5, 16:], w, scale, impl="triton")
    exp = moefuse.fused_add_rmsnorm_quant(x, r_r[:, 2:5, 16:], w, scale, impl="reference")
    _assert_within_one_step(got, exp, "3-D fused add")
    assert_bitwise_equal(r_k, r_r, "3-D residual, untouched elements included")


# ----------------------------------------------------------------------------- NVFP4 kernels
def _check_fp4_against_own_norm(fn, args, kwargs, layout, recipe, what):
    """Run with ``norm_out``; the packed codes and scales must be exactly the reference NVFP4 of
    the kernel's own rounded norm output; norm_out within 1 ulp of the reference norm."""
    x = args[0]
    m, h = x.shape
    norm_out = poison_(torch.empty_like(x))
    out = poison_(torch.empty(m, h // 2, dtype=torch.uint8))
    sc = poison_(torch.empty(moefuse.scale_shape(m, h, layout), dtype=torch.uint8))
    fn(
        *args,
        layout=layout,
        recipe=recipe,
        out=out,
        scale_out=sc,
        norm_out=norm_out,
        impl="triton",
        **kwargs,
    )
    ep, es = ref.fp4_quantize_reference(norm_out, args[-1], layout, recipe)
    assert_bitwise_equal(out, ep, f"{what}: packed == nvfp4(own norm_out)")
    assert_bitwise_equal(sc, es, f"{what}: scales == nvfp4(own norm_out), padding 0")
    return norm_out, out, sc


@pytest.mark.parametrize("width", WIDTHS_FP4)
@pytest.mark.parametrize("layout", list(F.LAYOUTS))
def test_rmsnorm_fp4_quantize_kernel(width, layout, seed):
    """Every layout with every token count at the one-block widths; at H = 20,000 (the two-pass
    rows, one row per program) each layout with one of them, the token counts (with their
    recipes and dtypes) spread over the layouts: swizzled 128x4 at M = 1 (127 programs of
    padding rows), 8x4 at M = 3 (5 of them), linear at M = 17 (none). There the 128x4 layout's
    padding-row programs cost 1-3 CPU-s a call whatever M."""
    for i, m in enumerate(TOKENS):
        if width == WIDTHS_FP4[-1] and i != list(F.LAYOUTS).index(layout):
            continue
        recipe = ("fast", "ieee")[i % 2]
        dtype = (torch.bfloat16, torch.float16)[i % 2]
        x, w = _rand(m, width, dtype=dtype, scale=3.0), _rand(width, dtype=dtype)
        gs = torch.tensor([448 * 6 / 8.0])
        y, out, sc = _check_fp4_against_own_norm(
            moefuse.rmsnorm_fp4_quantize,
            (x, w, gs),
            {"gain_center": 1.0},
            layout,
            recipe,
            f"rmsnorm_fp4 {m}x{width}",
        )
        assert_close(y, norm_ref.rmsnorm_reference(x, w, 1e-6, 1.0), "rsqrt_half", "norm_out")
        # without norm_out: the same bytes
        out2, sc2 = moefuse.rmsnorm_fp4_quantize(
            x, w, gs, layout=layout, recipe=recipe, gain_center=1.0, impl="triton"
        )
        assert_bitwise_equal(out2, out, "packed without norm_out")
        assert_bitwise_equal(sc2, sc, "scales without norm_out")


@pytest.mark.parametrize("width", WIDTHS_FP4)
def test_fused_add_rmsnorm_fp4_quantize_kernel(width, seed):
    for i, m in enumerate(TOKENS):
        layout = list(F.LAYOUTS)[i % 3]
        recipe = ("ieee", "fast")[i % 2]
        x, res, w = _rand(m, width, scale=2.0), _rand(m, width), _rand(width)
        gs = torch.tensor([448 * 6 / 10.0])
        res_k, res_r = res.clone(), res.clone()
        x_in = x.clone()
        y, _, _ = _check_fp4_against_own_norm(
            moefuse.fused_add_rmsnorm_fp4_quantize,
            (x_in, res_k, w, gs),
            {},
            layout,
            recipe,
            f"fused_add_fp4 {m}x{width}",
        )
        y_ref, r_ref = norm_ref.fused_add_rmsnorm_reference(x, res_r, w)
        assert_bitwise_equal(x_in, x, "input untouched")
        assert_bitwise_equal(res_k, r_ref, "residual = cast(h)")
        assert_close(y, y_ref, "rsqrt_half", "norm_out")


def test_fused_add_fp4_norm_out_in_place(seed):
    x, res, w = _rand(3, 64), _rand(3, 64), _rand(64)
    gs = torch.tensor([50.0])
    x_k, res_k = x.clone(), res.clone()
    out, sc = moefuse.fused_add_rmsnorm_fp4_quantize(x_k, res_k, w, gs, norm_out=x_k, impl="triton")
    ep, es = ref.fp4_quantize_reference(x_k, gs)
    assert_bitwise_equal(out, ep, "in-place norm_out: packed")
    assert_bitwise_equal(sc, es, "in-place norm_out: scales")
    x_f, res_f = x.clone(), res.clone()
    moefuse.fused_add_rmsnorm(x_f, res_f, w, impl="triton")
    assert_bitwise_equal(x_k, x_f, "norm_out=input behaves like fused_add_rmsnorm")
    assert_bitwise_equal(res_k, res_f, "residual")


# ----------------------------------------------------------------------------- contracts
def test_fused_batch_invariance_bitwise(seed):
    m, h = 17, 48
    x, res, w = _rand(m, h), _rand(m, h), _rand(h)
    scale, gs = torch.tensor([0.02]), torch.tensor([60.0])
    q_all = moefuse.rmsnorm_quant(x, w, scale, impl="triton")
    qa_all = moefuse.fused_add_rmsnorm_quant(x, res.clone(), w, scale, impl="triton")
    p_all, s_all = moefuse.rmsnorm_fp4_quantize(x, w, gs, layout="linear", impl="triton")
    pa_all, _ = moefuse.fused_add_rmsnorm_fp4_quantize(x, res.clone(), w, gs, impl="triton")
    for i in (0, 9, 16):
        sl = slice(i, i + 1)
        assert_bitwise_equal(
            moefuse.rmsnorm_quant(x[sl], w, scale, impl="triton")[0], q_all[i], "rmsnorm_quant row"
        )
        qa = moefuse.fused_add_rmsnorm_quant(x[sl], res[sl].clone(), w, scale, impl="triton")
        assert_bitwise_equal(qa[0], qa_all[i], "fused_add_rmsnorm_quant row")
        p, s = moefuse.rmsnorm_fp4_quantize(x[sl], w, gs, layout="linear", impl="triton")
        assert_bitwise_equal(p[0], p_all[i], "rmsnorm_fp4 packed row")
        assert_bitwise_equal(s[0], s_all[i], "rmsnorm_fp4 scale row")
        pa, _ = moefuse.fused_add_rmsnorm_fp4_quantize(x[sl], res[sl].clone(), w, gs, impl="triton")
        assert_bitwise_equal(pa[0], pa_all[i], "fused_add_fp4 packed row")


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fused_zero_tokens(impl):
    x = torch.empty(0, 32, dtype=torch.bfloat16)
    w, one = _rand(32), torch.tensor([1.0])
    assert moefuse.rmsnorm_quant(x, w, one, impl=impl).shape == (0, 32)
    assert moefuse.fused_add_rmsnorm_quant(x, x.clone(), w, one, impl=impl).shape == (0, 32)
    p, s = moefuse.rmsnorm_fp4_quantize(x, w, one, impl=impl)
    assert p.shape == (0, 16) and s.numel() == 0
    p, s = moefuse.fused_add_rmsnorm_fp4_quantize(x, x.clone(), w, one, layout="linear", impl=impl)
    assert p.shape == (0, 16) and s.shape == (0, 2)
