"""Communication kernels on ONE GPU: moefuse.tools.loopback_gpu_check (two loopback ranks as threads
of one process, half the SMs less one each) run as a subprocess, correctness only. Every family
of that script at H = 4096, M = 1 and 64: all-reduce + norm, the MoE-reduction fusions, every
all-gather op, every tp algorithm and the EP op, against the references (bitwise, or within the
spec's bound), bitwise across algorithms and across the ranks; then larger shapes per family.
Where two GPUs are lent, tests/test_comm_*_gpu.py run the same ops on real peers.

Every call is settled (the rank's device synchronized, the workspace's fault word read) before
the checks: a bounded wait that ran out is reported as the fault it is. The first-call stress
check (a fresh workspace per call, 200 rounds per family) and the repeated runs of this file
are ``bash scripts/comm_trust_check.sh``."""

from __future__ import annotations

import pytest

from fault_cases import CASES
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
    run_check_script(
        tmp_path,
        "--no-timing",
        "--budget-s",
        "240",
        "--families",
        ",".join(families),
        "--tokens",
        "65,300,1000",
        "--hidden",
        "4096,8192",
        timeout_s=420,
        families=families,
    )


def test_loopback_gpu_check_moe_large(tmp_path):
    """The MoE-reduction fusions from 2048 tokens, where the two-shot runs 2 CTAs per SM and
    its "auto" takes it at H > 4096, and the one-shot grids fill both ranks' SMs: one-shot and
    two-shot at H 7168 / 2880, M 2048 / 2049 / 4097, against the oracle of both ranks' inputs
    and bitwise equal to each other."""
    families = ("moe_reduce", "moe_finalize")
    run_check_script(
        tmp_path,
        "--no-timing",
        "--budget-s",
        "240",
        "--families",
        ",".join(families),
        "--tokens",
        "2048,2049,4097",
        "--hidden",
        "7168,2880",
        timeout_s=420,
        families=families,
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_fault_protocol_loopback_gpu(name):
    """The fault protocol of every (family, algorithm, kernel variant) on one GPU, two loopback
    ranks (tests/fault_cases.py): a rank failing validation leaves its peer a bounded wait naming
    it; the rank arriving after its peer gave up stops at once naming it; ``ws.failed()`` reports
    on both ranks after the step's sync; the workspace recovers by close() + re-create."""
    from fault_cases import case_env, scenario_fault_protocol
    from moefuse.testing_ranks import run_loopback_ranks

    timeout = 2.0
    with case_env(name):
        took = run_loopback_ranks(
            scenario_fault_protocol, 2, "cuda", name, "cuda", timeout, timeout_s=300
        )
    assert took[1]["alone"] >= timeout * 0.9, (name, took)
    assert took[0]["late"] < timeout, (name, took)
