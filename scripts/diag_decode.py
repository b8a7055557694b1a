"""Where a decode call of the MoE-reduction fusions spends its time (2 GPUs, P = 2).

At one token the MoE finalize fusion (`moe_finalize_allreduce_residual_rmsnorm`) took 4.34-4.47 µs
on 2 x H200 against 3.75 µs for the all-reduce fusion all-reduce + residual + RMSNorm alone, and
`tp_moe_finalize_rmsnorm` 7.1-7.4 µs (notes/comm-moe-reduction.md, notes/comm-expert-norm.md). This
times, in one run, the variants that isolate each suspect (CUDA-graph replays of 20 calls, max
over ranks, median of the replays); every row differs from ``split`` in one respect:

* ``ar`` / ``ar_hot``: the all-reduce alone, inputs rotating over sets larger than L2 / one set
  (L2-resident); ``finalize``: ``moe_finalize`` alone; ``chain``: the two back to back;
* ``split``: the fusion's default at M = 1 (column-split one-shot); ``split_hot``: one input
  set (expert rows, map, weights and residual stay in L2); ``split_k1``: one route per token
  (K = 1: one expert row to load); ``split_nopdl``: ``enable_pdl=False`` (the routing data is
  read after the previous call completes); ``split_c8``: 8 CTAs per row instead of 16;
  ``fused``: one CTA per row; ``split_fp32``: accumulate="fp32";
* ``reduction``: the MoE reduction fusion (dense rows: no index map to read);
* ``tp`` / ``tp_hot`` / ``tp_k1``: ``tp_moe_finalize_rmsnorm`` (slot_oneshot) likewise.

Read: split - split_hot = HBM latency of the inputs; split - split_k1 = the other 7 rows;
split_nopdl - split = what the early routing read saves; split - ar = the fusion's own cost.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python scripts/diag_decode.py --out $OUT        (about a minute; writes diag-decode.json)
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from moefuse.bench import ranks

H, K, M = 4096, 8, 1


def _inputs(k: int, n: int, rank: int, dev) -> dict:
    """``n`` input sets of one token with ``k`` routes (rows per rank; routing, residual and
    gain the same on every rank)."""
    bf = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(11 + rank)
    torch.manual_seed(5)
    return dict(maps=[torch.randperm(M * k, device=dev).to(torch.int32).view(M, k)
                      for _ in range(n)],
                wts=[torch.rand(M, k, device=dev) for _ in range(n)],
                res=[torch.randn(M, H, device=dev).to(bf) for _ in range(n)],
                w=(torch.rand(H, device=dev) + 0.5).to(bf),
                rows=[torch.randn(M * k, H, generator=g, device=dev).to(bf) for _ in range(n)],
                dense=[torch.randn(k, M, H, generator=g, device=dev).to(bf) for _ in range(n)],
                tokens=[torch.randn(M, H, generator=g, device=dev).to(bf) for _ in range(n)])


def _cases(mf, ws, xws, rank, dev) -> dict:
    """name -> ``fn(i)`` (input set ``i``), each one knob away from ``split``."""
    from moefuse.bench import harness
    from moefuse.bench.moe_reduction import with_env

    n = harness.rotation_sets((K + 3) * M * H * 2, cap=32)
    cold, hot, one = _inputs(K, n, rank, dev), _inputs(K, 1, rank, dev), _inputs(1, n, rank, dev)
    ro, no, part = (torch.empty(M, H, dtype=torch.bfloat16, device=dev) for _ in range(3))
    tp_out = torch.empty(M, H, dtype=torch.bfloat16, device=dev)

    def fusion(x, acc="stepwise", pdl=None):
        c = len(x["rows"])
        return lambda i: mf.moe_finalize_allreduce_residual_rmsnorm(
            x["rows"][i % c], x["res"][i % c], x["w"], x["maps"][i % c], workspace=ws,
            expert_scale_factor=x["wts"][i % c], accumulate=acc, algorithm="oneshot",
            enable_pdl=pdl, impl="triton", residual_out=ro, norm_out=no)  # fmt: skip

    def ar(x):
        c = len(x["rows"])
        return lambda i: mf.allreduce_residual_rmsnorm(
            x["tokens"][i % c], x["res"][i % c], x["w"], workspace=ws, impl="triton",
            residual_out=ro, norm_out=no)  # fmt: skip

    def finalize(i):
        return mf.moe_finalize(cold["rows"][i % n], cold["maps"][i % n], cold["wts"][i % n],
                               out=part, impl="triton")  # fmt: skip

    def chain(i):
        finalize(i)
        return mf.allreduce_residual_rmsnorm(part, cold["res"][i % n], cold["w"], workspace=ws,
                                             impl="triton", residual_out=ro, norm_out=no)

    def reduction(i):
        scale = cold["wts"][i % n].t().contiguous()
        return mf.moe_allreduce_residual_rmsnorm(
            cold["dense"][i % n], scale, cold["tokens"][i % n], cold["res"][i % n], cold["w"],
            workspace=ws, impl="triton", residual_out=ro, norm_out=no)  # fmt: skip

    def tp(x, space):
        c = len(x["rows"])
        return lambda i: mf.tp_moe_finalize_rmsnorm(
            x["rows"][i % c], x["wts"][i % c], x["maps"][i % c], x["w"], tp_out, workspace=space,
            eps=1e-6, gain_center=0.0, weight_before_norm=True, algorithm="slot_oneshot",
            impl="triton")  # fmt: skip

    split = {"MOEFUSE_MOE_COMM_VARIANT": "split"}
    return {
        "ar": ar(cold), "ar_hot": ar(hot), "finalize": finalize, "chain": chain,
        "split": with_env(split, fusion(cold)), "split_hot": with_env(split, fusion(hot)),
        "split_k1": with_env(split, fusion(one)),
        "split_nopdl": with_env(split, fusion(cold, pdl=False)),
        "split_c8": with_env({**split, "MOEFUSE_MOE_COMM_SPLIT_CTAS": "8"}, fusion(cold)),
        "fused": with_env({"MOEFUSE_MOE_COMM_VARIANT": "fused"}, fusion(cold)),
        "split_fp32": with_env(split, fusion(cold, "fp32")), "reduction": reduction,
        "tp": tp(cold, xws[K]), "tp_hot": tp(hot, xws[K]), "tp_k1": tp(one, xws[1]),
    }


def worker(rank: int, world_size: int, args, init_method) -> None:
    dev = ranks.init_rank(rank, world_size, init_method)
    import torch.distributed as dist
    from bench_moe_reduction_variants import timed

    import moefuse
    from moefuse.bench import harness

    group = dist.group.WORLD
    ws = moefuse.AllReduceWorkspace(group, 8, H, torch.bfloat16, dev, timeout_s=10.0)
    xws = {k: moefuse.ExpertNormWorkspace(group, H, k, dev, max_tokens=8, timeout_s=10.0)
           for k in (1, K)}  # fmt: skip
    us = {name: timed(fn, group, dev, args.replays)
          for name, fn in _cases(moefuse, ws, xws, rank, dev).items()}  # fmt: skip
    ws.check()
    if rank == 0:
        for name, value in us.items():
            print(f"{name:12s} {value:8.2f} us")
        meta = harness.run_metadata()
        meta.update(world_size=world_size, H=H, K=K, M=M,
                    note="µs: median of CUDA-graph replays of 20 calls, max over ranks")
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "diag-decode.json"), "w") as f:
            json.dump({"meta": meta, "us": us}, f, indent=1)
    for space in xws.values():
        space.close()
    ws.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results/sweeps")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--replays", type=int, default=20)
    return ranks.run_ranks(worker, parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
