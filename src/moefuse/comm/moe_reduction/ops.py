"""torch.library custom ops of the MoE-reduction fusions (spec: the MoE-reduction and
MoE-finalize all-reduce fusions).

As in :mod:`moefuse.comm.all_reduce.ops`: each op writes caller-allocated outputs, returns nothing,
``mutates_args`` names exactly the outputs, the workspace travels as its id, ``backend`` is
"triton" or "reference" (chosen by :mod:`moefuse.comm.moe_reduction.api`, which validates
everything first). ``pattern``: 1 norm only, 2 + FP8 (``quant_out`` as uint8 bytes), 3 + NVFP4.
``stepwise``: True for ``accumulate="stepwise"``, False for ``"fp32"``. Launchers are imported
lazily (TRITON_INTERPRET must be set before triton is imported).
"""

from __future__ import annotations

import torch

from moefuse._dispatch import custom_op
from moefuse.comm.moe_reduction import reference as ref
from moefuse.comm.moe_reduction.workspace import (  # noqa: F401 (extra_regions: public here too)
    GATHER32,
    extra_regions,
    fp32_gather_region,
    fp32_twoshot_fits,
)
from moefuse.comm.workspace import get_workspace

Tensor = torch.Tensor
LAYOUT_NAMES = ("swizzled_128x4", "swizzled_8x4", "linear")
QUANT_OF_PATTERN = {1: None, 2: "fp8", 3: "nvfp4"}


#: "auto" of the MoE reduction (dense expert rows, stepwise) takes two-shot instead of one-shot
#: for rows wider than DENSE_TWOSHOT_MIN_WIDTH from DENSE_TWOSHOT_MIN_TOKENS tokens. MEASURED
#: on 2 x H200 (bench/results/moe-reduction-h200-p2.json, H = 7168, K = 8, µs at M = 2048
#: / 16384): the one-shot 174.94 / 1325.94 lost to the unfused chain (a) 167.47 / 1195.84 (0.96 /
#: 0.90 x). MEASURED in loopback only (2 rank threads on one H200, 66 SMs each;
#: notes/comm-moe-reduction.md "Large-M two-shot at 2 CTAs per SM"): one-shot 327-346 / 2570,
#: two-shot at 1 CTA per SM
#: 269-276 / 1999-2005, at 2 CTAs per SM (:func:`moefuse.comm.moe_reduction.kernels.ctas_per_sm`)
#: 226-227 / 1728, chain (a) 256-277 / 1967-1972. Loopback over-charges the one-shot (MoE finalize,
#: chain time / one-shot time: 0.85 there, 1.06-1.08 on 2 GPUs) but matched chain / two-shot (MoE
#: finalize at 1 CTA per SM: 0.99 there, 1.02 on 2 GPUs), so two-shot at 2 CTAs is PREDICTED ~1.1 x
#: the chain on 2 GPUs (to confirm: `bench moe-reduction --world-size 2 --hidden 7168`, fused vs
#: fused_oneshot). accumulate="fp32" keeps the one-shot (155.51 / 1210.22 on 2 GPUs; its two-shot
#: unmeasured).
DENSE_TWOSHOT_MIN_WIDTH = 4097
DENSE_TWOSHOT_MIN_TOKENS = 2048


def prefers_twoshot(m: int, h: int, dense: bool, stepwise: bool) -> bool:
    """Does "auto" take two-shot where one-shot also fits (the table above)?"""
    return dense and stepwise and h >= DENSE_TWOSHOT_MIN_WIDTH and m >= DENSE_TWOSHOT_MIN_TOKENS


def resolve_algorithm(ws, m: int, algorithm: str, stepwise: bool, dense: bool = False) -> str:
    """The workspace's choice (:meth:`AllReduceWorkspace.choose_algorithm`), then two-shot for
    the wide MoE reduction (:func:`prefers_twoshot`), plus the FP32-sum capacity of two-shot
    (``accumulate="fp32"`` keeps FP32 sums in a gather region sized for T rows): "auto" then
    takes the torch path, an explicit "twoshot" raises. Same answer on every rank for the same
    M."""
    algo = ws.choose_algorithm(m, algorithm)
    if (
        algorithm == "auto"
        and algo == "oneshot"
        and prefers_twoshot(m, ws.hidden_size, dense, stepwise)
    ):
        algo = "twoshot"
    if algo == "twoshot" and not stepwise and not fp32_twoshot_fits(ws, m):
        if algorithm == "twoshot":
            cap = ws.regions[fp32_gather_region(ws)][1] // (4 * ws.hidden_size)
            raise RuntimeError(
                f"moefuse.comm: two-shot with accumulate='fp32' holds at most {cap} tokens on "
                f"this workspace, got {m} (create it with extra_regions="
                "moefuse.comm.moe_reduction.ops.extra_regions(max_tokens, H))"
            )
        algo = "torch"
    return algo


def _write(outs: dict, pattern, allreduce_out, residual_out, norm_out, quant_out, scale_out):
    # outputs may alias inputs (in place): every result is computed before anything is written
    if allreduce_out is not None:
        allreduce_out.copy_(outs["allreduce_out"])
    residual_out.copy_(outs["residual_out"])
    norm_out.copy_(outs["norm_out"])
    if pattern == 2:
        quant_out.copy_(outs["quant_out"].view(torch.uint8))
    elif pattern == 3:
        quant_out.copy_(outs["quant_out"])
        scale_out.copy_(outs["scale_out"].reshape(scale_out.shape))


def _execute(
    dense,
    ws_id,
    backend,
    algorithm,
    pattern,
    stepwise,
    *,
    src,
    idx_map,
    weights,
    shared,
    rsf,
    residual,
    weight,
    scale,
    allreduce_out,
    residual_out,
    norm_out,
    quant_out,
    scale_out,
    layout,
    eps,
    weight_bias,
    use_pdl,
    bias=None,
    expert_ids=None,
) -> None:
    ws = get_workspace(ws_id)
    ws.raise_if_unusable()
    if residual.shape[0] == 0:
        return
    accumulate = "stepwise" if stepwise else "fp32"
    if backend == "reference":
        if dense:
            part = ref.reduction_partial(src, weights, shared, accumulate)
        else:
            part = ref.finalize_partial(
                src, idx_map, weights, rsf, shared, accumulate, bias, expert_ids
            )
        outs = ref.reference_from_partial(
            part,
            residual,
            weight,
            workspace=ws,
            eps=eps,
            weight_bias=weight_bias,
            accumulate=accumulate,
            quant=QUANT_OF_PATTERN[pattern],
            scale_factor=scale,
            layout=LAYOUT_NAMES[layout],
        )
        _write(outs, pattern, allreduce_out, residual_out, norm_out, quant_out, scale_out)
        return
    from moefuse.comm.moe_reduction.kernels import launch_moe_reduction

    algo = resolve_algorithm(ws, residual.shape[0], algorithm, stepwise, bool(dense))
    launch_moe_reduction(
        ws,
        algo,
        pattern,
        dense=dense,
        src=src,
        idx_map=idx_map,
        weights=weights,
        shared=shared,
        rsf=rsf,
        bias=bias,
        expert_ids=expert_ids,
        residual=residual,
        weight=weight,
        residual_out=residual_out,
        norm_out=norm_out,
        allreduce_out=allreduce_out,
        quant_out=quant_out,
        scale_out=scale_out,
        scale=scale,
        layout=layout,
        eps=eps,
        weight_bias=weight_bias,
        stepwise=stepwise,
        use_pdl=use_pdl,
    )
    if ws.check_each_call and algo != "torch":
        ws.poll_status()


# ----------------------------------------------------------------------------- MoE reduction
@custom_op(
    "moefuse::moe_allreduce_residual_rmsnorm",
    mutates_args=("allreduce_out", "residual_out", "norm_out", "quant_out", "scale_out"),
)
def moe_allreduce_residual_rmsnorm_op(
    active_experts_token_input: Tensor,
    scale_input: Tensor,
    token_input: Tensor,
    residual: Tensor,
    weight: Tensor,
    scale: Tensor | None,
    allreduce_out: Tensor | None,
    residual_out: Tensor,
    norm_out: Tensor,
    quant_out: Tensor | None,
    scale_out: Tensor | None,
    workspace_id: int,
    eps: float,
    weight_bias: float,
    stepwise: bool,
    pattern: int,
    layout: int,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    _execute(
        True,
        workspace_id,
        backend,
        algorithm,
        pattern,
        stepwise,
        src=active_experts_token_input,
        idx_map=None,
        weights=scale_input,
        shared=token_input,
        rsf=1.0,
        residual=residual,
        weight=weight,
        scale=scale,
        allreduce_out=allreduce_out,
        residual_out=residual_out,
        norm_out=norm_out,
        quant_out=quant_out,
        scale_out=scale_out,
        layout=layout,
        eps=eps,
        weight_bias=weight_bias,
        use_pdl=use_pdl,
    )


@moe_allreduce_residual_rmsnorm_op.register_fake
def _(
    active_experts_token_input,
    scale_input,
    token_input,
    residual,
    weight,
    scale,
    allreduce_out,
    residual_out,
    norm_out,
    quant_out,
    scale_out,
    workspace_id,
    eps,
    weight_bias,
    stepwise,
    pattern,
    layout,
    algorithm,
    use_pdl,
    backend,
):
    return None


# ----------------------------------------------------------------------------- MoE finalize
@custom_op(
    "moefuse::moe_finalize_allreduce_residual_rmsnorm",
    mutates_args=("residual_out", "norm_out", "quant_out", "scale_out"),
)
def moe_finalize_allreduce_residual_rmsnorm_op(
    allreduce_in: Tensor,
    expanded_idx_to_permuted_idx: Tensor,
    expert_scale_factor: Tensor | None,
    shared_expert_output: Tensor | None,
    bias: Tensor | None,
    expert_ids: Tensor | None,
    residual: Tensor,
    weight: Tensor,
    scale: Tensor | None,
    residual_out: Tensor,
    norm_out: Tensor,
    quant_out: Tensor | None,
    scale_out: Tensor | None,
    workspace_id: int,
    routed_scaling_factor: float,
    eps: float,
    weight_bias: float,
    stepwise: bool,
    pattern: int,
    layout: int,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    _execute(
        False,
        workspace_id,
        backend,
        algorithm,
        pattern,
        stepwise,
        src=allreduce_in,
        idx_map=expanded_idx_to_permuted_idx,
        weights=expert_scale_factor,
        shared=shared_expert_output,
        rsf=routed_scaling_factor,
        bias=bias,
        expert_ids=expert_ids,
        residual=residual,
        weight=weight,
        scale=scale,
        allreduce_out=None,
        residual_out=residual_out,
        norm_out=norm_out,
        quant_out=quant_out,
        scale_out=scale_out,
        layout=layout,
        eps=eps,
        weight_bias=weight_bias,
        use_pdl=use_pdl,
    )


@moe_finalize_allreduce_residual_rmsnorm_op.register_fake
def _(
    allreduce_in,
    expanded_idx_to_permuted_idx,
    expert_scale_factor,
    shared_expert_output,
    bias,
    expert_ids,
    residual,
    weight,
    scale,
    residual_out,
    norm_out,
    quant_out,
    scale_out,
    workspace_id,
    routed_scaling_factor,
    eps,
    weight_bias,
    stepwise,
    pattern,
    layout,
    algorithm,
    use_pdl,
    backend,
):
    return None
