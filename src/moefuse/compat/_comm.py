"""FlashInfer's pattern-based ``trtllm_allreduce_fusion`` mapped onto moefuse's per-pattern ops.

``moefuse.compat.flashinfer`` re-exports these names. Differences from FlashInfer:

* ``workspace_ptrs`` must be a :class:`moefuse.comm.AllReduceWorkspace` (FlashInfer passes a tensor
  of IPC pointers); ``world_size`` / ``world_rank`` / ``hidden_dim`` must match it.
* ``use_oneshot``: None = moefuse's size heuristic, True = one-shot, False = two-shot; the results
  are bitwise identical either way.
* ``trigger_completion_at_end`` is accepted and ignored: moefuse kernels always let dependents
  launch after their last load of the previous kernel's data (their outputs are complete only at
  kernel end, which a dependent's grid-dependency wait observes).
* NVFP4 patterns use recipe "ieee" (spec: All-reduce fusions) and write every scale layout,
  padding zeroed, on SM90 too. Patterns 6 / 7 (the MoE-reduction fusions) forward to
  ``moefuse.compat._moe_reduction`` (MoE arguments as keywords); 8-11 (per-token and per-group
  FP8) raise here.
"""

from __future__ import annotations

import torch

from moefuse import comm

__all__ = ["AllReduceFusionPattern", "QuantizationSFLayout", "trtllm_allreduce_fusion"]


class AllReduceFusionPattern:
    """FlashInfer's pattern codes (spec: All-reduce fusions)."""

    kAllReduce = 0
    kARResidualRMSNorm = 1
    kARResidualRMSNormFP8Quant = 2
    kARResidualRMSNormFP4Quant = 3
    kARResidualRMSNormOutFP8Quant = 4
    kARResidualRMSNormOutFP4Quant = 5
    kMoEReductionARResidualRMSNorm = 6
    kMoEFinalizeARResidualRMSNorm = 7


class QuantizationSFLayout:
    """Scale-factor layout codes (``layout_code``)."""

    SWIZZLED_128x4 = 0
    SWIZZLED_8x4 = 1
    LINEAR = 2


_LAYOUT_NAMES = {0: "swizzled_128x4", 1: "swizzled_8x4", 2: "linear"}


def _scale_tensor(scale_factor, device) -> torch.Tensor:
    if scale_factor is None:
        raise ValueError("trtllm_allreduce_fusion: scale_factor is required by the quant patterns")
    if isinstance(scale_factor, torch.Tensor):
        return scale_factor.reshape(1).to(device=device, dtype=torch.float32)
    return torch.tensor([float(scale_factor)], dtype=torch.float32, device=device)


def _checked_workspace(ws, world_size: int, world_rank: int, hidden_dim: int):
    """``ws``, once it is an AllReduceWorkspace whose world size, rank and width are the call's
    (ValueError otherwise)."""
    if not isinstance(ws, comm.AllReduceWorkspace):
        raise ValueError(
            "trtllm_allreduce_fusion: 'workspace_ptrs' must be a moefuse AllReduceWorkspace"
        )
    if world_size != ws.world_size or world_rank != ws.rank or hidden_dim != ws.hidden_size:
        raise ValueError(
            "trtllm_allreduce_fusion: world_size / world_rank / hidden_dim do not "
            f"match the workspace ({ws.world_size}, {ws.rank}, {ws.hidden_size})"
        )
    return ws


def _norm_pattern(
    pattern: int,
    x,
    residual_in,
    rms_gamma,
    residual_out,
    norm_out,
    quant_out,
    scale_out,
    rms_eps,
    weight_bias,
    scale_factor,
    layout_code,
    common: dict,
) -> None:
    """The all-reduce + residual + RMSNorm patterns (1-5) of :func:`trtllm_allreduce_fusion` on
    the ``[token_num, hidden_dim]`` view ``x``; ``common`` holds the keywords every op takes."""
    if residual_in is None or rms_gamma is None or residual_out is None:
        raise ValueError(
            "trtllm_allreduce_fusion: residual_in, residual_out and rms_gamma are "
            f"required by pattern {pattern}"
        )
    common.update(
        eps=1e-6 if rms_eps is None else float(rms_eps),
        weight_bias=0.0 if weight_bias is None else float(weight_bias),
    )
    res = residual_in.reshape(x.shape)
    if pattern == AllReduceFusionPattern.kARResidualRMSNorm:
        comm.allreduce_residual_rmsnorm(
            x,
            res,
            rms_gamma,
            residual_out=_rows(residual_out, x),
            norm_out=_rows(norm_out, x),
            **common,
        )
        return None
    scale = _scale_tensor(scale_factor, x.device)
    if pattern in (
        AllReduceFusionPattern.kARResidualRMSNormFP8Quant,
        AllReduceFusionPattern.kARResidualRMSNormOutFP8Quant,
    ):
        _fp8_pattern(
            pattern,
            x,
            res,
            rms_gamma,
            scale,
            _rows(residual_out, x),
            norm_out,
            _rows(quant_out, x),
            common,
        )
    else:
        _fp4_pattern(
            pattern,
            x,
            res,
            rms_gamma,
            scale,
            _rows(residual_out, x),
            norm_out,
            quant_out,
            scale_out,
            layout_code,
            common,
        )
    return None


def trtllm_allreduce_fusion(
    allreduce_in: torch.Tensor,
    world_size: int,
    world_rank: int,
    token_num: int,
    hidden_dim: int,
    workspace_ptrs,
    launch_with_pdl: bool | None,
    trigger_completion_at_end: bool,
    fp32_acc: bool,
    pattern_code: int,
    use_oneshot: bool | None = None,
    allreduce_out: torch.Tensor | None = None,
    residual_in: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    norm_out: torch.Tensor | None = None,
    quant_out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    rms_gamma: torch.Tensor | None = None,
    rms_eps: float | None = None,
    scale_factor: torch.Tensor | float | None = None,
    layout_code: int | None = None,
    metadata: dict | None = None,
    weight_bias: float | None = None,
    *,
    impl: str = "auto",
    **moe_kwargs,
) -> None:
    """Run FlashInfer pattern ``pattern_code`` on ``workspace_ptrs`` (an AllReduceWorkspace),
    writing the caller's output tensors in place (FlashInfer semantics). Returns None.
    Patterns 6 / 7 take their MoE arguments as keywords (``moefuse.compat._moe_reduction``)."""
    ws = _checked_workspace(workspace_ptrs, world_size, world_rank, hidden_dim)
    if int(pattern_code) in (
        AllReduceFusionPattern.kMoEReductionARResidualRMSNorm,
        AllReduceFusionPattern.kMoEFinalizeARResidualRMSNorm,
    ):
        from moefuse.compat._moe_reduction import moe_pattern

        moe_pattern(
            int(pattern_code),
            allreduce_in=allreduce_in,
            world_size=world_size,
            world_rank=world_rank,
            token_num=token_num,
            hidden_dim=hidden_dim,
            workspace_ptrs=ws,
            launch_with_pdl=launch_with_pdl,
            residual_in=residual_in,
            residual_out=residual_out,
            norm_out=norm_out,
            quant_out=quant_out,
            scale_out=scale_out,
            rms_gamma=rms_gamma,
            rms_eps=rms_eps,
            scale_factor=scale_factor,
            layout_code=layout_code,
            weight_bias=weight_bias,
            impl=impl,
            allreduce_out=allreduce_out,
            use_oneshot=use_oneshot,
            **moe_kwargs,
        )
        return None
    if moe_kwargs:
        raise ValueError(f"trtllm_allreduce_fusion: unexpected arguments {sorted(moe_kwargs)}")
    x = allreduce_in.reshape(token_num, hidden_dim)
    algorithm = "auto" if use_oneshot is None else ("oneshot" if use_oneshot else "twoshot")
    common = dict(workspace=ws, fp32_acc=bool(fp32_acc), algorithm=algorithm, impl=impl)
    common["enable_pdl"] = launch_with_pdl
    pattern = int(pattern_code)
    if pattern == AllReduceFusionPattern.kAllReduce:
        out = allreduce_out.view(token_num, hidden_dim) if allreduce_out is not None else None
        comm.allreduce(x, out=out, **common)
        return None
    if pattern > AllReduceFusionPattern.kARResidualRMSNormOutFP4Quant:
        raise NotImplementedError(
            f"trtllm_allreduce_fusion: pattern {pattern} is not an all-reduce + RMSNorm pattern "
            "of moefuse.comm (MoE reduction/finalize fusions and per-token / block FP8 are "
            "separate ops)"
        )
    _norm_pattern(
        pattern,
        x,
        residual_in,
        rms_gamma,
        residual_out,
        norm_out,
        quant_out,
        scale_out,
        rms_eps,
        weight_bias,
        scale_factor,
        layout_code,
        common,
    )
    return None


def _rows(t, x):
    """``t`` viewed (never reshaped: a copy would silently drop the results) as ``x``'s [M, H]."""
    return t.view(x.shape) if t is not None else None


def _fp8_pattern(
    pattern: int, x, res, gamma, scale, residual_out, norm_out, quant_out, common: dict
) -> None:
    """Patterns 2 / 4 (all-reduce + residual + RMSNorm + FP8, without / with norm_out) on [M, H]
    views of the caller's tensors (``norm_out`` viewed here, by the pattern that writes it)."""
    if pattern == AllReduceFusionPattern.kARResidualRMSNormFP8Quant:
        comm.allreduce_residual_rmsnorm_fp8(
            x, res, gamma, scale, residual_out=residual_out, quant_out=quant_out, **common
        )
    else:
        comm.allreduce_residual_rmsnorm_out_fp8(
            x,
            res,
            gamma,
            scale,
            residual_out=residual_out,
            norm_out=_rows(norm_out, x),
            quant_out=quant_out,
            **common,
        )


def _fp4_pattern(
    pattern: int,
    x,
    res,
    gamma,
    scale,
    residual_out,
    norm_out,
    quant_out,
    scale_out,
    layout_code,
    common: dict,
) -> None:
    """Patterns 3 / 5 (all-reduce + residual + RMSNorm + NVFP4, without / with norm_out):
    ``quant_out`` and ``scale_out`` are the caller's tensors in any byte dtype, viewed as
    [M, H / 2] packed bytes and the ``layout_code`` layout's scale shape; ``norm_out`` is viewed
    as [M, H] by the pattern that writes it."""
    from moefuse.quant.formats import scale_layout_shape

    token_num, hidden_dim = x.shape
    layout = _LAYOUT_NAMES[0 if layout_code is None else int(layout_code)]
    q = (
        quant_out.view(torch.uint8).view(token_num, hidden_dim // 2)
        if quant_out is not None
        else None
    )
    sf = None
    if scale_out is not None:
        sf = scale_out.view(torch.uint8).view(
            scale_layout_shape(token_num, hidden_dim // 16, layout)
        )
    if pattern == AllReduceFusionPattern.kARResidualRMSNormFP4Quant:
        comm.allreduce_residual_rmsnorm_nvfp4(
            x,
            res,
            gamma,
            scale,
            layout=layout,
            residual_out=residual_out,
            quant_out=q,
            scale_out=sf,
            **common,
        )
    else:
        comm.allreduce_residual_rmsnorm_out_nvfp4(
            x,
            res,
            gamma,
            scale,
            layout=layout,
            residual_out=residual_out,
            norm_out=_rows(norm_out, x),
            quant_out=q,
            scale_out=sf,
            **common,
        )
