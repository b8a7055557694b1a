"""FP8 / NVFP4 format primitives in PyTorch: the oracle the kernels are checked against.

Written from the spec's text, independently of the Triton device code in ``device.py`` (which works
on FP32 bits): FP8 goes through PyTorch's own cast after clamping, E2M1 through the spec's
threshold table, and the swizzled layouts through the spec's reshape/permute formulation rather
than the offset formula. Every function runs on CPU or CUDA tensors.

Conventions shared with ``device.py``: FP8 NaN -> canonical 0x7F; E2M1 sign bit set iff x < 0
(-0.0 -> 0x0), NaN -> 0x7; NVFP4 zero block when the decoded scale byte is 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
FP8_CODE = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}

LAYOUTS = {"swizzled_128x4": 0, "swizzled_8x4": 1, "linear": 2}
RECIPES = {"fast": 0, "ieee": 1}
R6 = torch.tensor([0x3E2AAAAB], dtype=torch.int32).view(torch.float32).item()  # RNE(1/6)

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# (threshold, strict): code += 1 when |x| > t (strict) or |x| >= t (not strict).
_E2M1_STEPS = (
    (0.25, True),
    (0.75, False),
    (1.25, True),
    (1.75, False),
    (2.5, True),
    (3.5, False),
    (5.0, True),
)


def round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def fp8_bits(x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """FP32 -> FP8 bytes (uint8): clamp to +-max, RNE cast (spec: FP8 format), NaN -> 0x7F."""
    x = x.float()
    m = FP8_MAX[dtype]
    q = x.clamp(-m, m).to(dtype).view(torch.uint8)
    return torch.where(torch.isnan(x), torch.full_like(q, 0x7F), q)


def fp8_values(q: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """FP8 bytes (uint8) -> exact FP32 values."""
    return q.contiguous().view(dtype).float()


def e2m1_nibbles(x: torch.Tensor) -> torch.Tensor:
    """FP32 -> E2M1 nibbles (uint8 0..15) by the spec's threshold table (RNE, saturating)."""
    x = x.float()
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t, strict in _E2M1_STEPS:
        code += (a > t if strict else a >= t).to(torch.uint8)
    code = torch.where(torch.isnan(x), torch.full_like(code, 7), code)
    return code | (x < 0).to(torch.uint8) * 8


def e2m1_values(nib: torch.Tensor) -> torch.Tensor:
    """E2M1 nibbles -> FP32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=nib.device)
    mag = table[(nib & 7).long()]
    return torch.where((nib & 8) != 0, -mag, mag)


def pack_nibbles(nib: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]`` nibbles -> ``[..., n]`` bytes, element 2j in the low nibble."""
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def ieee_rcp(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded FP32 reciprocal (the interpreter's ``rcp_fast``)."""
    return torch.ones_like(x) / x


def nvfp4_block_quant(
    v: torch.Tensor,
    global_scale: torch.Tensor,
    recipe: str = "fast",
    rcp: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 per-block recipe (spec) on ``v`` ``[M, H]`` (H % 16 == 0; values already in the op's
    output precision). Returns ``(nibbles [M, H] uint8, sf [M, H/16] uint8)`` before packing and
    layout.

    ``rcp`` is the reciprocal of the "fast" recipe: by default IEEE (what the interpreter computes);
    GPU tests pass the device's ``rcp.approx.ftz.f32`` so that the comparison is bit-exact.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {tuple(RECIPES)}, got {recipe!r}")
    rcp = rcp or ieee_rcp
    m, h = v.shape
    blocks = v.float().reshape(m, h // 16, 16)
    gs = global_scale.float().reshape(()).to(v.device)
    # amax with NaN propagation (torch.amax propagates NaN).
    amax = blocks.abs().amax(dim=-1) if blocks.numel() else blocks.new_zeros(m, h // 16)
    r6 = torch.tensor(R6, dtype=torch.float32, device=v.device)
    sf_f32 = gs * (amax * r6)
    sf = fp8_bits(sf_f32)
    s = fp8_values(sf)
    if recipe == "fast":
        out_scale = rcp(s * rcp(gs.reshape(1)))
    else:
        out_scale = gs / s
    out_scale = torch.where(s == 0, torch.zeros_like(out_scale), out_scale)
    q = blocks.abs() * out_scale.unsqueeze(-1)
    code = e2m1_nibbles(q) & 7
    nib = code | (blocks < 0).to(torch.uint8) * 8
    return nib.reshape(m, h), sf


def scale_layout_shape(m: int, kb: int, layout: str) -> tuple[int, int]:
    """Shape ``[rows, cols]`` of the scale tensor for ``m`` rows and ``kb`` blocks per row."""
    if layout == "linear":
        return (m, kb)
    rows = round_up(m, 128 if layout == "swizzled_128x4" else 8)
    return (rows, round_up(kb, 4))


def swizzle_scales(sf: torch.Tensor, layout: str) -> torch.Tensor:
    """Row-major ``[M, KB]`` scale bytes -> the layout's bytes, shaped ``scale_layout_shape``.

    Padding bytes are 0.

    Uses the reshape/permute formulation of the spec (independent of the kernels' offsets).
    """
    m, kb = sf.shape
    if layout == "linear":
        return sf.clone()
    rows, kp = scale_layout_shape(m, kb, layout)
    padded = torch.zeros(rows, kp, dtype=torch.uint8, device=sf.device)
    padded[:m, :kb] = sf
    if layout == "swizzled_128x4":
        t = padded.reshape(rows // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4)
    else:
        t = padded.reshape(rows // 8, 8, kp // 4, 4).permute(0, 2, 1, 3)
    return t.contiguous().reshape(rows, kp)


def unswizzle_scales(scales: torch.Tensor, m: int, kb: int, layout: str) -> torch.Tensor:
    """Inverse of :func:`swizzle_scales`: the layout's bytes -> row-major ``[M, KB]``."""
    if layout == "linear":
        return scales.reshape(m, kb).clone()
    rows, kp = scale_layout_shape(m, kb, layout)
    flat = scales.reshape(-1)
    if layout == "swizzled_128x4":
        t = flat.reshape(rows // 128, kp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    else:
        t = flat.reshape(rows // 8, kp // 4, 8, 4).permute(0, 2, 1, 3)
    return t.contiguous().reshape(rows, kp)[:m, :kb]


def scale_offsets(m: int, kb: int, layout: str) -> torch.Tensor:
    """The spec's offset formula for every (row, block) as an int64 ``[M, KB]`` tensor."""
    r = torch.arange(m, dtype=torch.int64).unsqueeze(1)
    k = torch.arange(kb, dtype=torch.int64).unsqueeze(0)
    if layout == "linear":
        return r * kb + k
    kp = round_up(kb, 4)
    if layout == "swizzled_128x4":
        return (
            (r // 128) * (kp * 128) + (k // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + k % 4
        )
    return (r // 8) * (kp * 8) + (k // 4) * 32 + (r % 8) * 4 + k % 4


def _ordered_code(codes: torch.Tensor, sign_bit: int) -> torch.Tensor:
    c = codes.to(torch.int64)
    mag = c & (sign_bit - 1)
    return torch.where((c & sign_bit) != 0, -mag, mag)


def fp8_code_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Steps between FP8 codes along the value axis (``+0``/``-0`` are 0 apart); int64 tensor.

    Adjacent finite FP8 values are one step apart, so this measures "off by one rounding"."""
    oa = _ordered_code(a.view(torch.uint8), 0x80)
    return (oa - _ordered_code(b.view(torch.uint8).to(a.device), 0x80)).abs()


def e2m1_code_distance(a_packed: torch.Tensor, b_packed: torch.Tensor) -> torch.Tensor:
    """Steps between the E2M1 codes of two packed NVFP4 tensors (per element, int64)."""
    a, b = unpack_nibbles(a_packed), unpack_nibbles(b_packed.to(a_packed.device))
    return (_ordered_code(a, 8) - _ordered_code(b, 8)).abs()
