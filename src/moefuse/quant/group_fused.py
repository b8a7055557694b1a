"""RMSNorm (+ residual add) + per-token-group 8-bit quantization in one kernel (spec:
rmsnorm_group_quant, fused_add_rmsnorm_group_quant).

The bits are those of the unfused chain ``per_token_group_quant_8bit(rmsnorm(x))`` (or of
``fused_add_rmsnorm`` then the quantizer), so that fused and unfused engines agree bit for bit.
That holds by construction: the kernel uses the norm op's own tile (``norm.tiles.row_tile`` with
``RMSNORM_POLICY`` / ``FUSED_ADD_POLICY``: same block, rows, warps and stepped mode), the norm's
row code (``one_pass_rows`` with the norm's LOAD / COMBINE hooks, the stepped rows' per-thread
FMA accumulation and ``_inv_rms``, the two-pass chunk loop) and its arithmetic in the same order;
only the store differs: ``y`` is rounded to the input dtype as the norm stores it, widened back
exactly, and quantized by :func:`moefuse.quant.group_triton.group_quant_tile`, the standalone
quantizer's epilogue. (On the GPU the one-pass and stepped rows widen their BF16 loads two
elements per instruction, :func:`_widen`, and the stepped rows load through :func:`_step_x`
instead of the norm's ``_step_in`` / ``step_params`` for that: the same FP32 values. Where
:func:`store_plan` says so, rmsnorm_group_quant's store re-reads the row after the row sum,
:func:`_reloaded_out`, and the launch caps the registers: the same values again.) A group
never spans two tiles (blocks and steps are powers of two >= the group size, or the row fits one
block narrower than a group), so wide rows quantize chunk by chunk. The GPU tests check fused ==
unfused bitwise at every benchmarked shape.

With a residual, ``res <- cast(h)`` and the norm uses the FP32 ``h``; ``input`` is not written.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import round_to, round_widen_bf16_pairs, widen_bf16_pairs, widen_f32
from moefuse._runtime import interpreter_active
from moefuse.norm import tiles
from moefuse.norm.rms import _add_f32
from moefuse.norm.row_loop import add_pair, head_pair, keep_pair, one_pass_rows
from moefuse.norm.tiles import (
    FUSED_ADD_POLICY,
    RMSNORM_POLICY,
    RowTile,
    TilePolicy,
    row_tile,
)
from moefuse.norm.triton import (
    _grid,
    _inv_rms,
    _launch,
    _row_consts,
    _st,
    _tile,
    _weighted_sumsq,
    ld,
    step_cols,
)
from moefuse.quant.group_triton import group_quant_tile, rcp_quotients, store_scales


def _metadata(grid, kernel, args):
    n, h = args["n_rows"], args["H"]
    e = args["x_ptr"].element_size()
    scales = n * args["quant"][5] * (1 if args["E8M0"] else 4)
    elem = e * (3 if args["HAS_RESIDUAL"] else 1) + 1
    return {"name": f"rmsnorm_group_quant M={n} H={h}", "bytes": n * h * elem + scales}


# ``qa`` = (q_ptr, s_ptr, q_st, s_st, G, n_rows, qeps, x_ptr, s_sg): where and how the epilogue
# stores (x_ptr: the input dtype); ``QC`` = (GW, QMAX, UE8M0, INT8, E8M0, RCP): its constexprs,
# a tuple built in each call and read by index (Triton's assignment would turn its elements into
# tensors).
@triton.jit
def _group_out(y, rows, cols, mask, g0, qa, QC, PTX: tl.constexpr):
    """Store one tile of the norm output ``y`` (FP32 ``[R, B]``, columns ``cols`` [1, B]
    starting at group ``g0``): round to the input dtype, widen back exactly, quantize in groups
    (lanes outside ``mask`` count as 0); codes at ``q_ptr + row * q_st + col``, scales at
    ``s_ptr + row * s_st + g * s_sg``."""
    GW: tl.constexpr = QC[0]
    QMAX: tl.constexpr = QC[1]
    UE8M0: tl.constexpr = QC[2]
    INT8: tl.constexpr = QC[3]
    E8M0: tl.constexpr = QC[4]
    RCP: tl.constexpr = QC[5]
    B: tl.constexpr = y.shape[1]
    if PTX and qa[7].dtype.element_ty == tl.bfloat16:
        yq = round_widen_bf16_pairs(y)
    else:
        yq = widen_f32(round_to(y, qa[7].dtype.element_ty, PTX), PTX)
    live = tl.broadcast_to(mask, yq.shape)
    q, s = group_quant_tile(yq, live, qa[6], GW, QMAX, UE8M0, INT8, PTX, RCP)
    r64 = rows.to(tl.int64)[:, None]
    # codes stored 8 to a vector, as the 16-bit norm output is: a 16-byte vector of codes would
    # have Triton lay the whole tile out 16 elements per thread, the row sum included, and sum
    # rows in another order than the norm kernel (bits of r could differ)
    cols8 = (cols // 8) * 8 + cols % 8  # = cols, provably contiguous in runs of 8 only
    tl.store(qa[0] + r64 * qa[2] + cols8, q, mask=mask)
    gs = g0 + tl.arange(0, B // GW)[None, :]
    smask = (rows < qa[5])[:, None] & (gs < qa[4])
    store_scales(qa[1] + r64 * qa[3] + gs.to(tl.int64) * qa[8], s, smask, E8M0)


@triton.jit
def _widen(v, PTX: tl.constexpr):
    """Exact FP32 of a loaded tile: BF16 pairs widened by a shift / mask on the GPU
    (``widen_bf16_pairs``: one instruction per element, Triton's conversion takes 1.5)."""
    if PTX and v.dtype == tl.bfloat16:
        return widen_bf16_pairs(v)
    else:
        return v.to(tl.float32)


@triton.jit
def _load32(ptrs, mask, MASKED: tl.constexpr, POLICY: tl.constexpr, PTX: tl.constexpr):
    """``norm.triton.ldp`` (load with an L2 policy, widen exactly) through :func:`_widen`."""
    if MASKED:
        v = tl.load(ptrs, mask=mask, other=0.0, eviction_policy=POLICY)
    else:
        v = tl.load(ptrs, eviction_policy=POLICY)
    return _widen(v, PTX)


@triton.jit
def _step_x(x_ptr, res_ptr, x_row, r_row, cols, cm, MASKED: tl.constexpr, POLICY: tl.constexpr,
            ADD: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """``norm.triton._step_in`` (f32(x) [+ f32(res)]) with :func:`_load32`'s widening."""
    v = _load32(x_ptr + x_row + cols, cm, MASKED, POLICY, PTX)
    if ADD:
        v += _load32(res_ptr + r_row + cols, cm, MASKED, POLICY, PTX)
    return v


@triton.jit
def _norm_tile(pair, rows, cols, mask, args):
    """The ``TILE`` of :func:`moefuse.norm.row_loop.one_pass_rows`: the norm's tile arithmetic
    (``rms_tile`` / ``_add_tile``: [res <- cast(h)], ``r`` from ``tl.sum`` of the squares, ``y =
    (h * r) * w``) with the group-quant store, on the tile or (SUB > 0) by :func:`_reloaded_out`.
    ``args`` = ((w, res_ptr, r_st, Hf, eps), qa, QC, MASKED, HAS_RESIDUAL, PTX, SUB, NSUB,
    (x_ptr, x_st, w_ptr, gc, H))."""
    MASKED: tl.constexpr = args[3]
    HAS_RESIDUAL: tl.constexpr = args[4]
    PTX: tl.constexpr = args[5]
    w = args[0][0]
    if HAS_RESIDUAL:
        h = pair
        r64 = rows.to(tl.int64)[:, None]
        _st(args[0][1] + r64 * args[0][2] + cols[None, :], h, mask, MASKED, PTX)
    else:
        h = _widen(pair[0], PTX)
    r = _inv_rms(tl.sum(h * h, axis=1), args[0][3], args[0][4])[:, None]
    SUB: tl.constexpr = args[6]
    if SUB == 0:
        _group_out((h * r) * w, rows, cols[None, :], mask, 0, args[1], args[2], PTX)
    else:
        _reloaded_out(rows, r, args[8], args[1], args[2], SUB, args[7], PTX)


@triton.jit
def _reloaded_out(rows, r, src, qa, QC, SUB: tl.constexpr, NSUB: tl.constexpr, PTX: tl.constexpr):
    """The store of :func:`_norm_tile` / :func:`_stepped` in ``NSUB`` column chunks of ``SUB``
    instead of the norm's tile: each chunk's input and weight re-read (L1 / L2 hits: the row was
    just loaded), ``y = (f32(x) * r) * (f32(w) + gc)`` and quantized. The same values as the
    norm's tile gives (``y`` is elementwise and a group's amax a max), fewer empty lanes where
    the norm's power-of-two tile is far wider than the row, and nothing of the row held in
    registers across the row sum. ``src`` = (x_ptr, x_st, w_ptr, gc, H); rows: [R] (R = 1)."""
    GW: tl.constexpr = QC[0]
    row = rows.to(tl.int64)[:, None]
    live_row = (rows < qa[5])[:, None]
    for c in tl.static_range(NSUB):
        cols = c * SUB + tl.arange(0, SUB)[None, :]
        cm = cols < src[4]
        v = _load32(src[0] + row * src[1] + cols, cm & live_row, True, "", PTX)
        w = _load32(src[2] + cols, cm, True, "", PTX) + src[3]
        _group_out((v * r) * w, rows, cols, cm & live_row, c * (SUB // GW), qa, QC, PTX)


@triton.jit
def _stepped(
    x_ptr,
    res_ptr,
    w_ptr,
    row,
    x_st,
    r_st,
    H,
    Hf,
    eps,
    gc,
    qa,
    QC,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    UNROLL: tl.constexpr,
    MASKED: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    ADD: tl.constexpr,
    POLICY: tl.constexpr,
    RELOAD: tl.constexpr,
):
    """One stepped row: ``norm.triton.norm_stepped``'s arithmetic (per-thread FMA of the squares
    over the steps in ascending order, one tl.sum; unrolled or looped, the same bits) with the
    group-quant store per step (RELOAD, unrolled rows without a residual: each step re-read by
    :func:`_reloaded_out` after the sum instead of held in registers across it)."""
    x_row = row * x_st
    r_row = row * r_st
    rows = tl.full([1], 0, tl.int32) + row
    if UNROLL:
        ws = ()
        if not RELOAD:
            for k in tl.static_range(STEPS):
                cols, cm = step_cols(k, H, STEP)
                ws = ws + (_load32(w_ptr + cols, cm, MASKED, "", PTX) + gc,)
        if USE_PDL:
            gdc_wait()
        vs = ()
        for k in tl.static_range(STEPS):
            cols, cm = step_cols(k, H, STEP)
            vs = vs + (_step_x(x_ptr, res_ptr, x_row, r_row, cols, cm, MASKED, POLICY, ADD, PTX),)
        if USE_PDL:
            gdc_launch_dependents()
        if ADD:
            for k in tl.static_range(STEPS):
                cols, cm = step_cols(k, H, STEP)
                _st(res_ptr + r_row + cols, vs[k], cm, MASKED, PTX)
        _, ss = _weighted_sumsq(vs, ws, STEP, STEPS, False)
        r = _inv_rms(ss, Hf, eps)
        if RELOAD:
            _reloaded_out(rows, r, (x_ptr, x_st, w_ptr, gc, H), qa, QC, STEP, STEPS, PTX)
        else:
            for k in tl.static_range(STEPS):
                cols, cm = step_cols(k, H, STEP)
                _group_out((vs[k] * r) * ws[k], rows, cols, cm, k * (STEP // QC[0]), qa, QC, PTX)
    else:
        if USE_PDL:
            gdc_wait()
        acc = tl.zeros([1, STEP], dtype=tl.float32)
        for k in tl.range(0, STEPS):
            cols, cm = step_cols(k, H, STEP)
            v = _step_x(x_ptr, res_ptr, x_row, r_row, cols, cm, MASKED, "evict_last", ADD, PTX)
            acc = tl.fma(v, v, acc)
        r = _inv_rms(tl.sum(acc, axis=1)[:, None], Hf, eps)
        for k in tl.range(0, STEPS):
            cols, cm = step_cols(k, H, STEP)
            v = _step_x(x_ptr, res_ptr, x_row, r_row, cols, cm, MASKED, "evict_first", ADD, PTX)
            if ADD:
                _st(res_ptr + r_row + cols, v, cm, MASKED, PTX)
            y = (v * r) * (_load32(w_ptr + cols, cm, MASKED, "", PTX) + gc)
            _group_out(y, rows, cols, cm, k * (STEP // QC[0]), qa, QC, PTX)
        if USE_PDL:
            gdc_launch_dependents()


@triton.jit
def _two_pass(x_ptr, res_ptr, w_ptr, pid, n_rows, x_st, r_st, H, Hf, eps, gc, qa, QC,
              BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
              MASKED: tl.constexpr, EVICT_FIRST: tl.constexpr, PTX: tl.constexpr,
              USE_PDL: tl.constexpr, ADD: tl.constexpr):  # fmt: skip
    """Rows wider than one block: the norms' two-pass loop (``_rmsnorm_two_pass`` /
    ``_fused_add_two_pass``: squares summed over the chunks, then each chunk re-read and
    normalized) with the group-quant store per chunk."""
    rows, cols, mask = _tile(pid, 0, n_rows, H, ROWS, BLOCK)
    x_row = rows.to(tl.int64)[:, None] * x_st
    r_row = rows.to(tl.int64)[:, None] * r_st
    if USE_PDL:
        gdc_wait()
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for c in tl.range(NUM_CHUNKS):
        rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
        h = ld(x_ptr + x_row + cols[None, :], mask, MASKED, False)
        if ADD:
            h += ld(res_ptr + r_row + cols[None, :], mask, MASKED, False)
        acc += h * h
    r = _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None]
    for c in tl.range(NUM_CHUNKS):
        rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
        h = ld(x_ptr + x_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        if ADD:
            h += ld(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST)
        w = ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gc
        if ADD:
            _st(res_ptr + r_row + cols[None, :], h, mask, MASKED, PTX)
        _group_out((h * r) * w, rows, cols[None, :], mask, c * (BLOCK // QC[0]), qa, QC, PTX)
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit(do_not_specialize=["n_rows"], launch_metadata=_metadata)
def _norm_group_quant_kernel(
    x_ptr, res_ptr, w_ptr,
    n_rows, H, Hf,
    x_st, r_st,
    eps, gain_center,
    quant,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr, PREFETCH: tl.constexpr, STEPPED: tl.constexpr,
    UNROLL: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    GW: tl.constexpr, QMAX: tl.constexpr, UE8M0: tl.constexpr, INT8: tl.constexpr,
    E8M0: tl.constexpr, RCP: tl.constexpr, SUB: tl.constexpr = 0, NSUB: tl.constexpr = 0,
):  # fmt: skip
    """codes / scales of ``y = cast((h * r) * g)``, h = f32(x) [+ f32(res), res <- cast(h)].
    ``quant`` = (q_ptr, s_ptr, q_st, s_st, s_sg, G, qeps): the codes, the scales and their
    strides, the groups per row and the quantization eps."""
    q_ptr, s_ptr, q_st, s_st, s_sg, G, qeps = quant
    pid = tl.program_id(0)
    qa = (q_ptr, s_ptr, q_st, s_st, G, n_rows, qeps, x_ptr, s_sg)
    if STEPPED:
        _stepped(
            x_ptr, res_ptr, w_ptr, pid.to(tl.int64), x_st, r_st, H, Hf, eps, gain_center, qa,
            (GW, QMAX, UE8M0, INT8, E8M0, RCP),
            BLOCK, NUM_CHUNKS, UNROLL, MASKED, PTX, USE_PDL, HAS_RESIDUAL,
            "" if HAS_RESIDUAL else "evict_first", SUB > 0,
        )  # fmt: skip
    elif NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK)
        w = _load32(w_ptr + cols, cols < H, MASKED, "", PTX)[None, :] + gain_center
        if HAS_RESIDUAL:
            one_pass_rows(
                add_pair, (x_ptr, res_ptr, x_st, r_st), _add_f32, _norm_tile,
                ((w, res_ptr, r_st, Hf, eps), qa, (GW, QMAX, UE8M0, INT8, E8M0, RCP), MASKED, True,
                 PTX, 0, 0, ()),
                pid, cols, n_rows, H, ROWS, BLOCK, MASKED, EVICT_FIRST, USE_PDL,
                PERSISTENT, PREFETCH, False,
            )  # fmt: skip
        else:
            one_pass_rows(
                head_pair, ((x_ptr, x_ptr), (1, x_st, 0, 0, 0), False), keep_pair, _norm_tile,
                ((w, res_ptr, r_st, Hf, eps), qa, (GW, QMAX, UE8M0, INT8, E8M0, RCP), MASKED, False,
                 PTX, SUB, NSUB, (x_ptr, x_st, w_ptr, gain_center, H)),
                pid, cols, n_rows, H, ROWS, BLOCK, MASKED, EVICT_FIRST, USE_PDL,
                PERSISTENT, PREFETCH, True,
            )  # fmt: skip
    else:
        _two_pass(
            x_ptr, res_ptr, w_ptr, pid, n_rows, x_st, r_st, H, Hf, eps, gain_center, qa,
            (GW, QMAX, UE8M0, INT8, E8M0, RCP),
            BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, USE_PDL, HAS_RESIDUAL,
        )  # fmt: skip


#: The persistent row loop with prefetch on the one-pass rows (quant/fused.py QUANT_POLICY's
#: loop: rmsnorm_quant gained 26 % from it) keeps the norm's block, rows, warps and tree (the
#: reduce-tree audit compares both launch modes with rmsnorm / fused_add_rmsnorm), so it only
#: chooses which program computes a row. It is not a default: on an H100 it was slower for
#: rmsnorm_group_quant at 2048 / 2880 / 4096 columns from M = 2048 at 2, 3 and 4 programs per
#: SM (M = 16384, 4 per SM: 51.36 / 88.40 / 88.61 us against 47.16 / 84.14 / 84.75;
#: notes/quant.md, ``bench quant --sweep``); its only gain, M = 512 (3.61 / 5.19 / 5.47 against
#: 4.14 / 5.54 / 6.01), came with a grid of one tile per program, not from the loop. Sweeps and
#: tests ask for it through ``per_sm``.

#: programs per SM of that loop where one count stands for it (the reduce-tree audit)
GROUP_PROGRAMS_PER_SM = 4


#: stepped rows (rmsnorm 6145-8192 columns; fused_add 4096, 6554-8192) run looped (two passes,
#: the second re-reading the row from L2) from this many tokens and unrolled below; both modes
#: give the same bits. rmsnorm_group_quant: looped from 4096 rows (H100, 7168 columns, with
#: the lighter quantizer: M = 16384 146.45 us looped against 167.86 unrolled, M = 2048 22.95
#: against 22.46 unrolled with the re-reading store; before it, unrolled was faster at every M,
#: notes/quant.md); fused_add: the norm's threshold.
GROUP_RMSNORM_LOOP_MIN_ROWS = 4096
GROUP_ADD_LOOP_MIN_ROWS = tiles.FUSED_ADD_LOOP_MIN_ROWS


#: rmsnorm_group_quant's default launches (:func:`store_plan`), H100 80GB HBM3, 2026-12-06 (``bench
#: quant --sweep``, notes/quant.md; x the same-bytes copy at M = 2048 / 16384): the one-pass
#: 4096-lane tile (2049-4096 columns) with the registers capped at ONE_PASS_MAXNREG (48 -> 40: 6
#: programs of 8 warps per SM instead of 5; ptxas spills 16 bytes): 4096 columns 0.84 / 0.89 -> 0.89
#: / 0.98, 2880 0.67 / 0.69 -> 0.73 / 0.77 (the store re-reading the row in 1024-column chunks: 0.71
#: / 0.78); stepped rows (6145-8192 columns) unrolled below GROUP_RMSNORM_LOOP_MIN_ROWS with the
#: store re-reading each step after the row sum and the registers capped at RELOAD_STEPPED_MAXNREG
#: (51 -> 32: 4 programs of 16 warps per SM instead of 2), looped from there: 7168 columns M = 2048
#: 0.69 -> 0.75 (looped 0.73), M = 16384 0.71 -> 0.81 (looped; unrolled with the re-reading store
#: 0.70).
ONE_PASS_MAXNREG = 40
RELOAD_STEPPED_MAXNREG = 32
#: the stepped rows' re-reading store (capped) from this many rows; fewer rows keep the store on
#: the tile, uncapped, where a row's second read sits on the critical path. MEASURED (H100 80GB
#: HBM3, 2026-12-07, 270104f, ``bench quant --ops rmsnorm_group_quant --sweep --widths 7168
#: --tokens 1,16,128,2048``, notes/quant.md), us, store on the tile against re-reading store
#: capped: M = 1 1.89 / 2.42, 16 2.01 / 2.51, 128 3.16 / 3.76, 2048 23.53 / 22.61; then at ea54c2a
#: (``--tokens 512,1024``) M = 512 7.67 / 7.72, 1024 13.19 / 12.82.
RELOAD_STEPPED_MIN_ROWS = 1024


def reloadable(tile: RowTile, residual: bool, sub: int, gw: int) -> bool:
    """Whether the store may re-read the row in ``sub``-column chunks: rows without a residual
    (the residual is overwritten before the store), one row per program, one pass or unrolled
    steps (``sub`` = the step), chunks of whole groups."""
    if residual or tile.rows != 1 or sub % gw or sub & (sub - 1):
        return False
    if tile.stepped:
        return sub == tile.block
    return tile.num_chunks == 1 and sub <= tile.block


def store_plan(
    tile: RowTile, residual: bool, gw: int, bf16: bool, unrolled: bool, n_rows: int
) -> tuple[int, int | None]:
    """(store chunk, register cap) of rmsnorm_group_quant's default launch of one tile per
    program of ``n_rows`` rows (the comments above; measured on BF16 rows, other dtypes keep the
    store on the tile, as looped stepped rows and stepped rows below RELOAD_STEPPED_MIN_ROWS do):
    (0, None) = the store on the norm's tile, uncapped. No choice changes a bit."""
    if residual or not bf16:
        return 0, None
    if tile.stepped:
        reload_rows = n_rows >= RELOAD_STEPPED_MIN_ROWS
        if unrolled and reload_rows and reloadable(tile, residual, tile.block, gw):
            return tile.block, RELOAD_STEPPED_MAXNREG
        return 0, None
    if tile.num_chunks == 1 and tile.rows == 1 and tile.block == 4096:
        return 0, ONE_PASS_MAXNREG
    return 0, None


def _store(tile, residual, gw, reload, maxnreg, per_sm, unrolled, bf16, n_rows):
    """(store chunk, register cap) of a launch: ``reload`` / ``maxnreg`` as asked, else
    :func:`store_plan`'s (its cap only for one tile per program). Raises ``ValueError`` for a
    chunk the tile cannot take."""
    if reload is None:
        reload, cap = store_plan(tile, residual, gw, bf16, unrolled, n_rows)
        maxnreg = cap if maxnreg is None and not per_sm else maxnreg
    if reload and not reloadable(tile, residual, reload, gw):
        raise ValueError(f"reload width {reload} does not fit the tile {tile} (group {gw})")
    return reload, maxnreg


def _persistent_policy(policy: TilePolicy, per_sm: int) -> TilePolicy:
    return dataclasses.replace(policy, programs_per_sm=per_sm, prefetch=True)


def norm_group_tile(width: int, residual: bool, per_sm: int = 0) -> RowTile:
    """The norm op's own tile (rmsnorm / fused_add_rmsnorm): what makes fused == unfused. One-pass
    rows run the persistent loop with ``per_sm`` programs per SM when it is not 0 (benchmark
    sweeps, tests); the block, rows and warps are the norm's either way."""
    policy = FUSED_ADD_POLICY if residual else RMSNORM_POLICY
    if not per_sm:
        return row_tile(width, policy)
    return row_tile(width, _persistent_policy(policy, per_sm))


def launch_norm_group_quant(
    input, residual, weight, q, scales, group_size: int, eps: float, gain_center: float,
    quant_eps: float, int8: bool, ue8m0: bool, use_pdl: bool, unroll: bool | None = None,
    per_sm: int = 0, maxnreg: int | None = None, reload: int | None = None,
) -> None:  # fmt: skip
    """``input`` (and ``residual``) [M, H] with unit last stride; ``q`` contiguous codes (uint8
    FP8 bits or int8) [M, H]; ``scales`` [M, G] FP32 or uint8 (E8M0 bytes), any strides.
    ``unroll`` forces the stepped mode and ``per_sm`` the persistent loop's programs per SM (0 =
    one tile per program) of one-pass rows, ``maxnreg`` caps the registers per thread,
    ``reload`` the store's chunk width (0 = on the norm's tile; None = :func:`store_plan`'s, with
    its register cap) (tests, sweeps; none of them changes a bit)."""
    n_rows, width = input.shape
    if n_rows == 0:
        return
    tile = norm_group_tile(width, residual is not None, per_sm)
    loop_min = GROUP_ADD_LOOP_MIN_ROWS if residual is not None else GROUP_RMSNORM_LOOP_MIN_ROWS
    gw = min(group_size, tile.block)
    row_consts = _row_consts(tile, width, n_rows, unroll, loop_min, use_pdl)
    args = (
        input, residual if residual is not None else input, weight,
        n_rows, width, float(width),
        input.stride(0), residual.stride(0) if residual is not None else 0,
        eps, gain_center,
        (q, scales, q.stride(0), scales.stride(0), scales.stride(1), scales.shape[-1], quant_eps),
    )  # fmt: skip
    quant = {
        "HAS_RESIDUAL": residual is not None,
        "GW": gw,
        "QMAX": 127.0 if int8 else 448.0,
        "UE8M0": ue8m0,
        "INT8": int8,
        "E8M0": scales.dtype.itemsize == 1,
        "RCP": rcp_quotients(quant_eps),
    }

    def consts(unrolled: bool) -> dict:
        bf16 = input.dtype == torch.bfloat16
        has_res = residual is not None
        sub, cap = _store(tile, has_res, gw, reload, maxnreg, per_sm, unrolled, bf16, n_rows)
        out = {**row_consts, **quant, "UNROLL": unrolled, "SUB": sub}
        out["NSUB"] = -(-width // sub) if sub else 0
        if cap is not None and not interpreter_active():
            out["maxnreg"] = cap
        return out

    grid = _grid(tile, tile.grid(n_rows)[0], input.device)
    unrolled = row_consts["UNROLL"]
    _launch(
        _norm_group_quant_kernel, grid, args, consts(unrolled), tile, lambda: consts(not unrolled)
    )
