"""Public all-reduce fusions (the spec's all-reduce fusion), one function per FlashInfer pattern.

Every op is collective over ``workspace`` (an :class:`AllReduceWorkspace`): all ranks call it with
the same M, in the same order. Common keyword arguments:

* ``eps`` (1e-6), ``weight_bias`` (0.0 plain RMSNorm, 1.0 Gemma ``1 + w``),
* ``fp32_acc`` — True: FP32 running sum over ranks, one rounding; False: rounded to the
  activation dtype after every add (the spec's all-reduce fusion). Ranks are summed in ascending
order from +0.0.
* ``algorithm`` — "auto" (by payload size, ``moefuse.comm.workspace.ONESHOT_MAX_BYTES``),
  "oneshot" (Lamport), "twoshot" (reduce-scatter + all-gather) or "torch" (all-gather with
  torch.distributed + local rank-order sum). All give the same bits; an explicit peer algorithm
  that cannot run raises ``RuntimeError``.
* ``enable_pdl`` — None: programmatic dependent launch where the device supports it.
* ``impl`` — "auto" | "triton" | "reference" (DESIGN.md): "reference" all-gathers with
  torch.distributed and runs :mod:`moefuse.comm.all_reduce.reference`; "triton" runs the
  kernels (on CPU tensors under TRITON_INTERPRET=1 too, across processes) or raises saying why.
* optional outputs (``residual_out``, ``norm_out``, ...): allocated when None. ``residual_out``
  may be ``residual`` and ``norm_out`` may be ``input`` (in place); otherwise outputs must not
  overlap inputs or each other.

Shapes: ``input``, ``residual`` [M, H] (BF16/FP16/FP32, the workspace dtype, last dim contiguous);
``weight`` [H] (BF16/FP16/FP32). M = 0 is a no-op (no communication).
Outputs replicated on all ranks are bitwise identical across ranks and algorithms.
"""

from __future__ import annotations

import torch

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, resolve_pdl
from moefuse.comm.all_reduce import ops
from moefuse.comm.workspace import ALGORITHMS, DTYPES, WEIGHT_DTYPES, AllReduceWorkspace
from moefuse.quant.formats import LAYOUTS, scale_layout_shape


# ----------------------------------------------------------------------------- validation
def _check_common(op, input, workspace, fp32_acc, algorithm) -> None:
    if not isinstance(workspace, AllReduceWorkspace):
        raise ValueError(
            f"moefuse.{op}: argument 'workspace' must be an AllReduceWorkspace, "
            f"got {type(workspace).__name__}"
        )
    v.check_tensor(op, "input", input, dtypes=DTYPES, ndims=(2,))
    if input.dtype != workspace.dtype:
        raise ValueError(
            f"moefuse.{op}: argument 'input' has dtype {input.dtype} but the "
            f"workspace was created for {workspace.dtype}"
        )
    if input.shape[1] != workspace.hidden_size:
        raise ValueError(
            f"moefuse.{op}: argument 'input' has hidden size {input.shape[1]} but "
            f"the workspace was created for {workspace.hidden_size}"
        )
    if input.device != workspace.device:
        raise ValueError(
            f"moefuse.{op}: argument 'input' is on {input.device} but the workspace "
            f"is on {workspace.device}"
        )
    if not isinstance(fp32_acc, bool):
        raise ValueError(f"moefuse.{op}: argument 'fp32_acc' must be a bool, got {fp32_acc!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"moefuse.{op}: argument 'algorithm' must be one of {ALGORITHMS}, got {algorithm!r}"
        )


def _check_norm_inputs(op, input, residual, weight, eps, weight_bias) -> None:
    v.check_tensor(
        op, "residual", residual, dtypes=(input.dtype,), shape=input.shape, device=input.device
    )
    v.check_tensor(
        op, "weight", weight, dtypes=WEIGHT_DTYPES, shape=(input.shape[1],), device=input.device
    )
    v.check_eps(op, "eps", eps)
    v.check_real(op, "weight_bias", weight_bias)


def _out(op, name, t, shape, dtype, device) -> None:
    if t is not None:
        v.check_tensor(op, name, t, dtypes=(dtype,), shape=shape, device=device)


def _check_scale(op, name, scale, device) -> None:
    v.check_tensor(op, name, scale, dtypes=(torch.float32,), shape=(1,), device=device)


def _impl(op, impl, input, workspace) -> str:
    return choose_impl(op, impl, input.device, workspace.unsupported_reason(input))


# ----------------------------------------------------------------------------- pattern 0
@fast_op(guards=("workspace",))
@v.checked(writes=("out",))
def allreduce(
    input,
    *,
    workspace,
    out=None,
    fp32_acc: bool = True,
    algorithm: str = "auto",
    enable_pdl=None,
    impl: str = "auto",
):
    """Sum of ``input`` over the ranks: ``out = T(sum_r f32(input_r))`` (pattern kAllReduce).

    ``out`` [M, H] like ``input`` (may be ``input`` itself). Returns ``out``.
    """
    op = "allreduce"
    _check_common(op, input, workspace, fp32_acc, algorithm)
    _out(op, "out", out, input.shape, input.dtype, input.device)
    v.check_outputs(op, [("out", out)], [("input", input)], {("out", "input")})
    if out is None:
        out = torch.empty_like(input)
    if input.shape[0] == 0:
        return out
    backend = _impl(op, impl, input, workspace)
    ops.allreduce_op(
        input,
        out,
        workspace.id,
        fp32_acc,
        algorithm,
        resolve_pdl(enable_pdl, input.device),
        backend,
    )
    return out


def supports_allreduce(input, *, workspace) -> bool:
    """Local answer (no side effects); combine across ranks with ``workspace.vote``."""
    return isinstance(workspace, AllReduceWorkspace) and workspace.supports(input)


# ----------------------------------------------------------------------------- pattern 1
@fast_op(guards=("workspace",))
@v.checked(writes=("residual_out", "norm_out"))
def allreduce_residual_rmsnorm(
    input,
    residual,
    weight,
    *,
    workspace,
    eps: float = 1e-6,
    weight_bias: float = 0.0,
    fp32_acc: bool = True,
    algorithm: str = "auto",
    enable_pdl=None,
    impl: str = "auto",
    residual_out=None,
    norm_out=None,
):
    """All-reduce + residual add + RMSNorm (pattern kARResidualRMSNorm)::

        h = T(T(sum_r x_r) + residual)                         -> residual_out
        norm_out = T((h * rsqrt(mean(h^2) + eps)) * (f32(weight) + weight_bias))

    The statistic is taken over the ROUNDED h. Returns ``(residual_out, norm_out)``.
    """
    op = "allreduce_residual_rmsnorm"
    _check_common(op, input, workspace, fp32_acc, algorithm)
    _check_norm_inputs(op, input, residual, weight, eps, weight_bias)
    for name, t in (("residual_out", residual_out), ("norm_out", norm_out)):
        _out(op, name, t, input.shape, input.dtype, input.device)
    v.check_outputs(
        op,
        [("residual_out", residual_out), ("norm_out", norm_out)],
        [("input", input), ("residual", residual), ("weight", weight)],
        {("residual_out", "residual"), ("norm_out", "input")},
    )
    residual_out = torch.empty_like(input) if residual_out is None else residual_out
    norm_out = torch.empty_like(input) if norm_out is None else norm_out
    if input.shape[0] == 0:
        return residual_out, norm_out
    backend = _impl(op, impl, input, workspace)
    ops.allreduce_residual_rmsnorm_op(
        input,
        residual,
        weight,
        residual_out,
        norm_out,
        workspace.id,
        float(eps),
        float(weight_bias),
        fp32_acc,
        algorithm,
        resolve_pdl(enable_pdl, input.device),
        backend,
    )
    return residual_out, norm_out


def supports_allreduce_residual_rmsnorm(input, residual, weight, *, workspace) -> bool:
    """Local answer (no side effects); combine across ranks with ``workspace.vote``."""
    op = "allreduce_residual_rmsnorm"
    return (
        v.accepts(_check_common, op, input, workspace, True, "auto")
        and v.accepts(_check_norm_inputs, op, input, residual, weight, 1e-6, 0.0)
        and workspace.supports(input)
    )


# ----------------------------------------------------------------------------- FP8 (2 / 4)
def _fp8(
    op,
    input,
    residual,
    weight,
    scale,
    workspace,
    eps,
    weight_bias,
    fp32_acc,
    algorithm,
    enable_pdl,
    impl,
    residual_out,
    norm_out,
    quant_out,
    want_norm,
):
    _check_common(op, input, workspace, fp32_acc, algorithm)
    _check_norm_inputs(op, input, residual, weight, eps, weight_bias)
    _check_scale(op, "scale", scale, input.device)
    _out(op, "residual_out", residual_out, input.shape, input.dtype, input.device)
    if want_norm:
        _out(op, "norm_out", norm_out, input.shape, input.dtype, input.device)
    _out(op, "quant_out", quant_out, input.shape, torch.float8_e4m3fn, input.device)
    v.check_outputs(
        op,
        [("residual_out", residual_out), ("norm_out", norm_out), ("quant_out", quant_out)],
        [("input", input), ("residual", residual), ("weight", weight), ("scale", scale)],
        {("residual_out", "residual"), ("norm_out", "input")},
    )
    residual_out = torch.empty_like(input) if residual_out is None else residual_out
    if want_norm and norm_out is None:
        norm_out = torch.empty_like(input)
    if quant_out is None:
        quant_out = torch.empty(input.shape, dtype=torch.float8_e4m3fn, device=input.device)
    if input.shape[0] > 0:
        backend = _impl(op, impl, input, workspace)
        ops.allreduce_residual_rmsnorm_fp8_op(  # FP8 bytes travel as uint8 (schema checks)
            input,
            residual,
            weight,
            scale,
            residual_out,
            norm_out,
            quant_out.view(torch.uint8),
            workspace.id,
            float(eps),
            float(weight_bias),
            fp32_acc,
            algorithm,
            resolve_pdl(enable_pdl, input.device),
            backend,
        )
    return (residual_out, norm_out, quant_out) if want_norm else (residual_out, quant_out)


@fast_op(guards=("workspace",))
@v.checked(writes=("residual_out", "quant_out"))
def allreduce_residual_rmsnorm_fp8(
    input,
    residual,
    weight,
    scale,
    *,
    workspace,
    eps=1e-6,
    weight_bias=0.0,
    fp32_acc=True,
    algorithm="auto",
    enable_pdl=None,
    impl="auto",
    residual_out=None,
    quant_out=None,
):
    """As :func:`allreduce_residual_rmsnorm`, then static FP8 of the ROUNDED norm output
    (pattern kARResidualRMSNormFP8Quant): ``quant_out = e4m3(f32(n) * (1/scale))`` with ``scale``
    a [1] FP32 tensor (dequantization scale; 1/scale is one IEEE division). Returns
    ``(residual_out, quant_out float8_e4m3fn [M, H])``."""
    return _fp8(
        "allreduce_residual_rmsnorm_fp8",
        input,
        residual,
        weight,
        scale,
        workspace,
        eps,
        weight_bias,
        fp32_acc,
        algorithm,
        enable_pdl,
        impl,
        residual_out,
        None,
        quant_out,
        False,
    )


@fast_op(guards=("workspace",))
@v.checked(writes=("residual_out", "norm_out", "quant_out"))
def allreduce_residual_rmsnorm_out_fp8(
    input,
    residual,
    weight,
    scale,
    *,
    workspace,
    eps=1e-6,
    weight_bias=0.0,
    fp32_acc=True,
    algorithm="auto",
    enable_pdl=None,
    impl="auto",
    residual_out=None,
    norm_out=None,
    quant_out=None,
):
    """:func:`allreduce_residual_rmsnorm_fp8` that also writes ``norm_out`` (pattern
    kARResidualRMSNormOutFP8Quant). Returns ``(residual_out, norm_out, quant_out)``."""
    return _fp8(
        "allreduce_residual_rmsnorm_out_fp8",
        input,
        residual,
        weight,
        scale,
        workspace,
        eps,
        weight_bias,
        fp32_acc,
        algorithm,
        enable_pdl,
        impl,
        residual_out,
        norm_out,
        quant_out,
        True,
    )


def supports_allreduce_residual_rmsnorm_fp8(input, residual, weight, scale, *, workspace) -> bool:
    return v.accepts(
        _check_scale, "allreduce_residual_rmsnorm_fp8", "scale", scale, input.device
    ) and supports_allreduce_residual_rmsnorm(input, residual, weight, workspace=workspace)


# ----------------------------------------------------------------------------- NVFP4 (3 / 5)
def _nvfp4(
    op,
    input,
    residual,
    weight,
    global_scale,
    workspace,
    layout,
    eps,
    weight_bias,
    fp32_acc,
    algorithm,
    enable_pdl,
    impl,
    residual_out,
    norm_out,
    quant_out,
    scale_out,
    want_norm,
):
    _check_common(op, input, workspace, fp32_acc, algorithm)
    _check_norm_inputs(op, input, residual, weight, eps, weight_bias)
    _check_scale(op, "global_scale", global_scale, input.device)
    if layout not in LAYOUTS:
        raise ValueError(
            f"moefuse.{op}: argument 'layout' must be one of {tuple(LAYOUTS)}, got {layout!r}"
        )
    m, h = input.shape
    if h % 16 != 0:
        raise ValueError(
            f"moefuse.{op}: argument 'input' must have a hidden size divisible by 16 "
            f"for NVFP4, got {h}"
        )
    sf_shape = scale_layout_shape(m, h // 16, layout)
    _out(op, "residual_out", residual_out, input.shape, input.dtype, input.device)
    if want_norm:
        _out(op, "norm_out", norm_out, input.shape, input.dtype, input.device)
    _out(op, "quant_out", quant_out, (m, h // 2), torch.uint8, input.device)
    _out(op, "scale_out", scale_out, sf_shape, torch.uint8, input.device)
    for name, t in (("quant_out", quant_out), ("scale_out", scale_out)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"moefuse.{op}: argument '{name}' must be contiguous")
    v.check_outputs(
        op,
        [
            ("residual_out", residual_out),
            ("norm_out", norm_out),
            ("quant_out", quant_out),
            ("scale_out", scale_out),
        ],
        [
            ("input", input),
            ("residual", residual),
            ("weight", weight),
            ("global_scale", global_scale),
        ],
        {("residual_out", "residual"), ("norm_out", "input")},
    )
    residual_out = torch.empty_like(input) if residual_out is None else residual_out
    if want_norm and norm_out is None:
        norm_out = torch.empty_like(input)
    if quant_out is None:
        quant_out = torch.empty((m, h // 2), dtype=torch.uint8, device=input.device)
    if scale_out is None:
        scale_out = torch.empty(sf_shape, dtype=torch.uint8, device=input.device)
    if m > 0:
        backend = _impl(op, impl, input, workspace)
        ops.allreduce_residual_rmsnorm_nvfp4_op(
            input,
            residual,
            weight,
            global_scale,
            residual_out,
            norm_out,
            quant_out,
            scale_out,
            workspace.id,
            float(eps),
            float(weight_bias),
            LAYOUTS[layout],
            fp32_acc,
            algorithm,
            resolve_pdl(enable_pdl, input.device),
            backend,
        )
    if want_norm:
        return residual_out, norm_out, quant_out, scale_out
    return residual_out, quant_out, scale_out


@fast_op(guards=("workspace",))
@v.checked(writes=("residual_out", "quant_out", "scale_out"))
def allreduce_residual_rmsnorm_nvfp4(
    input,
    residual,
    weight,
    global_scale,
    *,
    workspace,
    layout="swizzled_128x4",
    eps=1e-6,
    weight_bias=0.0,
    fp32_acc=True,
    algorithm="auto",
    enable_pdl=None,
    impl="auto",
    residual_out=None,
    quant_out=None,
    scale_out=None,
):
    """As :func:`allreduce_residual_rmsnorm`, then NVFP4 of the ROUNDED norm output (pattern
    kARResidualRMSNormFP4Quant; the spec's NVFP4 recipe "ieee", ``gs = global_scale`` [1] FP32, H %
    16 == 0). ``layout``: "swizzled_128x4" | "swizzled_8x4" | "linear"; padding scale bytes are
    written as 0. Returns ``(residual_out, quant_out [M, H/2] uint8, scale_out uint8)`` with
    ``scale_out`` shaped ``moefuse.quant.formats.scale_layout_shape(M, H/16, layout)``."""
    return _nvfp4(
        "allreduce_residual_rmsnorm_nvfp4",
        input,
        residual,
        weight,
        global_scale,
        workspace,
        layout,
        eps,
        weight_bias,
        fp32_acc,
        algorithm,
        enable_pdl,
        impl,
        residual_out,
        None,
        quant_out,
        scale_out,
        False,
    )


@fast_op(guards=("workspace",))
@v.checked(writes=("residual_out", "norm_out", "quant_out", "scale_out"))
def allreduce_residual_rmsnorm_out_nvfp4(
    input,
    residual,
    weight,
    global_scale,
    *,
    workspace,
    layout="swizzled_128x4",
    eps=1e-6,
    weight_bias=0.0,
    fp32_acc=True,
    algorithm="auto",
    enable_pdl=None,
    impl="auto",
    residual_out=None,
    norm_out=None,
    quant_out=None,
    scale_out=None,
):
    """:func:`allreduce_residual_rmsnorm_nvfp4` that also writes ``norm_out`` (pattern
    kARResidualRMSNormOutFP4Quant). Returns ``(residual_out, norm_out, quant_out, scale_out)``."""
    return _nvfp4(
        "allreduce_residual_rmsnorm_out_nvfp4",
        input,
        residual,
        weight,
        global_scale,
        workspace,
        layout,
        eps,
        weight_bias,
        fp32_acc,
        algorithm,
        enable_pdl,
        impl,
        residual_out,
        norm_out,
        quant_out,
        scale_out,
        True,
    )


def supports_allreduce_residual_rmsnorm_nvfp4(
    input, residual, weight, global_scale, *, workspace
) -> bool:
    if not v.accepts(
        _check_scale, "allreduce_residual_rmsnorm_nvfp4", "global_scale", global_scale, input.device
    ):
        return False
    if input.dim() != 2 or input.shape[1] % 16 != 0:
        return False
    return supports_allreduce_residual_rmsnorm(input, residual, weight, workspace=workspace)
