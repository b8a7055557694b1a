"""FlashInfer's deterministic finalize signature mapped onto :func:`moefuse.moe_finalize`.

FlashInfer: ``flashinfer.fused_moe.cute_dsl.blackwell.moe_finalize.moe_unpermute`` (PR #5319).
Differences (moefuse is wider, never narrower): BF16 *and* FP16, any H (not only H % 8 == 0),
row-strided tensors, SM90+, a CPU reference; slots are invalid when negative *or* >= the number
of rows (spec: Slots and index maps); argument errors are ``ValueError`` naming the argument.
"""

from __future__ import annotations

import torch

from moefuse.moe.api import moe_finalize


def moe_unpermute(
    permuted_input: torch.Tensor,
    output: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    topk_scales: torch.Tensor,
    num_tokens: int,
    top_k: int,
    enable_pdl: bool = False,
    input_is_expanded: bool = False,
) -> None:
    """Writes ``output[:num_tokens]`` = deterministic finalize of the first ``num_tokens`` rows of
    ``expanded_idx_to_permuted_idx`` / ``topk_scales`` ([>= num_tokens, top_k] each); rows of
    ``output`` from ``num_tokens`` on are not written. Returns None, like FlashInfer."""
    op = "moe_unpermute"
    for name, value, low in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(
                f"moefuse.{op}: argument '{name}' must be an int >= {low}, got {value!r}"
            )
    for name, t in (
        ("expanded_idx_to_permuted_idx", expanded_idx_to_permuted_idx),
        ("topk_scales", topk_scales),
        ("output", output),
    ):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] < num_tokens:
            raise ValueError(
                f"moefuse.{op}: argument '{name}' must be a 2-D tensor with at "
                f"least num_tokens = {num_tokens} rows"
            )
    for name, t in (
        ("expanded_idx_to_permuted_idx", expanded_idx_to_permuted_idx),
        ("topk_scales", topk_scales),
    ):
        if t.shape[1] != top_k:
            raise ValueError(
                f"moefuse.{op}: argument '{name}' must have top_k = {top_k} "
                f"columns, got {t.shape[1]}"
            )
    moe_finalize(
        permuted_input,
        expanded_idx_to_permuted_idx[:num_tokens],
        topk_scales[:num_tokens],
        out=output[:num_tokens],
        input_is_expanded=bool(input_is_expanded),
        enable_pdl=bool(enable_pdl),
    )
