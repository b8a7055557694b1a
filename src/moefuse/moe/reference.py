"""PyTorch reference of the MoE finalize family (spec: MoE) — the oracle and the CPU path.

Everything here is whole-tensor torch math (no Python loop over tokens or columns), so the same
functions check the GPU kernels at full shapes in seconds. The functions are functional: they
return new tensors; the public ops copy results into caller-provided outputs.

``fma_ftz_f32`` emulates PTX ``fma.rn.ftz.f32`` bit for bit (spec: moe_finalize): subnormal inputs
flushed to ±0, exact FP64 product, FP64 sum made round-to-odd from its TwoSum error (equivalent to
the spec's midpoint correction, and also right on the subnormal FP32 grid), one FP32 RNE rounding,
subnormal result flushed to ±0.
"""

from __future__ import annotations

import torch

FP32_MIN_NORMAL = 2.0**-126
#: tokens per chunk are chosen so a chunk holds about this many elements (keeps FP64 temporaries
#: cache-sized: the big GPU test shapes would otherwise allocate GiBs per temporary)
_CHUNK_ELEMENTS = 1 << 18


def flush_subnormal_f32(x: torch.Tensor) -> torch.Tensor:
    """FP32 subnormals (|x| < 2^-126, nonzero) replaced by a zero of the same sign."""
    return torch.where(x.abs() < FP32_MIN_NORMAL, torch.copysign(torch.zeros_like(x), x), x)


def fma_ftz_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Bit-exact ``fma.rn.ftz.f32(a, b, c)`` of FP32 tensors (broadcasting), FP32 result."""
    a = flush_subnormal_f32(a.float()).double()
    b = flush_subnormal_f32(b.float()).double()
    c = flush_subnormal_f32(c.float()).double()
    p = a * b  # exact: two 24-bit significands fit in 53 bits, FP32 exponents cannot overflow FP64
    s = p + c
    bv = s - p
    err = (p - (s - bv)) + (c - bv)  # TwoSum: s + err == p + c exactly (s finite)
    bits = s.view(torch.int64)
    sticky = (err != 0) & ((bits & 1) == 0) & torch.isfinite(s)
    away = (err > 0) == (s > 0)
    step = torch.where(away, 1, -1).to(torch.int64)
    bits = torch.where(sticky, bits + step, bits)
    return flush_subnormal_f32(bits.view(torch.float64).float())


def slot_rows(
    expanded_idx_to_permuted_idx: torch.Tensor, num_rows: int, input_is_expanded: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [M, K] int64, valid [M, K] bool)`` per spec: Slots and index maps.

    Mapped mode: row = map[t, k], valid when 0 <= row < num_rows. Expanded mode: row = t*K + k and
    the map is only a mask (valid when map[t, k] >= 0).
    """
    idx = expanded_idx_to_permuted_idx.long()
    m, k = idx.shape
    if input_is_expanded:
        rows = torch.arange(m * k, device=idx.device, dtype=torch.int64).view(m, k)
        return rows, idx >= 0
    valid = (idx >= 0) & (idx < num_rows)
    return torch.where(valid, idx, 0), valid


def _finalize_rows(
    permuted_input: torch.Tensor,
    rows: torch.Tensor,
    valid: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    expert_ids: torch.Tensor | None,
    routed_scaling_factor: float,
    shared: torch.Tensor | None,
) -> torch.Tensor:
    """FP32 accumulator [m, H] of one chunk of tokens (before the final rounding)."""
    m, top_k = rows.shape
    h = permuted_input.shape[1]
    acc = torch.zeros(m, h, dtype=torch.float32, device=permuted_input.device)
    if permuted_input.shape[0] == 0:  # no rows: every slot is invalid
        top_k = 0
    w = scales.float()
    for k in range(top_k):  # ascending slot order (spec: moe_finalize)
        v = valid[:, k : k + 1]
        # whole-chunk gather: invalid slots read a stand-in row (rows[] holds 0 there) whose
        # values are discarded by the where() below, so NaN/Inf behind them cannot leak
        x = permuted_input.index_select(0, rows[:, k]).float()
        if bias is not None:
            e = expert_ids[:, k].long()
            has_b = (e >= 0) & (e < bias.shape[0])
            b = bias.index_select(0, torch.where(has_b, e, 0)).float()
            x = torch.where(has_b[:, None], x + b, x)
        acc = torch.where(v, fma_ftz_f32(x, w[:, k : k + 1], acc), acc)
    if routed_scaling_factor != 1.0:
        acc = acc * torch.tensor(routed_scaling_factor, dtype=torch.float32)
    if shared is not None:
        acc = acc + shared.float()
    return acc


def moe_finalize_reference(
    permuted_input: torch.Tensor,
    expanded_idx_to_permuted_idx: torch.Tensor,
    topk_scales: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    expert_ids: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    shared_expert_output: torch.Tensor | None = None,
    input_is_expanded: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Deterministic MoE finalize (spec: moe_finalize), returned as a new ``[M, H]`` tensor::

        acc = +0.0                                              # FP32, per (t, j)
        for k ascending, valid slots only (row never read otherwise):
            x = f32(permuted_input[row(t, k), j])
            if bias: x = x + f32(bias[expert_ids[t, k], j])      # FP32 add; ids outside [0, E)
                                                                # add nothing
            acc = fma_ftz(x, f32(topk_scales[t, k]), acc)
        if routed_scaling_factor != 1: acc = acc * fp32(routed_scaling_factor)
        if shared_expert_output:       acc = acc + f32(shared_expert_output[t, j])
        out[t, j] = cast(acc)                                   # the one rounding (RNE)

    Shapes: ``permuted_input`` [R, H], map / scales / expert_ids [M, K], bias [E, H], shared
    [M, H]. ``out_dtype`` defaults to the dtype of ``permuted_input``.
    """
    m, top_k = expanded_idx_to_permuted_idx.shape
    h = permuted_input.shape[1]
    out_dtype = out_dtype or permuted_input.dtype
    out = torch.empty(m, h, dtype=out_dtype, device=permuted_input.device)
    n_rows = permuted_input.shape[0]
    rows, valid = slot_rows(expanded_idx_to_permuted_idx, n_rows, input_is_expanded)
    # token chunks bound the FP32 intermediate; while torch.compile traces, one chunk: a loop
    # over a symbolic token count would specialise the graph on it (rows are independent, so the
    # bits are the same either way)
    step = max(1, _CHUNK_ELEMENTS // max(1, h))
    if torch.compiler.is_compiling():
        chunks = [slice(0, m)]
    else:
        chunks = [slice(t0, min(m, t0 + step)) for t0 in range(0, m, step)]
    for sl in chunks:
        acc = _finalize_rows(
            permuted_input,
            rows[sl],
            valid[sl],
            topk_scales[sl],
            bias,
            expert_ids[sl] if expert_ids is not None else None,
            routed_scaling_factor,
            shared_expert_output[sl] if shared_expert_output is not None else None,
        )
        out[sl] = acc.to(out_dtype)
    return out


def moe_finalize_scatter_add_reference(
    permuted_input: torch.Tensor,
    permuted_idx_to_expanded_idx: torch.Tensor,
    topk_scales: torch.Tensor,
    *,
    routed_scaling_factor: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Scatter-add finalize (the GEMM-epilogue style), new ``[M, H]`` tensor::

        buf = zeros(M, H) FP32
        for each permuted row p with e = permuted_idx_to_expanded_idx[p] in [0, M*K):
            buf[e // K] += f32(permuted_input[p]) * f32(topk_scales[e // K, e % K])   # FP32
        out = cast(buf * fp32(routed_scaling_factor))   # multiply skipped when 1.0

    The order of the additions into ``buf`` is unspecified (atomics on the GPU), so results may
    differ from :func:`moe_finalize_reference` by FP32 reassociation — this path exists to be
    compared against, not to be bit-reproducible.
    """
    m, top_k = topk_scales.shape
    h = permuted_input.shape[1]
    out_dtype = out_dtype or permuted_input.dtype
    e = permuted_idx_to_expanded_idx.long()
    rows = ((e >= 0) & (e < m * top_k)).nonzero().squeeze(1)
    e = e[rows]
    w = topk_scales.reshape(-1).float()[e]
    buf = torch.zeros(m, h, dtype=torch.float32, device=permuted_input.device)
    buf.index_add_(0, e // top_k, permuted_input.index_select(0, rows).float() * w[:, None])
    if routed_scaling_factor != 1.0:
        buf = buf * torch.tensor(routed_scaling_factor, dtype=torch.float32)
    return buf.to(out_dtype)


def moe_permute_reference(
    input: torch.Tensor, permuted_idx_to_expanded_idx: torch.Tensor, top_k: int
) -> torch.Tensor:
    """``out[p] = input[e // top_k]`` for ``e = permuted_idx_to_expanded_idx[p]`` in
    ``[0, M*top_k)``; other rows (padding) are zeros. New ``[R, H]`` tensor, same dtype."""
    m, h = input.shape
    e = permuted_idx_to_expanded_idx.long()
    valid = (e >= 0) & (e < m * top_k)
    if m == 0:
        return torch.zeros(e.shape[0], h, dtype=input.dtype, device=input.device)
    # static shapes (no nonzero): torch.compile traces it without a graph break
    rows = input.index_select(0, e.clamp(0, m * top_k - 1) // top_k)
    return torch.where(valid[:, None], rows, torch.zeros((), dtype=input.dtype))


def moe_experts_reference(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    activation: str = "silu",
    transposed: bool = False,
    bias: torch.Tensor | None = None,
    shared_expert_output: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    gate_up_proj_scale_inv: torch.Tensor | None = None,
    down_proj_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] = (128, 128),
    gate_up_layout: str = "stacked",
) -> torch.Tensor:
    """The routed experts of an MoE layer, new ``[T, H]`` tensor. Per valid slot (t, k), i.e.
    expert ``e = top_k_index[t, k]`` in [0, E) (other ids are expert-parallel sentinels and
    contribute nothing)::

        g = W_gate[e] x_t,  u = W_up[e] x_t        # exact products, FP32 results
        a = cast(silu(g) * u)                      # FP32 math, one rounding to the input dtype
        y = W_down[e] a                            # exact products, FP32 result (not rounded)
        out[t] = finalize(y of t's slots)          # moe_finalize_reference, expanded rows:
                                                   # ascending k, fma_ftz, bias[e] before the
                                                   # weight, * routed_scaling_factor, + shared,
                                                   # one rounding

    ``gate_up_proj`` [E, 2I, H] holds the gate rows then the up rows, ``down_proj`` [E, H, I];
    with ``transposed=True`` they are [E, H, 2I] and [E, I, H]. The products are summed in FP64
    and rounded once to FP32 (the kernels sum in FP32 MMA order: a few FP32 ulps apart, which can
    move ``a`` by one ulp of its dtype). A loop over the distinct experts (host reads): the oracle
    and the CPU path, not a fast path.

    ``gate_up_layout="interleaved"``: the gate|up rows are stored g0, u0, g1, u1, ... FP8 weights
    (``float8_e4m3fn`` with ``gate_up_proj_scale_inv`` / ``down_proj_scale_inv``, blocks of
    128 x 128): ``x_t`` and ``a`` are quantized per 128-channel group and each product is the
    block-scaled one of :mod:`moefuse.moe.reference_fp8` (FP64 dots, one rounding to FP32).
    """
    if activation != "silu":
        raise ValueError(
            f"moefuse.moe_experts: argument 'activation' must be 'silu', got {activation!r}"
        )
    from moefuse.moe import reference_fp8 as r8

    if tuple(block_size) != (r8.BLOCK, r8.BLOCK):
        raise ValueError(
            f"moefuse.moe_experts: argument 'block_size' must be (128, 128), got {block_size}"
        )
    w_gu = gate_up_proj.transpose(1, 2) if transposed else gate_up_proj  # [E, 2I, H]
    w_d = down_proj.transpose(1, 2) if transposed else down_proj  # [E, H, I]
    tokens, top_k = top_k_index.shape
    experts, two_i, hidden = w_gu.shape
    inter = two_i // 2
    fp8 = gate_up_proj_scale_inv is not None
    quant = r8.group_quant_f64 if fp8 else torch.Tensor.double
    ids = top_k_index.long()
    valid = (ids >= 0) & (ids < experts)
    y = torch.zeros(tokens * top_k, hidden, dtype=torch.float32, device=hidden_states.device)
    flat_ids = ids.reshape(-1)
    flat_valid = valid.reshape(-1)
    for e in torch.unique(flat_ids[flat_valid]).tolist():
        slots = (flat_valid & (flat_ids == e)).nonzero().squeeze(1)
        gu_e, d_e = r8.experts_weights_f64(
            w_gu[e],
            w_d[e],
            gate_up_proj_scale_inv[e] if fp8 else None,
            down_proj_scale_inv[e] if fp8 else None,
            gate_up_layout == "interleaved",
        )
        x = quant(hidden_states.index_select(0, slots // top_k))
        h = (x @ gu_e.T).float()
        g, u = h[:, :inter], h[:, inter:]
        a = (g * torch.sigmoid(g) * u).to(hidden_states.dtype)
        y[slots] = (quant(a) @ d_e.T).float()
    slot_map = torch.arange(tokens * top_k, dtype=torch.int32, device=hidden_states.device)
    slot_map = torch.where(flat_valid, slot_map, -1).view(tokens, top_k)
    return moe_finalize_reference(
        y,
        slot_map,
        top_k_weights,
        bias=bias,
        expert_ids=top_k_index if bias is not None else None,
        routed_scaling_factor=routed_scaling_factor,
        shared_expert_output=shared_expert_output,
        input_is_expanded=True,
        out_dtype=hidden_states.dtype,
    )


def router_topk_reference(
    router_logits: torch.Tensor,
    top_k: int,
    scoring: str = "softmax",
    renormalize: bool = True,
    weights_dtype: torch.dtype = torch.float32,
    ids_dtype: torch.dtype = torch.int32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moefuse.router_topk` in torch (spec: router_topk): FP32 scores, the K highest in
    descending order with ties to the lower expert id and NaN below every number (a stable sort),
    the chosen scores divided by their sum in ascending k, one rounding to ``weights_dtype``."""
    x = router_logits.float()
    if scoring == "softmax":
        p = torch.exp(x - x.max(dim=-1, keepdim=True).values)
        score = p / p.sum(dim=-1, keepdim=True)
    else:
        score = torch.sigmoid(x)
    rank = torch.where(torch.isnan(score), float("-inf"), score)
    order = torch.sort(rank, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = torch.gather(score, 1, order)
    if renormalize:
        total = torch.zeros_like(weights[:, 0])
        for k in range(top_k):
            total = total + weights[:, k]
        weights = weights / total[:, None]
    return weights.to(weights_dtype), order.to(ids_dtype)
