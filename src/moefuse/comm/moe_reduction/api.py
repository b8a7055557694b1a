"""Public MoE-reduction family (the spec's MoE-reduction and MoE-finalize all-reduce fusions): a
per-rank MoE partial, all-reduced, residual-added, RMS-normalized and optionally quantized — in one
kernel on the peer paths.

* :func:`moe_allreduce_residual_rmsnorm` — FlashInfer ``trtllm_moe_allreduce_fusion`` (pattern 6):
  active experts' outputs [E_loc, M, H] weighted by FP32 scales [E_loc, M], plus a token input.
* :func:`moe_finalize_allreduce_residual_rmsnorm` — FlashInfer
  ``trtllm_moe_finalize_allreduce_fusion`` (pattern 7): finalize from the permuted GEMM2 rows
  through ``expanded_idx_to_permuted_idx``.

Math: :mod:`moefuse.comm.moe_reduction.reference` (the docstring there is the contract). Common
keyword arguments, as in :mod:`moefuse.comm.all_reduce.api`: ``workspace`` (an
:class:`AllReduceWorkspace` of the activation dtype and H), ``eps``, ``weight_bias``, ``algorithm``
("auto" | "oneshot" | "twoshot" | "torch": same bits; "auto" is the workspace's choice, except that
the MoE reduction with accumulate="stepwise" takes two-shot for H > 4096 from 2048 tokens:
:func:`moefuse.comm.moe_reduction.ops.prefers_twoshot`), ``enable_pdl``, ``impl`` ("auto" |
"triton" | "reference"), and:

* ``accumulate`` — "stepwise" (default: T-rounding after every step, FlashInfer's default
  backend) or "fp32" (the deterministic FP32 FMA finalize of the spec's moe_finalize per rank, FP32
  rank sum, one rounding together with the residual: the MNNVL CuTe-DSL contract).
* ``quant`` — None, "fp8" (``quant_out = e4m3(norm_out * (1/scale_factor))``, float8_e4m3fn
  [M, H]) or "nvfp4" (recipe "fast", ``gs = scale_factor``, ``quant_out`` uint8 [M, H/2],
  ``scale_out`` uint8 shaped ``scale_layout_shape(M, H/16, layout)``, padding zeroed, H % 16 == 0).
  ``scale_factor``: [1] FP32 tensor (or a float) — required when quantizing (FlashInfer passes
  no NVFP4 global scale for pattern 7: moefuse takes it explicitly).

PDL (``enable_pdl``): as in :func:`moefuse.moe_finalize`, the one-shot kernel reads the routing
data of its first token (index map, weights, expert ids; the MoE reduction's scales) before the
grid-dependency wait — it must not be written by the immediately preceding kernel when that
kernel lets dependents launch early (GEMM2 does not write it).

Outputs (allocated when None; none may overlap an input or another output): ``residual_out`` and
``norm_out`` [M, H] always written, quant outputs when quantizing. Returns ``(residual_out,
norm_out)``, plus ``quant_out`` (FP8) or ``quant_out, scale_out`` (NVFP4). Replicated outputs are
bitwise identical on all ranks, algorithms and paths; M = 0 is a no-op. Collective: every rank
calls with the same M, quant, accumulate and options.
"""

from __future__ import annotations

import torch

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, resolve_pdl
from moefuse.comm.moe_reduction import ops
from moefuse.comm.moe_reduction.reference import ACCUMULATE, QUANTS
from moefuse.comm.workspace import ALGORITHMS, WEIGHT_DTYPES, AllReduceWorkspace
from moefuse.moe.api import SCALE_DTYPES, check_expert_bias
from moefuse.quant.formats import LAYOUTS, scale_layout_shape

PATTERN_OF_QUANT = {None: 1, "fp8": 2, "nvfp4": 3}


# ----------------------------------------------------------------------------- validation
def _check_epilogue(
    op,
    residual,
    weight,
    workspace,
    eps,
    weight_bias,
    accumulate,
    quant,
    scale_factor,
    layout,
    algorithm,
    weight_name="weight",
) -> None:
    if not isinstance(workspace, AllReduceWorkspace):
        raise ValueError(
            f"moefuse.{op}: argument 'workspace' must be an AllReduceWorkspace, "
            f"got {type(workspace).__name__}"
        )
    v.check_tensor(
        op, "residual", residual, dtypes=(workspace.dtype,), ndims=(2,), device=workspace.device
    )
    if residual.shape[1] != workspace.hidden_size:
        raise ValueError(
            f"moefuse.{op}: argument 'residual' has hidden size {residual.shape[1]} "
            f"but the workspace was created for {workspace.hidden_size}"
        )
    h = residual.shape[1]
    v.check_tensor(
        op, weight_name, weight, dtypes=WEIGHT_DTYPES, shape=(h,), device=residual.device
    )
    v.check_eps(op, "eps", eps)
    v.check_real(op, "weight_bias", weight_bias)
    if accumulate not in ACCUMULATE:
        raise ValueError(
            f"moefuse.{op}: argument 'accumulate' must be one of {ACCUMULATE}, got {accumulate!r}"
        )
    if quant not in QUANTS:
        raise ValueError(f"moefuse.{op}: argument 'quant' must be one of {QUANTS}, got {quant!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"moefuse.{op}: argument 'algorithm' must be one of {ALGORITHMS}, got {algorithm!r}"
        )
    if quant is not None:
        if not isinstance(scale_factor, torch.Tensor):
            raise ValueError(
                f"moefuse.{op}: argument 'scale_factor' must be a [1] FP32 tensor "
                f"when quant={quant!r}, got {type(scale_factor).__name__}"
            )
        v.check_tensor(
            op,
            "scale_factor",
            scale_factor,
            dtypes=(torch.float32,),
            shape=(1,),
            device=residual.device,
        )
    if quant == "nvfp4":
        if layout not in LAYOUTS:
            raise ValueError(
                f"moefuse.{op}: argument 'layout' must be one of {tuple(LAYOUTS)}, got {layout!r}"
            )
        if h % 16:
            raise ValueError(
                f"moefuse.{op}: argument 'residual' must have a hidden size "
                f"divisible by 16 for NVFP4, got {h}"
            )


def _check_quant_outputs(
    op, residual, quant, layout, residual_out, norm_out, quant_out, scale_out
) -> None:
    m, h = residual.shape
    dev, dt = residual.device, residual.dtype
    for name, t in (("residual_out", residual_out), ("norm_out", norm_out)):
        if t is not None:
            v.check_tensor(op, name, t, dtypes=(dt,), shape=(m, h), device=dev)
    if quant == "fp8" and quant_out is not None:
        v.check_tensor(
            op, "quant_out", quant_out, dtypes=(torch.float8_e4m3fn,), shape=(m, h), device=dev
        )
    if quant == "nvfp4":
        for name, t, shape in (
            ("quant_out", quant_out, (m, h // 2)),
            ("scale_out", scale_out, scale_layout_shape(m, h // 16, layout)),
        ):
            if t is not None:
                v.check_tensor(op, name, t, dtypes=(torch.uint8,), shape=shape, device=dev)
                if not t.is_contiguous():
                    raise ValueError(f"moefuse.{op}: argument '{name}' must be contiguous")
    if quant is None and (quant_out is not None or scale_out is not None):
        raise ValueError(f"moefuse.{op}: argument 'quant_out' / 'scale_out' given without quant")
    if quant == "fp8" and scale_out is not None:
        raise ValueError(f"moefuse.{op}: argument 'scale_out' is only written by quant='nvfp4'")


def _scale_tensor(scale_factor, device):
    if scale_factor is None or isinstance(scale_factor, torch.Tensor):
        return scale_factor
    if isinstance(scale_factor, (int, float)) and not isinstance(scale_factor, bool):
        return torch.tensor([float(scale_factor)], dtype=torch.float32, device=device)
    return scale_factor  # rejected by the check with the argument's name


def _allocate(residual, quant, layout, residual_out, norm_out, quant_out, scale_out):
    m, h = residual.shape
    residual_out = torch.empty_like(residual) if residual_out is None else residual_out
    norm_out = torch.empty_like(residual) if norm_out is None else norm_out
    if quant == "fp8" and quant_out is None:
        quant_out = torch.empty((m, h), dtype=torch.float8_e4m3fn, device=residual.device)
    if quant == "nvfp4":
        if quant_out is None:
            quant_out = torch.empty((m, h // 2), dtype=torch.uint8, device=residual.device)
        if scale_out is None:
            scale_out = torch.empty(
                scale_layout_shape(m, h // 16, layout), dtype=torch.uint8, device=residual.device
            )
    return residual_out, norm_out, quant_out, scale_out


def _result(quant, residual_out, norm_out, quant_out, scale_out):
    if quant is None:
        return residual_out, norm_out
    if quant == "fp8":
        return residual_out, norm_out, quant_out
    return residual_out, norm_out, quant_out, scale_out


def _op_tail(eps, weight_bias, accumulate, quant, layout, algorithm, enable_pdl, residual) -> tuple:
    """The epilogue arguments every op of the family ends with: (eps, weight_bias, stepwise,
    pattern, layout code, algorithm, PDL)."""
    return (
        float(eps),
        float(weight_bias),
        accumulate == "stepwise",
        PATTERN_OF_QUANT[quant],
        LAYOUTS[layout] if quant == "nvfp4" else 0,
        algorithm,
        resolve_pdl(enable_pdl, residual.device),
    )


def _impl(op, impl, residual, workspace) -> str:
    return choose_impl(op, impl, residual.device, workspace.unsupported_reason(residual))


# ----------------------------------------------------------------------------- MoE reduction
def _check_reduction(op, x, scale_input, token_input, residual, allreduce_out=None) -> torch.Tensor:
    """The MoE-reduction inputs and ``allreduce_out``; returns ``scale_input`` viewed as
    [E, M]."""
    m, h = residual.shape
    v.check_tensor(
        op,
        "active_experts_token_input",
        x,
        dtypes=(residual.dtype,),
        ndims=(3,),
        device=residual.device,
    )
    v.check_tensor(op, "active_experts_token_input", x, shape=(-1, m, h))
    if x.shape[0] < 1:
        raise ValueError(
            f"moefuse.{op}: argument 'active_experts_token_input' needs at least one expert"
        )
    e = x.shape[0]
    v.check_tensor(
        op,
        "scale_input",
        scale_input,
        dtypes=(torch.float32,),
        ndims=(1, 2),
        device=residual.device,
    )
    if scale_input.numel() != e * m:
        raise ValueError(
            f"moefuse.{op}: argument 'scale_input' must hold E_loc * M = {e * m} "
            f"FP32 scales ([E_loc, M]), got shape {tuple(scale_input.shape)}"
        )
    v.check_tensor(
        op,
        "token_input",
        token_input,
        dtypes=(residual.dtype,),
        shape=(m, h),
        device=residual.device,
    )
    if allreduce_out is not None:
        v.check_tensor(
            op,
            "allreduce_out",
            allreduce_out,
            dtypes=(residual.dtype,),
            shape=residual.shape,
            device=residual.device,
        )
    return scale_input.reshape(e, m)


@fast_op(guards=("workspace",))
@v.checked(writes=("allreduce_out", "residual_out", "norm_out", "quant_out", "scale_out"))
def moe_allreduce_residual_rmsnorm(
    active_experts_token_input,
    scale_input,
    token_input,
    residual,
    weight,
    *,
    workspace,
    eps: float = 1e-6,
    weight_bias: float = 0.0,
    accumulate: str = "stepwise",
    quant=None,
    scale_factor=None,
    layout: str = "swizzled_128x4",
    algorithm: str = "auto",
    enable_pdl=None,
    impl: str = "auto",
    allreduce_out=None,
    residual_out=None,
    norm_out=None,
    quant_out=None,
    scale_out=None,
):
    """MoE reduction + all-reduce + residual + RMSNorm (the spec's MoE-reduction fusion)::

        partial[t] = T-stepwise( sum_e T(x[e, t] * scale[e, t]) ) + token_input[t]   (this rank)
        s = rank-order sum of the partials;  h = T(s + residual)  -> residual_out
        norm_out = T(h * rsqrt(mean(h^2) + eps) * (f32(weight) + weight_bias)); quant of norm_out

    ``active_experts_token_input`` [E_loc, M, H] (T = workspace dtype, last dim contiguous),
    ``scale_input`` FP32 [E_loc, M] (or flattened), ``token_input``, ``residual`` [M, H] T,
    ``weight`` [H]. ``allreduce_out`` [M, H] (optional) receives ``T(s)``. See the module
    docstring for the other arguments and the returned tuple.
    """
    op = "moe_allreduce_residual_rmsnorm"
    scale_factor = _scale_tensor(scale_factor, getattr(residual, "device", None))
    _check_epilogue(
        op,
        residual,
        weight,
        workspace,
        eps,
        weight_bias,
        accumulate,
        quant,
        scale_factor,
        layout,
        algorithm,
    )
    scales = _check_reduction(
        op, active_experts_token_input, scale_input, token_input, residual, allreduce_out
    )
    _check_quant_outputs(op, residual, quant, layout, residual_out, norm_out, quant_out, scale_out)
    v.check_outputs(
        op,
        [
            ("allreduce_out", allreduce_out),
            ("residual_out", residual_out),
            ("norm_out", norm_out),
            ("quant_out", quant_out),
            ("scale_out", scale_out),
        ],
        [
            ("active_experts_token_input", active_experts_token_input),
            ("scale_input", scale_input),
            ("token_input", token_input),
            ("residual", residual),
            ("weight", weight),
            ("scale_factor", scale_factor),
        ],
        set(),
    )
    residual_out, norm_out, quant_out, scale_out = _allocate(
        residual, quant, layout, residual_out, norm_out, quant_out, scale_out
    )
    if residual.shape[0] > 0:
        backend = _impl(op, impl, residual, workspace)
        ops.moe_allreduce_residual_rmsnorm_op(
            active_experts_token_input,
            scales,
            token_input,
            residual,
            weight,
            scale_factor,
            allreduce_out,
            residual_out,
            norm_out,
            quant_out.view(torch.uint8) if quant_out is not None else None,
            scale_out,
            workspace.id,
            *_op_tail(eps, weight_bias, accumulate, quant, layout, algorithm, enable_pdl, residual),
            backend,
        )
    return _result(quant, residual_out, norm_out, quant_out, scale_out)


def supports_moe_allreduce_residual_rmsnorm(
    active_experts_token_input,
    scale_input,
    token_input,
    residual,
    weight,
    *,
    workspace,
    quant=None,
    scale_factor=None,
    layout="swizzled_128x4",
) -> bool:
    """Local answer (no side effects); combine across ranks with ``workspace.vote``."""
    op = "moe_allreduce_residual_rmsnorm"
    return (
        v.accepts(
            _check_epilogue,
            op,
            residual,
            weight,
            workspace,
            1e-6,
            0.0,
            "stepwise",
            quant,
            scale_factor,
            layout,
            "auto",
        )
        and v.accepts(
            _check_reduction, op, active_experts_token_input, scale_input, token_input, residual
        )
        and workspace.supports(residual)
    )


# ----------------------------------------------------------------------------- MoE finalize
def _check_finalize(
    op,
    allreduce_in,
    idx_map,
    expert_scale_factor,
    rsf,
    shared,
    residual,
    bias=None,
    expert_ids=None,
    epilogue=None,
    outs=None,
) -> None:
    """The MoE-finalize inputs; with ``outs`` = (residual_out, norm_out, quant_out, scale_out)
    and ``epilogue`` = (norm_weight, scale_factor, quant, layout) also the outputs
    (:func:`_check_quant_outputs`) and that no output overlaps another or an input."""
    m, h = residual.shape
    dev = residual.device
    v.check_tensor(
        op, "allreduce_in", allreduce_in, dtypes=(residual.dtype,), ndims=(2,), device=dev
    )
    v.check_tensor(op, "allreduce_in", allreduce_in, shape=(-1, h))
    v.check_tensor(
        op,
        "expanded_idx_to_permuted_idx",
        idx_map,
        dtypes=(torch.int32,),
        shape=(m, -1),
        device=dev,
    )
    if idx_map.shape[1] < 1:
        raise ValueError(f"moefuse.{op}: argument 'expanded_idx_to_permuted_idx' needs K >= 1")
    if expert_scale_factor is not None:
        v.check_tensor(
            op,
            "expert_scale_factor",
            expert_scale_factor,
            dtypes=SCALE_DTYPES,
            shape=tuple(idx_map.shape),
            device=dev,
        )
    v.check_real(op, "routed_scaling_factor", rsf)
    if shared is not None:
        v.check_tensor(
            op, "shared_expert_output", shared, dtypes=(residual.dtype,), shape=(m, h), device=dev
        )
    check_expert_bias(op, bias, expert_ids, h, tuple(idx_map.shape), dev)
    if outs is None:
        return
    norm_weight, scale_factor, quant, layout = epilogue
    residual_out, norm_out, quant_out, scale_out = outs
    _check_quant_outputs(op, residual, quant, layout, residual_out, norm_out, quant_out, scale_out)
    v.check_outputs(
        op,
        [
            ("residual_out", residual_out),
            ("norm_out", norm_out),
            ("quant_out", quant_out),
            ("scale_out", scale_out),
        ],
        [
            ("allreduce_in", allreduce_in),
            ("residual", residual),
            ("norm_weight", norm_weight),
            ("expanded_idx_to_permuted_idx", idx_map),
            ("expert_scale_factor", expert_scale_factor),
            ("shared_expert_output", shared),
            ("bias", bias),
            ("expert_ids", expert_ids),
            ("scale_factor", scale_factor),
        ],
        set(),
    )


@fast_op(guards=("workspace",))
@v.checked(writes=("residual_out", "norm_out", "quant_out", "scale_out"))
def moe_finalize_allreduce_residual_rmsnorm(
    allreduce_in,
    residual,
    norm_weight,
    expanded_idx_to_permuted_idx,
    *,
    workspace,
    expert_scale_factor=None,
    routed_scaling_factor: float = 1.0,
    shared_expert_output=None,
    bias=None,
    expert_ids=None,
    eps: float = 1e-6,
    weight_bias: float = 0.0,
    accumulate: str = "stepwise",
    quant=None,
    scale_factor=None,
    layout: str = "swizzled_128x4",
    algorithm: str = "auto",
    enable_pdl=None,
    impl: str = "auto",
    residual_out=None,
    norm_out=None,
    quant_out=None,
    scale_out=None,
):
    """MoE finalize + all-reduce + residual + RMSNorm (the spec's MoE-finalize fusion)::

        partial[t] = this rank's finalize of token t: slots k ascending, invalid slots
                     (index < 0 or >= R) skipped and never read, T(row * w[t, k]) accumulated
                     T-stepwise (or the FP32 FMA chain, accumulate="fp32"), * routed_scaling_factor,
                     + shared_expert_output[t]
        s = rank-order sum of the partials;  h = T(s + residual) -> residual_out;  norm; quant

    ``allreduce_in`` [R, H] permuted GEMM2 rows (T = workspace dtype; R may exceed M*K, padding
    rows are never read unless indexed); ``expanded_idx_to_permuted_idx`` [M, K] int32;
    ``expert_scale_factor`` [M, K] FP32/BF16/FP16 or None (unweighted sum);
    ``routed_scaling_factor`` (1.0 = skipped); ``shared_expert_output`` [M, H] T or None;
    ``residual`` [M, H]; ``norm_weight`` [H]; ``bias`` [E, H] (BF16/FP16/FP32) with
    ``expert_ids`` [M, K] int32/int64 (both or neither; moefuse extension as in the spec's
    moe_finalize: the bias row of the slot's expert is added to its row in FP32 before the weight,
    ids outside [0, E) add nothing). The partial is produced inside the all-reduce
    kernel (never written to HBM on the one-shot and two-shot paths). Other arguments: module
    docstring.
    """
    op = "moe_finalize_allreduce_residual_rmsnorm"
    scale_factor = _scale_tensor(scale_factor, getattr(residual, "device", None))
    _check_epilogue(
        op,
        residual,
        norm_weight,
        workspace,
        eps,
        weight_bias,
        accumulate,
        quant,
        scale_factor,
        layout,
        algorithm,
        "norm_weight",
    )
    _check_finalize(
        op,
        allreduce_in,
        expanded_idx_to_permuted_idx,
        expert_scale_factor,
        routed_scaling_factor,
        shared_expert_output,
        residual,
        bias,
        expert_ids,
        (norm_weight, scale_factor, quant, layout),
        (residual_out, norm_out, quant_out, scale_out),
    )
    residual_out, norm_out, quant_out, scale_out = _allocate(
        residual, quant, layout, residual_out, norm_out, quant_out, scale_out
    )
    if residual.shape[0] > 0:
        backend = _impl(op, impl, residual, workspace)
        ops.moe_finalize_allreduce_residual_rmsnorm_op(
            allreduce_in,
            expanded_idx_to_permuted_idx,
            expert_scale_factor,
            shared_expert_output,
            bias,
            expert_ids,
            residual,
            norm_weight,
            scale_factor,
            residual_out,
            norm_out,
            quant_out.view(torch.uint8) if quant_out is not None else None,
            scale_out,
            workspace.id,
            float(routed_scaling_factor),
            *_op_tail(eps, weight_bias, accumulate, quant, layout, algorithm, enable_pdl, residual),
            backend,
        )
    return _result(quant, residual_out, norm_out, quant_out, scale_out)


def supports_moe_finalize_allreduce_residual_rmsnorm(
    allreduce_in,
    residual,
    norm_weight,
    expanded_idx_to_permuted_idx,
    *,
    workspace,
    expert_scale_factor=None,
    shared_expert_output=None,
    quant=None,
    scale_factor=None,
    layout="swizzled_128x4",
) -> bool:
    """Local answer (no side effects); combine across ranks with ``workspace.vote``."""
    op = "moe_finalize_allreduce_residual_rmsnorm"
    return (
        v.accepts(
            _check_epilogue,
            op,
            residual,
            norm_weight,
            workspace,
            1e-6,
            0.0,
            "stepwise",
            quant,
            scale_factor,
            layout,
            "auto",
            "norm_weight",
        )
        and v.accepts(
            _check_finalize,
            op,
            allreduce_in,
            expanded_idx_to_permuted_idx,
            expert_scale_factor,
            1.0,
            shared_expert_output,
            residual,
        )
        and workspace.supports(residual)
    )
