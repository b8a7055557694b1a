"""Public per-token-group 8-bit ops (spec: per_token_group_quant_8bit, rmsnorm_group_quant,
fused_add_rmsnorm_group_quant): validate (``ValueError`` naming the argument, nothing written),
allocate, choose the implementation, run.

Scales are ``[..., G]`` with ``G = ceil(H / group_size)``. Their layout is chosen at allocation:
row-major (default), ``column_major_scales`` (the token dimension contiguous, DeepGEMM's layout:
storage ``[..., G, M]`` seen as ``[..., M, G]``) and ``scale_tma_aligned`` (that storage padded to
``M`` rounded up to 4 tokens, 16-byte rows for TMA, as FlashInfer and SGLang allocate it). A
``scale_out`` passed in is written through its own strides, whatever they are.
"""

from __future__ import annotations

import torch

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, kernel_device_reason, resolve_pdl
from moefuse.quant import ops
from moefuse.quant import reference as ref
from moefuse.quant.api import ACT, _check_norm_common, _check_rows

#: group sizes the kernels take (powers of two: a group is a reshape of a power-of-two tile)
GROUP_SIZES = (32, 64, 128, 256)
E4M3 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
DST_DTYPES = (E4M3, torch.int8)


def group_scale_shape(shape, group_size: int) -> tuple[int, ...]:
    """``(*shape[:-1], ceil(shape[-1] / group_size))``."""
    return (*shape[:-1], -(-shape[-1] // group_size))


def alloc_group_scales(
    shape, group_size: int, column_major: bool, tma_aligned: bool, dtype, device
) -> torch.Tensor:
    """An uninitialised ``[..., M, G]`` scale tensor of ``x.shape == shape`` in the layout the
    options name (module docstring); 1-D inputs (one token) get a ``[G]`` tensor."""
    full = group_scale_shape(shape, group_size)
    if not column_major or len(full) < 2:
        return torch.empty(full, dtype=dtype, device=device)
    m, g = full[-2], full[-1]
    mp = -(-m // 4) * 4 if tma_aligned else m
    raw = torch.empty((*full[:-2], g, mp), dtype=dtype, device=device)
    return raw[..., :m].transpose(-1, -2)


# ----------------------------------------------------------------------------- checks
def _dst(dst_dtype, out):
    """``dst_dtype=None``: the dtype of ``out`` when given, else E4M3."""
    if dst_dtype is None:
        return out.dtype if isinstance(out, torch.Tensor) else E4M3
    return dst_dtype


def _check_flag(op: str, name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"moefuse.{op}: argument '{name}' must be a bool, got {value!r}")


def _check_options(op, group_size, eps_name, eps, dst_dtype, out, cm, tma, ue8m0) -> None:
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise ValueError(
            f"moefuse.{op}: argument 'group_size' must be one of {GROUP_SIZES}, got {group_size!r}"
        )
    v.check_eps(op, eps_name, eps)
    dst = _dst(dst_dtype, out)
    if dst not in DST_DTYPES:
        raise ValueError(
            f"moefuse.{op}: argument 'dst_dtype' must be torch.float8_e4m3fn or torch.int8 "
            f"(or None), got {dst}"
        )
    for name, flag in (
        ("column_major_scales", cm),
        ("scale_tma_aligned", tma),
        ("scale_ue8m0", ue8m0),
    ):
        _check_flag(op, name, flag)
    if tma and not cm:
        raise ValueError(
            f"moefuse.{op}: argument 'scale_tma_aligned' pads the column-major scale layout; "
            "it needs column_major_scales=True"
        )


def _check_outputs(op, x, group_size, dst_dtype, ue8m0, out, scale_out, inputs) -> None:
    """``out`` (codes, contiguous, like ``x``) and ``scale_out`` ([..., G], any strides without
    self-overlap; FP32, or float8_e8m0fnu with power-of-two scales), disjoint from the
    ``inputs`` (name, tensor) and from each other."""
    dst = _dst(dst_dtype, out)
    if out is not None:
        v.check_tensor(op, "out", out, dtypes=(dst,), shape=x.shape, device=x.device)
        if not out.is_contiguous():
            raise ValueError(f"moefuse.{op}: argument 'out' must be contiguous")
    if scale_out is not None:
        dtypes = (torch.float32, E8M0) if ue8m0 else (torch.float32,)
        v.check_tensor(
            op,
            "scale_out",
            scale_out,
            dtypes=dtypes,
            shape=group_scale_shape(x.shape, group_size),
            device=x.device,
            last_dim_contiguous=False,
        )
        if scale_out.numel() > 1 and torch._debug_has_internal_overlap(scale_out) == 1:
            raise ValueError(
                f"moefuse.{op}: argument 'scale_out' must not have overlapping elements "
                f"(strides {tuple(scale_out.stride())})"
            )
    outs = [("out", out), ("scale_out", scale_out)]
    v.check_outputs(op, outs, [(n, t) for n, t in inputs], ())


def _codes(t: torch.Tensor) -> torch.Tensor:
    """Codes as the custom ops take them: FP8 as uint8 bits, INT8 as is; 1-D as one row."""
    t = t.view(torch.uint8) if t.dtype == E4M3 else t
    return t.unsqueeze(0) if t.dim() == 1 else t


def _scales(t: torch.Tensor) -> torch.Tensor:
    """Scales as the custom ops take them: FP32, or E8M0 as uint8 bytes; 1-D as one row."""
    t = t.view(torch.uint8) if t.dtype == E8M0 else t
    return t.unsqueeze(0) if t.dim() == 1 else t


def _reason(t: torch.Tensor) -> str | None:
    return kernel_device_reason(t.device)


# ----------------------------------------------------------------------------- standalone
def _check_group_quant(op, x, group_size, eps, dst_dtype, cm, tma, ue8m0, out, scale_out):
    _check_rows(op, "x", x, ACT)
    _check_options(op, group_size, "eps", eps, dst_dtype, out, cm, tma, ue8m0)
    _check_outputs(op, x, group_size, dst_dtype, ue8m0, out, scale_out, [("x", x)])


@fast_op
@v.checked(writes=("out", "scale_out"), reals=("eps",))
def per_token_group_quant_8bit(
    x,
    group_size,
    eps=1e-10,
    dst_dtype=None,
    column_major_scales=False,
    scale_tma_aligned=False,
    scale_ue8m0=False,
    *,
    out=None,
    scale_out=None,
    enable_pdl=None,
    impl: str = "auto",
):
    """Dynamic per-token-group 8-bit quantization (spec: per_token_group_quant_8bit), FlashInfer's
    name and arguments.

    ``x`` ``[H]``, ``[M, H]`` or ``[B, M, H]`` BF16/FP16/FP32 (last dim contiguous, any row
    strides), any H: the last dim splits into ``G = ceil(H / group_size)`` groups, the last one
    partial when ``group_size`` (32, 64, 128 or 256) does not divide H. Per token and group:
    ``s = max(amax, eps) / QMAX`` (448 for E4M3, 127 for INT8; FP32, IEEE division), ``s =
    2^ceil(log2 s)`` when ``scale_ue8m0``; ``q = e4m3(f32(x) / s)`` (IEEE division, RNE,
    saturating, NaN -> 0x7F) or, with ``dst_dtype=torch.int8``, round half to even clamped to
    [-127, 127] (NaN -> 0). A group containing NaN gets ``s = NaN``; one whose amax is Inf gets
    ``s = Inf`` (its finite values code 0, its infinities NaN -> 0x7F / 0).

    ``dst_dtype``: ``torch.float8_e4m3fn`` (None: the dtype of ``out`` when given, else E4M3) or
    ``torch.int8``. Scale layout: module docstring (``column_major_scales``,
    ``scale_tma_aligned``). ``scale_out`` may be ``torch.float8_e8m0fnu`` when ``scale_ue8m0``
    (the power-of-two scale's exponent byte). Returns ``(out [..., H], scale_out [..., G])``.
    """
    op = "per_token_group_quant_8bit"
    cm, tma = column_major_scales, scale_tma_aligned
    _check_group_quant(op, x, group_size, eps, dst_dtype, cm, tma, scale_ue8m0, out, scale_out)
    dst = _dst(dst_dtype, out)
    if out is None:
        out = torch.empty(x.shape, dtype=dst, device=x.device)
    if scale_out is None:
        scale_out = alloc_group_scales(x.shape, group_size, cm, tma, torch.float32, x.device)
    if x.numel() == 0:
        return out, scale_out
    if choose_impl(op, impl, x.device, _reason(x)) == "reference":
        q, s = ref.per_token_group_quant_8bit_reference(x, group_size, eps, dst, scale_ue8m0)
        out.copy_(q)
        scale_out.copy_(s)
        return out, scale_out
    ops.per_token_group_quant_8bit_op(
        x.unsqueeze(0) if x.dim() == 1 else x,
        _codes(out),
        _scales(scale_out),
        group_size,
        float(eps),
        scale_ue8m0,
        resolve_pdl(enable_pdl, x.device),
    )
    return out, scale_out


def supports_per_token_group_quant_8bit(
    x, group_size, dst_dtype=None, column_major_scales=False, scale_tma_aligned=False
) -> bool:
    return v.accepts(
        _check_group_quant,
        "per_token_group_quant_8bit",
        x,
        group_size,
        1e-10,
        dst_dtype,
        column_major_scales,
        scale_tma_aligned,
        False,
        None,
        None,
    ) and (_reason(x) is None)


# ----------------------------------------------------------------------------- fused norms
def _check_norm_group(
    op, input, residual, weight, eps, group_size, quant_eps, dst_dtype, cm, tma, ue8m0, out,
    scale_out, fused,
) -> None:  # fmt: skip
    _check_norm_common(op, input, residual, weight, eps, (2,), fused)
    _check_options(op, group_size, "quant_eps", quant_eps, dst_dtype, out, cm, tma, ue8m0)
    inputs = [("input", input), ("weight", weight)]
    if fused:
        inputs.append(("residual", residual))
    _check_outputs(op, input, group_size, dst_dtype, ue8m0, out, scale_out, inputs)


def _norm_group(
    op, input, residual, weight, eps, group_size, quant_eps, dst_dtype, cm, tma, ue8m0,
    gain_center, out, scale_out, enable_pdl, impl, fused,
):  # fmt: skip
    _check_norm_group(
        op, input, residual, weight, eps, group_size, quant_eps, dst_dtype, cm, tma, ue8m0, out,
        scale_out, fused,
    )  # fmt: skip
    dst = _dst(dst_dtype, out)
    if out is None:
        out = torch.empty(input.shape, dtype=dst, device=input.device)
    if scale_out is None:
        scale_out = alloc_group_scales(
            input.shape, group_size, cm, tma, torch.float32, input.device
        )
    if input.numel() == 0:
        return out, scale_out
    if choose_impl(op, impl, input.device, _reason(input)) == "reference":
        args = (eps, group_size, gain_center, quant_eps, dst, ue8m0)
        if fused:
            q, s, res_out = ref.fused_add_rmsnorm_group_quant_reference(
                input, residual, weight, *args
            )
            residual.copy_(res_out)
        else:
            q, s = ref.rmsnorm_group_quant_reference(input, weight, *args)
        out.copy_(q)
        scale_out.copy_(s)
        return out, scale_out
    common = (_codes(out), _scales(scale_out), group_size, float(eps), float(gain_center))
    tail = (float(quant_eps), ue8m0, resolve_pdl(enable_pdl, input.device))
    if fused:
        ops.fused_add_rmsnorm_group_quant_op(input, residual, weight, *common, *tail)
    else:
        ops.rmsnorm_group_quant_op(input, weight, *common, *tail)
    return out, scale_out


@fast_op
@v.checked(writes=("out", "scale_out"), reals=("gain_center", "quant_eps"))
def rmsnorm_group_quant(
    input,
    weight,
    eps: float = 1e-6,
    group_size: int = 128,
    *,
    dst_dtype=None,
    column_major_scales: bool = False,
    scale_tma_aligned: bool = False,
    scale_ue8m0: bool = False,
    quant_eps: float = 1e-10,
    gain_center: float = 0.0,
    out=None,
    scale_out=None,
    enable_pdl=None,
    impl: str = "auto",
):
    """RMSNorm + per-token-group 8-bit quantization in one pass: exactly the bits of
    ``per_token_group_quant_8bit(rmsnorm(input, weight, eps, gain_center), group_size,
    quant_eps, ...)`` (the norm output rounded to the input dtype, then quantized).

    ``input`` [M, H] BF16/FP16 (unit last stride, any row stride), any H; ``weight`` [H];
    ``gain_center`` 1.0 gives Gemma's ``(1 + w)``. The scale options, ``dst_dtype``, ``out`` and
    ``scale_out`` are :func:`per_token_group_quant_8bit`'s (``quant_eps`` its ``eps``). Returns
    ``(out [M, H], scale_out [M, G])``; ``input`` is not written.
    """
    return _norm_group(
        "rmsnorm_group_quant", input, None, weight, eps, group_size, quant_eps, dst_dtype,
        column_major_scales, scale_tma_aligned, scale_ue8m0, gain_center, out, scale_out,
        enable_pdl, impl, False,
    )  # fmt: skip


@fast_op
@v.checked(writes=("out", "scale_out", "residual"), reals=("gain_center", "quant_eps"))
def fused_add_rmsnorm_group_quant(
    input,
    residual,
    weight,
    eps: float = 1e-6,
    group_size: int = 128,
    *,
    dst_dtype=None,
    column_major_scales: bool = False,
    scale_tma_aligned: bool = False,
    scale_ue8m0: bool = False,
    quant_eps: float = 1e-10,
    gain_center: float = 0.0,
    out=None,
    scale_out=None,
    enable_pdl=None,
    impl: str = "auto",
):
    """Residual add + RMSNorm + per-token-group 8-bit quantization::

        h = f32(input) + f32(residual);  residual <- cast(h)          # in place
        y = cast((h * r) * g)                                        # r from the FP32 h
        (out, scale_out) = per_token_group_quant_8bit(y, group_size, quant_eps, ...)

    the bits of ``fused_add_rmsnorm`` then :func:`per_token_group_quant_8bit` of its output.
    ``input`` is not written; ``residual`` like ``input``, not aliasing it. Arguments and return
    as :func:`rmsnorm_group_quant`.
    """
    return _norm_group(
        "fused_add_rmsnorm_group_quant", input, residual, weight, eps, group_size, quant_eps,
        dst_dtype, column_major_scales, scale_tma_aligned, scale_ue8m0, gain_center, out,
        scale_out, enable_pdl, impl, True,
    )  # fmt: skip


def supports_rmsnorm_group_quant(input, weight, group_size=128, dst_dtype=None) -> bool:
    return v.accepts(
        _check_norm_group, "rmsnorm_group_quant", input, None, weight, 1e-6, group_size, 1e-10,
        dst_dtype, False, False, False, None, None, False,
    ) and (_reason(input) is None)  # fmt: skip


def supports_fused_add_rmsnorm_group_quant(
    input, residual, weight, group_size=128, dst_dtype=None
) -> bool:
    return v.accepts(
        _check_norm_group, "fused_add_rmsnorm_group_quant", input, residual, weight, 1e-6,
        group_size, 1e-10, dst_dtype, False, False, False, None, None, True,
    ) and (_reason(input) is None)  # fmt: skip
