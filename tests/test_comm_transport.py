"""Choice of the CUDA peer-buffer transport (symmetric memory, then CUDA IPC, then the
torch.distributed path), checked on CPU with stand-in transports. The transports themselves run
on the GPU machines: tests/test_comm_gpu.py::test_cuda_ipc_transport_matches_symmetric_memory.
"""

from __future__ import annotations

import logging

import pytest
import torch

from moefuse import _runtime
from moefuse.comm import transport as tp
from moefuse.comm.workspace import AllReduceWorkspace


def test_transport_order():
    assert tp.cuda_transport_order("auto") == ("symm_mem", "cuda_ipc")
    assert tp.cuda_transport_order("cuda_ipc") == ("cuda_ipc",)
    assert tp.cuda_transport_order("symm_mem") == ("symm_mem",)
    with pytest.raises(ValueError, match="transport"):
        tp.cuda_transport_order("nvls")


def test_bad_transport_is_refused_before_any_collective(monkeypatch):
    # no process group exists: the argument check must come first and name the argument
    with pytest.raises(ValueError, match="transport must be"):
        AllReduceWorkspace(None, 8, 64, torch.bfloat16, "cpu", transport="multicast")
    monkeypatch.setenv("MOEFUSE_COMM_TRANSPORT", "nope")
    with pytest.raises(ValueError, match="MOEFUSE_COMM_TRANSPORT must be"):
        AllReduceWorkspace(None, 8, 64, torch.bfloat16, "cpu")


def _bare_workspace(order):
    """A workspace object with only what ``_make_transport`` reads (no process group)."""
    ws = AllReduceWorkspace.__new__(AllReduceWorkspace)
    ws.device = torch.device("cuda", 0)
    ws._transport_order = order
    ws.group, ws.buffer_bytes = None, 1024
    ws._init_buffer = lambda local: None
    ws.vote = lambda ok: ok
    return ws


@pytest.mark.parametrize("failing, expect", [
    ((), "symm_mem"),
    (("symm_mem",), "cuda_ipc"),
    (("symm_mem", "cuda_ipc"), None),
])  # fmt: skip
def test_auto_falls_back_in_order_and_says_why(monkeypatch, caplog, failing, expect):
    tried = []

    def fake(kind, group, nbytes, device, init, vote):
        tried.append(kind)
        if kind in failing:
            raise RuntimeError(f"{kind} is broken here")
        return kind

    monkeypatch.setattr(tp, "make_transport", fake)
    monkeypatch.setattr(_runtime, "_logged", set())  # log_once: every case logs afresh
    with caplog.at_level(logging.INFO, logger="moefuse"):
        got = _bare_workspace(tp.cuda_transport_order("auto"))._make_transport()
    assert got == expect
    assert tried == list(tp.CUDA_TRANSPORTS[: len(failing) + (expect is not None)])
    for kind in failing:
        assert f"{kind} is broken here" in caplog.text
    if expect is None:
        assert "using the torch.distributed path" in caplog.text
    elif failing:
        assert f"trying {expect}" in caplog.text


def test_forced_transport_does_not_fall_back(monkeypatch):
    tried = []

    def fake(kind, *args):
        tried.append(kind)
        raise RuntimeError("no")

    monkeypatch.setattr(tp, "make_transport", fake)
    assert _bare_workspace(tp.cuda_transport_order("cuda_ipc"))._make_transport() is None
    assert tried == ["cuda_ipc"]


def test_device_bytes_interface():
    cai = tp._DeviceBytes(4096, 256).__cuda_array_interface__
    assert cai["shape"] == (256,) and cai["typestr"] == "|u1" and cai["data"] == (4096, False)
