"""The column all-gather of the all-gather + norm fusions (spec:
all_gather_gated_residual_next_rmsnorm, all_gather_rmsnorm_fp4_quantize) and its launcher.

Each rank holds ``shard`` [M, S] (its columns ``[rank*S, (rank+1)*S)`` of every token row,
S = H / P). ``_allgather_kernel`` assembles the full rows ``[M, H]`` in this rank's local
``gathered`` buffer; the caller then runs the unchanged single-GPU kernel of the op on it
(:mod:`moefuse.comm.all_gather.ops`). Running the very kernel the single-GPU op runs is what
makes the fused ops bitwise equal to "all-gather, then the single-GPU op": the row reduction
tree, tile and launch policy are that kernel's, chosen from H exactly as for a local call.

Transport (Lamport, unicast peer stores; the spec's Lamport transport with two changes):

* Slots: region ``"allgather"`` of every rank's peer buffer holds ``[3 generations, max_tokens,
  H]`` 16-bit words; sender r writes its fragment of row t into columns ``[r*S, (r+1)*S)`` of
  row t of every peer's slot of the current generation (plain 16-byte stores over NVLink).
* Encoding: senders store the bitwise complement of the payload, so the "empty" pattern is 0,
  which is what the workspace's zero-filled extra regions already hold (no initialisation
  pass) and what a re-arm writes. The one payload that would encode to 0, 0xFFFF (a NaN), is
  sent as 0x7FFF (also a NaN, whose row is NaN anyway: every output is arithmetic on the row
  statistic). Unlike the -0.0 sentinel of the all-reduce, -0.0 travels unchanged, so the
  gathered rows equal the shards bit for bit.
* Each CTA pushes row i and, one row behind, polls row i-1's peer fragments in its own slot
  until no word is 0 (or the wait ends), copies them (decoded) into ``gathered`` and re-arms
  (zeroes) them right away. Its own fragment goes straight from the shard into ``gathered``.
* Generations: three, advanced by the last CTA to arrive (atomic counter in the local
  ``agctrl`` word block), so CUDA-graph replays are correct. Consumer re-arm plus three
  generations: a peer can be at most one call ahead (it cannot finish call e+1 without this
  rank's pushes of e+1), so it never writes the generation this rank is reading.

Faults follow the protocol of :mod:`moefuse.comm.faults`: every launch first checks that the
workspace is healthy (no fault here, no peer's "gave up" notice) and otherwise does nothing;
every wait ends at its deadline or at a peer's notice; a CTA whose wait ended without its data
records the fault and, if it timed out, tells its peers that it gave up, so a late peer stops
instead of reading the fragments of an abandoned call. Token counts are run-time arguments
(``do_not_specialize``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs
from moefuse.comm import device as D
from moefuse.comm.tiles import next_pow2

#: words of the local all-gather control block (int32): generation, CTA arrival counter
AG_GEN: tl.constexpr = tl.constexpr(0)
AG_ARRIVE: tl.constexpr = tl.constexpr(1)
AG_CTRL_WORDS = 8
#: the 16-bit region word a sender stores for payload 0xFFFF is ~0x7FFF (see the module docstring)
_NAN_SUBSTITUTE: tl.constexpr = tl.constexpr(0x7FFF)


@triton.jit
def _encode(x):
    """Payload -> stored word: the complement of the 16-bit pattern (0xFFFF sent as 0x7FFF)."""
    bits = x.to(tl.int16, bitcast=True)
    bits = tl.where(bits == -1, tl.full(bits.shape, _NAN_SUBSTITUTE, tl.int16), bits)
    return bits ^ tl.full(bits.shape, -1, tl.int16)


@triton.jit
def _decode(w, T: tl.constexpr):
    """The values of dtype T that :func:`_encode` turned into the words ``w``."""
    return (w ^ tl.full(w.shape, -1, tl.int16)).to(T, bitcast=True)


@triton.jit
def _poll_fragment(ptr, cm, deadline, clock_ptr, PTX: tl.constexpr):
    """Volatile-load a peer fragment until no word is the empty pattern 0 (or the wait ends,
    ``D.ended``). Returns ``(stored words, pending)``; ``pending != 0``: it ended without them."""
    w = tl.load(ptr, mask=cm, other=1, volatile=True)
    pending = tl.max((w == 0).to(tl.int32), axis=0)
    expired = pending * 0
    while (pending != 0) & (expired == 0):
        w = tl.load(ptr, mask=cm, other=1, volatile=True)
        pending = tl.max((w == 0).to(tl.int32), axis=0)
        expired = D.ended(deadline, clock_ptr, PTX)
    return w, pending


@triton.jit(do_not_specialize=["M", "rank"])
def _allgather_kernel(
    shard_ptr,
    s_st,
    gath_ptr,
    g_st,
    table_ptr,
    ag_off16,
    agctrl_ptr,
    ctrl_ptr,
    clock_ptr,
    M,
    S,
    H,
    rank,
    cap,
    timeout_us,
    P: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_S)
    cm = cols < S
    if USE_PDL:
        gdc_wait()  # the shard is the previous kernel's output
        # every CTA of this grid is resident (grid <= co-resident capacity), so the next kernel
        # (the norm) may take its place early: it loads its parameters, then waits for this grid
        gdc_launch_dependents()
    deadline, gen, healthy, region, mine = prelude(
        table_ptr, ag_off16, agctrl_ptr, ctrl_ptr, clock_ptr, rank, cap, timeout_us, P, PTX
    )
    n_mine = tl.where(healthy, (M - pid + G - 1) // G, 0)
    empty = tl.zeros([BLOCK_S], tl.int16)
    own = rank * S
    missing = 0
    # iteration i pushes row pid + i*G and receives row pid + (i-1)*G: the peers pushed that
    # row one iteration earlier, so the wire time of one row overlaps the copy of the previous
    # (a while loop: the interpreter cannot range over a loaded value; a CTA stops at its
    # first expired wait, the status word then stops every later launch)
    i = 0
    while (i <= n_mine) & (missing == 0):
        if i < n_mine:
            push_row(
                shard_ptr,
                s_st,
                gath_ptr,
                g_st,
                pid + i * G,
                cols,
                cm,
                table_ptr,
                ag_off16,
                region,
                rank,
                own,
                H,
                P,
            )
        if i > 0:
            miss = receive_row(
                gath_ptr,
                g_st,
                pid + (i - 1) * G,
                cols,
                cm,
                mine,
                region,
                rank,
                S,
                H,
                deadline,
                clock_ptr,
                empty,
                P,
                PTX,
            )
            missing = missing | miss
        i += 1
    finish(agctrl_ptr, ctrl_ptr, table_ptr, rank, gen, missing, pid, G, P, PTX)


@triton.jit
def prelude(
    table_ptr,
    ag_off16,
    agctrl_ptr,
    ctrl_ptr,
    clock_ptr,
    rank,
    cap,
    timeout_us,
    P: tl.constexpr,
    PTX: tl.constexpr,
):
    """(bound of every wait (``D.wait_bound``), generation, workspace healthy — no fault here and
    no peer's "gave up" notice, ``D.healthy`` —, element offset of the generation's slots, this
    rank's slots as an int16 pointer)."""
    deadline = D.wait_bound(clock_ptr, timeout_us, table_ptr, rank, PTX)
    gen = tl.load(agctrl_ptr + AG_GEN)
    healthy = D.healthy(ctrl_ptr, table_ptr, rank, P, PTX)
    region = gen.to(tl.int64) * cap
    mine = D.peer_base(table_ptr, rank, ag_off16, 16)
    return deadline, gen, healthy, region, mine


@triton.jit
def push_row(
    shard_ptr,
    s_st,
    gath_ptr,
    g_st,
    t,
    cols,
    cm,
    table_ptr,
    ag_off16,
    region,
    rank,
    own,
    H,
    P: tl.constexpr,
    OWN_SLOT: tl.constexpr = False,
):
    """Row ``t`` of this rank's shard: encoded into its columns of every peer's slot, and as is
    into this rank's gathered row (``OWN_SLOT``: encoded into its own slot instead)."""
    x = load_fragment(shard_ptr, s_st, t, cols, cm)
    store_fragment(
        x, gath_ptr, g_st, t, cols, cm, table_ptr, ag_off16, region, rank, own, H, P, OWN_SLOT
    )


@triton.jit
def load_fragment(shard_ptr, s_st, t, cols, cm):
    """Row ``t`` of this rank's shard (masked columns ``cm``; an all-false mask reads nothing)."""
    return tl.load(shard_ptr + t.to(tl.int64) * s_st + cols, mask=cm, other=0.0)


@triton.jit
def store_fragment(
    x,
    gath_ptr,
    g_st,
    t,
    cols,
    cm,
    table_ptr,
    ag_off16,
    region,
    rank,
    own,
    H,
    P: tl.constexpr,
    OWN_SLOT: tl.constexpr = False,
):
    """The push of :func:`push_row` for a fragment ``x`` already loaded from shard row ``t``.
    ``OWN_SLOT``: this rank's fragment goes encoded into its own slot too (where
    :func:`receive_tile` reads the whole row), instead of as is into the gathered row."""
    t64 = t.to(tl.int64)
    enc = _encode(x)
    dst = (region + t64) * H + own + cols
    if OWN_SLOT:
        for q in tl.static_range(P):
            tl.store(D.peer_base(table_ptr, q, ag_off16, 16) + dst, enc, mask=cm)
    else:
        for q in tl.static_range(P):
            if q != rank:
                tl.store(D.peer_base(table_ptr, q, ag_off16, 16) + dst, enc, mask=cm)
        tl.store(gath_ptr + t64 * g_st + own + cols, x, mask=cm)


@triton.jit
def receive_row(
    gath_ptr,
    g_st,
    t,
    cols,
    cm,
    mine,
    region,
    rank,
    S,
    H,
    deadline,
    clock_ptr,
    empty,
    P: tl.constexpr,
    PTX: tl.constexpr,
):
    """Poll every peer's fragment of row ``t`` in this rank's slot, re-arm it, store it decoded
    into the gathered row. Returns the bit mask of peers whose fragment did not arrive in time."""
    T: tl.constexpr = gath_ptr.dtype.element_ty
    t64 = t.to(tl.int64)
    missing = 0
    for q in tl.static_range(P):
        if q != rank:
            ptr = mine + (region + t64) * H + q * S + cols
            w, pending = _poll_fragment(ptr, cm, deadline, clock_ptr, PTX)
            tl.store(ptr, empty, mask=cm)  # re-arm the fragment just consumed
            missing = missing | tl.where(pending != 0, 1 << q, 0)
            val = _decode(w, T)
            tl.store(gath_ptr + t64 * g_st + q * S + cols, val, mask=cm)
    return missing


@triton.jit
def _load_words(ptrs, valids, N: tl.constexpr):
    """One volatile load of each of the N word tensors ``ptrs[k]`` (one shape; masks
    ``valids[k]``; masked words read as 1, i.e. not empty). Returns ``(words, any word empty)``:
    the empty flags are OR-ed element-wise first, so a round costs one CTA-wide reduction."""
    w = tl.load(ptrs[0], mask=valids[0], other=1, volatile=True)
    ws = (w,)
    empty = w == 0
    for k in tl.static_range(1, N):
        w = tl.load(ptrs[k], mask=valids[k], other=1, volatile=True)
        ws = ws + (w,)
        empty = empty | (w == 0)
    return ws, tl.max(tl.max(empty.to(tl.int32), axis=1), axis=0)


@triton.jit
def _receive_words(
    ptrs,
    valids,
    owners,
    T: tl.constexpr,
    N: tl.constexpr,
    deadline,
    clock_ptr,
    MASKED: tl.constexpr,
    P: tl.constexpr,
    PTX: tl.constexpr,
):
    """Poll the N word tensors of this rank's slot (``ptrs``, masks ``valids``, owning rank of
    every word ``owners``) until no word is empty, or the deadline; all N are loaded together
    each round. Re-arms them, decodes them to dtype T (masked words 0 when ``MASKED``).
    Returns ``(values, bit mask of the ranks whose words did not arrive in time)``."""
    ws, pending = _load_words(ptrs, valids, N)
    expired = pending * 0
    while (pending != 0) & (expired == 0):
        ws, pending = _load_words(ptrs, valids, N)
        expired = D.ended(deadline, clock_ptr, PTX)
    missing = 0
    xs = ()
    for k in tl.static_range(N):
        w = ws[k]
        tl.store(ptrs[k], tl.zeros(w.shape, tl.int16), mask=valids[k])  # re-arm
        if pending != 0:  # timed out: name the ranks whose words are still empty
            for q in tl.static_range(P):
                late = ((w == 0) & (owners[k] == q)).to(tl.int32)
                late = tl.max(tl.max(late, axis=1), axis=0)
                missing = missing | tl.where(late != 0, 1 << q, 0)
        x = _decode(w, T)
        if MASKED:
            x = tl.where(valids[k], x, tl.zeros(x.shape, T))
        xs = xs + (x,)
    return xs, missing


@triton.jit
def receive_tile(
    mine,
    region,
    rows,
    cols,
    mask,
    live,
    S,
    H,
    deadline,
    clock_ptr,
    T: tl.constexpr,
    MASKED: tl.constexpr,
    P: tl.constexpr,
    PTX: tl.constexpr,
):
    """The rows ``rows`` x columns ``cols`` of the gathered rows as a register tile of dtype T,
    read straight from this rank's slot, where every rank (this one included: ``OWN_SLOT``)
    stored its fragment: poll until no word is empty (or the deadline), re-arm, decode. Masked
    elements (``MASKED``) read as 0, as the single-GPU kernels' masked loads; ``live`` False
    (workspace unhealthy, or a tile of padding rows) waits for nothing and reads nothing.
    Returns ``(tile, bit mask of the peers whose words did not arrive in time)``."""
    ptr = mine + (region + rows.to(tl.int64))[:, None] * H + cols[None, :]
    xs, missing = _receive_words(
        (ptr,), (mask & live,), ((cols // S)[None, :],), T, 1, deadline, clock_ptr, MASKED, P, PTX
    )
    return xs[0], missing


@triton.jit
def receive_steps(
    mine,
    region,
    row,
    live,
    S,
    H,
    deadline,
    clock_ptr,
    T: tl.constexpr,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    MASKED: tl.constexpr,
    P: tl.constexpr,
    PTX: tl.constexpr,
):
    """:func:`receive_tile` for a stepped row (``norm.triton`` layout: STEPS steps of [1, STEP]
    columns): the steps of gathered row ``row`` as a tuple of FP32 tensors, the values of the
    single-GPU kernels' ``ldp`` step loads, all polled together."""
    base = mine + (region + row.to(tl.int64)) * H
    ptrs = ()
    valids = ()
    owners = ()
    for k in tl.static_range(STEPS):
        cols = k * STEP + tl.arange(0, STEP)[None, :]
        ptrs = ptrs + (base + cols,)
        valids = valids + ((cols < H) & live,)
        owners = owners + (cols // S,)
    xs, missing = _receive_words(
        ptrs, valids, owners, T, STEPS, deadline, clock_ptr, MASKED, P, PTX
    )
    fs = ()
    for k in tl.static_range(STEPS):
        fs = fs + (xs[k].to(tl.float32),)
    return fs, missing


@triton.jit
def finish(
    agctrl_ptr, ctrl_ptr, table_ptr, rank, gen, missing, pid, G, P: tl.constexpr, PTX: tl.constexpr
):
    """A CTA whose wait ended without its data leaves the protocol (``D.leave``: the fault is
    recorded, and a timed-out rank tells its peers that it gave up); the CTA that arrives last
    resets the counter and advances the generation (device-resident: correct under CUDA-graph
    replay)."""
    if missing != 0:
        D.leave(ctrl_ptr, table_ptr, rank, missing, P, PTX)
    if G == 1:  # decode: no atomic round trip to L2 on the critical path
        last = pid == 0
    else:
        last = tl.atomic_add(agctrl_ptr + AG_ARRIVE, 1, sem="acq_rel", scope="gpu") == G - 1
    if last:
        tl.store(agctrl_ptr + AG_ARRIVE, 0)
        tl.store(agctrl_ptr + AG_GEN, (gen + 1) % 3)


def allgather_tile(shard_width: int) -> tuple[int, int]:
    """``(BLOCK_S, num_warps)`` for fragments of ``shard_width`` 16-bit columns: a power of two
    >= S, ~8 elements (16 bytes) per thread, 1 to 8 warps. A function of S alone."""
    block = max(16, next_pow2(shard_width))
    return block, min(8, max(1, block // 256))


def launch_allgather(
    ws, state, shard: torch.Tensor, gathered: torch.Tensor, use_pdl: bool = False
) -> None:
    """All-gather the column shards of every rank into ``gathered`` [M, H] (rank order).

    ``state``: the workspace's :class:`moefuse.comm.all_gather.ops.AllGatherState` (``agctrl``
    control words). ``shard`` [M, S] BF16/FP16, last dim contiguous; ``gathered`` [M, H] of the
    same dtype, rows contiguous. Collective: every rank launches it with the same M."""
    m, s = shard.shape
    if m == 0:
        return
    block, warps = allgather_tile(s)
    ws.refresh_clock()
    # the grid is the same on every rank (MIN-reduced SM count): in the interpreter, which runs
    # CTAs one after another, CTA j of every rank pushes before it waits on CTA j of the peers
    ctas = max(1, min(m, ws.max_ctas(warps)))
    extra = pdl_launch_kwargs(use_pdl)
    launch(
        _allgather_kernel,
        (ctas,),
        shard,
        shard.stride(0),
        gathered,
        gathered.stride(0),
        ws.table,
        ws.offset16("allgather"),
        state.agctrl,
        ws.ctrl,
        ws.clock,
        m,
        s,
        ws.hidden_size,
        ws.rank,
        ws.max_tokens,
        ws.timeout_us,
        P=ws.world_size,
        BLOCK_S=block,
        USE_PDL=bool(use_pdl),
        PTX=not interpreter_active(),
        num_warps=warps,
        **extra,
    )
