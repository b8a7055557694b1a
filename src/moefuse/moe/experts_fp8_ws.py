"""The FP8 experts' GEMMs at many tokens with both operands loaded by TMA and the K loop
warp-specialised (tile key ``ws`` with ``tma`` of :func:`launch_moe_experts_fp8`).

The products and their order are :mod:`moefuse.moe.experts_fp8_tma`'s (the slots on the MMA's M
side, ``BT`` = 128 slots of one work item, per K-block ``dot_b`` from a zero accumulator, then
``acc = fma(dot_b, xs[slot, b] * Ws[row / 128, b], acc)`` from +0.0). What changes is where the
slots' rows come from and who runs the loop:

* Rows in the plan's sorted order. The routing plan lists the valid slots by expert
  (``sorted_slots``), and a work item is ``rows`` consecutive positions from ``start``. A
  gather (:func:`_gather_sorted_kernel`) copies each valid slot's token codes and group scales
  to its position, so an item's ``BT`` rows are one TMA box ``[start, b * 128]``: both MMA
  operands arrive by TMA. The gate|up kernel stores ``act`` at the position too, the
  activation's quantization is row by row, and the down kernel reads the
  codes by position and stores ``y`` at the slot. Box rows past an item's own (the next item's
  rows, unwritten rows, past the end: zeros) fill MMA rows whose results are never stored; each
  row's sum is its own.
* Triton's Hopper warp specialisation (``tl.range(..., warp_specialize=True)``, 4 warps per
  partition): one warpgroup issues the TMA loads into a ring of ``STAGES`` buffers, two consumer
  warpgroups run 64 slot rows each (the same m64 MMAs as the 8-warp TMA launch), so one
  warpgroup's block scaling overlaps the other's MMA. The pass needs every MMA operand loaded by
  TMA and the loop outside any branch: an unused item runs zero iterations.

Same codes, scales and FP32 sums as the TMA launch, so the same bits (CPU interpreter tests;
GPU tests against the pointer kernels).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from moefuse._device import fma_rn, round_to
from moefuse._fastpath import launch
from moefuse._runtime import pdl_launch_kwargs
from moefuse.moe.experts_fp8_quant import group_quant_rows
from moefuse.moe.experts_fp8_tma import _rows_view, fp8_gemm_metadata
from moefuse.moe.fp8_device import fp8_block_dot, scale_f32

#: columns of codes one gather program copies (two 128-channel groups)
GATHER_COLS = 256


@triton.jit
def _item(items_ptr, sorted_ptr, BT: tl.constexpr):
    """``(expert, first position, positions [BT], slots [BT], rows in use [BT])`` of this
    program's work item (expert -1 and no rows in use for an unused item)."""
    rec = items_ptr + tl.program_id(0) * 3  # ITEM_FIELDS
    e = tl.load(rec)
    start = tl.load(rec + 1)
    rows = tl.load(rec + 2)
    r = tl.arange(0, BT)
    r_in = (r < rows) & (e >= 0)
    p = start + r
    s = tl.load(sorted_ptr + p, mask=r_in, other=0)
    return e, start, p.to(tl.int64), s.to(tl.int64), r_in


@triton.jit
def _gather_sorted_kernel(
    x_ptr,
    xs_ptr,
    items_ptr,
    sorted_ptr,
    xg_ptr,
    xgs_ptr,
    strides,
    top_k,
    H: tl.constexpr,
    G: tl.constexpr,
    BT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``xg[p, c] = x[slot_p // K, c]`` for the :data:`GATHER_COLS` columns from
    ``program_id(1) * GATHER_COLS`` and ``xgs[p, g] = xs[slot_p // K, g]`` for their groups, at
    the positions of work item ``program_id(0)``; ``strides`` = (x, xs, xg, xgs rows)."""
    x_st, xs_st, xg_st, xgs_st = strides
    if USE_PDL:
        gdc_wait()  # the tokens' codes
    e, start, p, s, r_in = _item(items_ptr, sorted_ptr, BT)
    tok = s // top_k
    c = tl.program_id(1) * 256 + tl.arange(0, 256)
    m = r_in[:, None] & (c < H)[None, :]
    v = tl.load(x_ptr + tok[:, None] * x_st + c[None, :], mask=m)
    tl.store(xg_ptr + p[:, None] * xg_st + c[None, :], v, mask=m)
    g = tl.program_id(1) * 2 + tl.arange(0, 2)
    mg = r_in[:, None] & (g < G)[None, :]
    sc = tl.load(xs_ptr + tok[:, None] * xs_st + g[None, :], mask=mg)
    tl.store(xgs_ptr + p[:, None] * xgs_st + g[None, :], sc, mask=mg)
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def _sorted_block_product(
    x_desc,
    xs_rows,
    r_in,
    start,
    e,
    descs,
    row0,
    s_ptrs,
    s_st_k,
    KDIM: tl.constexpr,
    BN: tl.constexpr,
    STAGES: tl.constexpr,
    PTX: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
):
    """FP32 ``acc[j] = fma(dot_b, xs[p, b] * Ws_j[b], acc[j])`` over the K-blocks ascending
    from +0.0 (none for an unused item, expert ``e`` < 0; the sums of
    ``experts_fp8_tma._slot_block_product``): the slot rows are the box ``[start, b * 128]`` of
    ``x_desc`` (their scales from ``xs_rows`` [BT]), the weight rows ``row0`` .. ``row0 + BN``
    of ``descs[j]`` (block-scale row pointers ``s_ptrs[j]``). The loop is warp-specialised
    (module docstring)."""
    BT: tl.constexpr = xs_rows.shape[0]
    TWO: tl.constexpr = len(descs) == 2
    acc0 = tl.zeros([BT, BN], dtype=tl.float32)
    acc1 = tl.zeros([BT, BN], dtype=tl.float32)
    NB: tl.constexpr = (KDIM + 127) // 128
    # an unused item (e < 0) runs no iteration; the interpreter's loops take a constant bound
    # (there it runs them on zeros, boxes outside the tensors, and stores nothing)
    for b in tl.range(
        0, tl.where(e >= 0, NB, 0) if PTX else NB, num_stages=STAGES, warp_specialize=PTX
    ):
        q = x_desc.load([start, b * 128])
        xs = tl.load(xs_rows + b, mask=r_in, other=0.0)
        w0 = descs[0].load([row0, b * 128])
        ws0 = scale_f32(tl.load(s_ptrs[0] + b * s_st_k), E8M0)
        acc0 = fma_rn(fp8_block_dot(q, tl.trans(w0), ACCUM, PTX), (xs * ws0)[:, None], acc0, PTX)
        if TWO:
            w1 = descs[1].load([row0, b * 128])
            ws1 = scale_f32(tl.load(s_ptrs[1] + b * s_st_k), E8M0)
            p1 = fp8_block_dot(q, tl.trans(w1), ACCUM, PTX)
            acc1 = fma_rn(p1, (xs * ws1)[:, None], acc1, PTX)
    return acc0, acc1


@triton.jit(launch_metadata=fp8_gemm_metadata)
def _experts_fp8_gate_up_ws_kernel(
    x_desc,
    xs_ptr,
    gate_desc,
    up_desc,
    s_ptr,
    items_ptr,
    sorted_ptr,
    act_ptr,
    strides,
    KDIM: tl.constexpr,
    INTER: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """act[p, n] = cast(silu(g_n) * u_n) at the positions ``p`` of work item ``program_id(0)``
    for the ``BN`` (64 or 128) rows of I from ``program_id(1) * BN`` (a stacked gate|up: gate row
    ``e * 2I + n`` of ``gate_desc``, which ``up_desc`` reads from ``I`` rows further on;
    I % 128 == 0); ``x_desc`` reads the gathered
    codes by position; ``strides`` = (x-scale row, act row, scale expert / row / block)."""
    xs_st, act_st, s_st_e, s_st_n, s_st_k = strides
    if USE_PDL:
        gdc_wait()  # the gathered codes
    e, start, p, _s, r_in = _item(items_ptr, sorted_ptr, BT)
    n0 = tl.program_id(1) * BN
    s_e = s_ptr + tl.maximum(e, 0).to(tl.int64) * s_st_e
    g, u = _sorted_block_product(
        x_desc,
        xs_ptr + p * xs_st,
        r_in,
        start,
        e,
        (gate_desc, up_desc),
        e * 2 * INTER + n0,
        (s_e + (n0 // 128) * s_st_n, s_e + ((INTER + n0) // 128) * s_st_n),
        s_st_k,
        KDIM,
        BN,
        STAGES,
        PTX,
        E8M0,
        ACCUM,
    )
    if USE_PDL:
        gdc_launch_dependents()
    act = g / (1.0 + tl.exp(-g)) * u  # silu(gate) * up, FP32
    n = n0 + tl.arange(0, BN)
    live = r_in[:, None] & (n < INTER)[None, :]
    val = round_to(act, act_ptr.dtype.element_ty, PTX)
    tl.store(act_ptr + p[:, None] * act_st + n[None, :], val, mask=live)


@triton.jit(launch_metadata=fp8_gemm_metadata)
def _experts_fp8_down_ws_kernel(
    a_desc,
    as_ptr,
    w_desc,
    s_ptr,
    items_ptr,
    sorted_ptr,
    y_ptr,
    strides,
    KDIM: tl.constexpr,
    H: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """y[s, h] (FP32, unrounded) for the slots of work item ``program_id(0)`` and the ``BN``
    rows of H from ``program_id(1) * BN`` (``BN`` divides 128); ``a_desc`` reads the
    activation's codes by position; ``strides`` = (act-scale row, y row, scale expert / row /
    block)."""
    as_st, y_st, s_st_e, s_st_n, s_st_k = strides
    if USE_PDL:
        gdc_wait()  # the activation's codes
    e, start, p, s, r_in = _item(items_ptr, sorted_ptr, BT)
    n0 = tl.program_id(1) * BN
    s_row = s_ptr + tl.maximum(e, 0).to(tl.int64) * s_st_e + (n0 // 128) * s_st_n
    acc, _unused = _sorted_block_product(
        a_desc,
        as_ptr + p * as_st,
        r_in,
        start,
        e,
        (w_desc,),
        e * H + n0,
        (s_row,),
        s_st_k,
        KDIM,
        BN,
        STAGES,
        PTX,
        E8M0,
        ACCUM,
    )
    if USE_PDL:
        gdc_launch_dependents()
    n = n0 + tl.arange(0, BN)
    tl.store(y_ptr + s[:, None] * y_st + n[None, :], acc, mask=r_in[:, None] & (n < H)[None, :])


# ----------------------------------------------------------------------------- launchers
def ws_experts_fits(gate_up: torch.Tensor, down: torch.Tensor, cfg: dict, bt: int) -> bool:
    """Whether the ``ws`` launch may run both GEMMs: 128-slot items (two 64-row consumer
    warpgroups), gate|up tiles of 64 or 128 rows and a down tile dividing 128 (each inside one
    scale block), block
    accumulation, both weights contiguous with I % 128 == 0 and H % 16 == 0 (TMA rows)."""
    from moefuse.moe.tiles import FP8_ACCUMULATION_CODES

    inter, hidden = down.shape[2], down.shape[1]
    return (
        bt == 128
        and cfg["bn_gate_up"] in (64, 128)
        and 128 % cfg["bn_down"] == 0
        and cfg["accumulation"] == FP8_ACCUMULATION_CODES["block"]
        and inter % 128 == 0
        and hidden % 16 == 0
        and all(w.is_contiguous() and w.data_ptr() % 16 == 0 for w in (gate_up, down))
    )


def _desc(t: torch.Tensor, rows: int) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, [rows, 128])


def launch_experts_fp8_ws(x, xs, gate_up, gu_scale, down, d_scale, e8m0, plan, top_k, cfg, use_pdl):
    """``plan.y`` [T*K, H] (FP32, per slot) from the tokens' codes ``x`` [T, H] and group scales
    ``xs`` through the gather, the gate|up kernel (``plan.act`` by position), the activation's
    group quantization (per_token_group_quant_8bit's kernel; with the quantization in the
    gate|up epilogue Triton's pass does not specialise the loop) and the down kernel;
    ``e8m0``: (gate|up scales, down scales) are UE8M0 bytes. Weights: E4M3 codes (uint8 in the
    interpreter) [E, 2I, H] and [E, H, I] (:func:`ws_experts_fits` holds)."""
    from moefuse._runtime import interpreter_active

    ptx = not interpreter_active()
    slots, hidden = plan.y.shape
    inter = plan.act.shape[1]
    groups = triton.cdiv(hidden, 128)
    xg = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    xgs = torch.empty(slots, groups, dtype=torch.float32, device=x.device)
    pdl = pdl_launch_kwargs(use_pdl)
    launch(
        _gather_sorted_kernel,
        (plan.n_items, triton.cdiv(hidden, GATHER_COLS)),
        x,
        xs,
        plan.items,
        plan.sorted_slots,
        xg,
        xgs,
        (x.stride(0), xs.stride(0), xg.stride(0), xgs.stride(0)),
        top_k,
        H=hidden,
        G=groups,
        BT=plan.bt,
        USE_PDL=use_pdl,
        num_warps=4,
        **pdl,
    )
    rows = _rows_view(gate_up)
    common = dict(BT=plan.bt, ACCUM=cfg["accumulation"], PTX=ptx, USE_PDL=use_pdl)
    launch(
        _experts_fp8_gate_up_ws_kernel,
        (plan.n_items, inter // cfg["bn_gate_up"]),
        _desc(xg, plan.bt),
        xgs,
        _desc(rows, cfg["bn_gate_up"]),
        _desc(rows[inter:], cfg["bn_gate_up"]),
        gu_scale,
        plan.items,
        plan.sorted_slots,
        plan.act,
        (xgs.stride(0), plan.act.stride(0), *gu_scale.stride()),
        KDIM=hidden,
        INTER=inter,
        BN=cfg["bn_gate_up"],
        STAGES=cfg["stages"],
        E8M0=e8m0[0],
        num_warps=4,
        enable_fp_fusion=False,
        **common,
        **pdl,
    )
    a, a_s = group_quant_rows(plan.act, use_pdl)  # row by row: the codes by position
    bn = cfg["bn_down"]
    launch(
        _experts_fp8_down_ws_kernel,
        (plan.n_items, triton.cdiv(hidden, bn)),
        _desc(a, plan.bt),
        a_s,
        _desc(_rows_view(down), bn),
        d_scale,
        plan.items,
        plan.sorted_slots,
        plan.y,
        (a_s.stride(0), plan.y.stride(0), *d_scale.stride()),
        KDIM=inter,
        H=hidden,
        BN=bn,
        STAGES=cfg.get("down_stages", cfg["stages"]),
        E8M0=e8m0[1],
        num_warps=4,
        enable_fp_fusion=False,
        **common,
        **pdl,
    )
