"""A complete MoE layer pipeline for the benchmark and the demo:

    route (router GEMM + top-k) -> sort by expert -> permute (gather) -> grouped GEMM1 (gate|up)
    -> SiLU(gate) * up -> grouped GEMM2 (down) -> finalize

``use_fused_finalize`` picks the last step and is honoured end to end:
* ``False``: :func:`moefuse.moe_finalize` — deterministic gather-reduce (spec: MoE), bitwise
  reproducible;
* ``True``: :func:`moefuse.moe.api.moe_finalize_scatter_add` — FP32 atomics into a buffer (what a
  GEMM2 epilogue with scatter-add does), correct to FP32 rounding but order-dependent.

The grouped GEMMs use ``torch._grouped_mm`` where it exists and works for the dtype and device
(probed once per (dtype, device) and checked against per-expert matmuls), else one matmul per
expert (which reads the expert offsets on the host, so only that fallback syncs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moefuse import _validate as v
from moefuse._runtime import constant_result
from moefuse.moe.api import moe_finalize, moe_finalize_scatter_add, moe_permute
from moefuse.moe.routing import RoutingPlan, check_routing, route_topk, sort_by_expert


@dataclass
class MoEWeights:
    """Weights of one MoE layer (nn.Linear layout: ``[out_features, in_features]`` per expert).

    ``router`` [E, H]; ``w13`` [E, 2I, H] (gate rows then up rows); ``w2`` [E, H, I].
    """

    router: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @staticmethod
    def random(
        num_experts: int,
        hidden: int,
        intermediate: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        generator: torch.Generator | None = None,
    ) -> MoEWeights:
        """Gaussian weights scaled by 1/sqrt(fan_in), so activations keep unit scale."""

        def w(*shape):
            t = torch.randn(*shape, generator=generator, dtype=torch.float32)
            return (t / shape[-1] ** 0.5).to(dtype=dtype, device=device)

        return MoEWeights(
            router=w(num_experts, hidden),
            w13=w(num_experts, 2 * intermediate, hidden),
            w2=w(num_experts, hidden, intermediate),
        )


# ----------------------------------------------------------------------------- grouped GEMM
def _grouped_mm_per_expert(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[rows of e] = a[rows of e] @ w[e].T``; rows outside every expert are zeros."""
    out = torch.zeros(a.shape[0], w.shape[1], dtype=a.dtype, device=a.device)
    bounds = offsets.tolist()  # host copy: this fallback is not graph-capturable
    for e in range(w.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            out[lo:hi] = a[lo:hi] @ w[e].transpose(0, 1)
    return out


def _grouped_mm_torch(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    # torch._grouped_mm takes the per-group END offsets of the 2-D operand and a [E, K, N] operand
    return torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets[1:])


@constant_result
def grouped_mm_available(dtype: torch.dtype, device: torch.device) -> bool:
    """True when ``torch._grouped_mm`` runs for ``dtype`` on ``device`` and matches per-expert
    matmuls on a small probe (including an empty group); probed once per (dtype, device). A
    constant while torch.compile traces (the probe runs eagerly then, outside the graph)."""
    return _probe_grouped_mm(dtype, device)


@functools.cache
def _probe_grouped_mm(dtype: torch.dtype, device: torch.device) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(40, 32, generator=g).to(dtype=dtype, device=device)
        w = torch.randn(3, 16, 32, generator=g).to(dtype=dtype, device=device)
        offsets = torch.tensor([0, 8, 8, 40], dtype=torch.int32, device=device)
        got = _grouped_mm_torch(a, w, offsets).float()
        want = _grouped_mm_per_expert(a, w, offsets).float()
        return bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
    except Exception:
        return False


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Grouped ``a @ w[e].T`` over the row segments ``[offsets[e], offsets[e+1])`` of ``a``.

    ``a`` [R, Kd]; ``w`` [E, N, Kd]; ``offsets`` [E + 1] int32 (``RoutingPlan.expert_offsets``).
    Rows past ``offsets[E]`` are unspecified (never read by the finalize).
    """
    aligned = a.shape[1] % 8 == 0 and w.shape[1] % 8 == 0 and a.is_contiguous()
    if aligned and w.is_contiguous() and grouped_mm_available(a.dtype, a.device):
        return _grouped_mm_torch(a, w, offsets)
    return _grouped_mm_per_expert(a, w, offsets)


# ----------------------------------------------------------------------------- the layer
@dataclass
class MoEIntermediates:
    """What :func:`moe_layer` computed on the way (for tests, the demo and the benchmark)."""

    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    plan: RoutingPlan
    permuted_input: torch.Tensor
    gemm2_out: torch.Tensor


def moe_experts(
    x: torch.Tensor,
    weights: MoEWeights,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    pad_to: int = 1,
    enable_pdl: bool | None = None,
    impl: str = "auto",
) -> MoEIntermediates:
    """Everything before the finalize: routing, permute and both grouped expert GEMMs."""
    logits = F.linear(x, weights.router)
    topk_weights, topk_ids = route_topk(logits, top_k, scoring=scoring, renormalize=renormalize)
    plan = sort_by_expert(topk_ids, weights.num_experts, pad_to=pad_to)
    xp = moe_permute(x, plan.permuted_idx_to_expanded_idx, top_k, enable_pdl=enable_pdl, impl=impl)
    h = grouped_mm(xp, weights.w13, plan.expert_offsets)
    inter = weights.w13.shape[1] // 2
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = grouped_mm(act.contiguous(), weights.w2, plan.expert_offsets)
    return MoEIntermediates(topk_weights, topk_ids, plan, xp, y)


def finalize(
    inter: MoEIntermediates,
    *,
    use_fused_finalize: bool,
    routed_scaling_factor: float = 1.0,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """The last step of :func:`moe_layer`, selected by ``use_fused_finalize`` (module docstring)."""
    if use_fused_finalize:
        return moe_finalize_scatter_add(
            inter.gemm2_out,
            inter.plan.permuted_idx_to_expanded_idx,
            inter.topk_weights,
            out=out,
            routed_scaling_factor=routed_scaling_factor,
            enable_pdl=enable_pdl,
            impl=impl,
        )
    return moe_finalize(
        inter.gemm2_out,
        inter.plan.expanded_idx_to_permuted_idx,
        inter.topk_weights,
        out=out,
        routed_scaling_factor=routed_scaling_factor,
        enable_pdl=enable_pdl,
        impl=impl,
    )


def _check_layer(
    op, x, weights, top_k, use_fused_finalize, scoring, renormalize, rsf, pad_to, out
) -> None:
    """Every argument of :func:`moe_layer`, checked before any step runs."""
    v.check_tensor(op, "x", x, dtypes=v.FLOAT16S, ndims=(2,))
    m, hidden = x.shape
    if not isinstance(weights, MoEWeights):
        raise ValueError(
            f"moefuse.{op}: argument 'weights' must be a MoEWeights, got {type(weights).__name__}"
        )
    v.check_tensor(op, "weights.w13", weights.w13, dtypes=(x.dtype,), ndims=(3,), device=x.device)
    experts, two_i = weights.w13.shape[0], weights.w13.shape[1]
    if two_i < 2 or two_i % 2 or weights.w13.shape[2] != hidden:
        raise ValueError(
            f"moefuse.{op}: argument 'weights.w13' must be [E, 2I, H] with H = "
            f"{hidden}, got {tuple(weights.w13.shape)}"
        )
    v.check_tensor(
        op,
        "weights.router",
        weights.router,
        dtypes=(x.dtype,),
        shape=(experts, hidden),
        device=x.device,
    )
    v.check_tensor(
        op,
        "weights.w2",
        weights.w2,
        dtypes=(x.dtype,),
        shape=(experts, hidden, two_i // 2),
        device=x.device,
    )
    if not isinstance(use_fused_finalize, bool):
        raise ValueError(f"moefuse.{op}: argument 'use_fused_finalize' must be a bool")
    check_routing(op, experts, top_k, scoring, renormalize)
    v.check_real(op, "routed_scaling_factor", rsf)
    if isinstance(pad_to, bool) or not isinstance(pad_to, int) or pad_to < 1:
        raise ValueError(f"moefuse.{op}: argument 'pad_to' must be an int >= 1, got {pad_to!r}")
    if out is not None:
        v.check_tensor(op, "out", out, dtypes=(x.dtype,), shape=(m, hidden), device=x.device)
        for name, t in (
            ("x", x),
            ("weights.router", weights.router),
            ("weights.w13", weights.w13),
            ("weights.w2", weights.w2),
        ):
            v.check_no_overlap(op, "out", out, name, t)


@v.checked(writes=("out",))
def moe_layer(
    x: torch.Tensor,
    weights: MoEWeights,
    top_k: int,
    *,
    use_fused_finalize: bool = False,
    scoring: str = "softmax",
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
    pad_to: int = 1,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """MoE layer forward ``x`` [M, H] -> [M, H] (BF16/FP16), see the module docstring.

    ``impl`` applies to the moefuse ops of the pipeline (permute and finalize); routing and the
    GEMMs are torch. With ``use_fused_finalize=False`` the output bits are a deterministic
    function of the GEMM2 output. Every argument is checked before the first step runs
    (``ValueError`` naming it; the ``weights`` fields as ``weights.router`` etc.).
    """
    _check_layer(
        "moe_layer",
        x,
        weights,
        top_k,
        use_fused_finalize,
        scoring,
        renormalize,
        routed_scaling_factor,
        pad_to,
        out,
    )
    inter = moe_experts(
        x,
        weights,
        top_k,
        scoring=scoring,
        renormalize=renormalize,
        pad_to=pad_to,
        enable_pdl=enable_pdl,
        impl=impl,
    )
    return finalize(
        inter,
        use_fused_finalize=use_fused_finalize,
        routed_scaling_factor=routed_scaling_factor,
        out=out,
        enable_pdl=enable_pdl,
        impl=impl,
    )
