"""The token-owner kernels of ``tp_moe_finalize_rmsnorm`` (launched by
:mod:`moefuse.comm.expert_norm.tp_kernels`): rank ``t mod P`` owns token t, every other rank
pushes the token's K partial rows to it, the owner computes the token (the group sums of
:func:`moefuse.comm.expert_norm.slot_math._owned_token`) and pushes the output row to every peer.

* ``_tp_token_owner_kernel`` — Lamport slots (larger M), bounded polls, three generations.
* ``_tp_staged_kernel`` — plain stores into single-buffered staging / gather regions and two
  flag barriers per CTA (large M), as the all-reduce two-shot kernel.

Argument groups as in :mod:`moefuse.comm.expert_norm.slot_math` (``src``, ``wait``).
"""

import triton
import triton.language as tl

from moefuse._device import round_to
from moefuse.comm import device as D
from moefuse.comm.expert_norm.slot_math import (
    _finish_oneshot,
    _owned_token,
    _prologue,
    _push_foreign_tokens,
    _store_out,
)


# ----------------------------------------------------------------------------- TP token owner
@triton.jit(do_not_specialize=["M", "R", "rank"])
def _tp_token_owner_kernel(
    rows_ptr, w_ptr, idx_ptr, nw_ptr, out_ptr, row_st, w_st, idx_st, out_st,
    table_ptr, rows_off16, res_off16, ctrl_ptr, clock_ptr,
    M, R, H, Hf, rank, cap, eps, gain_center, timeout_us,
    P: tl.constexpr, K: tl.constexpr, B: tl.constexpr, NG: tl.constexpr,
    BLOCK_H: tl.constexpr, WBN: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """Token owner (Lamport, larger M): phase 1 pushes every valid slot row of tokens owned by
    other ranks to their owner, phase 2 computes the owned tokens and pushes their output rows
    to every peer, phase 3 copies the other owners' rows (module docstring)."""
    pid, G, cols, cmask, g = _prologue(nw_ptr, gain_center, H, BLOCK_H, USE_PDL)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, pid, G, cap, P, PTX
    )
    src = (rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st)
    # phase 1: push every valid slot row of tokens owned by other ranks to their owner
    _push_foreign_tokens(
        src, pid, G, n_mine, R, region, rank, table_ptr, rows_off16, cols, cmask, H, K, P
    )
    # phase 2: owned tokens: whole token here, output row pushed to every peer
    mine16 = D.peer_base(table_ptr, rank, rows_off16, 16)
    empty16 = D.empty_row(BLOCK_H, 16)
    wait = (deadline, clock_ptr, empty16)
    missing = 0
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t % P == rank:
            t64 = t.to(tl.int64)
            out, miss = _owned_token(
                src,
                t64,
                region,
                mine16,
                rank,
                g,
                cols,
                cmask,
                H,
                Hf,
                R,
                eps,
                wait,
                0,
                NG,
                K,
                B,
                NG,
                P,
                WBN,
                False,
                PTX,
            )
            missing = missing | miss
            o = D.scrub(D.as_bits(round_to(out, tl.bfloat16, PTX), 16), 16)
            _store_out(out_ptr, out_st, t64, o, cols, cmask)
            _push_token_row(o, t64, region, rank, table_ptr, res_off16, cols, cmask, H, P)
        i += 1
    # phase 3: copy the rows owned by other ranks
    mine_res = D.peer_base(table_ptr, rank, res_off16, 16)
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t % P != rank:
            t64 = t.to(tl.int64)
            ptr = mine_res + (region + t64) * H + cols
            bits, pending = D.poll_row(ptr, cmask, deadline, clock_ptr, 16, PTX)
            tl.store(ptr, empty16, mask=cmask)
            missing = missing | tl.where(pending != 0, 1 << (t % P), 0)
            _store_out(out_ptr, out_st, t64, bits, cols, cmask)
        i += 1
    _finish_oneshot(ctrl_ptr, table_ptr, rank, gen, missing, M, pid, G, P, USE_PDL, PTX)


@triton.jit
def _push_token_row(o, t64, row0, rank, table_ptr, res_off16, cols, cmask, H, P: tl.constexpr):
    """An owned token's output row ``o`` (BF16 bits, -0.0 scrubbed) into row ``row0 + t`` of
    every peer's result region at ``res_off16`` (this rank excluded)."""
    for q in tl.static_range(P):
        if q != rank:
            dst = D.peer_base(table_ptr, q, res_off16, 16) + (row0 + t64) * H
            tl.store(dst + cols, o, mask=cmask)


# ----------------------------------------------------------------------------- TP staged
@triton.jit
def _staged_owned_tokens(
    missing,
    cta,
    src,
    stage,
    rank,
    g,
    table_ptr,
    gather_off16,
    out,
    cols,
    cmask,
    H,
    Hf,
    R,
    eps,
    wait,
    K: tl.constexpr,
    B: tl.constexpr,
    NG: tl.constexpr,
    P: tl.constexpr,
    WBN: tl.constexpr,
    PTX: tl.constexpr,
):
    """Staged phase 2: each token of this CTA that this rank owns (``t mod P == rank``) is
    computed whole from the staged rows (read after the flag barrier, which tracked missing
    peers: ``missing`` is only read), written, and its BF16 row pushed into row t of every
    peer's gather region. ``cta`` = (pid, G, n_mine); ``out`` = (out_ptr, out_st)."""
    pid, G, n_mine = cta
    out_ptr, out_st = out
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t % P == rank:
            t64 = t.to(tl.int64)
            osum, miss = _owned_token(
                src,
                t64,
                0,
                stage,
                rank,
                g,
                cols,
                cmask,
                H,
                Hf,
                R,
                eps,
                wait,
                0,
                NG,
                K,
                B,
                NG,
                P,
                WBN,
                True,
                PTX,
            )
            o = D.scrub(D.as_bits(round_to(osum, tl.bfloat16, PTX), 16), 16)
            _store_out(out_ptr, out_st, t64, o, cols, cmask)
            _push_token_row(o, t64, 0, rank, table_ptr, gather_off16, cols, cmask, H, P)
        i += 1


@triton.jit
def _staged_copy_tokens(missing, cta, gathered, out, cols, cmask, H, rank, P: tl.constexpr):
    """Staged phase 3: the rows of this CTA's tokens owned by other ranks, read from this
    rank's gather region ``gathered`` after the flag barrier (``missing`` is only read)."""
    pid, G, n_mine = cta
    out_ptr, out_st = out
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t % P != rank:
            t64 = t.to(tl.int64)
            bits = tl.load(gathered + t64 * H + cols, mask=cmask, other=0, cache_modifier=".cg")
            _store_out(out_ptr, out_st, t64, bits, cols, cmask)
        i += 1


@triton.jit(do_not_specialize=["M", "R", "rank"])
def _tp_staged_kernel(
    rows_ptr,
    w_ptr,
    idx_ptr,
    nw_ptr,
    out_ptr,
    strides,
    table_ptr,
    flags_off16,
    stage_off16,
    gather_off16,
    ctrl_ptr,
    clock_ptr,
    M,
    R,
    H,
    Hf,
    rank,
    eps,
    gain_center,
    timeout_us,
    P: tl.constexpr,
    PP: tl.constexpr,
    NSLOT: tl.constexpr,
    K: tl.constexpr,
    B: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WBN: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    """Token owner with push + flags instead of Lamport slots (larger M): single-buffered
    staging ``[t, k, sender]`` and gather ``[t]`` regions, two flag barriers per CTA (phase,
    CTA, sender; device-resident epoch), as the all-reduce two-shot kernel. Safe single
    buffering: a peer writes call e+1 only after this rank's CTA signalled it consumed call e.
    ``strides`` = (row_st, w_st, idx_st, out_st)."""
    row_st, w_st, idx_st, out_st = strides
    pid, G, cols, cmask, g = _prologue(nw_ptr, gain_center, H, BLOCK_H, USE_PDL)
    deadline = D.wait_bound(clock_ptr, timeout_us, table_ptr, rank, PTX)
    epoch = tl.load(ctrl_ptr + D.CTRL_EPOCH)
    healthy = D.healthy(ctrl_ptr, table_ptr, rank, P, PTX)
    n_mine = tl.where(healthy, (M - pid + G - 1) // G, 0)
    src = (rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st)
    cta = (pid, G, n_mine)
    out = (out_ptr, out_st)
    # phase 1: stage every valid slot row of tokens owned by other ranks at their owner
    _push_foreign_tokens(
        src, pid, G, n_mine, R, 0, rank, table_ptr, stage_off16, cols, cmask, H, K, P
    )
    missing = 0
    if healthy:
        D.signal_peers(table_ptr, flags_off16, pid, rank, epoch, P, PP)
        missing = D.wait_peers(
            table_ptr, flags_off16, pid, rank, epoch, deadline, clock_ptr, P, PP, PTX
        )
    # phase 2: owned tokens from the staged rows; output row pushed into every peer's gather
    stage = D.peer_base(table_ptr, rank, stage_off16, 16)
    empty16 = D.empty_row(BLOCK_H, 16)
    wait = (deadline, clock_ptr, empty16)
    _staged_owned_tokens(
        missing,
        cta,
        src,
        stage,
        rank,
        g,
        table_ptr,
        gather_off16,
        out,
        cols,
        cmask,
        H,
        Hf,
        R,
        eps,
        wait,
        K,
        B,
        NG,
        P,
        WBN,
        PTX,
    )
    if healthy & (missing == 0):
        D.signal_peers(table_ptr, flags_off16, NSLOT + pid, rank, epoch, P, PP)
        missing = D.wait_peers(
            table_ptr, flags_off16, NSLOT + pid, rank, epoch, deadline, clock_ptr, P, PP, PTX
        )
    # phase 3: copy the rows owned by other ranks from the local gather region
    gathered = D.peer_base(table_ptr, rank, gather_off16, 16)
    _staged_copy_tokens(missing, cta, gathered, out, cols, cmask, H, rank, P)
    _finish_staged(ctrl_ptr, table_ptr, rank, epoch, missing, M, pid, G, P, USE_PDL, PTX)


@triton.jit
def _finish_staged(
    ctrl_ptr,
    table_ptr,
    rank,
    epoch,
    missing,
    M,
    pid,
    G,
    P: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    """End of the staged kernel: :func:`moefuse.comm.device.finish` on the two-shot arrival
    word; the last CTA resets it and advances the epoch of the flag barriers."""
    last = D.finish(
        ctrl_ptr,
        table_ptr,
        rank,
        D.CTRL_ARRIVE_2S,
        missing,
        ctrl_ptr,
        M,
        M,
        0,
        pid,
        G,
        P,
        0,
        0,
        16,
        USE_PDL,
        PTX,
    )
    if last:
        tl.store(ctrl_ptr + D.CTRL_ARRIVE_2S, 0)
        tl.store(ctrl_ptr + D.CTRL_EPOCH, epoch % D.EPOCH_WRAP + 1)
