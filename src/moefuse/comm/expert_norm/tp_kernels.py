"""Triton kernels of the per-expert-norm MoE finalize fusions (spec: tp_moe_finalize_rmsnorm,
moe_finalize_rmsnorm_allreduce) and launchers.

TP (``tp_moe_finalize_rmsnorm``): every rank holds a partial GEMM2 row per (token, slot); the P
partials of a slot are summed in rank order (FP32, one BF16 rounding) BEFORE the per-expert
RMSNorm. Three algorithms, same bits:

* ``_tp_slot_oneshot_kernel`` (Lamport, decode): one CTA per (token, slot) row on EVERY rank;
  each rank pushes every partial row to every peer (one hop), sums, rounds and normalizes each
  row itself, and the CTA that completes a token's K rows folds them (no second hop); or, when
  every CTA has one row (:func:`split_fold`), the token's K CTAs wait for each other and fold a
  column slice each.
* ``_tp_expert_owner_kernel`` (Lamport, small M). Slot group j (``B = ceil(K/P)`` slots) belongs
  to rank j. Phase 1: every rank pushes its partial rows of the slots it does not own into the
  owner's BF16 slot ``[gen, t, k, sender]``. Phase 2: the owner polls them, sums ranks in order,
  rounds, normalizes, and folds its group with FMAs into an FP32 group sum ``G_j``, which it
  stores into slot ``[gen, t, j]`` of EVERY rank's FP32 region (its own too). Phase 3: every rank
  polls the groups and adds them in ascending j from +0.0, rounds once, writes the output.
* ``_tp_token_owner_kernel`` (Lamport, larger M). Rank ``t mod P`` owns token t: every other rank
  pushes all K partial rows of t to it; the owner computes the token exactly as above (same group
  sums, same order), writes its output row and pushes the BF16 row to every peer, which copies it.
* ``_tp_staged_kernel`` (push + flags, large M): the token-owner decomposition with plain stores
  into single-buffered staging / gather regions and two flag barriers per CTA (as the all-reduce
  two-shot kernel): no sentinels to poll or re-arm, one generation of memory instead of three.
* ``_tp_gathered_kernel`` — the torch.distributed path: all ranks' rows all-gathered into
  ``[P, R, H]``, then the same per-token math locally.

All three evaluate ``out = sum_{j asc} G_j`` with ``G_j = fma chain over group j's valid slots``
from the same device helpers, so a token's bits depend on (H, K, P) only — not on M, on the
algorithm that "auto" picks for M, or on the grid (batch invariance across the path switch).

EP (``moe_finalize_rmsnorm_allreduce``): :mod:`moefuse.comm.expert_norm.ep_kernels`. Both
reuse the per-slot math and slot rows of :mod:`moefuse.comm.expert_norm.slot_math`. This module
holds the expert-owner and torch-path kernels and the launchers of every TP algorithm; the slot
one-shot kernel is in :mod:`moefuse.comm.expert_norm.slot_oneshot`, the token-owner and staged
kernels in :mod:`moefuse.comm.expert_norm.token_owner`.

Invalid slots (index < 0 or >= R) are never loaded, normalized or weighted (their weight is not
read either). Lamport conventions, generations, bounded waits and the status word are those of
:mod:`moefuse.comm.device` (:func:`oneshot_state` / :func:`oneshot_finish`, shared control
words): the output is written with -0.0 as +0.0 on every path, because a BF16 row that travels as
Lamport payload must be scrubbed and all ranks must agree bitwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moefuse import knobs
from moefuse._device import round_to, widen_f32
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active
from moefuse.comm import device as D
from moefuse.comm.expert_norm.slot_math import (
    _finish_oneshot,
    _load_row,
    _owned_token,
    _prologue,
    _push_slot,
    _route,
    _slot_y,
    _store_out,
    _weight,
)
from moefuse.comm.expert_norm.slot_oneshot import _tp_slot_oneshot_kernel
from moefuse.comm.expert_norm.token_owner import _tp_staged_kernel, _tp_token_owner_kernel
from moefuse.comm.tiles import comm_tile


# ----------------------------------------------------------------------------- TP expert owner
@triton.jit
def _push_foreign_slots(
    src,
    t64,
    R,
    region,
    rank,
    table_ptr,
    rows_off16,
    cols,
    cmask,
    H,
    K: tl.constexpr,
    B: tl.constexpr,
    P: tl.constexpr,
):
    """Expert-owner phase 1, token t: push this rank's partial rows of the slots other ranks own
    (slot group ``k // B`` belongs to rank ``k // B``) into the owner's slot (never waits)."""
    rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st = src
    for k in tl.static_range(K):
        o = k // B
        if o != rank:
            p, valid = _route(idx_ptr, idx_st, t64, k, R)
            if valid:
                x = _load_row(rows_ptr, row_st, p, cols, cmask)
                _push_slot(x, o, k, t64, region, rank, table_ptr, rows_off16, cols, cmask, H, K, P)


@triton.jit
def _publish_group(
    gsum,
    t64,
    region,
    rank,
    table_ptr,
    gsum_off16,
    cols,
    cmask,
    H,
    NG: tl.constexpr,
    P: tl.constexpr,
):
    """Expert-owner phase 2: store the owned group's FP32 sum ``G_rank`` of token t (-0.0
    scrubbed) into slot ``[gen, t, rank]`` of every rank's group region, this rank's included."""
    bits = D.scrub(D.as_bits(gsum, 32), 32)
    for q in tl.static_range(P):
        dst = D.peer_base(table_ptr, q, gsum_off16, 32) + ((region + t64) * NG + rank) * H
        tl.store(dst + cols, bits, mask=cmask)


@triton.jit(do_not_specialize=["M", "R", "rank"])
def _tp_expert_owner_kernel(
    rows_ptr, w_ptr, idx_ptr, nw_ptr, out_ptr, row_st, w_st, idx_st, out_st,
    table_ptr, rows_off16, gsum_off16, ctrl_ptr, clock_ptr,
    M, R, H, Hf, rank, cap, eps, gain_center, timeout_us,
    P: tl.constexpr, K: tl.constexpr, B: tl.constexpr, NG: tl.constexpr,
    BLOCK_H: tl.constexpr, WBN: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """Expert owner (Lamport, small M): phase 1 pushes the rows of slots owned by other ranks,
    phase 2 sums the owned group of each token and publishes it to every rank, phase 3 adds the
    groups in ascending order (module docstring)."""
    pid, G, cols, cmask, g = _prologue(nw_ptr, gain_center, H, BLOCK_H, USE_PDL)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, pid, G, cap, P, PTX
    )
    src = (rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st)
    # phase 1: push the partial rows of slots owned by other ranks (never waits)
    i = 0
    while i < n_mine:
        t64 = (pid + i * G).to(tl.int64)
        _push_foreign_slots(
            src, t64, R, region, rank, table_ptr, rows_off16, cols, cmask, H, K, B, P
        )
        i += 1
    # phase 2: the owned group's sum, published to every rank (own buffer included)
    mine16 = D.peer_base(table_ptr, rank, rows_off16, 16)
    empty16 = D.empty_row(BLOCK_H, 16)
    wait = (deadline, clock_ptr, empty16)
    missing = 0
    i = 0
    while (i < n_mine) & (missing == 0) & (rank < NG):
        t64 = (pid + i * G).to(tl.int64)
        gsum, miss = _owned_token(
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
            rank,
            rank + 1,
            K,
            B,
            NG,
            P,
            WBN,
            False,
            PTX,
        )
        missing = missing | miss
        _publish_group(gsum, t64, region, rank, table_ptr, gsum_off16, cols, cmask, H, NG, P)
        i += 1
    # phase 3: every rank adds the group sums in ascending group order
    mine32 = D.peer_base(table_ptr, rank, gsum_off16, 32)
    empty32 = D.empty_row(BLOCK_H, 32)
    i = 0
    while (i < n_mine) & (missing == 0):
        t64 = (pid + i * G).to(tl.int64)
        out = tl.zeros([BLOCK_H], tl.float32)
        for j in tl.static_range(NG):
            ptr = mine32 + ((region + t64) * NG + j) * H + cols
            bits, pending = D.poll_row(ptr, cmask, deadline, clock_ptr, 32, PTX)
            tl.store(ptr, empty32, mask=cmask)
            missing = missing | tl.where(pending != 0, 1 << j, 0)
            out = out + bits.to(tl.float32, bitcast=True)
        o = D.as_bits(round_to(out, tl.bfloat16, PTX), 16)
        _store_out(out_ptr, out_st, t64, o, cols, cmask)
        i += 1
    _finish_oneshot(ctrl_ptr, table_ptr, rank, gen, missing, M, pid, G, P, USE_PDL, PTX)


# ----------------------------------------------------------------------------- TP gathered
@triton.jit(do_not_specialize=["M", "R"])
def _tp_gathered_kernel(
    g_ptr,
    w_ptr,
    idx_ptr,
    nw_ptr,
    out_ptr,
    w_st,
    idx_st,
    out_st,
    M,
    R,
    H,
    Hf,
    eps,
    gain_center,
    P: tl.constexpr,
    K: tl.constexpr,
    B: tl.constexpr,
    NG: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WBN: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    """``g_ptr``: every rank's rows, contiguous ``[P, R, H]``."""
    pid, G, cols, cmask, g = _prologue(nw_ptr, gain_center, H, BLOCK_H, USE_PDL)
    t = pid
    while t < M:
        t64 = t.to(tl.int64)
        out = tl.zeros([BLOCK_H], tl.float32)
        gsum = tl.zeros([BLOCK_H], tl.float32)
        for k in tl.static_range(K):
            if k > 0:
                if k % B == 0:
                    out = out + gsum
                    gsum = tl.zeros([BLOCK_H], tl.float32)
            p, valid = _route(idx_ptr, idx_st, t64, k, R)
            if valid:
                acc = tl.zeros([BLOCK_H], tl.float32)
                for q in tl.static_range(P):
                    v = _load_row(g_ptr + (q * R).to(tl.int64) * H, H, p, cols, cmask)
                    acc = acc + widen_f32(v, PTX)
                y = _slot_y(acc, g, cmask, Hf, eps, WBN, PTX)
                gsum = tl.fma(y, _weight(w_ptr, w_st, t64, k), gsum)
        out = out + gsum
        o = D.as_bits(round_to(out, tl.bfloat16, PTX), 16)
        _store_out(out_ptr, out_st, t64, o, cols, cmask)
        t += G


# ----------------------------------------------------------------------------- launchers
def _common(h: int, use_pdl: bool) -> tuple[dict, int]:
    tile = comm_tile(h, 1)
    kw = dict(
        BLOCK_H=tile.block,
        USE_PDL=bool(use_pdl),
        PTX=not interpreter_active(),
        num_warps=tile.num_warps,
    )
    if use_pdl:
        kw["launch_pdl"] = True
    return kw, tile.num_warps


def launch_tp_moe_finalize_rmsnorm(
    xws,
    algorithm: str,
    rows,
    weights,
    idx,
    norm_weight,
    out,
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
    use_pdl: bool = False,
    gathered=None,
) -> None:
    """Run tp_moe_finalize_rmsnorm on ``xws``
    (:class:`moefuse.comm.expert_norm.api.ExpertNormWorkspace`) with
    ``algorithm`` in "slot_oneshot" | "expert_owner" | "token_owner" | "staged" | "torch"
    (``gathered`` [P, R, H]).

    Peer algorithms run in chunks of at most ``xws.capacity`` tokens (one launch each; a
    token's math does not depend on its chunk). Nothing is validated here."""
    m, k = idx.shape
    if m == 0:
        return
    ws = xws.ar
    h = norm_weight.shape[0]
    p = ws.world_size
    block = xws.group_size
    ng = -(-k // block)
    common, warps = _common(h, use_pdl)
    consts = dict(K=k, B=block, NG=ng, WBN=bool(weight_before_norm), **common)
    args = (rows, weights, idx, norm_weight, out, eps, gain_center, p, consts)
    if algorithm == "torch":
        grid = (max(1, min(m, ws.max_ctas(warps))),)
        launch(
            _tp_gathered_kernel,
            grid,
            gathered,
            weights,
            idx,
            norm_weight,
            out,
            weights.stride(0),
            idx.stride(0),
            out.stride(0),
            m,
            rows.shape[0],
            h,
            float(h),
            float(eps),
            float(gain_center),
            P=p,
            **consts,
        )
    elif algorithm == "staged":
        _launch_staged(xws, *args)
    elif algorithm == "slot_oneshot":
        _launch_slot_oneshot(xws, *args)
    elif algorithm in ("expert_owner", "token_owner"):
        _launch_owner(xws, algorithm, *args)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")


def _launch_staged(xws, rows, weights, idx, norm_weight, out, eps, gain_center, p, consts):
    """Algorithm "staged": chunks of ``xws.capacity`` tokens, one CTA per SM at most (and per
    flag slot)."""
    ws = xws.ar
    m = idx.shape[0]
    h = norm_weight.shape[0]
    for c0 in range(0, m, xws.capacity):
        mc = min(xws.capacity, m - c0)
        ws.refresh_clock()
        grid = (max(1, min(mc, ws.num_sms, ws.num_flag_slots)),)
        launch(
            _tp_staged_kernel,
            grid,
            rows,
            weights[c0:],
            idx[c0:],
            norm_weight,
            out[c0:],
            (rows.stride(0), weights.stride(0), idx.stride(0), out.stride(0)),
            ws.table,
            ws.offset16("flags"),
            ws.offset16("xn_stage"),
            ws.offset16("xn_gather"),
            ws.ctrl,
            ws.clock,
            mc,
            rows.shape[0],
            h,
            float(h),
            ws.rank,
            float(eps),
            float(gain_center),
            ws.timeout_us,
            P=p,
            PP=triton.next_power_of_2(p),
            NSLOT=ws.num_flag_slots,
            **consts,
        )


def _launch_owner(
    xws, algorithm, rows, weights, idx, norm_weight, out, eps, gain_center, p, consts
):
    """Algorithms "expert_owner" and "token_owner": chunks of ``xws.capacity`` tokens."""
    ws = xws.ar
    m = idx.shape[0]
    h = norm_weight.shape[0]
    if algorithm == "expert_owner":
        kernel, res_off = _tp_expert_owner_kernel, ws.offset16("xn_gsum")
    else:
        kernel, res_off = _tp_token_owner_kernel, ws.offset16("xn_out")
    cap = xws.capacity
    for c0 in range(0, m, cap):
        mc = min(cap, m - c0)
        ws.refresh_clock()
        # one CTA per SM: ~170 registers per thread (ptxas, sm_90a, H = 4096, K = 8) leave room
        # for one 8-warp CTA, and a CTA's peer (same index on every rank) must be resident
        grid = (max(1, min(mc, ws.num_sms)),)
        launch(
            kernel,
            grid,
            rows,
            weights[c0:],
            idx[c0:],
            norm_weight,
            out[c0:],
            rows.stride(0),
            weights.stride(0),
            idx.stride(0),
            out.stride(0),
            ws.table,
            ws.offset16("xn_rows"),
            res_off,
            ws.ctrl,
            ws.clock,
            mc,
            rows.shape[0],
            h,
            float(h),
            ws.rank,
            cap,
            float(eps),
            float(gain_center),
            ws.timeout_us,
            P=p,
            **consts,
        )


def _launch_slot_oneshot(
    xws, rows, weights, idx, norm_weight, out, eps, gain_center, p, consts
) -> None:
    """Algorithm "slot_oneshot": chunks of ``xws.slot_capacity`` tokens (the local ``xn_xdec``
    rows); one CTA per (token, slot) row up to one CTA per SM (CTA j waits on CTA j of the peers,
    which must be resident; the interpreter runs CTAs one after another, 2 "SMs" on the CPU)."""
    ws = xws.ar
    m, k = idx.shape
    r = rows.shape[0]
    h = norm_weight.shape[0]
    for c0 in range(0, m, xws.slot_capacity):
        mc = min(xws.slot_capacity, m - c0)
        ws.refresh_clock()
        grid = (max(1, min(mc * k, ws.num_sms)),)
        split = split_fold(mc * k, grid[0])  # (the same on every rank: M, K, SMs, environment)
        launch(
            _tp_slot_oneshot_kernel,
            grid,
            rows,
            weights[c0:],
            idx[c0:],
            norm_weight,
            out[c0:],
            (rows.stride(0), weights.stride(0), idx.stride(0), out.stride(0)),
            (
                ws.table,
                ws.offset16("xn_rows"),
                ws.offset16("xn_xdec"),
                ws.offset16("xn_rdec"),
                ws.offset16("xn_cnt"),
                ws.ctrl,
                ws.clock,
            ),
            mc,
            r,
            h,
            float(h),
            ws.rank,
            xws.capacity,
            float(eps),
            float(gain_center),
            ws.timeout_us,
            P=p,
            SPLIT_FOLD=split,
            KP=triton.next_power_of_2(k),
            **consts,
        )


SPLIT_FOLD_ENV = "MOEFUSE_TP_SPLIT_FOLD"


def split_fold(n_rows: int, grid: int) -> bool:
    """Whether slot_oneshot's CTAs fold their token together (each a column slice, after
    waiting for the token's K rows: :func:`_await_token`) instead of the last CTA folding the
    whole row: only when every CTA has one row (``n_rows <= grid``: a token's K CTAs are all
    resident) and on the GPU (the interpreter runs CTAs one after another, so a CTA cannot wait
    for a later one); ``MOEFUSE_TP_SPLIT_FOLD=0`` (the same on every rank) turns it off.

    MEASURED on one H200 as two loopback ranks (PDL on, 4 alternating rounds,
    notes/comm-expert-norm.md "Split fold"), µs one folding CTA -> split fold, K = 8: H = 4096
    M = 1 6.97-9.43 -> 5.35-5.58, M = 8 7.51-8.43 -> 6.83-7.04; H = 7168 M = 1 8.90-9.26 ->
    6.99-7.40, M = 8 9.80-10.13 -> 9.74-9.89. The hop it shortens (one CTA reading the K
    normalized rows, 64 KiB at H = 4096, from L2) is local on 2 x H200 as well."""
    return knobs.get(SPLIT_FOLD_ENV) and n_rows <= grid and not interpreter_active()
