"""Triton kernel of the fused router top-k (:func:`moefuse.moe.router.router_topk`), launcher.

One program takes ``BM`` rows of router logits [M, E] whole (E padded to ``EP``, a power of
two) and, per row, in FP32:

1. scores: ``softmax`` (``p = exp(x - max x)``, ``s`` = the row's sum of ``p``, a tree fixed by
   ``EP`` alone, ``score = p / s`` IEEE-rounded) or ``sigmoid`` (``1 / (1 + exp(-x))``);
2. K rounds of selection: the highest remaining score, ties to the lowest expert id (NaN
   scores rank below every number, so a row of NaNs still picks K distinct ids in ``[0, E)``);
3. with ``RENORM``: the chosen scores divided (IEEE) by their sum in ascending k;
4. weights rounded once to the output dtype, ids stored as int32 or int64.

Every row is independent and its arithmetic is fixed by (E, K, scoring, renormalize), so a row's
bits do not depend on M, on ``BM`` or on the other rows. ``exp`` is the GPU's ``ex2.approx``
(Triton's ``tl.exp``) on the GPU and the host's ``exp`` in the interpreter: the two differ in the
last bits of the scores, as the reference (torch) does from both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import round_to
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs
from moefuse.moe.tiles import next_pow2

#: rows per program (fewer when M is smaller), and the elements of one program's score tile
#: above which it takes 8 warps
ROUTER_ROWS = 16
ROUTER_WIDE_TILE = 4096


@triton.jit
def _scores(x, e_in, SOFTMAX: tl.constexpr):
    """FP32 scores of a [BM, EP] tile of logits (columns outside ``e_in`` are ignored)."""
    if SOFTMAX:
        m = tl.max(tl.where(e_in, x, -float("inf")), axis=1)
        p = tl.where(e_in, tl.exp(x - m[:, None]), 0.0)
        s = tl.sum(p, axis=1)
        return tl.math.div_rn(p, s[:, None])
    else:
        return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + tl.exp(-x))


@triton.jit(do_not_specialize=["n_rows"])
def _router_topk_kernel(
    logits_ptr,
    w_ptr,
    ids_ptr,
    n_rows,
    logits_st,
    w_st,
    ids_st,
    E: tl.constexpr,
    EP: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,
    BM: tl.constexpr,
    SOFTMAX: tl.constexpr,
    RENORM: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """weights[t, k], ids[t, k] of rows t of this program (module docstring)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    r_in = rows < n_rows
    e = tl.arange(0, EP)
    e_in = e < E
    if USE_PDL:
        gdc_wait()  # the logits come from the kernel before
    x = tl.load(
        logits_ptr + rows.to(tl.int64)[:, None] * logits_st + e[None, :],
        mask=r_in[:, None] & e_in[None, :],
        other=0.0,
    ).to(tl.float32)
    if USE_PDL:
        gdc_launch_dependents()
    score = _scores(x, e_in[None, :], SOFTMAX)
    rank = tl.where(score == score, score, -float("inf"))  # NaN ranks below every number
    avail = (rows[:, None] >= 0) & e_in[None, :]
    kk = tl.arange(0, KP)
    w = tl.zeros([BM, KP], dtype=tl.float32)
    ids = tl.zeros([BM, KP], dtype=tl.int32)
    total = tl.zeros([BM], dtype=tl.float32)
    for k in tl.static_range(K):
        cand = tl.where(avail, rank, -float("inf"))
        best = tl.max(cand, axis=1)
        pick = tl.min(tl.where(avail & (cand == best[:, None]), e[None, :], EP), axis=1)
        hit = e[None, :] == pick[:, None]
        # the chosen score itself (a sum of one element and zeros: exact for scores >= +0.0)
        val = tl.sum(tl.where(hit, score, 0.0), axis=1)
        w = tl.where(kk[None, :] == k, val[:, None], w)
        ids = tl.where(kk[None, :] == k, pick[:, None], ids)
        total = total + val
        avail = avail & (e[None, :] != pick[:, None])
    if RENORM:
        w = tl.math.div_rn(w, total[:, None])
    k_in = kk < K
    mask = r_in[:, None] & k_in[None, :]
    r64 = rows.to(tl.int64)[:, None]
    tl.store(w_ptr + r64 * w_st + kk[None, :], round_to(w, w_ptr.dtype.element_ty, PTX), mask=mask)
    tl.store(ids_ptr + r64 * ids_st + kk[None, :], ids.to(ids_ptr.dtype.element_ty), mask=mask)


def router_tile(n_rows: int, experts: int) -> tuple[int, int]:
    """(rows per program, warps) for ``n_rows`` rows of ``experts`` logits."""
    bm = min(ROUTER_ROWS, next_pow2(max(1, n_rows)))
    return bm, 8 if bm * next_pow2(experts) > ROUTER_WIDE_TILE else 4


def launch_router_topk(
    router_logits: torch.Tensor,
    top_k: int,
    weights: torch.Tensor,
    ids: torch.Tensor,
    softmax: bool,
    renormalize: bool,
    use_pdl: bool,
) -> None:
    """Writes ``weights`` [M, K] and ``ids`` [M, K] from ``router_logits`` [M, E] (rows may be
    strided, elements contiguous)."""
    n_rows, experts = router_logits.shape
    if n_rows == 0:
        return
    bm, warps = router_tile(n_rows, experts)
    launch(
        _router_topk_kernel,
        (triton.cdiv(n_rows, bm),),
        router_logits,
        weights,
        ids,
        n_rows,
        router_logits.stride(0),
        weights.stride(0),
        ids.stride(0),
        E=experts,
        EP=max(16, next_pow2(experts)),
        K=top_k,
        KP=next_pow2(top_k),
        BM=bm,
        SOFTMAX=softmax,
        RENORM=renormalize,
        PTX=not interpreter_active(),
        USE_PDL=use_pdl,
        num_warps=warps,
        **pdl_launch_kwargs(use_pdl),
    )
