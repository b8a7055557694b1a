"""Run a test scenario in P spawned processes joined by a torch.distributed group.

``run_group(P, fn, *args)`` starts P processes (spawn), joins them with a FileStore rendezvous
(gloo on CPU; NCCL with one GPU per rank when ``backend="nccl"``), calls ``fn(rank, P, *args)`` in
each and returns the list of their return values (index = rank). Any exception in any rank fails
the caller with every rank's traceback; a group that does not finish within ``timeout_s`` is killed
(only the processes started here) and reported. ``fn`` must be importable by the children (a
module-level function of a test module or of this module).

The children inherit the environment: TRITON_INTERPRET=1 on CPU machines (set by conftest before
anything imports triton) and the no-multicast variables.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import traceback

import torch.multiprocessing as mp

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}  # fmt: skip


def _entry(rank, world_size, init_file, backend, fn, args, results):
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    import torch
    import torch.distributed as dist

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=600),
        )  # fmt: skip
        try:
            out = fn(rank, world_size, *args)
            results.put((rank, "ok", out))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_group(world_size: int, fn, *args, backend: str = "gloo", timeout_s: float = 300.0):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="moefuse-test-store-")
    os.close(fd)
    os.unlink(init_file)  # FileStore creates it
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, init_file, backend, fn, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, object]] = {}
    try:
        while len(got) < world_size:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(got))
                raise AssertionError(f"ranks {missing} did not finish in {timeout_s:g} s") from None
            got[rank] = (status, value)
            if status == "error":
                break  # the others may be stuck in a collective with this rank
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world_size else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        try:
            os.unlink(init_file)
        except FileNotFoundError:
            pass
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(got.items()) if s == "error"]
    if errors:
        raise AssertionError("scenario failed:\n" + "\n".join(errors))
    return [got[r][1] for r in range(world_size)]


def run_group_one_killed(world_size: int, fn, *args, killed: int = 1, backend: str = "gloo",
                         timeout_s: float = 300.0) -> dict:  # fmt: skip
    """:func:`run_group` for a scenario in which rank ``killed`` dies by SIGKILL (fault tests):
    returns the survivors' results ``{rank: value}`` once all of them reported, checks that the
    killed rank ended by SIGKILL, then ends the survivors (their process-group teardown may wait
    on the dead peer)."""
    import signal

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="moefuse-test-store-")
    os.close(fd)
    os.unlink(init_file)
    procs = [ctx.Process(target=_entry, args=(r, world_size, init_file, backend, fn, args, results))
             for r in range(world_size)]  # fmt: skip
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    try:
        while len(got) < world_size - 1:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"survivors did not finish in {timeout_s:g} s "
                                     f"(reported: {sorted(got)})") from None  # fmt: skip
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            got[rank] = value
        procs[killed].join(timeout=30)
        code = procs[killed].exitcode
        assert code == -signal.SIGKILL, f"rank {killed} ended with {code}, not SIGKILL"
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        try:
            os.unlink(init_file)
        except FileNotFoundError:
            pass
    return got
