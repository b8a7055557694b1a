"""Communication faults on 2 GPUs: NCCL group, symmetric-memory peer buffers, no
multicast. The host learns of a timed-out wait without a device sync (pinned host status block).

* late rank: rank 0's call times out naming rank 1 (seen by ``ws.failed()`` after the step's
  sync, and by the next call, which raises before launching); rank 1, arriving after rank 0
  gave up, stops at once naming rank 0; both recover with close() + re-create;
* killed rank: rank 1 is SIGKILLed while its kernel waits; rank 0 gets an error naming it within
  one timeout (at most one call later), and close() returns;
* 10,000 CUDA-graph replays per peer algorithm with fresh data copied into the static inputs:
  zero mismatches against the torch.distributed path (``algorithm="torch"``), bitwise;
* a graph replay that times out: no Python runs, yet ``ws.failed()`` reports it after a sync, the
  next eager call raises, and a further replay writes nothing.

Run (2 x H200): ``python -m pytest -q tests/test_comm_faults_gpu.py`` with NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 (also set by comm_mp for its children).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from comm_mp import run_group, run_group_one_killed

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

P = 2
M, H = 64, 4096
TIMEOUT = 2.0
REPLAYS = 10_000


def _need():
    if torch.cuda.device_count() < P:
        pytest.skip(f"needs {P} GPUs, found {torch.cuda.device_count()}")


def make_case(index, world_size, device):
    """Every rank's partial for call ``index`` (-0.0 in column 0), the residual, the weight."""
    g = torch.Generator(device=device).manual_seed(5000 + index)
    parts = []
    for r in range(world_size):
        p = (torch.randn(M, H, generator=g, device=device) * (r + 1)).to(torch.bfloat16)
        p[:, 0] = -0.0
        parts.append(p)
    res = torch.randn(M, H, generator=g, device=device).to(torch.bfloat16)
    w = (torch.rand(H, generator=g, device=device) + 0.5).to(torch.bfloat16)
    return parts, res, w


def call(moefuse, ws, rank, index, algo, *, check=True):
    """Call number ``index`` on ``ws``; with ``check``, as a serving step would: sync, then
    ``ws.raise_if_failed()`` (a failed step raises instead of handing out its outputs), then
    residual_out bitwise against the reference of the same call."""
    from moefuse.comm.all_reduce import reference as ref
    from moefuse.testing import assert_bitwise_equal

    parts, res, w = make_case(index, P, ws.device)
    ro, no = moefuse.allreduce_residual_rmsnorm(
        parts[rank], res, w, workspace=ws, algorithm=algo, impl="triton"
    )
    if check:
        torch.cuda.synchronize(ws.device)
        ws.raise_if_failed()
        h_ref, _ = ref.allreduce_residual_rmsnorm_from_partials(parts, res, w)
        assert_bitwise_equal(ro, h_ref, f"rank {rank} call {index} {algo}")
    return ro, no


def open_warm(moefuse, rank, algo, timeout_s=TIMEOUT):
    """A workspace with a short timeout, after a first call on a generous one (Triton compiles at
    the first call; ranks finish compiling at different times)."""
    import torch.distributed as dist

    dev = torch.device("cuda", rank)
    warm = moefuse.AllReduceWorkspace(None, M, H, torch.bfloat16, dev)
    call(moefuse, warm, rank, 0, algo)
    warm.check()
    warm.close()
    ws = moefuse.AllReduceWorkspace(None, M, H, torch.bfloat16, dev, timeout_s=timeout_s)
    dist.barrier()
    return ws


# ----------------------------------------------------------------------------- late rank
def scenario_late_rank(rank, world_size, algo):
    import torch.distributed as dist

    import moefuse
    from moefuse.comm import faults

    ws = open_warm(moefuse, rank, algo)
    call(moefuse, ws, rank, 1, algo)
    assert ws.failed() is None
    t0 = time.monotonic()
    if rank == 0:
        call(moefuse, ws, rank, 2, algo, check=False)  # rank 1 is not there: times out
        torch.cuda.synchronize()  # the serving loop's per-step sync
        elapsed = time.monotonic() - t0
        msg = ws.failed()  # no sync of its own
        assert msg is not None and "rank(s) 1 (global rank 1) never arrived" in msg, msg
        assert ws.host_status.codes(world_size) == [0, faults.MISSING]
        dist.barrier()  # now rank 1 comes, late
    else:
        dist.barrier()
        t0 = time.monotonic()
        call(moefuse, ws, rank, 2, algo, check=False)
        torch.cuda.synchronize()
        elapsed = time.monotonic() - t0
        msg = ws.failed()
        assert msg is not None and "rank(s) 0 (global rank 0) gave up" in msg, msg
        assert ws.host_status.codes(world_size) == [faults.GAVE_UP, 0]
    for i in (3, 4):  # the next calls raise before launching, without waiting
        t1 = time.monotonic()
        with pytest.raises(RuntimeError, match="never arrived|gave up"):
            call(moefuse, ws, rank, i, algo, check=False)
        assert time.monotonic() - t1 < 0.5
    with pytest.raises(RuntimeError, match="never arrived|gave up"):
        ws.check()
    ws.close()
    ws = moefuse.AllReduceWorkspace(
        None, M, H, torch.bfloat16, torch.device("cuda", rank), timeout_s=TIMEOUT
    )
    dist.barrier()
    for i, again in ((5, "oneshot"), (6, "twoshot"), (7, "torch")):
        call(moefuse, ws, rank, i, again)
    ws.check()
    ws.close()
    return elapsed


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_late_rank_errors_and_both_recover(algo):
    _need()
    elapsed = run_group(P, scenario_late_rank, algo, backend="nccl", timeout_s=300)
    assert TIMEOUT <= elapsed[0] < TIMEOUT + 10, f"rank 0's step took {elapsed[0]:.2f} s"
    assert elapsed[1] < TIMEOUT, f"the late rank waited {elapsed[1]:.2f} s instead of stopping"


# ----------------------------------------------------------------------------- killed rank
def scenario_killed(rank, world_size, algo):
    import moefuse

    ws = open_warm(moefuse, rank, algo)
    call(moefuse, ws, rank, 1, algo)
    if rank == 1:
        call(moefuse, ws, rank, 2, algo, check=False)  # waits for rank 0 (which sleeps)
        time.sleep(0.3)  # the kernel is spinning now
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(1.5)
    for i in (2, 3):
        t0 = time.monotonic()
        try:
            call(moefuse, ws, rank, i, algo)  # syncs, raises if failed; else correct
        except RuntimeError as exc:
            elapsed = time.monotonic() - t0
            assert "rank(s) 1 (global rank 1) never arrived" in str(exc), str(exc)
            break
    else:
        raise AssertionError("the survivor never saw the dead rank")
    with pytest.raises(RuntimeError, match="never arrived"):
        call(moefuse, ws, rank, 4, algo, check=False)
    t0 = time.monotonic()
    ws.close(timeout_s=2.0)  # the dead rank never arrives: bounded; its buffers are kept
    return i, elapsed, time.monotonic() - t0


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_killed_rank_leaves_the_survivor_with_an_error(algo):
    _need()
    got = run_group_one_killed(P, scenario_killed, algo, backend="nccl", timeout_s=300)
    calls, elapsed, closing = got[0]
    assert calls <= 3 and elapsed < TIMEOUT + 10, (calls, elapsed)
    assert closing < 10, f"close() took {closing:.1f} s with a dead peer"


# ----------------------------------------------------------------------------- graphs
def scenario_graph_replays(rank, world_size, replays):
    """Per peer algorithm: one call captured in a CUDA graph (PDL on), replayed ``replays`` times
    with fresh inputs (randn per replay, -0.0 in column 0) copied into its static inputs; after
    each replay the eager torch.distributed path runs on the same inputs. Mismatching elements
    are counted on the device (no sync per replay) and must be zero."""
    import moefuse
    from moefuse.testing import capture_graph

    dev = torch.device("cuda", rank)
    ws = moefuse.AllReduceWorkspace(None, M, H, torch.bfloat16, dev, oneshot_max_tokens=M)
    _, _, w = make_case(0, world_size, dev)
    x = torch.zeros(M, H, dtype=torch.bfloat16, device=dev)
    res = torch.zeros_like(x)
    counts = {}
    for algo in ("oneshot", "twoshot"):
        ro, no = torch.empty_like(x), torch.empty_like(x)
        run = lambda: moefuse.allreduce_residual_rmsnorm(  # noqa: E731
            x, res, w, workspace=ws, algorithm=algo, impl="triton", residual_out=ro, norm_out=no
        )
        graph = capture_graph(run, ws)
        g = torch.Generator(device=dev).manual_seed(77 + rank)
        bad = torch.zeros((), dtype=torch.int64, device=dev)
        for _ in range(replays):
            x.copy_(torch.randn(M, H, generator=g, device=dev).to(torch.bfloat16))
            x[:, 0] = -0.0
            res.copy_(torch.randn(M, H, generator=g, device=dev).to(torch.bfloat16))
            ro.fill_(float("nan"))
            graph.replay()
            want_ro, want_no = moefuse.allreduce_residual_rmsnorm(
                x, res, w, workspace=ws, algorithm="torch", impl="triton"
            )
            bad += (ro.view(torch.int16) != want_ro.view(torch.int16)).sum()
            bad += (no.view(torch.int16) != want_no.view(torch.int16)).sum()
        counts[algo] = int(bad)
        del graph
    ws.check()
    ws.close()
    return counts


def test_graph_replays_fresh_data_match_torch_path():
    _need()
    counts = run_group(P, scenario_graph_replays, REPLAYS, backend="nccl", timeout_s=600)
    for rank, c in enumerate(counts):
        assert c == {"oneshot": 0, "twoshot": 0}, f"rank {rank}: mismatching elements {c}"


def scenario_graph_failure(rank, world_size, algo):
    """A replay that times out on rank 0 (rank 1 skips it): after a sync ws.failed() names rank 1
    although no Python ran during the replay; the next eager call raises; a further replay writes
    nothing. Rank 1 replays late: it stops at once naming rank 0. Both recover."""
    import torch.distributed as dist

    import moefuse

    ws = open_warm(moefuse, rank, algo)
    dev = ws.device
    parts, res, w = make_case(1, world_size, dev)
    x = parts[rank].clone()
    ro, no = torch.empty_like(x), torch.empty_like(x)
    run = lambda: moefuse.allreduce_residual_rmsnorm(  # noqa: E731
        x, res, w, workspace=ws, algorithm=algo, impl="triton", residual_out=ro, norm_out=no
    )
    run()
    with ws.capture():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
    graph.replay()
    ws.check()  # both replayed: healthy
    if rank == 1:
        dist.barrier()  # after rank 0 gave up
    t0 = time.monotonic()
    graph.replay()
    torch.cuda.synchronize()
    elapsed = time.monotonic() - t0
    msg = ws.failed()
    who = (
        "rank(s) 1 (global rank 1) never arrived"
        if rank == 0
        else "rank(s) 0 (global rank 0) gave up"
    )
    assert msg is not None and who in msg, msg
    with pytest.raises(RuntimeError, match="never arrived|gave up"):
        run()  # the next eager call
    ro.fill_(float("nan"))
    graph.replay()  # the kernel sees the status word and does nothing
    torch.cuda.synchronize()
    assert bool(ro.isnan().all()), "a replay on a failed workspace wrote outputs"
    if rank == 0:
        dist.barrier()
    del graph
    ws.close()
    ws = moefuse.AllReduceWorkspace(None, M, H, torch.bfloat16, dev, timeout_s=TIMEOUT)
    dist.barrier()
    call(moefuse, ws, rank, 2, algo)
    ws.check()
    ws.close()
    return elapsed


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_graph_replay_timeout_raises_at_next_eager_call(algo):
    _need()
    elapsed = run_group(P, scenario_graph_failure, algo, backend="nccl", timeout_s=300)
    assert TIMEOUT <= elapsed[0] < TIMEOUT + 10, elapsed
    assert elapsed[1] < TIMEOUT, f"the late rank's replay waited {elapsed[1]:.2f} s"


# ----------------------------------------------------------------------------- creation
def scenario_no_future_warning(rank, world_size):
    """Creating (and closing) a symmetric-memory workspace emits no FutureWarning (PyTorch >= 2.11
    deprecates ``enable_symm_mem_for_group``; it is only called where it is not deprecated)."""
    import warnings

    import moefuse

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ws = moefuse.AllReduceWorkspace(
            None, M, H, torch.bfloat16, torch.device("cuda", rank), transport="symm_mem"
        )
        assert ws.transport is not None and ws.transport.kind == "symm_mem", repr(ws)
        call(moefuse, ws, rank, 1, "oneshot")
        ws.close()
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert not future, future
    return True


def test_workspace_creation_emits_no_future_warning():
    _need()
    assert all(run_group(P, scenario_no_future_warning, backend="nccl", timeout_s=300))
