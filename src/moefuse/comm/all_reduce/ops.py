"""torch.library custom ops of the all-reduce fusions.

Each op writes caller-allocated outputs and returns nothing; ``mutates_args`` names exactly the
outputs. The workspace travels as its integer id (custom-op schemas cannot carry Python objects;
the peer buffers it owns are internal state, like NCCL's). ``backend`` is "triton" or "reference"
(chosen by :mod:`moefuse.comm.all_reduce.api`): both run inside the op, so torch.compile sees
one opaque collective either way. Validation happens in the api before these are called; the
launchers are imported lazily (TRITON_INTERPRET must be set before triton is imported).
"""

from __future__ import annotations

import torch

from moefuse._dispatch import custom_op
from moefuse.comm.all_reduce import reference as ref
from moefuse.comm.workspace import get_workspace

Tensor = torch.Tensor
LAYOUT_NAMES = ("swizzled_128x4", "swizzled_8x4", "linear")


def _execute(
    pattern: int,
    ws_id: int,
    backend: str,
    algorithm: str,
    x: Tensor,
    residual,
    weight,
    *,
    out=None,
    residual_out=None,
    norm_out=None,
    quant_out=None,
    scale_out=None,
    scale=None,
    layout: int = 0,
    eps: float = 1e-6,
    weight_bias: float = 0.0,
    fp32_acc: bool = True,
    use_pdl: bool = False,
) -> None:
    ws = get_workspace(ws_id)
    ws.raise_if_failed()  # no device sync: the host status block (moefuse.comm.faults)
    if x.shape[0] == 0:
        return
    if backend == "reference":
        _execute_reference(
            pattern,
            ws,
            x,
            residual,
            weight,
            out,
            residual_out,
            norm_out,
            quant_out,
            scale_out,
            scale,
            layout,
            eps,
            weight_bias,
            fp32_acc,
        )
        return
    from moefuse.comm.all_reduce.kernels import launch_allreduce_fusion

    algo = ws.choose_algorithm(x.shape[0], algorithm)
    gathered = None
    if algo == "torch":
        from moefuse.comm.fallback import gather_stacked

        gathered = gather_stacked(x, ws)
    m_pad = scale_out.shape[0] if scale_out is not None else 0
    launch_allreduce_fusion(
        ws,
        algo,
        pattern,
        x,
        residual,
        weight,
        out=out,
        residual_out=residual_out,
        norm_out=norm_out,
        quant_out=quant_out,
        scale_out=scale_out,
        scale=scale,
        layout=layout,
        m_pad=m_pad,
        eps=eps,
        weight_bias=weight_bias,
        fp32_acc=fp32_acc,
        use_pdl=use_pdl,
        gathered=gathered,
    )
    if ws.check_each_call and algo != "torch":  # CPU: the kernel has finished, the read is free
        ws.poll_status()


def _execute_reference(
    pattern,
    ws,
    x,
    residual,
    weight,
    out,
    residual_out,
    norm_out,
    quant_out,
    scale_out,
    scale,
    layout,
    eps,
    weight_bias,
    fp32_acc,
) -> None:
    if pattern == 0:
        out.copy_(ref.allreduce_reference(x, workspace=ws, fp32_acc=fp32_acc))
        return
    if pattern == 1:
        h, n = ref.allreduce_residual_rmsnorm_reference(
            x, residual, weight, workspace=ws, eps=eps, weight_bias=weight_bias, fp32_acc=fp32_acc
        )
    elif pattern == 2:
        h, n, q = ref.allreduce_residual_rmsnorm_fp8_reference(
            x,
            residual,
            weight,
            scale,
            workspace=ws,
            eps=eps,
            weight_bias=weight_bias,
            fp32_acc=fp32_acc,
        )
        quant_out.copy_(q.view(torch.uint8))
    else:
        h, n, q, sf = ref.allreduce_residual_rmsnorm_nvfp4_reference(
            x,
            residual,
            weight,
            scale,
            workspace=ws,
            layout=LAYOUT_NAMES[layout],
            eps=eps,
            weight_bias=weight_bias,
            fp32_acc=fp32_acc,
        )
        quant_out.copy_(q)
        scale_out.copy_(sf.reshape(scale_out.shape))
    # outputs may alias inputs (in place): every result is computed before anything is written
    residual_out.copy_(h)
    if norm_out is not None:
        norm_out.copy_(n)


# ----------------------------------------------------------------------------- ops
@custom_op("moefuse::allreduce", mutates_args=("out",))
def allreduce_op(
    input: Tensor,
    out: Tensor,
    workspace_id: int,
    fp32_acc: bool,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    _execute(
        0,
        workspace_id,
        backend,
        algorithm,
        input,
        None,
        None,
        out=out,
        fp32_acc=fp32_acc,
        use_pdl=use_pdl,
    )


@allreduce_op.register_fake
def _(input, out, workspace_id, fp32_acc, algorithm, use_pdl, backend):
    return None


@custom_op("moefuse::allreduce_residual_rmsnorm", mutates_args=("residual_out", "norm_out"))
def allreduce_residual_rmsnorm_op(
    input: Tensor,
    residual: Tensor,
    weight: Tensor,
    residual_out: Tensor,
    norm_out: Tensor,
    workspace_id: int,
    eps: float,
    weight_bias: float,
    fp32_acc: bool,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    _execute(
        1,
        workspace_id,
        backend,
        algorithm,
        input,
        residual,
        weight,
        residual_out=residual_out,
        norm_out=norm_out,
        eps=eps,
        weight_bias=weight_bias,
        fp32_acc=fp32_acc,
        use_pdl=use_pdl,
    )


@allreduce_residual_rmsnorm_op.register_fake
def _(
    input,
    residual,
    weight,
    residual_out,
    norm_out,
    workspace_id,
    eps,
    weight_bias,
    fp32_acc,
    algorithm,
    use_pdl,
    backend,
):
    return None


@custom_op(
    "moefuse::allreduce_residual_rmsnorm_fp8",
    mutates_args=("residual_out", "norm_out", "quant_out"),
)
def allreduce_residual_rmsnorm_fp8_op(
    input: Tensor,
    residual: Tensor,
    weight: Tensor,
    scale: Tensor,
    residual_out: Tensor,
    norm_out: Tensor | None,
    quant_out: Tensor,
    workspace_id: int,
    eps: float,
    weight_bias: float,
    fp32_acc: bool,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    """``quant_out``: the FP8 bytes as a uint8 tensor."""
    _execute(
        2,
        workspace_id,
        backend,
        algorithm,
        input,
        residual,
        weight,
        residual_out=residual_out,
        norm_out=norm_out,
        quant_out=quant_out,
        scale=scale,
        eps=eps,
        weight_bias=weight_bias,
        fp32_acc=fp32_acc,
        use_pdl=use_pdl,
    )


@allreduce_residual_rmsnorm_fp8_op.register_fake
def _(
    input,
    residual,
    weight,
    scale,
    residual_out,
    norm_out,
    quant_out,
    workspace_id,
    eps,
    weight_bias,
    fp32_acc,
    algorithm,
    use_pdl,
    backend,
):
    return None


@custom_op(
    "moefuse::allreduce_residual_rmsnorm_nvfp4",
    mutates_args=("residual_out", "norm_out", "quant_out", "scale_out"),
)
def allreduce_residual_rmsnorm_nvfp4_op(
    input: Tensor,
    residual: Tensor,
    weight: Tensor,
    global_scale: Tensor,
    residual_out: Tensor,
    norm_out: Tensor | None,
    quant_out: Tensor,
    scale_out: Tensor,
    workspace_id: int,
    eps: float,
    weight_bias: float,
    layout: int,
    fp32_acc: bool,
    algorithm: str,
    use_pdl: bool,
    backend: str,
) -> None:
    _execute(
        3,
        workspace_id,
        backend,
        algorithm,
        input,
        residual,
        weight,
        residual_out=residual_out,
        norm_out=norm_out,
        quant_out=quant_out,
        scale_out=scale_out,
        scale=global_scale,
        layout=layout,
        eps=eps,
        weight_bias=weight_bias,
        fp32_acc=fp32_acc,
        use_pdl=use_pdl,
    )


@allreduce_residual_rmsnorm_nvfp4_op.register_fake
def _(
    input,
    residual,
    weight,
    global_scale,
    residual_out,
    norm_out,
    quant_out,
    scale_out,
    workspace_id,
    eps,
    weight_bias,
    layout,
    fp32_acc,
    algorithm,
    use_pdl,
    backend,
):
    return None
