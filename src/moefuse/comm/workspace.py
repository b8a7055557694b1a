"""The communication workspace: peer buffers, device-resident control state, lifecycle.

``AllReduceWorkspace(group, max_tokens, hidden_size, dtype, device)`` is collective over a
``torch.distributed`` process group (any ranks, any order; ranks below are ranks *in the group*).
Lifecycle::

    ws = AllReduceWorkspace(group, max_tokens, hidden, torch.bfloat16, device)   # collective
    ok = ws.vote(ws.supports(x))      # collective MIN before CUDA-graph capture: ranks agree
    with ws.capture():                # checks health (syncs) before the capture starts
        ... moefuse.allreduce_residual_rmsnorm(..., workspace=ws) ...
    ws.check()                        # syncs; RuntimeError naming ranks that never arrived
    ws.failed()                       # no sync: the failure message, or None while healthy
    ws.close()                        # required, collective: device sync + barrier; idempotent

Faults (see :mod:`moefuse.comm.faults`). Every wait of every communication kernel is bounded by
``timeout_s``. A CTA whose wait expires records the ranks it waited for in the device status word
and in a host status block (pinned host memory, written by the kernel with system-scope
stores), tells the peers that this rank gave up, and stops; later launches on this rank do
nothing, and a peer that arrives late sees the notice and stops too. Every op reads the host
block before it launches (:meth:`raise_if_failed`: one plain load, no device sync) and raises
``RuntimeError`` naming the rank(s) and the group; once failed, every later call raises until
the workspace is closed and re-created (``close()`` uses a bounded barrier, so a dead peer cannot
hang it; re-creation is collective over the same group, no process restart).

What the host sees, and when: on CUDA a call returns before its kernel ran, so the call that
times out returns normally and calls enqueued while it was still running return normally too
(their kernels do nothing: their outputs are NOT written). The first call made after the
timed-out kernel finished raises. In a CUDA graph no Python runs at replay: a replay that times
out records the fault the same way, later replays do nothing, and ``ws.failed()`` /
``ws.check()`` / the next eager call report it. A serving loop therefore checks once per step,
after the step's outputs reached the host (the sampled tokens: that copy is the step's sync)::

    graph.replay()                    # or eager calls
    tokens = sampled.tolist()         # the step's own sync
    if ws.failed() is not None:       # ~0.1 us, no sync; non-None: this step's outputs are invalid
        ws.close(); ws = AllReduceWorkspace(...)   # every rank (collective), then redo the step

On CPU (interpreter) kernels finish before the call returns, so the failing call itself raises.

Memory of one rank (one peer-visible byte buffer, every region 256-byte aligned)::

    faults  int32 [32]                                         word q: rank q gave up (offset 0)
    flags   int32 [2 phases, NSLOT CTA slots, P senders]      two-shot barrier flags (zeroed)
    lamport T     [3 generations, L tokens, P-1 peers, H]      one-shot slots (-0.0 sentinels)
    stage   T     [P senders, ceil(max_tokens / P), H]         two-shot reduce-scatter input
    gather  T     [max_tokens, H]                              two-shot all-gather output
    lamport_own T [min(L, OWN_SLOT_TOKENS), H]                 the MoE column-split one-shot's
                                                               local partial rows (-0.0 sentinels)

plus, local to the rank, the int32 control block (``ctrl``: Lamport generation, CTA arrival
counters, two-shot epoch, status word — all advanced by the kernels themselves, so CUDA-graph
replays are correct) and the int64 pointer table (``table``: every rank's buffer address in this
process, as distances from the table in 16-byte units). Later communication ops reuse the same
buffers through
:meth:`offset16` / ``table`` / ``ctrl`` (``regions`` lists the layout).

Backends: CUDA tensors use torch symmetric memory over NVLink P2P with multicast disabled, or,
where that is missing or fails, device buffers shared with CUDA IPC handles (``transport=``
"auto" tries them in that order; "symm_mem" / "cuda_ipc" pick one; the MOEFUSE_COMM_TRANSPORT
variable sets the default); a ``cpu`` device uses shared-memory files between processes (gloo
group) so the same Triton kernels run in the interpreter across real processes. For tests and
benchmarks on ONE device, ``transport="loopback"`` (never chosen by "auto") runs the ranks as
threads of one process (:mod:`moefuse.testing_ranks`): plain per-rank tensors, and on CUDA each
rank gets ``1/P`` of the SMs, so the persistent grids of all ranks fit on the GPU at once.
Groups that span hosts or lack peer access get a workspace without peer buffers (``peer_access``
False): every call then takes the torch.distributed path (all-gather + local rank-order sum),
which gives the same bits.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import uuid

import torch
import torch.distributed as dist

from moefuse import knobs
from moefuse.comm import faults
from moefuse.comm import transport as tp
from moefuse.comm.tiles import MAX_HIDDEN, comm_tile, resident_ctas_per_sm

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: dtypes of the norm weights of every family
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALGORITHMS = ("auto", "oneshot", "twoshot", "torch")

#: Crossovers of ``algorithm="auto"``: the largest payload ``M * H * elem`` (bytes per rank) for
#: which one-shot is chosen, per world size (None: always, up to the Lamport capacity); above it
#: two-shot runs.
#: * P = 2 MEASURED on 2 x H200 (2026-11-29, bench/results/all-reduce-h200-p2.json, commit
#:   2b8b3b71ed35): one-shot beats two-shot at every M and H measured, e.g. H = 4096: 3.4 vs 8.0 us
#:   (M = 1), 18.7 vs 24.7 (M = 512), 390 vs 470 (M = 16384); H = 7168: 668 vs 819 at M = 16384.
#: * P = 4 and 8: NOT YET MEASURED (the 4- and 8-GPU machines were not lent); first guess from
#:   FlashInfer's H200 baselines: one-shot sends 3x the payload against two-shot's
#:   1.5x at P = 4, and FlashInfer's one-shot wins at M = 64 (1/2 MiB, 10.2 vs 16.9 us) but loses
#:   from M = 512 (4 MiB, 49.7 vs 33.3 us).
ONESHOT_MAX_BYTES: dict[int, int | None] = {2: None, 4: 1 << 20, 8: 512 << 10}
#: cap of the default Lamport capacity: 3 generations x (P-1) slots x L tokens x H x elem bytes
LAMPORT_BUDGET_BYTES = 768 << 20
NUM_FLAG_SLOTS = 1024
#: token capacity of the "lamport_own" region (the column-split MoE one-shot kernel, used at
#: decode: moefuse.comm.moe_reduction.kernels.oneshot_variant); 512 KiB per 1K columns of BF16
OWN_SLOT_TOKENS = 256
CTRL_WORDS = 16
CTRL_GEN, CTRL_ARRIVE_1S, CTRL_EPOCH, CTRL_ARRIVE_2S, CTRL_STATUS = range(5)
#: int32 words 8-9 of ctrl: int64 distance from ctrl to the host status block (faults.CTRL_HOST64)
CTRL_HOST_WORDS = (8, 9)
DEFAULT_TIMEOUT_S = 60.0
#: bound of close()'s barrier on a healthy workspace (a failed one uses 2 * timeout_s + 10)
CLOSE_TIMEOUT_S = 600.0
#: "SM count" of the CPU backend: grids stay small so the interpreter also runs CTAs that loop
CPU_SMS = 2

_REGISTRY: dict[int, AllReduceWorkspace] = {}
_IDS = itertools.count(1)


def get_workspace(ws_id: int) -> AllReduceWorkspace:
    """The open workspace with this id (custom ops carry the id, not the object)."""
    try:
        return _REGISTRY[ws_id]
    except KeyError:
        raise RuntimeError(f"moefuse.comm: workspace {ws_id} is closed or unknown") from None


def oneshot_max_bytes(world_size: int) -> int | None:
    for p in sorted(ONESHOT_MAX_BYTES):
        if world_size <= p:
            return ONESHOT_MAX_BYTES[p]
    return ONESHOT_MAX_BYTES[max(ONESHOT_MAX_BYTES)]


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


def _collective_device(group, device: torch.device) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if device.type == "cuda" and "nccl" in backend:
        return device
    return torch.device("cpu")


def _check_knobs(group) -> None:
    """Collective over ``group``: every rank parses its MOEFUSE_* knobs and the ranks compare
    the ones they must set alike (:mod:`moefuse.knobs`). Every rank gets the same gathered
    answers and raises the same error: ValueError naming a knob that does not parse on some
    rank, RuntimeError naming a shared knob and the ranks that set it differently."""
    knobs.warn_unknown()
    try:
        knobs.check_all()
        mine = (None, knobs.shared_settings())
    except ValueError as exc:
        mine = (str(exc), {})
    per_rank = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, mine, group=group)
    bad = [f"rank {r}: {err}" for r, (err, _) in enumerate(per_rank) if err]
    if bad:
        raise ValueError("AllReduceWorkspace: " + "; ".join(bad))
    knobs.check_ranks_agree([s for _, s in per_rank], "AllReduceWorkspace")


class AllReduceWorkspace:
    """Collective workspace of the all-reduce fusions; see the module docstring.

    Args: ``group`` (ProcessGroup, None = WORLD; NCCL for CUDA, gloo for CPU), ``max_tokens`` (M
    capacity), ``hidden_size`` (H), ``dtype`` (activation dtype: BF16/FP16/FP32), ``device`` (this
    rank's CUDA device, or ``cpu``). Keyword-only: ``timeout_s`` (bound of every wait, default 60),
    ``oneshot_max_tokens`` (Lamport capacity L; default: what "auto" can pick for this world
    size, within a 768 MiB budget),
    ``peer_access`` (None = detect; False forces the torch.distributed path),
    ``transport`` (CUDA peer buffers: "auto" = symmetric memory, else CUDA IPC; "symm_mem" or
    "cuda_ipc" forces one; "loopback": ranks are threads of one process, CUDA or CPU, tests and
    benchmarks only; None = the MOEFUSE_COMM_TRANSPORT variable, else "auto"; the same on
    every rank),
    ``extra_regions`` (name -> bytes: more peer-visible regions, zero-filled, appended to the
    layout for other communication ops; ``offset16(name)`` addresses them).
    """

    def __init__(
        self,
        group,
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        device,
        *,
        timeout_s: float | None = None,
        oneshot_max_tokens: int | None = None,
        peer_access: bool | None = None,
        transport: str | None = None,
        extra_regions: dict[str, int] | None = None,
    ):
        group = group if group is not None else dist.group.WORLD
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(
                f"AllReduceWorkspace: max_tokens must be a positive int, got {max_tokens!r}"
            )
        if not isinstance(hidden_size, int) or not 1 <= hidden_size <= MAX_HIDDEN:
            raise ValueError(
                f"AllReduceWorkspace: hidden_size must be an int in [1, {MAX_HIDDEN}]"
                f", got {hidden_size!r}"
            )
        if dtype not in DTYPES:
            raise ValueError(f"AllReduceWorkspace: dtype must be one of {DTYPES}, got {dtype}")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"AllReduceWorkspace: device must be cuda or cpu, got {device}")
        if transport is None:
            transport = knobs.get("MOEFUSE_COMM_TRANSPORT")
        try:
            self._transport_order = tp.cuda_transport_order(transport)
        except ValueError as exc:
            raise ValueError(f"AllReduceWorkspace: {exc}") from None
        # every argument is checked before the first collective (the knobs' exchange)
        self._coll_device = _collective_device(group, device)
        _check_knobs(group)
        #: ranks are threads of one process, possibly sharing one device (tests, benchmarks)
        self.loopback = self._transport_order == (tp.LOOPBACK,)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if not 2 <= self.world_size <= faults.MAX_RANKS:
            raise ValueError(
                f"AllReduceWorkspace: the group must have 2 to {faults.MAX_RANKS} "
                f"ranks, got {self.world_size}"
            )
        self.max_tokens = max_tokens
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.timeout_s = float(DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s)
        if not 0 < self.timeout_s <= 2000:
            raise ValueError("AllReduceWorkspace: timeout_s must be in (0, 2000]")
        self._closed = False
        self._attachments: dict[str, object] = {}
        self._failure: str | None = None
        self._ok = False  # True while open and not failed (one flag for the per-call check)
        self._leaked = None  # transport kept alive when a failed close() could not agree
        # CPU: kernels have finished when the launch returns, so the status read after each
        # call is up to date and the failing call itself raises
        self.check_each_call = device.type == "cpu"

        self._layout(oneshot_max_tokens, extra_regions)

        self.num_sms = self._min_sm_count()
        want_peers = self._detect_peer_access() if peer_access is None else bool(peer_access)
        self.transport = self._make_transport() if self.vote(want_peers) else None
        self.peer_access = self.transport is not None
        # the table holds each rank's buffer as a distance from the table itself, in 16-byte units
        # (kernels index peer memory from the aligned table argument; see comm/device.py)
        p = self.world_size
        self.table = torch.zeros(max(p, 2), dtype=torch.int64, device=device)
        if self.peer_access:
            here = self.table.data_ptr()
            dist16 = [(a - here) // tp.ALIGN for a in self.transport.peer_addrs]
            self.table[:p] = torch.tensor(dist16, dtype=torch.int64)
        self.ctrl = torch.zeros(CTRL_WORDS, dtype=torch.int32, device=device)
        self.ctrl[CTRL_EPOCH] = 1
        self._ctrl_host = self.ctrl.numpy() if device.type == "cpu" else None
        self.host_status = faults.HostStatus(device, self.ctrl)
        self._status_view = self.host_status.view
        self._uid = self._agree_uid()
        self._clock = tp.CpuClock() if device.type == "cpu" else None
        self.clock = self._clock.tensor if self._clock is not None else self.ctrl
        # in-kernel wait bound: timeout_s plus the clock's resolution (the CPU clock word is
        # refreshed by a thread; %globaltimer is fine-grained), so no wait ends before timeout_s
        resolution_us = self._clock.resolution_us if self._clock is not None else 1
        self.timeout_us = int(self.timeout_s * 1e6) + resolution_us
        self.id = next(_IDS)
        _REGISTRY[self.id] = self
        self._ok = True

    def _layout(self, oneshot_max_tokens: int | None, extra_regions: dict[str, int] | None) -> None:
        """Token capacities and the peer buffer's regions (``self.regions``: name -> (offset,
        bytes), each 16-byte aligned; ``self.buffer_bytes``), from the sizes set so far."""
        elem = torch.empty(0, dtype=self.dtype).element_size()
        p, h = self.world_size, self.hidden_size
        if oneshot_max_tokens is None:
            limit = oneshot_max_bytes(p)
            auto_tokens = self.max_tokens if limit is None else -(-limit // (h * elem))
            budget_tokens = LAMPORT_BUDGET_BYTES // (3 * (p - 1) * h * elem)
            oneshot_max_tokens = min(auto_tokens, budget_tokens)
        self.oneshot_max_tokens = int(max(1, min(self.max_tokens, oneshot_max_tokens)))
        self.chunk_cap = (self.max_tokens + p - 1) // p
        self.own_slot_tokens = min(self.oneshot_max_tokens, OWN_SLOT_TOKENS)
        self.num_flag_slots = NUM_FLAG_SLOTS
        sizes = [
            ("faults", faults.FAULTS_REGION_BYTES),  # first: kernels address it at offset 0
            ("flags", 2 * NUM_FLAG_SLOTS * p * 4),
            ("lamport", 3 * self.oneshot_max_tokens * (p - 1) * h * elem),
            ("stage", p * self.chunk_cap * h * elem),
            ("gather", self.max_tokens * h * elem),
            ("lamport_own", self.own_slot_tokens * h * elem),
        ]
        for name, nbytes in (extra_regions or {}).items():
            if any(name == n for n, _ in sizes) or int(nbytes) < 0:
                raise ValueError(f"AllReduceWorkspace: bad extra region {name!r}: {nbytes!r}")
            sizes.append((name, int(nbytes)))
        self.regions: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, nbytes in sizes:
            self.regions[name] = (offset, nbytes)
            offset = _align(offset + nbytes)
        self.buffer_bytes = offset

    def refresh_clock(self) -> None:
        """CPU backend: set the clock word to now before a launch (see ``CpuClock.tick``); the
        GPU reads ``%globaltimer`` and needs nothing."""
        if self._clock is not None:
            self._clock.tick()

    # ------------------------------------------------------------------------- construction
    def _min_sm_count(self) -> int:
        if self.device.type != "cuda":
            return CPU_SMS
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        if self.loopback:
            # the ranks' kernels share the GPU and spin on each other: sized to 1/P of the SMs
            # less one, every rank's persistent grid is resident at once (else the waits run
            # out). MEASURED (H200, notes/comm-moe-reduction.md): at exactly 66 of 132
            # SMs the MoE-finalize one-shot at 2 CTAs per SM (H = 7168) timed out in 2 of 2 runs (M
            # = 4097 then 2049); at 65 or 60 every case passed
            sms = max(1, sms // self.world_size - 1)
        t = torch.tensor([sms], dtype=torch.int32, device=self._coll_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def _detect_peer_access(self) -> bool:
        """Same host for every rank and, on CUDA, P2P access to every peer's device (ranks on the
        same device, as loopback ranks may be, need none)."""
        index = self.device.index if self.device.type == "cuda" else -1
        infos = [None] * self.world_size
        dist.all_gather_object(infos, (socket.gethostname(), index), group=self.group)
        if any(host != infos[0][0] for host, _ in infos):
            return False
        if self.device.type == "cuda":
            for _, peer in infos:
                if peer != index and not torch.cuda.can_device_access_peer(index, peer):
                    return False
        return True

    def _agree_uid(self) -> str:
        """A name for this workspace, the same on every rank (keys of close()'s store barrier)."""
        obj = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(obj, src=self.global_rank(0), group=self.group)
        return obj[0]

    def _init_buffer(self, local: torch.Tensor) -> None:
        """Lamport regions ("lamport", "lamport_own") start as -0.0 sentinels ("empty")."""
        for name in ("lamport", "lamport_own"):
            off, nbytes = self.regions[name]
            view = local[off : off + nbytes]
            if self.dtype == torch.float32:
                view.view(torch.int32).fill_(-(2**31))
            else:
                view.view(torch.int16).fill_(-(2**15))

    def _make_transport(self):
        """Allocate and exchange the peer buffers; None (on every rank) if every transport fails.

        CUDA: the transports of ``transport=`` in order (symmetric memory, then CUDA IPC); every
        attempt is collective and ends the same way on every rank (each transport votes on its
        allocation and mapping), so the ranks always agree on the transport or on none."""
        from moefuse._runtime import log_once

        kinds = self._transport_order if self.device.type == "cuda" or self.loopback else ("shm",)
        for i, kind in enumerate(kinds):
            try:
                return tp.make_transport(
                    kind, self.group, self.buffer_bytes, self.device, self._init_buffer, self.vote
                )
            except Exception as exc:  # surfaced once; the next transport, or the torch path
                then = (
                    f"trying {kinds[i + 1]}"
                    if i + 1 < len(kinds)
                    else "using the torch.distributed path"
                )
                log_once(
                    f"AllReduceWorkspace:{kind}", f"{kind} peer buffers unavailable ({exc}); {then}"
                )
        return None

    # ------------------------------------------------------------------------- queries
    def offset16(self, region: str) -> int:
        """Byte offset of ``region`` inside every rank's buffer, in 16-byte units."""
        return self.regions[region][0] // tp.ALIGN

    def max_ctas(self, num_warps: int) -> int:
        return self.num_sms * resident_ctas_per_sm(num_warps)

    def unsupported_reason(self, x: torch.Tensor) -> str | None:
        """Why the Triton kernels cannot run ``x`` ([M, H]) on this workspace (None if they can)."""
        from moefuse._runtime import kernel_device_reason

        if self._closed:
            return "the workspace is closed"
        # (the host status block itself is read inside the op, by raise_if_failed: this runs
        # where torch.compile traces, which cannot subscript a memoryview)
        if self._failure is not None:
            return f"the workspace failed: {self._failure}"
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            return "input must be a 2-D [M, H] tensor"
        if x.shape[1] != self.hidden_size:
            return f"hidden size {x.shape[1]} != workspace hidden_size {self.hidden_size}"
        if x.shape[0] > self.max_tokens:
            return f"{x.shape[0]} tokens > workspace max_tokens {self.max_tokens}"
        if x.dtype != self.dtype:
            return f"dtype {x.dtype} != workspace dtype {self.dtype}"
        if x.device != self.device:
            return f"device {x.device} != workspace device {self.device}"
        if x.shape[1] > 1 and x.stride(1) != 1:
            return "the last dimension must be contiguous"
        return kernel_device_reason(self.device)

    def supports(self, x: torch.Tensor) -> bool:
        """Local answer: can the fused Triton path run ``x`` here? Combine with :meth:`vote`."""
        return self.unsupported_reason(x) is None

    def choose_algorithm(self, num_tokens: int, algorithm: str = "auto") -> str:
        """Resolve ``algorithm`` for M tokens: "oneshot" | "twoshot" | "torch".

        "auto" picks by payload bytes (:data:`ONESHOT_MAX_BYTES`); an explicit peer algorithm that
        cannot run raises (it never falls back silently). Same answer on every rank for the same M.
        """
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"moefuse.comm: algorithm must be one of {ALGORITHMS}, got {algorithm!r}"
            )
        if algorithm == "torch":
            return "torch"
        if not self.peer_access:
            if algorithm == "auto":
                return "torch"
            raise RuntimeError(
                f"moefuse.comm: algorithm={algorithm!r} needs peer buffers, which "
                "this workspace does not have (peer_access is False)"
            )
        fits_oneshot = num_tokens <= self.oneshot_max_tokens
        if algorithm == "oneshot" and not fits_oneshot:
            raise RuntimeError(
                f"moefuse.comm: one-shot holds at most {self.oneshot_max_tokens} "
                f"tokens, got {num_tokens}"
            )
        if algorithm != "auto":
            return algorithm
        elem = torch.empty(0, dtype=self.dtype).element_size()
        payload = num_tokens * self.hidden_size * elem
        limit = oneshot_max_bytes(self.world_size)
        if fits_oneshot and (limit is None or payload <= limit):
            return "oneshot"
        return "twoshot"

    def tile(self, pattern: int = 1):
        return comm_tile(self.hidden_size, pattern)

    # ------------------------------------------------------------------------- collectives
    def vote(self, local_ok: bool) -> bool:
        """Collective MIN of ``local_ok`` over the group (call outside graph capture): every rank
        gets True only if every rank said True, so all ranks take the same path."""
        t = torch.tensor([1 if local_ok else 0], dtype=torch.int32, device=self._coll_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def global_rank(self, group_rank: int) -> int:
        try:
            return dist.get_global_rank(self.group, group_rank)
        except Exception:
            return group_rank

    def fastpath_ready(self) -> bool:
        """May a recorded launch plan (:mod:`moefuse._fastpath`) replay a call on this workspace?
        Only while it is open and healthy (the same host status load as :meth:`raise_if_failed`,
        which replays skip), and never on the CPU backend, whose calls do host work after the
        launch (the status poll and the interpreter clock)."""
        return self._ok and self._status_view[0] == 0

    @property
    def fastpath_host_work(self) -> bool:
        """True on the CPU backend: every call refreshes the clock word before its launches and
        polls the status word after them (:meth:`fastpath_before` / :meth:`fastpath_after`, done
        without torch ops, so a recorded plan repeats them)."""
        return self.check_each_call

    def fastpath_before(self) -> None:
        self.refresh_clock()

    def fastpath_after(self) -> None:
        self.poll_status()

    def fastpath_tensors(self) -> list[torch.Tensor]:
        """Tensors of this workspace that kernels get and that live as long as it does: its own
        and those of the state that communication families keep on it (:meth:`attachment`)."""
        own = [t for t in vars(self).values() if isinstance(t, torch.Tensor)]
        return own + [t for state in self._attachments.values() for t in state.tensors()]

    def attachment(self, name: str, create):
        """The state a communication family keeps on this workspace under ``name`` (created by
        ``create(self)`` on first use; it lives and dies with the workspace). Its ``tensors()``
        join :meth:`fastpath_tensors`: their addresses are fixed once created."""
        state = self._attachments.get(name)
        if state is None:
            state = self._attachments[name] = create(self)
        return state

    # ------------------------------------------------------------------------- faults
    def raise_if_failed(self) -> None:
        """The check every communication op makes before it launches (or falls back): raises
        ``RuntimeError`` if the workspace is closed or has failed, naming the rank(s) and the
        group. No device sync: one plain load from the host status block (pinned host memory
        written by the kernels' timeout path, see :mod:`moefuse.comm.faults`). New ops call this
        first, so fault handling needs nothing of them beyond their kernels' bounded waits."""
        if self._ok and self._status_view[0] == 0:
            return
        if self._closed:
            raise RuntimeError("moefuse.comm: the workspace is closed")
        raise RuntimeError(f"moefuse.comm: {self.failed()}")

    #: the name used by callers written before raise_if_failed existed
    raise_if_unusable = raise_if_failed

    def poll_status(self) -> None:
        """:meth:`raise_if_failed`, after also reading the device status word (a sync on CUDA;
        free on CPU, where ops call it after every launch). That word is set by every timed-out
        wait, including kernels that record their timeouts only there (not through
        ``moefuse.comm.device.give_up``), so :meth:`check` sees those as well."""
        if self._failure is None and self.peer_access and not self._closed:
            status = self._device_status()
            if status and self._status_view[0] == 0:
                self._fail([0] * self.world_size, status)
        self.raise_if_failed()

    def _device_status(self) -> int:
        """The device status word: a plain load of the CPU tensor's memory (no torch op, so a
        launch plan's recorder sees a pure call), a synchronizing read on CUDA."""
        if self.device.type == "cpu":
            return int(self._ctrl_host[CTRL_STATUS])
        return int(self.ctrl[CTRL_STATUS].item())

    def failed(self) -> str | None:
        """The failure message, or None while healthy. No device sync: call it once per serving
        step (after the step's outputs were synchronized to the host, e.g. the sampled tokens)
        to learn whether that step's communication was valid. A failure is permanent: close()
        and re-create the workspace."""
        if self._failure is None and self._status_view[0] != 0:
            self._fail(self.host_status.codes(self.world_size), self._status_view[0])
        return self._failure

    def _group_name(self) -> str:
        return str(getattr(self.group, "group_name", "") or "WORLD")

    def check(self) -> None:
        """Synchronize this rank's device, then :meth:`raise_if_failed`: after the sync every
        fault of the calls issued so far is in the host status block. A peer's "gave up" notice
        is read here too, so a rank that made no call since a peer gave up learns of it. After a
        failure every later call raises until the workspace is closed and re-created
        (collectively)."""
        if self._closed:
            raise RuntimeError("moefuse.comm: the workspace is closed")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        notices = self._peer_notices()
        if notices and self._failure is None and self._status_view[0] == 0:
            # a peer gave up while this rank made no call: its notice is only in this rank's
            # buffer (no kernel of this rank has read it yet); it names the ranks it waited for
            words = self._notice_words()
            waited = 0
            for w in words:
                waited |= (w >> 1) if w else 0
            codes = [
                faults.GAVE_UP
                if notices >> r & 1
                else faults.MISSING
                if (waited >> r & 1) and r != self.rank
                else 0
                for r in range(self.world_size)
            ]
            self._fail(codes, notices)
        self.poll_status()

    def _fail(self, codes: list[int], summary: int) -> None:
        """Mark the workspace failed with :func:`faults.describe` of per-rank ``codes``."""
        self._failure = faults.describe(
            codes,
            summary,
            rank=self.rank,
            group=self._group_name(),
            timeout_s=self.timeout_s,
            global_rank=self.global_rank,
        )
        self._ok = False

    def _peer_notices(self) -> int:
        """Bit set of the peers whose "gave up" notice is in this rank's buffer (the faults
        region, :mod:`moefuse.comm.faults`); a device read on CUDA, so only :meth:`check`
        calls it."""
        if self.transport is None or getattr(self.transport, "local", None) is None:
            return 0
        return sum(1 << r for r, w in enumerate(self._notice_words()) if w)

    def _notice_words(self) -> list[int]:
        """The peers' notice words (bit 0: gave up; bits 1..: the ranks it waited for)."""
        words = self.transport.local[: faults.FAULTS_REGION_BYTES].view(torch.int32)
        return words[: self.world_size].tolist()

    @contextlib.contextmanager
    def capture(self):
        """Bracket CUDA-graph capture of calls on this workspace: health is checked (with a sync)
        before capture starts. Warm up every shape outside capture first (Triton compiles)."""
        self.check()
        yield self

    def close(self, timeout_s: float | None = None) -> None:
        """Collective: device sync, barrier, release the peer buffers. Idempotent.

        The barrier goes through the group's store, bounded by ``timeout_s``, not through a
        collective, so a dead peer cannot hang it (and every rank takes the same path, whether
        its copy of the workspace failed or not). Default bound: ``2 * self.timeout_s + 10``
        seconds on a failed workspace (a late peer first runs into its own timeout), 600 s
        otherwise. If not every rank arrives in time, the peer buffers are kept (not freed: a
        live peer could still write into them), a warning is logged and close() returns."""
        if self._closed:
            return
        failed = self.failed() is not None
        self._closed = True
        from moefuse import _fastpath

        _fastpath.forget(self)  # its launch plans hold it (their key) and its tensors
        self._ok = False
        _REGISTRY.pop(getattr(self, "id", -1), None)
        if self.device.type == "cuda":  # every wait is bounded: this ends within timeout_s
            torch.cuda.synchronize(self.device)
        if timeout_s is None:
            timeout_s = 2 * self.timeout_s + 10 if failed else CLOSE_TIMEOUT_S
        barrier = self._bounded_barrier(float(timeout_s))
        try:
            if self.transport is not None:
                self.transport.close(barrier)
            else:
                barrier()
        except TimeoutError as exc:
            import logging

            self._leaked = self.transport
            logging.getLogger("moefuse").warning(
                "moefuse.AllReduceWorkspace.close(): %s; the peer buffers are kept (not freed) "
                "because a peer may still write into them",
                exc,
            )
        self.transport = None
        if self._clock is not None:
            self._clock.stop()

    def _bounded_barrier(self, timeout_s: float):
        import torch.distributed.distributed_c10d as c10d

        store = c10d._get_process_group_store(self.group)
        steps = itertools.count()

        def barrier() -> None:
            key = f"moefuse/comm/{self._uid}/close/{next(steps)}"
            arrived = faults.bounded_barrier(store, key, self.world_size, timeout_s)
            if arrived < self.world_size:
                raise TimeoutError(
                    f"only {arrived} of {self.world_size} ranks of group "
                    f"{self._group_name()!r} reached close() within "
                    f"{timeout_s:g} s"
                )

        return barrier

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        kind = self.transport.kind if self.transport is not None else "torch.distributed only"
        return (
            f"AllReduceWorkspace(rank={self.rank}/{self.world_size}, max_tokens="
            f"{self.max_tokens}, hidden_size={self.hidden_size}, dtype={self.dtype}, "
            f"device={self.device}, backend={kind}, closed={self._closed})"
        )
