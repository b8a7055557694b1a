"""Triton kernels of the fused routed experts (:func:`moefuse.moe.experts.moe_experts`).

Four launches, no weight copy, every routed expert's weights read once per token tile:

1. ``_experts_plan_kernel`` (:mod:`moefuse.moe.experts_plan`) — the routing plan from
   ``top_k_index`` alone. Slot ``s = t*K + k`` is valid when its expert id lies in [0, E). Each
   program takes a block of up to 1,024 slots: histograms of all ids (``tl.histogram``; or of
   each block once, in a first launch, with the two-phase plan) give every expert's slot count
   and how many of its slots earlier blocks hold, and one ``tl.sort`` orders the block by
   (expert, slot), so ``sorted_slots`` lists the valid slots by expert, ascending slot within an
   expert. The slot that starts each tile of at most ``BT`` tokens of an expert writes that *work
   item* ``(expert, first sorted slot, slots)``; program 0 writes ``expert = -1`` into the unused
   items of the static item count. ``slot_map[t, k]`` is ``s`` or -1 (the finalize's validity
   mask).
2. ``_experts_gate_up_kernel`` — grid (item, tile of I): streams the item's expert's gate rows and
   the matching up rows once ([BN, H] each) and multiplies them with the item's tokens (gathered
   rows of ``hidden_states``): ``g, u = W_gate x, W_up x`` in FP32 (tensor-core MMAs, k16 steps in
   ascending k), ``act = cast(silu(g) * u)`` (FP32 math, one rounding to the activation dtype,
   as the down GEMM's operand) stored per slot: ``act[s, :]``. An item of at most ``BR`` slots
   (an expert's last, nearly empty one) runs a ``BR``-column tile instead (:func:`_tail_item`).
3. ``_experts_down_kernel`` — grid (item, tile of H): ``y[s, :] = W_down act[s]`` in FP32, stored
   unrounded per slot.
4. the deterministic finalize (:func:`moefuse.moe.triton.launch_moe_finalize`, expanded rows,
   FP32 input): ``out[t] = cast(((Σ_k ascending fma_ftz(y[t*K+k] + bias, w[t,k], acc)) * rsf) +
   shared)`` — one rounding.

Batch invariance: the weights are the MMA's M operand and the tokens its N operand (16, 32, 64,
128 or 256 columns: tiles of 16). Each output element is a chain of k16 MMA steps over the
reduction dimension in ascending k — the same chain whatever the other columns hold, how many
there are, which column a token occupies, how many weight rows share the program and how many k16
steps one loop step takes (``BK`` 128, or 64 in the wide tile of prefill-sized loads,
:data:`moefuse.moe.tiles.EXPERTS_WIDE`); masked columns are zeros and never mix with others. So a
token's ``act``, ``y`` and output bits depend on its own row, its experts and the weights only
(GPU tests: a token alone, in batches of 64 and 256, at every token-tile width, the wide tile's
128 and 256 included, with tail tiles and with 256 weight rows per program;
``75a3027:scripts/probe_experts_variants.py``: narrow and wide tiles, tails, 256-row tiles bitwise
equal at 256 to 8,192 tokens).

Interpreter: ``tl.dot`` there multiplies BF16 bit patterns as integers, so off the PTX path both
operands are widened to FP32 first (exact) and the product is an IEEE FP32 matmul.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import fma_ftz, round_to, widen_f32
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs
from moefuse.moe.experts_plan import (
    PLAN_CHUNK,
    PLAN_TWO_PHASE,
    experts_plan_buffers,
    launch_experts_plan,
    load_experts,
)
from moefuse.moe.tiles import experts_item_count, experts_tile, experts_token_tile, next_pow2
from moefuse.moe.triton import launch_moe_finalize


def experts_gemm_metadata(weight_bytes: int):
    """Launch metadata of an experts GEMM kernel (evaluated only under a profiler hook): its name
    with the grid and token tile, and the weight bytes of the whole grid at ``weight_bytes`` per
    element, unused items included (an upper bound of what the launch reads)."""

    def metadata(grid, kernel, args):
        gate_up = "gate_up" in kernel.name
        rows = args["BN"] * (2 if gate_up else 1)
        items, tiles = grid[0], grid[1]
        if "n_items" in args:  # a persistent grid: programs, not tiles
            items = args["n_items"]
            tiles = -(-(args["INTER"] if gate_up else args["H"]) // args["BN"])
        return {
            "name": f"{kernel.name} items={items} tiles={tiles} BT={args['BT']}",
            "bytes": items * tiles * rows * args["KDIM"] * weight_bytes,
        }

    return metadata


_gemm_metadata = experts_gemm_metadata(2)


# ----------------------------------------------------------------------------- GEMMs
@triton.jit
def _item_tokens(items_ptr, sorted_ptr, top_k, BT: tl.constexpr):
    """``(expert, slots [BT], columns in use [BT] bool, token rows [BT] int64)`` of this
    program's work item (``expert`` -1 for an unused item)."""
    return _item_tokens_at(items_ptr, sorted_ptr, tl.program_id(0), top_k, BT)


@triton.jit
def _item_tokens_at(items_ptr, sorted_ptr, item, top_k, BT: tl.constexpr):
    """:func:`_item_tokens` of work item ``item``."""
    rec = items_ptr + item * 3  # ITEM_FIELDS
    e = tl.load(rec)
    start = tl.load(rec + 1)
    rows = tl.load(rec + 2)
    r = tl.arange(0, BT)
    r_in = (r < rows) & (e >= 0)
    s = tl.load(sorted_ptr + start + r, mask=r_in, other=0)
    return e, s, r_in, (s // top_k).to(tl.int64)


@triton.jit
def _inline_item_tokens(
    idx_ptr, n_slots, top_k, n_experts, st0, st1, SP: tl.constexpr, BT: tl.constexpr
):
    """:func:`_item_tokens` computed in the program from ``top_k_index`` itself, for T*K <= SP
    slots: the same work items as the plan kernel (experts ascending, ``BT`` slots per item,
    slots ascending within an expert), from pairwise compares of all slots' expert ids."""
    sl = tl.arange(0, SP)
    e_s, v_s = load_experts(idx_ptr, sl, sl < n_slots, top_k, st0, st1, n_experts)
    same = (e_s[:, None] == e_s[None, :]) & v_s[:, None] & v_s[None, :]
    rank = tl.sum((same & (sl[None, :] < sl[:, None])).to(tl.int32), axis=1)  # j within expert
    count = tl.sum(same.to(tl.int32), axis=1)
    tiles = (count + BT - 1) // BT
    first = v_s & (rank == 0)  # one slot per expert in use carries its tile count
    smaller = first[None, :] & (e_s[None, :] < e_s[:, None])
    item = tl.sum(tl.where(smaller, tiles[None, :], 0), axis=1) + rank // BT
    mine = v_s & (item == tl.program_id(0))
    e = tl.max(tl.where(mine, e_s, -1), axis=0)
    r = tl.arange(0, BT)
    hit = mine[None, :] & ((rank % BT)[None, :] == r[:, None])  # [BT, SP]: column r holds slot
    s = tl.sum(tl.where(hit, sl[None, :], 0), axis=1)
    r_in = tl.sum(hit.to(tl.int32), axis=1) > 0
    return e, s, r_in, (s // top_k).to(tl.int64)


@triton.jit
def _write_slot_map(idx_ptr, slot_map_ptr, n_slots, top_k, n_experts, st0, st1, SP: tl.constexpr):
    """``slot_map[s] = s`` for a valid slot, -1 for a sentinel (the finalize's mask)."""
    sl = tl.arange(0, SP)
    sl_in = sl < n_slots
    _e, v_s = load_experts(idx_ptr, sl, sl_in, top_k, st0, st1, n_experts)
    tl.store(slot_map_ptr + sl, tl.where(v_s, sl, -1), mask=sl_in)


@triton.jit
def _work_item(
    items_ptr,
    sorted_ptr,
    idx_ptr,
    n_slots,
    top_k,
    n_experts,
    st0,
    st1,
    SP: tl.constexpr,
    BT: tl.constexpr,
):
    """This program's work item: from the plan kernel's buffers (``SP`` = 0) or computed in the
    program (``SP`` > 0: :func:`_inline_item_tokens`)."""
    if SP > 0:
        return _inline_item_tokens(idx_ptr, n_slots, top_k, n_experts, st0, st1, SP, BT)
    else:
        return _item_tokens(items_ptr, sorted_ptr, top_k, BT)


@triton.jit
def _tail_item(items_ptr, BR: tl.constexpr):
    """Whether this program's work item (from the plan kernel) is in use and holds at most
    ``BR`` slots (``BR`` > 0): the GEMM kernels then run a tile of ``BR`` token columns, not
    ``BT``. An expert's last item holds what its full items leave (with random routing at a mean
    load near ``BT``, a few slots): the narrow tile spends MMAs on ``BR`` columns where the full
    one would on ``BT``, and reads the same weight tile, which the expert's full item, next in
    launch order, has just brought into L2. A column's bits do not depend on the tile's width
    (module docstring)."""
    rec = items_ptr + tl.program_id(0) * 3  # ITEM_FIELDS
    return (tl.load(rec) >= 0) & (tl.load(rec + 2) <= BR)


@triton.jit
def _mma(w, xt, acc, PTX: tl.constexpr):
    """``acc + w @ xt`` with FP32 accumulation (interpreter: widened operands, module docstring)."""
    if PTX:
        return tl.dot(w, xt, acc)
    else:
        return tl.dot(widen_f32(w, PTX), widen_f32(xt, PTX), acc, input_precision="ieee")


@triton.jit
def _weight_times_columns(
    w_rows,
    n_in,
    w_st_k,
    col_rows,
    r_in,
    KDIM: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    PTX: tl.constexpr,
):
    """FP32 ``W @ X``: ``w_rows`` [rows, 1] points at each weight row (``n_in``: in range,
    reduction stride ``w_st_k``), ``col_rows`` [1, BT] at the row of each token column
    (``r_in``: in use, unit stride along the reduction); ``KDIM`` reduced in ``BK`` steps in
    ascending k, ``STAGES`` deep (the gate|up and down GEMMs of a work item)."""
    acc = tl.zeros([w_rows.shape[0], BT], dtype=tl.float32)
    for k0 in tl.range(0, KDIM, BK, num_stages=STAGES):
        kk = k0 + tl.arange(0, BK)
        k_in = kk < KDIM
        w = tl.load(w_rows + kk[None, :] * w_st_k, mask=n_in[:, None] & k_in[None, :], other=0.0)
        xt = tl.load(col_rows + kk[:, None], mask=r_in[None, :] & k_in[:, None], other=0.0)
        acc = _mma(w, xt, acc, PTX)
    return acc


@triton.jit
def _gate_up_item(
    x_ptr,
    w_ptr,
    act_ptr,
    item,
    strides,
    KDIM: tl.constexpr,
    INTER: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    """``act`` of this program's BN rows of I for the ``BT`` columns of ``item`` = (expert,
    slots, columns in use, token rows) (:func:`_experts_gate_up_kernel`); ``strides`` = (x row,
    act row, weight expert, weight row, weight reduction). ``INTERLEAVED``: gate row n is stored
    at 2n and up row n at 2n + 1."""
    e, s, r_in, tok = item
    x_st, act_st, w_st_e, w_st_n, w_st_k = strides
    # one [2*BN, BK] weight tile per step, in blocks of 64 rows: 32 gate rows, then the 32 up
    # rows that pair with them (rows n and INTER + n); one 64-row MMA operand per block
    r = tl.arange(0, 2 * BN)
    n = tl.program_id(1) * BN + (r // 64) * 32 + r % 32
    n_in = n < INTER
    if INTERLEAVED:
        rows = (2 * n + (r // 32) % 2).to(tl.int64)
    else:
        rows = (n + ((r // 32) % 2) * INTER).to(tl.int64)
    w_rows = w_ptr + e.to(tl.int64) * w_st_e + rows[:, None] * w_st_n
    acc = _weight_times_columns(
        w_rows, n_in, w_st_k, x_ptr + tok[None, :] * x_st, r_in, KDIM, BK, BT, STAGES, PTX
    )
    if USE_PDL:
        gdc_launch_dependents()
    g, u = tl.split(tl.permute(tl.reshape(acc, [BN // 32, 2, 32, BT]), (0, 2, 3, 1)))
    act = tl.reshape(g / (1.0 + tl.exp(-g)) * u, [BN, BT])  # silu(gate) * up, FP32
    n_out = tl.program_id(1) * BN + tl.arange(0, BN)
    ptrs = act_ptr + s.to(tl.int64)[None, :] * act_st + n_out[:, None]
    tl.store(
        ptrs,
        round_to(act, act_ptr.dtype.element_ty, PTX),
        mask=(n_out < INTER)[:, None] & r_in[None, :],
    )


@triton.jit(launch_metadata=_gemm_metadata)
def _experts_gate_up_kernel(
    x_ptr,
    w_ptr,
    items_ptr,
    sorted_ptr,
    act_ptr,
    idx_ptr,
    slot_map_ptr,
    count_ptr,
    top_k,
    x_st,
    w_st_e,
    w_st_n,
    w_st_k,
    act_st,
    n_slots,
    n_experts,
    idx_st0,
    idx_st1,
    n_count,
    KDIM: tl.constexpr,
    INTER: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    SP: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    BR: tl.constexpr = 0,
    INTERLEAVED: tl.constexpr = False,
):
    """act[s, n] = cast(silu(gate_n . x_t) * (up_n . x_t)) for the item's slots s (token t) and
    this program's BN rows n of I = ``INTER``. ``KDIM`` = H (the reduction). The widths are
    compile-time constants (one build per model shape: static trip counts, no column masks when
    aligned). ``BR`` > 0 (plan kernel only): an item of at most ``BR`` slots runs a tile of
    ``BR`` token columns (:func:`_tail_item`). ``SP`` > 0: no plan kernel ran; each program
    computes its work item from the ids and program (0, 0) writes ``slot_map`` and zeroes the
    down kernel's ``n_count`` finalize counters. With PDL the down kernel may launch once each
    program's reduction loop is done (an earlier trigger, right after ``gdc_wait``, measured no
    gain: notes/moe-experts.md)."""
    if USE_PDL:
        gdc_wait()  # the plan, or with SP > 0 the top_k_index of the kernel before
    if SP > 0:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            _write_slot_map(idx_ptr, slot_map_ptr, n_slots, top_k, n_experts, idx_st0, idx_st1, SP)
            c0 = 0
            while c0 < n_count:
                cs = c0 + tl.arange(0, 128)
                tl.store(count_ptr + cs, tl.zeros([128], tl.int32), mask=cs < n_count)
                c0 += 128
    # an item of at most BR slots runs the BR-column tile (a constexpr test first: with BR = 0
    # the narrow tile is not built)
    strides = (x_st, act_st, w_st_e, w_st_n, w_st_k)
    if BR > 0 and _tail_item(items_ptr, BR):
        tail = _item_tokens(items_ptr, sorted_ptr, top_k, BR)  # its own name: [BR] columns
        _gate_up_item(
            x_ptr,
            w_ptr,
            act_ptr,
            tail,
            strides,
            KDIM,
            INTER,
            BN,
            BK,
            BR,
            STAGES,
            PTX,
            USE_PDL,
            INTERLEAVED,
        )
    else:
        item = _work_item(
            items_ptr, sorted_ptr, idx_ptr, n_slots, top_k, n_experts, idx_st0, idx_st1, SP, BT
        )
        if item[0] >= 0:
            _gate_up_item(
                x_ptr,
                w_ptr,
                act_ptr,
                item,
                strides,
                KDIM,
                INTER,
                BN,
                BK,
                BT,
                STAGES,
                PTX,
                USE_PDL,
                INTERLEAVED,
            )


@triton.jit
def _down_item(
    act_ptr,
    w_ptr,
    y_ptr,
    item,
    rows,
    strides,
    KDIM: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``y`` of ``rows`` = (rows of H, in range) for the ``BT`` columns of ``item`` = (expert,
    slots, columns in use, token rows) (:func:`_experts_down_kernel`); ``strides`` = (act row,
    y row, weight expert, weight row, weight reduction)."""
    e, s, r_in, _tok = item
    n, n_in = rows
    act_st, y_st, w_st_e, w_st_n, w_st_k = strides
    w_rows = w_ptr + e.to(tl.int64) * w_st_e + n.to(tl.int64)[:, None] * w_st_n
    s64 = s.to(tl.int64)
    acc = _weight_times_columns(
        w_rows, n_in, w_st_k, act_ptr + s64[None, :] * act_st, r_in, KDIM, BK, BT, STAGES, PTX
    )
    if USE_PDL:
        gdc_launch_dependents()
    tl.store(y_ptr + s64[None, :] * y_st + n[:, None], acc, mask=n_in[:, None] & r_in[None, :])


@triton.jit(launch_metadata=_gemm_metadata)
def _experts_down_kernel(
    act_ptr,
    w_ptr,
    items_ptr,
    sorted_ptr,
    y_ptr,
    idx_ptr,
    map_ptr,
    scale_ptr,
    bias_ptr,
    shared_ptr,
    out_ptr,
    count_ptr,
    top_k,
    n_slots,
    n_experts,
    row_strides,
    w_strides,
    idx_strides,
    fin_strides,
    rsf,
    KDIM: tl.constexpr,
    H: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    SP: tl.constexpr,
    FINALIZE: tl.constexpr,
    EXTRAS: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    BR: tl.constexpr = 0,
):
    """y[s, h] = down_h . act[s] (FP32, unrounded) for the item's slots s and this program's BN
    rows h of H. ``KDIM`` = I (the reduction); ``BR`` as in :func:`_experts_gate_up_kernel`.
    ``row_strides`` = (act, y), ``w_strides`` = (expert, output row, reduction), ``idx_strides``
    those of ``top_k_index``.

    ``FINALIZE``: the finalize runs here, not in a launch of its own: every program of an H tile
    counts itself in ``counters[tile]`` (zeroed by the gate|up kernel) after its ``y`` stores,
    and the last one of the tile (the grid's first dimension: used and unused items alike) sums
    the tile's columns of every token (:func:`_finalize_rows`) into ``out``. ``fin_strides`` =
    row strides of (slot_map, top_k_weights, bias, shared, out); ``EXTRAS`` = (bias, routed
    scaling factor, shared expert output) present."""
    act_st, y_st = row_strides
    w_st_e, w_st_n, w_st_k = w_strides
    idx_st0, idx_st1 = idx_strides
    fin_ptrs = (map_ptr, scale_ptr, bias_ptr, idx_ptr, shared_ptr, out_ptr)
    if USE_PDL:
        gdc_wait()  # act from the gate|up kernel
    strides = (act_st, y_st, w_st_e, w_st_n, w_st_k)
    # the rows after the item's fetch in both branches (the order the code had before the tail)
    if BR > 0 and _tail_item(items_ptr, BR):
        tail = _item_tokens(items_ptr, sorted_ptr, top_k, BR)  # its own name: [BR] columns
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_in = n < H
        _down_item(
            act_ptr, w_ptr, y_ptr, tail, (n, n_in), strides, KDIM, BK, BR, STAGES, PTX, USE_PDL
        )
    else:
        item = _work_item(
            items_ptr, sorted_ptr, idx_ptr, n_slots, top_k, n_experts, idx_st0, idx_st1, SP, BT
        )
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        n_in = n < H
        if item[0] >= 0:
            _down_item(
                act_ptr, w_ptr, y_ptr, item, (n, n_in), strides, KDIM, BK, BT, STAGES, PTX, USE_PDL
            )
    if FINALIZE:
        map_st, scale_st, bias_st, shared_st, out_st = fin_strides
        fin_st = (y_st, map_st, scale_st, bias_st, idx_st0, idx_st1, shared_st, out_st)
        _finalize_if_last(
            y_ptr, fin_ptrs, count_ptr, n, n_in, n_slots, top_k, n_experts, fin_st, rsf, EXTRAS, PTX
        )


@triton.jit
def _finalize_if_last(
    y_ptr,
    fin_ptrs,
    count_ptr,
    n,
    n_in,
    n_slots,
    top_k,
    n_experts,
    fin_st,
    rsf,
    EXTRAS: tl.constexpr,
    PTX: tl.constexpr,
):
    """The down kernel's ``FINALIZE`` tail: count this program in ``counters[tile]`` after its
    ``y`` stores; the tile's last program runs :func:`_finalize_rows` on columns ``n``.
    ``fin_ptrs`` = (slot_map, top_k_weights, bias, top_k_index, shared, out), ``fin_st`` = row
    strides of (y, slot_map, top_k_weights, bias, top_k_index (2), shared, out)."""
    map_ptr, scale_ptr, bias_ptr, idx_ptr, shared_ptr, out_ptr = fin_ptrs
    y_st, map_st, scale_st, bias_st, idx_st0, idx_st1, shared_st, out_st = fin_st
    tl.debug_barrier()  # every thread's y stores precede the release below
    old = tl.atomic_add(count_ptr + tl.program_id(1), 1, sem="acq_rel", scope="gpu")
    if old == tl.num_programs(0) - 1:
        tl.debug_barrier()  # the acquire precedes every thread's loads
        _finalize_rows(
            y_ptr,
            map_ptr,
            scale_ptr,
            bias_ptr,
            idx_ptr,
            shared_ptr,
            out_ptr,
            n,
            n_in,
            n_slots // top_k,
            top_k,
            n_experts,
            y_st,
            map_st,
            scale_st,
            bias_st,
            idx_st0,
            idx_st1,
            shared_st,
            out_st,
            rsf,
            EXTRAS[0],
            EXTRAS[1],
            EXTRAS[2],
            PTX,
        )


@triton.jit
def _finalize_rows(
    y_ptr,
    map_ptr,
    scale_ptr,
    bias_ptr,
    eid_ptr,
    shared_ptr,
    out_ptr,
    n,
    n_in,
    n_tokens,
    top_k,
    n_experts,
    y_st,
    map_st,
    scale_st,
    bias_st,
    eid_st0,
    eid_st1,
    shared_st,
    out_st,
    rsf,
    HAS_BIAS: tl.constexpr,
    HAS_RSF: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PTX: tl.constexpr,
):
    """The deterministic finalize (module docstring, step 4) of columns ``n`` of every token,
    op for op that of :func:`moefuse.moe.triton.launch_moe_finalize` on expanded rows (same
    bits). ``y`` rows were written by other programs of this launch: read through L2 (``.cg``)."""
    t = 0
    while t < n_tokens:
        t64 = t.to(tl.int64)
        acc = tl.zeros(n.shape, dtype=tl.float32)
        k = 0
        while k < top_k:
            valid = tl.load(map_ptr + t64 * map_st + k) >= 0
            w = widen_f32(tl.load(scale_ptr + t64 * scale_st + k), PTX)
            x = tl.load(
                y_ptr + (t64 * top_k + k) * y_st + n,
                mask=n_in & valid,
                other=0.0,
                cache_modifier=".cg",
            )
            if HAS_BIAS:
                e = tl.load(eid_ptr + t64 * eid_st0 + k * eid_st1)
                has_b = valid & (e >= 0) & (e < n_experts)
                b = widen_f32(
                    tl.load(bias_ptr + e.to(tl.int64) * bias_st + n, mask=n_in & has_b, other=0.0),
                    PTX,
                )
                x = tl.where(has_b, x + b, x)
            acc = tl.where(valid, fma_ftz(x, w, acc, PTX), acc)
            k += 1
        if HAS_RSF:
            acc = acc * rsf
        if HAS_SHARED:
            acc = acc + widen_f32(
                tl.load(shared_ptr + t64 * shared_st + n, mask=n_in, other=0.0), PTX
            )
        tl.store(
            out_ptr + t64 * out_st + n, round_to(acc, out_ptr.dtype.element_ty, PTX), mask=n_in
        )
        t += 1


# ----------------------------------------------------------------------------- launcher
def _weight_strides(w: torch.Tensor, transposed: bool) -> tuple[int, int, int]:
    """(expert, output row, reduction) strides of a [E, N, Kd] weight ([E, Kd, N] transposed)."""
    if transposed:
        return w.stride(0), w.stride(2), w.stride(1)
    return w.stride(0), w.stride(1), w.stride(2)


class _Plan(NamedTuple):
    """Work of one :func:`launch_moe_experts` call: token tile ``bt``, tail tile ``br`` (0:
    none), work items, inline plan width ``sp`` (0: the plan kernel runs), whether the down
    kernel finalizes (``fused``), the plan buffers, the down kernel's per-H-tile counters and
    the ``act`` / ``y`` scratch rows."""

    bt: int
    br: int
    n_items: int
    sp: int
    fused: bool
    items: torch.Tensor
    sorted_slots: torch.Tensor
    slot_map: torch.Tensor
    counters: torch.Tensor
    act: torch.Tensor
    y: torch.Tensor


def _plan(hidden_states, top_k_index, experts, inter, cfg, token_tile, use_pdl) -> _Plan:
    """The routing plan's buffers and sizes; runs the plan kernel unless the plan is inline."""
    tokens, hidden = hidden_states.shape
    top_k = top_k_index.shape[1]
    slots = tokens * top_k
    bt = token_tile
    n_items = experts_item_count(slots, experts, bt)
    dev = hidden_states.device
    items, sorted_slots, slot_map = experts_plan_buffers(tokens, top_k, n_items, dev)
    act = torch.empty(slots, inter, dtype=hidden_states.dtype, device=dev)
    y = torch.empty(slots, hidden, dtype=torch.float32, device=dev)
    sp = next_pow2(slots) if slots <= cfg["inline_plan_slots"] else 0
    fused = bool(sp) and slots <= cfg["fuse_finalize_slots"]
    br = cfg["tail_tile"] if not sp and cfg["tail_tile"] < bt else 0
    n_htiles = triton.cdiv(hidden, cfg["bn_down"])
    counters = torch.empty(n_htiles if fused else 1, dtype=torch.int32, device=dev)
    if not sp:
        launch_experts_plan(
            top_k_index,
            experts,
            bt,
            items,
            sorted_slots,
            slot_map,
            use_pdl,
            chunk=cfg.get("plan_chunk", PLAN_CHUNK),
            warps=cfg.get("plan_warps"),
            two_phase=cfg.get("plan_two_phase", PLAN_TWO_PHASE),
        )
    return _Plan(bt, br, n_items, sp, fused, items, sorted_slots, slot_map, counters, act, y)


def _launch_gate_up(
    hidden_states,
    gate_up_proj,
    top_k_index,
    experts,
    plan: _Plan,
    cfg,
    transposed: bool,
    use_pdl: bool,
    interleaved: bool = False,
) -> None:
    """``act = cast(silu(gate x) * (up x))`` per slot (module docstring, step 2)."""
    hidden = hidden_states.shape[1]
    inter = plan.act.shape[1]
    args = (
        hidden_states, gate_up_proj, plan.items, plan.sorted_slots, plan.act, top_k_index,
        plan.slot_map, plan.counters,
        top_k_index.shape[1], hidden_states.stride(0), *_weight_strides(gate_up_proj, transposed),
        plan.act.stride(0), top_k_index.numel(), experts,
        top_k_index.stride(0), top_k_index.stride(1), plan.counters.numel() if plan.fused else 0,
    )  # fmt: skip
    launch(
        _experts_gate_up_kernel,
        (plan.n_items, triton.cdiv(inter, cfg["bn_gate_up"])),
        *args,
        KDIM=hidden,
        INTER=inter,
        BN=cfg["bn_gate_up"],
        BK=cfg["bk"],
        BT=plan.bt,
        BR=plan.br,
        STAGES=cfg["stages"],
        SP=plan.sp,
        PTX=not interpreter_active(),
        USE_PDL=use_pdl,
        INTERLEAVED=interleaved,
        num_warps=cfg["warps"],
        **pdl_launch_kwargs(use_pdl),
    )


def _launch_down(
    down_proj,
    top_k_index,
    top_k_weights,
    out,
    bias,
    shared_expert_output,
    rsf,
    experts,
    plan: _Plan,
    cfg,
    transposed: bool,
    use_pdl: bool,
) -> None:
    """``y = down act`` per slot (module docstring, step 3), and with ``plan.fused`` the
    finalize into ``out`` (step 4)."""
    act, y = plan.act, plan.y
    hidden = y.shape[1]
    fin_strides = (
        plan.slot_map.stride(0),
        top_k_weights.stride(0),
        bias.stride(0) if bias is not None else 0,
        shared_expert_output.stride(0) if shared_expert_output is not None else 0,
        out.stride(0),
    )
    args = (
        act, down_proj, plan.items, plan.sorted_slots, y, top_k_index,
        plan.slot_map, top_k_weights, bias if bias is not None else y,
        shared_expert_output if shared_expert_output is not None else y, out, plan.counters,
        top_k_index.shape[1], top_k_index.numel(), experts, (act.stride(0), y.stride(0)),
        _weight_strides(down_proj, transposed), (top_k_index.stride(0), top_k_index.stride(1)),
        fin_strides, rsf,
    )  # fmt: skip
    launch(
        _experts_down_kernel,
        (plan.n_items, triton.cdiv(hidden, cfg["bn_down"])),
        *args,
        KDIM=act.shape[1],
        H=hidden,
        BN=cfg["bn_down"],
        BK=cfg.get("down_bk", cfg["bk"]),
        BT=plan.bt,
        BR=plan.br,
        STAGES=cfg.get("down_stages", cfg["stages"]),
        SP=plan.sp,
        FINALIZE=plan.fused,
        EXTRAS=(bias is not None, rsf != 1.0, shared_expert_output is not None),
        PTX=not interpreter_active(),
        USE_PDL=use_pdl,
        num_warps=cfg.get("down_warps", cfg["warps"]),
        enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
    )


def launch_moe_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    shared_expert_output: torch.Tensor | None,
    routed_scaling_factor: float,
    transposed: bool,
    use_pdl: bool,
    *,
    tile: dict | None = None,
    token_tile: int | None = None,
    interleaved: bool = False,
) -> None:
    """Writes ``out`` [T, H] (module docstring); ``interleaved``: gate|up rows stored g0, u0, g1,
    u1, ... ``tile`` / ``token_tile`` override the policy
    of :mod:`moefuse.moe.tiles` (benchmarks and the invariance tests only; ``tile`` may also
    carry ``plan_chunk`` / ``plan_warps`` / ``plan_two_phase`` for :func:`launch_experts_plan`, and
    ``down_bk`` / ``down_stages`` / ``down_warps``: the down kernel's own, else the shared keys)."""
    tokens, hidden = hidden_states.shape
    experts = gate_up_proj.shape[0]
    inter = down_proj.shape[1] if transposed else down_proj.shape[2]
    if tokens == 0 or hidden == 0:
        return
    slots = tokens * top_k_index.shape[1]
    token_tile = token_tile or experts_token_tile(slots, experts)
    cfg = dict(experts_tile(hidden, inter, token_tile, slots), **(tile or {}))
    plan = _plan(hidden_states, top_k_index, experts, inter, cfg, token_tile, use_pdl)
    _launch_gate_up(
        hidden_states,
        gate_up_proj,
        top_k_index,
        experts,
        plan,
        cfg,
        transposed,
        use_pdl,
        interleaved,
    )
    rsf = float(routed_scaling_factor)
    _launch_down(
        down_proj,
        top_k_index,
        top_k_weights,
        out,
        bias,
        shared_expert_output,
        rsf,
        experts,
        plan,
        cfg,
        transposed,
        use_pdl,
    )
    if plan.fused:
        return
    # the finalize reads expert ids (for the bias) at unit stride along K
    eids = None
    if bias is not None:
        eids = top_k_index if top_k_index.stride(1) == 1 else top_k_index.contiguous()
    launch_moe_finalize(
        plan.y,
        plan.slot_map,
        top_k_weights,
        out,
        bias,
        eids,
        routed_scaling_factor,
        shared_expert_output,
        True,
        use_pdl,
    )
