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

This module holds the gathered kernel and the launcher; the one-shot kernels are in
:mod:`moefuse.comm.all_reduce.oneshot`, the two-shot kernel in
:mod:`moefuse.comm.all_reduce.twoshot`, their shared epilogue in
:mod:`moefuse.comm.all_reduce.rows`.
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
from moefuse.comm.all_reduce.oneshot import _oneshot_kernel, _oneshot_prefetch_kernel
from moefuse.comm.all_reduce.rows import _epilogue
from moefuse.comm.all_reduce.twoshot import _twoshot_kernel
from moefuse.comm.tiles import comm_tile, oneshot_variant


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
    epi = (g, cols, cmask, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols)
    outs = (out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr)
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
        _epilogue(s, res, t64, epi, outs, T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)
        t += G
    if USE_PDL:
        gdc_launch_dependents()
    if PATTERN == 3:
        D.zero_scale_rows(sf_ptr, M + pid, M_pad, G, n_kcols, LAYOUT, KP_BLOCK)


# ----------------------------------------------------------------------------- launcher
_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


def launch_allreduce_fusion(
    ws,
    algorithm: str,
    pattern: int,
    x,
    residual,
    weight,
    *,
    out=None,
    residual_out=None,
    norm_out=None,
    quant_out=None,
    scale_out=None,
    scale=None,
    layout: int = 0,
    m_pad: int = 0,
    eps: float = 1e-6,
    weight_bias: float = 0.0,
    fp32_acc: bool = True,
    use_pdl: bool = False,
    gathered=None,
) -> None:
    """Run one all-reduce fusion on ``ws`` with ``algorithm`` in "oneshot" | "twoshot" | "torch".

    ``pattern``: 0 all-reduce (``out``), 1 residual + RMSNorm, 2 + FP8, 3 + NVFP4 (``norm_out`` is
    written in 1, and in 2/3 when given). ``gathered`` ([P, M, H], "torch" only) holds the
    all-gathered partials. Outputs must be allocated by the caller; nothing is validated here.
    """
    m, h = x.shape
    if m == 0:
        return
    tile = comm_tile(h, pattern)
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
    ptrs = (res, w, o, ro, no, qo, so, sc)
    write_norm = pattern == 1 or (pattern in (2, 3) and norm_out is not None)
    n_kcols = 0
    if pattern == 3:
        n_kcols = scale_out.shape[-1] if scale_out.dim() == 2 else 0
    strides = (res.stride(0), o.stride(0), ro.stride(0), no.stride(0), qo.stride(0))
    common = dict(
        BLOCK_H=tile.block,
        PATTERN=pattern,
        WRITE_NORM=write_norm,
        LAYOUT=layout,
        KP_BLOCK=tile.kp_block,
        FP32_ACC=bool(fp32_acc),
        USE_PDL=bool(use_pdl),
        PTX=not interpreter_active(),
        num_warps=tile.num_warps,
    )
    if use_pdl:
        common["launch_pdl"] = True
    rows = (m, max(m_pad, m))
    norm = (float(eps), float(weight_bias))
    if algorithm == "torch":
        grid = (max(1, min(m, ws.max_ctas(tile.num_warps))),)
        launch(
            _gathered_kernel,
            grid,
            gathered,
            *ptrs,
            *strides,
            *rows,
            h,
            float(h),
            n_kcols,
            *norm,
            P=ws.world_size,
            **common,
        )
        return
    timeout_us = ws.timeout_us
    ws.refresh_clock()
    args = (x, *ptrs, (x.stride(0), *strides))
    scalars = (rows, h, float(h), ws.rank)
    if algorithm == "oneshot":
        _launch_oneshot(ws, tile, m, args, scalars, n_kcols, norm, timeout_us, common)
    elif algorithm == "twoshot":
        _launch_twoshot(ws, tile, m, args, scalars, n_kcols, norm, timeout_us, common)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")


def _launch_oneshot(ws, tile, m, args, scalars, n_kcols, norm, timeout_us, common) -> None:
    """Algorithm "oneshot": the variant of :func:`moefuse.comm.tiles.oneshot_variant` for M
    (rows per CTA, warps, prefetch pipeline); ``args`` = (x, the eight pointer arguments, the row
    strides), ``scalars`` = (rows, H, float(H), rank)."""
    var = oneshot_variant(m)
    cap_ctas = ws.max_ctas(tile.num_warps)
    if var.num_warps:  # registers grow as warps shrink: assume 2 co-resident CTAs per SM
        common["num_warps"] = var.num_warps
        cap_ctas = ws.num_sms * 2
    ctas = min(-(-m // var.rows_per_cta), cap_ctas)
    kernel = _oneshot_prefetch_kernel if var.prefetch else _oneshot_kernel
    launch(
        kernel,
        (max(1, ctas),),
        *args,
        ws.table,
        ws.offset16("lamport"),
        ws.ctrl,
        ws.clock,
        *scalars,
        ws.oneshot_max_tokens,
        n_kcols,
        norm,
        timeout_us,
        P=ws.world_size,
        BITS=_BITS[args[0].dtype],
        **common,
    )


def _launch_twoshot(ws, tile, m, args, scalars, n_kcols, norm, timeout_us, common) -> None:
    """Algorithm "twoshot": one CTA per row up to the CTAs that fit and the flag slots (CTA j
    waits on CTA j of the peers); ``args`` and ``scalars`` as :func:`_launch_oneshot`'s."""
    grid = (max(1, min(m, ws.max_ctas(tile.num_warps), ws.num_flag_slots)),)
    offsets = (ws.offset16("flags"), ws.offset16("stage"), ws.offset16("gather"))
    launch(
        _twoshot_kernel,
        grid,
        *args,
        (ws.table, *offsets, ws.ctrl, ws.clock),
        *scalars,
        ws.chunk_cap,
        n_kcols,
        norm,
        timeout_us,
        P=ws.world_size,
        PP=triton.next_power_of_2(ws.world_size),
        NSLOT=ws.num_flag_slots,
        BITS=_BITS[args[0].dtype],
        **common,
    )
