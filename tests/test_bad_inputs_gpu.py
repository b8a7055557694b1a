"""GPU variant of the bad-input suite (tests/bad_inputs.py): the same walk on CUDA tensors, the
kernels compiled for the device; the communication ops on two loopback ranks of one GPU."""

from __future__ import annotations

import pytest

from bad_inputs import comm_cases, local_cases
from moefuse.testing_ranks import run_loopback_ranks
from test_bad_inputs import comm_scenario, run_local

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("op", sorted(local_cases("cpu")))
def test_bad_inputs_local_gpu(op):
    run_local(op, "cuda")


def test_bad_inputs_comm_gpu():
    ops = sorted(comm_cases("cpu", None))
    failures = run_loopback_ranks(comm_scenario, 2, "cuda", "cuda", ops, timeout_s=600)[0]
    assert not failures, "\n".join(failures)
