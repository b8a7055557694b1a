"""Fault status of a communication workspace that the host reads without a device sync.

Every bounded wait of a communication kernel ends at a deadline. A CTA whose wait expires records
the ranks it waited for (``moefuse.comm.device.record_fault``) in two places:

* the device status word ``ctrl[CTRL_STATUS]`` (later launches of this rank do nothing: CUDA
  graph replays included), and
* the host status block (:class:`HostStatus`): int32 words in pinned, device-mapped host memory
  on CUDA (plain host memory on CPU), written by the kernel with system-scope stores. Word 0 is
  the summary (non-zero once anything was recorded); word ``1 + r`` holds rank r's code:
  ``MISSING`` (this rank waited for r until the deadline) or ``GAVE_UP`` (r's own wait timed out
  and r told its peers that it left the protocol).

The host reads word 0 with one plain load (a memoryview over the pinned tensor: tens of
nanoseconds) before every call on the workspace (``AllReduceWorkspace.raise_if_failed``), so a
fault becomes a ``RuntimeError`` at the next call without ``cudaStreamSynchronize``. Kernels
find the block relative to the ``ctrl`` argument (int64 distance stored in ctrl), as they find
peer buffers relative to the pointer table: no extra kernel argument, and the same code runs in
Triton's interpreter.

A rank whose wait timed out also sets word ``rank`` of every peer's peer-visible "faults" region
(offset 0 of each buffer, the "notice words"): it has left the protocol.

The protocol (every family, every algorithm that waits on peers; device functions in
:mod:`moefuse.comm.device`):

1. Entry (``healthy``): before a launch pushes or reads any peer data it reads the device status
   word and its notice words, in one reduction that the status check already needed. If a fault
   is recorded here or a peer gave up, the launch does nothing (no push, no read, no output) and
   records ``GAVE_UP`` for every peer whose notice it saw.
2. Waits (``wait_bound`` / ``ended``): every bounded wait ends when its data arrived, at its
   deadline, or as soon as a notice word is set. The notice words live in the rank's own buffer
   and are read only on a spin after a failed first probe: a wait whose data is already there
   does exactly what it did before, a spinning one reads them with its data (no extra round trip
   once the data lands).
3. Leaving (``leave``): a CTA whose wait ended without its data records ``GAVE_UP`` for the peers
   whose notice is set, naming the rank that gave up rather than the ranks this wait polled;
   with no notice the wait timed out: it records ``MISSING`` for the ranks it waited for and posts
   its own notice to every peer (``give_up``). Either way the device status word is set, so every
   later launch of this rank (graph replays included) does nothing.

Consequences. A rank that arrives after its peer gave up raises at once naming that rank and
reads nothing pushed for the abandoned call (its entry check, or its first spin, sees the
notice). No data needs revoking: a push is only ever read by the peer's call of the same
generation/epoch, and a peer that passed its entry check before the notice was posted reads data
of that same call. ``ws.failed()`` reports the fault on every rank that launched since;
:meth:`AllReduceWorkspace.check` also reads the notice words (a sync), so a rank that made no call
learns of it too. A rank whose call fails validation raises ValueError before launching anything
and keeps a healthy workspace: its peers' calls time out naming it (bounded by ``timeout_s``),
and its next call raises at once naming the peer that gave up — or, made before their deadline,
completes their waiting call. The "torch" algorithm has no kernel waits (the process group's).
"""

from __future__ import annotations

import time

import torch

#: largest world size: status masks are int32 bit sets, bit 31 is used by the device check
MAX_RANKS = 31
#: lanes of the device-side fault vectors (``moefuse.comm.device.MAX_RANKS``)
FAULT_LANES = 32
#: int64 index (in ctrl viewed as int64) of the distance from ctrl to the host block, int32 units
CTRL_HOST64 = 4
MISSING, GAVE_UP = 1, 2
#: host block: summary word + one code word per rank (padded to 64 words = 256 bytes)
HOST_WORDS = 64
#: bytes of the peer-visible faults region at the start of every rank's buffer
FAULTS_REGION_BYTES = FAULT_LANES * 4


class HostStatus:
    """The host status block of one workspace (see the module docstring).

    ``word0()`` is the no-sync read: a plain load from host memory. ``codes(P)`` returns every
    rank's code. The kernel-side address is written into ``ctrl`` (a distance, int32 units).
    """

    def __init__(self, device: torch.device, ctrl: torch.Tensor):
        pinned = device.type == "cuda"
        self.words = torch.zeros(HOST_WORDS, dtype=torch.int32, pin_memory=pinned)
        # memoryview over the tensor's memory: indexing it is a plain 4-byte load (no tensor
        # indexing, no dispatcher), cheap enough for every call
        self._view = memoryview(self.words.numpy()).cast("B").cast("i")
        addr = _device_address(self.words) if pinned else self.words.data_ptr()
        dist = addr - ctrl.data_ptr()
        if dist % 4:
            raise RuntimeError("moefuse.comm: host status block is not 4-byte aligned")
        ctrl.view(torch.int64)[CTRL_HOST64] = dist // 4

    def word0(self) -> int:
        return self._view[0]

    def codes(self, world_size: int) -> list[int]:
        return [self._view[1 + r] for r in range(world_size)]

    @property
    def view(self) -> memoryview:
        return self._view


def _device_address(pinned: torch.Tensor) -> int:
    """Device address of pinned host memory: ``cudaHostGetDevicePointer`` (equal to the host
    address wherever unified addressing applies, i.e. every 64-bit Linux system CUDA supports)."""
    from moefuse.comm.transport import host_device_pointer

    try:
        return host_device_pointer(pinned.data_ptr())
    except Exception as exc:  # no libcudart reachable through ctypes: unified addressing
        from moefuse._runtime import log_once

        log_once(
            "AllReduceWorkspace",
            f"cudaHostGetDevicePointer unavailable ({exc}); using "
            "the host address of the pinned status block (unified addressing)",
        )
        return pinned.data_ptr()


def describe(
    codes: list[int], summary: int, *, rank: int, group: str, timeout_s: float, global_rank
) -> str:
    """The error message of a failed workspace: which ranks, what happened, the way back."""
    missing = [r for r, c in enumerate(codes) if c == MISSING]
    gave_up = [r for r, c in enumerate(codes) if c == GAVE_UP]
    unknown = [
        r for r in range(len(codes)) if summary >> r & 1 and r not in missing and r not in gave_up
    ]
    names = lambda rs: ", ".join(f"{r} (global rank {global_rank(r)})" for r in rs)  # noqa: E731
    parts = []
    if missing or unknown:
        parts.append(
            f"rank(s) {names(missing + unknown)} never arrived within timeout_s={timeout_s:g}"
        )
    if gave_up:
        parts.append(
            f"rank(s) {names(gave_up)} gave up waiting (their bounded wait timed out "
            "before this rank arrived)"
        )
    if not parts:
        parts.append("a bounded wait timed out")
    return (
        f"{'; '.join(parts)} (seen by group rank {rank} of group {group!r}); outputs of "
        "the failed call and of every later call on this workspace are not valid; close() "
        "and re-create the workspace"
    )


def bounded_barrier(store, key: str, world_size: int, timeout_s: float) -> int:
    """Barrier through the process group's store, bounded by ``timeout_s`` (a dead peer must not
    hang ``close()`` of a failed workspace, which a collective would). Returns how many ranks
    arrived (``world_size`` on success)."""
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        arrived = int(store.add(key, 0))
        if arrived >= world_size or time.monotonic() > deadline:
            return arrived
        time.sleep(0.002)
