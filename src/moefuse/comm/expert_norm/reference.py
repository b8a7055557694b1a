"""PyTorch reference of the per-expert-norm MoE finalize fusions (spec: tp_moe_finalize_rmsnorm,
moe_finalize_rmsnorm_allreduce) — the oracle.

Two layers, like :mod:`moefuse.comm.all_reduce.reference`:

* ``*_from_ranks(...)`` is the math given every rank's inputs (lists in rank order): the tests'
  oracle, runnable in one process on CPU.
* ``*_reference(..., workspace=...)`` has the public op's signature: it all-gathers what the math
  needs with plain ``torch.distributed`` and applies the math (the ``impl="reference"`` path; it
  never touches peer buffers).

TP (tp_moe_finalize_rmsnorm), per token t, slot k valid (``0 <= idx[t, k] < R``; invalid rows are
never read)::

    x_k = f32(bf16(sum_r f32(partial_r[idx[t, k], :H])))        FP32 rank order from +0.0
    g   = f32(norm_weight) + gain_center
    y_k = (x_k*g) * rsqrt(mean_sq(x_k*g) + eps)        if weight_before_norm
        = (x_k * rsqrt(mean_sq(x_k) + eps)) * g        otherwise
    out = sum_{groups j asc} ( sum_{k in group j asc} y_k * f32(w[t, k]) )     FP32 from +0.0
    output[t] = bf16(out), -0.0 written as +0.0

with groups of ``B = ceil(K / P)`` slots (:func:`group_size`): the association depends on K and P
only, never on M. Each ``acc + y*w`` is one fused multiply-add (single rounding), emulated here in
FP64 (the product of two FP32 values is exact there).

EP (moe_finalize_rmsnorm_allreduce), per rank, local slots only (non-local slots are invalid here
and skipped)::

    partial_r[t] = scrub(bf16(sum_{k asc, valid} y_k * f32(w[t, k])))     FP32 fma chain from +0.0
    output[t]    = bf16(sum_{r asc} f32(partial_r[t]))                     FP32 from +0.0

Row statistics use :func:`moefuse.norm.reference.inv_rms` (FP64 sum, exact 1/sqrt).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moefuse.norm import reference as norm_ref


def group_size(top_k: int, world_size: int) -> int:
    """The canonical slot group size ``B = ceil(K / P)`` (the spec's tp_moe_finalize_rmsnorm)."""
    return -(-top_k // world_size)


def scrub_neg_zero(t: torch.Tensor) -> torch.Tensor:
    """-0.0 -> +0.0 (what every Lamport transport does; the sign of a zero is not kept)."""
    return torch.where(t == 0, torch.zeros_like(t), t)


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a*b + c`` with one rounding to FP32 (FP64 product is exact; the FP64 sum's own rounding
    can differ from a true FMA only on an FP32 midpoint, probability ~2^-29)."""
    return (a.double() * b.double() + c.double()).float()


def expert_norm(
    x32: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
) -> torch.Tensor:
    """Per-expert RMSNorm of FP32 rows ``x32`` [N, H] -> FP32 ``y`` (no rounding)."""
    g = norm_ref.gain(weight, gain_center)
    if weight_before_norm:
        z = x32 * g
        return z * norm_ref.inv_rms(z, eps)
    return (x32 * norm_ref.inv_rms(x32, eps)) * g


def _valid(idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    return (idx >= 0) & (idx < num_rows)


def _weighted_groups(
    y: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor, block: int
) -> torch.Tensor:
    """``sum_{groups asc} (fma chain over the group's valid slots)`` of ``y`` [M, K, H]."""
    m, k, h = y.shape
    w = weights.float()
    out = torch.zeros(m, h, dtype=torch.float32, device=y.device)
    for j0 in range(0, k, block):
        acc = torch.zeros(m, h, dtype=torch.float32, device=y.device)
        for kk in range(j0, min(k, j0 + block)):
            nxt = fma_f32(y[:, kk], w[:, kk : kk + 1], acc)
            acc = torch.where(valid[:, kk : kk + 1], nxt, acc)  # invalid: weight never used
        out = out + acc
    return out


def _slot_rows(rows_of_rank: Sequence[torch.Tensor], idx: torch.Tensor, hidden: int):
    """(valid [M, K], FP32 rank-order sum of the valid slots' rows rounded once to BF16 and
    widened, scattered into [M, K, H] with zeros at invalid slots)."""
    m, k = idx.shape
    valid = _valid(idx, rows_of_rank[0].shape[0])
    x = torch.zeros(m, k, hidden, dtype=torch.float32, device=idx.device)
    sel = idx[valid].long()
    if sel.numel():
        acc = torch.zeros(sel.numel(), hidden, dtype=torch.float32, device=idx.device)
        for rows in rows_of_rank:
            acc = acc + rows[sel, :hidden].float()
        x[valid] = acc.to(torch.bfloat16).float()
    return valid, x


# --------------------------------------------------------------------- tp_moe_finalize_rmsnorm (TP)
def tp_moe_finalize_rmsnorm_from_ranks(
    partials: Sequence[torch.Tensor],
    expert_weights: torch.Tensor,
    idx: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
    block: int | None = None,
) -> torch.Tensor:
    """``partials``: every rank's GEMM2 rows ``[R, >=H]`` (rank order). ``block``: slot group size
    (default ``ceil(K / P)``; ``K`` gives plain ascending order). Returns BF16 ``[M, H]``."""
    h = norm_weight.shape[0]
    m, k = idx.shape
    block = group_size(k, len(partials)) if block is None else block
    valid, x = _slot_rows(partials, idx, h)
    y = torch.zeros_like(x)
    if valid.any():
        y[valid] = expert_norm(x[valid], norm_weight, eps, gain_center, weight_before_norm)
    out = _weighted_groups(y, valid, expert_weights, block)
    return scrub_neg_zero(out.to(torch.bfloat16))


# -------------------------------------------------------------- moe_finalize_rmsnorm_allreduce (EP)
def ep_local_partial(
    routed_rows: torch.Tensor,
    route_weights: torch.Tensor,
    idx: torch.Tensor,
    norm_weight: torch.Tensor,
    *,
    eps: float,
    gain_center: float,
    weight_before_norm: bool,
) -> torch.Tensor:
    """This rank's BF16 partial ``[M, H]`` (local routes only, -0.0 scrubbed)."""
    h = norm_weight.shape[0]
    valid, x = _slot_rows([routed_rows], idx, h)  # one rank: the "sum" is the row itself
    y = torch.zeros_like(x)
    if valid.any():
        y[valid] = expert_norm(x[valid], norm_weight, eps, gain_center, weight_before_norm)
    out = _weighted_groups(y, valid, route_weights, max(1, idx.shape[1]))
    return scrub_neg_zero(out.to(torch.bfloat16))


def moe_finalize_rmsnorm_allreduce_from_ranks(
    routed_rows: Sequence[torch.Tensor],
    route_weights: Sequence[torch.Tensor],
    idx: Sequence[torch.Tensor],
    norm_weight: torch.Tensor,
    *,
    eps: float,
    gain_center: float = 0.0,
    weight_before_norm: bool = True,
) -> torch.Tensor:
    """Lists in rank order (each rank's local rows, weights and index map). BF16 ``[M, H]``."""
    parts = [
        ep_local_partial(
            rows,
            w,
            i,
            norm_weight,
            eps=eps,
            gain_center=gain_center,
            weight_before_norm=weight_before_norm,
        )
        for rows, w, i in zip(routed_rows, route_weights, idx)
    ]
    acc = torch.zeros(parts[0].shape, dtype=torch.float32, device=parts[0].device)
    for p in parts:
        acc = acc + p.float()
    return acc.to(torch.bfloat16)


# ----------------------------------------------------------------------------- collective
def _gather(t: torch.Tensor, group, world_size: int) -> list[torch.Tensor]:
    import torch.distributed as dist

    x = t.contiguous()
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x, group=group)
    return parts


def tp_moe_finalize_rmsnorm_reference(
    gemm2_permuted,
    expert_weights,
    idx,
    norm_weight,
    *,
    group,
    world_size,
    eps,
    gain_center,
    weight_before_norm,
) -> torch.Tensor:
    """All-gathers every rank's rows (first H columns) and applies the tp_moe_finalize_rmsnorm
    math."""
    h = norm_weight.shape[0]
    partials = _gather(gemm2_permuted[:, :h], group, world_size)
    return tp_moe_finalize_rmsnorm_from_ranks(
        partials,
        expert_weights,
        idx,
        norm_weight,
        eps=eps,
        gain_center=gain_center,
        weight_before_norm=weight_before_norm,
    )


def moe_finalize_rmsnorm_allreduce_reference(
    routed_rows,
    route_weights,
    idx,
    norm_weight,
    *,
    group,
    world_size,
    eps,
    gain_center=0.0,
    weight_before_norm=True,
) -> torch.Tensor:
    """Local partial, all-gathered, summed in rank order (FP32), one rounding."""
    part = ep_local_partial(
        routed_rows,
        route_weights,
        idx,
        norm_weight,
        eps=eps,
        gain_center=gain_center,
        weight_before_norm=weight_before_norm,
    )
    acc = torch.zeros(part.shape, dtype=torch.float32, device=part.device)
    for p in _gather(part, group, world_size):
        acc = acc + p.float()
    return acc.to(torch.bfloat16)
