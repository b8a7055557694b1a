"""Public ops of the quantization family (spec: Quantization).

Every op validates its arguments (``ValueError`` naming the argument, nothing written), allocates
missing outputs, picks the implementation (keyword-only ``impl="auto" | "triton" | "reference"``,
DESIGN.md) and runs it. ``enable_pdl=None`` means programmatic dependent launch where supported.
M = 0 is a no-op. Scales are device tensors (``[1]`` FP32), never synced to the host.

FP8 outputs are ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` tensors; NVFP4 outputs are
``(packed uint8 [M, H/2], scales uint8)`` where ``scales`` has shape
``scale_shape(M, H, layout)`` and, flattened, is in the layout's byte order with every padding byte
written as 0 by the op itself (no reliance on a zeroed allocation). NaN/Inf rules: see
:mod:`moefuse.quant.reference`.
"""

from __future__ import annotations

import torch

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, kernel_device_reason, resolve_pdl
from moefuse.quant import formats as F
from moefuse.quant import ops
from moefuse.quant import reference as ref

ACT = (torch.bfloat16, torch.float16, torch.float32)
HALF = v.FLOAT16S
WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
F32 = (torch.float32,)
U8 = (torch.uint8,)


def scale_shape(m: int, h: int, layout: str = "swizzled_128x4") -> tuple[int, int]:
    """Shape of the NVFP4 scale tensor for ``m`` rows of width ``h`` (``h % 16 == 0``):
    ``(round_up(m, 128), round_up(h/16, 4))`` for swizzled_128x4, ``(round_up(m, 8), ...)`` for
    swizzled_8x4, ``(m, h/16)`` for linear."""
    return F.scale_layout_shape(m, h // 16, layout)


# ----------------------------------------------------------------------------- checks
def _check_scalar_tensor(op: str, name: str, t, device) -> None:
    v.check_tensor(op, name, t, dtypes=F32, device=device, last_dim_contiguous=False)
    if t.numel() != 1:
        raise ValueError(
            f"moefuse.{op}: argument '{name}' must be a one-element FP32 tensor (shape [1]), "
            f"got shape {tuple(t.shape)}"
        )


def _check_choice(op: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(
            f"moefuse.{op}: argument '{name}' must be one of {tuple(choices)}, got {value!r}"
        )


def _check_rows(op: str, name: str, t, dtypes, ndims=(1, 2, 3)) -> None:
    # 3-D tensors may have any two leading strides: the kernels address row (t, h) as
    # t * stride(0) + h * stride(1), so no uniform-row requirement here.
    v.check_tensor(op, name, t, dtypes=dtypes, ndims=ndims)


def _check_out(op, name, out, shape, dtype, device, *, contiguous=True) -> None:
    v.check_tensor(op, name, out, dtypes=(dtype,), shape=shape, device=device)
    if contiguous and not out.is_contiguous():
        raise ValueError(f"moefuse.{op}: argument '{name}' must be contiguous")


def _u8(t: torch.Tensor) -> torch.Tensor:
    """The uint8 view of an FP8 tensor (the custom ops take FP8 data as bytes + a format code)."""
    return t.view(torch.uint8)


def _as_kernel_rows(t: torch.Tensor) -> torch.Tensor:
    """A 2-D or 3-D view the kernels address as rows (1-D -> [1, H])."""
    return t.unsqueeze(0) if t.dim() == 1 else t


def _check_fp4_input(op: str, input) -> None:
    v.check_tensor(op, "input", input, dtypes=ACT, ndims=(2,))
    if input.shape[1] % 16 != 0:
        raise ValueError(
            f"moefuse.{op}: argument 'input' must have a last dimension divisible by "
            f"16 (NVFP4 blocks), got {input.shape[1]}"
        )


def _check_fp4_outputs(op, input, layout, out, scale_out) -> None:
    m, h = input.shape
    if out is not None:
        v.check_tensor(op, "out", out, dtypes=U8, shape=(m, h // 2), device=input.device)
        v.check_no_overlap(op, "out", out, "input", input)
    if scale_out is not None:
        _check_out(op, "scale_out", scale_out, scale_shape(m, h, layout), torch.uint8, input.device)
        v.check_no_overlap(op, "scale_out", scale_out, "input", input)
        if out is not None:
            v.check_no_overlap(op, "scale_out", scale_out, "out", out)


def _reason(t: torch.Tensor) -> str | None:
    return kernel_device_reason(t.device)


def _supported(check, *args) -> bool:
    """``check(*args)`` passes and the kernel can run on the first tensor argument's device."""
    return v.accepts(check, *args) and _reason(args[1]) is None


# ----------------------------------------------------------------------------- FP8 standalone
def _check_fp8_quantize(op, input, scale, dtype, out) -> None:
    _check_rows(op, "input", input, ACT)
    _check_scalar_tensor(op, "scale", scale, input.device)
    _check_choice(op, "dtype", dtype, F.FP8_DTYPES)
    if out is not None:
        _check_out(op, "out", out, input.shape, dtype, input.device)
        v.check_no_overlap(op, "out", out, "input", input)


@fast_op
@v.checked(writes=("out",))
def fp8_quantize(
    input, scale, *, dtype=torch.float8_e4m3fn, out=None, enable_pdl=None, impl: str = "auto"
):
    """Static per-tensor FP8 (spec: FP8 format): ``out = e8(f32(input) * (1/scale))``.

    ``input`` [H], [M, H] or [M, heads, H] BF16/FP16/FP32 (last dim contiguous, rows uniformly
    strided); ``scale`` the FP32 dequantization scale, a ``[1]`` device tensor (``1/scale`` is one
    IEEE division); ``dtype`` ``torch.float8_e4m3fn`` (max 448) or ``torch.float8_e5m2`` (57344).
    RNE, saturating to +-max (Inf too), NaN -> 0x7F. ``out`` (contiguous, ``dtype``) is allocated
    when None. Returns ``out``.
    """
    op = "fp8_quantize"
    _check_fp8_quantize(op, input, scale, dtype, out)
    if out is None:
        out = torch.empty(input.shape, dtype=dtype, device=input.device)
    if input.numel() == 0:
        return out
    if choose_impl(op, impl, input.device, _reason(input)) == "reference":
        out.copy_(ref.fp8_quantize_reference(input, scale, dtype))
        return out
    ops.fp8_quantize_op(
        _as_kernel_rows(input),
        scale,
        _as_kernel_rows(_u8(out)),
        F.FP8_CODE[dtype],
        resolve_pdl(enable_pdl, input.device),
    )
    return out


def supports_fp8_quantize(input, scale, dtype=torch.float8_e4m3fn) -> bool:
    return _supported(_check_fp8_quantize, "fp8_quantize", input, scale, dtype, None)


def _check_per_token(op, input, out, scale_out) -> None:
    _check_rows(op, "input", input, ACT)
    if out is not None:
        _check_out(op, "out", out, input.shape, torch.float8_e4m3fn, input.device)
        v.check_no_overlap(op, "out", out, "input", input)
    if scale_out is not None:
        _check_out(op, "scale_out", scale_out, (*input.shape[:-1], 1), torch.float32, input.device)
        v.check_no_overlap(op, "scale_out", scale_out, "input", input)


@fast_op
@v.checked(writes=("out", "scale_out"))
def fp8_quantize_per_token(input, *, out=None, scale_out=None, enable_pdl=None, impl: str = "auto"):
    """Dynamic per-token E4M3 (spec) over the last dim of ``input`` ([H], [M, H], [M, h, H]).

    ``s = max(amax_row / 448, 2^-9 / 448)`` (FP32, IEEE division; a row containing NaN gets
    ``s = NaN`` and all-0x7F codes, a row with Inf gets ``s = Inf``); ``q = e4m3(v / s)`` with an
    IEEE division per element. Returns ``(out float8_e4m3fn like input, scale_out FP32 [..., 1])``.
    """
    op = "fp8_quantize_per_token"
    _check_per_token(op, input, out, scale_out)
    if out is None:
        out = torch.empty(input.shape, dtype=torch.float8_e4m3fn, device=input.device)
    if scale_out is None:
        scale_out = torch.empty((*input.shape[:-1], 1), dtype=torch.float32, device=input.device)
    if input.numel() == 0 and scale_out.numel() == 0:
        return out, scale_out
    if choose_impl(op, impl, input.device, _reason(input)) == "reference":
        q, s = ref.fp8_quantize_per_token_reference(input)
        out.copy_(q)
        scale_out.copy_(s)
        return out, scale_out
    ops.fp8_quantize_per_token_op(
        _as_kernel_rows(input),
        _as_kernel_rows(_u8(out)),
        scale_out,
        resolve_pdl(enable_pdl, input.device),
    )
    return out, scale_out


def supports_fp8_quantize_per_token(input) -> bool:
    return _supported(_check_per_token, "fp8_quantize_per_token", input, None, None)


def _check_fp8_dequantize(op, input, scale, out_dtype, out) -> None:
    _check_rows(op, "input", input, F.FP8_DTYPES)
    v.check_tensor(op, "scale", scale, dtypes=F32, device=input.device, last_dim_contiguous=False)
    per_row = (*input.shape[:-1], 1)
    if scale.numel() != 1 and (tuple(scale.shape) != per_row or not scale.is_contiguous()):
        raise ValueError(
            f"moefuse.{op}: argument 'scale' must be a [1] tensor or a contiguous "
            f"per-row tensor of shape {per_row}, got {tuple(scale.shape)}"
        )
    _check_choice(op, "out_dtype", out_dtype, ACT)
    if out is not None:
        _check_out(op, "out", out, input.shape, out_dtype, input.device)
        v.check_no_overlap(op, "out", out, "input", input)


@fast_op
@v.checked(writes=("out",))
def fp8_dequantize(
    input, scale, *, out_dtype=torch.bfloat16, out=None, enable_pdl=None, impl: str = "auto"
):
    """``out = cast(f32(q) * scale)``: ``scale`` ``[1]`` (per tensor) or ``[..., 1]`` (per row, as
    returned by :func:`fp8_quantize_per_token`). ``out_dtype`` BF16/FP16/FP32. Returns ``out``."""
    op = "fp8_dequantize"
    _check_fp8_dequantize(op, input, scale, out_dtype, out)
    if out is None:
        out = torch.empty(input.shape, dtype=out_dtype, device=input.device)
    if input.numel() == 0:
        return out
    if choose_impl(op, impl, input.device, _reason(input)) == "reference":
        out.copy_(ref.fp8_dequantize_reference(input, scale, out_dtype))
        return out
    ops.fp8_dequantize_op(
        _as_kernel_rows(_u8(input)),
        scale,
        _as_kernel_rows(out),
        F.FP8_CODE[input.dtype],
        resolve_pdl(enable_pdl, input.device),
    )
    return out


def supports_fp8_dequantize(input, scale, out_dtype=torch.bfloat16) -> bool:
    return _supported(_check_fp8_dequantize, "fp8_dequantize", input, scale, out_dtype, None)


# ----------------------------------------------------------------------------- NVFP4 standalone
def _check_fp4_quantize(op, input, global_scale, layout, recipe, out, scale_out) -> None:
    _check_fp4_input(op, input)
    _check_scalar_tensor(op, "global_scale", global_scale, input.device)
    _check_choice(op, "layout", layout, F.LAYOUTS)
    _check_choice(op, "recipe", recipe, F.RECIPES)
    _check_fp4_outputs(op, input, layout, out, scale_out)


def _alloc_fp4(input, layout, out, scale_out):
    m, h = input.shape
    if out is None:
        out = torch.empty((m, h // 2), dtype=torch.uint8, device=input.device)
    if scale_out is None:
        scale_out = torch.empty(scale_shape(m, h, layout), dtype=torch.uint8, device=input.device)
    return out, scale_out


@fast_op
@v.checked(writes=("out", "scale_out"))
def fp4_quantize(
    input,
    global_scale,
    *,
    layout: str = "swizzled_128x4",
    recipe: str = "fast",
    out=None,
    scale_out=None,
    enable_pdl=None,
    impl: str = "auto",
):
    """NVFP4 quantization (spec: NVFP4 format) of ``input`` [M, H] (BF16/FP16/FP32, H % 16 == 0).

    Per 16-element block: ``sf = e4m3(gs * (amax * R6))`` (R6 = RNE(1/6)); block zeroed when
    ``f32(sf) == 0``; else codes ``e2m1(|v| * out_scale)`` with ``out_scale = rcp_fast(s *
    rcp_fast(gs))`` (``recipe="fast"``, FlashInfer's quantizer) or ``gs / s`` (``"ieee"``, the
    all-reduce fusion). ``global_scale``: ``[1]`` FP32 device tensor (> 0, usually
    ``448 * 6 / amax``). ``layout``: ``"swizzled_128x4"`` (CUTLASS/TRT-LLM GEMMs),
    ``"swizzled_8x4"`` or ``"linear"``. Returns ``(out uint8 [M, H/2], scale_out uint8
    scale_shape(M, H, layout))``; element 2j is the low nibble of byte j.
    """
    op = "fp4_quantize"
    _check_fp4_quantize(op, input, global_scale, layout, recipe, out, scale_out)
    out, scale_out = _alloc_fp4(input, layout, out, scale_out)
    if scale_out.numel() == 0:
        return out, scale_out
    if choose_impl(op, impl, input.device, _reason(input)) == "reference":
        packed, scales = ref.fp4_quantize_reference(input, global_scale, layout, recipe)
        out.copy_(packed)
        scale_out.copy_(scales)
        return out, scale_out
    ops.fp4_quantize_op(
        input, global_scale, out, scale_out, layout, recipe, resolve_pdl(enable_pdl, input.device)
    )
    return out, scale_out


def supports_fp4_quantize(
    input, global_scale, layout: str = "swizzled_128x4", recipe: str = "fast"
) -> bool:
    return _supported(
        _check_fp4_quantize, "fp4_quantize", input, global_scale, layout, recipe, None, None
    )


def _check_fp4_dequantize(op, packed, scales, global_scale, layout, out_dtype, out) -> None:
    v.check_tensor(op, "packed", packed, dtypes=U8, ndims=(2,))
    _check_choice(op, "layout", layout, F.LAYOUTS)
    m, half = packed.shape
    if (2 * half) % 16 != 0:
        raise ValueError(
            f"moefuse.{op}: argument 'packed' must have H/2 columns with H % 16 == 0, "
            f"got {half} columns"
        )
    _check_out(op, "scales", scales, scale_shape(m, 2 * half, layout), torch.uint8, packed.device)
    _check_scalar_tensor(op, "global_scale", global_scale, packed.device)
    _check_choice(op, "out_dtype", out_dtype, ACT)
    if out is not None:
        _check_out(op, "out", out, (m, 2 * half), out_dtype, packed.device, contiguous=False)
        v.check_no_overlap(op, "out", out, "packed", packed)
        v.check_no_overlap(op, "out", out, "scales", scales)


@fast_op
@v.checked(writes=("out",))
def fp4_dequantize(
    packed,
    scales,
    global_scale,
    *,
    layout: str = "swizzled_128x4",
    out_dtype=torch.float32,
    out=None,
    enable_pdl=None,
    impl: str = "auto",
):
    """Inverse of :func:`fp4_quantize`: ``x = cast((e2m1(code) * f32(sf)) / gs)`` (the product is
    exact, the division IEEE). ``packed`` [M, H/2] uint8, ``scales`` in ``layout``. Returns ``out``
    [M, H] of ``out_dtype``."""
    op = "fp4_dequantize"
    _check_fp4_dequantize(op, packed, scales, global_scale, layout, out_dtype, out)
    m, half = packed.shape
    if out is None:
        out = torch.empty((m, 2 * half), dtype=out_dtype, device=packed.device)
    if out.numel() == 0:
        return out
    if choose_impl(op, impl, packed.device, _reason(packed)) == "reference":
        out.copy_(ref.fp4_dequantize_reference(packed, scales, global_scale, layout, out_dtype))
        return out
    ops.fp4_dequantize_op(
        packed, scales, global_scale, out, layout, resolve_pdl(enable_pdl, packed.device)
    )
    return out


def supports_fp4_dequantize(
    packed, scales, global_scale, layout: str = "swizzled_128x4", out_dtype=torch.float32
) -> bool:
    return _supported(
        _check_fp4_dequantize,
        "fp4_dequantize",
        packed,
        scales,
        global_scale,
        layout,
        out_dtype,
        None,
    )


# ----------------------------------------------------------------------------- fused FP8
def _check_norm_common(op, input, residual, weight, eps, ndims, fused) -> None:
    """``fused``: the op adds ``residual`` (required) before the norm."""
    _check_rows(op, "input", input, HALF, ndims)
    v.check_tensor(
        op, "weight", weight, dtypes=WEIGHT_DTYPES, shape=(input.shape[-1],), device=input.device
    )
    if fused:
        v.check_tensor(
            op, "residual", residual, dtypes=(input.dtype,), shape=input.shape, device=input.device
        )
        v.check_no_overlap(op, "residual", residual, "input", input)
        v.check_no_overlap(op, "residual", residual, "weight", weight)
    v.check_eps(op, "eps", eps)


def _fp8_dtype(dtype, out):
    """``dtype=None``: the dtype of ``out`` when given, else E4M3."""
    if dtype is None:
        return out.dtype if isinstance(out, torch.Tensor) else torch.float8_e4m3fn
    return dtype


def _check_norm_fp8(op, input, residual, weight, scale, eps, dtype, out, fused=False) -> None:
    _check_norm_common(op, input, residual, weight, eps, (2, 3), fused)
    _check_scalar_tensor(op, "scale", scale, input.device)
    _check_choice(op, "dtype", _fp8_dtype(dtype, None), F.FP8_DTYPES)
    if out is not None:
        v.check_tensor(
            op,
            "out",
            out,
            dtypes=F.FP8_DTYPES if dtype is None else (dtype,),
            shape=input.shape,
            device=input.device,
        )
        for name, t in (("input", input), ("weight", weight), ("residual", residual)):
            if t is not None:
                v.check_no_overlap(op, "out", out, name, t)


@fast_op
@v.checked(writes=("out",), reals=("gain_center",))
def rmsnorm_quant(
    input,
    weight,
    scale,
    eps: float = 1e-6,
    *,
    out=None,
    dtype=None,
    gain_center: float = 0.0,
    enable_pdl=None,
    impl: str = "auto",
):
    """RMSNorm + static FP8 (spec): ``out = e8(((x * r) * g) * (1/scale))``, the UNROUNDED
    FP32 norm output quantized, ``g = f32(weight) + gain_center`` (1.0 = Gemma).

    ``input`` [M, H] or [M, heads, H] BF16/FP16; ``weight`` [H] BF16/FP16/FP32; ``scale`` [1] FP32
    device tensor; ``dtype`` ``torch.float8_e4m3fn`` or ``torch.float8_e5m2`` (None: the dtype of
    ``out`` when given, else E4M3); ``out`` of that dtype, like ``input``, allocated when None.
    Returns ``out``.
    """
    op = "rmsnorm_quant"
    _check_norm_fp8(op, input, None, weight, scale, eps, dtype, out)
    dtype = _fp8_dtype(dtype, out)
    if out is None:
        out = torch.empty(input.shape, dtype=dtype, device=input.device)
    if input.numel() == 0:
        return out
    if choose_impl(op, impl, input.device, _reason(input)) == "reference":
        out.copy_(ref.rmsnorm_quant_reference(input, weight, scale, eps, dtype, gain_center))
        return out
    ops.rmsnorm_quant_op(
        input,
        weight,
        scale,
        _u8(out),
        F.FP8_CODE[dtype],
        float(eps),
        float(gain_center),
        resolve_pdl(enable_pdl, input.device),
    )
    return out


def supports_rmsnorm_quant(input, weight, scale, dtype=None) -> bool:
    return _supported(
        _check_norm_fp8, "rmsnorm_quant", input, None, weight, scale, 1e-6, dtype, None
    )


@fast_op
@v.checked(writes=("out", "residual"), reals=("gain_center",))
def fused_add_rmsnorm_quant(
    input,
    residual,
    weight,
    scale,
    eps: float = 1e-6,
    *,
    out=None,
    dtype=None,
    gain_center: float = 0.0,
    enable_pdl=None,
    impl: str = "auto",
):
    """Residual add + RMSNorm + static FP8 (spec: fused_add_rmsnorm_quant)::

        h = f32(input) + f32(residual);  residual <- cast(h)          # in place
        out = e8(((h * r) * g) * (1/scale))                          # r from the FP32 h

    ``input`` is NOT modified. Shapes/dtypes as :func:`rmsnorm_quant`; ``residual`` like
    ``input``, not aliasing it. Returns ``out``.
    """
    op = "fused_add_rmsnorm_quant"
    _check_norm_fp8(op, input, residual, weight, scale, eps, dtype, out, fused=True)
    dtype = _fp8_dtype(dtype, out)
    if out is None:
        out = torch.empty(input.shape, dtype=dtype, device=input.device)
    if input.numel() == 0:
        return out
    if choose_impl(op, impl, input.device, _reason(input)) == "reference":
        q, res_out = ref.fused_add_rmsnorm_quant_reference(
            input, residual, weight, scale, eps, dtype, gain_center
        )
        out.copy_(q)
        residual.copy_(res_out)
        return out
    ops.fused_add_rmsnorm_quant_op(
        input,
        residual,
        weight,
        scale,
        _u8(out),
        F.FP8_CODE[dtype],
        float(eps),
        float(gain_center),
        resolve_pdl(enable_pdl, input.device),
    )
    return out


def supports_fused_add_rmsnorm_quant(input, residual, weight, scale, dtype=None) -> bool:
    return _supported(
        _check_norm_fp8,
        "fused_add_rmsnorm_quant",
        input,
        residual,
        weight,
        scale,
        1e-6,
        dtype,
        None,
        True,
    )


# ----------------------------------------------------------------------------- fused NVFP4
def _check_norm_fp4(
    op,
    input,
    residual,
    weight,
    global_scale,
    eps,
    layout,
    recipe,
    out,
    scale_out,
    norm_out,
    fused=False,
) -> None:
    _check_fp4_input(op, input)
    _check_norm_common(op, input, residual, weight, eps, (2,), fused)
    _check_scalar_tensor(op, "global_scale", global_scale, input.device)
    _check_choice(op, "layout", layout, F.LAYOUTS)
    _check_choice(op, "recipe", recipe, F.RECIPES)
    _check_fp4_outputs(op, input, layout, out, scale_out)
    outs = [("out", out), ("scale_out", scale_out)]
    if norm_out is not None:
        v.check_tensor(
            op, "norm_out", norm_out, dtypes=(input.dtype,), shape=input.shape, device=input.device
        )
        v.check_alias_exact_or_disjoint(op, "norm_out", norm_out, "input", input)
        outs.append(("norm_out", norm_out))
    if residual is not None:
        outs.append(("residual", residual))
    for i, (name_a, a) in enumerate(outs):
        if a is None:
            continue
        v.check_no_overlap(op, name_a, a, "weight", weight)
        for name_b, b in outs[i + 1 :]:
            if b is not None:
                v.check_no_overlap(op, name_a, a, name_b, b)


def _norm_fp4(
    op,
    input,
    residual,
    weight,
    global_scale,
    eps,
    layout,
    recipe,
    gain_center,
    out,
    scale_out,
    norm_out,
    enable_pdl,
    impl,
    fused,
):
    _check_norm_fp4(
        op,
        input,
        residual,
        weight,
        global_scale,
        eps,
        layout,
        recipe,
        out,
        scale_out,
        norm_out,
        fused,
    )
    out, scale_out = _alloc_fp4(input, layout, out, scale_out)
    if scale_out.numel() == 0:
        return out, scale_out
    if choose_impl(op, impl, input.device, _reason(input)) == "reference":
        if not fused:
            packed, scales, y = ref.rmsnorm_fp4_quantize_reference(
                input, weight, global_scale, eps, layout, recipe, gain_center
            )
        else:
            packed, scales, y, res_out = ref.fused_add_rmsnorm_fp4_quantize_reference(
                input, residual, weight, global_scale, eps, layout, recipe, gain_center
            )
            residual.copy_(res_out)
        out.copy_(packed)
        scale_out.copy_(scales)
        if norm_out is not None:
            norm_out.copy_(y)
        return out, scale_out
    use_pdl = resolve_pdl(enable_pdl, input.device)
    if not fused:
        ops.rmsnorm_fp4_quantize_op(
            input,
            weight,
            global_scale,
            out,
            scale_out,
            norm_out,
            float(eps),
            float(gain_center),
            layout,
            recipe,
            use_pdl,
        )
    else:
        ops.fused_add_rmsnorm_fp4_quantize_op(
            input,
            residual,
            weight,
            global_scale,
            out,
            scale_out,
            norm_out,
            float(eps),
            float(gain_center),
            layout,
            recipe,
            use_pdl,
        )
    return out, scale_out


@fast_op
@v.checked(writes=("out", "scale_out", "norm_out"), reals=("gain_center",))
def rmsnorm_fp4_quantize(
    input,
    weight,
    global_scale,
    eps: float = 1e-6,
    *,
    layout: str = "swizzled_128x4",
    recipe: str = "fast",
    gain_center: float = 0.0,
    out=None,
    scale_out=None,
    norm_out=None,
    enable_pdl=None,
    impl: str = "auto",
):
    """RMSNorm + NVFP4 in one pass: ``y = cast((x * r) * g)`` rounded to the input dtype (as the
    unfused pipeline would store it), then :func:`fp4_quantize` of ``y``.

    ``input`` [M, H] BF16/FP16 with H % 16 == 0; ``weight`` [H]; ``global_scale`` [1] FP32.
    ``norm_out`` (optional, like ``input``, may be ``input`` itself) also receives ``y``.
    Returns ``(out uint8 [M, H/2], scale_out uint8 scale_shape(M, H, layout))``.
    """
    return _norm_fp4(
        "rmsnorm_fp4_quantize",
        input,
        None,
        weight,
        global_scale,
        eps,
        layout,
        recipe,
        gain_center,
        out,
        scale_out,
        norm_out,
        enable_pdl,
        impl,
        False,
    )


@fast_op
@v.checked(writes=("out", "scale_out", "norm_out", "residual"), reals=("gain_center",))
def fused_add_rmsnorm_fp4_quantize(
    input,
    residual,
    weight,
    global_scale,
    eps: float = 1e-6,
    *,
    layout: str = "swizzled_128x4",
    recipe: str = "fast",
    gain_center: float = 0.0,
    out=None,
    scale_out=None,
    norm_out=None,
    enable_pdl=None,
    impl: str = "auto",
):
    """Residual add + RMSNorm + NVFP4: ``h = f32(input) + f32(residual)``, ``residual <- cast(h)``
    (in place), ``y = cast((h * r) * g)`` with r from the FP32 h (spec), then NVFP4 of ``y``.
    ``input`` is not modified unless it is passed as ``norm_out``. Returns ``(out, scale_out)``.
    """
    return _norm_fp4(
        "fused_add_rmsnorm_fp4_quantize",
        input,
        residual,
        weight,
        global_scale,
        eps,
        layout,
        recipe,
        gain_center,
        out,
        scale_out,
        norm_out,
        enable_pdl,
        impl,
        True,
    )


def supports_rmsnorm_fp4_quantize(
    input, weight, global_scale, layout="swizzled_128x4", recipe="fast"
) -> bool:
    return _supported(
        _check_norm_fp4,
        "rmsnorm_fp4_quantize",
        input,
        None,
        weight,
        global_scale,
        1e-6,
        layout,
        recipe,
        None,
        None,
        None,
    )


def supports_fused_add_rmsnorm_fp4_quantize(
    input, residual, weight, global_scale, layout="swizzled_128x4", recipe="fast"
) -> bool:
    return _supported(
        _check_norm_fp4,
        "fused_add_rmsnorm_fp4_quantize",
        input,
        residual,
        weight,
        global_scale,
        1e-6,
        layout,
        recipe,
        None,
        None,
        None,
        True,
    )
