"""Triton device helpers shared by kernel families.

Each helper that needs inline PTX takes a ``PTX: tl.constexpr`` switch: launchers pass
``PTX = not interpreter_active()``; the interpreter runs the equivalent Python-side math instead
(Triton's interpreter cannot execute inline assembly).
"""

import triton
import triton.language as tl


@triton.jit
def rcp_fast(x, PTX: tl.constexpr):
    """``rcp.approx.ftz.f32`` (1 ulp off IEEE on ~13% of inputs); IEEE 1/x in the interpreter."""
    if PTX:
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return 1.0 / x


@triton.jit
def rsqrt_fast(x):
    """FP32 reciprocal square root; ``rsqrt.approx.ftz.f32`` on the GPU (<= 2 ulp)."""
    return tl.math.rsqrt(x)


@triton.jit
def _flush_subnormal_f32(x):
    """Sign-preserving zero for FP32 subnormals (biased exponent 0), ``x`` otherwise."""
    subnormal = (x.to(tl.int32, bitcast=True) & 0x7F800000) == 0
    return tl.where(subnormal, x * 0.0, x)


@triton.jit
def fma_ftz(a, b, c, PTX: tl.constexpr):
    """``fma.rn.ftz.f32``: ``a * b + c`` with one RNE rounding; subnormal inputs and result -> ±0.

    Off the PTX path (Triton's interpreter) the same bits come from FP64 math (spec: moe_finalize):
    product of two FP32 values is exact in FP64; the FP64 sum ``s = p + c`` is turned into its
    round-to-odd value (if the TwoSum error is non-zero and ``s`` has an even last bit, step ``s``
    one FP64 ulp toward the error), which has enough spare bits that the final FP64 -> FP32 RNE
    conversion equals a single rounding of the exact ``a * b + c`` — on every FP32 grid, including
    the subnormal one. This is the spec's midpoint correction in a form that needs no midpoint test.
    """
    if PTX:
        return tl.inline_asm_elementwise(
            "fma.rn.ftz.f32 $0, $1, $2, $3;",
            "=r,r,r,r",
            [a, b, c],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        a = _flush_subnormal_f32(a.to(tl.float32))
        b = _flush_subnormal_f32(b.to(tl.float32))
        c = _flush_subnormal_f32(c.to(tl.float32))
        p = a.to(tl.float64) * b.to(tl.float64)
        cd = c.to(tl.float64)
        s = p + cd
        # TwoSum (Knuth): err is the exact rounding error of s = p + cd
        bv = s - p
        err = (p - (s - bv)) + (cd - bv)
        bits = s.to(tl.int64, bitcast=True)
        # s - s == 0 only for finite s (inf/NaN keep their bits)
        sticky = (err != 0.0) & ((bits & 1) == 0) & ((s - s) == 0.0)
        away = (err > 0.0) == (s > 0.0)  # the exact value has the larger magnitude
        bits = tl.where(sticky, tl.where(away, bits + 1, bits - 1), bits)
        r = bits.to(tl.float64, bitcast=True).to(tl.float32)
        return _flush_subnormal_f32(r)


@triton.jit
def fma_rn(a, b, c, PTX: tl.constexpr):
    """``a * b + c`` with one rounding: the GPU's ``fma.rn.f32``; off the PTX path (the
    interpreter's FMA rounds twice) :func:`fma_ftz`'s exact emulation. The two differ only
    where an input or the result is an FP32 subnormal (flushed by the emulation)."""
    if PTX:
        return tl.fma(a, b, c)
    else:
        return fma_ftz(a, b, c, PTX)


@triton.jit
def round_to(x, dtype: tl.constexpr, PTX: tl.constexpr):
    """FP32 ``x`` -> ``dtype`` with round-to-nearest-even (the spec's ``cast``).

    Triton's interpreter converts FP32 to BF16 by truncation, so off the GPU the BF16 case rounds
    in integer arithmetic on the FP32 bits instead (NaN stays NaN); other dtypes convert directly.
    """
    if PTX or dtype != tl.bfloat16:
        return x.to(dtype)
    else:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        hi = tl.where(x != x, (bits >> 16) | 0x40, rounded)
        return hi.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def widen_f32(x, PTX: tl.constexpr):
    """Exact widening to FP32. The interpreter's BF16 -> FP32 conversion mishandles subnormals,
    so off the GPU BF16 widens through its bits (a 16-bit shift); other dtypes convert directly."""
    if (not PTX) and (x.dtype == tl.bfloat16):
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def round_widen_bf16_pairs(x):
    """FP32 ``x`` rounded to BF16 (RNE) and widened back to FP32 (exact), on the GPU, two
    elements per ``cvt.rn.bf16x2.f32`` and a shift / mask each: 1.5 instructions per element
    against 2 for ``widen_f32(round_to(x, bf16))``, the same values (NaN stays NaN). GPU only."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 t; cvt.rn.bf16x2.f32 t, $3, $2; shl.b32 $0, t, 16; "
        "and.b32 $1, t, 0xFFFF0000; }",
        "=r,=r,r,r",
        [x],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )


@triton.jit
def widen_bf16_pairs(x):
    """BF16 -> FP32 (exact) on the GPU in one instruction per element: a register holds a BF16
    pair; the low element widens by ``shl 16``, the high one by masking its low half. (Triton's
    conversion takes PRMT + IMAD for the high element.) BF16 tensors only; GPU only."""
    return tl.inline_asm_elementwise(
        "{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000; }",
        "=r,=r,r",
        [x],
        dtype=tl.float32,
        is_pure=True,
        pack=2,
    )
