"""moefuse._validate: aliasing checks on meta tensors (no memory: data_ptr() is 0 for all) and
the eps check."""

import pytest
import torch

import moefuse
from moefuse import _validate as v
from moefuse.testing import assert_close


def test_meta_tensors_alias_only_through_their_storage():
    a, b = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta")
    assert not v.overlaps(a, b) and not v.same_memory(a, b)
    assert v.overlaps(a, a[1:]) and v.same_memory(a, a.view(4, 8))
    assert not v.same_memory(a, a[1:])


def test_meta_call_passes_the_alias_checks():
    """A call on meta tensors fails, if at all, for a reason other than a false alias."""
    x, r = (
        torch.empty(2, 64, device="meta", dtype=torch.bfloat16),
        torch.empty(2, 64, device="meta", dtype=torch.bfloat16),
    )
    w = torch.empty(64, device="meta", dtype=torch.bfloat16)
    try:
        moefuse.fused_add_rmsnorm(x, r, w, impl="reference")
    except Exception as exc:  # noqa: BLE001 - only the message matters
        assert "alias" not in str(exc), exc


@pytest.mark.parametrize("eps", [True, -1.0, float("nan"), "1e-6", None])
def test_eps_rejects_non_numbers_and_bools(eps):
    with pytest.raises(ValueError, match="'eps'"):
        v.check_eps("rmsnorm", "eps", eps)


@pytest.mark.parametrize(
    "value", [True, float("nan"), float("inf"), -float("inf"), "1.0", None, torch.tensor(1.0)]
)
def test_real_rejects_non_finite_non_numbers_and_bools(value):
    with pytest.raises(ValueError, match="'routed_scaling_factor' must be a finite float"):
        v.check_real("moe_finalize", "routed_scaling_factor", value)


@pytest.mark.parametrize("value", [0, 1, -2, 0.0, 2.5, -1e30])
def test_real_accepts_finite_ints_and_floats(value):
    v.check_real("moe_finalize", "routed_scaling_factor", value)


@pytest.mark.interpreter
@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_written_tensor_that_requires_grad_is_refused_before_any_write(impl):
    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(4, 64, dtype=torch.bfloat16)
    r0 = r.clone()
    w = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="'input' requires grad"):
        moefuse.fused_add_rmsnorm(x, r, w, impl=impl)
    assert torch.equal(r, r0)
    with torch.no_grad():  # no autograd recording: accepted
        moefuse.fused_add_rmsnorm(x, r, w, impl=impl)


@pytest.mark.interpreter
def test_documented_limits_hold_on_both_impls():
    """docs/support.md: norms take any H >= 1 (beyond 65536 too), moe_finalize any K >= 0.
    The norm is held to the reference within the norms' tolerance (``rsqrt_half``: the kernel's
    FP32 row sum against the reference's FP64 one moves an output by one ulp on some rows; at
    H = 65,537 this input, generator seed 4, has 7 such elements)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 65537, generator=g).to(torch.bfloat16)
    w = torch.rand(65537, generator=g).to(torch.bfloat16)
    got = moefuse.rmsnorm(x, w, impl="triton")
    want = moefuse.rmsnorm(x, w, impl="reference")
    assert_close(got, want, "rsqrt_half", "rmsnorm at H = 65,537")
    rows, idx = torch.randn(2, 8).to(torch.bfloat16), torch.zeros(3, 0, dtype=torch.int32)
    shared = torch.randn(3, 8).to(torch.bfloat16)
    for impl in ("reference", "triton"):
        out = moefuse.moe_finalize(
            rows, idx, torch.zeros(3, 0), shared_expert_output=shared, impl=impl
        )
        assert torch.equal(out, shared)
