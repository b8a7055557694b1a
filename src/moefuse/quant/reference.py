"""PyTorch references of the quantization ops (spec: Quantization) — the oracle and the CPU path.

Each function has the signature of its public op (minus ``out``/``impl``/``enable_pdl``) and returns
new tensors; it never mutates its arguments (the public ops copy results into in-place targets).
The fused references are literally ``moefuse.norm.reference`` followed by the format primitives in
:mod:`moefuse.quant.formats`, so "fused == unfused" is true by construction.

Conventions (documented once here, tested in ``tests/test_quant*.py``):

* FP8: ``q = e8(v * inv)`` with ``inv = 1/scale`` an IEEE FP32 division done once; RNE, finite
  saturation (``|x| >= max`` and Inf -> +-max), every NaN -> byte 0x7F.
* NVFP4 ("fast" recipe): the reciprocal is a parameter ``rcp``; the default is the IEEE reciprocal
  (what Triton's interpreter computes for ``rcp_fast``). GPU tests pass the device's
  ``rcp.approx.ftz.f32`` (``moefuse.quant.triton.rcp_approx``) and then compare bit for bit.
* NVFP4 NaN/Inf: a block containing NaN gets scale byte 0x7F (E4M3 NaN) so the whole block
  dequantizes to NaN; a block whose amax is Inf gets scale byte 0x7E (448), Inf elements code
  +-6 and finite ones their (usually zero) codes. Nibble sign bit set iff ``v < 0``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moefuse.norm import reference as norm_ref
from moefuse.quant import formats as F

Rcp = Callable[[torch.Tensor], torch.Tensor] | None


def inverse_scale(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as one FP32 IEEE division (0-d tensor)."""
    s = scale.float().reshape(())
    return torch.ones_like(s) / s


# ----------------------------------------------------------------------------- FP8
def fp8_quantize_reference(
    input: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> torch.Tensor:
    """Static per-tensor FP8: ``e8(f32(input) * (1/scale))``; same shape as ``input``."""
    q = F.fp8_bits(input.float() * inverse_scale(scale).to(input.device), dtype)
    return q.view(dtype)


def _div(a: torch.Tensor, b: float) -> torch.Tensor:
    """IEEE FP32 ``a / b``. (Dividing a CUDA tensor by a Python scalar multiplies by the rounded
    reciprocal in PyTorch, which is not the spec's division.)"""
    return a / torch.full_like(a, b)


def fp8_per_token_scale(amax: torch.Tensor) -> torch.Tensor:
    """spec: fp8_quantize_per_token: ``max(amax / 448, 2^-9 / 448)`` in FP32, NaN propagating."""
    amax = amax.float()
    floor = _div(torch.full_like(amax, 2.0**-9), 448.0)
    return torch.maximum(_div(amax, 448.0), floor)


def fp8_quantize_per_token_reference(input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token E4M3 (spec: fp8_quantize_per_token) over the last dim.

    Returns ``(q [..., H] float8_e4m3fn, scales [..., 1] FP32)`` with
    ``s = max(amax/448, 2^-9/448)`` and ``q = e4m3(v / s)`` (IEEE division per element;
    saturation makes the spec's clamp implicit).
    """
    x = input.float()
    if x.shape[-1] == 0 or x.numel() == 0:
        amax = x.new_zeros(*x.shape[:-1], 1)
    else:
        amax = x.abs().amax(dim=-1, keepdim=True)
    s = fp8_per_token_scale(amax)
    return F.fp8_bits(x / s).view(torch.float8_e4m3fn), s


# ----------------------------------------------------------------------------- per-token-group
#: largest code of each 8-bit group format: the scale is ``max(amax, eps) / QMAX``
GROUP_QMAX = {torch.float8_e4m3fn: 448.0, torch.int8: 127.0}


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(s))`` exactly for positive finite FP32 ``s`` (UE8M0 scales); NaN, Inf and 0
    pass through. ``frexp`` gives ``s = m * 2^e`` with ``m`` in [0.5, 1): a power of two has
    ``m == 0.5`` and stays, anything else rounds up to ``2^e``."""
    m, e = torch.frexp(s)
    up = torch.ldexp(torch.ones_like(s), e.to(s.dtype))
    p2 = torch.where(m == 0.5, s, up)
    return torch.where(torch.isfinite(s) & (s > 0), p2, s)


def group_quant_scale(
    amax: torch.Tensor, eps: float, qmax: float, scale_ue8m0: bool = False
) -> torch.Tensor:
    """spec: per_token_group_quant_8bit: ``s = max(amax, eps) / qmax`` (one IEEE FP32 division,
    NaN propagating), then ``2^ceil(log2(s))`` when ``scale_ue8m0``."""
    amax = amax.float()
    s = _div(torch.maximum(amax, torch.full_like(amax, eps)), qmax)
    return pow2_ceil(s) if scale_ue8m0 else s


def group_quant_codes(v: torch.Tensor, s: torch.Tensor, dst_dtype: torch.dtype) -> torch.Tensor:
    """Codes of ``v / s`` (IEEE FP32 division per element; ``s`` broadcast): E4M3 with RNE and
    saturation, NaN -> 0x7F; INT8 with round-half-even, clamp to [-127, 127], NaN -> 0."""
    q = v.float() / s
    if dst_dtype == torch.int8:
        q = torch.nan_to_num(q, nan=0.0).round().clamp(-127.0, 127.0)
        return q.to(torch.int8)
    return F.fp8_bits(q, dst_dtype).view(dst_dtype)


def per_token_group_quant_8bit_reference(
    x: torch.Tensor,
    group_size: int,
    eps: float = 1e-10,
    dst_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token-group 8-bit quantization (spec: per_token_group_quant_8bit).

    ``x`` ``[..., H]``; the last dim splits into ``G = ceil(H / group_size)`` groups of
    ``group_size`` consecutive channels (the last one partial when ``group_size`` does not divide
    H). Per token and group: ``amax = max |f32(x)|`` (NaN propagating), ``s`` from
    :func:`group_quant_scale`, ``q`` from :func:`group_quant_codes`. Returns
    ``(q [..., H] dst_dtype, s [..., G] FP32)`` in row-major layout; new tensors.
    """
    h = x.shape[-1]
    g = -(-h // group_size) if h else 0
    v = x.float()
    pad = g * group_size - h
    vp = torch.nn.functional.pad(v, (0, pad)) if pad else v
    groups = vp.reshape(*v.shape[:-1], g, group_size)
    if groups.numel() == 0:
        amax = groups.new_zeros(*v.shape[:-1], g)
    else:
        # amax with NaN propagation (torch.amax propagates NaN)
        amax = groups.abs().amax(dim=-1)
    s = group_quant_scale(amax, eps, GROUP_QMAX[dst_dtype], scale_ue8m0)
    q = group_quant_codes(groups, s.unsqueeze(-1), dst_dtype)
    q = q.reshape(*v.shape[:-1], g * group_size)[..., :h]
    # a NaN scale is returned as the canonical quiet NaN 0x7FC00000, whatever the input's payload
    s = torch.where(torch.isnan(s), torch.full_like(s, float("nan")), s)
    return q.contiguous(), s


def rmsnorm_group_quant_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    group_size: int = 128,
    gain_center: float = 0.0,
    quant_eps: float = 1e-10,
    dst_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """spec: rmsnorm_group_quant: the unfused chain, RMSNorm rounded to the input dtype
    (``moefuse.norm.reference.rmsnorm_reference``) then
    :func:`per_token_group_quant_8bit_reference` of it. Returns ``(q, s [..., G])``."""
    y = norm_ref.rmsnorm_reference(input, weight, eps, gain_center)
    return per_token_group_quant_8bit_reference(y, group_size, quant_eps, dst_dtype, scale_ue8m0)


def fused_add_rmsnorm_group_quant_reference(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    group_size: int = 128,
    gain_center: float = 0.0,
    quant_eps: float = 1e-10,
    dst_dtype: torch.dtype = torch.float8_e4m3fn,
    scale_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """spec: fused_add_rmsnorm_group_quant: ``fused_add_rmsnorm`` (norm of the FP32 sum, rounded
    to the input dtype) then :func:`per_token_group_quant_8bit_reference` of the norm output.
    Returns ``(q, s [..., G], residual_out)``."""
    y, res_out = norm_ref.fused_add_rmsnorm_reference(input, residual, weight, eps, gain_center)
    q, s = per_token_group_quant_8bit_reference(y, group_size, quant_eps, dst_dtype, scale_ue8m0)
    return q, s, res_out


def fp8_dequantize_reference(
    input: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """``cast(f32(q) * scale)``; ``scale`` is ``[1]`` (per tensor) or ``[..., 1]`` (per row)."""
    s = scale.float()
    if s.numel() == 1:
        s = s.reshape(())
    return (input.float() * s).to(out_dtype)


# ----------------------------------------------------------------------------- NVFP4
def fp4_quantize_reference(
    input: torch.Tensor,
    global_scale: torch.Tensor,
    layout: str = "swizzled_128x4",
    recipe: str = "fast",
    rcp: Rcp = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4 (spec: NVFP4 format) of ``input`` ``[M, H]`` (H % 16 == 0, values taken as they are).

    Returns ``(packed [M, H/2] uint8, scales uint8)``; ``scales`` has shape
    ``formats.scale_layout_shape(M, H/16, layout)`` and, flattened, is in the layout's byte order
    with zeroed padding.
    """
    nib, sf = F.nvfp4_block_quant(input.float(), global_scale, recipe, rcp)
    return F.pack_nibbles(nib), F.swizzle_scales(sf, layout)


def fp4_dequantize_reference(
    packed: torch.Tensor,
    scales: torch.Tensor,
    global_scale: torch.Tensor,
    layout: str = "swizzled_128x4",
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``x = cast((e2m1_value(code) * f32(sf)) / gs)`` (product exact, IEEE division)."""
    m, half = packed.shape
    kb = 2 * half // 16
    sf = F.unswizzle_scales(scales, m, kb, layout)
    vals = F.e2m1_values(F.unpack_nibbles(packed)).reshape(m, kb, 16)
    prod = vals * F.fp8_values(sf).unsqueeze(-1)
    gs = global_scale.float().reshape(()).to(packed.device)
    return (prod / gs).reshape(m, 2 * half).to(out_dtype)


# ----------------------------------------------------------------------------- fused norms
def rmsnorm_quant_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
    quant_dtype: torch.dtype = torch.float8_e4m3fn,
    gain_center: float = 0.0,
) -> torch.Tensor:
    """spec: rmsnorm_quant: ``e8(((x * r) * g) * (1/scale))`` of the UNROUNDED FP32 norm output."""
    x = input.float()
    y = (x * norm_ref.inv_rms(x, eps)) * norm_ref.gain(weight, gain_center)
    return F.fp8_bits(y * inverse_scale(scale).to(y.device), quant_dtype).view(quant_dtype)


def fused_add_rmsnorm_quant_reference(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    eps: float = 1e-6,
    quant_dtype: torch.dtype = torch.float8_e4m3fn,
    gain_center: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_add_rmsnorm_quant. Returns ``(q, residual_out)``: ``h = f32(input) + f32(residual)``,
    ``residual_out = cast(h)``, ``q = e8(((h * r) * g) * (1/scale))`` with r from the FP32 h."""
    h = input.float() + residual.float()
    y = (h * norm_ref.inv_rms(h, eps)) * norm_ref.gain(weight, gain_center)
    q = F.fp8_bits(y * inverse_scale(scale).to(y.device), quant_dtype).view(quant_dtype)
    return q, h.to(residual.dtype)


def rmsnorm_fp4_quantize_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    global_scale: torch.Tensor,
    eps: float = 1e-6,
    layout: str = "swizzled_128x4",
    recipe: str = "fast",
    gain_center: float = 0.0,
    rcp: Rcp = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RMSNorm, rounded to the input dtype, then NVFP4 (the unfused pipeline, spec).

    Returns ``(packed, scales, norm_out)`` with ``norm_out = rmsnorm_reference(...)``.
    """
    y = norm_ref.rmsnorm_reference(input, weight, eps, gain_center)
    packed, scales = fp4_quantize_reference(y, global_scale, layout, recipe, rcp)
    return packed, scales, y


def fused_add_rmsnorm_fp4_quantize_reference(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    global_scale: torch.Tensor,
    eps: float = 1e-6,
    layout: str = "swizzled_128x4",
    recipe: str = "fast",
    gain_center: float = 0.0,
    rcp: Rcp = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fused_add_rmsnorm`` (spec: fused_add_rmsnorm) then NVFP4 of the rounded norm output.

    Returns ``(packed, scales, norm_out, residual_out)``.
    """
    y, res_out = norm_ref.fused_add_rmsnorm_reference(input, residual, weight, eps, gain_center)
    packed, scales = fp4_quantize_reference(y, global_scale, layout, recipe, rcp)
    return packed, scales, y, res_out
