"""Triton kernels of ``moe_finalize_rmsnorm_allreduce`` (EP) and their launcher.

* ``_ep_oneshot_kernel`` — one kernel: this rank's partial (local routes only, each normalized
  and weighted, fma chain from +0.0, rounded once to BF16) is pushed into the all-reduce
  workspace's Lamport slots and summed with the peers' partials in rank order (FP32, one
  rounding) — the protocol, slots, generation and helpers of ``comm.triton._oneshot_kernel``
  pattern 0, so both can share a workspace.
* ``_ep_partial_kernel`` — the partial alone (-0.0 written as +0.0); the two-shot and
  torch.distributed paths then run the existing all-reduce kernels on it. Same bits.

Non-local routes (index < 0 or >= R) are never loaded, normalized or weighted. The per-slot math
(:func:`moefuse.comm.expert_norm.slot_math._expert_norm`) is shared with the TP kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moefuse import knobs
from moefuse._device import round_to, widen_f32
from moefuse._fastpath import launch
from moefuse.comm import device as D
from moefuse.comm.expert_norm import ALLREDUCE
from moefuse.comm.expert_norm.slot_math import (
    _expert_norm,
    _load_row,
    _prologue,
    _route,
    _store_out,
    _weight,
)
from moefuse.comm.expert_norm.tp_kernels import _common


@triton.jit
def _ep_partial_row(
    src,
    t64,
    R,
    g,
    cols,
    cmask,
    Hf,
    eps,
    K: tl.constexpr,
    WBN: tl.constexpr,
    PTX: tl.constexpr,
    PREFETCH: tl.constexpr = False,
):
    """This rank's FP32 partial of token t: fma chain over its local valid slots of y_k * w_k.
    ``src`` = (rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st): the expert rows, the routing
    weights and the index map, with their row strides.
    ``PREFETCH``: the K slots' rows and weights are requested first (masked: a non-local slot's
    row and weight are never read), so their memory latency overlaps instead of adding up slot
    by slot (more registers: 191 against 106 for the one-shot kernel at H = 4096, sm_90a);
    then each local slot is normalized and folded in slot order. Same values, same chain."""
    rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st = src
    if not PREFETCH:
        acc = tl.zeros(cols.shape, tl.float32)
        for k in tl.static_range(K):
            p, valid = _route(idx_ptr, idx_st, t64, k, R)
            if valid:
                x = widen_f32(_load_row(rows_ptr, row_st, p, cols, cmask), PTX)
                y = _expert_norm(x, g, cmask, Hf, eps, WBN)
                acc = tl.fma(y, _weight(w_ptr, w_st, t64, k), acc)
        return acc
    valids = ()
    xs = ()
    ws = ()
    for k in tl.static_range(K):
        p, valid = _route(idx_ptr, idx_st, t64, k, R)
        valids = valids + (valid,)
        xs = xs + (tl.load(rows_ptr + p * row_st + cols, mask=cmask & valid, other=0.0),)
        ws = ws + (tl.load(w_ptr + t64 * w_st + k, mask=valid, other=0.0).to(tl.float32),)
    acc = tl.zeros(cols.shape, tl.float32)
    for k in tl.static_range(K):
        if valids[k]:
            y = _expert_norm(widen_f32(xs[k], PTX), g, cmask, Hf, eps, WBN)
            acc = tl.fma(y, ws[k], acc)
    return acc


@triton.jit(do_not_specialize=["M", "R"])
def _ep_partial_kernel(
    rows_ptr,
    w_ptr,
    idx_ptr,
    nw_ptr,
    out_ptr,
    row_st,
    w_st,
    idx_st,
    out_st,
    M,
    R,
    H,
    Hf,
    eps,
    gain_center,
    K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WBN: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
    PREFETCH: tl.constexpr = False,
):
    """This rank's partial ``scrub(bf16(...))`` into ``out`` (two-shot and torch paths)."""
    pid, G, cols, cmask, g = _prologue(nw_ptr, gain_center, H, BLOCK_H, USE_PDL)
    src = (rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st)
    t = pid
    while t < M:
        t64 = t.to(tl.int64)
        acc = _ep_partial_row(src, t64, R, g, cols, cmask, Hf, eps, K, WBN, PTX, PREFETCH)
        bits = D.as_bits(round_to(acc, tl.bfloat16, PTX), 16)
        _store_out(out_ptr, out_st, t64, bits, cols, cmask)
        t += G


@triton.jit
def _receive_row(
    missing,
    prev,
    tp,
    mine,
    region,
    rank,
    cols,
    cmask,
    H,
    wait,
    out_ptr,
    out_st,
    T: tl.constexpr,
    P: tl.constexpr,
    PTX: tl.constexpr,
):
    """Rank-order FP32 sum of row ``tp`` (this rank's ``prev`` in its place, the peers' rows
    polled from their Lamport slots of ``region`` in ``mine``; ``wait`` = (deadline, clock_ptr,
    empty row)), rounded to T into ``out``. Returns ``missing`` with the late peers' bits set."""
    deadline, clock_ptr, empty = wait
    s, miss = D.receive_sum(
        prev,
        tp,
        mine,
        region,
        rank,
        cols,
        cmask,
        H,
        deadline,
        clock_ptr,
        empty,
        T,
        P,
        16,
        True,
        PTX,
    )
    missing = missing | miss
    tl.store(out_ptr + tp * out_st + cols, round_to(s, T, PTX), mask=cmask)
    return missing


@triton.jit(do_not_specialize=["M", "R", "rank"])
def _ep_oneshot_kernel(
    rows_ptr,
    w_ptr,
    idx_ptr,
    nw_ptr,
    out_ptr,
    row_st,
    w_st,
    idx_st,
    out_st,
    table_ptr,
    lam_off16,
    ctrl_ptr,
    clock_ptr,
    M,
    R,
    H,
    Hf,
    rank,
    cap,
    eps,
    gain_center,
    timeout_us,
    P: tl.constexpr,
    K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    WBN: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
    PREFETCH: tl.constexpr = False,
):
    """Partial + Lamport all-reduce in one kernel, on the all-reduce workspace's one-shot slots
    and generation (same protocol and bits as ``comm.triton._oneshot_kernel`` pattern 0, whose
    ``D.push_vals`` / ``D.receive_sum`` it uses): iteration i computes and pushes row i, then
    receives row i-1 (its own partial kept in registers), so NVLink traffic overlaps the norms."""
    T: tl.constexpr = out_ptr.dtype.element_ty
    pid, G, cols, cmask, g = _prologue(nw_ptr, gain_center, H, BLOCK_H, USE_PDL)
    deadline, gen, n_mine, region = D.oneshot_state(
        ctrl_ptr, table_ptr, rank, clock_ptr, timeout_us, M, pid, G, cap, P, PTX
    )
    mine = D.peer_base(table_ptr, rank, lam_off16, 16)
    empty = D.empty_row(BLOCK_H, 16)
    src = (rows_ptr, row_st, w_ptr, w_st, idx_ptr, idx_st)
    wait = (deadline, clock_ptr, empty)
    prev = tl.zeros([BLOCK_H], T)
    missing = 0
    i = 0
    while (i <= n_mine) & (missing == 0):
        x = prev
        if i < n_mine:
            t = pid + i * G
            acc = _ep_partial_row(
                src, t.to(tl.int64), R, g, cols, cmask, Hf, eps, K, WBN, PTX, PREFETCH
            )
            x = round_to(acc, T, PTX)
            D.push_vals(x, t, cols, cmask, table_ptr, lam_off16, region, rank, H, P, 16)
        if i > 0:
            tp = (pid + (i - 1) * G).to(tl.int64)
            missing = _receive_row(
                missing,
                prev,
                tp,
                mine,
                region,
                rank,
                cols,
                cmask,
                H,
                wait,
                out_ptr,
                out_st,
                T,
                P,
                PTX,
            )
        prev = x
        i += 1
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


# ----------------------------------------------------------------------------- launcher
def launch_moe_finalize_rmsnorm_allreduce(
    ws,
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
    gather=None,
) -> None:
    """moe_finalize_rmsnorm_allreduce on the all-reduce workspace ``ws``. "oneshot": one fused
    kernel (partial + Lamport all-reduce); "twoshot" / "torch": the local partial kernel, then the
    all-reduce kernel of that algorithm (``gather(partial)`` -> [P, M, H] for torch). Same bits."""
    m, k = idx.shape
    if m == 0:
        return
    h = norm_weight.shape[0]
    common, warps = _common(h, use_pdl)
    if algorithm == "oneshot":
        ws.refresh_clock()
        grid = (max(1, min(m, ws.num_sms)),)
        launch(
            _ep_oneshot_kernel,
            grid,
            rows,
            weights,
            idx,
            norm_weight,
            out,
            rows.stride(0),
            weights.stride(0),
            idx.stride(0),
            out.stride(0),
            ws.table,
            ws.offset16("lamport"),
            ws.ctrl,
            ws.clock,
            m,
            rows.shape[0],
            h,
            float(h),
            ws.rank,
            ws.oneshot_max_tokens,
            float(eps),
            float(gain_center),
            ws.timeout_us,
            P=ws.world_size,
            K=k,
            WBN=bool(weight_before_norm),
            PREFETCH=prefetch_rows(m, grid[0]),
            **common,
        )
        return
    partial = torch.empty((m, h), dtype=torch.bfloat16, device=out.device)
    grid = (max(1, min(m, ws.max_ctas(warps))),)
    launch(
        _ep_partial_kernel,
        grid,
        rows,
        weights,
        idx,
        norm_weight,
        partial,
        rows.stride(0),
        weights.stride(0),
        idx.stride(0),
        partial.stride(0),
        m,
        rows.shape[0],
        h,
        float(h),
        float(eps),
        float(gain_center),
        K=k,
        WBN=bool(weight_before_norm),
        PREFETCH=prefetch_rows(m, grid[0]),
        **common,
    )
    gathered = gather(partial) if algorithm == "torch" else None
    ALLREDUCE[0](
        ws,
        algorithm,
        0,
        partial,
        None,
        None,
        out=out,
        fp32_acc=True,
        use_pdl=use_pdl,
        gathered=gathered,
    )


PREFETCH_ENV = "MOEFUSE_EP_PREFETCH_ROWS"


def prefetch_rows(m: int, grid: int) -> bool:
    """Whether the EP kernels request a token's K rows before normalizing any (``PREFETCH`` of
    :func:`_ep_partial_row`): when every CTA has one token (``m <= grid``: latency-bound, one
    token per SM) unless ``MOEFUSE_EP_PREFETCH_ROWS=0``; ``=1`` forces it at any M (the same on
    every rank). Larger M keep the lighter kernel (106 registers instead of 191 at H = 4096: two
    CTAs per SM instead of one; at H = 7168 the prefetching one-shot spills 76 bytes).

    MEASURED on one H200 as two loopback ranks (PDL on, 3 alternating rounds,
    notes/comm-expert-norm.md "EP rows first"), µs per rank, rows first / slot by slot, P = 2,
    K = 8 (4 local): H = 4096 M = 1 5.37-5.43 / 8.99-9.19, M = 8 6.23-6.48 / 7.16-10.59, M = 64
    7.0-7.1 / 7.95-8.01; H = 7168 M = 1 7.68-7.88 / 8.12-8.25, M = 8 8.39-8.42 / 8.65-8.92,
    M = 64 9.34-9.56 / 9.31-9.59 (equal)."""
    setting = knobs.get(PREFETCH_ENV)
    return m <= grid if setting is None else setting
