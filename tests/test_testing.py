"""The comparison helpers themselves can fail (so tests built on them can)."""

import pytest
import torch

from moefuse.testing import assert_close, expect_value_error, ulp_distance


def test_expect_value_error_detects_missing_error_wrong_name_and_writes():
    t = torch.zeros(4)
    with pytest.raises(AssertionError, match="no ValueError"):
        expect_value_error(lambda: None, "x", t)
    with pytest.raises(AssertionError, match="does not name"):
        expect_value_error(lambda: (_ for _ in ()).throw(ValueError("'y' is bad")), "x", t)

    def writes_then_raises():
        t.fill_(1.0)
        raise ValueError("argument 'x' is bad")

    with pytest.raises(AssertionError, match="nothing written"):
        expect_value_error(writes_then_raises, "x", t)


def test_ulp_tolerance_counts_bf16_steps_and_rejects_nan():
    a = torch.tensor([1.0, -0.0, 2.0], dtype=torch.bfloat16)
    b = torch.tensor([1.0078125, 0.0, 2.0], dtype=torch.bfloat16)  # one step above 1.0
    assert ulp_distance(a, b).tolist() == [1, 0, 0]
    assert_close(a, b, "rsqrt_half")
    with pytest.raises(AssertionError):
        assert_close(a, torch.tensor([1.015625, 0.0, 2.0], dtype=torch.bfloat16), "rsqrt_half")
    with pytest.raises(AssertionError, match="NaN"):
        assert_close(torch.tensor([float("nan")]).bfloat16(), b[:1], "rsqrt_half")
