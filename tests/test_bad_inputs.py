"""Property-based bad-input suite over every public op, on CPU (both implementations; the
kernels run in Triton's interpreter at tiny shapes). The walk and the two allowed outcomes are in
tests/bad_inputs.py; the example budget is fixed and derandomized, so CI runs the same calls."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import moefuse
from bad_inputs import SETTINGS, check_call, comm_cases, draw_mutation, local_cases
from moefuse.testing_ranks import run_loopback_ranks

pytestmark = pytest.mark.interpreter
DEVICE = "cpu"
#: public callables that take no tensors to check: helpers returning sizes or setting up state
NOT_OPS = {"scale_shape", "allgather_regions", "prepare_allgather", "init_tp_moe_finalize_rmsnorm",
           "shutdown_tp_moe_finalize_rmsnorm"}  # fmt: skip


def run_local(op: str, device) -> None:
    fn, build = getattr(moefuse, op.split("[")[0]), local_cases(device)[op]
    impls = ["reference", "triton"] if "impl" in inspect.signature(fn).parameters else [None]

    @SETTINGS
    @given(data=st.data(), impl=st.sampled_from(impls))
    def walk(data, impl):
        kw = build()
        kind, name = draw_mutation(data, fn, kw, comm=False)
        check_call(fn, kw, kind, name, impl)

    walk()


def _walk_comm(fn, build) -> None:
    @SETTINGS
    @given(data=st.data())
    def walk(data):
        kw = build()
        kind, name = draw_mutation(data, fn, kw, comm=True)
        check_call(fn, kw, kind, name, "triton")

    walk()


def comm_scenario(rank, world_size, device, ops):
    ws = moefuse.AllReduceWorkspace(None, 4, 32, torch.bfloat16, device, timeout_s=10)
    failures = []
    try:
        if rank == 0:
            for op in ops:
                try:
                    _walk_comm(getattr(moefuse, op), comm_cases(device, ws)[op])
                except Exception as exc:  # noqa: BLE001 - reported per op below
                    failures.append(f"{op}: {type(exc).__name__}: {exc}")
    finally:
        ws.close()
    return failures


def test_every_public_op_is_walked():
    ops = {
        n
        for n in moefuse.__all__
        if not n.startswith("supports_")
        and callable(getattr(moefuse, n))
        and not inspect.isclass(getattr(moefuse, n))
    }
    walked = {n.split("[")[0] for n in local_cases(DEVICE)} | set(comm_cases(DEVICE, None))
    assert ops - NOT_OPS == walked, (ops - NOT_OPS) ^ walked


@pytest.mark.parametrize("op", sorted(local_cases(DEVICE)))
def test_bad_inputs_local(op):
    run_local(op, DEVICE)


def test_bad_inputs_comm():
    ops = sorted(comm_cases(DEVICE, None))
    failures = run_loopback_ranks(comm_scenario, 2, DEVICE, DEVICE, ops, timeout_s=600)[0]
    assert not failures, "\n".join(failures)
