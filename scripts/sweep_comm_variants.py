"""Sweep the experimental one-shot variants (notes/comm-all-reduce.md "Mid-size one-shot",
2026-11-29) of
``allreduce_residual_rmsnorm`` on 2 GPUs: per (H, M), every variant is first checked bitwise
against the default kernel on fresh random data containing -0.0 (three calls each, so the Lamport
generations cycle), then timed like ``moefuse bench all-reduce`` (CUDA-graph replays, inputs
rotated over sets larger than L2, max over ranks of the median). One line per (H, M).

GPU (2 x H200, ~2-3 min with a cold Triton cache):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        PYTHONPATH=src python scripts/sweep_comm_variants.py
    (or under ``torchrun --nproc-per-node 2``; ``--tokens``, ``--hidden``, ``--variants`` narrow it)
No GPU: ``--compile-only`` compiles every variant for sm_90a and reports ptxas registers/spills;
``--cpu`` runs the bitwise checks in Triton's interpreter over 2 CPU processes (no timing).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch

KEYS = ("MOEFUSE_COMM_ONESHOT_PREFETCH", "MOEFUSE_COMM_ROWS_PER_CTA", "MOEFUSE_COMM_ONESHOT_WARPS")
PF, ROWS, WARPS = KEYS
#: name -> environment (moefuse.comm.tiles.OneshotVariant); "default" must stay first
VARIANTS = {
    "default": {},
    "prefetch": {PF: "1"},
    "pf+r2": {PF: "1", ROWS: "2"},
    "pf+r4": {PF: "1", ROWS: "4"},
    "pf+r8": {PF: "1", ROWS: "8"},
    "pf+w4": {PF: "1", WARPS: "4"},  # H <= 4096 only (235 registers; spills at 7168)
    "pf+r3": {PF: "1", ROWS: "3"},
    "pf+r6": {PF: "1", ROWS: "6"},
}
TOKENS = [1, 8, 64, 128, 512, 2048]
WIDTHS = [4096, 7168]
#: H = 4096, P = 2 targets: FlashInfer's one-shot latency on H200 / 1.15
TARGET_US = {1: 4.0, 8: 5.2 / 1.15, 64: 6.6 / 1.15, 512: 19.5 / 1.15}


@contextlib.contextmanager
def variant_env(env: dict):
    """Set the variant's knobs; launch plans recorded them, so they are dropped on both sides."""
    from moefuse import _fastpath

    saved = {k: os.environ.pop(k) for k in KEYS if k in os.environ}
    os.environ.update(env)
    _fastpath.clear()
    try:
        yield
    finally:
        for k in KEYS:
            os.environ.pop(k, None)
        os.environ.update(saved)
        _fastpath.clear()


def make_inputs(m, h, rank, dev, seed):
    """This rank's partial (random, ~3 % -0.0, column 0 all -0.0 on every rank, one +0.0 column)
    and the replicated residual and weight."""
    g = torch.Generator(device=dev).manual_seed(seed * 7919 + rank)
    x = torch.randn(m, h, generator=g, device=dev)
    x = torch.where(torch.rand(m, h, generator=g, device=dev) < 0.03, -0.0, x)
    x[:, 0] = -0.0
    x[:, 1] = 0.0
    g.manual_seed(seed)  # replicated on every rank
    res = torch.randn(m, h, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.rand(h, generator=g, device=dev) + 0.5).to(torch.bfloat16)
    return x.to(torch.bfloat16), res, w


def same_bits(a, b) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def check_case(moefuse, ws, group, m, h, names, seed) -> list[str]:
    """Problems found on any rank (empty: every variant gave the default's bits, and the
    default's residual_out equals the oracle's)."""
    import torch.distributed as dist

    from moefuse.comm.all_reduce import reference as ref

    rank = dist.get_rank(group)
    x, res, w = make_inputs(m, h, rank, ws.device, seed)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x, group=group)
    h_ref, _ = ref.allreduce_residual_rmsnorm_from_partials([p.cpu() for p in parts], res.cpu(),
                                                            w.cpu())  # fmt: skip
    bad = []
    base = None
    for name in names:
        with variant_env(VARIANTS[name]):
            for rep in range(3):
                o = moefuse.allreduce_residual_rmsnorm(x, res, w, workspace=ws,
                                                       algorithm="oneshot", impl="triton")
                base = base or o
                if not all(same_bits(a, b) for a, b in zip(o, base)):
                    bad.append(f"{name} call {rep}")
        ws.check()
    if not same_bits(base[0].cpu(), h_ref):
        bad.append("default residual_out vs oracle")
    flag = torch.tensor([len(bad)], device=ws.device if ws.device.type == "cuda" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() and not bad:
        bad.append("(another rank)")
    return [f"rank {rank}: {b}" for b in bad]


def time_case(moefuse, harness, ws, group, m, h, names, replays) -> dict[str, float]:
    import torch.distributed as dist

    dev = ws.device
    cuda = dev.type == "cuda"
    n = harness.rotation_sets(4 * m * h * 2) if cuda else 2
    sets = [make_inputs(m, h, dist.get_rank(group), dev, 100 + i) for i in range(n)]
    outs = [(torch.empty_like(s[0]), torch.empty_like(s[0])) for s in sets]

    def fn(i):
        x, res, w = sets[i % n]
        return moefuse.allreduce_residual_rmsnorm(
            x, res, w, workspace=ws, algorithm="oneshot", impl="triton",
            residual_out=outs[i % n][0], norm_out=outs[i % n][1],
        )  # fmt: skip

    times = {}
    for name in names:
        with variant_env(VARIANTS[name]):
            dist.barrier(group=group)
            if cuda:
                torch.cuda.synchronize(dev)
                us = harness.graph_time_us(fn, calls=max(20, n), replays=replays)
            else:  # --cpu: exercises the plumbing only (interpreter wall time)
                start = time.perf_counter()
                for i in range(n):
                    fn(i)
                us = (time.perf_counter() - start) / n * 1e6
        t = torch.tensor([us], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times[name] = float(t.item())
    ws.check()
    return times


def worker(rank, world_size, args, init_method) -> None:
    from moefuse.bench.all_reduce import NO_MULTICAST

    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    import torch.distributed as dist

    import moefuse
    from moefuse.bench import harness

    cpu = args.cpu
    if cpu:
        dev = torch.device("cpu")
    else:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    kw = {} if init_method is None else dict(init_method=init_method, rank=rank,
                                             world_size=world_size)  # fmt: skip
    dist.init_process_group("gloo" if cpu else "nccl", **kw)
    group = dist.group.WORLD
    rank = dist.get_rank()
    chosen = ["default"] + [v for v in args.variants.split(",") if v and v != "default"]
    tokens = [int(t) for t in args.tokens.split(",")]
    widths = [int(h) for h in args.hidden.split(",")]
    failures = 0
    for h in widths:
        names = [v for v in chosen if not (v.endswith("w4") and h > 4096)]
        ws = moefuse.AllReduceWorkspace(group, max(tokens), h, torch.bfloat16, dev,
                                        oneshot_max_tokens=max(tokens))  # fmt: skip
        for m in tokens:
            bad = check_case(moefuse, ws, group, m, h, names, seed=m * 131 + h)
            failures += bool(bad)
            line = f"H={h:5d} M={m:5d} bitwise={'OK' if not bad else 'MISMATCH'}"
            if not cpu or args.cpu_timing:
                t = time_case(moefuse, harness, ws, group, m, h, names, args.replays)
                best = min(t, key=t.get)
                line += " " + " ".join(f"{k}={v:7.2f}" for k, v in t.items())
                line += f"  best={best} {t[best]:.2f} us (x{t['default'] / t[best]:.3f})"
                if h == 4096 and world_size == 2 and m in TARGET_US:
                    ok = t[best] <= TARGET_US[m]
                    line += f" target<={TARGET_US[m]:.2f} {'PASS' if ok else 'FAIL'}"
            if rank == 0:
                print(line + ("  " + "; ".join(bad) if bad else ""), flush=True)
        ws.close()
    dist.barrier()
    dist.destroy_process_group()
    if failures:
        raise SystemExit(1)


# ----------------------------------------------------------------------------- offline compile
def compile_only(widths, dump=None) -> None:
    """Every variant's one-shot kernel for sm_90a (P = 2, BF16, pattern 1): registers, spills."""
    import re

    import triton
    from _ptxas import TARGET, ptxas_report, specialised_source

    from moefuse.comm.all_reduce import kernels as ct
    from moefuse.comm.tiles import comm_tile

    types = {"q_ptr": "*u8", "sf_ptr": "*u8", "scale_ptr": "*fp32", "table_ptr": "*i64",
             "ctrl_ptr": "*i32", "clock_ptr": "*i32", "eps": "fp32", "weight_bias": "fp32",
             "Hf": "fp32"}  # fmt: skip
    seen = set()
    for h in widths:
        tile = comm_tile(h, 1)
        for name, env in VARIANTS.items():
            with variant_env(env):
                from moefuse.comm.tiles import oneshot_variant

                var = oneshot_variant()
            kernel = ct._oneshot_prefetch_kernel if var.prefetch else ct._oneshot_kernel
            warps = var.num_warps or tile.num_warps
            key = (h, kernel.fn.__name__, warps)
            if key in seen:
                continue
            seen.add(key)
            consts = dict(P=2, BLOCK_H=tile.block, BITS=16, PATTERN=1, WRITE_NORM=True, LAYOUT=0,
                          KP_BLOCK=tile.kp_block, FP32_ACC=True, USE_PDL=True,
                          PTX=True)  # fmt: skip
            src = specialised_source(  # as the launcher's specialization
                kernel, consts, types,
                lambda name, _: name.endswith(("_ptr", "_st")) or name in ("H", "cap"),
            )  # fmt: skip
            ck = triton.compile(src, target=TARGET, options={"num_warps": warps})
            ptx = ck.asm["ptx"]
            report = ptxas_report(ptx)
            v4 = len(re.findall(r"ld\.volatile\.global\.v4", ptx))
            if dump:  # PTX and TTGIR of each variant, to diff or read offline
                for ext, text in (("ptx", ptx), ("ttgir", ck.asm["ttgir"])):
                    with open(os.path.join(dump, f"{name}-{h}.{ext}"), "w") as f:
                        f.write(text)
            print(f"H={h:5d} {name:9s} kernel={kernel.fn.__name__:24s} warps={warps:2d} "
                  f"regs={report.regs} spills={report.spills} "
                  f"ld.volatile.v4={v4} ptxas_rc={report.returncode}", flush=True)  # fmt: skip


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="sweep_comm_variants")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--hidden", default=",".join(map(str, WIDTHS)))
    parser.add_argument("--variants", default=",".join(VARIANTS), help="names of VARIANTS")
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--compile-only", action="store_true", help="sm_90a compile, no GPU")
    parser.add_argument("--dump-ptx", default=None, help="--compile-only: write PTX/TTGIR here")
    parser.add_argument("--cpu", action="store_true", help="bitwise checks in the interpreter")
    parser.add_argument("--cpu-timing", action="store_true",
                        help="with --cpu: also run the timing loop (interpreter wall time)")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS) - {""}
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    if args.compile_only:
        compile_only([int(h) for h in args.hidden.split(",")], args.dump_ptx)
        return 0
    if args.cpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if args.tokens == ",".join(map(str, TOKENS)):
            args.tokens, args.hidden = "1,5,17", "48,64"
    from moefuse.bench.ranks import NO_MULTICAST
    from moefuse.bench.ranks import free_port as _free_port

    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return 0
    if not args.cpu and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, found {torch.cuda.device_count()}")
        return 2
    import torch.multiprocessing as mp

    init = f"tcp://127.0.0.1:{_free_port()}"
    mp.start_processes(worker, args=(2, args, init), nprocs=2, start_method="spawn")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
