"""Triton device functions for FP8 and NVFP4 quantization, shared as kernel epilogues.

Every function here is pure (no loads or stores) and shape-generic unless its docstring says
otherwise, so the standalone quantizers, the fused norm + quant kernels and the communication
fusions all run the same code. Bit-exactness against the CPU reference must hold in
Triton's interpreter too, so every conversion has a software path built from integer operations on
the FP32 bits; ``PTX: tl.constexpr`` selects the hardware ``cvt`` where one exists on SM90 and has
been checked bit-identical (FP32 -> E4M3/E5M2 with RNE + satfinite). There is no FP32 -> E2M1
conversion on SM90 (spec: NVFP4 format): E2M1 is always software.

Constants and conventions (mirrored by ``moefuse.quant.reference``):

* FP8 format codes: ``E4M3 = 0`` (E4M3FN, max 448, byte 0x7E) and ``E5M2 = 1`` (max 57344, 0x7B).
  Encoding is round-to-nearest-even with finite saturation: ``|x| >= max`` (including +-Inf) gives
  +-max. Every NaN encodes as the canonical byte ``0x7F`` (sign dropped: NaN signs produced by GPU
  and CPU arithmetic differ, so a sign-carrying NaN could never be bit-exact). ``-0.0`` keeps its
  sign (0x80).
* E2M1 nibbles: sign bit 3, magnitude code bits 0-2 ``{0, .5, 1, 1.5, 2, 3, 4, 6}``, RNE with ties
  to the even code, saturating (``|x| > 6`` and Inf give code 7). The sign bit is set iff
  ``x < 0``: ``-0.0`` encodes as 0x0 and NaN as 0x7 (the spec lets tests treat 0x0 and 0x8 alike;
  this rule makes the nibble independent of NaN signs).
* NVFP4 recipe codes: ``RECIPE_FAST = 0`` (``rcp_fast(s * rcp_fast(gs))``), ``RECIPE_IEEE = 1``
  (``gs / s``, IEEE division).
* Scale layout codes (FlashInfer's ``layout_code``): ``SWIZZLED_128x4 = 0``, ``SWIZZLED_8x4 = 1``,
  ``LINEAR = 2``.
"""

import triton
import triton.language as tl

from moefuse._device import rcp_fast

# FP8 formats.
E4M3: tl.constexpr = tl.constexpr(0)
E5M2: tl.constexpr = tl.constexpr(1)
# NVFP4 output-scale recipes.
RECIPE_FAST: tl.constexpr = tl.constexpr(0)
RECIPE_IEEE: tl.constexpr = tl.constexpr(1)
# Scale-factor layouts (spec: NVFP4 format, scale layouts).
SWIZZLED_128x4: tl.constexpr = tl.constexpr(0)
SWIZZLED_8x4: tl.constexpr = tl.constexpr(1)
LINEAR: tl.constexpr = tl.constexpr(2)

# FP32 bit patterns used below.
_F32_INF_BITS: tl.constexpr = tl.constexpr(0x7F800000)
_R6: tl.constexpr = tl.constexpr(0x3E2AAAAB)  # rcp_fast(6.0) == RNE(1/6) (spec: Notation)


@triton.jit
def _add_rn(a, b, PTX: tl.constexpr):
    """FP32 ``a + b`` with one RNE rounding that the compiler may NOT contract with a preceding
    multiply into an FMA (``add.rn.f32``): the operand ``a`` must be the rounded product."""
    if PTX:
        return tl.inline_asm_elementwise(
            "add.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return a + b


@triton.jit
def _minifloat_magnitude(
    a,
    MAN: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    PTX: tl.constexpr,
):
    """Magnitude code of a small float format for ``a`` = FP32 bits with the sign cleared (uint32).

    RNE to MAN mantissa bits with exponent bias BIAS, target subnormals exact, saturating at
    MAX_CODE (which also catches Inf and NaN; callers that need a NaN code patch it).

    One FP32 add does the rounding: for ``a`` in binade ``e`` (clamped below at the target's
    minimum normal exponent ``emin``), ``magic = 2^(e + 23 - MAN)`` has an ulp equal to the target's
    spacing in that binade, so ``a + magic`` rounds ``a`` to the target grid (RNE, ties to even)
    and its low bits count grid steps ``k``; the code is ``k + ((e - emin) << MAN)``. The clamp
    makes the same formula produce the target's subnormals. Huge ``a`` (magic overflowing into the
    sign bit or to Inf), Inf and NaN all give codes far above MAX_CODE (unsigned), so the final
    minimum saturates them. Pure integer/FP32-add math: identical in the interpreter and on GPU.
    """
    EMIN_BITS: tl.constexpr = (128 - BIAS) << 23  # bits of 2^emin, emin = 1 - BIAS
    D: tl.constexpr = 23 - MAN
    eb = tl.maximum(a & 0x7F800000, EMIN_BITS)
    magic = eb + (D << 23)
    y = _add_rn(a.to(tl.float32, bitcast=True), magic.to(tl.float32, bitcast=True), PTX)
    code = (y.to(tl.uint32, bitcast=True) - magic - (EMIN_BITS >> D)) + (eb >> D)
    return tl.minimum(code, MAX_CODE)


@triton.jit
def _e4m3_ptx_canonical(x):
    """FP32 -> E4M3 byte on the GPU, four elements per instance, for inputs whose NaNs are the
    GPU's canonical ``0x7FFFFFFF`` (every result of an FP32 multiply or FMA is): two
    ``cvt.rn.satfinite.e4m3x2`` only, which give 0x7F for that NaN, so :func:`_e4m3_ptx`'s
    fix-up of negative NaNs is not needed. About 0.75 instructions per element."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 $0, {lo, hi}; }",
        "=r,r,r,r,r",
        [x],
        dtype=tl.uint8,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _e4m3_ptx(x):
    """FP32 -> E4M3 byte on the GPU, four elements per instance: two ``cvt.rn.satfinite.e4m3x2``
    (RNE, finite saturation; Inf -> +-448), then NaN bytes made canonical with byte-parallel
    integer ops. The conversion keeps a NaN's sign (0x7F / 0xFF) and never makes 0xFF from a
    number, so clearing bit 7 of 0xFF bytes gives 0x7F for every NaN: ``u = (t & 0x7F7F7F7F) +
    0x01010101`` sets bit 7 of a byte iff its low seven bits are all ones (no carry between
    bytes), and ``t ^ (u & t & 0x80808080)`` clears it where the byte had it too. About 1.75
    instructions per element, against ~5 for Triton's conversion plus a per-element NaN select
    (which also unpacks and repacks the bytes)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 t, u;\n"
        "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
        "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
        "mov.b32 t, {lo, hi};\n"
        "and.b32 u, t, 0x7F7F7F7F;\n"
        "add.u32 u, u, 0x01010101;\n"
        "and.b32 u, u, t;\n"
        "and.b32 u, u, 0x80808080;\n"
        "xor.b32 $0, t, u; }",
        "=r,r,r,r,r",
        [x],
        dtype=tl.uint8,
        is_pure=True,
        pack=4,
    )


@triton.jit
def fp8_encode(
    x,
    FMT: tl.constexpr,
    PTX: tl.constexpr,
    PACKED: tl.constexpr = True,
    CANONICAL_NAN: tl.constexpr = False,
):
    """FP32 -> FP8 byte (uint8), RNE, finite saturation, canonical NaN 0x7F. Any shape.

    ``FMT``: ``E4M3`` (0) or ``E5M2`` (1). ``PTX=True`` uses the hardware ``cvt.rn.satfinite``
    conversion and only fixes up NaN: for E4M3 four elements at a time in inline PTX
    (``_e4m3_ptx``) unless ``PACKED`` is False, otherwise Triton's ``.to(float8, rtne)`` and a
    per-element select (the same bytes). ``CANONICAL_NAN`` (E4M3, packed): every NaN of ``x``
    is the GPU's canonical positive NaN (``x`` is the result of FP32 arithmetic), so the
    conversion alone gives 0x7F (``_e4m3_ptx_canonical``). ``PTX=False`` is the integer
    encoder. The GPU test sweeps all 2^32 FP32 patterns through the three.
    """
    b = x.to(tl.uint32, bitcast=True)
    a = b & 0x7FFFFFFF
    if PTX:
        if FMT == 0 and PACKED and CANONICAL_NAN:
            q = _e4m3_ptx_canonical(x)
        elif FMT == 0 and PACKED:
            q = _e4m3_ptx(x)
        else:
            if FMT == 0:
                hw = x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
            else:
                hw = x.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
            q = tl.where(a > _F32_INF_BITS, 0x7F, hw).to(tl.uint8)
        return q
    else:
        if FMT == 0:
            mag = _minifloat_magnitude(a, 3, 7, 0x7E, PTX)
        else:
            mag = _minifloat_magnitude(a, 2, 15, 0x7B, PTX)
        sign = (b >> 24) & 0x80
        return tl.where(a > _F32_INF_BITS, 0x7F, mag | sign).to(tl.uint8)


@triton.jit
def _fp8_decode_fmt(
    q, MAN: tl.constexpr, BIAS: tl.constexpr, SUB_UNIT: tl.constexpr, HAS_INF: tl.constexpr
):
    qi = q.to(tl.uint32) & 0xFF
    sign = (qi & 0x80) << 24
    mag = qi & 0x7F
    exp = mag >> MAN
    man = mag & ((1 << MAN) - 1)
    normal_bits = ((exp + (127 - BIAS)) << 23) | (man << (23 - MAN))
    # Subnormal: man * 2^(1 - BIAS - MAN) (SUB_UNIT), exact in FP32.
    sub = man.to(tl.float32) * SUB_UNIT
    val = tl.where(exp == 0, sub, normal_bits.to(tl.float32, bitcast=True))
    if HAS_INF:
        val = tl.where(exp == 31, tl.where(man == 0, float("inf"), float("nan")), val)
    else:
        val = tl.where(mag == 0x7F, float("nan"), val)
    return (val.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def fp8_decode(q, FMT: tl.constexpr):
    """FP8 byte (integer tensor holding 0..255) -> exact FP32 value. Any shape.

    E4M3: 0x7F/0xFF decode to NaN; E5M2: exponent 31 decodes to Inf/NaN as the format defines.
    Software (integer) decode so it runs identically in the interpreter.
    """
    if FMT == 0:
        return _fp8_decode_fmt(q, 3, 7, 2.0**-9, False)
    else:
        return _fp8_decode_fmt(q, 2, 15, 2.0**-16, True)


@triton.jit
def _e2m1_round(a, PTX: tl.constexpr):
    """E2M1 rounding of ``a`` = FP32 bits with the sign cleared (uint32): returns FP32 bits ``y``
    (uint32) whose low byte is the magnitude code (0..7, bit 3 clear); bits 8..22 are zero and bits
    23..30 hold an exponent (callers mask or take the low byte). Any shape.

    Five operations, no final saturation: ``c = min(a, bits(6.0))`` (unsigned: Inf, NaN and
    everything above 6 become 6.0 = code 7); ``e'`` = exponent of ``c`` clamped below at 0 (E2M1's
    minimum normal 1.0); ``magic`` = ``2^(e' + 22)`` with mantissa ``2e'``, whose ulp ``2^(e'-1)``
    is E2M1's spacing in that binade; ``y = c + magic`` (one RNE add, ``add.rn.f32``: never
    contracted) then has mantissa ``k + 2e'`` with ``k = round(c / 2^(e'-1))``, which is the code
    (the even mantissa ``2e'`` keeps ties on even ``k``, i.e. on the even code). ``magic`` comes
    from ``t = max(eb + X, B)`` (``eb`` = exponent bits of ``c``) and ``t + (t >> 22)``: with
    ``X = (22 << 23) - 297`` the shift adds ``2e' + 254 + 43`` and the offset cancels. Checked
    against the spec's thresholds, all 2^31 non-negative FP32 patterns (numpy, and the GPU suite).
    """
    if PTX:
        # the same steps in PTX: LLVM would rewrite max(x + X, B) as max(x, B - X) + X, which
        # ptxas does not fuse; written this way SASS is VIMNMX, LOP3, VIADDMNMX (add+max),
        # LEA.HI (shr+add), FADD: 5 instructions (the previous encoder took 8 plus the min)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 c, t, s;\n"
            "min.u32 c, $1, 0x40C00000;\n"
            "and.b32 t, c, 0x7F800000;\n"
            "add.u32 t, t, 0x0AFFFED7;\n"
            "max.u32 t, t, 0x4A7FFED7;\n"
            "shr.u32 s, t, 22;\n"
            "add.u32 t, t, s;\n"
            "add.rn.f32 $0, c, t; }",
            "=r,r",
            [a],
            dtype=tl.uint32,
            is_pure=True,
            pack=1,
        )
    else:
        X: tl.constexpr = (22 << 23) - 297  # 0x0AFFFED7
        B: tl.constexpr = (127 << 23) + X  # 0x4A7FFED7: e' >= 0 (E2M1's minimum normal exponent)
        c = tl.minimum(a, 0x40C00000)
        t = tl.maximum((c & 0x7F800000) + X, B)
        magic = t + (t >> 22)
        y = c.to(tl.float32, bitcast=True) + magic.to(tl.float32, bitcast=True)
        return y.to(tl.uint32, bitcast=True)


@triton.jit
def e2m1_magnitude(a, PTX: tl.constexpr):
    """E2M1 magnitude code (int32, 0..7) of ``a`` = FP32 bits with the sign cleared (uint32).

    RNE with ties to the even code, saturating at 6.0 (code 7); NaN -> 7. Any shape.
    """
    return (_e2m1_round(a, PTX) & 7).to(tl.int32)


@triton.jit
def e2m1_encode(x, PTX: tl.constexpr):
    """FP32 -> E2M1 nibble (int32, 0..15): magnitude code | 8 if ``x < 0``. Any shape.

    Thresholds: 0 <= .25 < 1 < .75 <= 2 <= 1.25 < 3 < 1.75 <= 4 <= 2.5 < 5 < 3.5 <= 6
    <= 5 < 7. ``-0.0`` -> 0x0, NaN -> 0x7, +-Inf -> 0x7/0xF.
    """
    a = x.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    return e2m1_magnitude(a, PTX) | tl.where(x < 0, 8, 0)


@triton.jit
def e2m1_decode(nibble):
    """E2M1 nibble (integer tensor, 0..15) -> FP32 value (exact). Any shape."""
    n = nibble.to(tl.int32)
    code = n & 7
    # code 0..7 -> 0, .5, 1, 1.5, 2, 3, 4, 6: subnormal code 1 is 0.5; otherwise (2 + m) * 2^(e-2)
    # with e = code >> 1, m = code & 1.
    e = code >> 1
    m = code & 1
    normal = (2 + m).to(tl.float32) * tl.where(e == 1, 0.5, tl.where(e == 2, 1.0, 2.0))
    mag = tl.where(code < 2, code.to(tl.float32) * 0.5, normal)
    # Sign by bit-or (Triton's unary minus is 0 - x, which would turn -0.0 into +0.0).
    sign = ((n & 8) << 28).to(tl.uint32)
    return (mag.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def pack_nibbles(nib, N_OUT: tl.constexpr):
    """Pack nibbles along the last axis of a 3-D tile: ``[R, C, 2*N_OUT]`` -> ``[R, C, N_OUT]``
    uint8, element ``2j`` in the low nibble and ``2j+1`` in the high nibble (spec: NVFP4 format).
    (Reshape + split of a size-2 axis: each thread already holds the pair, no data movement.)
    """
    pairs = tl.reshape(nib, (nib.shape[0], nib.shape[1], N_OUT, 2))
    lo, hi = tl.split(pairs)
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def nvfp4_scale(amax, gs, rcp_gs, RECIPE: tl.constexpr, PTX: tl.constexpr):
    """NVFP4 per-block scale (spec) from the block amax. Any shape; returns (sf, out_scale).

    ``amax`` FP32 >= 0 (NaN allowed), ``gs`` the FP32 global scale (scalar), ``rcp_gs`` =
    ``rcp_fast(gs)`` computed once by the caller (only read by the "fast" recipe).
    ``sf`` (uint8) = ``e4m3(gs * (amax * R6))`` - two FP32 RNE multiplies in this order, never
    contracted (no add). ``out_scale`` (FP32) = 0 when ``f32(sf) == 0`` (zero block), else
    ``rcp_fast(s * rcp_gs)`` (RECIPE_FAST) or ``gs / s`` (RECIPE_IEEE, correctly rounded).
    A NaN amax gives ``sf = 0x7F`` and a NaN out_scale; Inf gives 448 (0x7E).
    """
    r6 = tl.full(amax.shape, _R6, tl.uint32).to(tl.float32, bitcast=True)
    sf_f32 = gs * (amax * r6)
    sf = fp8_encode(sf_f32, 0, PTX)
    if PTX:
        # hardware E4M3 -> FP32 (cvt via f16x2; exact, NaN stays NaN): ~3 instructions instead of
        # the ~12 of the integer decoder
        s = sf.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        s = fp8_decode(sf, 0)
    if RECIPE == 0:
        os = rcp_fast(s * rcp_gs, PTX)
    else:
        os = tl.math.div_rn(tl.zeros_like(s) + gs, s)
    out_scale = tl.where(s == 0.0, 0.0, os)
    return sf, out_scale


@triton.jit
def nvfp4_quantize_3d(v, gs, rcp_gs, RECIPE: tl.constexpr, PTX: tl.constexpr):
    """NVFP4-quantize an ``[R, B, 16]`` FP32 tile whose last axis is one 16-element block.

    ``v`` must already be in the op's output precision (e.g. BF16-rounded, widened exactly).
    Returns ``(packed [R, B, 8] uint8, sf [R, B] uint8)``: element 2j in the low nibble, 2j+1 in
    the high nibble; one E4M3 scale byte per block. Masked-off lanes must hold 0 (a block of zeros
    quantizes to sf = 0 and codes 0). Codes are ``e2m1(|v| * out_scale)`` with the sign bit set iff
    ``v < 0``. amax is an integer max over the FP32 bits with the sign cleared: exact for finite
    values, and NaN (largest bit pattern) propagates deterministically, whereas Triton's float max
    may drop NaN on the GPU.
    """
    a = v.to(tl.uint32, bitcast=True) & 0x7FFFFFFF
    amax = tl.max(a, axis=2).to(tl.float32, bitcast=True)
    sf, out_scale = nvfp4_scale(amax, gs, rcp_gs, RECIPE, PTX)
    q = a.to(tl.float32, bitcast=True) * tl.expand_dims(out_scale, 2)
    # low byte of y = the nibble (code in bits 0-2, sign in bit 3); the bits above are dropped by
    # the uint8 truncation after the pair merge, so no mask is needed
    y = _e2m1_round(q.to(tl.uint32, bitcast=True), PTX)
    R: tl.constexpr = v.shape[0]
    B: tl.constexpr = v.shape[1]
    y_lo, y_hi = tl.split(tl.reshape(y, (R, B, 8, 2)))
    v_lo, v_hi = tl.split(tl.reshape(v, (R, B, 8, 2)))
    # signs into bits 3 and 7 of the byte (a compare + one predicated OR each), then one IMAD
    # (y_hi * 16 + low): bit-disjoint in the low byte, so + is |
    low = tl.where(v_lo < 0, y_lo | 0x08, y_lo)
    low = tl.where(v_hi < 0, low | 0x80, low)
    return ((y_hi << 4) + low).to(tl.uint8), sf


@triton.jit
def nvfp4_quantize_blocks(v, gs, rcp_gs, RECIPE: tl.constexpr, PTX: tl.constexpr):
    """NVFP4-quantize a ``[BLOCKS, 16]`` FP32 tile (one block per row of the tile).

    Returns ``(packed [BLOCKS, 8] uint8, sf [BLOCKS] uint8)``; numerics of ``nvfp4_quantize_3d``.
    """
    B: tl.constexpr = v.shape[0]
    packed, sf = nvfp4_quantize_3d(tl.reshape(v, (1, B, 16)), gs, rcp_gs, RECIPE, PTX)
    return tl.reshape(packed, (B, 8)), tl.reshape(sf, (B,))


@triton.jit
def nvfp4_quantize_rows(
    v, gs, rcp_gs, BLOCK_H: tl.constexpr, RECIPE: tl.constexpr, PTX: tl.constexpr
):
    """NVFP4-quantize a ``[ROWS, BLOCK_H]`` FP32 tile of whole rows (BLOCK_H % 16 == 0).

    Returns ``(packed [ROWS, BLOCK_H // 2] uint8, sf [ROWS, BLOCK_H // 16] uint8)``. Columns past
    the real H must hold 0; the caller masks their stores. Numerics of ``nvfp4_quantize_3d``.
    """
    ROWS: tl.constexpr = v.shape[0]
    packed, sf = nvfp4_quantize_3d(
        tl.reshape(v, (ROWS, BLOCK_H // 16, 16)), gs, rcp_gs, RECIPE, PTX
    )
    return tl.reshape(packed, (ROWS, BLOCK_H // 2)), sf


@triton.jit
def scale_offset(m, k, n_kcols, LAYOUT: tl.constexpr):
    """Byte offset of the scale of row ``m``, block column ``k`` (integer tensors, broadcastable).

    ``n_kcols``: padded block columns ``Kp = round_up(H/16, 4)`` for the swizzled layouts, or
    ``KB = H/16`` for LINEAR. Offsets (spec: NVFP4 format):
    LINEAR ``m*KB + k``; SWIZZLED_128x4 ``(m//128)*Kp*128 + (k//4)*512 + (m%32)*16 +
    ((m%128)//32)*4 + k%4``; SWIZZLED_8x4 ``(m//8)*Kp*8 + (k//4)*32 + (m%8)*4 + k%4``.
    Callers pass int64 ``m`` when ``Mp * Kp`` may exceed 2^31.
    """
    # m, k >= 0: shifts and masks instead of // and % (signed division needs sign fix-ups); the
    # offset inside a row tile is < 2^31 for any real width, so it is computed in 32 bits and only
    # the row-tile term keeps m's width (64-bit when the caller passes int64)
    if LAYOUT == 2:
        return m * n_kcols + k
    elif LAYOUT == 0:
        mi = m.to(tl.int32)
        ki = k.to(tl.int32)
        inner = ((ki >> 2) << 9) + ((mi & 31) << 4) + (((mi >> 5) & 3) << 2) + (ki & 3)
        return (m >> 7) * (n_kcols * 128) + inner
    else:
        mi = m.to(tl.int32)
        ki = k.to(tl.int32)
        inner = ((ki >> 2) << 5) + ((mi & 7) << 2) + (ki & 3)
        return (m >> 3) * (n_kcols * 8) + inner


@triton.jit
def fp8_amax_scale(amax):
    """Dynamic per-token E4M3 scale (spec): ``max(amax / 448, 2^-9 / 448)``, IEEE division."""
    floor_ = tl.math.div_rn(tl.zeros_like(amax) + 2.0**-9, tl.zeros_like(amax) + 448.0)
    return tl.maximum(tl.math.div_rn(amax, tl.zeros_like(amax) + 448.0), floor_)
