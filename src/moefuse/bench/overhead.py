"""``python -m moefuse bench overhead``: host microseconds per eager call at decode size.

What a user feels in eager mode (prefill, Hugging Face models, notebooks): at M = 1 the GPU work
of an op takes 1-3 µs, so back-to-back eager calls run at the speed of their host code. Each op
is called ``--calls`` times back to back with one synchronize at the end; the row is wall time /
calls (the median of ``--repeats`` such runs), next to ``torch.nn.functional.rms_norm``, torch
eager equivalents and FlashInfer's calls where ``flashinfer`` imports (its rows are skipped with a
note otherwise). With ``--world-size P`` (P processes, one GPU each) the communication ops are
timed too, on rank 0, every rank calling in lockstep; on one GPU they run on two loopback ranks
(threads of this process), where each row also carries the calling thread's CPU time per call:
the rank's own host work, without the time it waited for the other rank's thread.

Writes ``overhead-<gpu>.json`` as ``{"meta": ..., "rows": [{"op", "impl", "us_per_call",
"thread_cpu_us_per_call"}, ...]}``
plus a bar plot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

H = 4096
HEADS, HEAD_DIM = 32, 128
TOP_K = 8
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def per_call_us(fns: list, calls: int, repeats: int) -> list[tuple[float, float]]:
    """Per function: (wall µs, thread CPU µs) per call, each the median over ``repeats`` rounds of
    ``calls`` back-to-back calls + one synchronize, divided by ``calls``. Rounds visit every
    function in turn, so that a slow spell of the host (other tenants, frequency changes) falls
    on all of them alike. The thread CPU time (``time.thread_time``) is the host work of this
    thread alone: where ranks run as threads of one process, it leaves out the time a rank waits
    for the GIL while the other rank runs its own calls, which the wall time includes."""
    for fn in fns:
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    walls: list[list[float]] = [[] for _ in fns]
    cpus: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, wall, cpu in zip(fns, walls, cpus):
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            wall.append((time.perf_counter() - t0) / calls * 1e6)
            cpu.append((time.thread_time() - c0) / calls * 1e6)
    return [(statistics.median(w), statistics.median(c)) for w, c in zip(walls, cpus)]


def single_gpu_cases(dev: torch.device) -> list[tuple[str, str, object]]:
    """(op, impl, fn) for every single-GPU public op (:func:`moefuse.bench.op_calls.
    single_gpu_calls`) and its baselines, at M = 1, BF16."""
    import torch.nn.functional as F

    from moefuse.bench.op_calls import single_gpu_calls

    bf = torch.bfloat16
    x = torch.randn(1, H, device=dev, dtype=bf)
    r = torch.randn_like(x)
    w = torch.randn(H, device=dev, dtype=bf)
    rows, plan, weights = _moe_inputs(dev)
    baselines = {
        "rmsnorm": ("rms_norm", lambda: F.rms_norm(x, (H,), w, 1e-6)),
        "fused_add_rmsnorm": ("fused_add_rmsnorm", lambda: _torch_fused_add(F, x, r, w)),
        "moe_finalize": ("moe_finalize", lambda: _torch_finalize(rows, plan, weights)),
    }
    calls, _ = single_gpu_calls(dev, m=1, h=H)
    cases = []
    for name, label, fn in calls:
        if name in baselines and label == name:
            base_op, base_fn = baselines.pop(name)
            cases.append((base_op, "torch", base_fn))
        cases.append((label, "moefuse", fn))
    return cases + _flashinfer_cases(x, r, w)


def _torch_fused_add(F, x, r, w):
    r.add_(x)
    x.copy_(F.rms_norm(r, (H,), w, 1e-6))


def _torch_finalize(rows, plan, weights):
    idx = plan.expanded_idx_to_permuted_idx.long()
    return (rows[idx].float() * weights.unsqueeze(-1)).sum(1).bfloat16()


def _moe_inputs(dev):
    from moefuse.bench.moe import make_inputs

    return make_inputs(1, TOP_K, H, dev)


def _flashinfer_cases(x, r, w) -> list:
    try:
        import flashinfer.norm as fin
    except Exception as exc:  # optional: the rows are skipped with a note
        print(f"flashinfer not importable ({type(exc).__name__}): its rows are skipped")
        return []
    return [
        ("rmsnorm", "flashinfer", lambda: fin.rmsnorm(x, w)),
        ("fused_add_rmsnorm", "flashinfer", lambda: fin.fused_add_rmsnorm(x, r, w)),
        ("gemma_rmsnorm", "flashinfer", lambda: fin.gemma_rmsnorm(x, w)),
        ("gemma_fused_add_rmsnorm", "flashinfer", lambda: fin.gemma_fused_add_rmsnorm(x, r, w)),
    ]


def comm_cases(dev: torch.device, group) -> tuple[list[tuple[str, str, object]], object]:
    """(op, impl, fn) for every public communication op at M = 1 (:func:`moefuse.bench.
    op_calls.comm_calls`) and NCCL's all-reduce where the group is NCCL; and ``close()``."""
    import torch.distributed as dist

    from moefuse.bench.op_calls import comm_calls

    calls, _, close = comm_calls(dev, group, m=1, h=H)
    cases = [(name, "moefuse", fn) for name, fn in calls]
    if "nccl" in str(dist.get_backend(group)).lower():
        x = torch.randn(1, H, device=dev, dtype=torch.bfloat16)
        cases.append(("all_reduce", "nccl", lambda: dist.all_reduce(x, group=group)))
    return cases, close


def _loopback_rank(rank: int, world_size: int, calls: int, repeats: int) -> list[dict]:
    """One loopback rank (a thread; :mod:`moefuse.testing_ranks`): every communication op's
    host µs per eager call, both ranks calling in lockstep on one GPU."""
    import torch.distributed as dist

    dev = torch.device("cuda", torch.cuda.current_device())
    cases, close = comm_cases(dev, None)
    rows = _measure(cases, calls, repeats, rank0=rank == 0)
    dist.barrier()  # closing drops every launch plan: not before both ranks have read theirs
    close()
    for r in rows:
        r.update(P=world_size, ranks="loopback")
    return rows


def _measure(cases, calls, repeats, rank0=True) -> list[dict]:
    rows = []
    times = per_call_us([fn for _, _, fn in cases], calls, repeats)
    for (op, impl, _), (us, cpu_us) in zip(cases, times):
        row = {"op": op, "impl": impl, "us_per_call": us, "thread_cpu_us_per_call": cpu_us}
        if impl == "moefuse":
            row["launch_plan"] = _plan_state(op)
        rows.append(row)
        if rank0:
            print(
                f"{op:38s} {impl:8s} {us:8.2f} us/call {cpu_us:8.2f} us CPU  "
                f"{row.get('launch_plan', '')}",
                flush=True,
            )
    return rows


def _plan_state(op: str) -> str:
    """Whether the timed calls replayed an eager launch plan ("replayed"), or why not."""
    import moefuse
    from moefuse import _fastpath

    fn = getattr(moefuse, op.split("(")[0])
    if _fastpath.plan_count(fn):
        return "replayed"
    return "slow path: " + "; ".join(_fastpath.refusals(fn) or ["no plan recorded"])


#: which time of a communication row the 1.5 x bar reads, per kind of ranks
_COMM_BAR_TIME = {"loopback": "thread_cpu_us_per_call", "gpus": "us_per_call"}


def add_ratios(rows: list[dict]) -> list[str]:
    """Ratios to F.rms_norm and to FlashInfer's call of the same op (in place in ``rows``)."""
    base = next((r["us_per_call"] for r in rows if r["op"] == "rms_norm"), None)
    fi = {r["op"]: r["us_per_call"] for r in rows if r["impl"] == "flashinfer"}
    lines = []
    ar = {
        r.get("ranks"): r
        for r in rows
        if r["op"] == "allreduce_residual_rmsnorm" and r["impl"] == "moefuse"
    }
    for r in rows:
        if r["impl"] == "moefuse" and r.get("ranks") in ar:  # communication ops: same run
            # loopback ranks share one process: the bar reads each rank's own host work (thread
            # CPU time); the wall ratio, which holds the other rank's calls too, is kept beside it
            key = _COMM_BAR_TIME[r["ranks"]]
            r["x_allreduce_residual_rmsnorm"] = x = r[key] / ar[r["ranks"]][key]
            r["x_allreduce_residual_rmsnorm_wall"] = (
                r["us_per_call"] / ar[r["ranks"]]["us_per_call"]
            )
            ok = x <= 1.5 and r.get("launch_plan") == "replayed"
            lines.append(
                f"{'PASS' if ok else 'FAIL'} {r['op']} [{r['ranks']}]: "
                f"{r[key]:.2f} us ({key}) = {x:.2f} x allreduce_residual_rmsnorm "
                f"(bar <= 1.5, replayed: {r.get('launch_plan')}; wall "
                f"{r['us_per_call']:.2f} us = {r['x_allreduce_residual_rmsnorm_wall']:.2f} x)"
            )
        if r["impl"] != "moefuse" or base is None or r.get("ranks") == "loopback":
            continue
        r["x_rms_norm"] = r["us_per_call"] / base
        op = r["op"].split("(")[0]
        limit = 2.0 if op.startswith("allreduce") else 1.2
        ok = r["x_rms_norm"] <= limit
        lines.append(
            f"{'PASS' if ok else 'FAIL'} {r['op']}: {r['us_per_call']:.2f} us = "
            f"{r['x_rms_norm']:.2f} x F.rms_norm (bar <= {limit})"
        )
        if op in fi:
            r["x_flashinfer"] = r["us_per_call"] / fi[op]
            ok = r["x_flashinfer"] <= 1.5
            lines.append(
                f"{'PASS' if ok else 'FAIL'} {r['op']}: {r['x_flashinfer']:.2f} x "
                "FlashInfer (bar <= 1.5)"
            )
    return lines


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "moefuse": "tab:blue",
        "torch": "tab:gray",
        "flashinfer": "tab:orange",
        "nccl": "tab:green",
    }
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(rows) + 1.2))
    labels = [f"{r['op']} [{r['impl']}]" for r in rows]
    ax.barh(
        range(len(rows)),
        [r["us_per_call"] for r in rows],
        color=[colors.get(r["impl"], "tab:purple") for r in rows],
    )
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    base = next((r["us_per_call"] for r in rows if r["op"] == "rms_norm"), None)
    if base:
        ax.axvline(base * 1.2, color="red", ls="--", lw=0.8, label="1.2 x F.rms_norm")
        ax.legend(fontsize=7)
    ax.set_xlabel("host µs per eager call (M = 1, H = 4096, BF16)")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _worker(rank: int, world_size: int, args, init: str | None, queue=None) -> None:
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=world_size)
    dev = torch.device("cuda", rank)
    cases, close = comm_cases(dev, dist.group.WORLD)
    rows = _measure(cases, args.calls, args.repeats, rank0=rank == 0)
    for r in rows:
        r["op"] = f"{r['op']} (P={world_size})" if r["impl"] != "moefuse" else r["op"]
        r.update(P=world_size, ranks="gpus")
    close()
    dist.destroy_process_group()
    if rank == 0 and queue is not None:
        queue.put(rows)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moefuse bench overhead")
    parser.add_argument("--save", action="store_true", help="write JSON + PNG under --out")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        help="time the communication ops on P GPUs (default: every GPU there "
        "when there are two or more; on one GPU two loopback ranks; 0: skip)",
    )
    parser.add_argument(
        "--ops", default="", help="comma-separated single-GPU ops to time (F.rms_norm always)"
    )
    parser.add_argument("--tag", default="", help="results file overhead-<gpu>-<tag>.json")
    args = parser.parse_args(argv)
    # the loopback ranks share one context: every module loaded at start-up (moefuse.testing_ranks)
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    if not torch.cuda.is_available():
        print("bench overhead needs a CUDA GPU (host time of eager calls on the real launcher)")
        return 2
    from moefuse.bench import harness

    dev = torch.device("cuda", 0)
    cases = single_gpu_cases(dev)
    if args.ops:
        keep = set(args.ops.split(",")) | {"rms_norm"}
        cases = [c for c in cases if c[0] in keep]
    rows = _measure(cases, args.calls, args.repeats)
    world = torch.cuda.device_count() if args.world_size is None else args.world_size
    if world == 1 or (world >= 2 and torch.cuda.device_count() < world):
        from moefuse.testing_ranks import run_loopback_ranks

        print(
            "communication ops on two loopback ranks (threads of this process, one GPU): "
            "host time with two ranks sharing one Python process"
        )
        rows += run_loopback_ranks(
            _loopback_rank, 2, dev, args.calls, args.repeats, timeout_s=1200
        )[0]
    elif world >= 2:
        import torch.multiprocessing as mp

        from moefuse.bench.ranks import free_port

        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        init = f"tcp://127.0.0.1:{free_port()}"
        procs = [
            ctx.Process(target=_worker, args=(r, args.world_size, args, init, queue))
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        rows += queue.get(timeout=600)
        for p in procs:
            p.join()
    bars = add_ratios(rows)
    print("\n".join(bars))
    if args.save:
        meta = harness.run_metadata()
        meta.update(
            method="host µs per eager call: wall time of back-to-back calls with one "
            "final synchronize / calls, median of repeats, and the calling thread's CPU time "
            "over the same calls (thread_cpu_us_per_call); M = 1, H = 4096, BF16; the "
            "communication rows' 1.5 x bar reads the thread CPU time on loopback ranks (two "
            "ranks as threads of one process, whose wall time holds both ranks' calls) and the "
            "wall time on one process per GPU",
            calls=args.calls,
            repeats=args.repeats,
            bar=bars,
        )
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        import json

        stem = out / f"overhead-{harness.gpu_slug()}{'-' + args.tag if args.tag else ''}"
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        plot(rows, stem.with_suffix(".png"), f"moefuse eager host overhead on {meta['gpu']}")
        print(f"wrote {stem}.json / .png")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
