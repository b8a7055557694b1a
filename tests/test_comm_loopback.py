"""Loopback ranks on CPU: P ranks as P threads of this process (``moefuse.testing_ranks``) with
``transport="loopback"`` peer buffers, the real Triton kernels in the interpreter. The same
scenarios and checks as the multi-process tests (tests/test_comm.py, test_comm_moe_reduction.py):
residual_out bitwise and norm_out within 1 ulp of the reference of all ranks' inputs, bitwise
across algorithms and ranks. The GPU counterpart is moefuse.tools.loopback_gpu_check (one GPU)."""

from __future__ import annotations

import os

import pytest
import torch

from moefuse.comm import transport as tp
from moefuse.testing_ranks import run_loopback_ranks
from test_comm import _assert_ranks_agree, scenario_patterns

pytestmark = pytest.mark.interpreter


def test_loopback_is_only_picked_explicitly():
    assert tp.LOOPBACK not in tp.cuda_transport_order("auto")
    assert tp.cuda_transport_order("loopback") == ("loopback",)


def scenario_norm(rank, world_size, cfg):
    """The workspace really is a loopback one (distinct per-rank buffers of this process), then
    test_comm's pattern scenario (oracle, bitwise across algorithms)."""
    import moefuse

    ws = moefuse.AllReduceWorkspace(None, 4, 64, torch.bfloat16, "cpu", timeout_s=60)
    assert ws.loopback and ws.transport.kind == "loopback" and ws.peer_access
    addrs = ws.transport.peer_addrs
    assert len(set(addrs)) == world_size and addrs[rank] == ws.transport.local.data_ptr()
    ws.close()
    return scenario_patterns(rank, world_size, cfg)


@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_residual_rmsnorm_loopback_ranks(world_size):
    cfg = dict(
        dtypes=(torch.bfloat16,),
        widths=(64, 200),
        tokens=(1, 5),
        patterns=("norm",),
        algorithms=("oneshot", "twoshot", "torch"),
        batch_invariance=world_size == 2,
    )
    _assert_ranks_agree(run_loopback_ranks(scenario_norm, world_size, "cpu", cfg))


def test_moe_finalize_loopback_ranks():
    from test_comm_moe_reduction import scenario as moe_scenario

    cfg = dict(
        shapes=((40, (1, 5)),),
        cases=(("finalize", 2, "stepwise", None),),
        algorithms=("oneshot", "twoshot", "torch"),
        alone=False,
    )
    _assert_ranks_agree(run_loopback_ranks(moe_scenario, 2, "cpu", cfg))


def _fail_on_rank_one(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one gives up")
    dist.barrier()  # woken by the runner when rank 1 fails
    return rank


def test_runner_reports_the_failing_rank():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 ---.*rank one gives up"):
        run_loopback_ranks(_fail_on_rank_one, 2, "cpu", timeout_s=60)
    # the process is left clean: the next run works
    assert run_loopback_ranks(lambda r, p: (r, p), 3, "cpu") == [(0, 3), (1, 3), (2, 3)]


def _loopback_across_processes(rank, world_size):
    import moefuse

    ws = moefuse.AllReduceWorkspace(None, 4, 64, torch.bfloat16, "cpu", transport="loopback")
    out = (ws.loopback, ws.peer_access)
    ws.close()
    return out


def test_loopback_refuses_ranks_in_separate_processes():
    """Addresses of another process are not valid here: the transport fails on every rank alike
    and the workspace takes the torch.distributed path."""
    from comm_mp import run_group

    got = run_group(2, _loopback_across_processes, ranks="processes")
    assert got == [(True, False), (True, False)]


def run_check_script(
    out_dir, *options, timeout_s: float = 300.0, families: tuple | None = None
) -> None:
    """``python -m moefuse.tools.loopback_gpu_check`` with ``options`` in a fresh process: exit
    status 0, no case failed or skipped, the op of every family (or of ``families``, the names
    the options pass with ``--families``) passed (used by the GPU file too)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"))
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself for --device cpu
    cmd = [
        sys.executable,
        "-m",
        "moefuse.tools.loopback_gpu_check",
        "--out",
        str(out_dir),
        *options,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    failed = [
        line
        for line in proc.stdout.splitlines()
        if line.startswith(("FAIL", "     ", "HANG", "ERROR"))
    ]
    assert proc.returncode == 0, (
        "\n".join(failed[:60]) + "\n...\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    report = json.loads((out_dir / "loopback_gpu_check.json").read_text())
    summary = report.get("summary", {})
    assert summary.get("FAIL") == 0 and summary.get("SKIP") == 0, summary
    ops = {case["op"] for case in report["cases"] if case["status"] == "PASS"}
    from moefuse.tools import loopback_families as fams

    named = fams.FAMILIES if families is None else {n: fams.FAMILIES[n] for n in families}
    assert ops == {f.op for f in named.values()}, ops  # every family ran


def test_gpu_check_script_dry_run(tmp_path):
    """moefuse.tools.loopback_gpu_check itself (what a one-GPU check runs) in its interpreter
    mode: every family at H = 64, M = 1, so the tool cannot rot between GPU runs."""
    run_check_script(tmp_path, "--device", "cpu", "--hidden", "64", "--tokens", "1")


def test_first_call_stress_in_the_interpreter(tmp_path):
    """The stress check of every family (fresh workspace, first call, fault check, bitwise check,
    close; algorithms, M and H in turn) at interpreter sizes: no wrong result, no timeout.
    On one GPU the same script runs it with ``--stress 200`` (test_comm_loopback_gpu.py)."""
    # bounded waits of 120 s: on a loaded 2-core machine an interpreted peer can be late by
    # more than the script's 30 s default without anything being wrong
    run_check_script(
        tmp_path,
        "--device",
        "cpu",
        "--stress",
        "6",
        "--hidden",
        "64,96",
        "--tokens",
        "1,3",
        "--timeout-s",
        "120",
        timeout_s=600,
    )


def test_compile_lock_hands_a_cached_kernel_to_a_waiting_rank():
    """The loopback runner's serialized Triton compile: a rank waiting for the compile lock
    takes the kernel another rank has put in the cache, even while that rank holds the lock
    again (loading another module can wait for the device, i.e. for that rank's running
    communication kernel, which waits for this rank: a stall until the bounded wait ran out,
    seen as wrong outputs of a timed-out kernel). Processes on separate GPUs share no lock."""
    import threading

    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from moefuse.testing_ranks import _serialized_triton_compile

    class Fake:
        def __init__(self):
            self.device_caches = {0: ({}, None, None, None, None)}

    fake = Fake()
    compiled_once = threading.Event()
    release = threading.Event()

    def original(self, key, signature, device, *rest, **kwargs):
        self.device_caches[device][0][key] = f"kernel {key}"
        compiled_once.set()
        release.wait(5)  # the first rank keeps the lock (as a module load would)
        return self.device_caches[device][0][key]

    got = {}
    real = JITFunction._do_compile
    JITFunction._do_compile = original
    try:
        with _serialized_triton_compile():
            do_compile = JITFunction._do_compile
            first = threading.Thread(target=lambda: do_compile(fake, "k", None, 0))
            first.start()
            compiled_once.wait(5)
            waiter = threading.Thread(
                target=lambda: got.setdefault("k", do_compile(fake, "k", None, 0))
            )
            waiter.start()
            waiter.join(2)
            assert not waiter.is_alive() and got["k"] == "kernel k"  # did not wait for the lock
            release.set()
            first.join(5)
    finally:
        release.set()
        JITFunction._do_compile = real


def test_loopback_ranks_on_cuda_ask_for_eager_module_loading(monkeypatch, caplog):
    """Loopback ranks share one CUDA context, where a module loaded at a kernel's first use waits
    for a peer's running kernel: before CUDA starts the runner asks for eager loading; after a
    lazy start it says once why a bounded wait may run out."""
    import logging

    from moefuse import _runtime, testing_ranks

    monkeypatch.delenv("CUDA_MODULE_LOADING", raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    testing_ranks._eager_module_loading()
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"

    monkeypatch.setenv("CUDA_MODULE_LOADING", "LAZY")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(_runtime, "_logged", set())
    with caplog.at_level(logging.INFO, logger="moefuse"):
        testing_ranks._eager_module_loading()
        testing_ranks._eager_module_loading()
    said = [r.getMessage() for r in caplog.records if "lazy module loading" in r.getMessage()]
    assert len(said) == 1 and "CUDA_MODULE_LOADING=EAGER" in said[0]
