"""Communication faults surface on their own, on CPU: the real kernels in Triton's
interpreter across real processes (gloo group, shared-memory peer buffers).

* a late rank: its peer's call raises after ~timeout_s naming it; the late rank's own call then
  raises at once naming the peer that gave up (it reads nothing that peer pushed); both keep
  raising at every later call; both recover with close() + re-create in the same processes;
* a rank killed mid-call: the survivor gets a RuntimeError naming it within one timeout (at most
  one more call: a call whose data did arrive is correct), and close() returns instead of hanging;
* the no-sync check (a plain host load) is fast; the host status block is written by the kernel;
* ``enable_symm_mem_for_group`` is only called where the installed PyTorch needs it.

Timeouts are 2 s and shapes tiny (M = 3, H = 48) so the file runs in well under a minute.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import timeit
import warnings

import pytest
import torch

from moefuse.comm.all_reduce import reference as ref
from moefuse.testing import assert_bitwise_equal

pytestmark = pytest.mark.interpreter

BF16 = torch.bfloat16
M, H, TIMEOUT = 3, 48, 2.0


def make_case(call_index, world_size):
    """Partials of every rank for call number ``call_index`` (different data per call, so a call
    that used another call's data could not pass), the residual and the weight."""
    g = torch.Generator().manual_seed(1000 + call_index)
    parts = [(torch.randn(M, H, generator=g) * (r + 1)).to(BF16) for r in range(world_size)]
    res = torch.randn(M, H, generator=g).to(BF16)
    w = (torch.rand(H, generator=g) + 0.5).to(BF16)
    return parts, res, w


def run_call(moefuse, ws, rank, world_size, index, algo):
    """Call number ``index``: checks the result bitwise against the reference when it returns."""
    parts, res, w = make_case(index, world_size)
    ro, no = moefuse.allreduce_residual_rmsnorm(
        parts[rank], res, w, workspace=ws, algorithm=algo, impl="triton"
    )
    h_ref, _ = ref.allreduce_residual_rmsnorm_from_partials(parts, res, w)
    assert_bitwise_equal(ro, h_ref, f"rank {rank} call {index} {algo}")
    return ro, no


def open_warm(moefuse, rank, world_size, algo):
    """A workspace with the short timeout, after a first call on a generous one: the first call
    of a process sets up the interpreted kernel (seconds on a loaded 2-core machine), which must
    not count against a 2 s wait. A barrier then lines the ranks up."""
    import torch.distributed as dist

    warm = moefuse.AllReduceWorkspace(None, 8, H, BF16, "cpu", timeout_s=120)
    run_call(moefuse, warm, rank, world_size, 0, algo)
    warm.close()
    ws = moefuse.AllReduceWorkspace(None, 8, H, BF16, "cpu", timeout_s=TIMEOUT)
    dist.barrier()
    return ws


def timed_raise(fn, match):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=match) as info:
        fn()
    return time.monotonic() - t0, str(info.value)


# ----------------------------------------------------------------------------- late rank
def scenario_late_rank(rank, world_size, algos):
    """Per algorithm, in the same processes: rank 1 arrives only after rank 0 gave up; both fail,
    keep failing, recover. Returns ([seconds this rank's failing call took, per algorithm], mean
    seconds of one healthy raise_if_failed())."""
    import torch.distributed as dist

    import moefuse
    from moefuse.comm import faults

    took = []
    per_call = None
    for k, algo in enumerate(algos):
        ws = open_warm(moefuse, rank, world_size, algo)
        run_call(moefuse, ws, rank, world_size, 10 * k, algo)
        assert ws.failed() is None
        if per_call is None:  # the per-call check on a healthy workspace: a plain load
            per_call = min(timeit.repeat(ws.raise_if_failed, number=20000, repeat=5)) / 20000
        call = lambda i: run_call(moefuse, ws, rank, world_size, 10 * k + i, algo)  # noqa: E731
        if rank == 0:
            elapsed, msg = timed_raise(
                lambda: call(1), r"rank\(s\) 1 \(global rank 1\) never arrived"
            )
            assert "group" in msg and "close()" in msg, msg
            assert ws.host_status.codes(world_size) == [0, faults.MISSING], "written by kernel"
            dist.barrier()  # rank 1 may come now: after rank 0 gave up
        else:
            dist.barrier()
            elapsed, msg = timed_raise(lambda: call(1), r"rank\(s\) 0 \(global rank 0\) gave up")
            assert ws.host_status.codes(world_size) == [faults.GAVE_UP, 0], "written by kernel"
        took.append(elapsed)
        assert ws.failed() == msg.removeprefix("moefuse.comm: ")
        for i in (2, 3):  # every later call raises at once, whatever the backend
            quick, _ = timed_raise(lambda: call(i), "never arrived|gave up")
            assert quick < TIMEOUT, "a failed workspace must not wait again"
        with pytest.raises(RuntimeError, match="never arrived|gave up"):
            ws.check()
        with pytest.raises(RuntimeError, match="never arrived|gave up"):
            moefuse.allreduce(make_case(4, world_size)[0][rank], workspace=ws, impl="reference")
        ws.close()
        with pytest.raises(RuntimeError, match="closed"):
            call(5)
        # recovery in the same processes
        ws = moefuse.AllReduceWorkspace(None, 8, H, BF16, "cpu", timeout_s=TIMEOUT)
        dist.barrier()
        for i, again in ((6, "oneshot"), (7, "twoshot")):
            run_call(moefuse, ws, rank, world_size, 10 * k + i, again)
        ws.check()
        assert ws.failed() is None
        ws.close()
    return took, per_call


def test_late_rank_errors_and_both_recover():
    """One-shot, then two-shot, in the same two processes (fail, recover, fail again, recover)."""
    from comm_mp import run_group

    (t0, c0), (t1, c1) = run_group(2, scenario_late_rank, ("oneshot", "twoshot"))
    for algo, a, b in zip(("oneshot", "twoshot"), t0, t1):
        assert TIMEOUT <= a < TIMEOUT + 30, f"{algo}: rank 0's failing call took {a:.2f} s"
        assert b < TIMEOUT, f"{algo}: the late rank waited {b:.2f} s instead of stopping at once"
    assert max(c0, c1) < 1e-6, f"raise_if_failed costs {max(c0, c1) * 1e9:.0f} ns"


# ----------------------------------------------------------------------------- killed rank
def scenario_killed(rank, world_size, algo):
    """Rank 1 is SIGKILLed during a call; rank 0 (survivor) must get an error naming it within
    one timeout, at the latest one call later. Returns (calls made, seconds of the raising call,
    seconds close() took)."""
    import moefuse

    ws = open_warm(moefuse, rank, world_size, algo)
    run_call(moefuse, ws, rank, world_size, 0, algo)
    if rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        run_call(moefuse, ws, rank, world_size, 1, algo)  # killed in here
        time.sleep(60)
        raise AssertionError("rank 1 was not killed")
    time.sleep(1.0)  # rank 1 is inside its call when it dies
    for i in (1, 2):
        t0 = time.monotonic()
        try:
            run_call(moefuse, ws, rank, world_size, i, algo)  # correct if it returns
        except RuntimeError as exc:
            elapsed = time.monotonic() - t0
            assert "rank(s) 1 (global rank 1) never arrived" in str(exc), str(exc)
            break
    else:
        raise AssertionError("the survivor never saw the dead rank")
    with pytest.raises(RuntimeError, match="never arrived"):
        run_call(moefuse, ws, rank, world_size, 3, algo)
    t0 = time.monotonic()
    ws.close(timeout_s=1.0)  # the dead rank never arrives: bounded, buffers kept
    return i, elapsed, time.monotonic() - t0


def test_killed_rank_leaves_the_survivor_with_an_error():
    from comm_mp import run_group_one_killed

    got = run_group_one_killed(2, scenario_killed, "twoshot")
    calls, elapsed, closing = got[0]
    assert calls <= 2
    assert elapsed < TIMEOUT + 30, f"the survivor's failing call took {elapsed:.1f} s"
    assert closing < 15, f"close() took {closing:.1f} s with a dead peer"


# ----------------------------------------------------------------------------- host side
def test_symm_mem_group_enable_only_where_needed():
    """Deprecated (PyTorch >= 2.11: registered automatically, FutureWarning) -> not called."""
    from typing_extensions import deprecated

    from moefuse.comm.transport import needs_group_enable

    @deprecated("no need", category=FutureWarning)
    def new_style(name):
        raise AssertionError("must not be called")

    def old_style(name):
        return None

    assert needs_group_enable(old_style) and not needs_group_enable(None)
    assert not needs_group_enable(new_style)
    import torch.distributed._symmetric_memory as symm_mem

    real = getattr(symm_mem, "enable_symm_mem_for_group", None)
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    if real is not None and (major, minor) >= (2, 11):
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            assert not needs_group_enable(real)


def test_fault_message_names_ranks_and_group():
    from moefuse.comm import faults

    msg = faults.describe(
        [0, faults.MISSING, faults.GAVE_UP, 0],
        0b110,
        rank=0,
        group="tp",
        timeout_s=3,
        global_rank=lambda r: r + 8,
    )
    assert "rank(s) 1 (global rank 9) never arrived within timeout_s=3" in msg, msg
    assert "rank(s) 2 (global rank 10) gave up" in msg and "group 'tp'" in msg, msg
    # a summary bit whose code word is not visible yet still names the rank
    msg = faults.describe(
        [0, 0, 0, 0], 0b1000, rank=0, group="tp", timeout_s=3, global_rank=lambda r: r
    )
    assert "rank(s) 3 (global rank 3) never arrived" in msg, msg
