"""Public op of the fused router: ``router_topk`` and ``supports_router_topk``.

Router logits -> scores -> top-k -> renormalized weights in one launch
(:mod:`moefuse.moe.router_triton`), where torch runs a softmax, a top-k selection, a sort of the
chosen K and a division (four to five kernels). The weights and ids are those an MoE layer hands
to :func:`moefuse.moe_experts` or to a finalize. Validation raises ``ValueError`` naming the
argument before anything is written; ``impl`` follows DESIGN.md.
"""

from __future__ import annotations

import torch

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, kernel_device_reason, resolve_pdl
from moefuse.moe import ops
from moefuse.moe.api import MAX_PROGRAMS
from moefuse.moe.reference import router_topk_reference
from moefuse.moe.routing import check_routing

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ID_DTYPES = (torch.int32, torch.int64)
#: most experts of one row (a program holds a row's scores whole)
ROUTER_MAX_EXPERTS = 1024


def _check_router(
    op, logits, top_k, scoring, renormalize, weights_dtype, ids_dtype, weights_out, ids_out
) -> tuple[int, int]:
    """Validate; returns (M, E)."""
    v.check_tensor(op, "router_logits", logits, dtypes=LOGIT_DTYPES, ndims=(2,))
    rows, experts = logits.shape
    if experts < 1:
        raise ValueError(f"moefuse.{op}: argument 'router_logits' must have E >= 1 columns")
    check_routing(op, experts, top_k, scoring, renormalize)
    for name, value, allowed in (
        ("weights_dtype", weights_dtype, WEIGHT_DTYPES),
        ("ids_dtype", ids_dtype, ID_DTYPES),
    ):
        if value not in allowed:
            raise ValueError(
                f"moefuse.{op}: argument '{name}' must be one of {allowed}, got {value!r}"
            )
    dev = logits.device
    for name, t, dtype in (
        ("weights_out", weights_out, weights_dtype),
        ("ids_out", ids_out, ids_dtype),
    ):
        if t is not None:
            v.check_tensor(op, name, t, dtypes=(dtype,), shape=(rows, top_k), device=dev)
            v.check_no_overlap(op, name, t, "router_logits", logits)
    if weights_out is not None and ids_out is not None:
        v.check_no_overlap(op, "weights_out", weights_out, "ids_out", ids_out)
    return rows, experts


def _kernel_reason(logits: torch.Tensor, rows: int, experts: int) -> str | None:
    reason = kernel_device_reason(logits.device)
    if reason is not None:
        return reason
    if experts > ROUTER_MAX_EXPERTS:
        return f"{experts} experts exceed the kernel's {ROUTER_MAX_EXPERTS} per row"
    if rows > MAX_PROGRAMS:
        return f"{rows} rows exceed one launch grid"
    return None


@fast_op
@v.checked(writes=("weights_out", "ids_out"))
def router_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    weights_dtype: torch.dtype = torch.float32,
    ids_dtype: torch.dtype = torch.int32,
    weights_out: torch.Tensor | None = None,
    ids_out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
    impl: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of every row of ``router_logits`` [M, E] (BF16/FP16/FP32, rows may be
    strided) in FP32::

        score = softmax(f32(x)) = p / sum(p), p = exp(x - max x)     # or sigmoid(f32(x))
        ids   = the K highest scores, descending; ties to the lower id; NaN below every number
        w     = score[ids], divided by w[0] + w[1] + ... + w[K-1] (ascending k) if renormalize
        weights = cast(w)                                              # one rounding

    Returns ``(weights [M, K] weights_dtype, ids [M, K] ids_dtype)`` (``weights_out`` /
    ``ids_out`` when given, else new tensors). Each row's bits depend on that row alone (no
    batch, token count or launch dependence). :func:`moefuse.route_topk` is the same selection in
    torch with FP32 weights and int32 ids; ``impl="reference"`` runs
    :func:`moefuse.moe.reference.router_topk_reference` (torch's ``exp`` and sum: scores within a
    few FP32 ulps, so ids may differ where two scores are that close).
    """
    op = "router_topk"
    rows, experts = _check_router(
        op,
        router_logits,
        top_k,
        scoring,
        renormalize,
        weights_dtype,
        ids_dtype,
        weights_out,
        ids_out,
    )
    dev = router_logits.device
    if weights_out is None:
        weights_out = torch.empty(rows, top_k, dtype=weights_dtype, device=dev)
    if ids_out is None:
        ids_out = torch.empty(rows, top_k, dtype=ids_dtype, device=dev)
    if rows == 0:
        return weights_out, ids_out
    reason = _kernel_reason(router_logits, rows, experts)
    if choose_impl(op, impl, dev, reason) == "reference":
        w, ids = router_topk_reference(
            router_logits, top_k, scoring, renormalize, weights_dtype, ids_dtype
        )
        weights_out.copy_(w)
        ids_out.copy_(ids)
        return weights_out, ids_out
    use_pdl = resolve_pdl(enable_pdl, dev)
    ops.router_topk_op(
        router_logits,
        top_k,
        weights_out,
        ids_out,
        scoring == "softmax",
        renormalize,
        use_pdl,
    )
    return weights_out, ids_out


def supports_router_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    weights_dtype: torch.dtype = torch.float32,
    ids_dtype: torch.dtype = torch.int32,
    weights_out: torch.Tensor | None = None,
    ids_out: torch.Tensor | None = None,
) -> bool:
    """True when the Triton kernel can run these arguments on their device (no side effects)."""
    args = (router_logits, top_k, scoring, renormalize, weights_dtype, ids_dtype)
    try:
        rows, experts = _check_router("router_topk", *args, weights_out, ids_out)
    except ValueError:
        return False
    return _kernel_reason(router_logits, rows, experts) is None
