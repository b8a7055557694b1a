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
