"""Old vs new one-shot variants of ``moe_finalize_allreduce_residual_rmsnorm`` on 2 GPUs.

For H = 4096, K = 8 and each M: first every variant is checked bitwise against the current fused
one-shot kernel (same accumulate mode) on fresh random inputs with NaN-poisoned outputs, and the
fused stepwise residual_out against the oracle of all ranks' inputs (M <= 512); then CUDA-graph
replays (inputs rotating over sets larger than L2, max over ranks) time:

* ``fused`` / ``fused_fp32`` — the current kernel (MOEFUSE_MOE_COMM_VARIANT=fused);
* ``split`` / ``split_fp32`` — the column-split one-shot (default CTAs per row), plus
  ``split_c4`` / ``split_c16`` at M <= 8 (MOEFUSE_MOE_COMM_SPLIT_CTAS) and ``split_2ctas`` at
  M <= 64 (MOEFUSE_MOE_COMM_CTAS_PER_SM=2); ``fused_2ctas`` at M >= 64 (the current kernel at
  2 CTAs per SM);
* ``chain`` — moefuse's unfused chain: ``moe_finalize`` + ``allreduce_residual_rmsnorm``.

Run (repo root, 2 GPUs; ~1-3 minutes, mostly Triton compiles):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python scripts/bench_moe_reduction_variants.py --out $OUT
Prints a table (µs, and chain / variant) and writes ``moe-reduction-variants-p2.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from moefuse.bench import ranks

H, K = 4096, 8
TOKENS = (1, 8, 64, 512, 2048)
ORACLE_MAX_TOKENS = 512
#: (name, accumulate, knobs); "fused" rows are the references of the bitwise checks
VARIANTS = (
    ("fused", "stepwise", {"MOEFUSE_MOE_COMM_VARIANT": "fused"}),
    ("fused_fp32", "fp32", {"MOEFUSE_MOE_COMM_VARIANT": "fused"}),
    ("split", "stepwise", {"MOEFUSE_MOE_COMM_VARIANT": "split"}),
    ("split_fp32", "fp32", {"MOEFUSE_MOE_COMM_VARIANT": "split"}),
)
#: CTAs-per-row sweep of the split variant at decode (M <= SWEEP_MAX_TOKENS)
SPLIT_SWEEP = (4, 16)
SWEEP_MAX_TOKENS = 8


def variants_for(m: int) -> list[tuple[str, str, dict]]:
    """The variants timed at ``m`` tokens (the split sweep only at decode; no split above the
    workspace's "lamport_own" rows, where it would run the fused kernel again)."""
    from moefuse.comm.workspace import OWN_SLOT_TOKENS

    out = [v for v in VARIANTS if m <= OWN_SLOT_TOKENS or not v[0].startswith("split")]
    if m <= SWEEP_MAX_TOKENS:
        out += [(f"split_c{c}", "stepwise", {"MOEFUSE_MOE_COMM_VARIANT": "split",
                                             "MOEFUSE_MOE_COMM_SPLIT_CTAS": str(c)})
                for c in SPLIT_SWEEP]  # fmt: skip
    if m >= 64:  # the fused kernel at 2 CTAs per SM (128 registers, fewer rows in flight)
        out.append(("fused_2ctas", "stepwise", {"MOEFUSE_MOE_COMM_VARIANT": "fused",
                                                "MOEFUSE_MOE_COMM_CTAS_PER_SM": "2"}))
    if m <= 64:  # 2 CTAs per SM: twice the CTAs per row at M = 64, a 128-register cap
        out.append(("split_2ctas", "stepwise", {"MOEFUSE_MOE_COMM_VARIANT": "split",
                                                "MOEFUSE_MOE_COMM_CTAS_PER_SM": "2"}))
    return out


def make_inputs(m: int, n_sets: int, rank: int, seed: int, dev) -> dict:
    """``n_sets`` input sets: permuted rows (per rank), index maps, weights, residuals (shared
    by the ranks), one gain."""
    bf = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(seed + 101 * rank)
    torch.manual_seed(seed)  # routing, residual, gain: the same on every rank
    return dict(
        maps=[torch.randperm(m * K, device=dev).to(torch.int32).view(m, K) for _ in range(n_sets)],
        wts=[torch.rand(m, K, device=dev) for _ in range(n_sets)],
        res=[torch.randn(m, H, device=dev).to(bf) for _ in range(n_sets)],
        w=(torch.rand(H, device=dev) + 0.5).to(bf),
        rows=[torch.randn(m * K, H, generator=g, device=dev).to(bf) for _ in range(n_sets)],
    )


def fused_call(mf, ws, x, acc, ro, no):
    """``fn(i)``: the fused op (algorithm "oneshot") on input set ``i``."""
    n = len(x["rows"])
    return lambda i: mf.moe_finalize_allreduce_residual_rmsnorm(
        x["rows"][i % n], x["res"][i % n], x["w"], x["maps"][i % n], workspace=ws,
        expert_scale_factor=x["wts"][i % n], accumulate=acc, algorithm="oneshot", impl="triton",
        residual_out=ro, norm_out=no)  # fmt: skip


def chain_call(mf, ws, x, part, ro, no):
    """``fn(i)``: moe_finalize into ``part``, then allreduce_residual_rmsnorm."""
    n = len(x["rows"])

    def call(i):
        mf.moe_finalize(x["rows"][i % n], x["maps"][i % n], x["wts"][i % n], out=part,
                        impl="triton")  # fmt: skip
        return mf.allreduce_residual_rmsnorm(part, x["res"][i % n], x["w"], workspace=ws,
                                             impl="triton", residual_out=ro, norm_out=no)

    return call


def check(mf, ws, m, rank, world, group, dev) -> list[str]:
    """Bitwise checks on fresh inputs with poisoned outputs; returns failure lines."""
    import torch.distributed as dist

    from moefuse.bench.moe_reduction import with_env
    from moefuse.comm.moe_reduction import reference as mref
    from moefuse.testing import poison_

    x = make_inputs(m, 1, rank, 7000 + m, dev)
    refs, fails = {}, []
    for name, acc, env in variants_for(m):
        ro = poison_(torch.empty(m, H, dtype=torch.bfloat16, device=dev))
        no = poison_(torch.empty_like(ro))
        with_env(env, fused_call(mf, ws, x, acc, ro, no))(0)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        got = (ro.view(torch.int16).clone(), no.view(torch.int16).clone())
        if name.startswith("fused"):
            refs[acc] = got
            continue
        for what, a, b in zip(("residual_out", "norm_out"), got, refs[acc]):
            bad = int((a != b).sum())
            if bad:
                fails.append(f"M={m} {name} {what}: {bad} elements differ from fused ({acc})")
    if m <= ORACLE_MAX_TOKENS:
        parts = [torch.empty_like(x["rows"][0]) for _ in range(world)]
        dist.all_gather(parts, x["rows"][0], group=group)
        want = mref.moe_finalize_allreduce_from_ranks(parts, x["maps"][0], x["res"][0], x["w"],
                                                      expert_scale_factors=x["wts"][0])
        bad = int((refs["stepwise"][0] != want["residual_out"].view(torch.int16)).sum())
        if bad:
            fails.append(f"M={m} fused residual_out: {bad} elements differ from the oracle")
    return fails


def timed(fn, group, dev, replays: int) -> float:
    """Max over ranks of the median per-call µs of CUDA-graph replays (NaN when it fails)."""
    import torch.distributed as dist

    from moefuse.bench import harness

    dist.barrier(group=group)
    torch.cuda.synchronize(dev)
    try:
        us = harness.graph_time_us(fn, calls=20, replays=replays)
    except Exception as exc:  # report and go on: the other variants still get timed
        print(f"variant failed: {exc}", flush=True)
        us = float("nan")
    t = torch.tensor([us], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def time_shape(mf, ws, m, rank, group, dev, replays) -> dict[str, float]:
    """µs of every variant and of the chain at ``m`` tokens."""
    from moefuse.bench import harness
    from moefuse.bench.moe_reduction import with_env

    n = harness.rotation_sets((K + 3) * m * H * 2, cap=8)
    x = make_inputs(m, n, rank, 17 + m, dev)
    ro, no, part = (torch.empty(m, H, dtype=torch.bfloat16, device=dev) for _ in range(3))
    out = {name: timed(with_env(env, fused_call(mf, ws, x, acc, ro, no)), group, dev, replays)
           for name, acc, env in variants_for(m)}  # fmt: skip
    out["chain"] = timed(chain_call(mf, ws, x, part, ro, no), group, dev, replays)
    return out


def table(results: dict[int, dict[str, float]]) -> str:
    """Rows M, columns variants (µs), then chain / variant for the stepwise defaults."""
    names = sorted({v for r in results.values() for v in r}, key=_order)
    lines = ["M      " + " ".join(f"{v:>15s}" for v in names)]
    for m, r in results.items():
        lines.append(f"{m:<6d} " + " ".join(f"{r.get(v, float('nan')):15.2f}" for v in names))
    lines.append("chain / variant (>= 1.2 wanted at M <= 64, >= 1.0 everywhere; M = 1 <= 4.0 us):")
    for m, r in results.items():
        lines.append(f"{m:<6d} " + " ".join(f"{r['chain'] / r[v]:15.2f}" if r.get(v) else
                                            f"{'':15s}" for v in names))  # fmt: skip
    return "\n".join(lines)


def _order(name: str) -> tuple:
    base = [v[0] for v in VARIANTS] + [f"split_c{c}" for c in SPLIT_SWEEP] + [
        "split_2ctas", "fused_2ctas", "chain"]
    return (base.index(name) if name in base else len(base), name)


def worker(rank: int, world_size: int, args, init_method) -> None:
    dev = ranks.init_rank(rank, world_size, init_method)
    import torch.distributed as dist

    import moefuse

    group = dist.group.WORLD
    tokens = [int(t) for t in args.tokens.split(",")]
    ws = moefuse.AllReduceWorkspace(group, max(tokens), H, torch.bfloat16, dev,
                                    oneshot_max_tokens=max(tokens), timeout_s=args.timeout_s)
    start = time.time()
    results, fails = {}, []
    for m in tokens:
        fails += check(moefuse, ws, m, rank, world_size, group, dev)
        results[m] = time_shape(moefuse, ws, m, rank, group, dev, args.replays)
        if rank == 0:
            print(f"M={m}: " + "  ".join(f"{k}={v:.2f}" for k, v in results[m].items()) +
                  f" us ({time.time() - start:.0f} s)", flush=True)  # fmt: skip
    ws.check()
    ws.close()
    if rank == 0:
        print(table(results))
        for line in fails or ["all bitwise checks passed"]:
            print("CHECK", line)
        from moefuse.bench import harness

        meta = harness.run_metadata()
        meta.update(world_size=world_size, H=H, K=K, fails=fails, seconds=time.time() - start,
                    note="µs: median of CUDA-graph replays, max over ranks")  # fmt: skip
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"moe-reduction-variants-p{world_size}.json")
        with open(path, "w") as f:
            json.dump({"meta": meta, "us": {str(m): r for m, r in results.items()}}, f, indent=1)
        print("wrote", path)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--tokens", default=",".join(str(t) for t in TOKENS))
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="bound of the kernels' waits (a hang surfaces as an error)")
    return ranks.run_ranks(worker, parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
