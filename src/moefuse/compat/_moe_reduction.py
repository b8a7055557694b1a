"""FlashInfer's MoE all-reduce fusion calls mapped onto moefuse (spec: MoE-reduction ops).

``trtllm_moe_allreduce_fusion`` (pattern 6) and ``trtllm_moe_finalize_allreduce_fusion``
(pattern 7) with FlashInfer's argument names, writing the caller's outputs in place and returning
None; ``trtllm_allreduce_fusion(pattern_code=6 | 7, ...)`` forwards here (see
:func:`moe_pattern`). Differences from FlashInfer:

* ``workspace_ptrs`` must be a :class:`moefuse.comm.AllReduceWorkspace`.
* Numerics: FlashInfer's default (T-stepwise) semantics; ``accumulate="fp32"`` (keyword) selects
  the FP32 contract of its MNNVL backend. Invalid slots are any index < 0 or >= R (FlashInfer
  skips only -1).
* Pattern 7 quantization needs an explicit ``scale_factor`` (FlashInfer passes none);
  NVFP4 uses recipe "fast" on SM90 too (FlashInfer writes zeros below SM100).
* ``backend`` ("trtllm" | "cake") is accepted and ignored: one implementation.
"""

from __future__ import annotations

import torch

from moefuse import comm

__all__ = ["trtllm_moe_allreduce_fusion", "trtllm_moe_finalize_allreduce_fusion"]

_LAYOUT_NAMES = {0: "swizzled_128x4", 1: "swizzled_8x4", 2: "linear"}


def _check_ws(name, ws, world_size, world_rank, hidden_dim=None):
    if not isinstance(ws, comm.AllReduceWorkspace):
        raise ValueError(f"{name}: argument 'workspace_ptrs' must be a moefuse AllReduceWorkspace")
    if (
        world_size != ws.world_size
        or world_rank != ws.rank
        or (hidden_dim is not None and hidden_dim != ws.hidden_size)
    ):
        raise ValueError(
            f"{name}: world_size / world_rank / hidden_dim do not match the "
            f"workspace ({ws.world_size}, {ws.rank}, {ws.hidden_size})"
        )


def _quant(quant_out, scale_out, scale_factor, layout_code, m, h, device):
    """(quant, scale tensor, layout, quant_out view, scale_out view) from FlashInfer's outputs:
    NVFP4 when ``scale_out`` is given, FP8 when only ``quant_out`` (float8) is."""
    from moefuse.quant.formats import scale_layout_shape

    if quant_out is None:
        return None, None, "swizzled_128x4", None, None
    if isinstance(scale_factor, torch.Tensor):
        sf = scale_factor.reshape(1).to(device=device, dtype=torch.float32)
    elif scale_factor is None:
        raise ValueError("argument 'scale_factor' is required when 'quant_out' is given")
    else:
        sf = torch.tensor([float(scale_factor)], dtype=torch.float32, device=device)
    layout = _LAYOUT_NAMES[0 if layout_code is None else int(layout_code)]
    if scale_out is None:
        return "fp8", sf, layout, quant_out.view(m, h), None
    q = quant_out.view(torch.uint8).view(m, h // 2)
    s = scale_out.view(torch.uint8).view(scale_layout_shape(m, h // 16, layout))
    return "nvfp4", sf, layout, q, s


def trtllm_moe_allreduce_fusion(
    world_size: int,
    world_rank: int,
    token_num: int,
    hidden_dim: int,
    workspace_ptrs,
    launch_with_pdl: bool | None,
    residual_in: torch.Tensor,
    rms_gamma: torch.Tensor,
    rms_eps: float,
    scale_factor,
    moe_reduction_device_num_experts: int,
    moe_reduction_scale_input: torch.Tensor,
    moe_reduction_active_experts_token_input: torch.Tensor,
    moe_reduction_token_input: torch.Tensor,
    layout_code: int | None = None,
    moe_allreduce_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    norm_out: torch.Tensor | None = None,
    quant_out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    *,
    weight_bias: float = 0.0,
    backend: str = "trtllm",
    accumulate: str = "stepwise",
    impl: str = "auto",
) -> None:
    """Pattern 6 (MoE reduction) on ``workspace_ptrs``; outputs written in place."""
    name = "trtllm_moe_allreduce_fusion"
    _check_ws(name, workspace_ptrs, world_size, world_rank, hidden_dim)
    m, h, e = token_num, hidden_dim, moe_reduction_device_num_experts
    x = moe_reduction_active_experts_token_input.reshape(e, m, h)
    quant, sf, layout, q, s = _quant(
        quant_out, scale_out, scale_factor, layout_code, m, h, x.device
    )
    rows = lambda t: t.view(m, h) if t is not None else None  # noqa: E731
    comm.moe_allreduce_residual_rmsnorm(
        x,
        moe_reduction_scale_input.reshape(e, m),
        moe_reduction_token_input.reshape(m, h),
        residual_in.reshape(m, h),
        rms_gamma,
        workspace=workspace_ptrs,
        eps=float(rms_eps),
        weight_bias=float(weight_bias),
        accumulate=accumulate,
        quant=quant,
        scale_factor=sf,
        layout=layout,
        enable_pdl=launch_with_pdl,
        impl=impl,
        allreduce_out=rows(moe_allreduce_out),
        residual_out=rows(residual_out),
        norm_out=rows(norm_out),
        quant_out=q,
        scale_out=s,
    )


def trtllm_moe_finalize_allreduce_fusion(
    allreduce_in: torch.Tensor,
    residual_in: torch.Tensor,
    norm_weight: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    norm_out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
    workspace_ptrs,
    launch_with_pdl: bool | None,
    world_rank: int,
    world_size: int,
    eps: float,
    shared_expert_output: torch.Tensor | None = None,
    expert_scale_factor: torch.Tensor | None = None,
    routed_scaling_factor: float | None = None,
    *,
    quant_out: torch.Tensor | None = None,
    scale_out: torch.Tensor | None = None,
    scale_factor=None,
    layout_code: int | None = None,
    weight_bias: float = 0.0,
    backend: str = "trtllm",
    accumulate: str = "stepwise",
    use_oneshot: bool | None = None,
    impl: str = "auto",
) -> None:
    """Pattern 7 (MoE finalize) on ``workspace_ptrs``; outputs written in place. ``use_oneshot``:
    None = moefuse's heuristic, True one-shot, False two-shot (same bits)."""
    name = "trtllm_moe_finalize_allreduce_fusion"
    _check_ws(name, workspace_ptrs, world_size, world_rank)
    m, h = residual_in.shape[0], residual_in.shape[-1]
    if norm_out is None and residual_out is None and quant_out is None:
        raise ValueError(
            f"{name}: at least one of 'norm_out', 'residual_out', 'quant_out' is required"
        )
    quant, sf, layout, q, s = _quant(
        quant_out, scale_out, scale_factor, layout_code, m, h, residual_in.device
    )
    algorithm = "auto" if use_oneshot is None else ("oneshot" if use_oneshot else "twoshot")
    rows = lambda t: t.view(m, h) if t is not None else None  # noqa: E731
    comm.moe_finalize_allreduce_residual_rmsnorm(
        allreduce_in.reshape(-1, h),
        residual_in.reshape(m, h),
        norm_weight,
        expanded_idx_to_permuted_idx,
        workspace=workspace_ptrs,
        expert_scale_factor=expert_scale_factor,
        routed_scaling_factor=1.0 if routed_scaling_factor is None else routed_scaling_factor,
        shared_expert_output=rows(shared_expert_output),
        eps=float(eps),
        weight_bias=float(weight_bias),
        accumulate=accumulate,
        quant=quant,
        scale_factor=sf,
        layout=layout,
        algorithm=algorithm,
        enable_pdl=launch_with_pdl,
        impl=impl,
        residual_out=rows(residual_out),
        norm_out=rows(norm_out),
        quant_out=q,
        scale_out=s,
    )


def moe_pattern(
    pattern: int,
    *,
    allreduce_in,
    world_size,
    world_rank,
    token_num,
    hidden_dim,
    workspace_ptrs,
    launch_with_pdl,
    residual_in,
    residual_out,
    norm_out,
    quant_out,
    scale_out,
    rms_gamma,
    rms_eps,
    scale_factor,
    layout_code,
    weight_bias,
    impl,
    allreduce_out=None,
    use_oneshot=None,
    **moe,
) -> None:
    """``trtllm_allreduce_fusion(pattern_code=6 | 7, ...)``: the MoE arguments travel as keywords
    (pattern 6: ``moe_reduction_device_num_experts``, ``moe_reduction_scale_input``,
    ``moe_reduction_active_experts_token_input``, ``moe_reduction_token_input`` — the last may be
    omitted, ``allreduce_in`` is then the token input; pattern 7: ``expanded_idx_to_permuted_idx``
    and optionally ``expert_scale_factor``, ``routed_scaling_factor``, ``shared_expert_output``,
    with ``allreduce_in`` the permuted rows)."""
    wb = 0.0 if weight_bias is None else float(weight_bias)
    eps = 1e-6 if rms_eps is None else float(rms_eps)
    need = (
        (
            "moe_reduction_device_num_experts",
            "moe_reduction_scale_input",
            "moe_reduction_active_experts_token_input",
        )
        if pattern == 6
        else ("expanded_idx_to_permuted_idx",)
    )
    for name in need:
        if moe.get(name) is None:
            raise ValueError(
                f"trtllm_allreduce_fusion: argument '{name}' is required by pattern {pattern}"
            )
    if pattern == 6:
        tok = moe.pop("moe_reduction_token_input", None)
        trtllm_moe_allreduce_fusion(
            world_size,
            world_rank,
            token_num,
            hidden_dim,
            workspace_ptrs,
            launch_with_pdl,
            residual_in,
            rms_gamma,
            eps,
            scale_factor,
            moe.pop("moe_reduction_device_num_experts"),
            moe.pop("moe_reduction_scale_input"),
            moe.pop("moe_reduction_active_experts_token_input"),
            allreduce_in if tok is None else tok,
            layout_code,
            allreduce_out,
            residual_out,
            norm_out,
            quant_out,
            scale_out,
            weight_bias=wb,
            impl=impl,
            **moe,
        )
        return
    trtllm_moe_finalize_allreduce_fusion(
        allreduce_in,
        residual_in,
        rms_gamma,
        moe.pop("expanded_idx_to_permuted_idx"),
        norm_out,
        residual_out,
        workspace_ptrs,
        launch_with_pdl,
        world_rank,
        world_size,
        eps,
        quant_out=quant_out,
        scale_out=scale_out,
        scale_factor=scale_factor,
        layout_code=layout_code,
        weight_bias=wb,
        use_oneshot=use_oneshot,
        impl=impl,
        **moe,
    )
