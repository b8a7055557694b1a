"""The routing plan of the fused routed experts (:mod:`moefuse.moe.experts_triton`, step 1):
from ``top_k_index`` alone, the work items (expert, first sorted slot, slots: at most one token
tile each), the valid slots sorted by expert and the slot map, in one launch, or two with the
two-phase plan (per-block counts first). Integer work only: the same plan whatever the grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._fastpath import launch
from moefuse._runtime import pdl_launch_kwargs
from moefuse.moe.tiles import next_pow2

#: most slots sorted per plan program (a block of next_pow2(T*K) slots up to this, at least 32)
PLAN_SLOTS = 1024
#: most ids read per step of a plan program's histogram loop (next_pow2(T*K) up to this, at least
#: a block), and its warps: 8 from 4,096-id chunks on, else 4. MEASURED (H200, 2026-12-04,
#: notes/moe-experts.md), plan kernel us with 1,024-id chunks and 4 warps -> 4,096 and 8: Qwen3
#: T = 1024 22.3 -> 16.4, 2048 37.0 -> 26.0, 4096 59.4 -> 39.6; DeepSeek-V3 1024 27.5 -> 19.1,
#: 2048 45.0 -> 31.6; Mixtral 1024 (2,048 ids) 13.8 -> 11.2.
PLAN_CHUNK = 4096
PLAN_WIDE_CHUNK_WARPS = 8
#: block counts summed per step of a two-phase plan program (``CB`` = this // EP blocks, a power
#: of two, EP the expert count rounded up to one)
PLAN_COUNT_STEP = 4096
#: the two-phase plan wherever the slots span more than one block (one block: one launch as
#: before). MEASURED (H200, 2026-12-04, 5fb90ec, notes/moe-experts.md), plan us one-phase ->
#: two-phase (counts kernel included): Qwen3 T = 256 (2 blocks) 14.2 -> 12.7, 1024 15.9 -> 12.4,
#: 2048 23.3 -> 12.5, 4096 41.1 -> 12.9; DeepSeek-V3 512 13.9 -> 11.9, 1024 19.0 -> 12.4, 2048
#: 33.3 -> 13.9, 4096 58.5 -> 18.7; Mixtral 1024 17.1 -> 14.1; Qwen3 512 11.6 -> 11.7, the one
#: point without a gain.
PLAN_TWO_PHASE = True
#: int32 fields of one work item: expert (-1 = unused), first sorted slot, slot count
ITEM_FIELDS = 3


@triton.jit
def load_experts(idx_ptr, s, s_in, top_k, st0, st1, n_experts):
    """``(expert, valid)`` of slots ``s`` (int32); the expert is ``n_experts`` for invalid slots
    (outside [0, E): sentinels) and ``n_experts + 1`` where ``s_in`` is False."""
    t = s // top_k
    k = s - t * top_k
    ids = tl.load(idx_ptr + t.to(tl.int64) * st0 + k * st1, mask=s_in, other=-1).to(tl.int64)
    valid = s_in & (ids >= 0) & (ids < n_experts)
    e = tl.where(valid, ids, tl.where(s_in, n_experts, n_experts + 1)).to(tl.int32)
    return e, valid


@triton.jit(do_not_specialize=["n_slots", "n_experts"])
def _experts_block_counts_kernel(
    idx_ptr,
    counts_ptr,
    n_slots,
    top_k,
    n_experts,
    idx_st0,
    idx_st1,
    BS: tl.constexpr,
    EP: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """``counts[b, e]`` = valid slots of expert ``e`` in block ``b`` (slots ``b*BS ..``): the
    first phase of the two-phase plan (:func:`launch_experts_plan`), one histogram per program."""
    pid = tl.program_id(0)
    if USE_PDL:
        gdc_wait()  # top_k_index may come from the kernel before
    s = pid * BS + tl.arange(0, BS)
    e, v = load_experts(idx_ptr, s, s < n_slots, top_k, idx_st0, idx_st1, n_experts)
    h = tl.histogram(tl.where(v, e, 0), EP, mask=v)
    tl.store(counts_ptr + pid.to(tl.int64) * EP + tl.arange(0, EP), h)
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def _expert_counts(
    idx_ptr,
    counts_ptr,
    n_slots,
    top_k,
    n_experts,
    idx_st0,
    idx_st1,
    b0,
    BS: tl.constexpr,
    BC: tl.constexpr,
    EP: tl.constexpr,
    CB: tl.constexpr,
):
    """``(counts [EP], before [EP])``: every expert's valid slots, and those before slot ``b0``
    (this program's block). ``CB`` = 0: histograms of all ids, one per chunk of ``BC`` (a second
    one only for the chunk that holds ``b0``); ``CB`` > 0: sums of the per-block histograms
    that :func:`_experts_block_counts_kernel` wrote, ``CB`` blocks per step. Integer sums: the
    same counts either way."""
    counts = tl.zeros([EP], dtype=tl.int32)
    before = tl.zeros([EP], dtype=tl.int32)
    if CB > 0:
        n_blocks = tl.cdiv(n_slots, BS)
        first = b0 // BS
        c0 = 0
        while c0 < n_blocks:
            bb = c0 + tl.arange(0, CB)
            rows = tl.load(
                counts_ptr + bb.to(tl.int64)[:, None] * EP + tl.arange(0, EP)[None, :],
                mask=(bb < n_blocks)[:, None],
                other=0,
            )
            counts += tl.sum(rows, 0)
            before += tl.sum(tl.where((bb < first)[:, None], rows, 0), 0)
            c0 += CB
    else:
        c0 = 0
        while c0 < n_slots:
            cs = c0 + tl.arange(0, BC)
            e_c, v_c = load_experts(idx_ptr, cs, cs < n_slots, top_k, idx_st0, idx_st1, n_experts)
            e_c = tl.where(v_c, e_c, 0)
            chunk = tl.histogram(e_c, EP, mask=v_c)
            counts += chunk
            if c0 + BC <= b0:  # the whole chunk is before this block: its histogram counts too
                before += chunk
            elif c0 < b0:
                before += tl.histogram(e_c, EP, mask=v_c & (cs < b0))
            c0 += BC
    return counts, before


@triton.jit(do_not_specialize=["n_slots", "n_experts", "n_items"])
def _experts_plan_kernel(
    idx_ptr,
    items_ptr,
    sorted_ptr,
    slot_map_ptr,
    counts_ptr,
    n_slots,
    top_k,
    n_experts,
    n_items,
    idx_st0,
    idx_st1,
    BS: tl.constexpr,
    BC: tl.constexpr,
    EP: tl.constexpr,
    BT: tl.constexpr,
    USE_PDL: tl.constexpr,
    CB: tl.constexpr = 0,
):
    """Routing plan (module docstring, step 1) for this program's block of ``BS`` slots. Integer
    work only: every program counts all T*K expert ids, so the grid cannot change the plan.

    Each expert's count, and how many of its slots the earlier blocks hold, give its first sorted
    position (:func:`_expert_counts`: from all ids, or with ``CB`` > 0 from the per-block counts
    of the two-phase plan); the block's own slots are put in (expert, slot) order by one
    ``tl.sort`` of the keys ``expert * BS + offset``. A slot's rank j within its expert is the
    earlier blocks' count plus its place among the block's slots of that expert; the slot with
    j % BT == 0 heads a work item and writes it. Work per program: T*K histogram updates (or
    T*K / BS block counts) and one sort of ``BS`` keys."""
    pid = tl.program_id(0)
    if USE_PDL:
        gdc_wait()  # top_k_index (or the block counts) from the kernel before
    b0 = pid * BS
    counts, before = _expert_counts(
        idx_ptr, counts_ptr, n_slots, top_k, n_experts, idx_st0, idx_st1, b0, BS, BC, EP, CB
    )
    tiles = (counts + BT - 1) // BT
    first_item = tl.cumsum(tiles, 0) - tiles
    starts = tl.cumsum(counts, 0) - counts
    off = tl.arange(0, BS)
    mine = b0 + off
    m_in = mine < n_slots
    e_m, v_m = load_experts(idx_ptr, mine, m_in, top_k, idx_st0, idx_st1, n_experts)
    in_block = tl.histogram(tl.where(v_m, e_m, 0), EP, mask=v_m)
    block_start = tl.cumsum(in_block, 0) - in_block  # an expert's first place in the sorted block
    key = tl.sort(tl.where(v_m, e_m, EP) * BS + off)  # invalid slots sort last (expert EP)
    e_q = key // BS  # the expert and the slot at each place of the sorted block
    v_q = e_q < EP
    e_g = tl.minimum(e_q, EP - 1)
    slot = b0 + key % BS
    j = tl.gather(before, e_g, 0) + off - tl.gather(block_start, e_g, 0)  # rank within expert
    pos = tl.gather(starts, e_g, 0) + j
    head = v_q & (j % BT == 0)
    rec = items_ptr + (tl.gather(first_item, e_g, 0) + j // BT) * 3
    tl.store(rec, e_q, mask=head)
    tl.store(rec + 1, pos, mask=head)
    tl.store(rec + 2, tl.minimum(tl.gather(counts, e_g, 0) - j, BT), mask=head)
    tl.store(sorted_ptr + pos, slot, mask=v_q)
    tl.store(slot_map_ptr + mine, tl.where(v_m, mine, -1), mask=m_in)
    if pid == 0:  # the static item count's unused tail
        i0 = tl.sum(tiles, 0)
        while i0 < n_items:
            ii = i0 + tl.arange(0, BS)
            tl.store(items_ptr + ii * 3, tl.full([BS], -1, tl.int32), mask=ii < n_items)
            i0 += BS
    if USE_PDL:
        gdc_launch_dependents()


# ----------------------------------------------------------------------------- launcher
def experts_plan_buffers(tokens: int, top_k: int, n_items: int, device):
    """``(items [n_items * 3], sorted_slots [T*K], slot_map [T, K])`` int32, uninitialised."""
    return (
        torch.empty(n_items * ITEM_FIELDS, dtype=torch.int32, device=device),
        torch.empty(tokens * top_k, dtype=torch.int32, device=device),
        torch.empty(tokens, top_k, dtype=torch.int32, device=device),
    )


def launch_experts_plan(
    top_k_index: torch.Tensor,
    experts: int,
    token_tile: int,
    items: torch.Tensor,
    sorted_slots: torch.Tensor,
    slot_map: torch.Tensor,
    use_pdl: bool,
    chunk: int = PLAN_CHUNK,
    warps: int | None = None,
    two_phase: bool = PLAN_TWO_PHASE,
) -> None:
    """Writes the routing plan of ``top_k_index`` [T, K] (:mod:`moefuse.moe.experts_triton`,
    step 1): ``items`` (``n_items`` records of expert, first sorted slot, slots; expert -1 when
    unused), ``sorted_slots`` (valid slots by expert; the tail past the valid count is not
    written) and ``slot_map`` [T, K] (s or -1). ``two_phase`` (more than one block of slots): a
    first launch histograms each block once (:func:`_experts_block_counts_kernel`) and the plan
    programs sum those counts instead of reading every id; the same plan."""
    slots = top_k_index.numel()
    block = min(PLAN_SLOTS, max(32, next_pow2(slots)))
    chunk = max(block, min(chunk, next_pow2(slots)))
    warps = warps or (PLAN_WIDE_CHUNK_WARPS if chunk >= 4096 else 4)
    ep = max(16, next_pow2(experts))
    grid = triton.cdiv(slots, block)
    idx_args = (slots, top_k_index.shape[1], experts)
    strides = (top_k_index.stride(0), top_k_index.stride(1))
    counts, cb = items, 0
    if two_phase and grid > 1:
        counts = torch.empty(grid * ep, dtype=torch.int32, device=top_k_index.device)
        cb = max(1, PLAN_COUNT_STEP // ep)
        launch(
            _experts_block_counts_kernel,
            (grid,),
            top_k_index,
            counts,
            *idx_args,
            *strides,
            BS=block,
            EP=ep,
            USE_PDL=use_pdl,
            num_warps=4,
            **pdl_launch_kwargs(use_pdl),
        )
    launch(
        _experts_plan_kernel,
        (grid,),
        top_k_index,
        items,
        sorted_slots,
        slot_map,
        counts,
        *idx_args,
        items.numel() // ITEM_FIELDS,
        *strides,
        BS=block,
        BC=chunk,
        EP=ep,
        BT=token_tile,
        CB=cb,
        USE_PDL=use_pdl,
        num_warps=warps,
        **pdl_launch_kwargs(use_pdl),
    )
