"""moefuse.compat.flashinfer: FlashInfer's norm call style gives the moefuse results."""

import pytest
import torch

import moefuse
from moefuse.compat import flashinfer as fi
from moefuse.testing import assert_bitwise_equal

pytestmark = pytest.mark.interpreter


def test_flashinfer_norm_calls_match_moefuse():
    x, r, w = torch.randn(3, 32).bfloat16(), torch.randn(3, 32).bfloat16(), torch.randn(32)
    assert_bitwise_equal(fi.rmsnorm(x, w.bfloat16(), 1e-6), moefuse.rmsnorm(x, w.bfloat16()))
    a, b = x.clone(), r.clone()
    assert fi.fused_add_rmsnorm(a, b, w, 1e-6) is None
    c, d = x.clone(), r.clone()
    moefuse.fused_add_rmsnorm(c, d, w)
    assert_bitwise_equal(a, c)
    assert_bitwise_equal(b, d)
    s, al = torch.randn(3, 32), torch.rand(32)
    ro, ffn = fi.gated_residual_next_rmsnorm(x, s, w, 1.0, al, post_weight=w, post_gain_center=1.0)
    ro2, ffn2 = moefuse.gated_residual_next_rmsnorm(
        x, s, w, 1.0, al, post_weight=w, post_gain_center=1.0
    )
    assert_bitwise_equal(ro, ro2)
    assert_bitwise_equal(ffn, ffn2)
    assert fi.supports_rmsnorm_sigmoid_gate(torch.bfloat16, 64, "cpu") in (True, False)
    assert not fi.supports_rmsnorm_sigmoid_gate(torch.float32, 64, "cpu")
