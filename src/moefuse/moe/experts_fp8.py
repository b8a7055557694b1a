"""Triton kernels of the FP8 (block-scaled W8A8) routed experts (:func:`moefuse.moe_experts` with
``float8_e4m3fn`` weights).

Six launches at most: the routing plan (above 32 slots; below, each program computes its own
work item), the tokens' group quantization (per_token_group_quant_8bit's kernel: E4M3 codes and
one FP32 scale per 128 channels; inside every gate|up program, per K-block, with
``fuse_tokens_quant``), gate|up, the activation's group quantization (inside the gate|up kernel
with ``fuse_act_quant``: the last program of each 128-column group of I quantizes it, or, in
the many-token TMA launch (:mod:`moefuse.moe.experts_fp8_tma`, the default there), each
128-row program its own group; inside every down program, per K-block, with
``down_act_quant``), down, and the deterministic finalize (inside the down kernel up to 8
slots). Every placement writes or uses that kernel's bytes; the decode keys are
:func:`moefuse.moe.tiles.experts_fp8_decode_tile`'s. The plan, work items, tail
tiles and finalize are the BF16 kernels' (:mod:`moefuse.moe.experts_triton`); the products are
:func:`moefuse.moe.fp8_device.block_fp8_product`: every program streams its weight tile of one
expert (E4M3 codes and their 128 x 128 block scales) once for all the item's tokens and sums the
FP8 MMA of each K-block from zero, scaled, in ascending block order. No weight is copied or
dequantized.

Batch invariance: a column's ``dot_b`` is the MMA's chain of k32 steps whatever the other
columns hold; its group scale is its own token's; the block sums run in ascending ``b``; the
epilogues are the BF16 kernels'. So a token's bits depend on its own row, its experts and the
weights only (GPU tests: alone, in batches of 64 and 256, at every token tile).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import round_to
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs
from moefuse.moe.experts_fp8_quant import group_quant_rows, store_slot_group_codes, tokens_quant
from moefuse.moe.experts_fp8_tma import (
    fp8_gemm_metadata,
    gate_up_tma_fits,
    launch_down_fp8_tma,
    launch_gate_up_fp8_tma,
    tma_experts_ready,
)
from moefuse.moe.experts_triton import (
    _finalize_if_last,
    _item_tokens,
    _plan,
    _tail_item,
    _work_item,
    _write_slot_map,
)
from moefuse.moe.fp8_device import (
    GROUP_EPS,
    block_fp8_product,
    fp8_codes,
    prefetch_row_bytes,
    prefetch_rows_l2,
)
from moefuse.moe.tiles import (
    EXPERTS_FP8_NARROW,
    EXPERTS_FP8_TMA64_TOKEN_TILE,
    experts_fp8_decode_tile,
    experts_fp8_tile,
    experts_fp8_token_tile,
)
from moefuse.moe.triton import launch_moe_finalize


@triton.jit
def _gate_up_rows(INTER: tl.constexpr, BN: tl.constexpr, INTERLEAVED: tl.constexpr):
    """(stored rows [2 * BN] int64 of this program's gate|up weight tile, in range): blocks of
    64 rows, 32 gate rows and the 32 up rows that pair with them, as in the BF16 kernel."""
    r = tl.arange(0, 2 * BN)
    n = tl.program_id(1) * BN + (r // 64) * 32 + r % 32
    if INTERLEAVED:
        rows = (2 * n + (r // 32) % 2).to(tl.int64)
    else:
        rows = (n + ((r // 32) % 2) * INTER).to(tl.int64)
    return rows, n < INTER


@triton.jit
def _request_item_rows(
    w_ptr,
    rows,
    n_in,
    strides,
    work,
    SP: tl.constexpr,
    BT: tl.constexpr,
    NBYTES: tl.constexpr,
    PTX: tl.constexpr,
):
    """:func:`prefetch_rows_l2` of the first ``NBYTES`` of ``rows`` of the weight of this
    program's work item's expert (none without an item); ``work`` = (items, sorted slots,
    top_k_index, slots, top_k, experts, index strides) as :func:`_work_item` takes them,
    ``strides[3:5]`` the weight's expert and row strides."""
    items_ptr, sorted_ptr, idx_ptr, n_slots, top_k, n_experts, st0, st1 = work
    e = _work_item(items_ptr, sorted_ptr, idx_ptr, n_slots, top_k, n_experts, st0, st1, SP, BT)[0]
    ptrs = w_ptr + e.to(tl.int64) * strides[3] + rows * strides[4]
    prefetch_rows_l2(ptrs, n_in & (e >= 0), NBYTES, PTX)


@triton.jit
def _request_expert_slice(down, e, CHUNK: tl.constexpr, PTX: tl.constexpr):
    """:func:`prefetch_rows_l2` of this program's slice of expert ``e``'s down weights:
    ``down`` = (pointer, bytes of one expert's [H, I] codes); the programs of a gate|up item
    (grid axis 1) take 16 chunks of ``CHUNK`` bytes each, in order, so together they cover the
    expert. The down kernel, launched next, then finds its weights in the L2."""
    down_ptr, expert_bytes = down
    off = (tl.program_id(1) * 16 + tl.arange(0, 16)).to(tl.int64) * CHUNK
    size = tl.minimum(expert_bytes - off, CHUNK)
    prefetch_rows_l2(down_ptr + e.to(tl.int64) * expert_bytes + off, size > 0, size, PTX)


@triton.jit
def _gate_up_item(
    ptrs,
    item,
    strides,
    aq_ptrs,
    aq_args,
    BT: tl.constexpr,
    TILE: tl.constexpr,
):
    """``act`` of this program's BN rows of I for the ``BT`` columns of ``item``; ``TILE`` = the
    gate|up kernel's (KDIM, INTER, BN, STAGES, PTX, trigger its dependents after the products,
    INTERLEAVED, E8M0, ACCUM, FUSE_QUANT, QUANT_X); ``ptrs`` = (x,
    x scales, weight codes, weight scales, act); ``strides`` =
    (x row, x-scale row, act row, weight expert / row / reduction, scale expert / row / block);
    ``x`` holds the tokens' E4M3 codes and ``xs`` their group scales, or with ``QUANT_X`` the
    tokens themselves, quantized per K-block in registers (``xs`` unused). The weight
    tile is blocks of 64 rows, 32 gate rows and the 32 up rows that pair with them, as in the
    BF16 kernel; a row's scale is row ``stored row // 128`` of its expert's scales.
    ``FUSE_QUANT``: the activation's group quantization follows (:func:`_quantize_group_if_last`,
    ``aq_ptrs`` / ``aq_args`` its buffers and arguments)."""
    KDIM, INTER, BN, STAGES, PTX, USE_PDL, INTERLEAVED, E8M0, ACCUM, FUSE_QUANT, QUANT_X = TILE
    x_ptr, xs_ptr, w_ptr, s_ptr, act_ptr = ptrs
    e, s, r_in, tok = item
    x_st, xs_st, act_st, w_st_e, w_st_n, w_st_k, s_st_e, s_st_n, s_st_k = strides
    rows, n_in = _gate_up_rows(INTER, BN, INTERLEAVED)
    e64 = e.to(tl.int64)
    w_rows = w_ptr + e64 * w_st_e + rows[:, None] * w_st_n
    s_rows = s_ptr + e64 * s_st_e + (rows // 128) * s_st_n
    x_cols = x_ptr + tok[None, :] * x_st
    acc = block_fp8_product(
        w_rows,
        n_in,
        w_st_k,
        s_rows,
        s_st_k,
        x_cols,
        r_in,
        xs_ptr + tok * xs_st,
        0,
        (KDIM + 127) // 128,
        KDIM,
        BT,
        STAGES,
        PTX,
        E8M0,
        ACCUM,
        QUANT=QUANT_X,
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
    if FUSE_QUANT:
        _quantize_group_if_last(act_ptr, s, r_in, aq_ptrs, aq_args, INTER, BN, PTX)


@triton.jit
def _quantize_group_if_last(
    act_ptr,
    s,
    r_in,
    aq_ptrs,
    aq_args,
    INTER: tl.constexpr,
    BN: tl.constexpr,
    PTX: tl.constexpr,
):
    """per_token_group_quant_8bit of the rounded activation, inside the gate|up kernel: this
    program counts itself in ``counters[item, group]`` (group = its 128 columns of I, whole
    ``BN``-column tiles: 128 % BN == 0; the counters zeroed by ``experts_fp8_quant.tokens_quant``)
    after its ``act`` stores, and the group's last program loads the group's ``act`` of the
    item's slots (through L2) and writes their E4M3 codes and FP32 scale with the standalone
    kernel's device function (:func:`moefuse.quant.group_triton.group_quant_tile`, the same
    lanes, eps and division): the same bytes as that kernel, at every token count. ``aq_ptrs`` =
    (codes [slots, I], scales [slots, ceil(I/128)], counters [items * ceil(I/128)]), ``aq_args`` =
    (act row, codes row, scales row strides, eps)."""
    codes_ptr, scales_ptr, count_ptr = aq_ptrs
    act_st, codes_st, scales_st, eps = aq_args
    grp = (tl.program_id(1) * BN) // 128
    first = grp * 128
    tiles = (tl.minimum(first + 128, INTER) - first + BN - 1) // BN  # programs of this group
    n_groups: tl.constexpr = (INTER + 127) // 128
    tl.debug_barrier()  # every thread's act stores precede the release below
    old = tl.atomic_add(
        count_ptr + tl.program_id(0) * n_groups + grp, 1, sem="acq_rel", scope="gpu"
    )
    if old == tiles - 1:
        tl.debug_barrier()  # the acquire precedes every thread's loads
        cols = first + tl.arange(0, 128)
        s64 = s.to(tl.int64)
        live = r_in[:, None] & (cols < INTER)[None, :]
        v = tl.load(
            act_ptr + s64[:, None] * act_st + cols[None, :],
            mask=live,
            other=0.0,
            cache_modifier=".cg",
        )
        codes, scales = (codes_ptr, codes_st), (scales_ptr, scales_st)
        store_slot_group_codes(v, live, r_in, s64, cols, grp, codes, scales, eps, PTX)


@triton.jit(launch_metadata=fp8_gemm_metadata)
def _experts_fp8_gate_up_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    items_ptr,
    sorted_ptr,
    act_ptr,
    idx_ptr,
    slot_map_ptr,
    count_ptr,
    aq_ptrs,
    strides,
    idx_strides,
    aq_args,
    sizes,
    down,
    KDIM: tl.constexpr,
    INTER: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    SP: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    BR: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    FUSE_QUANT: tl.constexpr,
    QUANT_X: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """act[s, n] = cast(silu(g_n) * u_n) with the block-scaled FP8 products of the item's
    tokens (module docstring); the roles of ``SP``, ``BR`` and the counters are those of the
    BF16 gate|up kernel (:func:`moefuse.moe.experts_triton._experts_gate_up_kernel`), ``sizes``
    = (top_k, slots, experts, counters to zero);
    ``FUSE_QUANT``: the activation's codes and scales too (:func:`_quantize_group_if_last`);
    ``QUANT_X``: ``x`` holds the tokens, quantized per K-block in registers. ``PREFETCH`` =
    (bytes, early dependents): bytes > 0 (only with ``SP`` > 0 after the tokens' quantization
    kernel, whose dependents launch after its own ``gdc_wait``, so ``top_k_index`` is
    complete), the first bytes of each of the program's weight rows are requested from the L2
    before the wait; early dependents, the kernel next in the stream may launch right after the
    wait, not after the products; down chunk bytes > 0, after its products each program asks
    the L2 for its slice of its expert's down weights (:func:`_request_expert_slice`; ``down``
    = (the down weights' codes, bytes per expert))."""
    top_k, n_slots, n_experts, n_count = sizes
    idx_st0, idx_st1 = idx_strides
    ptrs = (x_ptr, xs_ptr, w_ptr, s_ptr, act_ptr)
    if PREFETCH[0] > 0:
        work = (items_ptr, sorted_ptr, idx_ptr, n_slots, top_k, n_experts, idx_st0, idx_st1)
        rows, n_in = _gate_up_rows(INTER, BN, INTERLEAVED)
        _request_item_rows(w_ptr, rows, n_in, strides, work, SP, BT, PREFETCH[0], PTX)
    TRIGGER_AFTER_LOOP: tl.constexpr = USE_PDL and not PREFETCH[1]
    TILE: tl.constexpr = (
        KDIM,
        INTER,
        BN,
        STAGES,
        PTX,
        TRIGGER_AFTER_LOOP,
        INTERLEAVED,
        E8M0,
        ACCUM,
        FUSE_QUANT,
        QUANT_X,
    )
    if USE_PDL:
        gdc_wait()
        if PREFETCH[1]:
            gdc_launch_dependents()
    if SP > 0:
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            _write_slot_map(idx_ptr, slot_map_ptr, n_slots, top_k, n_experts, idx_st0, idx_st1, SP)
            c0 = 0
            while c0 < n_count:
                cs = c0 + tl.arange(0, 128)
                tl.store(count_ptr + cs, tl.zeros([128], tl.int32), mask=cs < n_count)
                c0 += 128
    if BR > 0 and _tail_item(items_ptr, BR):
        tail = _item_tokens(items_ptr, sorted_ptr, top_k, BR)
        _gate_up_item(ptrs, tail, strides, aq_ptrs, aq_args, BR, TILE)
    else:
        item = _work_item(
            items_ptr, sorted_ptr, idx_ptr, n_slots, top_k, n_experts, idx_st0, idx_st1, SP, BT
        )
        if item[0] >= 0:
            _gate_up_item(ptrs, item, strides, aq_ptrs, aq_args, BT, TILE)
            if PREFETCH[2] > 0:
                _request_expert_slice(down, item[0], PREFETCH[2], PTX)


@triton.jit
def _down_item(
    act_ptr,
    as_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    item,
    rows,
    strides,
    BT: tl.constexpr,
    TILE: tl.constexpr,
):
    """``y`` of ``rows`` = (rows of H, in range) for the ``BT`` columns of ``item``; ``TILE`` =
    the down kernel's (KDIM, STAGES, PTX, USE_PDL, E8M0, ACCUM, QUANT_A); ``strides``
    = (act row, act-scale row, y row, weight expert / row / reduction, scale expert / row /
    block); ``act`` holds the activation's E4M3 codes and ``as`` their group scales, or with
    ``QUANT_A`` the rounded activation itself, quantized per K-block in registers (``as``
    unused)."""
    KDIM, STAGES, PTX, USE_PDL, E8M0, ACCUM, QUANT_A = TILE
    e, s, r_in, _tok = item
    n, n_in = rows
    act_st, as_st, y_st, w_st_e, w_st_n, w_st_k, s_st_e, s_st_n, s_st_k = strides
    e64 = e.to(tl.int64)
    n64 = n.to(tl.int64)
    w_rows = w_ptr + e64 * w_st_e + n64[:, None] * w_st_n
    # rows from a multiple of a tile of at most 128: one weight-scale row for the whole tile
    TILE_SCALE: tl.constexpr = n.shape[0] <= 128
    if TILE_SCALE:
        s_rows = s_ptr + e64 * s_st_e + (tl.min(n64, axis=0) // 128) * s_st_n
    else:
        s_rows = s_ptr + e64 * s_st_e + (n64 // 128) * s_st_n
    s64 = s.to(tl.int64)
    acc = block_fp8_product(
        w_rows,
        n_in,
        w_st_k,
        s_rows,
        s_st_k,
        act_ptr + s64[None, :] * act_st,
        r_in,
        as_ptr + s64 * as_st,
        0,
        (KDIM + 127) // 128,
        KDIM,
        BT,
        STAGES,
        PTX,
        E8M0,
        ACCUM,
        0,
        TILE_SCALE,
        QUANT_A,
    )
    if USE_PDL:
        gdc_launch_dependents()
    tl.store(y_ptr + s64[None, :] * y_st + n[:, None], acc, mask=n_in[:, None] & r_in[None, :])


@triton.jit(launch_metadata=fp8_gemm_metadata)
def _experts_fp8_down_kernel(
    act_ptr,
    as_ptr,
    w_ptr,
    s_ptr,
    items_ptr,
    sorted_ptr,
    y_ptr,
    idx_ptr,
    fin_out,
    count_ptr,
    strides,
    idx_strides,
    fin_strides,
    top_k,
    n_slots,
    n_experts,
    rsf,
    KDIM: tl.constexpr,
    H: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    SP: tl.constexpr,
    FINALIZE: tl.constexpr,
    EXTRAS: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    BR: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    QUANT_A: tl.constexpr,
    PF_BYTES: tl.constexpr,
):
    """y[s, h] = the block-scaled FP8 product of act[s] and down row h (FP32, unrounded); with
    ``FINALIZE`` the last program of each H tile runs the finalize, as in the BF16 down kernel
    (:func:`moefuse.moe.experts_triton._experts_down_kernel`); ``fin_out`` = the finalize's
    (slot map, top_k_weights, bias, shared expert output, out); ``QUANT_A``: ``act`` holds the
    rounded activation, quantized per K-block in registers. ``PF_BYTES`` > 0 (``SP`` > 0): the
    first ``PF_BYTES`` of each of the program's weight rows are requested before the wait
    (``top_k_index`` is complete: the kernel before this one launches its dependents after its
    own ``gdc_wait``, which follows the gate|up kernel's)."""
    map_ptr, scale_ptr, bias_ptr, shared_ptr, out_ptr = fin_out
    idx_st0, idx_st1 = idx_strides
    fin_ptrs = (map_ptr, scale_ptr, bias_ptr, idx_ptr, shared_ptr, out_ptr)
    if PF_BYTES > 0:
        work = (items_ptr, sorted_ptr, idx_ptr, n_slots, top_k, n_experts, idx_st0, idx_st1)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        _request_item_rows(w_ptr, rows.to(tl.int64), rows < H, strides, work, SP, BT, PF_BYTES, PTX)
    if USE_PDL:
        gdc_wait()  # act from the gate|up kernel
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    n_in = n < H
    TILE: tl.constexpr = (KDIM, STAGES, PTX, USE_PDL, E8M0, ACCUM, QUANT_A)
    if BR > 0 and _tail_item(items_ptr, BR):
        tail = _item_tokens(items_ptr, sorted_ptr, top_k, BR)
        _down_item(act_ptr, as_ptr, w_ptr, s_ptr, y_ptr, tail, (n, n_in), strides, BR, TILE)
    else:
        item = _work_item(
            items_ptr, sorted_ptr, idx_ptr, n_slots, top_k, n_experts, idx_st0, idx_st1, SP, BT
        )
        if item[0] >= 0:
            _down_item(act_ptr, as_ptr, w_ptr, s_ptr, y_ptr, item, (n, n_in), strides, BT, TILE)
    if FINALIZE:
        y_st = strides[2]
        map_st, scale_st, bias_st, shared_st, out_st = fin_strides
        fin_st = (y_st, map_st, scale_st, bias_st, idx_st0, idx_st1, shared_st, out_st)
        _finalize_if_last(
            y_ptr, fin_ptrs, count_ptr, n, n_in, n_slots, top_k, n_experts, fin_st, rsf, EXTRAS, PTX
        )


# ----------------------------------------------------------------------------- launcher
def _scale_arg(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the tensor the kernel reads, UE8M0): UE8M0 scales as their bytes."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.view(torch.uint8), True
    return scale, False


def _prefetch_bytes(cfg: dict, plan, weights: torch.Tensor, use_pdl: bool, ptx: bool) -> int:
    """The kernels' ``PF_BYTES``: :func:`moefuse.moe.fp8_device.prefetch_row_bytes` of
    ``cfg["prefetch"]`` where the programs can name their work item before their ``gdc_wait``
    (PDL on, items computed in the program from ``top_k_index``: ``plan.sp`` > 0, the tokens'
    quantization launched just before); 0 elsewhere."""
    want = int(cfg.get("prefetch", 0))
    if not (want and use_pdl and ptx and plan.sp > 0) or cfg.get("fuse_tokens_quant"):
        return 0
    return prefetch_row_bytes(want, weights)


def _prefetch_down_bytes(cfg: dict, down: torch.Tensor | None, programs: int, ptx: bool) -> int:
    """The gate|up kernel's down chunk bytes (``PREFETCH[2]``) for the tile key
    ``prefetch_down``: each of an item's ``programs`` asks the L2 for 16 chunks of its expert's
    down weights, together the whole expert; 0 without the key, in the interpreter, or where an
    expert's codes are not one contiguous, 16-byte aligned run of a multiple of 16 bytes."""
    if not (cfg.get("prefetch_down") and ptx) or down is None:
        return 0
    _, h, i = down.shape
    expert = h * i
    if down.stride() != (expert, i, 1) or down.data_ptr() % 16 or expert % 16:
        return 0
    return -(-expert // (programs * 16 * 16)) * 16


def _tma_gate_up(
    cfg: dict,
    token_tile: int,
    plan_kernel: bool,
    weight: torch.Tensor,
    interleaved: bool,
    inter: int,
) -> bool:
    """Whether the tile's ``tma`` key runs the gate|up GEMM by
    :mod:`moefuse.moe.experts_fp8_tma` (its readiness and scale-block rules: 128 rows take a
    stacked gate|up with I % 128 == 0; an interleaved one needs ``bn_gate_up`` <= 64)."""
    return (
        bool(cfg.get("tma"))
        and tma_experts_ready(weight, cfg, token_tile, plan_kernel=plan_kernel)
        and gate_up_tma_fits(inter, cfg["bn_gate_up"], interleaved)
    )


def policy_token_tile(slots: int, experts: int, weight, inter: int, interleaved: bool) -> int:
    """The token tile of the policy (:func:`moefuse.moe.tiles.experts_fp8_token_tile`) for the
    gate|up ``weight`` [E, 2I, H]: its 64-slot TMA items only where their gate|up GEMM takes the
    TMA launch on a stacked layout (the measured case). Elsewhere the token tile without them:
    the pointer gate|up at 64 columns is slower than at 128 (Qwen3 T = 2,048, H100: 787.6 against
    568.0 us, notes/moe-experts-fp8.md), and the interleaved TMA gate|up has not run on a GPU."""
    token_tile = experts_fp8_token_tile(slots, experts)
    if token_tile != EXPERTS_FP8_TMA64_TOKEN_TILE:
        return token_tile
    cfg = experts_fp8_tile(weight.shape[-1], inter, token_tile, slots, experts)
    if not interleaved and _tma_gate_up(cfg, token_tile, True, weight, interleaved, inter):
        return token_tile  # (above the decode slots the plan kernel writes the work items)
    return experts_fp8_token_tile(slots, experts, tma64=False)


def _pointer_tile(cfg: dict) -> dict:
    """The pointer kernels' tile for a GEMM the ``tma`` key could not run: the narrow rows and
    warps (:data:`moefuse.moe.tiles.EXPERTS_FP8_NARROW`) with the activation's quantization as
    a launch of its own, as measured on that kernel at many tokens."""
    return {**cfg, **EXPERTS_FP8_NARROW, "fuse_act_quant": False} if cfg.get("tma") else cfg


def _tma_down(cfg: dict, plan, weight: torch.Tensor, quant_a: bool) -> bool:
    """Whether the tile's ``tma`` key runs the down GEMM by :mod:`moefuse.moe.experts_fp8_tma`:
    its readiness, a row tile inside one scale block, the finalize a launch of its own and the
    activation's codes given (not quantized inside the GEMM)."""
    down_cfg = dict(cfg, warps=cfg.get("down_warps", cfg["warps"]))
    return (
        bool(cfg.get("tma"))
        and not (plan.fused or quant_a)
        and 128 % cfg["bn_down"] == 0
        and tma_experts_ready(weight, down_cfg, plan.bt, plan_kernel=plan.sp == 0)
    )


def _wgmma_down(cfg: dict, plan, a: torch.Tensor) -> bool:
    """Whether the down GEMM runs :mod:`moefuse.moe.experts_fp8_wgmma` (tile key ``down_wgmma``,
    where :func:`_tma_down` holds): on the GPU, a 64- or 128-row tile, one accumulator row set
    per warp (``plan.bt`` = 16 x warps) and 16-byte aligned activation rows (16-byte copies)."""
    warps = cfg.get("down_warps", cfg["warps"])
    return (
        bool(cfg.get("down_wgmma"))
        and not interpreter_active()
        and cfg["bn_down"] in (64, 128)
        and plan.bt == 16 * warps
        and a.stride(0) % 16 == 0
        and a.data_ptr() % 16 == 0
    )


def _launch_gate_up_pointer(
    operands, plan, cfg, top_k_index, experts, quant, interleaved, use_pdl, down_proj
) -> None:
    """The pointer kernel's gate|up launch of :func:`_launch_gate_up_fp8`: ``operands`` = (token
    codes or, with ``QUANT_X``, the tokens; their scales; the gate|up codes; their block
    scales; whether those are UE8M0), ``quant`` = (activation codes, their scales, the fused
    quantization's counters, ``FUSE_QUANT``, ``QUANT_X``)."""
    x, xs, gw, gs, gs_e8 = operands
    a, a_s, q_count, fuse_quant, quant_x = quant
    hidden, inter = x.shape[1], plan.act.shape[1]
    slots_all = top_k_index.numel()
    ptx = not interpreter_active()
    pf_bytes = _prefetch_bytes(cfg, plan, gw, use_pdl, ptx)
    programs = triton.cdiv(inter, cfg["bn_gate_up"])
    pf_down = _prefetch_down_bytes(cfg, down_proj, programs, ptx)
    down = (fp8_codes(down_proj), down_proj.shape[1] * down_proj.shape[2]) if pf_down else (gw, 0)
    strides = (x.stride(0), xs.stride(0), plan.act.stride(0), *gw.stride(), *gs.stride())
    launch(
        _experts_fp8_gate_up_kernel,
        (plan.n_items, programs),
        x,
        xs,
        gw,
        gs,
        plan.items,
        plan.sorted_slots,
        plan.act,
        top_k_index,
        plan.slot_map,
        plan.counters,
        (a, a_s, q_count),
        strides,
        (top_k_index.stride(0), top_k_index.stride(1)),
        (plan.act.stride(0), a.stride(0), a_s.stride(0), GROUP_EPS),
        (top_k_index.shape[1], slots_all, experts, plan.counters.numel() if plan.fused else 0),
        down,
        KDIM=hidden,
        INTER=inter,
        BN=cfg["bn_gate_up"],
        BT=plan.bt,
        STAGES=cfg["stages"],
        SP=plan.sp,
        PTX=ptx,
        USE_PDL=use_pdl,
        BR=plan.br,
        INTERLEAVED=interleaved,
        E8M0=gs_e8,
        ACCUM=cfg["accumulation"],
        FUSE_QUANT=fuse_quant,
        QUANT_X=quant_x,
        PREFETCH=(pf_bytes, bool(pf_bytes and cfg.get("early_dependents")), pf_down),
        num_warps=cfg["warps"],
        enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
    )


def _launch_gate_up_fp8(
    hidden_states,
    gate_up_proj,
    gate_up_proj_scale_inv,
    top_k_index,
    experts,
    plan,
    cfg,
    interleaved: bool,
    use_pdl: bool,
    down_proj: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens' group quantization and the gate|up kernel: ``plan.act`` and what the down
    kernel reads of the activation: its E4M3 codes [T*K, I] and FP32 group scales [T*K,
    ceil(I/128)], from the gate|up kernel itself with ``cfg["fuse_act_quant"]`` (rows of valid
    slots written) or from per_token_group_quant_8bit's kernel on ``plan.act`` (every row); or,
    with ``cfg["down_act_quant"]``, ``plan.act`` twice (the down kernel quantizes it per
    K-block). ``cfg["fuse_tokens_quant"]``: the gate|up kernel quantizes the tokens per K-block
    (no launch of their own; the fused quantization's counters then zeroed by a memset)."""
    inter = plan.act.shape[1]
    gs, gs_e8 = _scale_arg(gate_up_proj_scale_inv)
    gw = fp8_codes(gate_up_proj)
    slots_all, dev = top_k_index.numel(), hidden_states.device
    n_groups = triton.cdiv(inter, 128)
    quant_x = bool(cfg.get("fuse_tokens_quant"))
    # a TMA program quantizes whole 128-channel groups only
    split_groups = bool(cfg.get("fuse_act_quant")) and cfg["bn_gate_up"] != 128
    tma = _tma_gate_up(cfg, plan.bt, plan.sp == 0, gw, interleaved, inter) and not (
        quant_x or split_groups
    )
    cfg = cfg if tma else _pointer_tile(cfg)
    down_quant = bool(cfg.get("down_act_quant"))
    fuse_quant = not down_quant and bool(cfg.get("fuse_act_quant")) and 128 % cfg["bn_gate_up"] == 0
    if fuse_quant:  # the activation's codes and scales, written by the gate|up kernel
        a = torch.empty(slots_all, inter, dtype=torch.uint8, device=dev)
        a_s = torch.empty(slots_all, n_groups, dtype=torch.float32, device=dev)
        if tma:  # its programs hold whole groups: no counters to zero
            q_count = plan.act
            x, xs = group_quant_rows(hidden_states, use_pdl)
        elif quant_x:
            q_count = torch.zeros(plan.n_items * n_groups, dtype=torch.int32, device=dev)
        else:
            q_count = torch.empty(plan.n_items * n_groups, dtype=torch.int32, device=dev)
            x, xs = tokens_quant(hidden_states, q_count, q_count.numel(), use_pdl)
    else:
        a = a_s = q_count = plan.act
        if not quant_x:
            x, xs = group_quant_rows(hidden_states, use_pdl)
    if quant_x:
        x = xs = hidden_states
    if tma:
        launch_gate_up_fp8_tma(x, xs, gw, gs, gs_e8, plan, top_k_index.shape[1], cfg,
                               interleaved, use_pdl, (a, a_s) if fuse_quant else None)  # fmt: skip
    else:
        _launch_gate_up_pointer(
            (x, xs, gw, gs, gs_e8),
            plan,
            cfg,
            top_k_index,
            experts,
            (a, a_s, q_count, fuse_quant, quant_x),
            interleaved,
            use_pdl,
            down_proj,
        )
    if fuse_quant:
        return fp8_codes(a), a_s
    if down_quant:
        return plan.act, plan.act
    return group_quant_rows(plan.act, use_pdl)


def _gate_up_stage(
    hidden_states,
    gate_up_proj,
    gate_up_proj_scale_inv,
    top_k_index,
    interleaved: bool,
    use_pdl: bool,
    tile: dict | None,
    token_tile: int | None,
    down_proj: torch.Tensor | None = None,
):
    """The tile policy (:func:`moefuse.moe.tiles.experts_fp8_tile`, the decode keys, then
    ``tile``), the routing plan and the gate|up launch of :func:`launch_moe_experts_fp8`:
    ``(plan, cfg, activation codes, their group scales)``; ``down_proj``: the down weights the
    gate|up programs may ask the L2 for (tile key ``prefetch_down``)."""
    experts, two_i, hidden = gate_up_proj.shape
    inter = two_i // 2
    slots = top_k_index.numel()
    token_tile = token_tile or policy_token_tile(slots, experts, gate_up_proj, inter, interleaved)
    cfg = {
        **experts_fp8_tile(hidden, inter, token_tile, slots, experts),
        **experts_fp8_decode_tile(hidden, inter, token_tile, slots),
        **(tile or {}),
    }
    plan = _plan(hidden_states, top_k_index, experts, inter, cfg, token_tile, use_pdl)
    a, a_s = _launch_gate_up_fp8(
        hidden_states,
        gate_up_proj,
        gate_up_proj_scale_inv,
        top_k_index,
        experts,
        plan,
        cfg,
        interleaved,
        use_pdl,
        down_proj,
    )
    return plan, cfg, a, a_s


def _finalize(plan, top_k_index, top_k_weights, out, bias, shared, rsf: float, use_pdl: bool):
    """The deterministic finalize of ``plan.y`` into ``out`` as its own launch (the down kernel
    runs it itself up to the plan's fused limit)."""
    eids = None
    if bias is not None:
        eids = top_k_index if top_k_index.stride(1) == 1 else top_k_index.contiguous()
    launch_moe_finalize(
        plan.y, plan.slot_map, top_k_weights, out, bias, eids, rsf, shared, True, use_pdl
    )


def _launch_down_fp8(a, a_s, dw, ds, ds_e8, plan, cfg, top_k_index, routing, extras, use_pdl):
    """The pointer kernel's down GEMM (and, with ``plan.fused``, the finalize) of
    :func:`launch_moe_experts_fp8`: ``routing`` = (top_k_weights, out), ``extras`` = (bias,
    shared expert output, routed scaling factor, expert count)."""
    top_k_weights, out = routing
    bias, shared, rsf, experts = extras
    hidden, y = out.shape[1], plan.y
    ptx = not interpreter_active()
    cfg = _pointer_tile(cfg)
    strides = (a.stride(0), a_s.stride(0), y.stride(0), *dw.stride(), *ds.stride())
    fin_strides = (
        plan.slot_map.stride(0),
        top_k_weights.stride(0),
        bias.stride(0) if bias is not None else 0,
        shared.stride(0) if shared is not None else 0,
        out.stride(0),
    )
    quant_a = bool(cfg.get("down_act_quant"))
    launch(
        _experts_fp8_down_kernel,
        (plan.n_items, triton.cdiv(hidden, cfg["bn_down"])),
        a,
        a_s,
        dw,
        ds,
        plan.items,
        plan.sorted_slots,
        y,
        top_k_index,
        (
            plan.slot_map,
            top_k_weights,
            bias if bias is not None else y,
            shared if shared is not None else y,
            out,
        ),
        plan.counters,
        strides,
        (top_k_index.stride(0), top_k_index.stride(1)),
        fin_strides,
        top_k_index.shape[1],
        top_k_index.numel(),
        experts,
        rsf,
        KDIM=dw.shape[2],
        H=hidden,
        BN=cfg["bn_down"],
        BT=plan.bt,
        STAGES=cfg.get("down_stages", cfg["stages"]),
        SP=plan.sp,
        FINALIZE=plan.fused,
        EXTRAS=(bias is not None, rsf != 1.0, shared is not None),
        PTX=ptx,
        USE_PDL=use_pdl,
        BR=plan.br,
        E8M0=ds_e8,
        ACCUM=cfg["accumulation"],
        QUANT_A=quant_a,
        PF_BYTES=_prefetch_bytes(cfg, plan, dw, use_pdl, ptx),
        num_warps=cfg.get("down_warps", cfg["warps"]),
        enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
    )


def launch_moe_experts_fp8(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_proj_scale_inv: torch.Tensor,
    down_proj: torch.Tensor,
    down_proj_scale_inv: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    out: torch.Tensor,
    bias: torch.Tensor | None,
    shared_expert_output: torch.Tensor | None,
    routed_scaling_factor: float,
    interleaved: bool,
    use_pdl: bool,
    *,
    tile: dict | None = None,
    token_tile: int | None = None,
) -> None:
    """Writes ``out`` [T, H] (module docstring). ``tile`` / ``token_tile`` override the policy of
    :func:`moefuse.moe.tiles.experts_fp8_tile` (benchmarks and the invariance tests only)."""
    tokens, hidden = hidden_states.shape
    if tokens == 0 or hidden == 0:
        return
    plan, cfg, a, a_s = _gate_up_stage(
        hidden_states,
        gate_up_proj,
        gate_up_proj_scale_inv,
        top_k_index,
        interleaved,
        use_pdl,
        tile,
        token_tile,
        down_proj,
    )
    ds, ds_e8 = _scale_arg(down_proj_scale_inv)
    dw = fp8_codes(down_proj)
    rsf = float(routed_scaling_factor)
    finalize = (plan, top_k_index, top_k_weights, out, bias, shared_expert_output, rsf, use_pdl)
    if _tma_down(cfg, plan, dw, bool(cfg.get("down_act_quant"))):
        if _wgmma_down(cfg, plan, a):
            from moefuse.moe.experts_fp8_wgmma import launch_down_fp8_wgmma

            launch_down_fp8_wgmma(a, a_s, dw, ds, ds_e8, plan, cfg, use_pdl)
            _finalize(*finalize)
            return
        launch_down_fp8_tma(a, a_s, dw, ds, ds_e8, plan, top_k_index.shape[1], cfg, use_pdl)
        _finalize(*finalize)
        return
    _launch_down_fp8(
        a,
        a_s,
        dw,
        ds,
        ds_e8,
        plan,
        cfg,
        top_k_index,
        (top_k_weights, out),
        (bias, shared_expert_output, rsf, gate_up_proj.shape[0]),
        use_pdl,
    )
    if not plan.fused:
        _finalize(*finalize)


def gate_up_activation_codes(
    hidden_states,
    gate_up_proj,
    gate_up_proj_scale_inv,
    top_k_index,
    *,
    interleaved=False,
    use_pdl=False,
    tile: dict | None = None,
    token_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``act`` [T*K, I], its E4M3 codes as uint8, its FP32 group scales, valid slots [T*K]
    bool) after the gate|up stage of :func:`launch_moe_experts_fp8` with the same tile policy
    and overrides: what the down kernel reads (tests: the fused quantization's bytes against
    per_token_group_quant_8bit of ``act``, on the valid slots' rows)."""
    plan, _, a, a_s = _gate_up_stage(
        hidden_states,
        gate_up_proj,
        gate_up_proj_scale_inv,
        top_k_index,
        interleaved,
        use_pdl,
        tile,
        token_tile,
    )
    valid = (top_k_index >= 0) & (top_k_index < gate_up_proj.shape[0])
    return plan.act, a.view(torch.uint8), a_s, valid.reshape(-1)
