"""FlashInfer-signature quantization entry points (moefuse.compat._quant) on CPU: argument mapping,
output shapes and layouts, in-place semantics, and the options that must raise."""

import pytest
import torch

import moefuse
from moefuse.compat import _quant as fi
from moefuse.norm import reference as norm_ref
from moefuse.quant import reference as ref
from moefuse.testing import assert_bitwise_equal

pytestmark = pytest.mark.interpreter


def _rand(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def test_fp4_quantize_maps_layout_flags_and_shapes():
    x, gs = _rand(5, 64), torch.tensor([200.0])
    for swz, eight, layout in (
        (True, False, "swizzled_128x4"),
        (True, True, "swizzled_8x4"),
        (False, False, "linear"),
    ):
        p, s = fi.fp4_quantize(x, gs, is_sf_swizzled_layout=swz, is_sf_8x4_layout=eight)
        ep, es = ref.fp4_quantize_reference(x, gs, layout, "fast")
        assert_bitwise_equal(p, ep, layout)
        assert s.shape[1] == 64 // 16
        assert_bitwise_equal(s.reshape(-1), es.reshape(-1), layout)
    # column-major input: FlashInfer quantizes along the contiguous dimension (transpose in,
    # transpose out)
    xc = _rand(3, 64).t()
    p, s = fi.fp4_quantize(xc, gs, is_sf_swizzled_layout=False)
    ep, es = ref.fp4_quantize_reference(xc.t(), gs, "linear", "fast")
    assert_bitwise_equal(p.t(), ep, "column-major packed")
    assert_bitwise_equal(s.t(), es, "column-major scales")


def test_nvfp4_quantize_and_dequantize():
    x, gs = _rand(3, 32), torch.tensor([150.0])
    for layout in fi.SfLayout:
        p, s = fi.nvfp4_quantize(x, gs, layout)
        ep, es = ref.fp4_quantize_reference(x, gs, fi._LAYOUT_NAMES[layout.value], "fast")
        assert_bitwise_equal(p, ep, str(layout))
        assert_bitwise_equal(s, es, str(layout))
    p, s = fi.fp4_quantize(x, gs)
    back = fi.e2m1_and_ufp8sf_scale_to_float(p, s.reshape(-1), gs)
    assert_bitwise_equal(back, ref.fp4_dequantize_reference(p, s.reshape(128, 4), gs), "dequant")


def test_unsupported_options_raise():
    x, gs = _rand(3, 64), torch.tensor([1.0])
    with pytest.raises(NotImplementedError):
        fi.fp4_quantize(x, gs, sf_vec_size=32, sf_use_ue8m0=True)
    with pytest.raises(NotImplementedError):
        fi.nvfp4_quantize(x, gs, do_shuffle=True)
    with pytest.raises(NotImplementedError):
        fi.rmsnorm_fp4quant(x, _rand(64), global_scale=gs, block_size=32)


def test_fp8_norms_out_first_and_float_scale_deprecation():
    x, r, w = _rand(4, 48), _rand(4, 48), _rand(48)
    out = torch.empty(4, 48, dtype=torch.float8_e4m3fn)
    with pytest.warns(DeprecationWarning):
        fi.rmsnorm_quant(out, x, w, 0.05)
    assert_bitwise_equal(out, moefuse.rmsnorm_quant(x, w, torch.tensor([0.05])), "rmsnorm_quant")
    r_k, r_m = r.clone(), r.clone()
    fi.fused_add_rmsnorm_quant(out, x, r_k, w, torch.tensor([0.05]))
    exp = moefuse.fused_add_rmsnorm_quant(x, r_m, w, torch.tensor([0.05]))
    assert_bitwise_equal(out, exp, "fused_add_rmsnorm_quant")
    assert_bitwise_equal(r_k, r_m, "residual updated in place")


def test_fp4_norms():
    x, r, w, gs = _rand(5, 64), _rand(5, 64), _rand(64), torch.tensor([120.0])
    p, s = fi.rmsnorm_fp4quant(x, w, global_scale=gs)
    ep, es = moefuse.rmsnorm_fp4_quantize(x, w, gs, layout="linear")
    assert_bitwise_equal(p, ep, "rmsnorm_fp4quant packed")
    assert_bitwise_equal(s, es, "rmsnorm_fp4quant linear scales")
    y, bs = torch.empty(5, 32, dtype=torch.uint8), torch.empty(128 * 4, dtype=torch.uint8)
    r_k, r_m = r.clone(), r.clone()
    out = fi.add_rmsnorm_fp4quant(
        x, r_k, w, y, bs, gs, is_sf_swizzled_layout=True, output_both_sf_layouts=True
    )
    ep, es = moefuse.fused_add_rmsnorm_fp4_quantize(x, r_m, w, gs)
    assert out[0] is y and out[1] is bs and len(out) == 3
    assert_bitwise_equal(y, ep, "add_rmsnorm_fp4quant packed")
    assert_bitwise_equal(bs.reshape(128, 4), es, "swizzled scales")
    assert_bitwise_equal(r_k, r_m, "residual")
    y_ref = norm_ref.fused_add_rmsnorm_reference(x, r, w)[0]
    lin = ref.fp4_quantize_reference(y_ref, gs, "linear")[1]
    assert_bitwise_equal(out[2], lin, "unswizzled scales")
