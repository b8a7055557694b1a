"""PyTorch reference of the all-reduce fusions (the spec's all-reduce fusion) — the oracle and the
CPU path.

Two layers:

* ``*_from_partials(partials, ...)`` is the math of the spec's all-reduce fusion given every rank's
  partial input (a list in rank order): the tests' oracle, and what the kernels must reproduce bit
  for bit on
  ``residual_out`` (and on ``allreduce_out``).
* ``*_reference(input, ..., workspace=...)`` has the public op's signature: it all-gathers the
  partials over ``workspace.group`` with plain ``torch.distributed`` and applies the math. It is
  the ``impl="reference"`` path and never touches the peer buffers.

Math per token (T = activation dtype)::

    s = T(x_0 + x_1 + ... + x_{P-1})   FP32 running sum from +0.0 in rank order, one rounding
                                       (fp32_acc=False: T-rounded after every add)
    h = T(f32(s) + f32(residual))      residual_out
    n = T((f32(h) * r) * (f32(weight) + weight_bias)),  r = 1/sqrt(mean(f32(h)^2) + eps)
    FP8:   q = e4m3(f32(n) * (1/scale))                       (IEEE 1/scale, once)
    NVFP4: q, sf = nvfp4(n, gs = global_scale, recipe "ieee", layout)

The norm is :func:`moefuse.norm.reference.rmsnorm_reference` applied to the ROUNDED h (FP64 row
sum, exact 1/sqrt), and the quantizers are :mod:`moefuse.quant.reference`, so the comm references
are literally "unfused reference ops in sequence".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moefuse.comm.fallback import gather_partials  # noqa: F401 (also public here)
from moefuse.norm import reference as norm_ref
from moefuse.quant import reference as quant_ref


def rank_sum(partials: Sequence[torch.Tensor], fp32_acc: bool = True) -> torch.Tensor:
    """``T(sum_r x_r)`` in ascending rank order from +0.0 (FP32, or T-stepwise)."""
    dtype = partials[0].dtype
    acc = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for x in partials:
        acc = acc + x.float()
        if not fp32_acc:
            acc = acc.to(dtype).float()
    return acc.to(dtype)


def allreduce_from_partials(partials, fp32_acc: bool = True) -> torch.Tensor:
    return rank_sum(partials, fp32_acc)


def allreduce_residual_rmsnorm_from_partials(
    partials, residual, weight, eps: float = 1e-6, weight_bias: float = 0.0, fp32_acc: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(residual_out, norm_out)``."""
    s = rank_sum(partials, fp32_acc)
    h = (s.float() + residual.float()).to(s.dtype)
    return h, norm_ref.rmsnorm_reference(h, weight, eps, weight_bias)


def allreduce_residual_rmsnorm_fp8_from_partials(
    partials, residual, weight, scale, eps=1e-6, weight_bias=0.0, fp32_acc=True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(residual_out, norm_out, quant_out float8_e4m3fn)``."""
    h, n = allreduce_residual_rmsnorm_from_partials(
        partials, residual, weight, eps, weight_bias, fp32_acc
    )
    return h, n, quant_ref.fp8_quantize_reference(n, scale)


def allreduce_residual_rmsnorm_nvfp4_from_partials(
    partials,
    residual,
    weight,
    global_scale,
    layout="swizzled_128x4",
    eps=1e-6,
    weight_bias=0.0,
    fp32_acc=True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(residual_out, norm_out, packed [M, H/2] uint8, scales uint8)`` (recipe "ieee")."""
    h, n = allreduce_residual_rmsnorm_from_partials(
        partials, residual, weight, eps, weight_bias, fp32_acc
    )
    packed, scales = quant_ref.fp4_quantize_reference(n, global_scale, layout, recipe="ieee")
    return h, n, packed, scales


# ----------------------------------------------------------------------------- collective
def allreduce_reference(input, *, workspace, fp32_acc: bool = True) -> torch.Tensor:
    return allreduce_from_partials(gather_partials(input, workspace), fp32_acc)


def allreduce_residual_rmsnorm_reference(
    input, residual, weight, *, workspace, eps=1e-6, weight_bias=0.0, fp32_acc=True
) -> tuple[torch.Tensor, torch.Tensor]:
    return allreduce_residual_rmsnorm_from_partials(
        gather_partials(input, workspace), residual, weight, eps, weight_bias, fp32_acc
    )


def allreduce_residual_rmsnorm_fp8_reference(
    input, residual, weight, scale, *, workspace, eps=1e-6, weight_bias=0.0, fp32_acc=True
):
    return allreduce_residual_rmsnorm_fp8_from_partials(
        gather_partials(input, workspace), residual, weight, scale, eps, weight_bias, fp32_acc
    )


def allreduce_residual_rmsnorm_nvfp4_reference(
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
):
    return allreduce_residual_rmsnorm_nvfp4_from_partials(
        gather_partials(input, workspace),
        residual,
        weight,
        global_scale,
        layout,
        eps,
        weight_bias,
        fp32_acc,
    )
