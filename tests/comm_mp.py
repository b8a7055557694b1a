"""Run a test scenario on P ranks joined by a torch.distributed group, as threads or processes.

``run_group(P, fn, *args)`` calls ``fn(rank, P, *args)`` on every rank and returns the list of
their return values (index = rank). Any exception in any rank fails the caller with every rank's
traceback; a group that does not finish within ``timeout_s`` is reported (and, as processes,
killed: only the processes started here).

Two ways to run the ranks, the same scenario code for both:

* ``ranks="threads"`` (the default for gloo): P threads of this process
  (:func:`moefuse.testing_ranks.run_loopback_ranks`: a threaded group, ``transport="loopback"``
  workspaces, the Triton interpreter made safe for concurrent launches). A process costs ~3 CPU
  seconds of imports plus the interpreter's first rewrite of every kernel it runs; a thread costs
  neither, so the multi-rank kernels run at P = 2 ... 8 for a fraction of the time. What a rank
  would own as a process it gets here too: its own ``os.environ`` (a copy of the caller's, taken
  when the rank starts; what the scenario sets stays in that rank), and the module attributes of
  ``moefuse`` that ranks set (tile thresholds, wrapped launchers) are put back when the run ends.
  The ranks share those modules while they run: a scenario sets the same values on every rank
  and counts its own calls with :func:`count_calls`. Ranks cannot trace (``opcheck``,
  ``torch.compile``) at the same time as threads: torch.fx keeps its patcher per process.
* ``ranks="processes"``: P spawned processes with a FileStore rendezvous (gloo on CPU; NCCL with
  one GPU per rank when ``backend="nccl"``), ``fn`` importable by the children (a module-level
  function of a test module or of this module). On CPU the workspaces then use the shared-memory
  transport between real processes. Tests that need real processes (the transport itself,
  killed ranks, separate address spaces, tracing) ask for it; ``pytest --rank-processes`` runs every
  group as processes (tests/conftest.py).

The ranks inherit the environment: TRITON_INTERPRET=1 on CPU machines (set by conftest before
anything imports triton) and the no-multicast variables.
"""

from __future__ import annotations

import datetime
import os
import queue
import sys
import tempfile
import threading
import traceback
from collections.abc import MutableMapping

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
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=600),
        )
        try:
            from moefuse.testing_ranks import interpreter_session  # (a no-op on GPUs)

            with interpreter_session():  # spins pause on the interpreter, launches patch once
                out = fn(rank, world_size, *args)
            results.put((rank, "ok", out))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


#: True runs every group as processes (``pytest --rank-processes``, set by tests/conftest.py)
FORCE_PROCESSES = False


def _rank_context():
    """Where rank processes come from: a fork server that imported torch, Triton and moefuse
    once (each rank is forked from it: no second import of torch per rank, no thread of this
    process inherited)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "triton", "moefuse", "comm_mp"])
    return ctx


def run_group(
    world_size: int,
    fn,
    *args,
    backend: str = "gloo",
    timeout_s: float = 900.0,
    ranks: str | None = None,
):
    """``fn(rank, world_size, *args)`` on every rank; the results in rank order. ``ranks``:
    "threads" (default for gloo) or "processes" (default for nccl, and for every group under
    ``--rank-processes``). See the module docstring."""
    if ranks is None:
        ranks = "processes" if backend != "gloo" or FORCE_PROCESSES else "threads"
    if ranks not in ("threads", "processes"):
        raise ValueError(f"run_group: ranks must be 'threads' or 'processes', got {ranks!r}")
    if ranks == "threads" and not FORCE_PROCESSES:
        if backend != "gloo":
            raise ValueError(f"run_group: ranks as threads run on CPU (gloo), not {backend!r}")
        return _run_threads(world_size, fn, args, timeout_s)
    ctx = _rank_context()
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


def run_group_one_killed(
    world_size: int, fn, *args, killed: int = 1, backend: str = "gloo", timeout_s: float = 300.0
) -> dict:
    """:func:`run_group` for a scenario in which rank ``killed`` dies by SIGKILL (fault tests):
    returns the survivors' results ``{rank: value}`` once all of them reported, checks that the
    killed rank ended by SIGKILL, then ends the survivors (their process-group teardown may wait
    on the dead peer)."""
    import signal

    ctx = _rank_context()
    results = ctx.Queue()
    fd, init_file = tempfile.mkstemp(prefix="moefuse-test-store-")
    os.close(fd)
    os.unlink(init_file)
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, init_file, backend, fn, args, results))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    try:
        while len(got) < world_size - 1:
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(
                    f"survivors did not finish in {timeout_s:g} s (reported: {sorted(got)})"
                ) from None
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


# ----------------------------------------------------------------------------- ranks as threads
_PATCH_LOCK = threading.Lock()


def assert_bounded_waits(spans: list, timeout_s: float, most_s: float = 30.0) -> None:
    """The failing calls of the ranks that waited for an absent peer. ``spans``: per rank,
    ``(start, end)`` of its failing call in ``time.monotonic()`` seconds (a clock shared by the
    processes of one machine), None for a rank that did not wait. A wait ends at its own
    deadline (``timeout_s`` after its call began, at the earliest) or as soon as a peer whose
    wait timed out posts its notice (moefuse.comm.faults). So no rank raises before the earliest
    deadline, ``min(start) + timeout_s``; a rank that began its call later than the first one
    may wait less than ``timeout_s`` itself. Each call also ends within ``most_s``."""
    waits = [span for span in spans if span is not None]
    assert waits, "no rank waited"
    first_deadline = min(start for start, _ in waits) + timeout_s
    for rank, span in enumerate(spans):
        if span is None:
            continue
        start, end = span
        assert end >= first_deadline, (
            f"rank {rank}'s call ended {first_deadline - end:.2f} s before the first deadline "
            f"(timeout {timeout_s:g} s; spans {spans})"
        )
        assert end - start < most_s, f"rank {rank}'s call took {end - start:.1f} s"


#: (backend, dynamic) of :func:`assert_compiles_to_eager_bits`: the graph capture with static
#: and with dynamic shapes, and inductor as serving engines compile (dynamic). Inductor's static
#: compile checks nothing the others do not (the ops are opaque to it; its C++ build cost 1-3
#: CPU-s per rank), as in tests/test_compile_ops.py.
COMPILE_CONFIGS = (("aot_eager", False), ("aot_eager", True), ("inductor", True))


def assert_compiles_to_eager_bits(layer, args: tuple, expected) -> None:
    """``layer(*args)`` under ``torch.compile(fullgraph=True)`` in every :data:`COMPILE_CONFIGS`:
    ``aot_eager`` with static and with dynamic shapes (a symbolic token count and symbolic float
    arguments) and inductor with dynamic shapes (it rewrites the graph around the ops:
    reinplacing, buffer reuse; skipped without g++, which its CPU code needs), gives
    ``expected`` (a tensor or a tuple of tensors, the eager results) bit for bit."""
    import shutil

    import torch

    from moefuse.testing import assert_bitwise_equal

    want = expected if isinstance(expected, tuple) else (expected,)
    for backend, dynamic in COMPILE_CONFIGS:
        if backend == "inductor" and not shutil.which("g++"):
            continue
        what = f"compiled ({backend}, dynamic={dynamic})"
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True, dynamic=dynamic, backend=backend)
        got = compiled(*args)
        got = got if isinstance(got, tuple) else (got,)
        assert len(got) == len(want), f"{what}: {len(got)} results"
        for i, (g, e) in enumerate(zip(got, want)):
            assert_bitwise_equal(g, e, f"{what} result {i} == eager")


def count_calls(module, name: str, counts: dict, key) -> None:
    """Wrap ``module.name`` so that this rank's calls add 1 to ``counts[key]``. As threads, every
    rank wraps the same module attribute (the wrappers chain); each wrapper counts only the
    calls of the thread that installed it. The wrapper is removed when the run ends (threads:
    module attributes are put back; processes: the process ends)."""
    with _PATCH_LOCK:  # read and replace as one step: no rank's wrapper is lost
        inner = getattr(module, name)
        owner = threading.get_ident()

        def counted(*args, **kwargs):
            if threading.get_ident() == owner:
                counts[key] += 1
            return inner(*args, **kwargs)

        setattr(module, name, counted)


class _RankEnviron(MutableMapping):
    """``os.environ`` while ranks run as threads: a rank thread sees and changes its own copy
    (taken by :meth:`enter_rank`), any other thread the process environment."""

    def __init__(self, real):
        self.real = real
        self._local = threading.local()

    def enter_rank(self) -> None:
        self._local.env = dict(self.real)

    def leave_rank(self) -> None:
        self._local.env = None

    def _env(self):
        env = getattr(self._local, "env", None)
        return self.real if env is None else env

    def __getitem__(self, key):
        return self._env()[key]

    def __setitem__(self, key, value):
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"environment keys and values are str, got {key!r}: {value!r}")
        self._env()[key] = value

    def __delitem__(self, key):
        del self._env()[key]

    def __iter__(self):
        return iter(list(self._env()))

    def __len__(self):
        return len(self._env())

    def copy(self) -> dict:
        return dict(self._env())


#: the packages whose module attributes scenarios set (imported whole before the first run, so
#: that the state saved before a run covers every module a rank can change)
_PATCHED_PACKAGES = ("moefuse.norm", "moefuse.quant", "moefuse.moe", "moefuse.comm")
_MISSING = object()


def _module_state() -> dict:
    import importlib
    import pkgutil

    for name in _PATCHED_PACKAGES:
        package = importlib.import_module(name)
        for info in pkgutil.walk_packages(package.__path__, name + "."):
            importlib.import_module(info.name)
    return {
        name: (mod, dict(vars(mod)))
        for name, mod in list(sys.modules.items())
        if mod is not None and (name == "moefuse" or name.startswith("moefuse."))
    }


def _restore_modules(saved: dict) -> None:
    """Put back the module attributes of ``moefuse`` that the ranks changed. Added names stay:
    submodules imported meanwhile, and the names Triton's interpreter puts into a kernel
    module's globals when it first rewrites one of its kernels."""
    for mod, before in saved.values():
        now = vars(mod)
        for key, value in before.items():
            if now.get(key, _MISSING) is not value:
                now[key] = value


def _run_threads(world_size: int, fn, args: tuple, timeout_s: float) -> list:
    from moefuse.testing_ranks import run_loopback_ranks

    env = _RankEnviron(os.environ)

    def rank_main(rank, size, *rank_args):
        env.enter_rank()
        try:
            return fn(rank, size, *rank_args)
        finally:
            env.leave_rank()

    saved = _module_state()
    # rebinding os.environ (not changing it) is the point: os.getenv and every reader of
    # os.environ see the rank's copy, and the process environment stays as it was
    os.environ = env  # noqa: B003
    try:
        return run_loopback_ranks(rank_main, world_size, "cpu", *args, timeout_s=timeout_s)
    finally:
        os.environ = env.real  # noqa: B003
        _restore_modules(saved)
