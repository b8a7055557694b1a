"""Bitwise checks of the group quantizer's division-free steps against the IEEE division:
:func:`moefuse.quant.group_triton.scale_quotient_rn` (the scale ``m / QMAX``) at every FP32
``m`` of a bit range (:func:`check_scales`), and :func:`moefuse.quant.group_triton.quotient_rn`
(the reciprocal-and-FMA quotient) on cases built to stress it: scales
from amaxes across the FP32 range and at the eps floor, power-of-two (UE8M0) scales, dividends
spread over ``[-amax, amax]`` (FP32 and BF16-rounded), dividends whose quotient lies at or one to
two ulps beside an E4M3 rounding midpoint or an INT8 half-integer, zeros of both signs,
subnormal dividends, infinite and NaN scales.

Used by the CPU tests (the Triton interpreter, whose FMA is emulated exactly) and the GPU tests
(the hardware FMA, millions of cases).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moefuse._runtime import interpreter_active
from moefuse.quant import formats
from moefuse.quant.group_triton import _F32_MAX, RCP_MIN_EPS, quotient_rn, scale_quotient_rn


@triton.jit
def _quotient_kernel(x_ptr, s_ptr, q_ptr, n, BLOCK: tl.constexpr, PTX: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    x = tl.load(x_ptr + i, mask=m, other=0.0)
    s = tl.load(s_ptr + i, mask=m, other=1.0)
    rcp = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    tl.store(q_ptr + i, quotient_rn(x, tl.minimum(s, _F32_MAX), rcp, PTX), mask=m)


def quotients(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``quotient_rn(x, min(s, FLT_MAX), 1 / s)`` elementwise, as the quantizer calls it (FP32
    1-D tensors of one length)."""
    q = torch.empty_like(x)
    block = 1024
    _quotient_kernel[(triton.cdiv(x.numel(), block),)](
        x, s, q, x.numel(), BLOCK=block, PTX=not interpreter_active()
    )
    return q


def cases(n: int, device, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, s): ``n`` random pairs of each kind (module docstring), FP32, on ``device``."""

    def rand(*shape):
        return torch.rand(*shape, generator=generator, device=device)

    # scales as group_scale makes them: max(amax, eps) / 448 or / 127, amax over 2^-40..2^100
    amax = torch.exp2(rand(n) * 140.0 - 40.0)
    qmax = torch.where(rand(n) < 0.5, 448.0, 127.0)
    s = torch.maximum(amax, torch.full_like(amax, 1e-10)) / qmax
    pow2 = rand(n) < 0.2  # UE8M0: 2^ceil(log2 s)
    s = torch.where(pow2, torch.exp2(torch.ceil(torch.log2(s))), s)
    s = torch.where(rand(n) < 0.02, torch.full_like(s, RCP_MIN_EPS / 448.0), s)
    # spread dividends, FP32 and BF16-rounded
    x = (rand(n) * 2.0 - 1.0) * (s * qmax)
    x = torch.where(rand(n) < 0.5, x.bfloat16().float(), x)
    # dividends at and beside rounding midpoints: quotients k * 2^e with a 5-bit odd k (E4M3
    # midpoints, normal and subnormal) or j + 1/2 (INT8), times s rounded, then 0..+-2 ulps
    k = 17 + 2 * torch.randint(0, 8, (n,), generator=generator, device=device)
    e = torch.randint(-14, 5, (n,), generator=generator, device=device)
    target = torch.where(
        rand(n) < 0.7,
        k.float() * torch.exp2(e.float()),
        torch.randint(0, 127, (n,), generator=generator, device=device).float() + 0.5,
    )
    sign = torch.where(rand(n) < 0.5, -1.0, 1.0)
    steps = torch.randint(-2, 3, (n,), generator=generator, device=device).to(torch.int32)
    xm = ((sign * target * s).view(torch.int32) + steps).view(torch.float32)  # ulps from zero
    specials_x = torch.tensor(
        [0.0, -0.0, 1e-45, -1e-45, 1e-39, -3e-39, 1.0, -1.0, float("inf"), 1.0, 0.0, -2.0],
        device=device,
    )
    specials_s = torch.tensor(
        [1.0, 1.0, 3e-12, 3e-12, 1e-13, 1e-13, float("inf"), float("inf"), float("inf"),
         float("nan"), float("nan"), 2.0**-40],
        device=device,
    )  # fmt: skip
    return torch.cat([x, xm, specials_x]), torch.cat([s, s, specials_s])


def check(n: int, device="cpu", seed: int = 0) -> int:
    """Compare :func:`quotients` with ``x / s`` (IEEE) on :func:`cases`: the FP32 bits where the
    quotient is at least 2^-11, the E4M3 codes (sign included) and INT8 codes everywhere; NaN
    quotients must stay NaN. Raises AssertionError naming the first mismatch; returns the count
    of pairs checked."""
    g = torch.Generator(device=device).manual_seed(seed)
    x, s = cases(n, device, g)
    got = quotients(x, s)
    want = x / s
    nan = torch.isnan(want)
    bad = nan != torch.isnan(got)
    big = (want.abs() >= 2.0**-11) & ~nan
    bad |= big & (got.view(torch.int32) != want.view(torch.int32))
    bad |= formats.fp8_bits(got) != formats.fp8_bits(want)
    i8 = lambda q: torch.nan_to_num(q, nan=0.0).clamp(-127, 127).round()  # noqa: E731
    bad |= i8(got) != i8(want)
    if bool(bad.any()):
        j = int(bad.nonzero()[0])
        raise AssertionError(
            f"quotient_rn({x[j].item()!r}, {s[j].item()!r}) = {got[j].item()!r}, IEEE division "
            f"{want[j].item()!r} ({int(bad.sum())} of {x.numel()} pairs differ)"
        )
    return x.numel()


@triton.jit
def _scale_kernel(
    s_ptr, first, step, n, QMAX: tl.constexpr, BLOCK: tl.constexpr, PTX: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    bits = (first + i * step).to(tl.uint32)
    m = bits.to(tl.float32, bitcast=True)
    tl.store(s_ptr + i, scale_quotient_rn(m, QMAX, PTX), mask=i < n)


def check_scales(first: int, count: int, qmax: float, device="cpu", step: int = 1) -> int:
    """:func:`scale_quotient_rn` of the ``count`` FP32 values whose bit patterns are ``first +
    i * step`` (positive patterns up to 0x7FFFFFFF; Inf and NaN patterns included)
    against ``m / qmax`` (IEEE; NaN for NaN). Raises AssertionError naming the first mismatch;
    returns ``count``."""
    got = torch.empty(count, dtype=torch.float32, device=device)
    block = 1024
    _scale_kernel[(triton.cdiv(count, block),)](
        got, first, step, count, QMAX=qmax, BLOCK=block, PTX=not interpreter_active()
    )
    m = (torch.arange(count, dtype=torch.int64, device=device) * step + first).to(torch.int32)
    m = m.view(torch.float32)
    # a tensor divisor: torch on CUDA divides by a Python scalar as a product with its reciprocal
    want = m / torch.full_like(m, qmax)
    same = got.view(torch.int32) == want.view(torch.int32)
    same |= torch.isnan(got) & torch.isnan(want)
    if not bool(same.all()):
        j = int((~same).nonzero()[0])
        raise AssertionError(
            f"scale_quotient_rn({m[j].item()!r} / {qmax}) = {got[j].item()!r}, IEEE division "
            f"{want[j].item()!r} ({int((~same).sum())} of {count} values differ)"
        )
    return count


#: the bit pattern of RCP_MIN_EPS (2^-60): every scale the reciprocal path computes has m >= it
RCP_MIN_EPS_BITS = (127 - 60) << 23


def check_all_scales(qmax: float, device, chunk: int = 1 << 28) -> int:
    """:func:`check_scales` at every FP32 ``m`` from 2^-60 through +Inf and the positive NaNs
    (about 1.6e9 values; the GPU test's exhaustive run)."""
    done, first, end = 0, RCP_MIN_EPS_BITS, 0x80000000
    while first < end:
        n = min(chunk, end - first)
        done += check_scales(first, n, qmax, device)
        first += n
    return done
