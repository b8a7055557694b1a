"""The fault protocol of every communication (family, algorithm, kernel variant), on CPU: the
real kernels in Triton's interpreter, two ranks as threads (``moefuse.testing_ranks``) and as
processes (gloo, shared-memory peer buffers), every case both ways.

Per case (tests/fault_cases.py): a rank failing validation leaves its peer a bounded wait that
names it; a rank arriving after its peer gave up raises at once naming the rank that gave up,
reads nothing of the abandoned call and writes no output; ``ws.failed()`` reports the fault on
both ranks; the workspace recovers by close() + re-create. A rank that made no call learns of
the notice by ``ws.check()``.

The "torch" algorithm has no kernel waits (its waits are the process group's) and is not a
case here. Only the faulty calls run on the short bound, 1 s (8 s for the column-split MoE
one-shot, whose interpreted CTAs wait for the other CTAs of their row group); healthy calls run
on a 120 s bound (tests/fault_cases.py). The late rank's call took 0.02-0.07 s against that
bound (0.12 s for the column split; every case as threads and as processes, two pytest workers
on the 2-core machine, 2026-12-06), and shapes are tiny, so the matrix stays short: the lone
rank's waits are most of its time.
"""

from __future__ import annotations

import pytest

from fault_cases import CASES, case_env, scenario_fault_protocol, scenario_idle_rank_learns_by_check
from moefuse.testing_ranks import run_loopback_ranks

pytestmark = pytest.mark.interpreter

TIMEOUT = 1.0
SLOW = {"moe_reduction/oneshot-split": 8.0}


def _check(took, name):
    timeout = SLOW.get(name, TIMEOUT)
    assert took[1]["alone"] >= timeout * 0.9, (name, took)
    assert took[0]["late"] < timeout, (name, took)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fault_protocol_threads(name):
    with case_env(name):
        took = run_loopback_ranks(
            scenario_fault_protocol, 2, "cpu", name, "cpu", SLOW.get(name, TIMEOUT), timeout_s=600
        )
    _check(took, name)


def test_idle_rank_learns_by_check_threads():
    name = "all_reduce/twoshot"
    with case_env(name):
        assert all(
            run_loopback_ranks(
                scenario_idle_rank_learns_by_check, 2, "cpu", name, "cpu", TIMEOUT, timeout_s=600
            )
        )


#: processes: every case, one test per family (its cases in the same two processes)
FAMILIES = sorted({name.split("/")[0] for name in CASES})


def _process_scenario(rank, p, names, timeout_s):
    out = {}
    for name in names:
        with case_env(name):
            out[name] = scenario_fault_protocol(rank, p, name, "cpu", SLOW.get(name, timeout_s))
    if "expert_norm/tp-staged" in names:
        with case_env("expert_norm/tp-staged"):
            scenario_idle_rank_learns_by_check(rank, p, "expert_norm/tp-staged", "cpu", timeout_s)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_fault_protocol_processes(family):
    from comm_mp import run_group

    names = tuple(n for n in sorted(CASES) if n.startswith(family + "/"))
    got = run_group(2, _process_scenario, names, TIMEOUT, timeout_s=900, ranks="processes")
    for name in names:
        _check([got[0][name], got[1][name]], name)
