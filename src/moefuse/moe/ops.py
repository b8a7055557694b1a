"""torch.library custom ops of the MoE finalize family.

Each op writes a caller-allocated output and returns nothing; ``mutates_args`` names exactly that
output, so torch.compile (functionalization) and CUDA graphs see the true data flow. Validation
happens in :mod:`moefuse.moe.api` before these are called. The real implementations import the
Triton launchers lazily (TRITON_INTERPRET must be set before triton is imported).
"""

import torch

from moefuse._dispatch import custom_op

Tensor = torch.Tensor


@custom_op("moefuse::moe_finalize", mutates_args=("out",))
def moe_finalize_op(
    permuted_input: Tensor,
    expanded_idx_to_permuted_idx: Tensor,
    topk_scales: Tensor,
    out: Tensor,
    bias: Tensor | None,
    expert_ids: Tensor | None,
    routed_scaling_factor: float,
    shared_expert_output: Tensor | None,
    input_is_expanded: bool,
    use_pdl: bool,
) -> None:
    from moefuse.moe.triton import launch_moe_finalize

    launch_moe_finalize(
        permuted_input,
        expanded_idx_to_permuted_idx,
        topk_scales,
        out,
        bias,
        expert_ids,
        routed_scaling_factor,
        shared_expert_output,
        input_is_expanded,
        use_pdl,
    )


@moe_finalize_op.register_fake
def _(
    permuted_input,
    expanded_idx_to_permuted_idx,
    topk_scales,
    out,
    bias,
    expert_ids,
    routed_scaling_factor,
    shared_expert_output,
    input_is_expanded,
    use_pdl,
):
    return None


@custom_op("moefuse::moe_finalize_scatter_add", mutates_args=("out",))
def moe_finalize_scatter_add_op(
    permuted_input: Tensor,
    permuted_idx_to_expanded_idx: Tensor,
    topk_scales: Tensor,
    out: Tensor,
    routed_scaling_factor: float,
    use_pdl: bool,
) -> None:
    from moefuse.moe.triton import launch_moe_finalize_scatter_add

    launch_moe_finalize_scatter_add(
        permuted_input,
        permuted_idx_to_expanded_idx,
        topk_scales,
        out,
        routed_scaling_factor,
        use_pdl,
    )


@moe_finalize_scatter_add_op.register_fake
def _(
    permuted_input, permuted_idx_to_expanded_idx, topk_scales, out, routed_scaling_factor, use_pdl
):
    return None


@custom_op("moefuse::moe_permute", mutates_args=("out",))
def moe_permute_op(
    input: Tensor, permuted_idx_to_expanded_idx: Tensor, top_k: int, out: Tensor, use_pdl: bool
) -> None:
    from moefuse.moe.triton import launch_moe_permute

    launch_moe_permute(input, permuted_idx_to_expanded_idx, top_k, out, use_pdl)


@moe_permute_op.register_fake
def _(input, permuted_idx_to_expanded_idx, top_k, out, use_pdl):
    return None


@custom_op("moefuse::moe_experts", mutates_args=("out",))
def moe_experts_op(
    hidden_states: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    out: Tensor,
    bias: Tensor | None,
    shared_expert_output: Tensor | None,
    routed_scaling_factor: float,
    transposed: bool,
    interleaved: bool,
    use_pdl: bool,
    backend: str,
) -> None:
    """``backend`` "reference" runs :func:`moefuse.moe.reference.moe_experts_reference` inside
    the op: its loop over the distinct experts reads ids on the host, which a trace cannot do."""
    if backend == "reference":
        from moefuse.moe.reference import moe_experts_reference

        out.copy_(
            moe_experts_reference(
                hidden_states,
                gate_up_proj,
                down_proj,
                top_k_index,
                top_k_weights,
                transposed=transposed,
                bias=bias,
                shared_expert_output=shared_expert_output,
                routed_scaling_factor=routed_scaling_factor,
                gate_up_layout="interleaved" if interleaved else "stacked",
            )
        )
        return
    from moefuse.moe.experts_triton import launch_moe_experts

    launch_moe_experts(
        hidden_states,
        gate_up_proj,
        down_proj,
        top_k_index,
        top_k_weights,
        out,
        bias,
        shared_expert_output,
        routed_scaling_factor,
        transposed,
        use_pdl,
        interleaved=interleaved,
    )


@moe_experts_op.register_fake
def _(
    hidden_states,
    gate_up_proj,
    down_proj,
    top_k_index,
    top_k_weights,
    out,
    bias,
    shared_expert_output,
    routed_scaling_factor,
    transposed,
    interleaved,
    use_pdl,
    backend,
):
    return None


@custom_op("moefuse::router_topk", mutates_args=("weights", "ids"))
def router_topk_op(
    router_logits: Tensor,
    top_k: int,
    weights: Tensor,
    ids: Tensor,
    softmax: bool,
    renormalize: bool,
    use_pdl: bool,
) -> None:
    from moefuse.moe.router_triton import launch_router_topk

    launch_router_topk(router_logits, top_k, weights, ids, softmax, renormalize, use_pdl)


@router_topk_op.register_fake
def _(router_logits, top_k, weights, ids, softmax, renormalize, use_pdl):
    return None


@custom_op("moefuse::moe_experts_fp8", mutates_args=("out",))
def moe_experts_fp8_op(
    hidden_states: Tensor,
    gate_up_proj: Tensor,
    gate_up_proj_scale_inv: Tensor,
    down_proj: Tensor,
    down_proj_scale_inv: Tensor,
    top_k_index: Tensor,
    top_k_weights: Tensor,
    out: Tensor,
    bias: Tensor | None,
    shared_expert_output: Tensor | None,
    routed_scaling_factor: float,
    interleaved: bool,
    use_pdl: bool,
    backend: str,
) -> None:
    """The FP8 (block-scaled W8A8) routed experts; ``backend`` as in :func:`moe_experts_op`."""
    if backend == "reference":
        from moefuse.moe.reference import moe_experts_reference

        out.copy_(
            moe_experts_reference(
                hidden_states,
                gate_up_proj,
                down_proj,
                top_k_index,
                top_k_weights,
                bias=bias,
                shared_expert_output=shared_expert_output,
                routed_scaling_factor=routed_scaling_factor,
                gate_up_proj_scale_inv=gate_up_proj_scale_inv,
                down_proj_scale_inv=down_proj_scale_inv,
                gate_up_layout="interleaved" if interleaved else "stacked",
            )
        )
        return
    from moefuse.moe.experts_fp8 import launch_moe_experts_fp8

    launch_moe_experts_fp8(
        hidden_states,
        gate_up_proj,
        gate_up_proj_scale_inv,
        down_proj,
        down_proj_scale_inv,
        top_k_index,
        top_k_weights,
        out,
        bias,
        shared_expert_output,
        routed_scaling_factor,
        interleaved,
        use_pdl,
    )


@moe_experts_fp8_op.register_fake
def _(
    hidden_states,
    gate_up_proj,
    gate_up_proj_scale_inv,
    down_proj,
    down_proj_scale_inv,
    top_k_index,
    top_k_weights,
    out,
    bias,
    shared_expert_output,
    routed_scaling_factor,
    interleaved,
    use_pdl,
    backend,
):
    return None


@custom_op("moefuse::fp8_linear", mutates_args=("out",))
def fp8_linear_op(
    input: Tensor,
    weight: Tensor,
    weight_scale_inv: Tensor,
    bias: Tensor | None,
    input_scale: Tensor | None,
    out: Tensor,
    workspace: Tensor | None,
    use_pdl: bool,
    backend: str,
) -> None:
    """``out`` [M, N] = the block-scaled FP8 product of ``input`` [M, K] (codes when
    ``input_scale`` is given) and ``weight`` [N, K] (:func:`moefuse.moe.linear.fp8_linear`).
    ``workspace`` (zeroed counters) is left as it was found: not a mutated argument."""
    if backend == "reference":
        from moefuse.moe.reference_fp8 import fp8_linear_reference

        out.copy_(
            fp8_linear_reference(
                input, weight, weight_scale_inv, bias, input_scale=input_scale, out_dtype=out.dtype
            )
        )
        return
    from moefuse.moe.linear_triton import launch_fp8_linear

    launch_fp8_linear(
        input, weight, weight_scale_inv, bias, input_scale, out, use_pdl, workspace=workspace
    )


@fp8_linear_op.register_fake
def _(input, weight, weight_scale_inv, bias, input_scale, out, workspace, use_pdl, backend):
    return None
