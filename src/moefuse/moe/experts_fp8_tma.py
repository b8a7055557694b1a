"""The FP8 experts' GEMMs at many tokens with the tokens on the MMA's M side and the weight tiles
loaded by the Tensor Memory Accelerator (tile key ``tma`` of :func:`launch_moe_experts_fp8`).

The products and their order are :mod:`moefuse.moe.experts_fp8`'s: per K-block ``b`` ascending,
``dot_b`` of the block's E4M3 codes from a zero accumulator (:func:`fp8_block_dot`), then
``acc = fma(dot_b, xs[t, b] * Ws[row / 128, b], acc)`` from +0.0; gate|up then
``cast(silu(g) * u)``, down the FP32 sum. What changes is the program's shape, as in
``fp8_linear``'s TMA launch (:mod:`moefuse.moe.linear_tma`):

* ``BT`` slots of one work item (the routing plan's: one expert, slots in sorted order) x ``BN``
  weight rows, the slots as the MMA's M operand. A thread holds two token rows of each
  accumulator, so the per-token scales cost two registers, and a tile's weight rows lie in one
  128-row scale block, so the weight scale is one scalar per K-block (gate and up: one each).
* The weight tiles (one expert's rows, contiguous) arrive by TMA through host-side descriptors
  over the weight viewed as ``[experts * rows, K]`` rows: no address registers. The slots' rows
  are gathered by the plan's order, so they stay pointer loads (Hopper's TMA has no row gather).
  A tile's rows past I (or H) read the next expert's rows or zeros: their columns are never
  stored, and each column's sum is its own.

The FP8 MMA's ``dot_b`` of a (token, weight row) pair has the same bits whichever operand is the
M side (measured for ``fp8_linear``, H100, block accumulation), so a slot's bits do not depend on
the launch, the batch or the tile. Used at many tokens only: the routing plan's kernel has
written the work items (no inline plan, no finalize inside the down kernel, no quantization
inside the GEMMs), the token tile fills the 64-row MMAs of its warpgroups, and the weights are
TMA-readable (:func:`tma_experts_ready`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

from moefuse._device import fma_rn, round_to
from moefuse._fastpath import launch
from moefuse._runtime import pdl_launch_kwargs, sm_count
from moefuse.moe.experts_fp8_quant import store_slot_group_codes
from moefuse.moe.experts_triton import _item_tokens, _item_tokens_at, experts_gemm_metadata
from moefuse.moe.fp8_device import _GROUP_EPS, fp8_block_dot, scale_f32

#: launch metadata of every FP8 experts GEMM kernel (one byte per weight element)
fp8_gemm_metadata = experts_gemm_metadata(1)


@triton.jit
def _slot_block_product(
    col_rows,
    r_in,
    cs_rows,
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
    """FP32 ``acc[j] = fma(dot_b, cs[t, b] * Ws_j[b], acc[j])`` over the K-blocks ``b``
    ascending from +0.0, for each of the one or two weight tiles ``descs[j]`` (rows ``row0`` ..
    ``row0 + BN``, block-scale row pointer ``s_ptrs[j]``, block stride ``s_st_k``): slot rows
    ``col_rows`` [BT] (E4M3 codes, unit stride; ``r_in``: in use) with their group scales from
    ``cs_rows`` [BT]. Returns two [BT, BN] sums (the second +0.0 with one descriptor)."""
    BT: tl.constexpr = col_rows.shape[0]
    TWO: tl.constexpr = len(descs) == 2
    acc0 = tl.zeros([BT, BN], dtype=tl.float32)
    acc1 = tl.zeros([BT, BN], dtype=tl.float32)
    for b in tl.range(0, (KDIM + 127) // 128, num_stages=STAGES):
        kk = b * 128 + tl.arange(0, 128)
        live = r_in[:, None] & (kk < KDIM)[None, :]
        q = tl.load(col_rows[:, None] + kk[None, :], mask=live, other=0.0)
        xs = tl.load(cs_rows + b, mask=r_in, other=0.0)
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
def _experts_fp8_gate_up_tma_kernel(
    x_ptr,
    xs_ptr,
    gate_desc,
    up_desc,
    s_ptr,
    items_ptr,
    sorted_ptr,
    act_ptr,
    strides,
    top_k,
    aq_ptrs,
    aq_strides,
    KDIM: tl.constexpr,
    INTER: tl.constexpr,
    PITCH: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    QUANT: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """act[s, n] = cast(silu(g_n) * u_n) for the ``BT`` slots of work item ``program_id(0)`` and
    the ``BN`` rows of I from ``program_id(1) * BN``; ``gate_desc`` / ``up_desc`` read the gate
    and up rows, row ``e * PITCH + n`` for row ``n`` of expert ``e``; ``strides`` = (x row,
    x-scale row, act row, scale expert / row / block). A gate (up) row's scale is row ``stored
    row // 128`` of its expert's scales: ``n // 128`` and ``(I + n) // 128`` stacked, ``2n //
    128`` for both interleaved. ``QUANT`` (``BN`` = 128: the program holds whole 128-channel
    groups): instead of ``act``, its per_token_group_quant_8bit codes and FP32 scales, from the
    rounded values in registers with that op's device function (the standalone kernel's bytes);
    ``aq_ptrs`` = (codes [T*K, I], scales [T*K, ceil(I/128)]), ``aq_strides`` their row strides."""
    if USE_PDL:
        gdc_wait()  # the tokens' codes
    e, s, r_in, tok = _item_tokens(items_ptr, sorted_ptr, top_k, BT)
    if e >= 0:
        n0 = tl.program_id(1) * BN
        ins = (x_ptr, xs_ptr, gate_desc, up_desc, s_ptr)
        g, u = _gate_up_tma_product(
            e, r_in, tok, n0, ins, strides, KDIM, INTER, PITCH, BN, STAGES, INTERLEAVED, E8M0,
            ACCUM, PTX,
        )  # fmt: skip
        if USE_PDL:
            gdc_launch_dependents()
        outs = (act_ptr, strides[2], aq_ptrs, aq_strides)
        _gate_up_tma_store(g, u, s, r_in, n0, outs, INTER, BN, QUANT, PTX)


@triton.jit
def _gate_up_tma_product(
    e,
    r_in,
    tok,
    n0,
    ins,
    strides,
    KDIM: tl.constexpr,
    INTER: tl.constexpr,
    PITCH: tl.constexpr,
    BN: tl.constexpr,
    STAGES: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    PTX: tl.constexpr,
):
    """The gate and up sums [BT, BN] of :func:`_experts_fp8_gate_up_tma_kernel`'s tile (expert
    ``e``, slots' token rows ``tok``, rows of I from ``n0``); ``ins`` = (token codes, their
    scales, gate and up descriptors, weight scales)."""
    x_ptr, xs_ptr, gate_desc, up_desc, s_ptr = ins
    x_st, xs_st, _act_st, s_st_e, s_st_n, s_st_k = strides
    if INTERLEAVED:
        g_row = (2 * n0) // 128
        u_row = g_row
    else:
        g_row = n0 // 128
        u_row = (INTER + n0) // 128
    s_e = s_ptr + e.to(tl.int64) * s_st_e
    return _slot_block_product(
        x_ptr + tok * x_st,
        r_in,
        xs_ptr + tok * xs_st,
        (gate_desc, up_desc),
        e * PITCH + n0,
        (s_e + g_row * s_st_n, s_e + u_row * s_st_n),
        s_st_k,
        KDIM,
        BN,
        STAGES,
        PTX,
        E8M0,
        ACCUM,
    )


@triton.jit
def _gate_up_tma_store(
    g, u, s, r_in, n0, outs, INTER: tl.constexpr, BN: tl.constexpr, QUANT: tl.constexpr, PTX
):
    """``cast(silu(g) * u)`` of the tile's slots ``s`` and rows of I from ``n0`` into ``act``, or
    with ``QUANT`` its group codes and scales; ``outs`` = (act, act row stride, (codes,
    scales), their row strides)."""
    act_ptr, act_st, aq_ptrs, aq_strides = outs
    BT: tl.constexpr = g.shape[0]
    act = g / (1.0 + tl.exp(-g)) * u  # silu(gate) * up, FP32
    n = n0 + tl.arange(0, BN)
    s64 = s.to(tl.int64)
    live = r_in[:, None] & (n < INTER)[None, :]
    val = round_to(act, act_ptr.dtype.element_ty, PTX)
    if QUANT:
        codes_ptr, scales_ptr = aq_ptrs
        eps = tl.full([BT, 1], _GROUP_EPS, tl.float32)
        codes, scales = (codes_ptr, aq_strides[0]), (scales_ptr, aq_strides[1])
        store_slot_group_codes(val, live, r_in, s64, n, n0 // 128, codes, scales, eps, PTX)
    else:
        tl.store(act_ptr + s64[:, None] * act_st + n[None, :], val, mask=live)


@triton.jit
def _gate_up_tma_tile(
    j,
    walk,
    KDIM: tl.constexpr,
    INTER: tl.constexpr,
    PITCH: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    QUANT: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    PTX: tl.constexpr,
):
    """Tile ``j`` of :func:`_experts_fp8_gate_up_tma_persistent_kernel`: work item ``j % used``
    x the ``BN`` rows of I from ``(j // used) * BN``; ``walk`` = (items, sorted slots, top_k,
    used, the product's ``ins``, the store's ``outs``, strides)."""
    items_ptr, sorted_ptr, top_k, used, ins, outs, strides = walk
    e, s, r_in, tok = _item_tokens_at(items_ptr, sorted_ptr, j % used, top_k, BT)
    n0 = (j // used) * BN
    g, u = _gate_up_tma_product(
        e, r_in, tok, n0, ins, strides, KDIM, INTER, PITCH, BN, STAGES, INTERLEAVED, E8M0, ACCUM,
        PTX,
    )  # fmt: skip
    _gate_up_tma_store(g, u, s, r_in, n0, outs, INTER, BN, QUANT, PTX)


@triton.jit(launch_metadata=fp8_gemm_metadata)
def _experts_fp8_gate_up_tma_persistent_kernel(
    x_ptr,
    xs_ptr,
    gate_desc,
    up_desc,
    s_ptr,
    items_ptr,
    sorted_ptr,
    act_ptr,
    strides,
    top_k,
    aq_ptrs,
    aq_strides,
    n_items,
    KDIM: tl.constexpr,
    INTER: tl.constexpr,
    PITCH: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    QUANT: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """:func:`_experts_fp8_gate_up_tma_kernel`'s tiles on a persistent grid, walked as
    :func:`_experts_fp8_down_tma_persistent_kernel` walks the down tiles (tile ``j``: item ``j %
    used`` x rows of I from ``(j // used) * BN``; the tile loop flattened into the K loop). The
    same bits."""
    if USE_PDL:
        gdc_wait()  # the tokens' codes
    used = _items_in_use(items_ptr, n_items)
    n_tiles = used * ((INTER + BN - 1) // BN)
    used = tl.maximum(used, 1)
    ins = (x_ptr, xs_ptr, gate_desc, up_desc, s_ptr)
    outs = (act_ptr, strides[2], aq_ptrs, aq_strides)
    walk = (items_ptr, sorted_ptr, top_k, used, ins, outs, strides)
    if PTX:  # a for loop, which Triton can flatten into the K loop
        for j in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=True):
            _gate_up_tma_tile(
                j, walk, KDIM, INTER, PITCH, BN, BT, STAGES, INTERLEAVED, QUANT, E8M0, ACCUM, PTX
            )
    else:  # the interpreter's range() takes no tensors: the same tiles by a while loop
        j = tl.program_id(0)
        while j < n_tiles:
            _gate_up_tma_tile(
                j, walk, KDIM, INTER, PITCH, BN, BT, STAGES, INTERLEAVED, QUANT, E8M0, ACCUM, PTX
            )
            j += tl.num_programs(0)
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def _items_in_use(items_ptr, n_items):
    """The plan's work items in use: the first record with expert -1 (they are a prefix of the
    ``n_items`` records), or ``n_items``; by bisection."""
    lo = 0
    hi = n_items
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(items_ptr + mid * 3) >= 0:
            lo = mid + 1
        else:
            hi = mid
    return lo


@triton.jit(launch_metadata=fp8_gemm_metadata)
def _experts_fp8_down_tma_kernel(
    a_ptr,
    as_ptr,
    w_desc,
    s_ptr,
    items_ptr,
    sorted_ptr,
    y_ptr,
    strides,
    top_k,
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
    """y[s, h] (FP32, unrounded) for the ``BT`` slots of work item ``program_id(0)`` and the
    ``BN`` rows of H from ``program_id(1) * BN`` (``BN`` divides 128: one scale row);
    ``w_desc`` reads row ``e * H + h``; ``strides`` = (act row, act-scale row, y row, scale
    expert / row / block)."""
    if USE_PDL:
        gdc_wait()  # the activation's codes
    e, s, r_in, _tok = _item_tokens(items_ptr, sorted_ptr, top_k, BT)
    if e >= 0:
        n0 = tl.program_id(1) * BN
        s64 = s.to(tl.int64)
        ins = (a_ptr, as_ptr, w_desc, s_ptr)
        acc = _down_tma_product(
            e, s64, r_in, n0, ins, strides, KDIM, H, BN, STAGES, E8M0, ACCUM, PTX
        )
        if USE_PDL:
            gdc_launch_dependents()
        _down_tma_store(acc, s64, r_in, n0, y_ptr, strides[2], H, BN)


@triton.jit
def _down_tma_product(
    e,
    s64,
    r_in,
    n0,
    ins,
    strides,
    KDIM: tl.constexpr,
    H: tl.constexpr,
    BN: tl.constexpr,
    STAGES: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    PTX: tl.constexpr,
):
    """The FP32 sums [BT, BN] of :func:`_experts_fp8_down_tma_kernel`'s tile (expert ``e``,
    slot rows ``s64``, rows of H from ``n0``); ``ins`` = (activation codes, their scales, weight
    descriptor, weight scales)."""
    a_ptr, as_ptr, w_desc, s_ptr = ins
    a_st, as_st, _y_st, s_st_e, s_st_n, s_st_k = strides
    acc, _unused = _slot_block_product(
        a_ptr + s64 * a_st,
        r_in,
        as_ptr + s64 * as_st,
        (w_desc,),
        e * H + n0,
        (s_ptr + e.to(tl.int64) * s_st_e + (n0 // 128) * s_st_n,),
        s_st_k,
        KDIM,
        BN,
        STAGES,
        PTX,
        E8M0,
        ACCUM,
    )
    return acc


@triton.jit
def _down_tma_store(acc, s64, r_in, n0, y_ptr, y_st, H: tl.constexpr, BN: tl.constexpr):
    """``y`` rows ``s64`` (valid ``r_in``), columns ``n0`` .. ``n0 + BN`` below H, from ``acc``."""
    n = n0 + tl.arange(0, BN)
    tl.store(y_ptr + s64[:, None] * y_st + n[None, :], acc, mask=r_in[:, None] & (n < H)[None, :])


@triton.jit
def _down_tma_tile(
    j,
    walk,
    KDIM: tl.constexpr,
    H: tl.constexpr,
    BN: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    PTX: tl.constexpr,
):
    """Tile ``j`` of :func:`_experts_fp8_down_tma_persistent_kernel`: work item ``j % used`` x
    the ``BN`` rows of H from ``(j // used) * BN``; ``walk`` = (items, sorted slots, top_k, used,
    the product's ``ins``, y, strides)."""
    items_ptr, sorted_ptr, top_k, used, ins, y_ptr, strides = walk
    e, s, r_in, _tok = _item_tokens_at(items_ptr, sorted_ptr, j % used, top_k, BT)
    n0 = (j // used) * BN
    s64 = s.to(tl.int64)
    acc = _down_tma_product(e, s64, r_in, n0, ins, strides, KDIM, H, BN, STAGES, E8M0, ACCUM, PTX)
    _down_tma_store(acc, s64, r_in, n0, y_ptr, strides[2], H, BN)


@triton.jit(launch_metadata=fp8_gemm_metadata)
def _experts_fp8_down_tma_persistent_kernel(
    a_ptr,
    as_ptr,
    w_desc,
    s_ptr,
    items_ptr,
    sorted_ptr,
    y_ptr,
    strides,
    top_k,
    n_items,
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
    """:func:`_experts_fp8_down_tma_kernel`'s tiles on a persistent grid: tile ``j`` is work item
    ``j % used`` x the ``BN`` rows of H from ``(j // used) * BN`` (``used``: the plan's items in
    use, a prefix of the ``n_items`` records, found by bisection), program ``p`` takes tiles
    ``p``, ``p + grid``, ... with the tile loop flattened into the K loop, so a tile's first
    weight loads run under the one before's last blocks and store (K is short: 6 blocks at I =
    768). The same products in the same order: the same bits."""
    if USE_PDL:
        gdc_wait()  # the activation's codes
    used = _items_in_use(items_ptr, n_items)
    n_tiles = used * ((H + BN - 1) // BN)
    used = tl.maximum(used, 1)
    walk = (items_ptr, sorted_ptr, top_k, used, (a_ptr, as_ptr, w_desc, s_ptr), y_ptr, strides)
    if PTX:  # a for loop, which Triton can flatten into the K loop
        for j in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=True):
            _down_tma_tile(j, walk, KDIM, H, BN, BT, STAGES, E8M0, ACCUM, PTX)
    else:  # the interpreter's range() takes no tensors: the same tiles by a while loop
        j = tl.program_id(0)
        while j < n_tiles:
            _down_tma_tile(j, walk, KDIM, H, BN, BT, STAGES, E8M0, ACCUM, PTX)
            j += tl.num_programs(0)
    if USE_PDL:
        gdc_launch_dependents()


# ----------------------------------------------------------------------------- launchers
def _rows_view(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [E, R, K] as [E * R, K] rows (a view: the weight is contiguous)."""
    return weight.view(weight.shape[0] * weight.shape[1], weight.shape[2])


def _tile_grid(plan, row_tiles: int, per_sm: int, device: torch.device) -> tuple[int, ...]:
    """Grid of a TMA GEMM over ``plan.n_items`` work items x ``row_tiles``: one program per tile
    (2-D), or with ``per_sm`` > 0 a persistent grid of at most ``per_sm`` programs per SM (1-D,
    never more programs than tiles)."""
    if per_sm:
        return (min(plan.n_items * row_tiles, per_sm * sm_count(device)),)
    return (plan.n_items, row_tiles)


def tma_experts_ready(weight: torch.Tensor, cfg: dict, token_tile: int, plan_kernel: bool) -> bool:
    """Whether the ``tma`` launch may run this GEMM: the plan kernel writes the work items
    (``plan_kernel``), the token tile fills the 64-row MMAs of each warpgroup (``token_tile >=
    16 * warps``), block accumulation (where the orientation's bits were measured), the weight
    contiguous with 16-byte aligned rows (K % 16 == 0) and base."""
    from moefuse.moe.tiles import FP8_ACCUMULATION_CODES

    return (
        plan_kernel
        and token_tile >= 16 * cfg["warps"]
        and cfg["accumulation"] == FP8_ACCUMULATION_CODES["block"]
        and weight.is_contiguous()
        and weight.shape[-1] % 16 == 0
        and weight.data_ptr() % 16 == 0
    )


def gate_up_tma_fits(inter: int, bn: int, interleaved: bool) -> bool:
    """Whether every gate and every up tile of ``bn`` rows lies in one 128-row scale block:
    ``bn`` divides 128, and stacked I % 128 == 0 (the up rows start at I), interleaved ``bn`` <=
    64 (a tile's rows are 2 * ``bn`` stored rows)."""
    return 128 % bn == 0 and (bn <= 64 if interleaved else inter % 128 == 0)


def launch_gate_up_fp8_tma(
    x, xs, weight, scale, e8m0, plan, top_k, cfg, interleaved, use_pdl, quant=None
):
    """``plan.act`` [T*K, I] from the tokens' codes ``x`` [T, H] with their group scales ``xs``
    and the gate|up weight codes [E, 2I, H] (E4M3, or uint8 in the interpreter) with their block
    scales ``scale`` (FP32 or UE8M0 bytes); ``cfg``: ``bn_gate_up``, ``warps``, ``stages``,
    ``accumulation`` (:func:`tma_experts_ready` and :func:`gate_up_tma_fits` hold). ``quant`` =
    (codes uint8 [T*K, I], scales FP32 [T*K, ceil(I/128)]), with ``bn_gate_up`` 128: the
    activation's group quantization written there instead of ``plan.act`` (valid slots' rows).
    ``gate_up_persistent`` (programs per SM, 0 = one program per tile) runs the persistent
    kernel."""
    from moefuse._runtime import interpreter_active

    experts, two_i, hidden = weight.shape
    inter = two_i // 2
    bn = cfg["bn_gate_up"]
    if interleaved:
        pairs = weight.view(experts * inter, 2, hidden)
        gate, up, pitch = pairs[:, 0], pairs[:, 1], inter
    else:
        rows = _rows_view(weight)
        gate, up, pitch = rows, rows[inter:], two_i
    grid = _tile_grid(plan, triton.cdiv(inter, bn), cfg.get("gate_up_persistent", 0), x.device)
    persistent = len(grid) == 1
    launch(
        _experts_fp8_gate_up_tma_persistent_kernel
        if persistent
        else _experts_fp8_gate_up_tma_kernel,
        grid,
        x,
        xs,
        TensorDescriptor.from_tensor(gate, [bn, 128]),
        TensorDescriptor.from_tensor(up, [bn, 128]),
        scale,
        plan.items,
        plan.sorted_slots,
        plan.act,
        (x.stride(0), xs.stride(0), plan.act.stride(0), *scale.stride()),
        top_k,
        quant if quant is not None else (plan.act, plan.act),
        (quant[0].stride(0), quant[1].stride(0)) if quant is not None else (0, 0),
        *((plan.n_items,) if persistent else ()),
        KDIM=hidden,
        INTER=inter,
        PITCH=pitch,
        BN=bn,
        BT=plan.bt,
        STAGES=cfg["stages"],
        INTERLEAVED=interleaved,
        QUANT=quant is not None,
        E8M0=e8m0,
        ACCUM=cfg["accumulation"],
        PTX=not interpreter_active(),
        USE_PDL=use_pdl,
        num_warps=cfg["warps"],
        enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
    )


def launch_down_fp8_tma(a, a_s, weight, scale, e8m0, plan, top_k, cfg, use_pdl):
    """``plan.y`` [T*K, H] (FP32) from the activation's codes ``a`` [T*K, I] with their group
    scales ``a_s`` and the down weight codes [E, H, I] with their block scales; ``cfg``:
    ``bn_down`` (a divisor of 128), ``down_warps`` or ``warps``, ``down_stages`` or ``stages``,
    ``accumulation``; ``down_persistent`` (programs per SM, 0 = one program per tile) runs the
    persistent kernel."""
    from moefuse._runtime import interpreter_active

    hidden, inter = weight.shape[1], weight.shape[2]
    bn = cfg["bn_down"]
    grid = _tile_grid(plan, triton.cdiv(hidden, bn), cfg.get("down_persistent", 0), a.device)
    persistent = len(grid) == 1
    launch(
        _experts_fp8_down_tma_persistent_kernel if persistent else _experts_fp8_down_tma_kernel,
        grid,
        a,
        a_s,
        TensorDescriptor.from_tensor(_rows_view(weight), [bn, 128]),
        scale,
        plan.items,
        plan.sorted_slots,
        plan.y,
        (a.stride(0), a_s.stride(0), plan.y.stride(0), *scale.stride()),
        top_k,
        *((plan.n_items,) if persistent else ()),
        KDIM=inter,
        H=hidden,
        BN=bn,
        BT=plan.bt,
        STAGES=cfg.get("down_stages", cfg["stages"]),
        E8M0=e8m0,
        ACCUM=cfg["accumulation"],
        PTX=not interpreter_active(),
        USE_PDL=use_pdl,
        num_warps=cfg.get("down_warps", cfg["warps"]),
        enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
    )
