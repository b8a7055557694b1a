"""torch.library custom ops of the quantization family.

Each op writes caller-allocated outputs and returns nothing; ``mutates_args`` names exactly the
tensors it writes. Validation happens in :mod:`moefuse.quant.api` before these are called. The real
implementations import the Triton launchers lazily (TRITON_INTERPRET must be set before triton is
imported). Layout and recipe travel as strings (``"swizzled_128x4" | "swizzled_8x4" | "linear"``,
``"fast" | "ieee"``). FP8 tensors cross the op boundary as ``uint8`` views with an explicit format
code ``fmt`` (0 = E4M3, 1 = E5M2): PyTorch's generic op checks cannot do arithmetic on FP8 tensors.
"""

import torch

from moefuse._dispatch import custom_op

Tensor = torch.Tensor


@custom_op("moefuse::fp8_quantize", mutates_args=("out",))
def fp8_quantize_op(input: Tensor, scale: Tensor, out: Tensor, fmt: int, use_pdl: bool) -> None:
    from moefuse.quant.triton import launch_fp8_quantize

    launch_fp8_quantize(input, scale, out, fmt, use_pdl)


@fp8_quantize_op.register_fake
def _(input, scale, out, fmt, use_pdl):
    return None


@custom_op("moefuse::fp8_quantize_per_token", mutates_args=("out", "scale_out"))
def fp8_quantize_per_token_op(input: Tensor, out: Tensor, scale_out: Tensor, use_pdl: bool) -> None:
    from moefuse.quant.triton import launch_fp8_quantize_per_token

    launch_fp8_quantize_per_token(input, out, scale_out, use_pdl)


@fp8_quantize_per_token_op.register_fake
def _(input, out, scale_out, use_pdl):
    return None


@custom_op("moefuse::fp8_dequantize", mutates_args=("out",))
def fp8_dequantize_op(input: Tensor, scale: Tensor, out: Tensor, fmt: int, use_pdl: bool) -> None:
    from moefuse.quant.triton import launch_fp8_dequantize

    launch_fp8_dequantize(input, scale, out, fmt, use_pdl)


@fp8_dequantize_op.register_fake
def _(input, scale, out, fmt, use_pdl):
    return None


@custom_op("moefuse::fp4_quantize", mutates_args=("packed", "scales"))
def fp4_quantize_op(
    input: Tensor,
    global_scale: Tensor,
    packed: Tensor,
    scales: Tensor,
    layout: str,
    recipe: str,
    use_pdl: bool,
) -> None:
    from moefuse.quant.triton import launch_fp4_quantize

    launch_fp4_quantize(input, global_scale, packed, scales, layout, recipe, use_pdl)


@fp4_quantize_op.register_fake
def _(input, global_scale, packed, scales, layout, recipe, use_pdl):
    return None


@custom_op("moefuse::fp4_dequantize", mutates_args=("out",))
def fp4_dequantize_op(
    packed: Tensor, scales: Tensor, global_scale: Tensor, out: Tensor, layout: str, use_pdl: bool
) -> None:
    from moefuse.quant.triton import launch_fp4_dequantize

    launch_fp4_dequantize(packed, scales, global_scale, out, layout, use_pdl)


@fp4_dequantize_op.register_fake
def _(packed, scales, global_scale, out, layout, use_pdl):
    return None


@custom_op("moefuse::rmsnorm_quant", mutates_args=("out",))
def rmsnorm_quant_op(
    input: Tensor,
    weight: Tensor,
    scale: Tensor,
    out: Tensor,
    fmt: int,
    eps: float,
    gain_center: float,
    use_pdl: bool,
) -> None:
    from moefuse.quant.fused import launch_rmsnorm_fp8

    launch_rmsnorm_fp8(input, None, weight, scale, out, fmt, eps, gain_center, use_pdl)


@rmsnorm_quant_op.register_fake
def _(input, weight, scale, out, fmt, eps, gain_center, use_pdl):
    return None


@custom_op("moefuse::fused_add_rmsnorm_quant", mutates_args=("residual", "out"))
def fused_add_rmsnorm_quant_op(
    input: Tensor,
    residual: Tensor,
    weight: Tensor,
    scale: Tensor,
    out: Tensor,
    fmt: int,
    eps: float,
    gain_center: float,
    use_pdl: bool,
) -> None:
    from moefuse.quant.fused import launch_rmsnorm_fp8

    launch_rmsnorm_fp8(input, residual, weight, scale, out, fmt, eps, gain_center, use_pdl)


@fused_add_rmsnorm_quant_op.register_fake
def _(input, residual, weight, scale, out, fmt, eps, gain_center, use_pdl):
    return None


@custom_op("moefuse::rmsnorm_fp4_quantize", mutates_args=("packed", "scales", "norm_out"))
def rmsnorm_fp4_quantize_op(
    input: Tensor,
    weight: Tensor,
    global_scale: Tensor,
    packed: Tensor,
    scales: Tensor,
    norm_out: Tensor | None,
    eps: float,
    gain_center: float,
    layout: str,
    recipe: str,
    use_pdl: bool,
) -> None:
    from moefuse.quant.fused import launch_rmsnorm_fp4

    launch_rmsnorm_fp4(
        input,
        None,
        weight,
        global_scale,
        packed,
        scales,
        norm_out,
        eps,
        gain_center,
        layout,
        recipe,
        use_pdl,
    )


@rmsnorm_fp4_quantize_op.register_fake
def _(
    input, weight, global_scale, packed, scales, norm_out, eps, gain_center, layout, recipe, use_pdl
):
    return None


@custom_op(
    "moefuse::fused_add_rmsnorm_fp4_quantize",
    mutates_args=("residual", "packed", "scales", "norm_out"),
)
def fused_add_rmsnorm_fp4_quantize_op(
    input: Tensor,
    residual: Tensor,
    weight: Tensor,
    global_scale: Tensor,
    packed: Tensor,
    scales: Tensor,
    norm_out: Tensor | None,
    eps: float,
    gain_center: float,
    layout: str,
    recipe: str,
    use_pdl: bool,
) -> None:
    from moefuse.quant.fused import launch_rmsnorm_fp4

    launch_rmsnorm_fp4(
        input,
        residual,
        weight,
        global_scale,
        packed,
        scales,
        norm_out,
        eps,
        gain_center,
        layout,
        recipe,
        use_pdl,
    )


@fused_add_rmsnorm_fp4_quantize_op.register_fake
def _(
    input,
    residual,
    weight,
    global_scale,
    packed,
    scales,
    norm_out,
    eps,
    gain_center,
    layout,
    recipe,
    use_pdl,
):
    return None


# ----------------------------------------------------------------------------- per-token-group
# codes travel as uint8 (FP8 bits) or int8, scales as FP32 or uint8 (float8_e8m0fnu bytes)
@custom_op("moefuse::per_token_group_quant_8bit", mutates_args=("out", "scale_out"))
def per_token_group_quant_8bit_op(
    input: Tensor,
    out: Tensor,
    scale_out: Tensor,
    group_size: int,
    eps: float,
    ue8m0: bool,
    use_pdl: bool,
) -> None:
    from moefuse.quant.group_triton import launch_group_quant

    int8 = out.dtype == torch.int8
    launch_group_quant(input, out, scale_out, group_size, eps, int8, ue8m0, use_pdl)


@per_token_group_quant_8bit_op.register_fake
def _(input, out, scale_out, group_size, eps, ue8m0, use_pdl):
    return None


@custom_op("moefuse::rmsnorm_group_quant", mutates_args=("out", "scale_out"))
def rmsnorm_group_quant_op(
    input: Tensor,
    weight: Tensor,
    out: Tensor,
    scale_out: Tensor,
    group_size: int,
    eps: float,
    gain_center: float,
    quant_eps: float,
    ue8m0: bool,
    use_pdl: bool,
) -> None:
    from moefuse.quant.group_fused import launch_norm_group_quant

    int8 = out.dtype == torch.int8
    launch_norm_group_quant(
        input, None, weight, out, scale_out, group_size, eps, gain_center, quant_eps, int8,
        ue8m0, use_pdl,
    )  # fmt: skip


@rmsnorm_group_quant_op.register_fake
def _(input, weight, out, scale_out, group_size, eps, gain_center, quant_eps, ue8m0, use_pdl):
    return None


@custom_op("moefuse::fused_add_rmsnorm_group_quant", mutates_args=("residual", "out", "scale_out"))
def fused_add_rmsnorm_group_quant_op(
    input: Tensor,
    residual: Tensor,
    weight: Tensor,
    out: Tensor,
    scale_out: Tensor,
    group_size: int,
    eps: float,
    gain_center: float,
    quant_eps: float,
    ue8m0: bool,
    use_pdl: bool,
) -> None:
    from moefuse.quant.group_fused import launch_norm_group_quant

    int8 = out.dtype == torch.int8
    launch_norm_group_quant(
        input, residual, weight, out, scale_out, group_size, eps, gain_center, quant_eps, int8,
        ue8m0, use_pdl,
    )  # fmt: skip


@fused_add_rmsnorm_group_quant_op.register_fake
def _(
    input, residual, weight, out, scale_out, group_size, eps, gain_center, quant_eps, ue8m0,
    use_pdl,
):  # fmt: skip
    return None
