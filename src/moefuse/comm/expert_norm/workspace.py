"""The workspace of the tensor-parallel expert-norm op, its registry and its choice of
algorithm per token count: :class:`ExpertNormWorkspace` (an :class:`AllReduceWorkspace` with the
family's peer regions) and :func:`get_expert_norm_workspace` (the op layer finds a workspace by
its integer id: custom-op schemas cannot carry Python objects)."""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist

from moefuse._runtime import kernel_device_reason
from moefuse.comm.expert_norm.reference import group_size
from moefuse.comm.tiles import MAX_HIDDEN
from moefuse.comm.workspace import AllReduceWorkspace

TP_ALGORITHMS = ("auto", "slot_oneshot", "expert_owner", "token_owner", "staged", "torch")
#: ``algorithm="auto"`` of tp_moe_finalize_rmsnorm: expert owner (K/P slots normalized per rank,
#: group sums in FP32) up to this many tokens, the Lamport token owner above. MEASURED at P = 2 on 2
#: x H200 (bench/results/expert-norm-h200-p2.json, H = 4096, K = 8, us): M = 1 expert_owner 11.98,
#: token_owner 17.21, staged 19.41; M = 64 18.82 / 22.60 / 27.06; M = 2048 450.7 / 388.0 /
#: 528.2 (a one-CTA-per-(token, slot) expert owner, deleted, lost to expert_owner at every M
#: measured: M = 1 12.94, M = 64 68.28). P = 4 and 8: first guesses (FlashInfer switches at 64/P).
EXPERT_OWNER_MAX_TOKENS = {2: 64, 4: 16, 8: 8}
#: ``algorithm="auto"`` takes "slot_oneshot" (one CTA per (token, slot) row, one NVLink hop, the
#: token folded locally) while M * K <= this many rows, by world size (P = 2: M <= 16 at K = 8,
#: one row per CTA on a 132-SM H200; larger P: every rank sends (P-1) copies of each row, so the
#: cap keeps ~1 MiB out per rank). MEASURED at P = 2 (bench/results/expert-norm-h200-p2.json,
#: H = 4096, K = 8, us slot_oneshot / expert_owner): M = 1 7.96 / 12.42, M = 8 9.39 / 12.82,
#: M = 64 35.28 / 19.17 — the expert owner's single CTA per token runs the K slots' dependent
#: loads, polls and norms one by one, which costs at decode only. P = 4 and 8: first guesses.
SLOT_ONESHOT_MAX_ROWS = {2: 128, 4: 32, 8: 16}
#: ... and the Lamport token owner up to this many tokens (chunked to the workspace capacity), the
#: staged (push + flags) token owner above: staged was the slowest peer algorithm at every M
#: measured (above), so it is only chosen past the largest M of the benchmark.
TOKEN_OWNER_LAMPORT_MAX_TOKENS = 16384
#: cap of the Lamport slots of one ExpertNormWorkspace (larger M runs in chunks of the capacity)
TP_LAMPORT_BUDGET_BYTES = 256 << 20
TP_DEFAULT_CAPACITY = 1024
#: tokens per launch of "slot_oneshot" (its local ``xn_xdec`` / ``xn_rdec`` / ``xn_cnt`` rows)
TP_SLOT_CAPACITY = 64

_XREGISTRY: dict[int, ExpertNormWorkspace] = {}
_XIDS = itertools.count(1)


def get_expert_norm_workspace(ws_id: int) -> ExpertNormWorkspace:
    try:
        return _XREGISTRY[ws_id]
    except KeyError:
        raise RuntimeError(
            f"moefuse.comm: expert-norm workspace {ws_id} is closed or unknown"
        ) from None


def _by_world_size(table: dict[int, int], world_size: int) -> int:
    """The entry of the smallest tabulated P >= ``world_size`` (the largest P's past the table)."""
    for p in sorted(table):
        if world_size <= p:
            return table[p]
    return table[max(table)]


def expert_owner_max_tokens(world_size: int) -> int:
    return _by_world_size(EXPERT_OWNER_MAX_TOKENS, world_size)


def slot_oneshot_max_rows(world_size: int) -> int:
    return _by_world_size(SLOT_ONESHOT_MAX_ROWS, world_size)


# ----------------------------------------------------------------------------- workspace
class ExpertNormWorkspace:
    """Collective workspace of :func:`tp_moe_finalize_rmsnorm` for one (H, K).

    ``ar`` is an :class:`AllReduceWorkspace` (BF16, H) whose ``extra_regions`` hold, per rank:
    ``xn_rows`` BF16 ``[3, L, K, P-1, H]`` (partial rows received for slots this rank reduces),
    ``xn_gsum`` FP32 ``[3, L, NG, H]`` (expert-owner group sums, ``NG = ceil(K / B)``) and
    ``xn_out`` BF16 ``[3, L, H]`` (token-owner output rows), all armed with -0.0
    sentinels, "slot_oneshot"'s local BF16 ``xn_xdec [Ls, K, H]`` (rank-summed rows,
    Ls = ``slot_capacity``), FP32
    ``xn_rdec [Ls, K]`` (their reciprocal RMS) and int32 ``xn_cnt [Ls]`` (per-token arrival words,
    zero between calls), and
    the staged algorithm's single-buffered ``xn_stage`` BF16 ``[L, K, P-1, H]`` and
    ``xn_gather`` BF16 ``[L, H]`` (with the base workspace's flags and epoch);
    ``L = capacity`` tokens per launch (more tokens run as several launches). Lifecycle as
    ``AllReduceWorkspace``: ``vote``, ``capture()``, ``check()``, ``close()`` (required)."""

    def __init__(
        self,
        group,
        hidden_size: int,
        top_k: int,
        device,
        *,
        max_tokens: int | None = None,
        timeout_s: float | None = None,
        peer_access: bool | None = None,
        transport: str | None = None,
    ):
        group = group if group is not None else dist.group.WORLD
        if not isinstance(hidden_size, int) or not 1 <= hidden_size <= MAX_HIDDEN:
            raise ValueError(
                f"ExpertNormWorkspace: hidden_size must be an int in [1, "
                f"{MAX_HIDDEN}], got {hidden_size!r}"
            )
        if not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"ExpertNormWorkspace: top_k must be a positive int, got {top_k!r}")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(
                f"ExpertNormWorkspace: max_tokens must be a positive int, got {max_tokens!r}"
            )
        p = dist.get_world_size(group)
        h, k = hidden_size, top_k
        self.world_size = p
        self.hidden_size = h
        self.top_k = k
        self.group_size = group_size(k, p)
        self.num_groups = -(-k // self.group_size)
        slots = k * max(1, p - 1) * h * 2
        per_token = 3 * (slots + self.num_groups * h * 4 + h * 2) + slots + h * 2
        cap = max_tokens or max(1, min(TP_DEFAULT_CAPACITY, TP_LAMPORT_BUDGET_BYTES // per_token))
        self.capacity = cap
        self.slot_capacity = min(cap, TP_SLOT_CAPACITY)
        regions = {
            "xn_rows": 3 * cap * k * max(1, p - 1) * h * 2,
            "xn_gsum": 3 * cap * self.num_groups * h * 4,
            "xn_out": 3 * cap * h * 2,
            "xn_stage": cap * k * max(1, p - 1) * h * 2,
            "xn_gather": cap * h * 2,
            "xn_xdec": self.slot_capacity * k * h * 2,
            "xn_rdec": self.slot_capacity * k * 4,
            "xn_cnt": self.slot_capacity * 4,
        }
        self.ar = AllReduceWorkspace(
            group,
            cap,
            h,
            torch.bfloat16,
            device,
            timeout_s=timeout_s,
            oneshot_max_tokens=cap,
            peer_access=peer_access,
            transport=transport,
            extra_regions=regions,
        )
        if self.ar.peer_access:
            self._arm(regions)
        self.id = next(_XIDS)
        _XREGISTRY[self.id] = self

    def _arm(self, regions) -> None:
        """-0.0 sentinels in the new regions, then a group-wide collective so no peer can push
        into a region before its owner armed it (the collective is stream-ordered after the
        fill on NCCL, and synchronous on gloo)."""
        local = self.ar.transport.local
        for name in ("xn_rows", "xn_gsum", "xn_out"):  # staging needs no sentinel
            off, nbytes = self.ar.regions[name]
            view = local[off : off + nbytes]
            if name == "xn_gsum":
                view.view(torch.int32).fill_(-(2**31))
            else:
                view.view(torch.int16).fill_(-(2**15))
        if self.ar.device.type == "cuda":
            torch.cuda.synchronize(self.ar.device)
        self.ar.vote(True)

    # ------------------------------------------------------------------------- queries
    @property
    def device(self) -> torch.device:
        return self.ar.device

    @property
    def rank(self) -> int:
        return self.ar.rank

    @property
    def peer_access(self) -> bool:
        return self.ar.peer_access

    # launch plans (moefuse._fastpath): the base workspace's health, tensors and host work
    def fastpath_ready(self) -> bool:
        return self.ar.fastpath_ready()

    def fastpath_tensors(self) -> list[torch.Tensor]:
        return self.ar.fastpath_tensors()

    @property
    def fastpath_host_work(self) -> bool:
        return self.ar.fastpath_host_work

    def fastpath_before(self) -> None:
        self.ar.fastpath_before()

    def fastpath_after(self) -> None:
        self.ar.fastpath_after()

    def unsupported_reason(self) -> str | None:
        """Why the Triton kernels cannot run on this workspace (None if they can)."""
        if self.ar.closed:
            return "the workspace is closed"
        if self.ar._failure is not None:
            return f"the workspace failed: {self.ar._failure}"
        return kernel_device_reason(self.ar.device)

    def choose_algorithm(self, num_tokens: int, algorithm: str = "auto") -> str:
        """An algorithm of :data:`TP_ALGORITHMS` other than "auto" for M tokens (same answer on
        every rank). An explicit peer algorithm on a workspace without peer buffers raises."""
        if algorithm not in TP_ALGORITHMS:
            raise ValueError(
                f"moefuse.tp_moe_finalize_rmsnorm: algorithm must be one of "
                f"{TP_ALGORITHMS}, got {algorithm!r}"
            )
        if algorithm == "torch":
            return "torch"
        if not self.ar.peer_access:
            if algorithm == "auto":
                return "torch"
            raise RuntimeError(
                f"moefuse.tp_moe_finalize_rmsnorm: algorithm={algorithm!r} needs "
                "peer buffers, which this workspace does not have"
            )
        if algorithm == "slot_oneshot" and self.top_k >= 1 << 16:  # 16-bit arrival counts
            raise ValueError(
                f"moefuse.tp_moe_finalize_rmsnorm: algorithm='slot_oneshot' needs "
                f"top_k < 65536, got {self.top_k}"
            )
        if algorithm != "auto":
            return algorithm
        if num_tokens * self.top_k <= slot_oneshot_max_rows(self.world_size):
            return "slot_oneshot"
        if num_tokens <= expert_owner_max_tokens(self.world_size):
            return "expert_owner"
        if num_tokens <= TOKEN_OWNER_LAMPORT_MAX_TOKENS:
            return "token_owner"
        return "staged"

    # ------------------------------------------------------------------------- lifecycle
    def vote(self, local_ok: bool) -> bool:
        return self.ar.vote(local_ok)

    def check(self) -> None:
        self.ar.check()

    def failed(self) -> str | None:
        """The failure message of the underlying workspace, or None (no sync; see
        :meth:`moefuse.comm.workspace.AllReduceWorkspace.failed`)."""
        return self.ar.failed()

    def raise_if_failed(self) -> None:
        self.ar.raise_if_failed()

    @contextlib.contextmanager
    def capture(self):
        self.ar.check()
        yield self

    def close(self) -> None:
        from moefuse import _fastpath

        _XREGISTRY.pop(getattr(self, "id", -1), None)
        _fastpath.forget(self)  # its launch plans hold it (their key) and the base's tensors
        self.ar.close()

    @property
    def closed(self) -> bool:
        return self.ar.closed

    def __repr__(self) -> str:
        return (
            f"ExpertNormWorkspace(H={self.hidden_size}, K={self.top_k}, "
            f"capacity={self.capacity}, {self.ar!r})"
        )
