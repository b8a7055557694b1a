"""Cost and latency of the no-sync fault check on 2 GPUs.

Per rank, on a workspace with H = 4096 (BF16):
1. ``ws.raise_if_failed()`` and ``ws.failed()`` on a healthy workspace: ns per call (the check
   every op makes before it launches; target well under 1 us);
2. CUDA-graph replay time of ``allreduce_residual_rmsnorm`` (one-shot, M = 1 / 64 / 512): median
   us per replay over the ranks' max, to compare with notes/comm-all-reduce.md (3.3 / 6.0 / 17.3 us
   before the fault check was added to the kernels);
3. detection latency: rank 1 skips one replay; rank 0 polls ``ws.failed()`` in a Python loop
   WITHOUT any sync and records when the fault appears (expected ~timeout_s after the replay;
   the loop must see it while nothing synchronized the stream).

Writes ``comm-faults-p2.json`` into ``--out`` (default bench/results) and prints one line per item.

GPU (2 x H200, ~1 min):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=src python scripts/bench_comm_faults.py --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import timeit

import torch

H = 4096
TOKENS = (1, 64, 512)
TIMEOUT_S = 2.0


def _graph(moefuse, ws, m, dev):
    from moefuse.testing import capture_graph

    x = torch.randn(m, H, device=dev).to(torch.bfloat16)
    res = torch.randn_like(x)
    w = torch.ones(H, dtype=torch.bfloat16, device=dev)
    ro, no = torch.empty_like(x), torch.empty_like(x)
    run = lambda: moefuse.allreduce_residual_rmsnorm(  # noqa: E731
        x, res, w, workspace=ws, algorithm="oneshot", impl="triton", residual_out=ro, norm_out=no)
    return capture_graph(run, ws)


def _replay_us(graph, dist, replays=200, repeats=7) -> float:
    """Median over ``repeats`` of the mean time of ``replays`` back-to-back replays (us), max over
    the ranks (a collective is as slow as its slowest rank)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / replays)
    t = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def worker(rank, world_size, init, out_dir):
    from moefuse.bench.all_reduce import NO_MULTICAST

    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    import torch.distributed as dist

    import moefuse

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world_size)
    result = {"gpu": torch.cuda.get_device_name(dev), "world_size": world_size, "hidden": H}

    ws = moefuse.AllReduceWorkspace(None, max(TOKENS), H, torch.bfloat16, dev,
                                    oneshot_max_tokens=max(TOKENS))  # fmt: skip
    n = 1_000_000
    per_call_ns = lambda fn: min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e9  # noqa: E731
    result["raise_if_failed_ns"] = per_call_ns(ws.raise_if_failed)
    result["failed_ns"] = per_call_ns(ws.failed)
    result["replay_us"] = {}
    for m in TOKENS:
        result["replay_us"][m] = _replay_us(_graph(moefuse, ws, m, dev), dist)
    ws.check()
    ws.close()

    # detection latency without a sync
    ws = moefuse.AllReduceWorkspace(None, 1, H, torch.bfloat16, dev, timeout_s=TIMEOUT_S)
    graph = _graph(moefuse, ws, 1, dev)
    graph.replay()
    ws.check()
    dist.barrier()
    if rank == 0:
        done = torch.cuda.Event()
        t0 = time.monotonic()
        graph.replay()  # rank 1 skips it
        done.record()
        seen = None
        while time.monotonic() - t0 < TIMEOUT_S + 30:
            if ws.failed() is not None:  # a host load, no sync
                seen = time.monotonic() - t0
                break
        result["detect_s"] = seen
        result["stream_done_when_seen"] = done.query()
        result["message"] = ws.failed()
    dist.barrier()
    ws.close()

    if rank == 0:
        print(f"raise_if_failed: {result['raise_if_failed_ns']:.0f} ns/call, failed(): "
              f"{result['failed_ns']:.0f} ns/call", flush=True)  # fmt: skip
        for m, us in result["replay_us"].items():
            print(f"one-shot graph replay H={H} M={m}: {us:.2f} us (max over ranks)", flush=True)
        print(f"fault seen by ws.failed() without a sync after {result['detect_s']} s "
              f"(timeout_s={TIMEOUT_S}); message: {result['message']}", flush=True)  # fmt: skip
        os.makedirs(out_dir, exist_ok=True)
        path = os.path.join(out_dir, "comm-faults-p2.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {path}", flush=True)
    dist.destroy_process_group()


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="bench_comm_faults")
    parser.add_argument("--out", default=os.path.join("bench", "results"))
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, found {torch.cuda.device_count()}")
        return 2
    import torch.multiprocessing as mp

    from moefuse.bench.ranks import free_port as _free_port

    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(worker, args=(2, init, args.out), nprocs=2, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
