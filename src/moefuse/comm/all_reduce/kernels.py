"""Triton kernels of the all-reduce fusions (spec: the common model and the all-reduce fusion) and
their launcher.

Three algorithms, one epilogue (:func:`moefuse.comm.device.epilogue_row`), same bits:

* ``_oneshot_kernel`` — Lamport. Every CTA pushes its token rows (payload -0.0 scrubbed to +0.0)
  into its slot ``[gen, t, sender]`` of every peer's buffer with plain 16-byte stores and, one row
  behind, volatile-polls the P-1 peer slots of its own buffer until no element is the -0.0
  sentinel, re-arms each slot as soon as it has consumed it (so the amount to clear is always
  exactly what was used, never a stale size), sums the ranks in ascending order (its own row from
  its own input) and runs the epilogue. Three generations of slots; the last CTA to arrive (atomic
  counter) advances the device-resident generation, so nothing about it is baked into a graph.
* ``_twoshot_kernel`` — reduce-scatter + all-gather with unicast stores only. Rank o owns tokens
  ``[o*c, (o+1)*c)``, ``c = ceil(M/P)``. Phase 1: push every non-owned row into its owner's
  staging slot; release-flag every peer; acquire-wait for theirs. Phase 2: the owner sums its rows
  (own input + P-1 staging slots, rank order), rounds once, pushes the sum into every peer's
  gather buffer and runs the epilogue of those rows itself; flag; wait. Phase 3: every rank runs
  the epilogue of the other ranks' rows from its local gather buffer. Flags are per (phase, CTA
  index, sender) and carry a device-resident epoch; CTA ``j`` only ever waits on CTA ``j`` of the
  peers, so no CTA waits on another CTA of its own launch (Triton's interpreter runs them one
  after another) and the grid is identical on all ranks.
* ``_gathered_kernel`` — the torch.distributed path: the inputs of all ranks were all-gathered by
  NCCL/gloo into ``[P, M, H]``; sum in rank order, epilogue.

Every wait is bounded (``timeout_us``): a CTA that gives up records the missing ranks (device
status word + the host status block the host reads before every call, no sync) and tells the
peers it gave up; a later launch on this rank, or on a peer that sees the notice, does nothing
(``moefuse.comm.device.healthy``; see ``moefuse.comm.faults``).
Token counts are run-time arguments (``do_not_specialize``), tiles depend on H only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import round_to
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active
from moefuse.comm import device as D
from moefuse.comm.tiles import comm_tile, oneshot_variant


@triton.jit
def _push_row(x_ptr, x_st, t, cols, cmask, table_ptr, lam_off16, region, rank, H,
              P: tl.constexpr, BITS: tl.constexpr, dists=None):  # fmt: skip
    """Load row ``t`` of this rank's input and push it (:func:`moefuse.comm.device.push_vals`)."""
    x = tl.load(x_ptr + t.to(tl.int64) * x_st + cols, mask=cmask, other=0.0)
    D.push_vals(x, t, cols, cmask, table_ptr, lam_off16, region, rank, H, P, BITS, dists)


@triton.jit(do_not_specialize=["rows", "rank"])
def _oneshot_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, rout_ptr, nout_ptr, q_ptr, sf_ptr, scale_ptr,
    strides, table_ptr, lam_off16, ctrl_ptr, clock_ptr,
    rows, H, Hf, rank, cap, n_kcols, norm, timeout_us,
    P: tl.constexpr, BLOCK_H: tl.constexpr, BITS: tl.constexpr, PATTERN: tl.constexpr,
    WRITE_NORM: tl.constexpr, LAYOUT: tl.constexpr, KP_BLOCK: tl.constexpr,
    FP32_ACC: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """One-shot all-reduce (+ residual, RMSNorm, FP8 / NVFP4) over the Lamport slots.
    ``strides`` = (x_st, res_st, out_st, rout_st, nout_st, q_st) row strides, ``rows`` =
    (M, M_pad) (not specialised), ``norm`` = (eps, weight_bias)."""
    x_st, res_st, out_st, rout_st, nout_st, q_st = strides
    M, M_pad = rows
    eps, weight_bias = norm
    T: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = D.load_gain(w_ptr, cols, cmask, weight_bias, PATTERN)
    dists = D.table_dists(table_ptr, P)  # constant workspace metadata: before the wait
    if USE_PDL:
        gdc_wait()
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    deadline, gen, n_mine, region = D.oneshot_state(ctrl_ptr, table_ptr, rank, clock_ptr,
                                                   timeout_us, M, pid, G, cap, P, PTX,
                                                   dists)  # fmt: skip

    # The first row's activations stay in registers: a CTA with one row has then read all of the
    # previous kernel's data before it starts waiting, and lets dependents launch (PDL) early.
    # (Masked by pid < M, not by the status word. They still issue after the control words'
    # CTA-wide reduction, a barrier; requesting them before it measured no different on
    # 2 x H200 at M = 1 / 8 / 64 — 3.79 / 4.47 / 5.82 against 3.75 / 4.63 / 5.94 µs —
    # unlike the MoE fusions' expert rows: moefuse.comm.moe_reduction.producer._first_loads.)
    first = cmask & (pid < M)
    x0 = tl.load(x_ptr + pid.to(tl.int64) * x_st + cols, mask=first, other=0.0)
    if PATTERN != 0:
        res0 = tl.load(res_ptr + pid.to(tl.int64) * res_st + cols, mask=first, other=0.0)
        res0 = res0.to(tl.float32)
    else:
        res0 = tl.zeros([BLOCK_H], tl.float32)

    # Iteration i pushes row i and receives row i - 1: the peers pushed row i - 1 one iteration
    # earlier, so NVLink traffic of one row overlaps the local epilogue of the previous one.
    mine = D.peer_base(table_ptr, rank, lam_off16, BITS, dists)
    empty = D.empty_row(BLOCK_H, BITS)
    missing = 0
    i = 0
    while (i <= n_mine) & (missing == 0):
        if i < n_mine:
            _push_row(x_ptr, x_st, pid + i * G, cols, cmask, table_ptr, lam_off16, region, rank,
                      H, P, BITS, dists)  # fmt: skip
            if USE_PDL:
                if n_mine == 1:
                    gdc_launch_dependents()
        if i > 0:
            t = (pid + (i - 1) * G).to(tl.int64)
            if i == 1:
                x = x0
                res = res0
            else:
                x = tl.load(x_ptr + t * x_st + cols, mask=cmask, other=0.0)
                if PATTERN != 0:
                    res = tl.load(res_ptr + t * res_st + cols, mask=cmask, other=0.0)
                    res = res.to(tl.float32)
                else:
                    res = res0
            s, miss = D.receive_sum(x, t, mine, region, rank, cols, cmask, H, deadline,
                                   clock_ptr, empty, T, P, BITS, FP32_ACC, PTX)  # fmt: skip
            missing = missing | miss
            D.epilogue_row(s, res, g, t, cols, cmask, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols,
                           out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st,
                           sf_ptr, T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)  # fmt: skip
        i += 1
    D.oneshot_finish(ctrl_ptr, table_ptr, rank, gen, missing, sf_ptr, M, M_pad, n_kcols, pid, G,
                    P, PATTERN, LAYOUT, KP_BLOCK, USE_PDL, PTX)  # fmt: skip


# ----------------------------------------------------------------------------- one-shot, prefetch
@triton.jit
def _load_row(x_ptr, res_ptr, x_st, res_st, t, M, cols, cmask, PATTERN: tl.constexpr):
    """Row ``t``'s input and residual in their own dtypes (zeros past M; residual zeros when
    PATTERN 0 has none). Depends on nothing but ``t``: the loads issue at once."""
    m = cmask & (t < M)
    t64 = t.to(tl.int64)
    x = tl.load(x_ptr + t64 * x_st + cols, mask=m, other=0.0)
    if PATTERN != 0:
        r = tl.load(res_ptr + t64 * res_st + cols, mask=m, other=0.0)
    else:
        r = tl.zeros_like(x)
    return x, r


@triton.jit(do_not_specialize=["rows", "rank"])
def _oneshot_prefetch_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, rout_ptr, nout_ptr, q_ptr, sf_ptr, scale_ptr,
    strides, table_ptr, lam_off16, ctrl_ptr, clock_ptr,
    rows, H, Hf, rank, cap, n_kcols, norm, timeout_us,
    P: tl.constexpr, BLOCK_H: tl.constexpr, BITS: tl.constexpr, PATTERN: tl.constexpr,
    WRITE_NORM: tl.constexpr, LAYOUT: tl.constexpr, KP_BLOCK: tl.constexpr,
    FP32_ACC: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """``_oneshot_kernel`` with a software pipeline over this CTA's rows (same slots, same
    generation protocol, same bits). Rows ``a`` (current), ``b`` (next), ``c`` (after next) live
    in registers: iteration i pushes row i+1 (loaded one iteration earlier, so the store never
    waits on a load), issues the loads of row i+2, then polls row i and runs its epilogue from
    the registers (each input row is read from HBM once, not three times). Arguments as
    ``_oneshot_kernel``'s."""
    x_st, res_st, out_st, rout_st, nout_st, q_st = strides
    M, M_pad = rows
    eps, weight_bias = norm
    T: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = D.load_gain(w_ptr, cols, cmask, weight_bias, PATTERN)
    if USE_PDL:
        gdc_wait()
    # rows pid and pid + G: issued with the control-word loads, not behind them
    xa, ra = _load_row(x_ptr, res_ptr, x_st, res_st, pid, M, cols, cmask, PATTERN)
    xb, rb = _load_row(x_ptr, res_ptr, x_st, res_st, pid + G, M, cols, cmask, PATTERN)
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    deadline, gen, n_mine, region = D.oneshot_state(ctrl_ptr, table_ptr, rank, clock_ptr,
                                                   timeout_us, M, pid, G, cap, P, PTX)  # fmt: skip
    if n_mine > 0:
        D.push_vals(xa, pid, cols, cmask, table_ptr, lam_off16, region, rank, H, P, BITS)
        if USE_PDL:
            if n_mine == 1:  # every input of the previous kernel is in registers
                gdc_launch_dependents()

    mine = D.peer_base(table_ptr, rank, lam_off16, BITS)
    empty = D.empty_row(BLOCK_H, BITS)
    missing = 0
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if i + 1 < n_mine:
            D.push_vals(xb, t + G, cols, cmask, table_ptr, lam_off16, region, rank, H, P, BITS)
        xc, rc = _load_row(x_ptr, res_ptr, x_st, res_st, t + 2 * G, M, cols, cmask, PATTERN)
        t64 = t.to(tl.int64)
        s, miss = D.receive_sum(xa, t64, mine, region, rank, cols, cmask, H, deadline, clock_ptr,
                               empty, T, P, BITS, FP32_ACC, PTX)  # fmt: skip
        missing = missing | miss
        D.epilogue_row(s, ra.to(tl.float32), g, t64, cols, cmask, H, Hf, eps, inv_scale, gs,
                       rcp_gs, n_kcols, out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st,
                       q_ptr, q_st, sf_ptr, T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)
        xa, ra, xb, rb = xb, rb, xc, rc
        i += 1
    D.oneshot_finish(ctrl_ptr, table_ptr, rank, gen, missing, sf_ptr, M, M_pad, n_kcols, pid, G,
                    P, PATTERN, LAYOUT, KP_BLOCK, USE_PDL, PTX)  # fmt: skip


# ----------------------------------------------------------------------------- two-shot
@triton.jit
def _scatter_to_owners(x_ptr, x_st, cols, cmask, pid, G, n_mine, chunk, rank, chunk_cap,
                       table_ptr, stage_off16, H, BITS: tl.constexpr):  # fmt: skip
    """Two-shot phase 1: push this CTA's rows (``pid + i * G``, ``i < n_mine``) that another
    rank owns (``t // chunk``) into that owner's staging slot ``[rank]``."""
    i = 0
    while i < n_mine:
        t = pid + i * G
        o = t // chunk
        if o != rank:
            t64 = t.to(tl.int64)
            x = tl.load(x_ptr + t64 * x_st + cols, mask=cmask, other=0.0)
            row = rank * chunk_cap + (t - o * chunk)
            dst = D.peer_base(table_ptr, o, stage_off16, BITS) + row.to(tl.int64) * H + cols
            tl.store(dst, D.as_bits(x, BITS), mask=cmask)
        i += 1


@triton.jit(do_not_specialize=["rows", "rank"])
def _twoshot_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, rout_ptr, nout_ptr, q_ptr, sf_ptr, scale_ptr,
    strides, ws, rows, H, Hf, rank, chunk_cap, n_kcols, norm, timeout_us,
    P: tl.constexpr, PP: tl.constexpr, NSLOT: tl.constexpr, BLOCK_H: tl.constexpr,
    BITS: tl.constexpr, PATTERN: tl.constexpr, WRITE_NORM: tl.constexpr, LAYOUT: tl.constexpr,
    KP_BLOCK: tl.constexpr, FP32_ACC: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """Two-shot all-reduce (reduce-scatter to the row owners, all-gather of the sums) with the
    one-shot's epilogues. ``strides``, ``rows``, ``norm`` as ``_oneshot_kernel``'s; ``ws`` =
    (table_ptr, flags_off16, stage_off16, gather_off16, ctrl_ptr, clock_ptr)."""
    x_st, res_st, out_st, rout_st, nout_st, q_st = strides
    M, M_pad = rows
    eps, weight_bias = norm
    table_ptr, flags_off16, stage_off16, gather_off16, ctrl_ptr, clock_ptr = ws
    T: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = D.load_gain(w_ptr, cols, cmask, weight_bias, PATTERN)
    if USE_PDL:
        gdc_wait()
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    deadline = D.wait_bound(clock_ptr, timeout_us, table_ptr, rank, PTX)
    epoch = tl.load(ctrl_ptr + D.CTRL_EPOCH)
    healthy = D.healthy(ctrl_ptr, table_ptr, rank, P, PTX)
    n_mine = tl.where(healthy, (M - pid + G - 1) // G, 0)
    chunk = (M + P - 1) // P  # tokens per owner

    # phase 1: scatter non-owned rows to their owner's staging slot [rank]
    _scatter_to_owners(x_ptr, x_st, cols, cmask, pid, G, n_mine, chunk, rank, chunk_cap,
                       table_ptr, stage_off16, H, BITS)  # fmt: skip
    missing = 0
    if healthy:
        D.signal_peers(table_ptr, flags_off16, pid, rank, epoch, P, PP)
        missing = D.wait_peers(table_ptr, flags_off16, pid, rank, epoch, deadline, clock_ptr,
                               P, PP, PTX)  # fmt: skip

    # phase 2: reduce the owned rows (rank order) and push the sum into every rank's gather buffer
    stage = D.peer_base(table_ptr, rank, stage_off16, BITS)
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t // chunk == rank:
            t64 = t.to(tl.int64)
            acc = tl.zeros([BLOCK_H], tl.float32)
            for q in tl.static_range(P):
                if q == rank:
                    v = tl.load(x_ptr + t64 * x_st + cols, mask=cmask, other=0.0).to(tl.float32)
                else:
                    row = (q * chunk_cap + (t - rank * chunk)).to(tl.int64)
                    bits = tl.load(stage + row * H + cols, mask=cmask, other=0,
                                   cache_modifier=".cg")  # fmt: skip
                    v = bits.to(T, bitcast=True).to(tl.float32)
                acc = D.accumulate(acc, v, T, FP32_ACC, PTX)
            s = round_to(acc, T, PTX)
            for q in tl.static_range(P):
                if q != rank:
                    dst = D.peer_base(table_ptr, q, gather_off16, BITS) + t64 * H + cols
                    tl.store(dst, D.as_bits(s, BITS), mask=cmask)
            # the owner finishes its own rows now, with the sum still in registers
            if PATTERN != 0:
                res = tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0)
                res = res.to(tl.float32)
            else:
                res = acc
            D.epilogue_row(s.to(tl.float32), res, g, t64, cols, cmask, H, Hf, eps, inv_scale, gs,
                           rcp_gs, n_kcols, out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st,
                           q_ptr, q_st, sf_ptr, T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)
        i += 1
    if healthy & (missing == 0):
        D.signal_peers(table_ptr, flags_off16, NSLOT + pid, rank, epoch, P, PP)
        missing = D.wait_peers(table_ptr, flags_off16, NSLOT + pid, rank, epoch, deadline,
                               clock_ptr, P, PP, PTX)  # fmt: skip

    # phase 3: epilogue on this CTA's rows owned by other ranks, from the local gather buffer
    gathered = D.peer_base(table_ptr, rank, gather_off16, BITS)
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t // chunk != rank:
            t64 = t.to(tl.int64)
            bits = tl.load(gathered + t64 * H + cols, mask=cmask, other=0, cache_modifier=".cg")
            s = bits.to(T, bitcast=True).to(tl.float32)
            if PATTERN != 0:
                res = tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0)
                res = res.to(tl.float32)
            else:
                res = s
            D.epilogue_row(s, res, g, t64, cols, cmask, H, Hf, eps, inv_scale, gs, rcp_gs,
                           n_kcols, out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr,
                           q_st, sf_ptr, T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)  # fmt: skip
        i += 1
    last = D.finish(ctrl_ptr, table_ptr, rank, D.CTRL_ARRIVE_2S, missing, sf_ptr, M, M_pad,
                   n_kcols, pid, G, P, PATTERN, LAYOUT, KP_BLOCK, USE_PDL, PTX)  # fmt: skip
    if last:
        tl.store(ctrl_ptr + D.CTRL_ARRIVE_2S, 0)
        tl.store(ctrl_ptr + D.CTRL_EPOCH, epoch % D.EPOCH_WRAP + 1)


# ----------------------------------------------------------------------------- gathered (torch)
@triton.jit(do_not_specialize=["M", "M_pad"])
def _gathered_kernel(
    g_ptr, res_ptr, w_ptr, out_ptr, rout_ptr, nout_ptr, q_ptr, sf_ptr, scale_ptr,
    res_st, out_st, rout_st, nout_st, q_st,
    M, M_pad, H, Hf, n_kcols, eps, weight_bias,
    P: tl.constexpr, BLOCK_H: tl.constexpr, PATTERN: tl.constexpr, WRITE_NORM: tl.constexpr,
    LAYOUT: tl.constexpr, KP_BLOCK: tl.constexpr, FP32_ACC: tl.constexpr, USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):  # fmt: skip
    """``g_ptr``: the all-gathered partials, contiguous ``[P, M, H]``."""
    T: tl.constexpr = g_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = D.load_gain(w_ptr, cols, cmask, weight_bias, PATTERN)
    if USE_PDL:
        gdc_wait()
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    t = pid
    while t < M:
        t64 = t.to(tl.int64)
        acc = tl.zeros([BLOCK_H], tl.float32)
        for q in tl.static_range(P):
            v = tl.load(g_ptr + (q * M + t64) * H + cols, mask=cmask, other=0.0).to(tl.float32)
            acc = D.accumulate(acc, v, T, FP32_ACC, PTX)
        s = round_to(acc, T, PTX).to(tl.float32)
        if PATTERN != 0:
            res = tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            res = s
        D.epilogue_row(s, res, g, t64, cols, cmask, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols,
                       out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr,
                       T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)  # fmt: skip
        t += G
    if USE_PDL:
        gdc_launch_dependents()
    if PATTERN == 3:
        D.zero_scale_rows(sf_ptr, M + pid, M_pad, G, n_kcols, LAYOUT, KP_BLOCK)


# ----------------------------------------------------------------------------- launcher
_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


def launch_allreduce_fusion(ws, algorithm: str, pattern: int, x, residual, weight, *, out=None,
                            residual_out=None, norm_out=None, quant_out=None, scale_out=None,
                            scale=None, layout: int = 0, m_pad: int = 0, eps: float = 1e-6,
                            weight_bias: float = 0.0, fp32_acc: bool = True,
                            use_pdl: bool = False, gathered=None) -> None:  # fmt: skip
    """Run one all-reduce fusion on ``ws`` with ``algorithm`` in "oneshot" | "twoshot" | "torch".

    ``pattern``: 0 all-reduce (``out``), 1 residual + RMSNorm, 2 + FP8, 3 + NVFP4 (``norm_out`` is
    written in 1, and in 2/3 when given). ``gathered`` ([P, M, H], "torch" only) holds the
    all-gathered partials. Outputs must be allocated by the caller; nothing is validated here.
    """
    m, h = x.shape
    if m == 0:
        return
    tile = comm_tile(h, pattern)
    ptx = not interpreter_active()
    dummy = x
    # unused pointer arguments get a real tensor (never dereferenced: constexpr-disabled code)
    res = residual if residual is not None else dummy
    w = weight if weight is not None else dummy
    o = out if out is not None else dummy
    ro = residual_out if residual_out is not None else dummy
    no = norm_out if norm_out is not None else dummy
    qo = quant_out.view(torch.uint8) if quant_out is not None else dummy
    so = scale_out.view(torch.uint8) if scale_out is not None else dummy
    sc = scale if scale is not None else dummy
    write_norm = pattern == 1 or (pattern in (2, 3) and norm_out is not None)
    n_kcols = 0
    if pattern == 3:
        n_kcols = scale_out.shape[-1] if scale_out.dim() == 2 else 0
    strides = (res.stride(0), o.stride(0), ro.stride(0), no.stride(0), qo.stride(0))
    common = dict(
        BLOCK_H=tile.block, PATTERN=pattern, WRITE_NORM=write_norm, LAYOUT=layout,
        KP_BLOCK=tile.kp_block, FP32_ACC=bool(fp32_acc), USE_PDL=bool(use_pdl), PTX=ptx,
        num_warps=tile.num_warps,
    )  # fmt: skip
    if use_pdl:
        common["launch_pdl"] = True
    rows = (m, max(m_pad, m))
    norm = (float(eps), float(weight_bias))
    if algorithm == "torch":
        grid = (max(1, min(m, ws.max_ctas(tile.num_warps))),)
        launch(_gathered_kernel, grid,
            gathered, res, w, o, ro, no, qo, so, sc, *strides, *rows, h, float(h), n_kcols,
            *norm, P=ws.world_size, **common,
        )  # fmt: skip
        return
    timeout_us = ws.timeout_us
    ws.refresh_clock()
    bits = _BITS[x.dtype]
    if algorithm == "oneshot":
        var = oneshot_variant(m)
        cap_ctas = ws.max_ctas(tile.num_warps)
        if var.num_warps:  # registers grow as warps shrink: assume 2 co-resident CTAs per SM
            common["num_warps"] = var.num_warps
            cap_ctas = ws.num_sms * 2
        ctas = min(-(-m // var.rows_per_cta), cap_ctas)
        kernel = _oneshot_prefetch_kernel if var.prefetch else _oneshot_kernel
        launch(kernel, (max(1, ctas),),
            x, res, w, o, ro, no, qo, so, sc, (x.stride(0), *strides),
            ws.table, ws.offset16("lamport"), ws.ctrl, ws.clock, rows, h, float(h), ws.rank,
            ws.oneshot_max_tokens, n_kcols, norm, timeout_us,
            P=ws.world_size, BITS=bits, **common,
        )  # fmt: skip
    elif algorithm == "twoshot":
        grid = (max(1, min(m, ws.max_ctas(tile.num_warps), ws.num_flag_slots)),)
        launch(_twoshot_kernel, grid,
            x, res, w, o, ro, no, qo, so, sc, (x.stride(0), *strides),
            (ws.table, ws.offset16("flags"), ws.offset16("stage"), ws.offset16("gather"),
             ws.ctrl, ws.clock),
            rows, h, float(h), ws.rank, ws.chunk_cap, n_kcols, norm, timeout_us,
            P=ws.world_size, PP=triton.next_power_of_2(ws.world_size),
            NSLOT=ws.num_flag_slots, BITS=bits, **common,
        )  # fmt: skip
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")
