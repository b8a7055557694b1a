"""Communication kernels on ONE GPU: scripts/loopback_gpu_check.py (two loopback ranks as threads
of one process, half the SMs each) run as a subprocess, correctness only. Every family of that
script at H = 4096, M = 1 and 64: all-reduce + norm, the §3.3 MoE fusion, all_gather_rmsnorm and
every tp algorithm, bitwise against the references, across algorithms and across the ranks.
Where two GPUs are lent, tests/test_comm_*_gpu.py run the same ops on real peers."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("pdl", [False, True], ids=["pdl_off", "pdl_on"])
def test_loopback_gpu_check(tmp_path, pdl):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "loopback_gpu_check.py"), "--out",
           str(tmp_path), "--quick", "--no-timing", "--budget-s", "240"]  # fmt: skip
    if pdl:
        cmd.append("--pdl")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    report = json.loads((tmp_path / "loopback_gpu_check.json").read_text())
    summary = report.get("summary", {})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert summary.get("FAIL") == 0 and summary.get("SKIP") == 0, summary
    ops = {case["op"] for case in report["cases"] if case["status"] == "PASS"}
    assert len(ops) == 4, ops  # every family ran
