"""moefuse._validate: aliasing checks on meta tensors (no memory: data_ptr() is 0 for all) and
the eps check."""

import pytest
import torch

import moefuse
from moefuse import _validate as v


def test_meta_tensors_alias_only_through_their_storage():
    a, b = torch.empty(4, 8, device="meta"), torch.empty(4, 8, device="meta")
    assert not v.overlaps(a, b) and not v.same_memory(a, b)
    assert v.overlaps(a, a[1:]) and v.same_memory(a, a.view(4, 8))
    assert not v.same_memory(a, a[1:])


def test_meta_call_passes_the_alias_checks():
    """A call on meta tensors fails, if at all, for a reason other than a false alias."""
    x, r = torch.empty(2, 64, device="meta", dtype=torch.bfloat16), \
        torch.empty(2, 64, device="meta", dtype=torch.bfloat16)  # fmt: skip
    w = torch.empty(64, device="meta", dtype=torch.bfloat16)
    try:
        moefuse.fused_add_rmsnorm(x, r, w, impl="reference")
    except Exception as exc:  # noqa: BLE001 - only the message matters
        assert "alias" not in str(exc), exc


@pytest.mark.parametrize("eps", [True, -1.0, float("nan"), "1e-6", None])
def test_eps_rejects_non_numbers_and_bools(eps):
    with pytest.raises(ValueError, match="'eps'"):
        v.check_eps("rmsnorm", "eps", eps)
