"""The fused RMSNorm (+ residual add) + FP8 kernel (:mod:`moefuse.quant.fused` has the numbers,
the tile policies and the launcher): ``q = e8(((h * r) * g) * (1 / scale))`` in one-pass tiles
(one per program or the persistent loop: the norm kernels'
:func:`moefuse.norm.row_loop.one_pass_rows` with the FP8 tile), two passes over chunks, or the
norm's stepped row with FP8 output hooks. Also the FP8 row functions the all-gather family
reuses (``fp8_tile``; its loads are the norm's ``rms_load``).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse.norm.row_loop import head_pair, one_pass_rows
from moefuse.norm.triton import _inv_rms, _st, ld, norm_stepped, row_base
from moefuse.quant import device as D
from moefuse.quant.fused_rows import _load_h, _st_maybe, widen_sum, widen_x


def _fp8_metadata(grid, kernel, args):
    n, h = args["n_rows"], args["H"]
    elem = args["x_ptr"].element_size() * (3 if args["HAS_RESIDUAL"] else 1)
    return {"name": f"rmsnorm_fp8 M={n} H={h}", "bytes": n * h * (elem + 1)}


# ----------------------------------------------------------------------------- rows
@triton.jit
def fp8_tile(
    h,
    w,
    inv,
    rows,
    cols,
    mask,
    res_ptr,
    q_ptr,
    HEADS,
    r_st,
    r_sh,
    q_st,
    q_sh,
    Hf,
    eps,
    MASKED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FMT: tl.constexpr,
    PTX: tl.constexpr,
    PACKED: tl.constexpr,
):
    """One-pass tile: [res <- cast(h)]; q = e8(((h * r) * w) * inv). PACKED: fp8_encode's
    four-element E4M3 path (the persistent loop passes False: with it, rmsnorm_quant 16384 x 4096
    under PDL ran 60.6 against 53.8 us on H200, notes/gpu-logs/
    ab-e4m3-encoder-rmsnorm-quant-2026-11-30.log, although one tile per program gains)."""
    if HAS_RESIDUAL:
        _st(
            res_ptr + row_base(rows, HEADS, r_st, r_sh)[:, None] + cols[None, :],
            h,
            mask,
            MASKED,
            PTX,
        )
    r = _inv_rms(tl.sum(h * h, axis=1), Hf, eps)[:, None]
    q = D.fp8_encode(((h * r) * w) * inv, FMT, PTX, PACKED)
    _st_maybe(q_ptr + row_base(rows, HEADS, q_st, q_sh)[:, None] + cols[None, :], q, mask, MASKED)


# ----------------------------------------------------------------------------- stepped hooks
# hooks of norm.triton.norm_stepped for the stepped FP8 rows: q = e8(y * (1 / scale))
@triton.jit
def _inv_scale(scale_ptr):
    """AUX hook: 1 / scale, one IEEE division (after gdc_wait: the scale may come from the
    previous kernel)."""
    return tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))


@triton.jit
def _st_fp8(ptrs, y, inv, mask, MASKED: tl.constexpr, FMT: tl.constexpr, PTX: tl.constexpr):
    _st_maybe(ptrs, D.fp8_encode(y * inv, FMT, PTX), mask, MASKED)


@triton.jit
def _st_e4m3(ptrs, y, inv, mask, MASKED: tl.constexpr, PTX: tl.constexpr):
    """OUT hook: E4M3 codes of ``y * inv``."""
    _st_fp8(ptrs, y, inv, mask, MASKED, 0, PTX)


@triton.jit
def _st_e5m2(ptrs, y, inv, mask, MASKED: tl.constexpr, PTX: tl.constexpr):
    """OUT hook: E5M2 codes of ``y * inv``."""
    _st_fp8(ptrs, y, inv, mask, MASKED, 1, PTX)


# ----------------------------------------------------------------------------- row modes
@triton.jit
def _fp8_stepped(
    ptrs,
    strides,
    pid,
    H,
    Hf,
    HEADS,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    UNROLL: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FMT: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Stepped row ``pid``: norm.triton ``norm_stepped`` with the FP8 output hooks."""
    x_ptr, res_ptr, w_ptr, scale_ptr, q_ptr = ptrs
    x_st, x_sh, r_st, r_sh, q_st, q_sh = strides
    x_row = row_base(pid, HEADS, x_st, x_sh)
    r_row = row_base(pid, HEADS, r_st, r_sh)
    q_row = row_base(pid, HEADS, q_st, q_sh)
    if FMT == 0:
        norm_stepped(
            x_ptr,
            res_ptr,
            w_ptr,
            q_ptr,
            x_row,
            r_row,
            q_row,
            H,
            Hf,
            eps,
            gain_center,
            scale_ptr,
            BLOCK,
            NUM_CHUNKS,
            UNROLL,
            MASKED,
            PTX,
            USE_PDL,
            HAS_RESIDUAL,
            "",
            _inv_scale,
            _st_e4m3,
        )
    else:  # (a hook cannot be chosen into a variable: Triton only passes it as an argument)
        norm_stepped(
            x_ptr,
            res_ptr,
            w_ptr,
            q_ptr,
            x_row,
            r_row,
            q_row,
            H,
            Hf,
            eps,
            gain_center,
            scale_ptr,
            BLOCK,
            NUM_CHUNKS,
            UNROLL,
            MASKED,
            PTX,
            USE_PDL,
            HAS_RESIDUAL,
            "",
            _inv_scale,
            _st_e5m2,
        )


@triton.jit
def _fp8_tile_at(h, rows, cols, mask, args):
    """:func:`fp8_tile` of the FP32 tile ``h`` into the residual and FP8 tiles at ``rows``: the
    ``TILE`` of :func:`moefuse.norm.row_loop.one_pass_rows`. ``args`` = ((w, inv, res_ptr,
    q_ptr, Hf, eps), (HEADS, r_st, r_sh, q_st, q_sh), MASKED, HAS_RESIDUAL, FMT, PTX, PACKED);
    the integers are read by index (an unpacking assignment would turn one that the launch
    specialised to 1 into a tensor)."""
    w, inv, res_ptr, q_ptr, Hf, eps = args[0]
    MASKED: tl.constexpr = args[2]
    HAS_RESIDUAL: tl.constexpr = args[3]
    FMT: tl.constexpr = args[4]
    PTX: tl.constexpr = args[5]
    PACKED: tl.constexpr = args[6]
    fp8_tile(
        h,
        w,
        inv,
        rows,
        cols,
        mask,
        res_ptr,
        q_ptr,
        args[1][0],
        args[1][1],
        args[1][2],
        args[1][3],
        args[1][4],
        Hf,
        eps,
        MASKED,
        HAS_RESIDUAL,
        FMT,
        PTX,
        PACKED,
    )


@triton.jit
def _fp8_one_pass(
    ptrs,
    strides,
    pid,
    n_rows,
    H,
    Hf,
    HEADS,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FMT: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Rows that fit one block: the weight row (before ``gdc_wait``) and ``inv`` = 1 / scale
    (after it: the scale may come from the previous kernel), then :func:`fp8_tile` of ``h =
    f32(x) [+ f32(res)]`` (widened before ``gdc_launch_dependents``; a prefetched tile before
    the next tile's loads are issued) of this program's tile, with the packed E4M3 encoder, or
    of its tiles of the persistent loop, without it (:func:`fp8_tile` says why)."""
    cols = tl.arange(0, BLOCK)
    w = ld(ptrs[2] + cols, cols < H, MASKED, False)[None, :] + gain_center
    if USE_PDL:
        gdc_wait()
    inv = tl.math.div_rn(1.0, tl.load(ptrs[3]).to(tl.float32))
    one_pass_rows(
        head_pair,
        (
            (ptrs[0], ptrs[1]),
            (HEADS, strides[0], strides[1], strides[2], strides[3]),
            HAS_RESIDUAL,
        ),
        widen_sum if HAS_RESIDUAL else widen_x,
        _fp8_tile_at,
        (
            (w, inv, ptrs[1], ptrs[4], Hf, eps),
            (HEADS, strides[2], strides[3], strides[4], strides[5]),
            MASKED,
            HAS_RESIDUAL,
            FMT,
            PTX,
            not PERSISTENT,
        ),
        pid,
        cols,
        n_rows,
        H,
        ROWS,
        BLOCK,
        MASKED,
        EVICT_FIRST,
        USE_PDL,
        PERSISTENT,
        PREFETCH,
        True,
        True,
    )


@triton.jit
def _fp8_two_pass(
    ptrs,
    strides,
    pid,
    n_rows,
    H,
    Hf,
    HEADS,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FMT: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Rows wider than one block: the sum of squares over NUM_CHUNKS chunks, then a second pass
    that recomputes the same FP32 h, stores the residual and the FP8 codes chunk by chunk."""
    x_ptr, res_ptr, w_ptr, scale_ptr, q_ptr = ptrs
    x_st, x_sh, r_st, r_sh, q_st, q_sh = strides
    rows = pid * ROWS + tl.arange(0, ROWS)
    rmask = (rows < n_rows)[:, None]
    x_row = row_base(rows, HEADS, x_st, x_sh)[:, None]
    r_row = row_base(rows, HEADS, r_st, r_sh)[:, None]
    q_row = row_base(rows, HEADS, q_st, q_sh)[:, None]
    if USE_PDL:
        gdc_wait()
    inv = tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for c in tl.static_range(NUM_CHUNKS):
        cols = c * BLOCK + tl.arange(0, BLOCK)
        mask = rmask & (cols < H)[None, :]
        h = _load_h(
            x_ptr, res_ptr, x_row, r_row, cols, mask, MASKED, HAS_RESIDUAL, EVICT_FIRST, PTX
        )
        acc += h * h
    r = _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None]
    # second pass: recompute the same FP32 h (the residual is written only now, chunk by
    # chunk, after this chunk's read)
    for c in tl.static_range(NUM_CHUNKS):
        cols = c * BLOCK + tl.arange(0, BLOCK)
        mask = rmask & (cols < H)[None, :]
        h = _load_h(
            x_ptr, res_ptr, x_row, r_row, cols, mask, MASKED, HAS_RESIDUAL, EVICT_FIRST, PTX
        )
        w = ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        if HAS_RESIDUAL:
            _st(res_ptr + r_row + cols[None, :], h, mask, MASKED, PTX)
        q = D.fp8_encode(((h * r) * w) * inv, FMT, PTX)
        tl.store(q_ptr + q_row + cols[None, :], q, mask=mask)
    if USE_PDL:
        gdc_launch_dependents()


# ----------------------------------------------------------------------------- kernel
# ``ptrs`` = (x, res, w, scale, q) pointers and ``strides`` = (x_st, x_sh, r_st, r_sh, q_st,
# q_sh): the kernel's arguments, grouped for its row modes.
@triton.jit(do_not_specialize=["n_rows"], launch_metadata=_fp8_metadata)
def _rmsnorm_fp8_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    scale_ptr,
    q_ptr,
    n_rows,
    H,
    Hf,
    HEADS,
    x_st,
    x_sh,
    r_st,
    r_sh,
    q_st,
    q_sh,
    eps,
    gain_center,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FMT: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
    STEPPED: tl.constexpr = False,
    UNROLL: tl.constexpr = False,
):
    """q = e8(((h * r) * g) * (1/scale)); h = f32(x) [+ f32(res), res <- cast(h)].
    STEPPED: one row per program in NUM_CHUNKS steps of BLOCK columns (norm.triton
    ``norm_stepped`` with the FP8 output hooks)."""
    ptrs = (x_ptr, res_ptr, w_ptr, scale_ptr, q_ptr)
    strides = (x_st, x_sh, r_st, r_sh, q_st, q_sh)
    pid = tl.program_id(0)
    if STEPPED:
        _fp8_stepped(
            ptrs,
            strides,
            pid,
            H,
            Hf,
            HEADS,
            eps,
            gain_center,
            BLOCK,
            NUM_CHUNKS,
            UNROLL,
            MASKED,
            HAS_RESIDUAL,
            FMT,
            PTX,
            USE_PDL,
        )
    elif NUM_CHUNKS == 1:
        _fp8_one_pass(
            ptrs,
            strides,
            pid,
            n_rows,
            H,
            Hf,
            HEADS,
            eps,
            gain_center,
            BLOCK,
            ROWS,
            MASKED,
            HAS_RESIDUAL,
            FMT,
            EVICT_FIRST,
            PTX,
            USE_PDL,
            PERSISTENT,
            PREFETCH,
        )
    else:
        _fp8_two_pass(
            ptrs,
            strides,
            pid,
            n_rows,
            H,
            Hf,
            HEADS,
            eps,
            gain_center,
            BLOCK,
            NUM_CHUNKS,
            ROWS,
            MASKED,
            HAS_RESIDUAL,
            FMT,
            EVICT_FIRST,
            PTX,
            USE_PDL,
        )
