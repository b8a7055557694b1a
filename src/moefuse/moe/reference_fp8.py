"""PyTorch reference of block-scaled FP8 (W8A8) matrix products: ``fp8_linear`` and the FP8
routed experts of ``moe_experts`` (spec: Block-scaled FP8 products).

A weight ``W`` [N, K] is stored as E4M3 codes with one scale per block of 128 x 128 (``scale_inv``
[ceil(N/128), ceil(K/128)], FP32 or UE8M0 ``float8_e8m0fnu``; the last block row / column may be
partial). The activation row is quantized per 128-channel group with the formula of
:func:`moefuse.quant.reference.per_token_group_quant_8bit_reference` (eps 1e-10, E4M3, FP32
scales). Per output element::

    y[n] = sum over K-blocks b of  dot_b(xq, Wq[n]) * xs[b] * Ws[n // 128, b]

The kernels compute ``dot_b`` in FP32 in an order fixed by their tile; here every product and
sum is FP64 (the dequantized operands ``xq * xs`` and ``Wq * Ws`` multiplied in FP64: each
``dot_b`` is exact, the scale products are 28-bit, so the FP64 result is within 2^-50 of the
exact value) and the result is rounded once to FP32. Whole-tensor torch math, runs on CPU.
"""

from __future__ import annotations

import torch

from moefuse.quant.reference import per_token_group_quant_8bit_reference

#: the one block edge the ops accept (weights 128 x 128, activation groups of 128)
BLOCK = 128
#: the group quantization's epsilon (the scale is ``max(amax, eps) / 448``)
GROUP_EPS = 1e-10
SCALE_DTYPES = (torch.float32, torch.float8_e8m0fnu)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def scales_f32(scale: torch.Tensor) -> torch.Tensor:
    """FP32 values of block scales: FP32 as is, UE8M0 bytes ``b`` as ``2^(b - 127)`` (``b = 255``
    is NaN)."""
    return scale.float()


def dequantize_weight_f64(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``Wq * Ws`` in FP64 for ``weight`` [..., N, K] E4M3 and ``scale_inv`` [..., ceil(N/128),
    ceil(K/128)]: element (n, k) takes the scale of block (n // 128, k // 128)."""
    n, k = weight.shape[-2:]
    s = scales_f32(scale_inv).double()
    s = s.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]
    return weight.double() * s


def group_quant_f64(x: torch.Tensor) -> torch.Tensor:
    """``xq * xs`` in FP64: ``x`` [..., K] quantized per token and 128-channel group (E4M3 codes,
    FP32 scales ``max(amax, 1e-10) / 448``, the last group partial) and dequantized exactly."""
    q, s = per_token_group_quant_8bit_reference(x, BLOCK, GROUP_EPS)
    return pre_quantized_f64(q, s)


def pre_quantized_f64(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """``q * s`` in FP64 for codes ``q`` [..., K] and group scales ``s`` [..., ceil(K/128)]."""
    k = q.shape[-1]
    return q.double() * s.double().repeat_interleave(BLOCK, dim=-1)[..., :k]


def block_fp8_matmul_f32(x64: torch.Tensor, w64: torch.Tensor) -> torch.Tensor:
    """``x64 @ w64.T`` in FP64, rounded once to FP32 (operands from :func:`group_quant_f64` and
    :func:`dequantize_weight_f64`)."""
    return (x64 @ w64.transpose(-1, -2)).float()


def fp8_linear_reference(
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    block_size: tuple[int, int] = (BLOCK, BLOCK),
    input_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`moefuse.fp8_linear` in torch, new ``[..., N]`` tensor::

        xq, xs = group_quant(input)      (or input / input_scale as given: codes and scales)
        y[n]   = sum_b dot_b(xq, Wq[n]) * xs[b] * Ws[n // 128, b]     # FP64 here, FP32 result
        out    = cast(y + f32(bias))                                  # one rounding

    ``out_dtype`` defaults to the input's dtype (BF16 where the input is E4M3 codes)."""
    if tuple(block_size) != (BLOCK, BLOCK):
        raise ValueError(
            f"moefuse.fp8_linear: argument 'block_size' must be (128, 128), got {block_size}"
        )
    if input_scale is None:
        x64 = group_quant_f64(input)
        out_dtype = out_dtype or input.dtype
    else:
        x64 = pre_quantized_f64(input, input_scale)
        out_dtype = out_dtype or torch.bfloat16
    y = block_fp8_matmul_f32(x64, dequantize_weight_f64(weight, weight_scale_inv))
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def experts_weights_f64(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_scale: torch.Tensor | None,
    down_scale: torch.Tensor | None,
    interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's ``(W_gate|up [2I, H] stacked: gate rows then up rows, W_down [H, I])`` in
    FP64: FP8 weights dequantized with their block scales (the scale of gate|up row ``r`` of the
    matrix as stored is row ``r // 128`` of its scales, whatever the layout), BF16/FP16 widened.
    ``interleaved``: the stored rows are g0, u0, g1, u1, ...; returned in stacked order."""
    if gate_up_scale is not None:
        # transformers allocates at least two scale rows for a gate|up matrix of fewer than
        # 128 rows; the rows past ceil(2I / 128) are never used
        rows = cdiv(gate_up.shape[0], BLOCK)
        w_gu = dequantize_weight_f64(gate_up, gate_up_scale[:rows])
        w_d = dequantize_weight_f64(down, down_scale)
    else:
        w_gu, w_d = gate_up.double(), down.double()
    if interleaved:
        w_gu = torch.cat([w_gu[0::2], w_gu[1::2]])
    return w_gu, w_d


def quantize_weight_blocks(
    weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-quantize ``weight`` [..., N, K] (any float dtype) for tests and benchmarks with the
    recipe of transformers' FP8 quantizer, also on partial edge blocks: per 128 x 128 block
    ``f = 448 / amax`` (1 for an all-zero block), ``scale_inv = 1 / f`` (UE8M0: rounded up to a
    power of two, and ``f = 1 / scale_inv``), ``q = e4m3(clamp(w * f, +-448))``. Returns
    ``(q [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N/128), ceil(K/128)] scale_dtype)``."""
    from moefuse.quant.reference import pow2_ceil

    n, k = weight.shape[-2:]
    w = weight.float()
    pad = torch.nn.functional.pad(w, (0, cdiv(k, BLOCK) * BLOCK - k, 0, cdiv(n, BLOCK) * BLOCK - n))
    blocks = pad.unflatten(-1, (-1, BLOCK)).unflatten(-3, (-1, BLOCK))  # [.., nb, 128, kb, 128]
    amax = blocks.abs().amax(dim=(-3, -1))
    f = torch.where(amax > 0, 448.0 / torch.where(amax > 0, amax, 1.0), torch.ones_like(amax))
    s = 1.0 / f
    if scale_dtype == torch.float8_e8m0fnu:
        s = pow2_ceil(s)
        f = 1.0 / s
    full = f.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)
    q = (w * full[..., :k]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, s.to(scale_dtype)
