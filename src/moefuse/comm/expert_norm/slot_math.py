"""Device functions shared by the expert-norm kernels (:mod:`moefuse.comm.expert_norm.tp_kernels`
and :mod:`moefuse.comm.expert_norm.ep_kernels`): the per-slot math (the norm statistic and the
normalized row of one expert row), the routes and rows of a token's K slots, and the Lamport slot
rows of the TP algorithms (push, rank-order sum, the owner's token sum).

A token's slot rows are addressed through ``src`` = (rows_ptr, row_st, w_ptr, w_st, idx_ptr,
idx_st): the expert rows ``[R, H]``, the routing weights ``[M, K]`` (FP32) and the index map
``[M, K]`` (int32), with their row strides. A bounded wait is ``wait`` = (deadline, clock_ptr,
empty row) (:func:`moefuse.comm.device.poll_row`). ``PTX`` (constexpr) is False in Triton's
interpreter; the off-path computes the same values.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from moefuse._device import round_to, rsqrt_fast, widen_f32
from moefuse.comm import device as D


# ----------------------------------------------------------------------------- per-slot math
@triton.jit
def _norm_rstd(x, g, cmask, Hf, eps, WBN: tl.constexpr):
    """Reciprocal RMS of one expert row ``x`` (FP32, BF16-exact values; of ``x * g`` when WBN).
    The statistic is an FP64 sum of exact squares rounded once to FP32 (same convention as
    ``moefuse.comm.device.epilogue_row``)."""
    if WBN:
        z = x * g
    else:
        z = x
    zd = tl.where(cmask, z, 0.0).to(tl.float64)
    sumsq = tl.sum(zd * zd, axis=0).to(tl.float32)
    return rsqrt_fast(tl.math.div_rn(sumsq, Hf) + eps)


@triton.jit
def _norm_apply(x, g, r, WBN: tl.constexpr):
    """The normalized row from ``x`` and its :func:`_norm_rstd` ``r`` (products only: nothing
    for the compiler to contract, so a row rebuilt from (x, r) elsewhere has the same bits)."""
    if WBN:
        y = (x * g) * r
    else:
        y = (x * r) * g
    return y


@triton.jit
def _expert_norm(x, g, cmask, Hf, eps, WBN: tl.constexpr):
    """RMSNorm of one expert row ``x`` (FP32, BF16-exact values)."""
    return _norm_apply(x, g, _norm_rstd(x, g, cmask, Hf, eps, WBN), WBN)


@triton.jit
def _slot_y(acc, g, cmask, Hf, eps, WBN: tl.constexpr, PTX: tl.constexpr):
    """FP32 rank sum ``acc`` of a slot -> one BF16 rounding -> normalized FP32 row."""
    x = widen_f32(round_to(acc, tl.bfloat16, PTX), PTX)
    return _expert_norm(x, g, cmask, Hf, eps, WBN)


@triton.jit
def _prologue(nw_ptr, gain_center, H, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr):
    """(program, programs, columns, column mask, gain ``f32(w) + gain_center``); the gain is a
    model parameter, loaded before the grid-dependency wait (PDL)."""
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = tl.load(nw_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + gain_center
    if USE_PDL:
        gdc_wait()
    return tl.program_id(0), tl.num_programs(0), cols, cmask, g


@triton.jit
def _route(idx_ptr, idx_st, t64, k, R):
    """(row index as int64, valid) of slot (t, k)."""
    p = tl.load(idx_ptr + t64 * idx_st + k)
    valid = (p >= 0) & (p < R)
    return p.to(tl.int64), valid


@triton.jit
def _weight(w_ptr, w_st, t64, k):
    return tl.load(w_ptr + t64 * w_st + k).to(tl.float32)


@triton.jit
def _load_row(rows_ptr, row_st, p64, cols, cmask):
    return tl.load(rows_ptr + p64 * row_st + cols, mask=cmask, other=0.0)


@triton.jit
def _store_out(out_ptr, out_st, t64, o, cols, cmask):
    """Store a BF16 row with -0.0 written as +0.0 (``o`` given as int16 bits)."""
    tl.store(
        out_ptr + t64 * out_st + cols, D.scrub(o, 16).to(tl.bfloat16, bitcast=True), mask=cmask
    )


@triton.jit
def _slot_off(region, t64, k, s, H, K: tl.constexpr, P: tl.constexpr):
    """Element offset of BF16 row slot [gen region + t, k, sender slot s] ([3, L, K, P-1, H])."""
    return (((region + t64) * K + k) * (P - 1) + s) * H


@triton.jit
def _push_slot(
    x,
    q,
    k,
    t64,
    region,
    rank,
    table_ptr,
    rows_off16,
    cols,
    cmask,
    H,
    K: tl.constexpr,
    P: tl.constexpr,
    dists=None,
):
    """Store this rank's partial row ``x`` of slot (t, k) into its slot of rank ``q``'s buffer
    (sender ``s`` uses slot ``s - (s > q)``; a rank never sends to itself). ``dists``: the
    table entries read early (``D.table_dists``)."""
    s = rank - (rank > q).to(tl.int32)
    dst = D.peer_base(table_ptr, q, rows_off16, 16, dists) + _slot_off(region, t64, k, s, H, K, P)
    tl.store(dst + cols, D.scrub(D.as_bits(x, 16), 16), mask=cmask)


@triton.jit
def _slot_sum(
    own,
    k,
    t64,
    region,
    mine16,
    rank,
    cols,
    cmask,
    H,
    wait,
    K: tl.constexpr,
    P: tl.constexpr,
    STAGED: tl.constexpr,
    PTX: tl.constexpr,
):
    """FP32 rank-order sum (from +0.0) of slot (t, k): this rank's row ``own`` (FP32) in its
    place, each peer's row polled from this rank's Lamport slot and the slot re-armed (or, when
    STAGED, read from the staging region after the flag barrier). Returns (sum, bit mask of
    peers that never arrived)."""
    deadline, clock_ptr, empty16 = wait
    acc = tl.zeros(own.shape, tl.float32)
    missing = 0
    for q in tl.static_range(P):
        if q == rank:
            v = own
        else:
            s = q - (q > rank).to(tl.int32)
            ptr = mine16 + _slot_off(region, t64, k, s, H, K, P) + cols
            if STAGED:  # .cg: written by a peer over NVLink, never cached in this SM's L1
                bits = tl.load(ptr, mask=cmask, other=0, cache_modifier=".cg")
            else:
                bits, pending = D.poll_row(ptr, cmask, deadline, clock_ptr, 16, PTX)
                tl.store(ptr, empty16, mask=cmask)  # re-arm the slot just consumed
                missing = missing | tl.where(pending != 0, 1 << q, 0)
            v = widen_f32(bits.to(tl.bfloat16, bitcast=True), PTX)
        acc = acc + v
    return acc, missing


@triton.jit
def _owned_token(
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
    j_lo,
    j_hi,
    K: tl.constexpr,
    B: tl.constexpr,
    NG: tl.constexpr,
    P: tl.constexpr,
    WBN: tl.constexpr,
    STAGED: tl.constexpr,
    PTX: tl.constexpr,
):
    """``sum_{j in [j_lo, j_hi) asc} G_j`` for token t (FP32 from +0.0), every slot's peer rows
    from this rank's Lamport slots (or staging region). Returns (sum, missing peers)."""
    rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st = src
    out = tl.zeros(cols.shape, tl.float32)
    gsum = tl.zeros(cols.shape, tl.float32)
    missing = 0
    for k in tl.static_range(K):
        if k > 0:
            if k % B == 0:  # group boundary (compile time): close the previous group
                out = out + gsum
                gsum = tl.zeros(cols.shape, tl.float32)
        if (k // B >= j_lo) & (k // B < j_hi):
            p, valid = _route(idx_ptr, idx_st, t64, k, R)
            if valid:
                own = widen_f32(_load_row(rows_ptr, row_st, p, cols, cmask), PTX)
                acc, miss = _slot_sum(
                    own, k, t64, region, mine16, rank, cols, cmask, H, wait, K, P, STAGED, PTX
                )
                missing = missing | miss
                y = _slot_y(acc, g, cmask, Hf, eps, WBN, PTX)
                gsum = tl.fma(y, _weight(w_ptr, w_st, t64, k), gsum)
    out = out + gsum
    return out, missing


@triton.jit
def _push_foreign_tokens(
    src,
    pid,
    G,
    n_mine,
    R,
    region,
    rank,
    table_ptr,
    off16,
    cols,
    cmask,
    H,
    K: tl.constexpr,
    P: tl.constexpr,
):
    """Token-owner phase 1: every valid slot row of this CTA's tokens owned by other ranks
    (owner ``t mod P``) into the owner's slot (never waits)."""
    rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st = src
    i = 0
    while i < n_mine:
        t = pid + i * G
        o = t % P
        if o != rank:
            t64 = t.to(tl.int64)
            for k in tl.static_range(K):
                p, valid = _route(idx_ptr, idx_st, t64, k, R)
                if valid:
                    x = _load_row(rows_ptr, row_st, p, cols, cmask)
                    _push_slot(x, o, k, t64, region, rank, table_ptr, off16, cols, cmask, H, K, P)
        i += 1


@triton.jit
def _finish_oneshot(
    ctrl_ptr,
    table_ptr,
    rank,
    gen,
    missing,
    M,
    pid,
    G,
    P: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    """End of a Lamport TP kernel: :func:`moefuse.comm.device.oneshot_finish` with no scale
    rows to pad (the status word, the arrival, the generation advanced by the last CTA)."""
    D.oneshot_finish(
        ctrl_ptr,
        table_ptr,
        rank,
        gen,
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
