"""Triton device functions that every communication family uses (public: the all-reduce,
MoE-reduction, expert-norm and all-gather kernels call them): peer addressing, peer loads and
stores, control words, epochs and generations, bounded waits and the fault record, the kernel
prologue and tail of the one-shot algorithms (:func:`oneshot_state`, :func:`oneshot_finish`,
:func:`finish`), the Lamport push and rank-order receive (:func:`push_vals`,
:func:`receive_sum`), and the per-row epilogue (residual add, RMSNorm, quantization) that every
all-reduce algorithm shares.

Sharing one epilogue is what makes the algorithms agree bit for bit: each of them produces the
same T-rounded sum ``s`` of a row (FP32 rank-order sum from +0.0, one rounding) and hands it to
:func:`epilogue_row`. The row statistic is summed in FP64 from exact squares (every BF16/FP16/FP32
square is exact in FP64) and rounded once to FP32: a different ``tl.sum`` tree — another kernel,
another register layout — could only change the FP32 result if the FP64 sums differed across an
FP32 rounding boundary, which needs a relative FP64 difference of ~2^-53 to hit a 2^-24 window
(probability ~2^-29 per row); within one kernel the tree is fixed by the width anyway.

Conventions: ``PTX`` (constexpr) is False in Triton's interpreter, which cannot run inline PTX or
PDL intrinsics; the off-path computes the same thing (the clock comes from a host-refreshed word,
see :class:`moefuse.comm.transport.CpuClock`). Peer buffers are addressed relative to the pointer
table argument (distances in 16-byte units) so that Triton can prove the alignment of every peer
row and vectorize it.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, globaltimer

from moefuse._device import rcp_fast, round_to, rsqrt_fast
from moefuse.quant import device as QD

# Control-block words (int32, local to a rank; see moefuse.comm.workspace for their lifecycle).
CTRL_GEN: tl.constexpr = tl.constexpr(0)  # Lamport generation 0, 1, 2, 0, ...
CTRL_ARRIVE_1S: tl.constexpr = tl.constexpr(1)  # one-shot CTA arrival counter
CTRL_EPOCH: tl.constexpr = tl.constexpr(2)  # two-shot barrier epoch 1..2^30
CTRL_ARRIVE_2S: tl.constexpr = tl.constexpr(3)  # two-shot CTA arrival counter
CTRL_STATUS: tl.constexpr = tl.constexpr(4)  # bit r set: a fault involving rank r was recorded
# int64 word 4 of ctrl (int32 words 8-9): distance, in int32 units, from ctrl to the host status
# block (pinned host memory on CUDA; see moefuse.comm.faults)
CTRL_HOST64: tl.constexpr = tl.constexpr(4)
EPOCH_WRAP: tl.constexpr = tl.constexpr(1 << 30)
# Fault codes of the host status block, one word per rank (after the summary word 0)
FAULT_MISSING: tl.constexpr = tl.constexpr(1)  # this rank waited for rank r until the deadline
FAULT_GAVE_UP: tl.constexpr = tl.constexpr(2)  # rank r's wait timed out: it abandoned the workspace
# Every rank's buffer starts with the peer-visible "faults" region: int32 [MAX_RANKS], word q set
# by rank q when a wait of q timed out (q then never takes part in the protocol again)
FAULTS_OFF16: tl.constexpr = tl.constexpr(0)
MAX_RANKS: tl.constexpr = tl.constexpr(32)  # lanes of the fault vectors (world size <= 31)


@triton.jit
def now_ns(clock_ptr, PTX: tl.constexpr):
    """Nanosecond clock: ``%globaltimer`` on the GPU, the host-refreshed word in the interpreter."""
    if PTX:
        return globaltimer()
    else:
        return tl.load(clock_ptr, volatile=True)


@triton.jit
def sentinel(BITS: tl.constexpr):
    """The Lamport "empty" pattern: negative zero of the payload type, as a signed integer."""
    if BITS == 16:
        return -32768
    else:
        return -2147483648


@triton.jit
def empty_row(BLOCK: tl.constexpr, BITS: tl.constexpr):
    """A row of sentinels, to re-arm a consumed Lamport slot."""
    if BITS == 16:
        return tl.full([BLOCK], -32768, tl.int16)
    else:
        return tl.full([BLOCK], -2147483648, tl.int32)


@triton.jit
def as_bits(x, BITS: tl.constexpr):
    if BITS == 16:
        return x.to(tl.int16, bitcast=True)
    else:
        return x.to(tl.int32, bitcast=True)


@triton.jit
def table_dists(table_ptr, P: tl.constexpr):
    """Every rank's table entry (a tuple of P scalars), for :func:`peer_base` ``dists=``. The
    table never changes during a workspace's life, so a decode kernel reads it before its
    grid-dependency wait: the push and the state words then wait for no table round trip (each
    was an L2 round trip on the critical path, issued after a CTA barrier)."""
    dists = ()
    for q in tl.static_range(P):
        dists = dists + (tl.load(table_ptr + q),)
    return dists


@triton.jit
def pick(dists, q):
    """Entry ``q`` (a run-time or compile-time rank) of :func:`table_dists`' tuple."""
    d = dists[0]
    for j in tl.static_range(1, len(dists)):
        d = tl.where(q == j, dists[j], d)
    return d


@triton.jit
def peer_base(table_ptr, q, off16, BITS: tl.constexpr, dists=None):
    """Integer-typed pointer to region ``off16`` (16-byte units) of rank ``q``'s buffer; the
    table entry from ``dists`` (:func:`table_dists`) when given, else loaded here.

    Table entries are distances from the table itself in 16-byte units: pointer arithmetic on the
    (aligned) table argument keeps Triton's alignment analysis, so peer rows are moved with 16-byte
    vector loads and stores; an integer cast to a pointer would lose it (scalar 2-byte accesses).
    """
    if dists is None:
        d = tl.load(table_ptr + q) + off16
    else:
        d = pick(dists, q) + off16
    if BITS == 16:
        return table_ptr.to(tl.pointer_type(tl.int16)) + d * 8
    else:
        return table_ptr.to(tl.pointer_type(tl.int32)) + d * 4


@triton.jit
def flag_ptrs(table_ptr, ranks, rmask, flags_off16, index):
    """Pointers to int32 flag ``index`` of every rank in ``ranks`` (masked lanes: rank 0)."""
    d = tl.load(table_ptr + ranks, mask=rmask, other=0) + flags_off16
    return table_ptr.to(tl.pointer_type(tl.int32)) + d * 4 + index


@triton.jit
def signal_peers(table_ptr, flags_off16, slot, rank, value, P: tl.constexpr, PP: tl.constexpr):
    """Release-store ``value`` into flag ``[slot, rank]`` of every other rank (system scope).

    The CTA barrier first makes every thread's earlier stores part of what the release publishes.
    """
    tl.debug_barrier()
    ranks = tl.arange(0, PP)
    rmask = (ranks < P) & (ranks != rank)
    ptrs = flag_ptrs(table_ptr, ranks, rmask, flags_off16, slot * P + rank)
    tl.atomic_xchg(ptrs, tl.zeros([PP], tl.int32) + value, mask=rmask, sem="release", scope="sys")


@triton.jit
def wait_peers(
    table_ptr,
    flags_off16,
    slot,
    rank,
    value,
    deadline,
    clock_ptr,
    P: tl.constexpr,
    PP: tl.constexpr,
    PTX: tl.constexpr,
):
    """Wait (acquire, system scope) until this rank's flags ``[slot, q]`` equal ``value`` for
    every other rank q, or until the wait ends (:func:`ended`: ``deadline`` is the launch's
    :func:`wait_bound`). Returns the bit mask of ranks still missing (0 on
    success). Polls with atomics so the successful read is itself the acquire; the CTA barrier
    after it orders every thread's later loads behind that acquire."""
    ranks = tl.arange(0, PP)
    rmask = (ranks < P) & (ranks != rank)
    mine = flag_ptrs(table_ptr, rank + ranks * 0, rmask, flags_off16, slot * P + ranks)
    seen = tl.atomic_add(mine, tl.zeros([PP], tl.int32), mask=rmask, sem="acquire", scope="sys")
    missing = tl.sum(tl.where(rmask & (seen != value), 1 << ranks, 0), axis=0)
    expired = missing * 0
    while (missing != 0) & (expired == 0):
        seen = tl.atomic_add(mine, tl.zeros([PP], tl.int32), mask=rmask, sem="acquire", scope="sys")
        missing = tl.sum(tl.where(rmask & (seen != value), 1 << ranks, 0), axis=0)
        expired = ended(deadline, clock_ptr, PTX)
    tl.debug_barrier()
    return missing


@triton.jit
def poll_row(ptr, cmask, deadline, clock_ptr, BITS: tl.constexpr, PTX: tl.constexpr):
    """Lamport receive: volatile-load the row until no element is the sentinel (or the wait
    ends, :func:`ended`; ``deadline`` is the launch's :func:`wait_bound`). Returns ``(bits,
    pending)``; ``pending != 0`` means the wait ended without the row (timed out, or a peer gave
    up: :func:`leave` tells which)."""
    SENT = sentinel(BITS)
    v = tl.load(ptr, mask=cmask, other=0, volatile=True)
    pending = tl.max((v == SENT).to(tl.int32), axis=0)
    expired = pending * 0
    while (pending != 0) & (expired == 0):
        v = tl.load(ptr, mask=cmask, other=0, volatile=True)
        pending = tl.max((v == SENT).to(tl.int32), axis=0)
        expired = ended(deadline, clock_ptr, PTX)
    return v, pending


@triton.jit
def scrub(bits, BITS: tl.constexpr):
    """-0.0 -> +0.0 in the payload (numerically the same; a -0.0 would look like "not arrived")."""
    return tl.where(bits == sentinel(BITS), tl.zeros_like(bits), bits)


@triton.jit
def accumulate(acc, v, T: tl.constexpr, FP32_ACC: tl.constexpr, PTX: tl.constexpr):
    """One step of the rank-order sum: FP32 running sum, or T-rounded after every add."""
    if FP32_ACC:
        return acc + v
    else:
        return round_to(acc + v, T, PTX).to(tl.float32)


@triton.jit
def epilogue_row(
    s,
    res,
    g,
    t,
    cols,
    cmask,
    H,
    Hf,
    eps,
    inv_scale,
    gs,
    rcp_gs,
    n_kcols,
    out_ptr,
    out_st,
    rout_ptr,
    rout_st,
    nout_ptr,
    nout_st,
    q_ptr,
    q_st,
    sf_ptr,
    T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PATTERN: tl.constexpr,
    WRITE_NORM: tl.constexpr,
    LAYOUT: tl.constexpr,
    PTX: tl.constexpr,
    RECIPE: tl.constexpr = 1,
):
    """Everything after the all-reduce for token row ``t`` (the spec's all-reduce fusion).

    ``s``: FP32 values of the T-rounded sum (masked lanes 0); ``res``: the residual row widened to
    FP32; ``g = f32(weight) + weight_bias``. PATTERN 0 writes ``s``; otherwise
    ``h = T(s + res)`` -> residual_out, ``n = T((h * r) * g)`` with ``r`` the inverse RMS of the
    ROUNDED h -> norm_out (when WRITE_NORM), and PATTERN 2 (FP8) / 3 (NVFP4) quantize ``n``.
    ``RECIPE``: NVFP4 output-scale recipe (1 "ieee", the spec's all-reduce fusion; the MoE-reduction
    and MoE-finalize fusions pass 0 "fast").
    """
    t64 = t.to(tl.int64)
    if PATTERN == 0:
        tl.store(out_ptr + t64 * out_st + cols, round_to(s, T, PTX), mask=cmask)
    else:
        h = round_to(s + res, T, PTX)
        tl.store(rout_ptr + t64 * rout_st + cols, h, mask=cmask)
        hf = tl.where(cmask, h.to(tl.float32), 0.0)
        hd = hf.to(tl.float64)
        sumsq = tl.sum(hd * hd, axis=0).to(tl.float32)
        r = rsqrt_fast(tl.math.div_rn(sumsq, Hf) + eps)
        n = round_to((hf * r) * g, T, PTX)
        if WRITE_NORM:
            tl.store(nout_ptr + t64 * nout_st + cols, n, mask=cmask)
        if PATTERN == 2:
            q = QD.fp8_encode(n.to(tl.float32) * inv_scale, 0, PTX)
            tl.store(q_ptr + t64 * q_st + cols, q, mask=cmask)
        if PATTERN == 3:
            nf = tl.where(cmask, n.to(tl.float32), 0.0)
            packed, sf = QD.nvfp4_quantize_rows(
                tl.reshape(nf, (1, BLOCK_H)), gs, rcp_gs, BLOCK_H, RECIPE, PTX
            )
            half = tl.arange(0, BLOCK_H // 2)
            tl.store(
                q_ptr + t64 * q_st + half, tl.reshape(packed, (BLOCK_H // 2,)), mask=half * 2 < H
            )
            ks = tl.arange(0, BLOCK_H // 16)
            kb = H // 16
            sfv = tl.where(ks < kb, tl.reshape(sf, (BLOCK_H // 16,)), 0).to(tl.uint8)
            off = QD.scale_offset(t64, ks.to(tl.int64), n_kcols, LAYOUT)
            tl.store(sf_ptr + off, sfv, mask=ks < n_kcols)


@triton.jit
def zero_scale_rows(
    sf_ptr, first, stop, step, n_kcols, LAYOUT: tl.constexpr, KP_BLOCK: tl.constexpr
):
    """Write 0 into every scale byte of padding rows ``first, first+step, ... < stop``."""
    ks = tl.arange(0, KP_BLOCK)
    row = first
    while row < stop:
        off = QD.scale_offset(row.to(tl.int64), ks.to(tl.int64), n_kcols, LAYOUT)
        tl.store(sf_ptr + off, tl.zeros([KP_BLOCK], tl.uint8), mask=ks < n_kcols)
        row += step


# ----------------------------------------------------------------------------- faults
@triton.jit
def store_sys(ptrs, values, mask, RELEASE: tl.constexpr, PTX: tl.constexpr):
    """Store of int32 ``values`` where ``mask``, at system scope (``st.relaxed.sys``, or
    ``st.release.sys`` with RELEASE): the host (pinned memory) or a peer (NVLink) sees it without
    waiting for the kernel to end. A plain store in the interpreter (host memory)."""
    if PTX:
        if RELEASE:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.release.sys.global.b32 [$1], $2; "
                "mov.u32 $0, 0; }",
                "=r,l,r,r",
                [ptrs, values, mask.to(tl.int32)],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $3, 0; @p st.relaxed.sys.global.b32 [$1], $2; "
                "mov.u32 $0, 0; }",
                "=r,l,r,r",
                [ptrs, values, mask.to(tl.int32)],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
    else:
        tl.store(ptrs, values, mask=mask)


@triton.jit
def host_status(ctrl_ptr):
    """Pointer to the host status block (int32 words; word 0 summary, word 1 + r rank r's code):
    ctrl plus the distance the workspace stored at int64 word CTRL_HOST64 of ctrl. Relative
    addressing (as for peer buffers), so the same code runs in the interpreter."""
    d = tl.load(ctrl_ptr.to(tl.pointer_type(tl.int64)) + CTRL_HOST64)
    return ctrl_ptr + d


@triton.jit
def record_fault(ctrl_ptr, mask, code, PTX: tl.constexpr):
    """Record ``code`` (FAULT_MISSING / FAULT_GAVE_UP) for every rank in the bit set ``mask``: in
    the device status word (later launches of this rank stop) and in the host status block (the
    host reads it before every call, without a device sync). The per-rank words are written
    before the summary word, with system-scope stores."""
    tl.atomic_or(ctrl_ptr + CTRL_STATUS, mask, sem="relaxed", scope="gpu")
    host = host_status(ctrl_ptr)
    ranks = tl.arange(0, MAX_RANKS)
    hit = ((mask >> ranks) & 1) != 0
    store_sys(host + 1 + ranks, tl.zeros([MAX_RANKS], tl.int32) + code, hit, False, PTX)
    # the CTA barrier makes every thread's code store part of what the release publishes: a host
    # that sees the summary word sees the codes (x86 loads are ordered)
    tl.debug_barrier()
    first = ranks == 0
    store_sys(host + ranks, tl.zeros([MAX_RANKS], tl.int32) + mask, first, True, PTX)


@triton.jit
def give_up(ctrl_ptr, table_ptr, rank, missing, P: tl.constexpr, PTX: tl.constexpr):
    """A bounded wait of this rank timed out waiting for the ranks in ``missing``: record it, and
    tell every peer (word ``rank`` of its faults region) that this rank has left the protocol, so
    a late peer stops with an error at its next launch instead of reading what this rank pushed
    for a call it abandoned."""
    record_fault(ctrl_ptr, missing, FAULT_MISSING, PTX)
    ranks = tl.arange(0, MAX_RANKS)
    peers = (ranks < P) & (ranks != rank)
    ptrs = flag_ptrs(table_ptr, ranks, peers, FAULTS_OFF16, rank)
    # the notice word: bit 0 "gave up", bits 1.. the ranks this rank waited for in vain
    store_sys(ptrs, tl.zeros([MAX_RANKS], tl.int32) + ((missing << 1) | 1), peers, False, PTX)


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def record_notices(ctrl_ptr, words, left, rank, PTX: tl.constexpr):
    """Record what the peers' notice ``words`` ([MAX_RANKS] int32, 0 where no notice) say: the
    ranks in ``left`` gave up (FAULT_GAVE_UP), and the ranks they gave up waiting for, this rank
    and themselves aside, never arrived (FAULT_MISSING): the host names the cause as well as the
    peer that stopped because of it."""
    record_fault(ctrl_ptr, left, FAULT_GAVE_UP, PTX)
    waited = tl.reduce(tl.where(words != 0, (words >> 1) & 0x3FFFFFFF, 0), 0, _bit_or)
    blamed = waited & (0x7FFFFFFF - (left | (1 << rank)))  # clear the bits of left and rank
    if blamed != 0:
        record_fault(ctrl_ptr, blamed, FAULT_MISSING, PTX)


@triton.jit
def healthy(ctrl_ptr, table_ptr, rank, P: tl.constexpr, PTX: tl.constexpr, dists=None):
    """True when this rank may take part in a call: no fault recorded here (device status word)
    and no peer has announced that it gave up (this rank's faults region). A peer that gave up is
    recorded as FAULT_GAVE_UP, so the host raises naming it.

    Both words go through ONE reduction, whose result every thread of the CTA shares: a plain
    scalar load is executed by every warp, and warps that read before and after another CTA's
    atomic_or would disagree about the row count and then diverge around barriers.
    ``dists``: the table entries read early (:func:`table_dists`), else loaded here."""
    ranks = tl.arange(0, MAX_RANKS)
    rmask = ranks < P
    status = tl.load(ctrl_ptr + CTRL_STATUS + ranks * 0, mask=ranks == 0, other=0, volatile=True)
    if dists is None:
        mine = flag_ptrs(table_ptr, rank + ranks * 0, rmask, FAULTS_OFF16, ranks)
    else:
        mine = peer_base(table_ptr, rank, FAULTS_OFF16, 32, dists) + ranks
    seen = tl.load(mine, mask=rmask, other=0, volatile=True)
    # bits 0..P-1: peers that gave up; bit 31 (P <= 31): "the status word is set". Disjoint
    # bits, so the int32 sum is their OR (an int64 variant cost 40 registers in the prefetch
    # kernel at H = 4096)
    word = tl.where(rmask & (seen != 0), 1 << ranks, 0) | tl.where(status != 0, 1 << 31, 0)
    both = tl.sum(word, axis=0)
    left = both & 0x7FFFFFFF
    if left != 0:
        record_notices(ctrl_ptr, tl.where(rmask, seen, 0), left, rank, PTX)
    return both == 0


@triton.jit
def notices(table_ptr, rank, dists=None):
    """Pointer to this rank's notice words: int32 [MAX_RANKS] at the start of its own buffer,
    word q non-zero once rank q gave up (:func:`give_up`). Lanes of ranks >= P stay 0."""
    return peer_base(table_ptr, rank, FAULTS_OFF16, 32, dists)


@triton.jit
def notice_mask(notice_ptr):
    """Bit set of the ranks whose notice word is set (one volatile load of the words, one CTA-wide
    reduction: every thread gets the same answer)."""
    ranks = tl.arange(0, MAX_RANKS)
    seen = tl.load(notice_ptr + ranks, volatile=True)
    return tl.sum(tl.where(seen != 0, 1 << ranks, 0), axis=0)


@triton.jit
def wait_bound(clock_ptr, timeout_us, table_ptr, rank, PTX: tl.constexpr, dists=None):
    """The bound of every wait of one launch: ``(deadline in ns, this rank's notice words)``.
    A wait ends when its data arrived, or (:func:`ended`) when the deadline passed or a peer's
    notice says that it gave up."""
    deadline = now_ns(clock_ptr, PTX) + timeout_us.to(tl.int64) * 1000
    return deadline, notices(table_ptr, rank, dists)


@triton.jit
def ended(bound, clock_ptr, PTX: tl.constexpr):
    """1 when a wait bounded by ``bound`` (:func:`wait_bound`) must stop: its deadline passed, or
    a peer gave up. Called only on a spin after a failed first probe, so a wait whose data is
    already there pays nothing; a spinning wait reads the notice words (local memory) with its
    data, so the notice costs no round trip of its own."""
    late = now_ns(clock_ptr, PTX) > bound[0]
    return (late | (notice_mask(bound[1]) != 0)).to(tl.int32)


@triton.jit
def leave(ctrl_ptr, table_ptr, rank, missing, P: tl.constexpr, PTX: tl.constexpr):
    """The end of a CTA whose wait ended without the data of the ranks in ``missing``. If a peer
    gave up (its notice is set), this rank stops too and records FAULT_GAVE_UP for that peer: the
    host then names the rank that gave up, not the ranks this wait happened to poll. Else the wait
    timed out: :func:`give_up` (FAULT_MISSING for ``missing`` and this rank's own notice to every
    peer). Either way the device status word is set, so later launches of this rank do nothing."""
    note = notices(table_ptr, rank)
    left = notice_mask(note)
    if left != 0:
        words = tl.load(note + tl.arange(0, MAX_RANKS), volatile=True)
        record_notices(ctrl_ptr, words, left, rank, PTX)
    else:
        give_up(ctrl_ptr, table_ptr, rank, missing, P, PTX)


# ------------------------------------------------------------------ kernel prologue and tail
# (shared by the one-shot kernels of every family: all-reduce, MoE reduction, expert norm)
@triton.jit
def load_gain(w_ptr, cols, cmask, weight_bias, PATTERN: tl.constexpr):
    """Gain ``f32(w) + weight_bias`` (model parameters: loaded before the grid-dependency wait)."""
    if PATTERN != 0:
        g = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + weight_bias
    else:
        g = tl.zeros(cols.shape, tl.float32)
    return g


@triton.jit
def quant_scales(scale_ptr, PATTERN: tl.constexpr, PTX: tl.constexpr):
    """``(1/scale, gs, rcp_fast(gs))`` from the [1] FP32 scale (IEEE 1/scale for FP8, the spec's
    all-reduce fusion)."""
    one = tl.full([], 1.0, tl.float32)
    if PATTERN == 2:
        sc = tl.load(scale_ptr).to(tl.float32)
        return tl.math.div_rn(one, sc), one, one
    elif PATTERN == 3:
        gs = tl.load(scale_ptr).to(tl.float32)
        return one, gs, rcp_fast(gs, PTX)
    else:
        return one, one, one


@triton.jit
def finish(
    ctrl_ptr,
    table_ptr,
    rank,
    arrive_idx,
    missing,
    sf_ptr,
    M,
    M_pad,
    n_kcols,
    pid,
    G,
    P: tl.constexpr,
    PATTERN: tl.constexpr,
    LAYOUT: tl.constexpr,
    KP_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
    arrive=True,
    n_arrive=0,
):
    """Common tail: PDL trigger, fault record on timeout, scale padding rows, CTA arrival count.

    A CTA whose wait ended without its data leaves the protocol (:func:`leave`).
    Returns True in the one CTA that arrives last (it then advances the device-resident state).

    By default every CTA arrives (``n_arrive`` 0 means G). A kernel whose CTAs are known to have
    read the state words once a subset of them finishes passes ``arrive`` (this CTA counts) and
    ``n_arrive`` (how many count); with one arrival there is no atomic at all: its round trip to
    L2 is on the critical path of a decode launch."""
    if USE_PDL:
        gdc_launch_dependents()
    if missing != 0:
        leave(ctrl_ptr, table_ptr, rank, missing, P, PTX)
    if PATTERN == 3:
        zero_scale_rows(sf_ptr, M + pid, M_pad, G, n_kcols, LAYOUT, KP_BLOCK)
    if n_arrive == 0:
        n_arrive = G
    last = arrive & (n_arrive == 1)
    if arrive & (n_arrive > 1):
        old = tl.atomic_add(ctrl_ptr + arrive_idx, 1, sem="acq_rel", scope="gpu")
        last = old == n_arrive - 1
    return last


@triton.jit
def oneshot_state(
    ctrl_ptr,
    table_ptr,
    rank,
    clock_ptr,
    timeout_us,
    M,
    pid,
    G,
    cap,
    P: tl.constexpr,
    PTX: tl.constexpr,
    dists=None,
):
    """(bound of every wait (:func:`wait_bound`), Lamport generation, this CTA's row count — rows
    pid, pid + G, ...; 0 once the workspace has failed or a peer gave up —, element offset of the
    generation's slot region)."""
    deadline = wait_bound(clock_ptr, timeout_us, table_ptr, rank, PTX, dists)
    gen = tl.load(ctrl_ptr + CTRL_GEN)
    ok = healthy(ctrl_ptr, table_ptr, rank, P, PTX, dists)
    n_mine = tl.where(ok, (M - pid + G - 1) // G, 0)
    region = gen.to(tl.int64) * cap
    return deadline, gen, n_mine, region


@triton.jit
def oneshot_finish(
    ctrl_ptr,
    table_ptr,
    rank,
    gen,
    missing,
    sf_ptr,
    M,
    M_pad,
    n_kcols,
    pid,
    G,
    P: tl.constexpr,
    PATTERN: tl.constexpr,
    LAYOUT: tl.constexpr,
    KP_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
    arrive=True,
    n_arrive=0,
):
    """:func:`finish` (``arrive`` / ``n_arrive`` as there); the CTA that arrives last resets the
    counter and advances the generation."""
    last = finish(
        ctrl_ptr,
        table_ptr,
        rank,
        CTRL_ARRIVE_1S,
        missing,
        sf_ptr,
        M,
        M_pad,
        n_kcols,
        pid,
        G,
        P,
        PATTERN,
        LAYOUT,
        KP_BLOCK,
        USE_PDL,
        PTX,
        arrive,
        n_arrive,
    )
    if last:
        tl.store(ctrl_ptr + CTRL_ARRIVE_1S, 0)
        tl.store(ctrl_ptr + CTRL_GEN, (gen + 1) % 3)


@triton.jit
def push_vals(
    x,
    t,
    cols,
    cmask,
    table_ptr,
    lam_off16,
    region,
    rank,
    H,
    P: tl.constexpr,
    BITS: tl.constexpr,
    dists=None,
):
    """Store row ``t`` of this rank, already in registers as ``x`` (-0.0 scrubbed), into its
    slot of every peer's buffer.

    Slots hold only the P-1 peers of the receiving rank (a rank reads its own row from its own
    input): sender ``s`` uses slot ``s - (s > q)`` at receiver ``q``."""
    t64 = t.to(tl.int64)
    bits = scrub(as_bits(x, BITS), BITS)
    for q in tl.static_range(P):
        if q != rank:
            slot = rank - (rank > q).to(tl.int32)
            off = ((region + t64) * (P - 1) + slot) * H
            tl.store(peer_base(table_ptr, q, lam_off16, BITS, dists) + off + cols, bits, mask=cmask)


@triton.jit
def receive_sum(
    x,
    t64,
    mine,
    region,
    rank,
    cols,
    cmask,
    H,
    deadline,
    clock_ptr,
    empty,
    T: tl.constexpr,
    P: tl.constexpr,
    BITS: tl.constexpr,
    FP32_ACC: tl.constexpr,
    PTX: tl.constexpr,
):
    """Row ``t64`` summed over ranks in ascending order (this rank's ``x`` in its place, each
    peer's row polled from its slot of this rank's buffer, then the slot re-armed), rounded to
    ``T``. Returns (sum as FP32, bit mask of the peers whose row did not arrive in time)."""
    acc = tl.zeros(x.shape, tl.float32)
    missing = 0
    for q in tl.static_range(P):
        if q == rank:
            v = x.to(tl.float32)
        else:
            slot = q - (q > rank).to(tl.int32)
            row = mine + ((region + t64) * (P - 1) + slot) * H
            ptr = row + cols
            bits, pending = poll_row(ptr, cmask, deadline, clock_ptr, BITS, PTX)
            tl.store(ptr, empty, mask=cmask)  # re-arm the slot just consumed
            missing = missing | tl.where(pending != 0, 1 << q, 0)
            v = bits.to(T, bitcast=True).to(tl.float32)
        acc = accumulate(acc, v, T, FP32_ACC, PTX)
    return round_to(acc, T, PTX).to(tl.float32), missing
