"""FlashInfer's quantization entry points mapped onto moefuse (used by ``compat/flashinfer.py``).

Same names, argument names and defaults as FlashInfer 0.7.2; the work is done by the moefuse ops,
so the numbers are moefuse's (spec: software E2M1 on SM90, zero block when the scale byte is
0, padding bytes written as 0). Differences are stated per function; options moefuse does not
implement (MXFP4 / UE8M0 scales, weight shuffling) raise ``NotImplementedError`` instead of being
ignored.
"""

from __future__ import annotations

import warnings
from enum import Enum

import torch

from moefuse.quant import api, group_api

__all__ = [
    "SfLayout",
    "fp4_quantize",
    "nvfp4_quantize",
    "e2m1_and_ufp8sf_scale_to_float",
    "rmsnorm_quant",
    "fused_add_rmsnorm_quant",
    "rmsnorm_fp4quant",
    "add_rmsnorm_fp4quant",
    "per_token_group_quant_8bit",
]


class SfLayout(Enum):
    """Layout of NVFP4 scale factors (FlashInfer's enum values)."""

    layout_128x4 = 0
    layout_8x4 = 1
    layout_linear = 2


_LAYOUT_NAMES = {0: "swizzled_128x4", 1: "swizzled_8x4", 2: "linear"}


def _nvfp4_only(sf_vec_size: int, sf_use_ue8m0: bool = False) -> None:
    if sf_vec_size != 16 or sf_use_ue8m0:
        raise NotImplementedError(
            "moefuse implements NVFP4 only (16-element blocks, E4M3 scales); MXFP4 "
            f"(sf_vec_size={sf_vec_size}, sf_use_ue8m0={sf_use_ue8m0}) is not supported"
        )


def _global_scale(global_scale, device) -> torch.Tensor:
    if global_scale is None:
        return torch.ones(1, dtype=torch.float32, device=device)
    if not isinstance(global_scale, torch.Tensor):
        return torch.tensor([float(global_scale)], dtype=torch.float32, device=device)
    return global_scale.reshape(1).float()


def fp4_quantize(
    input: torch.Tensor,
    global_scale: torch.Tensor | None = None,
    sf_vec_size: int = 16,
    sf_use_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
    is_sf_8x4_layout: bool = False,
    enable_pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer ``fp4_quantize``: ``(packed uint8 [M, K/2], scales)`` with the "fast" recipe.

    Scales come back reshaped to ``(-1, K // 16)`` as FlashInfer does (flat when the padded
    layout does not divide). Column-major inputs are quantized along their rows like FlashInfer
    (transpose in, transpose out). Difference: a block whose scale byte underflows to 0 is zeroed
    (FlashInfer saturates it, spec: NVFP4 format).
    """
    _nvfp4_only(sf_vec_size, sf_use_ue8m0)
    column_major = input.dim() == 2 and input.stride(-2) == 1 and input.shape[-2] > 1
    x = input.transpose(-2, -1) if column_major else input
    if not is_sf_swizzled_layout:
        layout = "linear"
    else:
        layout = "swizzled_8x4" if is_sf_8x4_layout else "swizzled_128x4"
    packed, scales = api.fp4_quantize(
        x,
        _global_scale(global_scale, x.device),
        layout=layout,
        recipe="fast",
        enable_pdl=enable_pdl,
    )
    kb = x.shape[-1] // 16
    if kb and scales.numel() % kb == 0:
        scales = scales.reshape(-1, kb)
    if column_major:
        packed, scales = packed.transpose(-2, -1), scales.transpose(-2, -1)
    return packed, scales


def nvfp4_quantize(
    a: torch.Tensor,
    a_global_sf: torch.Tensor,
    sfLayout: SfLayout = SfLayout.layout_128x4,  # noqa: N803 (FlashInfer's argument name)
    do_shuffle: bool = False,
    sf_vec_size: int = 16,
    enable_pdl: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer ``nvfp4_quantize``. Difference: ``layout_linear`` really returns LINEAR scales
    (FlashInfer routes it to the 128x4 layout); ``do_shuffle`` (weight preparation for TRT-LLM
    GEMMs) is not implemented."""
    _nvfp4_only(sf_vec_size)
    if do_shuffle:
        raise NotImplementedError("moefuse does not shuffle weights for TRT-LLM GEMMs")
    return api.fp4_quantize(
        a,
        _global_scale(a_global_sf, a.device),
        layout=_LAYOUT_NAMES[SfLayout(sfLayout).value],
        recipe="fast",
        enable_pdl=enable_pdl,
    )


def e2m1_and_ufp8sf_scale_to_float(
    e2m1_tensor: torch.Tensor,
    ufp8_scale_tensor: torch.Tensor,
    global_scale_tensor: torch.Tensor | None = None,
    sf_vec_size: int = 16,
    ufp8_type: int = 1,
    is_sf_swizzled_layout: bool = True,
) -> torch.Tensor:
    """FlashInfer's NVFP4 dequantization to FP32 ``[M, K]``: ``(e2m1 * f32(sf)) / gs``.

    ``ufp8_scale_tensor`` may be flat or 2-D; it is read as 128x4-swizzled or linear bytes.
    Runs where the tensors are (FlashInfer runs it on the CPU).
    """
    _nvfp4_only(sf_vec_size, ufp8_type != 1)
    packed = e2m1_tensor.view(torch.uint8)
    m, half = packed.shape
    layout = "swizzled_128x4" if is_sf_swizzled_layout else "linear"
    scales = ufp8_scale_tensor.view(torch.uint8).reshape(api.scale_shape(m, 2 * half, layout))
    gs = _global_scale(global_scale_tensor, packed.device).to(packed.device)
    return api.fp4_dequantize(packed, scales.to(packed.device), gs, layout=layout)


def _fp8_scale(scale, device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).float()
    warnings.warn(
        "passing the FP8 scale as a Python float is deprecated (as in FlashInfer); "
        "pass a [1] FP32 device tensor",
        DeprecationWarning,
        stacklevel=3,
    )
    return torch.tensor([float(scale)], dtype=torch.float32, device=device)


def rmsnorm_quant(
    out: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    scale,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """FlashInfer ``rmsnorm_quant(out, input, weight, scale, eps, enable_pdl)``: ``out`` (FP8,
    E4M3 or E5M2) receives ``e8((x * r) * w * (1/scale))``. moefuse divides ``1/scale`` in IEEE
    FP32 (FlashInfer's kernels use rcp.approx)."""
    api.rmsnorm_quant(
        input, weight, _fp8_scale(scale, input.device), eps, out=out, enable_pdl=enable_pdl
    )


def fused_add_rmsnorm_quant(
    out: torch.Tensor,
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    scale,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """FlashInfer ``fused_add_rmsnorm_quant``: ``residual += input`` (rounded), ``out`` receives the
    FP8 norm of the FP32 sum; ``input`` is left untouched."""
    api.fused_add_rmsnorm_quant(
        input,
        residual,
        weight,
        _fp8_scale(scale, input.device),
        eps,
        out=out,
        enable_pdl=enable_pdl,
    )


def _fp4_norm_args(block_size, scale_format, is_sf_swizzled_layout):
    _nvfp4_only(block_size, scale_format not in (None, "e4m3"))
    return "swizzled_128x4" if is_sf_swizzled_layout else "linear"


def _fp4_outputs(input, layout, y_fp4, block_scale):
    """FlashInfer passes outputs with its own shapes (block scales flat or [M, K/16])."""
    m, h = input.shape
    out = y_fp4.view(torch.uint8) if y_fp4 is not None else None
    sc = None
    if block_scale is not None:
        sc = block_scale.view(torch.uint8).reshape(api.scale_shape(m, h, layout))
    return out, sc


def rmsnorm_fp4quant(
    input: torch.Tensor,
    weight: torch.Tensor,
    y_fp4: torch.Tensor | None = None,
    block_scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    eps: float = 1e-6,
    block_size: int = 16,
    scale_format: str | None = None,
    is_sf_swizzled_layout: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer ``rmsnorm_fp4quant`` (CuTe DSL, Blackwell upstream): RMSNorm rounded to the
    input dtype, then NVFP4 ("fast" recipe); LINEAR scales unless ``is_sf_swizzled_layout``.
    2-D inputs only in moefuse. Returns ``(y_fp4, block_scale)``."""
    layout = _fp4_norm_args(block_size, scale_format, is_sf_swizzled_layout)
    out, sc = _fp4_outputs(input, layout, y_fp4, block_scale)
    packed, scales = api.rmsnorm_fp4_quantize(
        input,
        weight,
        _global_scale(global_scale, input.device),
        eps,
        layout=layout,
        recipe="fast",
        out=out,
        scale_out=sc,
    )
    return (
        y_fp4 if y_fp4 is not None else packed,
        block_scale if block_scale is not None else scales,
    )


def add_rmsnorm_fp4quant(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    y_fp4: torch.Tensor | None = None,
    block_scale: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    eps: float = 1e-6,
    block_size: int = 16,
    scale_format: str | None = None,
    is_sf_swizzled_layout: bool = False,
    output_both_sf_layouts: bool = False,
    block_scale_unswizzled: torch.Tensor | None = None,
):
    """FlashInfer ``add_rmsnorm_fp4quant``: ``residual = residual + input`` in place (rounded),
    RMSNorm of the FP32 sum rounded to the input dtype, NVFP4 ("fast"). With
    ``output_both_sf_layouts`` also returns the LINEAR scales (computed by a second, identical
    quantization of the same norm output). Returns ``(y_fp4, block_scale[, unswizzled])``."""
    layout = _fp4_norm_args(
        block_size, scale_format, is_sf_swizzled_layout or output_both_sf_layouts
    )
    out, sc = _fp4_outputs(input, layout, y_fp4, block_scale)
    gs = _global_scale(global_scale, input.device)
    norm_out = torch.empty_like(input) if output_both_sf_layouts else None
    packed, scales = api.fused_add_rmsnorm_fp4_quantize(
        input,
        residual,
        weight,
        gs,
        eps,
        layout=layout,
        recipe="fast",
        out=out,
        scale_out=sc,
        norm_out=norm_out,
    )
    result = (
        y_fp4 if y_fp4 is not None else packed,
        block_scale if block_scale is not None else scales,
    )
    if not output_both_sf_layouts:
        return result
    m, h = input.shape
    lin = None
    if block_scale_unswizzled is not None:
        lin = block_scale_unswizzled.view(torch.uint8).reshape(m, h // 16)
    _, lin = api.fp4_quantize(norm_out, gs, layout="linear", recipe="fast", scale_out=lin)
    return (*result, block_scale_unswizzled if block_scale_unswizzled is not None else lin)


def per_token_group_quant_8bit(
    x: torch.Tensor,
    group_size: int,
    eps: float = 1e-10,
    dst_dtype: torch.dtype | None = None,
    column_major_scales: bool = False,
    scale_tma_aligned: bool = False,
    scale_ue8m0: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer ``per_token_group_quant_8bit``: ``(x_q, x_s)``, E4M3 (default) or INT8 codes
    and FP32 scales per token and group, in the same layouts (row-major, column-major,
    column-major padded to 4 tokens). Differences: any H (a last partial group is its own group;
    FlashInfer requires ``H % group_size == 0``), row-strided ``x``, and UE8M0 scales in any
    layout, returned as their FP32 values (FlashInfer's CUDA path packs four exponent bytes into
    an int32 for DeepGEMM; pass ``scale_out`` of dtype float8_e8m0fnu to
    ``moefuse.per_token_group_quant_8bit`` for the bytes)."""
    return group_api.per_token_group_quant_8bit(
        x, group_size, eps, dst_dtype, column_major_scales, scale_tma_aligned, scale_ue8m0
    )
