"""FP8 and NVFP4 quantization (spec: Quantization): standalone quantizers/dequantizers and the fused
RMSNorm + quantization ops. Device functions shared with other kernel families (the communication
fusions' epilogues) live in :mod:`moefuse.quant.device`."""

from moefuse.quant.api import (
    fp4_dequantize,
    fp4_quantize,
    fp8_dequantize,
    fp8_quantize,
    fp8_quantize_per_token,
    fused_add_rmsnorm_fp4_quantize,
    fused_add_rmsnorm_quant,
    rmsnorm_fp4_quantize,
    rmsnorm_quant,
    scale_shape,
    supports_fp4_dequantize,
    supports_fp4_quantize,
    supports_fp8_dequantize,
    supports_fp8_quantize,
    supports_fp8_quantize_per_token,
    supports_fused_add_rmsnorm_fp4_quantize,
    supports_fused_add_rmsnorm_quant,
    supports_rmsnorm_fp4_quantize,
    supports_rmsnorm_quant,
)

__all__ = [
    "fp8_quantize",
    "fp8_quantize_per_token",
    "fp8_dequantize",
    "fp4_quantize",
    "fp4_dequantize",
    "scale_shape",
    "rmsnorm_quant",
    "fused_add_rmsnorm_quant",
    "rmsnorm_fp4_quantize",
    "fused_add_rmsnorm_fp4_quantize",
    "supports_fp8_quantize",
    "supports_fp8_quantize_per_token",
    "supports_fp8_dequantize",
    "supports_fp4_quantize",
    "supports_fp4_dequantize",
    "supports_rmsnorm_quant",
    "supports_fused_add_rmsnorm_quant",
    "supports_rmsnorm_fp4_quantize",
    "supports_fused_add_rmsnorm_fp4_quantize",
]
