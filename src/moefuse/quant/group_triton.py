"""Per-token-group 8-bit quantization (spec: per_token_group_quant_8bit): the device functions
shared with the fused norm kernels (:mod:`moefuse.quant.group_fused`), the standalone kernel and
its launcher.

Per token and group of ``GS`` consecutive channels (the last group partial when GS does not
divide H): ``amax = max |v|`` as an integer max over the FP32 bits with the sign cleared (exact;
NaN, the largest pattern, propagates; Triton's float max may drop NaN on the GPU), ``s =
max(amax, eps) / QMAX`` correctly rounded (the IEEE division's bits, from a constant
reciprocal and one FMA correction where ``eps >= RCP_MIN_EPS``: :func:`scale_quotient_rn`; a NaN
amax stays NaN), ``s = 2^ceil(log2 s)``
with UE8M0 scales (integer arithmetic on the bits, subnormals exact), then ``v / s`` correctly
rounded (the IEEE division's bits, from one reciprocal per group and an FMA-corrected product
per element: :func:`quotient_rn`), encoded as E4M3 (RNE, saturating, NaN -> 0x7F) or INT8
(round half to even, clamp to [-127, 127], NaN -> 0). Lanes outside the data count as 0 (a
zero never raises a group's amax).

Groups never span programs, so no result depends on the tile: the standalone kernel walks
``[BLOCK_M rows, BLOCK_N columns]`` tiles (BLOCK_N a multiple of GS) chosen from H and GS only;
the token count is a run-time argument that never recompiles.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import fma_rn, widen_bf16_pairs, widen_f32
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs
from moefuse.norm.tiles import next_pow2
from moefuse.norm.triton import row_base
from moefuse.quant import device as D

#: the standalone kernel's tile (no bit depends on it: a group never spans two programs).
#: MEASURED (H100 80GB HBM3, 2026-12-06, 2479cb9, `python -m moefuse bench quant --ops
#: per_token_group_quant_8bit --sweep --widths 2048,2880,4096,7168 --tokens 1,16,128,2048`,
#: notes/gpu-logs/2026-12-06-quant-group-standalone-tiles-2479cb9.log), CUDA-graph us, the former
#: 4 x 1024 (4 warps) -> the tile chosen: up to GROUP_ROW_MAX_ROWS rows one row of up to 2048
#: columns per program (8 warps): M = 1 1.97-1.99 -> 1.29-1.31 at H = 2048-7168, M = 16
#: 2.02-2.08 -> 1.31-1.38; more rows, 2 rows x 1024 columns (4 warps): M = 128 2.34-3.30 ->
#: 1.82-3.18, M = 2048 7.00 / 8.56 / 11.33 / 17.94 -> 6.23 / 8.20 / 10.94 / 17.48 (H = 2048 /
#: 2880 / 4096 / 7168), M = 16,384 within 0.2 % (notes/quant.md).
GROUP_TILE = 2048
GROUP_MAX_COLS = 1024
GROUP_WARPS = 4
GROUP_ROW_MAX_ROWS = 16
GROUP_ROW_MAX_COLS = 2048
GROUP_ROW_WARPS = 8
#: the 1.5 * 2^23 of the round-half-even trick: ``(q + M) - M`` rounds |q| < 2^22 to an integer
_RINT_MAGIC: tl.constexpr = tl.constexpr(12582912.0)
#: the smallest eps whose scales give correctly rounded quotients through one reciprocal per
#: group (:func:`quotient_rn`): every scale is then >= 2^-69 (normal, its reciprocal finite) and
#: every quotient kept from the FMA correction has a normal dividend and an exact remainder
RCP_MIN_EPS = 2.0**-60
#: the largest finite FP32: an infinite scale enters :func:`quotient_rn`'s FMA as this
_F32_MAX: tl.constexpr = tl.constexpr(float.fromhex("0x1.fffffep127"))
#: RN(1 / 448) and RN(1 / 127) in FP32 (0x1.24924ap-9, 0x1.020408p-7), for :func:`scale_quotient_rn`
_RCP_448: tl.constexpr = tl.constexpr(float.fromhex("0x1.24924ap-9"))
_RCP_127: tl.constexpr = tl.constexpr(float.fromhex("0x1.020408p-7"))


# ----------------------------------------------------------------------------- device functions
@triton.jit
def pow2_ceil(s):
    """``2^ceil(log2 s)`` of FP32 ``s`` >= 0, exact; 0, Inf and NaN pass through. A normal value
    with mantissa bits rounds up to the next exponent; a subnormal's bits, read as an integer
    (exact in FP32), round the same way and convert back into the subnormal's bits."""
    b = s.to(tl.uint32, bitcast=True)
    sub = b < 0x800000
    f = tl.where(sub, b.to(tl.float32), s).to(tl.uint32, bitcast=True)
    up = tl.where((f & 0x7FFFFF) != 0, (f & 0x7F800000) + 0x800000, f)
    nb = tl.where(sub, up.to(tl.float32, bitcast=True).to(tl.uint32), up)
    nb = tl.where((b == 0) | (b >= 0x7F800000), b, nb)
    return nb.to(tl.float32, bitcast=True)


@triton.jit
def scale_quotient_rn(m, QMAX: tl.constexpr, PTX: tl.constexpr):
    """``m / QMAX`` correctly rounded (QMAX 448 or 127) for ``m >= RCP_MIN_EPS``, Inf or NaN,
    without a division: :func:`quotient_rn`'s Markstein step with the constant reciprocal
    ``RN(1 / QMAX)`` (``q0 = m * c``, ``r = fma(-q0, QMAX, m)`` exact, ``q1 = fma(r, c, q0)``);
    where ``r`` is NaN (``m`` Inf or NaN) the quotient is ``q0`` (Inf or NaN). Checked against
    the IEEE division at every FP32 ``m`` from 2^-60 up on the GPU
    (``moefuse.tools.quotient_check``)."""
    if QMAX == 448.0:
        c = tl.full(m.shape, _RCP_448, tl.float32)
    else:
        c = tl.full(m.shape, _RCP_127, tl.float32)
    q0 = m * c
    r = fma_rn(q0 * -1.0, tl.full(m.shape, QMAX, tl.float32), m, PTX)
    q1 = fma_rn(r, c, q0, PTX)
    return tl.where(r != r, q0, q1)


@triton.jit
def group_scale(
    amax,
    eps,
    QMAX: tl.constexpr,
    UE8M0: tl.constexpr,
    RCP: tl.constexpr = False,
    PTX: tl.constexpr = True,
):
    """``max(amax, eps) / QMAX`` correctly rounded (NaN amax -> NaN), power-of-two when UE8M0:
    the IEEE division, or with ``RCP`` (``eps >= RCP_MIN_EPS``) :func:`scale_quotient_rn`'s
    division-free step (the same bits)."""
    m = tl.where(amax < eps, eps, amax)
    if RCP:
        s = scale_quotient_rn(m, QMAX, PTX)
    else:
        s = tl.math.div_rn(m, tl.full(m.shape, QMAX, tl.float32))
    if UE8M0:
        s = pow2_ceil(s)
    return s


@triton.jit
def group_codes(q, INT8: tl.constexpr, PTX: tl.constexpr, CANONICAL_NAN: tl.constexpr = False):
    """Codes of the FP32 quotients ``q``: E4M3 bytes (uint8) or INT8 (round half to even by the
    magic-number add, whose rounding is the FP32 add's RNE; NaN -> 0; clamp first, which gives
    the same integers as clamping after rounding since the bounds are integers).
    ``CANONICAL_NAN``: every NaN of ``q`` is the GPU's canonical one (``q`` came out of a
    multiply or an FMA: :func:`quotient_rn`), so E4M3 skips the NaN fix-up."""
    if INT8:
        q = tl.where(q != q, 0.0, q)
        q = tl.where(q > 127.0, 127.0, tl.where(q < -127.0, -127.0, q))
        magic = tl.full(q.shape, _RINT_MAGIC, tl.float32)
        r = D._add_rn(D._add_rn(q, magic, PTX), -magic, PTX)
        return r.to(tl.int8)
    else:
        return D.fp8_encode(q, 0, PTX, True, CANONICAL_NAN)


@triton.jit
def quotient_rn(x, s, rcp, PTX: tl.constexpr):
    """``x / s`` correctly rounded (the IEEE division's bits) from ``rcp`` = ``1 / s`` correctly
    rounded, one per group: ``q0 = x * rcp`` (within one ulp of the quotient), the exact
    remainder ``r = fma(q0, s, -x)`` (``q0 s - x``) and ``q = fma(-r, rcp, q0)``, which is the
    correctly rounded quotient (Markstein's theorem: a correctly rounded reciprocal and a
    quotient within one ulp). Three instructions per element (the negations are operand
    modifiers). Valid for the scales of :func:`group_scale` with ``eps >= RCP_MIN_EPS`` (``s``
    normal, ``rcp`` finite), with ``s`` given as ``min(s, FLT_MAX)`` (:data:`_F32_MAX`: an
    infinite scale enters the FMA as FLT_MAX, so finite ``x`` give ``q = x * 0``, a zero of
    ``x``'s sign, where ``Inf * 0`` would give NaN). Signed zeros: ``r`` is ``+0`` where ``q0 s
    = x`` and ``-r`` is ``-0``, so a zero ``q0`` (``x = +-0``, or a product that underflowed)
    keeps its sign. Quotients under 2^-11 may differ from the division's in their FP32 bits
    where ``x`` is subnormal (the remainder is then inexact; the interpreter's FMA flushes
    subnormals), never in their codes: every such quotient has ``x``'s sign and codes to a
    signed zero in E4M3, 0 in INT8. NaN scales and ``Inf / Inf`` give NaN."""
    q0 = x * rcp
    # negations as products with -1 (a sign flip, folded into the FMA's operand): Triton's unary
    # minus is ``0 - v``, which gives +0 for +0
    r = fma_rn(q0, s, x * -1.0, PTX)
    return fma_rn(r * -1.0, rcp, q0, PTX)


@triton.jit
def group_quant_tile(
    v,
    live,
    eps,
    GW: tl.constexpr,
    QMAX: tl.constexpr,
    UE8M0: tl.constexpr,
    INT8: tl.constexpr,
    PTX: tl.constexpr,
    RCP: tl.constexpr = True,
):
    """Quantize an FP32 ``[R, B]`` tile in groups of GW columns (B % GW == 0); ``live`` [R, B]
    marks the lanes holding data (the others count as 0 and their codes are not meant to be
    stored). Returns ``(codes [R, B], scales [R, B // GW] FP32)``. ``RCP`` (only where ``eps >=
    RCP_MIN_EPS``: :func:`rcp_quotients`): each quotient from the group's reciprocal
    (:func:`quotient_rn`); otherwise one IEEE division per element. The same bits either way."""
    R: tl.constexpr = v.shape[0]
    B: tl.constexpr = v.shape[1]
    g = tl.reshape(v, (R, B // GW, GW))
    lv = tl.reshape(live, (R, B // GW, GW))
    bits = tl.where(lv, g.to(tl.uint32, bitcast=True) & 0x7FFFFFFF, 0)
    amax = tl.max(bits, axis=2).to(tl.float32, bitcast=True)
    s = group_scale(amax, eps, QMAX, UE8M0, RCP, PTX)
    sb = tl.broadcast_to(tl.expand_dims(s, 2), (R, B // GW, GW))
    if RCP:
        rcp = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        rb = tl.broadcast_to(tl.expand_dims(rcp, 2), (R, B // GW, GW))
        sf = tl.broadcast_to(tl.expand_dims(tl.minimum(s, _F32_MAX), 2), (R, B // GW, GW))
        q = quotient_rn(g, sf, rb, PTX)  # lanes without data: 0 (or unused codes)
    else:
        # lanes without data divide s by itself: the GPU's division takes its slow path for a
        # zero dividend (a partial group's padding, padding rows), which made such tiles 2-3x
        # slower
        q = tl.math.div_rn(tl.where(lv, g, sb), sb)
    return tl.reshape(group_codes(q, INT8, PTX, RCP), (R, B)), s


def rcp_quotients(eps: float) -> bool:
    """Whether :func:`group_quant_tile` may take its quotients from one reciprocal per group:
    ``eps >= RCP_MIN_EPS`` (the default 1e-10 is), so every scale is a normal FP32 number."""
    return eps >= RCP_MIN_EPS


@triton.jit
def store_scales(ptrs, s, mask, E8M0: tl.constexpr):
    """FP32 scales (NaN as 0x7FC00000), or their float8_e8m0fnu bytes (E8M0: the exponent field
    of the power-of-two scale; 0 and subnormals -> 0, Inf and NaN -> 0xFF, as torch converts)."""
    if E8M0:
        b = s.to(tl.uint32, bitcast=True)
        tl.store(ptrs, tl.where(b >= 0x7F800000, 255, b >> 23).to(tl.uint8), mask=mask)
    else:
        # every NaN scale stored as the canonical 0x7FC00000 (payloads differ between the GPU's
        # division and the CPU's, as between NaN inputs)
        nan = tl.full(s.shape, 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)
        tl.store(ptrs, tl.where(s != s, nan, s), mask=mask)


# ----------------------------------------------------------------------------- standalone
def _metadata(grid, kernel, args):
    n, h = args["n_rows"], args["H"]
    scales = n * args["G"] * (1 if args["E8M0"] else 4)
    return {
        "name": f"per_token_group_quant_8bit M={n} H={h}",
        "bytes": n * h * (args["x_ptr"].element_size() + 1) + scales,
    }


# ``strides`` = (x_st, x_sh, s_st, s_sh, s_sg): the rows of x and of the scales addressed as
# (row // T) * stride_t + (row % T) * stride_h (T = 1 for 2-D), groups at g * s_sg.
@triton.jit(do_not_specialize=["n_rows"], launch_metadata=_metadata)
def _group_quant_kernel(
    x_ptr, q_ptr, s_ptr,
    n_rows, H, G, T,
    x_st, x_sh, s_st, s_sh, s_sg,
    eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GW: tl.constexpr, QMAX: tl.constexpr,
    UE8M0: tl.constexpr, INT8: tl.constexpr, E8M0: tl.constexpr, RCP: tl.constexpr,
    PTX: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """codes[row, col] and scales[row, g] of one [BLOCK_M, BLOCK_N] tile (whole groups)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols < H)[None, :]
    if USE_PDL:
        gdc_wait()
    x = tl.load(
        x_ptr + row_base(rows, T, x_st, x_sh)[:, None] + cols[None, :],
        mask=mask,
        other=0.0,
        eviction_policy="evict_first",
    )
    if USE_PDL:
        gdc_launch_dependents()
    if PTX and x.dtype == tl.bfloat16:
        xf = widen_bf16_pairs(x)  # one instruction per element (Triton's conversion: 1.5)
    else:
        xf = widen_f32(x, PTX)
    q, s = group_quant_tile(xf, mask, eps, GW, QMAX, UE8M0, INT8, PTX, RCP)
    tl.store(q_ptr + (rows.to(tl.int64) * H)[:, None] + cols[None, :], q, mask=mask)
    gs = tl.program_id(1) * (BLOCK_N // GW) + tl.arange(0, BLOCK_N // GW)
    s_off = row_base(rows, T, s_st, s_sh)[:, None] + gs[None, :].to(tl.int64) * s_sg
    store_scales(s_ptr + s_off, s, rmask[:, None] & (gs < G)[None, :], E8M0)


def group_tile(width: int, group_size: int, rows: int = 1 << 30) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) of the standalone kernel for ``rows`` rows of ``width``: up to
    GROUP_ROW_MAX_ROWS rows, one row of up to GROUP_ROW_MAX_COLS columns per program
    (GROUP_ROW_WARPS warps at most, 8 elements per thread); more rows, up to GROUP_MAX_COLS
    columns and as many rows as make GROUP_TILE elements. Always at least one group wide."""
    if rows <= GROUP_ROW_MAX_ROWS:
        block_n = max(group_size, min(next_pow2(max(width, 1)), GROUP_ROW_MAX_COLS))
        return 1, block_n, max(1, min(GROUP_ROW_WARPS, block_n // 256))
    block_n = max(group_size, min(next_pow2(max(width, 1)), GROUP_MAX_COLS))
    return max(1, GROUP_TILE // block_n), block_n, GROUP_WARPS


def _rows(t):
    """(rows, T, stride_t, stride_h) of a 2-D or 3-D view (T = 1 for 2-D)."""
    if t.dim() == 2:
        return t.shape[0], 1, t.stride(0), 0
    return t.shape[0] * t.shape[1], t.shape[1], t.stride(0), t.stride(1)


def launch_group_quant(
    input,
    q,
    scales,
    group_size: int,
    eps: float,
    int8: bool,
    ue8m0: bool,
    use_pdl: bool,
    tile: tuple[int, int, int] | None = None,
) -> None:
    """``input`` 2-D/3-D (last dim contiguous, any row strides); ``q`` contiguous codes (uint8
    FP8 bits or int8) of its shape; ``scales`` ``[..., G]`` FP32 or uint8 (E8M0 bytes) with any
    strides. ``tile`` overrides ``group_tile``'s (BLOCK_M, BLOCK_N, warps) (benchmark sweeps;
    no bit depends on it)."""
    n_rows, t, x_st, x_sh = _rows(input)
    width = input.shape[-1]
    if n_rows == 0 or width == 0:
        return
    _, _, s_st, s_sh = _rows(scales)
    g = scales.shape[-1]
    bm, bn, warps = tile or group_tile(width, group_size, n_rows)
    grid = (triton.cdiv(n_rows, bm), triton.cdiv(width, bn))
    launch(
        _group_quant_kernel,
        grid,
        input, q, scales,
        n_rows, width, g, t,
        x_st, x_sh, s_st, s_sh, scales.stride(-1),
        float(eps),
        BLOCK_M=bm, BLOCK_N=bn, GW=group_size, QMAX=127.0 if int8 else 448.0,
        UE8M0=ue8m0, INT8=int8, E8M0=scales.dtype.itemsize == 1, RCP=rcp_quotients(eps),
        PTX=not interpreter_active(), USE_PDL=use_pdl,
        num_warps=warps,
        **pdl_launch_kwargs(use_pdl),
    )  # fmt: skip
