"""Communication kernels on ONE GPU: scripts/loopback_gpu_check.py (two loopback ranks as threads
of one process, half the SMs each) run as a subprocess, correctness only. Every family of that
script at H = 4096, M = 1 and 64: all-reduce + norm, the §3.3 MoE fusion, every all-gather op,
every tp algorithm and the EP op, against the references (bitwise, or within the SPEC bound),
bitwise across algorithms and across the ranks.
Where two GPUs are lent, tests/test_comm_*_gpu.py run the same ops on real peers."""

from __future__ import annotations

import pytest

from test_comm_loopback import run_check_script

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("pdl", [False, True], ids=["pdl_off", "pdl_on"])
def test_loopback_gpu_check(tmp_path, pdl):
    options = ["--quick", "--no-timing", "--budget-s", "240"] + (["--pdl"] if pdl else [])
    run_check_script(tmp_path, *options, timeout_s=420)


def test_loopback_gpu_check_allgather_persistent(tmp_path):
    """Every all-gather op above the decode range (the persistent kernel in each op's default
    mode: one-pass tiles from the slots or gathered, stepped rows early / slots, the gated op at
    two CTAs per SM) at a 2-step and a 4-step width, bitwise against the single-GPU op."""
    families = ("allgather_norm", "allgather_fp8", "allgather_fp4", "allgather_gated")
    run_check_script(tmp_path, "--no-timing", "--budget-s", "240", "--families",
                     ",".join(families), "--tokens", "65,300,1000", "--hidden", "4096,8192",
                     timeout_s=420, families=families)  # fmt: skip
