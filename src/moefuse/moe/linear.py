"""Public op of the block-scaled FP8 linear layer: ``fp8_linear`` and ``supports_fp8_linear``.

The dense layers of an FP8 checkpoint (attention projections, shared experts, dense MLPs) with
the W8A8 product of the FP8 routed experts (:mod:`moefuse.moe.reference_fp8`): E4M3 weights with
one scale per 128 x 128 block, the activation quantized per token and 128-channel group inside
the kernel (or given pre-quantized). Validation raises ``ValueError`` naming the argument before
anything is written; ``impl`` follows DESIGN.md.
"""

from __future__ import annotations

import torch

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, kernel_device_reason, resolve_pdl
from moefuse.moe import ops
from moefuse.moe.api import EXTRA_DTYPES, HALF
from moefuse.moe.reference_fp8 import BLOCK, SCALE_DTYPES, cdiv
from moefuse.moe.tiles import LINEAR_FP8_WORKSPACE

FP8 = torch.float8_e4m3fn


def _check_workspace(op, workspace, dev) -> None:
    """A contiguous 1-D int32 tensor (check_tensor: dtype, rank, device, unit stride) of at least
    :data:`LINEAR_FP8_WORKSPACE` elements."""
    v.check_tensor(op, "workspace", workspace, dtypes=(torch.int32,), ndims=(1,), device=dev)
    if workspace.numel() < LINEAR_FP8_WORKSPACE:
        raise ValueError(
            f"moefuse.{op}: argument 'workspace' must hold at least {LINEAR_FP8_WORKSPACE} int32 "
            f"zeros, got shape {tuple(workspace.shape)}"
        )


def _check_linear(
    op, x, weight, scale, bias, block_size, input_scale, out, workspace=None
) -> tuple[int, int, int]:
    """Validate; returns (M, N, K) with M the product of the input's leading dims."""
    v.check_tensor(op, "weight", weight, dtypes=(FP8,), ndims=(2,))
    dev = weight.device
    n, k = weight.shape
    if not isinstance(block_size, (tuple, list)) or tuple(block_size) != (BLOCK, BLOCK):
        raise ValueError(
            f"moefuse.{op}: argument 'block_size' must be (128, 128) (the one measured weight "
            f"block), got {block_size!r}"
        )
    v.check_tensor(op, "weight_scale_inv", scale, dtypes=SCALE_DTYPES,
                   shape=(cdiv(n, BLOCK), cdiv(k, BLOCK)), device=dev,
                   last_dim_contiguous=False)  # fmt: skip
    if input_scale is None:
        v.check_tensor(op, "input", x, dtypes=HALF, ndims=(1, 2, 3), device=dev)
    else:
        v.check_tensor(op, "input", x, dtypes=(FP8,), ndims=(1, 2, 3), device=dev)
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(
            f"moefuse.{op}: argument 'input' must be [..., K] with K = {k} (the weight's "
            f"columns), got {tuple(x.shape)}"
        )
    lead = tuple(x.shape[:-1])
    m = 1
    for d in lead:
        m *= d
    v.check_rows_addressable(op, "input", x)
    if input_scale is not None:
        v.check_tensor(op, "input_scale", input_scale, dtypes=(torch.float32,),
                       shape=(*lead, cdiv(k, BLOCK)), device=dev)  # fmt: skip
    out_dtypes = HALF if input_scale is not None else (x.dtype,)
    if bias is not None:
        v.check_tensor(op, "bias", bias, dtypes=EXTRA_DTYPES, shape=(n,), device=dev)
    if workspace is not None:
        _check_workspace(op, workspace, dev)
    if out is not None:
        v.check_tensor(op, "out", out, dtypes=out_dtypes, shape=(*lead, n), device=dev)
        v.check_rows_addressable(op, "out", out)
        for name, t in (
            ("input", x),
            ("weight", weight),
            ("weight_scale_inv", scale),
            ("bias", bias),
            ("input_scale", input_scale),
            ("workspace", workspace),
        ):
            if t is not None:
                v.check_no_overlap(op, "out", out, name, t)
    return m, n, k


def _kernel_reason(x, m, n, k) -> str | None:
    reason = kernel_device_reason(x.device)
    if reason is not None:
        return reason
    return None


@fast_op
@v.checked(writes=("out",))
def fp8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] = (BLOCK, BLOCK),
    input_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Block-scaled FP8 linear layer ``out = input @ W.T (+ bias)`` (spec: fp8_linear)::

        xq, xs = group_quant(x_m)       # per token, groups of 128 channels, eps 1e-10 (the
                                        # formula of per_token_group_quant_8bit)
        y[n]   = sum over K-blocks b of dot_b(xq, Wq[n]) * xs[b] * Ws[n // 128, b]    # FP32
        out    = cast(y + f32(bias[n]))                                            # one rounding

    ``input`` [..., K] BF16/FP16, or E4M3 codes with ``input_scale`` [..., ceil(K/128)] FP32
    (pre-quantized, e.g. by a norm + group-quant fusion); ``weight`` [N, K] ``float8_e4m3fn``,
    ``weight_scale_inv`` [ceil(N/128), ceil(K/128)] FP32 or ``float8_e8m0fnu`` (the last block
    row / column may be partial), ``block_size`` (128, 128) only; ``bias`` [N] BF16/FP16/FP32;
    ``out`` [..., N] in the input's dtype (given pre-quantized input: ``out``'s dtype, BF16 when
    ``out`` is None), allocated when None, never aliasing an input. ``workspace``: optional
    contiguous int32 zeros, at least 132 of them (``tiles.LINEAR_FP8_WORKSPACE``), that a launch
    whose K chunks run as programs of their own may count its tiles in (the tile's last program
    then adds the chunk sums, no second launch; ``tiles.LINEAR_FP8_FUSED_REDUCE``); every launch
    leaves it zeroed, so one workspace serves every call of one stream in turn (not two streams
    at once). No bit depends on it; it is not read on the host, so a workspace that does not hold
    zeros (not from ``torch.zeros``, or shared by two streams at once) gives wrong outputs.

    Determinism: ``dot_b`` is the FP32 sum of a 128-block's products in an order fixed by the
    kernel's tile and the blocks are summed in an order fixed by (N, K), never by M, so a row's
    bits do not depend on the batch. ``impl="reference"`` runs
    :func:`moefuse.moe.reference_fp8.fp8_linear_reference` (FP64 dots). Returns ``out``.
    """
    op = "fp8_linear"
    m, n, k = _check_linear(
        op, input, weight, weight_scale_inv, bias, block_size, input_scale, out, workspace
    )
    if out is None:
        dtype = input.dtype if input_scale is None else torch.bfloat16
        out = torch.empty(*input.shape[:-1], n, dtype=dtype, device=input.device)
    if m == 0 or n == 0:
        return out
    reason = _kernel_reason(input, m, n, k)
    backend = choose_impl(op, impl, input.device, reason)
    use_pdl = backend == "triton" and resolve_pdl(enable_pdl, input.device)
    x2 = input.reshape(m, k)
    xs2 = input_scale.reshape(m, -1) if input_scale is not None else None
    ops.fp8_linear_op(
        x2, weight, weight_scale_inv, bias, xs2, out.view(m, n), workspace, use_pdl, backend
    )
    return out


def supports_fp8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] = (BLOCK, BLOCK),
    input_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
) -> bool:
    """True when the Triton kernel can run these arguments on their device (no side effects)."""
    try:
        dims = _check_linear(
            "fp8_linear",
            input,
            weight,
            weight_scale_inv,
            bias,
            block_size,
            input_scale,
            out,
            workspace,
        )
    except ValueError:
        return False
    return _kernel_reason(input, *dims) is None
