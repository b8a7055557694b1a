"""Loopback ranks: P ranks of a communication group as P threads of this process, on ONE device.

The communication ops need P >= 2 ranks with peer buffers. :func:`run_loopback_ranks` runs
``fn(rank, world_size, *args)`` in P threads that form a torch.distributed group (PyTorch's
threaded test group, ``torch.testing._internal.distributed.multi_threaded_pg``: WORLD is per
thread) and whose workspaces use ``transport="loopback"`` (plain per-rank tensors, addresses
shared in-process; :class:`moefuse.comm.transport.LoopbackTransport`). So correctness tests and
rough A/B timings of multi-rank kernels run on one GPU, or on CPU in the Triton interpreter::

    def scenario(rank, world_size, h):
        ws = moefuse.AllReduceWorkspace(None, 64, h, torch.bfloat16, "cuda")   # loopback
        ...
        ws.close()
        return digest

    digests = run_loopback_ranks(scenario, 2, "cuda", 4096)   # index = rank

What the runner does for the duration of the call:

* each thread joins the group, makes ``device`` current and, on CUDA, runs ``fn`` on its own
  ``torch.cuda.Stream`` (current in that thread): the ranks' kernels run concurrently, as they
  must, since they wait on each other; the stream is synchronized before ``fn``'s result is
  returned. With one GPU every rank's workspace sizes its grids to ``1/P`` of the SMs.
* on CUDA each rank first fills PyTorch's caching allocator for its stream (``reserve_bytes``
  in one block plus 64 MiB of small blocks, allocated and freed), so later allocations need no
  ``cudaMalloc``: see "One context" below.
* ``MOEFUSE_COMM_TRANSPORT=loopback`` is set (restored afterwards), so workspaces created with
  the default ``transport=None`` use loopback buffers without changing the scenario code.
* Triton's JIT compiles a kernel the first time a thread launches it. Compilation is
  serialized by a lock, and a thread that waited takes the kernel the first one compiled: the
  ranks then compile and load each kernel once, and the module is loaded before any rank
  launches it (loading waits for the device, see "One context"; two threads compiling at once
  is also a case Triton's JIT does not promise to handle, triton-lang/triton#5933).
* Under ``TRITON_INTERPRET=1`` the interpreter keeps the program id in one global builder and
  patches ``triton.language`` per launch (restoring it at the end of each launch), which two
  concurrent launches would trample: :func:`_thread_safe_interpreter` makes the program id
  per thread and restores the patches only when no launch is running.

Exceptions of any rank are re-raised in the caller with every failing rank's traceback (a rank
blocked in a group collective is woken and ends); ranks that do not finish within ``timeout_s``
raise ``TimeoutError`` (their threads are daemons; kernels end by their bounded waits).

One context (CUDA): the ranks share one CUDA context, and some CUDA calls wait for the work
already running on the device: loading a kernel's module (measured on H200 / CUDA 13: a second
load of a Triton kernel waited for the peer's running kernel, which waited for this rank, until
the bounded wait expired; CUDA's lazy loading of a kernel at its first use loads modules too,
``CUDA_MODULE_LOADING=EAGER`` avoids that: the runner sets it where CUDA is not initialized yet,
and tests/conftest.py for every test process), ``cudaFree`` (``torch.cuda.empty_cache()``, which
``torch.cuda.graph`` calls on entry), and per the CUDA programming guide's "implicit
synchronization" list device-memory and pinned-host allocation. Issued by one rank while a
peer's kernel waits for that rank, they stall both until the wait runs out. The runner loads
each Triton kernel once, under its compile lock, and fills each rank's allocator cache first;
in ``fn``: put ``dist.barrier()`` between host-side work (checks, references) and the next
collective call, so that no rank still does such work while a peer's kernel already waits;
keep CUDA graphs alive until the workspaces are closed; capture with
``CUDAGraph.capture_begin`` / ``capture_end`` (no ``empty_cache``) while the other ranks are
idle. Separate processes on separate GPUs have none of this.

Limits: one run at a time per process; ``fn`` must make the same collective calls on every
rank, as with processes. The threaded group's collectives run in Python on the host and are not
ordered with the ranks' CUDA streams: use it for host values and CPU tensors (the workspaces do:
their votes and exchanges are on CPU), not to move CUDA tensors between ranks (compute
references from every rank's inputs instead, and compare on the host).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
import traceback

import torch

_RUN_LOCK = threading.Lock()


def run_loopback_ranks(
    fn, world_size: int, device, *args, timeout_s: float = 300.0, reserve_bytes: int = 1 << 30
) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` threads joined by a threaded
    torch.distributed group (loopback workspaces, one stream per rank on CUDA); returns the
    results in rank order. ``reserve_bytes``: caching-allocator reserve per rank (CUDA). See
    the module docstring."""
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(
            f"run_loopback_ranks: world_size must be a positive int, got {world_size!r}"
        )
    device = torch.device(device)
    if device.type == "cuda":
        _eager_module_loading()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not _RUN_LOCK.acquire(blocking=False):
        raise RuntimeError("run_loopback_ranks: another loopback run is in progress")
    isolation = getattr(torch._C._distributed_c10d, "_set_thread_isolation_mode", None)
    results: dict[int, tuple[str, object]] = {}
    old_env = os.environ.get("MOEFUSE_COMM_TRANSPORT")
    try:
        with contextlib.ExitStack() as stack:
            os.environ["MOEFUSE_COMM_TRANSPORT"] = "loopback"
            if _interpreting():
                stack.enter_context(_thread_safe_interpreter())
            elif device.type == "cuda":
                stack.enter_context(_serialized_triton_compile())
            if isolation is not None:  # c10d's group registry per thread
                isolation(True)
            mtpg.ProcessLocalGroup.reset()
            world = mtpg._install_threaded_pg()
            if not hasattr(world, "comms"):  # torch 2.11: destroy_process_group reads _world.comms
                world.comms = []  # (torchcomms objects; the threaded group never has any)
            store = dist.HashStore()

            def worker(rank: int) -> None:
                try:
                    dist.init_process_group(
                        "threaded",
                        rank=rank,
                        world_size=world_size,
                        store=store,
                        timeout=datetime.timedelta(seconds=timeout_s),
                    )
                    try:
                        results[rank] = (
                            "ok",
                            _call_on_own_stream(fn, rank, world_size, args, device, reserve_bytes),
                        )
                    finally:
                        dist.destroy_process_group()
                except SystemExit:  # woken out of a collective because another rank failed
                    results[rank] = ("terminated", None)
                except BaseException as exc:
                    results[rank] = ("error", traceback.format_exc())
                    mtpg.ProcessLocalGroup.exception_handle(exc)  # wake ranks in collectives

            threads = [
                threading.Thread(target=worker, args=(r,), name=f"moefuse-rank-{r}", daemon=True)
                for r in range(world_size)
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + timeout_s
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            stuck = [r for r, t in enumerate(threads) if t.is_alive()]
            if stuck:
                mtpg.ProcessLocalGroup.exception_handle(TimeoutError())
            mtpg.ProcessLocalGroup.reset()
            mtpg._uninstall_threaded_pg()
            if isolation is not None:
                isolation(False)
    finally:
        if old_env is None:
            os.environ.pop("MOEFUSE_COMM_TRANSPORT", None)
        else:
            os.environ["MOEFUSE_COMM_TRANSPORT"] = old_env
        _RUN_LOCK.release()
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(results.items()) if s == "error"]
    if errors:
        raise AssertionError("loopback ranks failed:\n" + "\n".join(errors))
    if stuck:
        raise TimeoutError(f"loopback ranks {stuck} did not finish within {timeout_s:g} s")
    missing = [r for r in range(world_size) if results.get(r, ("",))[0] != "ok"]
    if missing:
        raise AssertionError(f"loopback ranks {missing} ended without a result")
    return [results[r][1] for r in range(world_size)]


def _call_on_own_stream(fn, rank, world_size, args, device, reserve_bytes):
    if device.type != "cuda":
        return fn(rank, world_size, *args)
    torch.cuda.set_device(device)  # the current device is per thread
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        _reserve(device, reserve_bytes)
        out = fn(rank, world_size, *args)
    stream.synchronize()
    return out


def _reserve(device, nbytes: int) -> None:
    """Cached blocks for the current stream (the allocator reuses a freed block only on the
    stream it was allocated on): one large block of ``nbytes`` (split for requests > 1 MiB) and
    32 two-MiB small-pool segments (requests <= 1 MiB), allocated now, before any peer kernel
    runs, so that later allocations of this rank need no ``cudaMalloc``."""
    if nbytes > 0:
        big = torch.empty(int(nbytes), dtype=torch.uint8, device=device)
        small = [torch.empty(1 << 20, dtype=torch.uint8, device=device) for _ in range(64)]
        del big, small


def _eager_module_loading() -> None:
    """One context for every rank: load every module at start-up (see "One context"). Where CUDA
    started already with lazy loading, say so once: a kernel's first use on one rank may then
    stall a peer's waiting kernel until its bounded wait runs out."""
    if not torch.cuda.is_initialized():
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    elif os.environ.get("CUDA_MODULE_LOADING", "LAZY").upper() != "EAGER":
        from moefuse._runtime import log_once

        log_once(
            "testing_ranks",
            "CUDA started with lazy module loading: a module loaded at a kernel's first use by "
            "one loopback rank waits for the other rank's running kernel; set "
            "CUDA_MODULE_LOADING=EAGER before CUDA starts",
        )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@contextlib.contextmanager
def _serialized_triton_compile():
    """One Triton compilation and module load at a time (see the module docstring): a thread
    that waited looks the kernel up again first, so the second rank reuses the first rank's
    compilation, and the first rank loads the module before anyone can launch the kernel.

    Measured on H200 (Triton 3.6, CUDA 13): without the load under the lock, the second rank
    found the kernel in the cache while the first was still loading it, loaded it again after
    the first had launched, and ``cuModuleLoadData`` waited for the first rank's kernel, which
    waited for the second rank (until the bounded wait ran out).

    A rank waiting for the lock polls the cache: with a plain wait, the first rank could launch
    the kernel both needed, then take the lock again to compile and load another kernel (a
    reference check, say) while the second rank still waited for it; that load waits for the
    first rank's running kernel, which waits for the second rank: both stall until the
    kernel's bounded wait runs out, and the call's outputs are those of a timed-out kernel
    (garbage, with the fault recorded in the workspace). Separate processes share no lock and
    no context, so they cannot stall this way."""
    try:
        from triton.compiler.compiler import CompiledKernel
        from triton.runtime.jit import JITFunction
    except ImportError:
        yield
        return
    original = getattr(JITFunction, "_do_compile", None)
    init_handles = getattr(CompiledKernel, "_init_handles", None)
    if original is None or init_handles is None:  # another Triton: its JIT is left as it is
        yield
        return
    lock = threading.RLock()

    def _init_handles(self):
        if getattr(self, "module", None) is not None:  # loaded: the per-launch fast exit
            return None
        with lock:
            return init_handles(self)

    def cached(self, key, device):
        try:
            return self.device_caches[device][0].get(key)
        except Exception:  # a cache layout this wrapper does not know: just compile
            return None

    def _do_compile(self, key, signature, device, *rest, **kwargs):
        # While waiting for the lock, take the kernel as soon as another rank has put it in the
        # cache (compiled and loaded). Waiting for the lock itself could last until a bounded
        # wait runs out: the holder may be loading another module, which waits for the device,
        # i.e. for the holder's own communication kernel, which waits for this rank's launch.
        while not lock.acquire(timeout=0.005):
            kernel = cached(self, key, device)
            if kernel is not None:
                return kernel
        try:
            kernel = cached(self, key, device)
            if kernel is not None:
                return kernel
            kernel = original(self, key, signature, device, *rest, **kwargs)
            if isinstance(kernel, CompiledKernel):  # (not a future of async compilation)
                kernel._init_handles()  # load now, under the lock
            return kernel
        finally:
            lock.release()

    JITFunction._do_compile = _do_compile
    CompiledKernel._init_handles = _init_handles
    try:
        yield
    finally:
        JITFunction._do_compile = original
        CompiledKernel._init_handles = init_handles


#: sleep before each volatile load under the interpreter (see :func:`_thread_safe_interpreter`)
SPIN_PAUSE_S = 2e-4


def _pausing(masked_load):
    """``InterpreterBuilder.create_masked_load`` that sleeps :data:`SPIN_PAUSE_S` (releasing the
    GIL) before a volatile load: the loads a bounded wait spins on."""

    def pausing_masked_load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile):
        if is_volatile:
            time.sleep(SPIN_PAUSE_S)
        return masked_load(self, ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)

    return pausing_masked_load


_INSTALLED = [False]  # whether _thread_safe_interpreter's patches are in place (process-wide)


@contextlib.contextmanager
def interpreter_session():
    """The interpreter set-up of :func:`run_loopback_ranks` (see :func:`_thread_safe_interpreter`)
    for longer than one run, e.g. a whole pytest run: one thread or many, every launch then
    patches ``triton.language`` once instead of at every device-function call (the same kernels
    and bits; 30-40 % less CPU time measured for the norm and quant interpreter tests). A no-op
    without ``TRITON_INTERPRET=1``; nested uses (a loopback run inside it) share the outer
    set-up."""
    if not _interpreting():
        yield
        return
    with _thread_safe_interpreter():
        yield


@contextlib.contextmanager
def _thread_safe_interpreter():
    """Let several threads run Triton-interpreter launches at once (Triton 3.x interpreter).

    * ``InterpreterBuilder.grid_idx`` / ``grid_dim`` (what ``tl.program_id`` and
      ``tl.num_programs`` read) become per-thread properties;
    * ``_patch_lang`` scopes are restored only once no launch runs on any thread (a launch that
      ended would otherwise restore ``triton.language`` under a launch still running), in
      reverse order of patching;
    * while a launch runs, a ``_patch_lang`` of modules already patched since the last restore
      is skipped: Triton patches again on every device-function call (~2 ms of
      ``inspect.getmembers`` each, the same attributes set to equivalent wrappers), which made
      up a third of a multi-rank interpreter test, and more with the ranks queued on the lock;
    * a function's first rewrite (``InterpretedFunction.rewrite``: parse, one AST transformer
      shared by all functions, ``compile``) runs under a lock: two threads rewriting at once
      failed now and then with ``SystemError: AST constructor recursion depth mismatch``;
    * every volatile load (what a bounded wait spins on: the clock word, notice words, Lamport
      rows) first sleeps :data:`SPIN_PAUSE_S`, releasing the GIL: a rank spinning on a peer's
      data otherwise held it for half of every switch interval while the peer it waited for
      needed it to make progress (a profile of a two-rank pattern test: ~80 % of the rank
      threads' samples in spins).
    """
    if _INSTALLED[0]:  # already installed (by interpreter_session): nothing to add
        yield
        return
    from triton.runtime import interpreter as interp

    builder_cls = interp.InterpreterBuilder
    local = threading.local()
    lock = threading.Lock()
    state = {"active": 0, "scopes": [], "patched": set()}
    patch_lang = interp._patch_lang
    call = interp.GridExecutor.__call__
    lang_modules = (interp.tl, interp.tl.core)
    langs_of: dict = {}  # function -> the language modules _patch_lang patches for it

    class _Deferred:
        def restore(self) -> None:  # restored by the last launch to end
            pass

    def deferred_patch_lang(fn):
        langs = langs_of.get(fn)
        if langs is None:  # the modules Triton's _patch_lang finds in the function's globals
            langs = frozenset(
                id(v) for v in list(fn.__globals__.values()) if any(v is m for m in lang_modules)
            )
            langs_of[fn] = langs
        with lock:
            if not (state["active"] and langs and langs <= state["patched"]):
                state["scopes"].append(patch_lang(fn))
                state["patched"] |= langs
        return _Deferred()

    def counted_call(self, *args, **kwargs):
        with lock:
            state["active"] += 1
        try:
            return call(self, *args, **kwargs)
        finally:
            with lock:
                state["active"] -= 1
                if state["active"] == 0:
                    while state["scopes"]:
                        state["scopes"].pop().restore()
                    state["patched"].clear()

    def per_thread(name):
        return property(
            lambda self: getattr(local, name, None), lambda self, value: setattr(local, name, value)
        )

    rewrite = interp.InterpretedFunction.rewrite
    rewrite_lock = threading.Lock()

    def locked_rewrite(self):
        done = self.rewritten_fn.get(self.fn)
        if done is not None:
            return done
        with rewrite_lock:
            return rewrite(self)

    masked_load = builder_cls.create_masked_load
    builder_cls.grid_idx = per_thread("grid_idx")
    builder_cls.grid_dim = per_thread("grid_dim")
    builder_cls.create_masked_load = _pausing(masked_load)
    interp._patch_lang = deferred_patch_lang
    interp.GridExecutor.__call__ = counted_call
    interp.InterpretedFunction.rewrite = locked_rewrite
    _INSTALLED[0] = True
    try:
        yield
    finally:
        _INSTALLED[0] = False
        interp.InterpretedFunction.rewrite = rewrite
        interp.GridExecutor.__call__ = call
        interp._patch_lang = patch_lang
        del builder_cls.grid_idx, builder_cls.grid_dim
        builder_cls.create_masked_load = masked_load
        with lock:
            while state["scopes"]:
                state["scopes"].pop().restore()
