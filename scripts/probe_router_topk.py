"""Fused router top-k against transformers' Qwen3-MoE router tail on one GPU.

For each (E, K) and row count M: ids against the torch reference (``ids==ref``) and against
``torch.topk`` in order (``ids==hf``), the largest weight differences, whether a row's bits are
the same alone as in the batch, and CUDA-graph µs per call of ``moefuse.router_topk`` next to the
router tail transformers runs after its linear (FP32 softmax, ``topk``, renormalize, cast), eager
and ``torch.compile``'d.

    PYTHONPATH=src python scripts/probe_router_topk.py
"""

from __future__ import annotations

import argparse

import torch

import moefuse
from moefuse.bench.harness import graph_time_us
from moefuse.moe.reference import router_topk_reference


def qwen3_router_tail(x, k):
    p = torch.softmax(x, dtype=torch.float, dim=-1)
    v, i = torch.topk(p, k, dim=-1)
    v /= v.sum(dim=-1, keepdim=True)
    return v.to(x.dtype), i


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    torch._dynamo.config.recompile_limit = 64
    compiled = torch.compile(qwen3_router_tail, dynamic=False)
    kw = dict(weights_dtype=torch.bfloat16, ids_dtype=torch.int64)
    for e, k in ((128, 8), (8, 2), (256, 8), (60, 4)):
        for m in (1, 7, 64, 2048, 4096):
            x = torch.randn(m, e, device=dev).to(torch.bfloat16)
            wo = torch.full((m, k), float("nan"), device=dev, dtype=torch.bfloat16)
            io = torch.full((m, k), -7, device=dev, dtype=torch.int64)
            w, i = moefuse.router_topk(x, k, weights_out=wo, ids_out=io, **kw)
            rw, ri = router_topk_reference(x, k, "softmax", True, torch.bfloat16, torch.int64)
            hw, hi = qwen3_router_tail(x, k)
            w1, i1 = moefuse.router_topk(x[-1:].contiguous(), k, **kw)
            same = torch.equal(w1.view(torch.int16), w[-1:].view(torch.int16))
            inv = same and torch.equal(i1, i[-1:])
            ids_ref = (i == ri).all(1).float().mean().item()
            ids_hf = (i == hi).all(1).float().mean().item()
            dw = (w.float() - rw.float()).abs().max().item()
            dhw = (w.float() - hw.float()).abs().max().item()
            t_ours = graph_time_us(
                lambda _i: moefuse.router_topk(x, k, weights_out=wo, ids_out=io, **kw)
            )
            t_torch = graph_time_us(lambda _i: qwen3_router_tail(x, k))
            compiled(x, k)
            t_comp = graph_time_us(lambda _i: compiled(x, k))
            print(
                f"E={e} K={k} M={m} ids==ref {ids_ref:.4f} ids==hf {ids_hf:.4f} "
                f"|dw| ref {dw:.2e} hf {dhw:.2e} row-invariant {inv} "
                f"us ours {t_ours:.2f} torch {t_torch:.2f} compiled {t_comp:.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
