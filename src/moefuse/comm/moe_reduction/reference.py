"""PyTorch reference of the MoE-reduction family (the spec's MoE-reduction and MoE-finalize
all-reduce fusions) — the oracle and the CPU path.

Both ops are "a per-rank MoE partial row, all-reduced, then the all-reduce fusion's epilogue". Two
layers, as in :mod:`moefuse.comm.all_reduce.reference`:

* ``*_from_ranks(...)`` take every rank's MoE inputs as lists in rank order (all in one process):
  the tests' oracle;
* ``*_reference(..., workspace=...)`` have the public ops' signatures: each rank computes its own
  partial, the partials are all-gathered with plain ``torch.distributed`` and the same math runs.

Partial of one rank, per token t (T = activation dtype), ``accumulate="stepwise"`` (default,
TRT-LLM / FlashInfer semantics, T-rounding after every step)::

    acc = T(0)
    for k ascending, valid slots only (rows behind invalid slots are never read):
        acc = T(f32(acc) + f32(T(f32(row_k) * f32(w_k))))     # T(acc + row_k) without weights
    if rsf != 1: acc = T(f32(acc) * rsf)
    if shared:   acc = T(f32(acc) + f32(shared[t]))

``accumulate="fp32"`` (the MNNVL CuTe-DSL contract): the deterministic finalize of the spec's
moe_finalize —
``acc = fma_ftz(f32(row_k), f32(w_k), acc)`` in FP32, ``* rsf``, ``+ f32(shared)``, one rounding
(exactly :func:`moefuse.moe.reference.moe_finalize_reference`).

All-reduce and epilogue::

    stepwise: s = T-stepwise rank-order sum of the partials from +0.0; h = T(f32(s) + f32(res))
    fp32:     s = FP32 rank-order sum from +0.0 (not rounded);  h = T(s + f32(res))   (one rounding)
    allreduce_out = T(s);  residual_out = h;  norm_out = T((h * r) * (f32(weight) + weight_bias))
    FP8:   quant_out = e4m3(f32(norm_out) * (1/scale))          (IEEE 1/scale)
    NVFP4: quant_out, scale_out = nvfp4(norm_out, gs = scale, recipe "fast", layout)

For the MoE reduction the "rows" of token t are ``x[e, t]`` for every local expert e (all valid),
the weights ``scale[e, t]`` and the "shared" term is the token input; rsf = 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moefuse.comm.fallback import gather_partials
from moefuse.moe import reference as moe_ref
from moefuse.norm import reference as norm_ref
from moefuse.quant import reference as quant_ref

ACCUMULATE = ("stepwise", "fp32")
QUANTS = (None, "fp8", "nvfp4")


# ----------------------------------------------------------------------------- partial of one rank
def _stepwise(rows, valid, weights, rsf, shared, dtype, bias_rows=None) -> torch.Tensor:
    """``rows`` [K, M, H] (any values where invalid), ``valid`` [M, K] bool, ``weights`` [M, K]
    or None, ``shared`` [M, H] or None, ``bias_rows`` [K, M, H] FP32 (0 where no bias) or None
    -> T-stepwise partial [M, H]."""
    k_slots, m, h = rows.shape
    acc = torch.zeros(m, h, dtype=torch.float32, device=rows.device)
    for k in range(k_slots):
        x = rows[k].float()
        if bias_rows is not None:
            x = x + bias_rows[k]
        if weights is not None:
            x = (x * weights[:, k : k + 1].float()).to(dtype).float()
        acc = torch.where(valid[:, k : k + 1], (acc + x).to(dtype).float(), acc)
    if rsf != 1.0:
        acc = (acc * torch.tensor(rsf, dtype=torch.float32)).to(dtype).float()
    if shared is not None:
        acc = (acc + shared.float()).to(dtype).float()
    return acc.to(dtype)


def finalize_partial(
    allreduce_in,
    expanded_idx_to_permuted_idx,
    expert_scale_factor=None,
    routed_scaling_factor=1.0,
    shared_expert_output=None,
    accumulate="stepwise",
    bias=None,
    expert_ids=None,
) -> torch.Tensor:
    """One rank's MoE-finalize partial [M, H] (the spec's MoE-finalize fusion) from the permuted
    rows [R, H].

    ``bias`` [E, H] with ``expert_ids`` [M, K] (moefuse extension, as the spec's moe_finalize): the
    expert's bias row is added to the slot's row in FP32 before the weight, not rounded in between
    (ids outside [0, E) add nothing): stepwise ``T((f32(row) + f32(bias)) * w)``, fp32 mode
    ``fma_ftz(f32(row) + f32(bias), w, acc)``."""
    idx = expanded_idx_to_permuted_idx
    m, k = idx.shape
    if accumulate == "fp32":
        w = expert_scale_factor
        if w is None:
            w = torch.ones(m, k, dtype=torch.float32, device=allreduce_in.device)
        return moe_ref.moe_finalize_reference(
            allreduce_in,
            idx,
            w,
            routed_scaling_factor=float(routed_scaling_factor),
            shared_expert_output=shared_expert_output,
            bias=bias,
            expert_ids=expert_ids,
        )
    rows, valid = moe_ref.slot_rows(idx, allreduce_in.shape[0], False)
    if allreduce_in.shape[0] == 0:
        valid = torch.zeros_like(valid)
        gathered = torch.zeros(k, m, allreduce_in.shape[1], dtype=allreduce_in.dtype)
    else:
        gathered = allreduce_in.index_select(0, rows.t().reshape(-1)).view(k, m, -1)
    bias_rows = None
    if bias is not None:
        e = expert_ids.long()
        has_b = (e >= 0) & (e < bias.shape[0])
        b = bias.index_select(0, torch.where(has_b, e, 0).t().reshape(-1)).float()
        bias_rows = torch.where(has_b.t().reshape(-1, 1), b, 0.0).view(k, m, -1)
    return _stepwise(
        gathered,
        valid,
        expert_scale_factor,
        float(routed_scaling_factor),
        shared_expert_output,
        allreduce_in.dtype,
        bias_rows,
    )


def reduction_partial(
    active_experts_token_input, scale_input, token_input, accumulate="stepwise"
) -> torch.Tensor:
    """One rank's MoE-reduction partial [M, H] (the spec's MoE-reduction fusion): experts [E, M, H],
    FP32 scales [E, M], token input [M, H]."""
    x = active_experts_token_input
    e, m, h = x.shape
    w = scale_input.reshape(e, m).t()  # [M, E]
    if accumulate == "fp32":
        rows = x.permute(1, 0, 2).reshape(m * e, h)  # token-major: row t*E + e
        idx = torch.arange(m * e, dtype=torch.int32, device=x.device).view(m, e)
        return moe_ref.moe_finalize_reference(rows, idx, w, shared_expert_output=token_input)
    valid = torch.ones(m, e, dtype=torch.bool, device=x.device)
    return _stepwise(x, valid, w, 1.0, token_input, x.dtype)


# ------------------------------------------------------------------------- all-reduce + epilogue
def epilogue_from_partials(
    partials: Sequence[torch.Tensor],
    residual,
    weight,
    eps=1e-6,
    weight_bias=0.0,
    accumulate="stepwise",
    quant=None,
    scale_factor=None,
    layout="swizzled_128x4",
) -> dict:
    """Rank-order sum of the partials and the epilogue. Returns a dict with ``allreduce_out``,
    ``residual_out``, ``norm_out`` and, when quantizing, ``quant_out`` (FP8: float8_e4m3fn; NVFP4:
    packed uint8 [M, H/2]) and ``scale_out`` (NVFP4)."""
    dtype = partials[0].dtype
    acc = torch.zeros(partials[0].shape, dtype=torch.float32, device=partials[0].device)
    for p in partials:
        acc = acc + p.float()
        if accumulate == "stepwise":
            acc = acc.to(dtype).float()
    h = (acc + residual.float()).to(dtype)
    n = norm_ref.rmsnorm_reference(h, weight, eps, weight_bias)
    out = {"allreduce_out": acc.to(dtype), "residual_out": h, "norm_out": n}
    if quant == "fp8":
        out["quant_out"] = quant_ref.fp8_quantize_reference(n, scale_factor)
    elif quant == "nvfp4":
        out["quant_out"], out["scale_out"] = quant_ref.fp4_quantize_reference(
            n, scale_factor, layout, recipe="fast"
        )
    return out


def moe_finalize_allreduce_from_ranks(
    allreduce_ins,
    expanded_idx_to_permuted_idx,
    residual,
    weight,
    *,
    expert_scale_factors=None,
    routed_scaling_factor=1.0,
    shared_expert_outputs=None,
    eps=1e-6,
    weight_bias=0.0,
    accumulate="stepwise",
    quant=None,
    scale_factor=None,
    layout="swizzled_128x4",
    biases=None,
    expert_ids=None,
) -> dict:
    """The spec's MoE-finalize fusion with every rank's inputs (lists in rank order;
    ``expanded_idx_to_permuted_idx`` may be one tensor for all ranks or a list). See
    :func:`epilogue_from_partials`."""
    p = len(allreduce_ins)
    maps = expanded_idx_to_permuted_idx
    maps = maps if isinstance(maps, (list, tuple)) else [maps] * p
    ws = (
        expert_scale_factors
        if isinstance(expert_scale_factors, (list, tuple))
        else [expert_scale_factors] * p
    )
    sh = shared_expert_outputs if shared_expert_outputs is not None else [None] * p
    bs = biases if biases is not None else [None] * p
    partials = [
        finalize_partial(
            allreduce_ins[r],
            maps[r],
            ws[r],
            routed_scaling_factor,
            sh[r],
            accumulate,
            bs[r],
            expert_ids,
        )
        for r in range(p)
    ]
    return epilogue_from_partials(
        partials, residual, weight, eps, weight_bias, accumulate, quant, scale_factor, layout
    )


def moe_allreduce_from_ranks(
    active_experts_token_inputs,
    scale_inputs,
    token_inputs,
    residual,
    weight,
    *,
    eps=1e-6,
    weight_bias=0.0,
    accumulate="stepwise",
    quant=None,
    scale_factor=None,
    layout="swizzled_128x4",
) -> dict:
    """The spec's MoE-reduction fusion with every rank's inputs (lists in rank order)."""
    partials = [
        reduction_partial(x, s, t, accumulate)
        for x, s, t in zip(active_experts_token_inputs, scale_inputs, token_inputs)
    ]
    return epilogue_from_partials(
        partials, residual, weight, eps, weight_bias, accumulate, quant, scale_factor, layout
    )


# ----------------------------------------------------------------------------- collective
def reference_from_partial(partial, residual, weight, *, workspace, **kw) -> dict:
    """This rank's ``partial`` all-gathered (torch.distributed), then the epilogue."""
    return epilogue_from_partials(gather_partials(partial, workspace), residual, weight, **kw)
