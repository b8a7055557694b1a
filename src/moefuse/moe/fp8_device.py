"""Triton device functions of the block-scaled FP8 products (spec: Block-scaled FP8 products),
shared by the FP8 routed experts (:mod:`moefuse.moe.experts_fp8`) and ``fp8_linear``
(:mod:`moefuse.moe.linear_triton`).

The weights are the MMA's M operand (rows of ``W``), the tokens its N operand (columns), as in
the BF16 experts kernels. The token rows arrive quantized (E4M3 codes and one FP32 scale per
128-channel group, from per_token_group_quant_8bit's kernel), or, with ``QUANT``, as their
BF16 / FP16 / FP32 values, each K-block quantized in registers by that kernel's device function
(:func:`quantized_columns`: a K-block is one group, so the same codes and scales). One loop step
is one 128-wide K-block ``b``: the block's weight codes and per-row scale, the columns' codes and
scales, one FP8 MMA from a zero accumulator (``dot_b``, FP32) and ``acc = fma(dot_b, xs[b] *
Ws[row, b], acc)``.
Each column's ``dot_b`` is the MMA's chain of k32 steps whatever the other columns hold, and the
blocks are added in ascending ``b``: a column's bits depend on its own row, the weights and the
accumulation mode, never on the batch or the tile's width.

Quantizing the token groups inside every program with one IEEE division per element lost
everywhere it was measured (H100, notes/moe-experts-fp8.md): 2.6-3.9 x slower at one token, 2-5 x
at 2,048 (the padding lanes took the division's slow path). ``QUANT`` takes the quotients from
one reciprocal per group (:func:`moefuse.quant.group_triton.quotient_rn`); the FP8 experts use
it where their tile says so (``fuse_tokens_quant``, ``down_act_quant``: off by default, measured
slower at every shape and T = 1 / 4 / 16 on the H100: a [128, 16]-column tile per K-block in
every program costs more than one launch; :mod:`moefuse.moe.tiles`, notes/moe-experts-fp8.md).

Interpreter: the FP8 codes are decoded exactly to FP64 and multiplied in FP64 (every ``dot_b`` is
exact there: products of two E4M3 values have 8 significant bits and 128 of them span under 53
bits), then rounded to FP32: a deterministic stand-in for the tensor cores' block sum.
"""

import triton
import triton.language as tl

from moefuse._device import fma_rn, widen_f32
from moefuse.quant.device import fp8_decode
from moefuse.quant.group_triton import group_quant_tile

#: per_token_group_quant_8bit's eps for the tokens and the activation of the FP8 experts
GROUP_EPS = 1e-10
_GROUP_EPS: tl.constexpr = tl.constexpr(GROUP_EPS)

#: the K-block (and activation group) width: one scale per 128 x 128 weight block
BLOCK: tl.constexpr = tl.constexpr(128)
#: FP32 bits of 2^-127 (UE8M0 byte 0, an FP32 subnormal)
_E8M0_ZERO_BITS: tl.constexpr = tl.constexpr(0x00400000)


@triton.jit
def scale_f32(s, E8M0: tl.constexpr):
    """FP32 value of a loaded block scale: FP32 as is; UE8M0 bytes ``b`` (uint8) as ``2^(b -
    127)`` (0: 2^-127, 255: NaN)."""
    if E8M0:
        bi = s.to(tl.uint32)
        v = (bi << 23).to(tl.float32, bitcast=True)
        v = tl.where(
            bi == 0, tl.full(bi.shape, _E8M0_ZERO_BITS, tl.uint32).to(tl.float32, bitcast=True), v
        )
        return tl.where(bi == 255, float("nan"), v)
    else:
        return s


@triton.jit
def _e4m3(t):
    """E4M3 codes as the MMA's operand type (uint8 bytes bitcast; E4M3 loads as they are: a
    load that feeds the MMA directly is pipelined through shared memory)."""
    if t.dtype == tl.uint8:
        return t.to(tl.float8e4nv, bitcast=True)
    else:
        return t


@triton.jit
def _bytes(t):
    if t.dtype == tl.uint8:
        return t
    else:
        return t.to(tl.uint8, bitcast=True)


#: ``ACCUM`` codes of the FP8 products (the knob MOEFUSE_FP8_ACCUMULATION, one per process)
ACCUM_BLOCK: tl.constexpr = tl.constexpr(0)
ACCUM_K32: tl.constexpr = tl.constexpr(1)
ACCUM_FP16: tl.constexpr = tl.constexpr(2)


@triton.jit
def fp8_block_dot(w, q, ACCUM: tl.constexpr, PTX: tl.constexpr):
    """``dot_b`` = FP32 ``w @ q`` of E4M3 codes (E4M3 or their uint8 bytes) ``w`` [R, 128] and
    ``q`` [128, BT] from a zero accumulator. ``ACCUM``: :data:`ACCUM_BLOCK`, Hopper's FP8 MMA
    carries the block's four k32 steps in its own accumulator (narrower than FP32);
    :data:`ACCUM_K32`, every k32 MMA step is added to the FP32 sum; :data:`ACCUM_FP16`, the codes
    widened to FP16 (exact: every E4M3 value is an FP16 value) and multiplied by the FP16 MMA,
    whose products are exact and whose sum is carried in FP32. Interpreter: exact FP64 products
    and sum, rounded once (module docstring), whatever ``ACCUM``."""
    if PTX:
        if ACCUM == ACCUM_FP16:
            return tl.dot(_e4m3(w).to(tl.float16), _e4m3(q).to(tl.float16), out_dtype=tl.float32)
        elif ACCUM == ACCUM_K32:
            return tl.dot(_e4m3(w), _e4m3(q), max_num_imprecise_acc=32)
        else:
            return tl.dot(_e4m3(w), _e4m3(q))
    else:
        a = fp8_decode(_bytes(w), 0).to(tl.float64)
        b = fp8_decode(_bytes(q), 0).to(tl.float64)
        return tl.dot(a, b, input_precision="ieee", out_dtype=tl.float64).to(tl.float32)


@triton.jit
def prefetch_rows_l2(row_ptrs, live, nbytes, PTX: tl.constexpr):
    """Asks the L2 for the ``nbytes`` bytes from each of ``row_ptrs`` [R] where ``live`` (one
    ``cp.async.bulk.prefetch.L2`` per row: rows 16-byte aligned and ``nbytes`` % 16 == 0, which
    :func:`prefetch_row_bytes` checks). Reads and writes nothing a thread sees: it only starts
    the HBM reads of the weights a program is about to stream. A no-op in the interpreter."""
    if PTX:
        size = tl.where(live, nbytes, 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r",
            [row_ptrs, size],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )


@triton.jit
def quantized_columns(col_rows, kk, k_in, r_in, PTX: tl.constexpr):
    """per_token_group_quant_8bit of one 128-channel K-block of BT columns, in registers:
    ``col_rows`` [1, BT] pointers to the columns' rows (BF16, FP16 or FP32 values, unit stride
    along K), ``kk`` [128] the block's channels (``k_in``: below K), ``r_in`` [BT] the columns in
    use. Returns (E4M3 codes [128, BT] as uint8, FP32 group scales [BT], 0 where not in use).
    The standalone kernel's device function on the same lanes: ``group_quant_tile`` (integer
    amax, ``s = max(amax, eps) / 448``, each quotient from the group's correctly rounded
    reciprocal: the IEEE division's bits, eps :data:`GROUP_EPS`), so that kernel's bytes for
    every in-use column; lanes past K or of unused columns are 0 and give code 0, as the loads
    of stored codes do."""
    live = r_in[:, None] & k_in[None, :]
    v = tl.load(tl.trans(col_rows) + kk[None, :], mask=live, other=0.0)
    eps = tl.full([r_in.shape[0], 1], _GROUP_EPS, tl.float32)
    q, s = group_quant_tile(widen_f32(v, PTX), live, eps, 128, 448.0, False, False, PTX, True)
    return tl.trans(q), tl.where(r_in, tl.reshape(s, [r_in.shape[0]]), 0.0)


@triton.jit
def block_fp8_product(
    w_rows,
    n_in,
    w_st_k,
    s_rows,
    s_st_k,
    col_rows,
    r_in,
    cs_rows,
    b0,
    NB: tl.constexpr,
    KDIM: tl.constexpr,
    BT: tl.constexpr,
    STAGES: tl.constexpr,
    PTX: tl.constexpr,
    E8M0: tl.constexpr,
    ACCUM: tl.constexpr,
    CHUNK: tl.constexpr = 0,
    TILE_SCALE: tl.constexpr = False,
    QUANT: tl.constexpr = False,
):
    """FP32 ``acc = fma(dot_b, xs[b] * Ws[row, b], acc)`` over the ``NB`` K-blocks ``b`` from
    ``b0`` ascending (blocks past K read nothing and add +0.0), from +0.0. Weight rows
    ``w_rows`` [R, 1] (E4M3 codes: :func:`fp8_codes`; ``n_in``: in range; reduction stride
    ``w_st_k``) with their block-scale rows ``s_rows`` [R] (block stride ``s_st_k``); token
    columns ``col_rows`` [1, BT] (E4M3 codes, unit stride along the reduction; ``r_in``: in use)
    with their group scales from ``cs_rows`` [BT] (FP32, unit stride over the groups). ``KDIM``
    is the reduction's width (a partial last block reads zeros), ``STAGES`` the pipeline depth.

    ``TILE_SCALE``: every row of the tile lies in one 128-row weight block (R <= 128 rows from
    a multiple of R), so ``s_rows`` is that block row's scalar pointer and ``xs[b] * Ws[b]`` a
    [BT] vector: the same products, one per column instead of one per element.
    ``CHUNK`` > 0 (``b0`` = 0): the sum restarts from +0.0 every ``CHUNK`` blocks and the chunk
    sums are added in ascending order from +0.0 (``fp8_linear``'s split order,
    :mod:`moefuse.moe.linear_triton`): a branch at each chunk's last block of the one pipelined
    loop. ``QUANT``: ``col_rows`` point at the columns' BF16 / FP16 / FP32 values and each
    K-block is quantized in registers (:func:`quantized_columns`; ``cs_rows`` unused): the codes
    and scales per_token_group_quant_8bit writes, so the same bits."""
    acc = tl.zeros([w_rows.shape[0], BT], dtype=tl.float32)
    total = tl.zeros([w_rows.shape[0], BT], dtype=tl.float32)
    for j in tl.range(0, NB, num_stages=STAGES):
        b = b0 + j
        kk = b * BLOCK + tl.arange(0, BLOCK)
        k_in = kk < KDIM
        w = tl.load(w_rows + kk[None, :] * w_st_k, mask=n_in[:, None] & k_in[None, :], other=0.0)
        b_in = b * BLOCK < KDIM  # (a chunk of fp8_linear's split may end past K)
        if QUANT:
            q, xs = quantized_columns(col_rows, kk, k_in, r_in, PTX)
        else:
            q = tl.load(col_rows + kk[:, None], mask=r_in[None, :] & k_in[:, None], other=0.0)
            xs = tl.load(cs_rows + b, mask=r_in & b_in, other=0.0)
        part = fp8_block_dot(w, q, ACCUM, PTX)
        if TILE_SCALE:
            ws = scale_f32(tl.load(s_rows + b * s_st_k, mask=b_in, other=0), E8M0)
            acc = fma_rn(part, (xs * ws)[None, :], acc, PTX)
        else:
            ws = scale_f32(tl.load(s_rows + b * s_st_k, mask=n_in & b_in, other=0), E8M0)
            acc = fma_rn(part, xs[None, :] * ws[:, None], acc, PTX)
        if CHUNK > 0:
            if ((b + 1) % CHUNK == 0) | (j + 1 == NB):
                total = total + acc
                acc = tl.zeros([w_rows.shape[0], BT], dtype=tl.float32)
    if CHUNK > 0:
        return total
    return acc


def prefetch_row_bytes(want: int, weight) -> int:
    """The bytes of each row of ``weight`` (E4M3, rows along its last dimension) that
    :func:`prefetch_rows_l2` may request: ``want`` cut to the row and to a multiple of 16, where
    every row is contiguous and 16-byte aligned (the bulk prefetch's rule); 0 elsewhere."""
    row = weight.shape[-1]
    aligned = weight.data_ptr() % 16 == 0 and all(st % 16 == 0 for st in weight.stride()[:-1])
    if weight.stride(-1) != 1 or not aligned or row % 16:
        return 0
    return min(want, row) // 16 * 16


def fp8_codes(t):
    """The tensor a kernel reads E4M3 codes from: the E4M3 tensor itself on the GPU (its loads
    feed the MMA directly), its bytes in the interpreter (decoded in software there)."""
    import torch

    from moefuse._runtime import interpreter_active

    return t.view(torch.uint8) if interpreter_active() else t.view(torch.float8_e4m3fn)
