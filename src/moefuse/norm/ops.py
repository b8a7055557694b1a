"""torch.library custom ops of the RMSNorm family.

Each op writes caller-allocated outputs and returns nothing; ``mutates_args`` names exactly the
tensors it writes, so torch.compile (functionalization) and CUDA graphs see the true data flow.
Validation happens in :mod:`moefuse.norm.api` before these are called. The real implementations
import the Triton launchers lazily (TRITON_INTERPRET must be set before triton is imported).
"""

import torch

from moefuse._dispatch import custom_op

Tensor = torch.Tensor


@custom_op("moefuse::rmsnorm", mutates_args=("out",))
def rmsnorm_op(
    input: Tensor, weight: Tensor, out: Tensor, eps: float, gain_center: float, use_pdl: bool
) -> None:
    from moefuse.norm.rms import launch_rmsnorm

    launch_rmsnorm(input, weight, out, eps, gain_center, use_pdl)


@rmsnorm_op.register_fake
def _(input, weight, out, eps, gain_center, use_pdl):
    return None


@custom_op("moefuse::fused_add_rmsnorm", mutates_args=("input", "residual"))
def fused_add_rmsnorm_op(
    input: Tensor, residual: Tensor, weight: Tensor, eps: float, gain_center: float, use_pdl: bool
) -> None:
    from moefuse.norm.rms import launch_fused_add_rmsnorm

    launch_fused_add_rmsnorm(input, residual, weight, eps, gain_center, use_pdl)


@fused_add_rmsnorm_op.register_fake
def _(input, residual, weight, eps, gain_center, use_pdl):
    return None


@custom_op("moefuse::gated_residual_rmsnorm", mutates_args=("out",))
def gated_residual_rmsnorm_op(
    branch: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    alpha: Tensor,
    beta: Tensor,
    out: Tensor,
    eps: float,
    gain_center: float,
    use_pdl: bool,
) -> None:
    from moefuse.norm.gated_residual import launch_gated_residual_rmsnorm

    launch_gated_residual_rmsnorm(
        branch, residual, weight, alpha, beta, out, eps, gain_center, use_pdl
    )


@gated_residual_rmsnorm_op.register_fake
def _(branch, residual, weight, alpha, beta, out, eps, gain_center, use_pdl):
    return None


@custom_op(
    "moefuse::gated_residual_next_rmsnorm",
    mutates_args=("residual_out", "ffn_input", "router_input"),
)
def gated_residual_next_rmsnorm_op(
    branch: Tensor,
    residual: Tensor,
    next_weight: Tensor,
    alpha: Tensor | None,
    alpha_scalar: float,
    beta: Tensor,
    post_weight: Tensor | None,
    residual_out: Tensor,
    ffn_input: Tensor,
    router_input: Tensor | None,
    post_eps: float,
    next_eps: float,
    next_gain_center: float,
    post_gain_center: float,
    use_pdl: bool,
) -> None:
    from moefuse.norm.gated import launch_gated_residual_next_rmsnorm

    launch_gated_residual_next_rmsnorm(
        branch,
        residual,
        next_weight,
        alpha,
        alpha_scalar,
        beta,
        post_weight,
        residual_out,
        ffn_input,
        router_input,
        post_eps,
        next_eps,
        next_gain_center,
        post_gain_center,
        use_pdl,
    )


@gated_residual_next_rmsnorm_op.register_fake
def _(
    branch,
    residual,
    next_weight,
    alpha,
    alpha_scalar,
    beta,
    post_weight,
    residual_out,
    ffn_input,
    router_input,
    post_eps,
    next_eps,
    next_gain_center,
    post_gain_center,
    use_pdl,
):
    return None


@custom_op("moefuse::rmsnorm_sigmoid_gate", mutates_args=("input",))
def rmsnorm_sigmoid_gate_op(input: Tensor, gate: Tensor, eps: float, use_pdl: bool) -> None:
    from moefuse.norm.rms import launch_rmsnorm

    launch_rmsnorm(input, None, input, eps, 0.0, use_pdl, gate=gate)


@rmsnorm_sigmoid_gate_op.register_fake
def _(input, gate, eps, use_pdl):
    return None
