"""Peer-visible memory for the communication workspace: one byte buffer per rank, mapped into every
rank's address space, addressed by a table of base addresses.

Backends (chosen by :class:`moefuse.comm.AllReduceWorkspace` from the device type):

* :class:`SymmetricMemoryTransport` (CUDA): ``torch.distributed._symmetric_memory.empty`` +
  ``rendezvous`` with NVLink multicast disabled; ``buffer_ptrs`` are the peers' buffers mapped into
  this process over NVLink P2P (unicast loads and stores only, never ``multimem``).
* :class:`CudaIpcTransport` (CUDA, where symmetric memory is missing or fails): an ordinary
  device allocation per rank, shared with CUDA IPC handles (``torch.multiprocessing``'s tensor
  reduction) exchanged over the group and opened by every peer; the same unicast P2P mappings.
* :class:`SharedMemoryTransport` (CPU): one file per rank in a shared-memory directory, mapped
  ``MAP_SHARED`` by every process of the group. The Triton interpreter dereferences raw addresses,
  so the same kernels that run on the GPU run across real processes on CPU tensors.
* :class:`LoopbackTransport` (CUDA or CPU, tests and benchmarks only): every rank is a thread of
  ONE process (``moefuse.testing_ranks``), so an ordinary tensor per rank is already addressable
  by every rank; several ranks may share one GPU. Only picked by an explicit
  ``transport="loopback"``, never by "auto".

All expose ``local`` (this rank's buffer as a uint8 tensor), ``peer_addrs`` (the address, valid in
this process, of every rank's buffer; index = rank in the group) and an idempotent ``close()``.
Neither ever hands a shared buffer to a kernel as a tensor argument: Triton's interpreter copies
tensor arguments back after a launch, which would race with peers writing the same bytes.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import uuid

import torch
import torch.distributed as dist

#: environment the GPU transport (and every process that benchmarks against NCCL/symm-mem) keeps
#: set: multicast (NVLS) must never be used, and NCCL must not pick it either.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

#: every base address is a multiple of this (kernels load table entries in 16-byte units so that
#: Triton can prove 16-byte alignment and vectorize peer loads and stores)
ALIGN = 16


def disable_multicast_env() -> None:
    """Set the no-multicast variables (without overriding an explicit user choice)."""
    for key, value in NO_MULTICAST_ENV.items():
        os.environ.setdefault(key, value)


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


class _PeerBuffers:
    """What every transport shares: the last step of its collective construction
    (:meth:`_publish`) and its collective, idempotent :meth:`close`. Subclasses call
    ``__init__`` first and say how to let go of their buffers (:meth:`_unmap`, :meth:`_free`)."""

    def __init__(self, group, nbytes: int):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.nbytes = int(nbytes)

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def _publish(self, addrs, what: str) -> None:
        """Every rank's buffer address (index = rank), checked against the kernels' 16-byte
        alignment, then a barrier: no rank touches a peer's buffer before every rank has set its
        own up."""
        self.peer_addrs = list(addrs)
        if any(a % ALIGN for a in self.peer_addrs):
            raise RuntimeError(f"{what} are not 16-byte aligned")
        dist.barrier(group=self.group)
        self._closed = False

    def close(self, barrier=None) -> None:
        """Collective. This rank stops using the peers' buffers (:meth:`_unmap`), then
        ``barrier`` (default ``dist.barrier``; if it raises, nothing of this rank is released: a
        peer may still write into it), then this rank's own buffer goes (:meth:`_free`)."""
        if self._closed:
            return
        self._closed = True
        self.peer_addrs = []
        self._unmap()
        (barrier or self._barrier)()
        self._free()

    def _unmap(self) -> None:
        """Drop this process's mappings of the peers' buffers (before the closing barrier)."""

    def _free(self) -> None:
        """Release this rank's buffer (after the closing barrier)."""


class SharedMemoryTransport(_PeerBuffers):
    """Per-rank buffers in shared-memory files; collective over a gloo ``group``.

    Construction: every rank creates and zero-fills its file, the names are exchanged with
    ``all_gather_object``, every rank maps every file, a barrier, and each rank unlinks its own
    file (the mappings outlive the names). ``close()`` is collective too (barrier, unmap).
    """

    kind = "shm"

    def __init__(self, group, nbytes: int, init=None, vote=None):
        super().__init__(group, nbytes)
        tag = uuid.uuid4().hex[:12]
        self._path = os.path.join(_shm_dir(), f"moefuse-comm-{os.getpid()}-{tag}-r{self.rank}")
        try:
            storage = torch.UntypedStorage.from_file(self._path, True, self.nbytes)
            error = None
        except Exception as exc:  # e.g. no space in the shared-memory directory
            error = exc
        _agree(vote, error, self._unlink)
        self.local = torch.empty(0, dtype=torch.uint8).set_(storage)
        self.local.zero_()
        if init is not None:
            init(self.local)
        paths = [None] * self.world_size
        dist.all_gather_object(paths, self._path, group=group)
        self._maps = []
        for r, path in enumerate(paths):
            if r == self.rank:
                self._maps.append(self.local)
            else:
                st = torch.UntypedStorage.from_file(path, True, self.nbytes)
                self._maps.append(torch.empty(0, dtype=torch.uint8).set_(st))
        self._publish([m.data_ptr() for m in self._maps], "shared-memory mappings")
        # every rank has mapped every file: the names can go now (the mappings stay valid), so a
        # crashed process never leaves a file behind
        self._unlink()

    def _free(self) -> None:
        self._maps = []
        self.local = None
        self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass


def needs_group_enable(enable) -> bool:
    """Whether ``enable_symm_mem_for_group`` must be called: it exists and is not marked
    deprecated. PyTorch >= 2.11 registers groups itself and decorates the function with
    ``@deprecated`` (``__deprecated__`` set), which would emit a FutureWarning on every
    workspace creation."""
    return enable is not None and getattr(enable, "__deprecated__", None) is None


class SymmetricMemoryTransport(_PeerBuffers):
    """Per-rank buffers from torch symmetric memory over NVLink P2P, multicast disabled.

    ``init(local)`` fills this rank's buffer (e.g. Lamport sentinels) before the rendezvous
    barrier, so no peer can write into it before it is initialised.
    """

    kind = "symm_mem"

    def __init__(self, group, nbytes: int, device: torch.device, init=None, vote=None):
        disable_multicast_env()
        import torch.distributed._symmetric_memory as symm_mem

        super().__init__(group, nbytes)
        name = group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if needs_group_enable(enable):
            try:
                enable(name)
            except Exception:  # a torch that registers groups itself
                pass
        try:
            self.local = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=device)
            error = None
        except Exception as exc:  # e.g. out of memory, or no symmetric-memory backend
            error = exc
        _agree(vote, error, lambda: None)
        self.local.zero_()
        if init is not None:
            init(self.local)
        torch.cuda.synchronize(device)
        self._handle = symm_mem.rendezvous(self.local, name)
        self._publish([int(p) for p in self._handle.buffer_ptrs], "symmetric-memory buffers")

    def _free(self) -> None:
        self._handle = None
        self.local = None


class _CudaRuntime:
    """The CUDA runtime calls of :class:`CudaIpcTransport`, through ctypes (no compiled code): on
    the libcudart this process already loaded (PyTorch's), else the one the loader finds."""

    IPC_HANDLE_BYTES = 64
    LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess

    def __init__(self):
        import ctypes
        import ctypes.util

        self._c = ctypes
        path = _loaded_library("libcudart") or ctypes.util.find_library("cudart")
        if path is None:
            raise RuntimeError("libcudart not found")
        lib = ctypes.CDLL(path)

        class IpcHandle(ctypes.Structure):  # cudaIpcMemHandle_t: passed BY VALUE to open
            _fields_ = [("reserved", ctypes.c_byte * self.IPC_HANDLE_BYTES)]

        self._handle_t = IpcHandle
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self._sig(lib.cudaMalloc, [ctypes.POINTER(vp), sz])
        self._sig(lib.cudaFree, [vp])
        self._sig(lib.cudaIpcGetMemHandle, [ctypes.POINTER(IpcHandle), vp])
        self._sig(lib.cudaIpcOpenMemHandle, [ctypes.POINTER(vp), IpcHandle, ctypes.c_uint])
        self._sig(lib.cudaIpcCloseMemHandle, [vp])
        self._sig(lib.cudaGetErrorString, [ctypes.c_int], ctypes.c_char_p)
        self._sig(lib.cudaGetLastError, [])
        self._sig(lib.cudaSetDevice, [ctypes.c_int])
        self._sig(lib.cudaHostGetDevicePointer, [ctypes.POINTER(vp), vp, ctypes.c_uint])
        self.lib = lib

    def set_device(self, index: int) -> None:
        """Make ``index`` current for this runtime (a libcudart loaded apart from PyTorch's has
        its own current device)."""
        self._check(self.lib.cudaSetDevice(index), "cudaSetDevice")

    @staticmethod
    def _sig(fn, argtypes, restype=None):
        import ctypes

        fn.argtypes = argtypes
        fn.restype = ctypes.c_int if restype is None else restype

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            # reset the runtime's last-error word: PyTorch shares this libcudart and would
            # otherwise report the error at its next, unrelated CUDA call
            self.lib.cudaGetLastError()
            msg = self.lib.cudaGetErrorString(rc).decode(errors="replace")
            raise RuntimeError(f"{what} failed: {msg} (error {rc})")

    def malloc(self, nbytes: int) -> int:
        ptr = self._c.c_void_p()
        self._check(self.lib.cudaMalloc(self._c.byref(ptr), nbytes), "cudaMalloc")
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(self._c.c_void_p(ptr)), "cudaFree")

    def ipc_handle(self, ptr: int) -> bytes:
        handle = self._handle_t()
        self._check(
            self.lib.cudaIpcGetMemHandle(self._c.byref(handle), self._c.c_void_p(ptr)),
            "cudaIpcGetMemHandle",
        )
        return bytes(handle)

    def ipc_open(self, handle: bytes) -> int:
        ptr = self._c.c_void_p()
        raw = self._handle_t.from_buffer_copy(handle)
        self._check(
            self.lib.cudaIpcOpenMemHandle(self._c.byref(ptr), raw, self.LAZY_ENABLE_PEER_ACCESS),
            "cudaIpcOpenMemHandle",
        )
        return int(ptr.value)

    def ipc_close(self, ptr: int) -> None:
        self._check(self.lib.cudaIpcCloseMemHandle(self._c.c_void_p(ptr)), "cudaIpcCloseMemHandle")

    def host_device_pointer(self, ptr: int) -> int:
        dev = self._c.c_void_p()
        self._check(
            self.lib.cudaHostGetDevicePointer(self._c.byref(dev), self._c.c_void_p(ptr), 0),
            "cudaHostGetDevicePointer",
        )
        return int(dev.value)


def host_device_pointer(ptr: int) -> int:
    """Device address of pinned host memory at host address ``ptr`` (the same value under
    unified addressing; asked of the runtime rather than assumed)."""
    return _CudaRuntime().host_device_pointer(ptr)


def _loaded_library(stem: str) -> str | None:
    """Path of an already-loaded shared library whose file name starts with ``stem``."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith(stem + ".so"):
                    return path
    except OSError:
        pass
    return None


class _DeviceBytes:
    """``__cuda_array_interface__`` of a raw device allocation (zero-copy into a torch tensor)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


class CudaIpcTransport(_PeerBuffers):
    """Per-rank device buffers shared with CUDA IPC (same host, P2P access between the devices).

    Each rank ``cudaMalloc``s its own buffer (outside PyTorch's caching allocator, so the IPC
    handle covers exactly this buffer), fills it (``init``) and publishes its 64-byte IPC handle
    with ``all_gather_object``. Every rank opens every peer's handle on its own device
    (``cudaIpcOpenMemHandle`` with lazy peer access): the returned addresses are valid in this
    process and reach the peer's memory over NVLink. ``close()`` is collective: every rank
    closes its mappings of the peers' buffers before any rank frees its own.
    """

    kind = "cuda_ipc"

    def __init__(self, group, nbytes: int, device: torch.device, init=None, vote=None):
        super().__init__(group, nbytes)
        self.device = device
        self._ptr = None
        self._opened: list[int] = []
        handle, error = None, None
        try:
            self._rt = _CudaRuntime()
            with torch.cuda.device(device):
                self._rt.set_device(device.index)
                self._ptr = self._rt.malloc(self.nbytes)
                handle = self._rt.ipc_handle(self._ptr)
        except Exception as exc:  # no libcudart, out of memory, no IPC on this platform
            error = exc
        _agree(vote, error, self._free)
        self.local = torch.as_tensor(_DeviceBytes(self._ptr, self.nbytes), device=device)
        self.local.zero_()
        if init is not None:
            init(self.local)
        torch.cuda.synchronize(device)
        handles = [None] * self.world_size
        dist.all_gather_object(handles, handle, group=group)
        addrs, error = [], None
        try:
            with torch.cuda.device(device):
                self._rt.set_device(device.index)
                for r, h in enumerate(handles):
                    if r == self.rank:
                        addrs.append(self._ptr)
                    else:
                        addr = self._rt.ipc_open(h)
                        self._opened.append(addr)
                        addrs.append(addr)
        except Exception as exc:  # e.g. no P2P between two of the devices
            error = exc
        _agree(vote, error, self._release)
        self._publish(addrs, "CUDA IPC buffers")

    def _unmap(self) -> None:
        with torch.cuda.device(self.device):
            if self._opened:
                self._rt.set_device(self.device.index)
            for addr in self._opened:
                self._rt.ipc_close(addr)
        self._opened = []

    def _free(self) -> None:
        if self._ptr is not None:
            self.local = None
            with torch.cuda.device(self.device):
                self._rt.set_device(self.device.index)
                self._rt.free(self._ptr)
            self._ptr = None

    def _release(self) -> None:
        """Failure during set-up: every rank runs this after the same vote."""
        self._unmap()
        dist.barrier(group=self.group)
        self._free()


class LoopbackTransport(_PeerBuffers):
    """Per-rank buffers of ranks that are threads of one process, for tests and benchmarks on
    ONE device (several ranks on one GPU, or on CPU under the Triton interpreter).

    Each rank allocates an ordinary zero-filled tensor on ``device`` (``init`` applied) and
    publishes ``(pid, address)`` with ``all_gather_object``: all ranks live in this process, so
    the addresses are valid as they are (no mapping). Construction fails on every rank alike
    when the ranks are not all in one process. ``close()`` frees this rank's buffer after the
    barrier, so no peer still writes into it. Never chosen by "auto": ranks on one device only
    make progress when every rank's kernels can be resident at once (the workspace gives each
    rank ``1/P`` of the SMs, see ``AllReduceWorkspace``), which real deployments do not need.
    """

    kind = "loopback"

    def __init__(self, group, nbytes: int, device: torch.device, init=None, vote=None):
        super().__init__(group, nbytes)
        self.device = device
        try:
            self.local = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
            error = None
        except Exception as exc:  # out of memory
            error = exc
        _agree(vote, error, lambda: None)
        if init is not None:
            init(self.local)
        if device.type == "cuda":  # peers' kernels run on other streams: the fill must be done
            torch.cuda.synchronize(device)
        infos = [None] * self.world_size
        dist.all_gather_object(infos, (os.getpid(), self.local.data_ptr()), group=group)
        if any(pid != os.getpid() for pid, _ in infos):
            self.local = None
            raise RuntimeError(
                "loopback transport: the ranks are not threads of one process "
                f"(pids {sorted({pid for pid, _ in infos})})"
            )
        self._publish([addr for _, addr in infos], "loopback buffers")

    def _free(self) -> None:
        self.local = None


#: CUDA transports in the order "auto" tries them
CUDA_TRANSPORTS = ("symm_mem", "cuda_ipc")
#: the test transport (ranks as threads of one process); only ever by explicit request
LOOPBACK = "loopback"


def cuda_transport_order(requested: str) -> tuple[str, ...]:
    """The CUDA transports to try, in order, for ``requested`` ("auto", "symm_mem", "cuda_ipc"
    or "loopback"); ValueError otherwise. "auto" never includes "loopback"."""
    if requested == "auto":
        return CUDA_TRANSPORTS
    if requested in CUDA_TRANSPORTS or requested == LOOPBACK:
        return (requested,)
    raise ValueError(
        f"transport must be 'auto' or one of {(*CUDA_TRANSPORTS, LOOPBACK)}, got {requested!r}"
    )


def make_transport(kind: str, group, nbytes: int, device, init=None, vote=None):
    """Transport ``kind`` ("shm" for a CPU device, "loopback" for threads of one process on any
    device, else one of ``CUDA_TRANSPORTS``)."""
    if kind == "shm":
        return SharedMemoryTransport(group, nbytes, init, vote)
    cls = {
        "symm_mem": SymmetricMemoryTransport,
        "cuda_ipc": CudaIpcTransport,
        LOOPBACK: LoopbackTransport,
    }[kind]
    return cls(group, nbytes, device, init, vote)


def _agree(vote, error, cleanup) -> None:
    """Every rank learns whether every rank's allocation succeeded before anyone enters the
    next collective step (a rank that failed alone would otherwise leave the others hanging)."""
    ok = error is None
    if vote is not None:
        ok = vote(ok)
    if not ok:
        cleanup()
        raise RuntimeError(f"peer buffer allocation failed ({error or 'on another rank'})")


class CpuClock:
    """A nanosecond clock in a one-element int64 tensor, refreshed by a daemon thread.

    Triton's interpreter cannot read ``%globaltimer``; its bounded waits read this word instead
    (with a volatile load), so a CPU timeout means the same wall-clock time as a GPU one. The
    thread ticks every ``period_s``; the interpreter releases the GIL often enough for it to run.
    """

    def __init__(self, period_s: float = 0.002):
        self.tensor = torch.zeros(1, dtype=torch.int64)
        self._period = period_s
        #: a read may be up to one tick old, so a wait can see its deadline pass up to one tick
        #: early: waits add this to their timeout so none ends before ``timeout_s``
        self.resolution_us = int(period_s * 1e6)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._word = self.tensor.numpy()  # ticks write here: no torch op per launch
        self._word[0] = time.monotonic_ns()
        self._thread = threading.Thread(target=self._run, name="moefuse-comm-clock", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.tick()

    def tick(self) -> None:
        """Set the word to now. Called right before each launch as well: a wait's deadline is the
        word it reads first plus the timeout, and that word is then never older than the call,
        so no wait ends before ``timeout_s`` after the call began even when the refresh thread is
        starved (2-core CI, several rank processes; a thread-only clock ended a 2 s wait at 1.98 s).
        Locked and monotonic: the thread can never write back an older reading over a newer one.
        """
        with self._lock:
            now = time.monotonic_ns()
            if now > int(self._word[0]):
                self._word[0] = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1.0)
