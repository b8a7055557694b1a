"""all_gather_rmsnorm at large M on P GPUs (against the NVLink bound): the persistent gather + norm
kernel (comm/all_gather/persistent.py) against the old paths, bitwise first.

Run (2 x H200, < 4 minutes)::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=src \\
        python scripts/bench_allgather_large.py --out $OUT

Per H in --hidden and M in --tokens (default 4096,8192 x 512,4096,16384):

(a) every moefuse variant below is checked bit for bit against NCCL all_gather + moefuse.rmsnorm
    on fresh random shards with poisoned outputs (a failing variant is reported and not timed);
(b) median µs of CUDA-graph replays (max over ranks; shards rotate over sets larger than L2):
    ``fused`` (the default: persistent kernel), ``fused_la2`` / ``fused_la4`` (lookahead 2 / 4
    tiles), ``fused_2xcta`` (twice the default CTAs per SM, capped at what the compiled kernel
    fits), ``chunked`` (two launches + 4-chunk stream pipeline), ``nochunk`` (two launches),
    ``gather`` (the all-gather launch alone), ``nccl+rmsnorm``; and the NVLink bound (bytes each
    rank receives over the peer-copy bandwidth measured in the same run);
(c) prints a table (time / bound as ``x_bound``) and writes ``allgather_large.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from moefuse.bench import ranks
from moefuse.bench.all_gather import peer_copy_gbps, time_variant

FUSED = "MOEFUSE_ALLGATHER_LARGE"
#: moefuse variants: the knobs each sets (read at capture; the same on every rank)
VARIANTS = {
    "fused": {FUSED: "fused"},
    "fused_la2": {FUSED: "fused", "MOEFUSE_ALLGATHER_LOOKAHEAD": "2"},
    "fused_la4": {FUSED: "fused", "MOEFUSE_ALLGATHER_LOOKAHEAD": "4"},
    "fused_2xcta": {FUSED: "fused"},  # + MOEFUSE_ALLGATHER_FUSED_CTAS_PER_SM, per width below
    "chunked": {FUSED: "chunked"},
    "nochunk": {FUSED: "chunked", "MOEFUSE_ALLGATHER_CHUNK_ROWS": "0"},
}


def variant_env(name: str, h: int) -> dict[str, str]:
    """The knobs of moefuse variant ``name`` at width ``h``."""
    env = dict(VARIANTS[name])
    if name == "fused_2xcta":
        from moefuse.comm.all_gather.persistent import CTAS_PER_SM_ENV
        from moefuse.comm.tiles import resident_ctas_per_sm
        from moefuse.norm.tiles import RMSNORM_POLICY, row_tile

        warps = row_tile(h, RMSNORM_POLICY).num_warps
        env[CTAS_PER_SM_ENV] = str(2 * resident_ctas_per_sm(warps))
    return env


def check_bitwise(moefuse, ws, group, h, m, seed, env) -> None:
    """Fresh shards (``seed``), poisoned output: the op (under the knobs ``env``, which the
    caller has set) equals NCCL all_gather + moefuse.rmsnorm bit for bit (AssertionError naming
    the first differing element and the knobs)."""
    import torch.distributed as dist

    from moefuse.testing import assert_bitwise_equal, poison_

    dev, p, rank = ws.device, dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator(device=dev).manual_seed(seed * 131 + rank)
    shard = torch.randn(m, h // p, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.rand(h, generator=torch.Generator(device=dev).manual_seed(seed), device=dev)
         + 0.5).to(torch.bfloat16)  # fmt: skip
    parts = torch.empty(p, m, h // p, dtype=torch.bfloat16, device=dev)
    dist.all_gather_into_tensor(parts, shard, group=group)
    want = moefuse.rmsnorm(parts.permute(1, 0, 2).reshape(m, h), w)
    got = moefuse.all_gather_rmsnorm(shard, w, workspace=ws, impl="triton",
                                     out=poison_(torch.empty_like(want)))  # fmt: skip
    assert_bitwise_equal(got, want, f"H={h} M={m} {env}")
    ws.check()


def time_case(moefuse, harness, ws, group, h, m, replays) -> dict[str, float]:
    """Median µs (max over ranks) of every variant at [M, H]; NaN for a variant that failed."""
    import torch.distributed as dist

    from moefuse.comm.all_gather import ops as allgather_ops
    from moefuse.comm.all_gather.kernels import launch_allgather

    dev, p, rank = ws.device, dist.get_world_size(group), dist.get_rank(group)
    bf = torch.bfloat16
    n = harness.rotation_sets(4 * m * h * 2)
    g = torch.Generator(device=dev).manual_seed(77 + rank)
    shards = [torch.randn(m, h // p, generator=g, device=dev).to(bf) for _ in range(n)]
    w = (torch.rand(h, device=dev) + 0.5).to(bf)
    dist.broadcast(w, 0, group=group)
    out = torch.empty(m, h, dtype=bf, device=dev)
    parts = torch.empty(p, m, h // p, dtype=bf, device=dev)
    state = allgather_ops.allgather_state(ws)
    gathered = state.gathered(bf, m)

    def fused(i):
        moefuse.all_gather_rmsnorm(shards[i % n], w, workspace=ws, impl="triton", out=out)

    def gather(i):
        launch_allgather(ws, state, shards[i % n], gathered, True)

    def nccl(i):
        dist.all_gather_into_tensor(parts, shards[i % n], group=group)
        moefuse.rmsnorm(parts.permute(1, 0, 2).reshape(m, h), w, out=out)

    def check(name, seed):
        env = variant_env(name, h)
        return lambda: check_bitwise(moefuse, ws, group, h, m, seed, env)

    runs = [(name, fused, variant_env(name, h), check(name, 1000 + k))
            for k, name in enumerate(VARIANTS)]  # fmt: skip
    runs += [("gather", gather, {}, None), ("nccl+rmsnorm", nccl, {}, None)]
    times = {name: time_variant(harness, fn, env, group, f"{name} at H={h} M={m}",
                                calls=max(20, n), replays=replays, check=chk)
             for name, fn, env, chk in runs}  # fmt: skip
    try:
        ws.check()
    except RuntimeError as exc:  # a wait expired during a timed replay: say so, keep the run
        print(f"rank {rank}: H={h} M={m}: {exc}", flush=True)
    return times


def _worker(rank: int, world_size: int, args, init_method: str | None) -> None:
    dev = ranks.init_rank(rank, world_size, init_method)
    import torch.distributed as dist

    import moefuse
    from moefuse.bench import harness

    group = dist.group.WORLD
    tokens = [int(x) for x in args.tokens.split(",")]
    widths = [int(x) for x in args.hidden.split(",")]
    bw = peer_copy_gbps(group, dev, harness)
    rows = []
    for h in widths:
        for m in tokens:
            # one workspace per case, waits bounded at 15 s: a hung variant costs 15 s and fails
            # the later variants of its case only
            ws = moefuse.AllReduceWorkspace(group, m, h, torch.bfloat16, dev,
                                            oneshot_max_tokens=1, timeout_s=15,
                                            extra_regions=moefuse.allgather_regions(m, h))
            try:
                times = time_case(moefuse, harness, ws, group, h, m, args.replays)
            finally:
                ws.close()
            bound = (world_size - 1) * m * h * 2 / world_size / (bw * 1e9) * 1e6
            rows.append({"P": world_size, "H": h, "M": m, "bound_us": bound, "us": times,
                         "x_bound": {k: bound / v for k, v in times.items()}})  # fmt: skip
            if rank == 0:
                print(f"H={h} M={m} bound={bound:.1f} " + " ".join(
                    f"{k}={v:.1f}" for k, v in times.items()), flush=True)  # fmt: skip
    if rank == 0:
        print_table(rows, bw)
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "allgather_large.json")
        with open(path, "w") as f:
            json.dump({"peer_copy_GBps": bw, "meta": harness.run_metadata(), "rows": rows}, f,
                      indent=1)  # fmt: skip
        print("wrote", path)
    dist.barrier()
    dist.destroy_process_group()


def print_table(rows: list[dict], bw: float) -> None:
    """µs per variant, then time / NVLink bound of the default (``fused``), and the bar."""
    names = list(rows[0]["us"])
    print(f"\npeer-copy bandwidth {bw:.1f} GB/s; µs (x = NVLink bound / time)")
    print(f"{'H':>5} {'M':>6} {'bound':>7} " + " ".join(f"{n:>13}" for n in names))
    for r in rows:
        cells = [f"{r['us'][n]:7.1f} {r['x_bound'][n]:4.2f}x" for n in names]
        print(f"{r['H']:5d} {r['M']:6d} {r['bound_us']:7.1f} " + " ".join(cells))
    for r in rows:
        if r["M"] >= 4096:
            x = r["x_bound"]["fused"]
            print(f"BAR {'PASS' if x >= 0.8 else 'FAIL'}: H={r['H']} M={r['M']} fused "
                  f"{r['us']['fused']:.1f} us = {x:.2f} x bound (>= 0.8)")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(prog="bench_allgather_large")
    parser.add_argument("--out", default="bench/results", help="folder of allgather_large.json")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--hidden", default="4096,8192")
    parser.add_argument("--tokens", default="512,4096,16384")
    parser.add_argument("--replays", type=int, default=10)
    return ranks.run_ranks(_worker, parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
