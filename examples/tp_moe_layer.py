"""A tensor-parallel MoE layer on P ranks, with moefuse's fused epilogue and the unfused one.

    torchrun --nproc-per-node 2 examples/tp_moe_layer.py                 # GPUs (NCCL)
    torchrun --nproc-per-node 2 examples/tp_moe_layer.py --device cpu    # CPU (gloo), for CI

Sharding: TENSOR parallelism of the expert intermediate dimension. Every rank holds all E experts,
but only columns ``[r*I/P, (r+1)*I/P)`` of each expert's gate and up projections and the matching
rows of its down projection, so its GEMM2 output rows are partial sums over its slice of I. The
tokens (and the routing) are replicated. Per layer, on every rank::

    topk_w, topk_ids = route_topk(x @ router.T, K)             # softmax top-K, renormalized
    plan = sort_by_expert(topk_ids, E);  xp = moe_permute(x, plan)
    y_r  = grouped GEMM(silu(gate_r) * up_r, down_r)           # [M*K, H] partial rows
    epilogue:  residual_out = residual + sum_r finalize(y_r);  norm_out = RMSNorm(residual_out)

Epilogues compared (both produce ``residual_out`` and ``norm_out``, replicated):
* fused (moefuse): ``moefuse.moe_finalize_allreduce_residual_rmsnorm`` when this moefuse has it
  (finalize inside the all-reduce kernel), else ``moefuse.moe_finalize`` +
  ``moefuse.allreduce_residual_rmsnorm`` (peer-memory all-reduce + residual + RMSNorm, one kernel);
* unfused (PyTorch / NCCL): weighted gather-sum finalize in torch, ``dist.all_reduce``, residual
  add and the RMSNorm as transformers writes it.

The script checks that the two agree (BF16: the reduction orders differ, so within a few BF16 ulps
of the output scale) and that the fused outputs are bitwise identical on all ranks, then prints the
latency per layer (the whole layer and the epilogue alone; max over ranks; CUDA-graph replays on
GPU, falling back to CUDA events on eager launches if a capture fails; wall clock on CPU) at the
decode and prefill token counts. ``--out DIR`` also writes ``tp_moe_layer-p{P}.json`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import moefuse
from moefuse.bench.harness import run_metadata
from moefuse.integrations._experts import grouped_linear
from moefuse.moe.routing import route_topk, sort_by_expert


# ----------------------------------------------------------------------------- the layer
class ShardedMoE:
    """This rank's shard of one MoE layer (weights identical on every rank's seed)."""

    def __init__(self, args, rank: int, world: int, device, dtype):
        if args.inter % world:
            raise ValueError(f"--inter {args.inter} must be divisible by the world size {world}")
        # drawn on the device (GiBs of weights at the GPU defaults); the same seed on every rank
        # gives every rank the same full weights, of which it keeps its slice
        g = torch.Generator(device=device).manual_seed(args.seed)
        e, h, i = args.experts, args.hidden, args.inter

        def w(*shape):
            t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32)
            return (t / shape[-1] ** 0.5).to(dtype)

        router, w13, w2 = w(e, h), w(e, 2 * i, h), w(e, h, i)
        self.norm_weight = (torch.rand(h, generator=g, device=device) + 0.5).to(dtype)
        lo, hi = rank * i // world, (rank + 1) * i // world
        self.router = router
        # gate rows then up rows of this rank's slice, kept in the [gate; up] layout
        self.w13 = torch.cat([w13[:, lo:hi], w13[:, i + lo : i + hi]], 1).contiguous()
        self.w2 = w2[:, :, lo:hi].contiguous()
        del w13, w2
        self.top_k, self.experts, self.eps = args.topk, e, 1e-6
        self.device, self.dtype, self.impl = device, dtype, args.impl

    def experts_partial(self, x):
        """Routing + both grouped GEMMs: (GEMM2 partial rows [M*K, H], plan, topk weights)."""
        logits = F.linear(x, self.router)
        topk_w, topk_ids = route_topk(logits, self.top_k)
        plan = sort_by_expert(topk_ids, self.experts)
        xp = moefuse.moe_permute(x, plan.permuted_idx_to_expanded_idx, self.top_k,
                                 impl=self.impl)  # fmt: skip
        hmid = grouped_linear(xp, self.w13, plan.expert_offsets)
        half = hmid.shape[1] // 2
        act = F.silu(hmid[:, :half]) * hmid[:, half:]
        y = grouped_linear(act, self.w2, plan.expert_offsets)
        return y, plan, topk_w


def fused_epilogue(layer, ws, y, plan, topk_w, residual, out):
    """moefuse: finalize + all-reduce + residual + RMSNorm (writes ``out`` = (res_out, norm))."""
    res_out, norm_out = out
    if hasattr(moefuse, "moe_finalize_allreduce_residual_rmsnorm"):
        moefuse.moe_finalize_allreduce_residual_rmsnorm(
            y, residual, layer.norm_weight, plan.expanded_idx_to_permuted_idx, workspace=ws,
            expert_scale_factor=topk_w, eps=layer.eps, accumulate="fp32",
            residual_out=res_out, norm_out=norm_out, impl=layer.impl,
        )  # fmt: skip
        return
    partial = moefuse.moe_finalize(y, plan.expanded_idx_to_permuted_idx, topk_w, impl=layer.impl)
    moefuse.allreduce_residual_rmsnorm(partial, residual, layer.norm_weight, workspace=ws,
                                       eps=layer.eps, residual_out=res_out, norm_out=norm_out,
                                       impl=layer.impl)  # fmt: skip


def unfused_epilogue(layer, y, plan, topk_w, residual, out):
    """PyTorch / NCCL: gather-sum finalize, all_reduce, residual add, transformers' RMSNorm."""
    res_out, norm_out = out
    m, k = topk_w.shape
    idx = plan.expanded_idx_to_permuted_idx.clamp(min=0).long().view(-1)
    rows = y.index_select(0, idx).view(m, k, -1).float()
    partial = (rows * topk_w.float().unsqueeze(-1)).sum(1).to(y.dtype)
    dist.all_reduce(partial)
    torch.add(partial, residual, out=res_out)
    hf = res_out.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + layer.eps)
    torch.mul(layer.norm_weight, hf.to(res_out.dtype), out=norm_out)


# ----------------------------------------------------------------------------- timing
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fn(fn, device, iters: int, use_graph: bool) -> tuple[float, str]:
    """Median µs per call of ``fn`` (CUDA graph of ``fn`` replayed when possible)."""
    fn()
    _sync(device)
    if device.type != "cuda":
        samples = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(samples), "wall"
    mode, run = "eager", fn
    if use_graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            run, mode = graph.replay, "graph"
        except Exception as exc:  # report, then time eager launches
            print(f"[rank {dist.get_rank()}] CUDA graph capture failed ({exc}); timing eager")
            torch.cuda.synchronize()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3)
    return statistics.median(samples), mode


def max_over_ranks(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


# ----------------------------------------------------------------------------- run
def run_case(args, layer, ws, phase: str, m: int, device, world: int) -> dict:
    """Check and time one token count (every rank)."""
    g = torch.Generator().manual_seed(args.seed + m)
    x = torch.randn(m, args.hidden, generator=g).to(layer.dtype).to(device)
    residual = torch.randn(m, args.hidden, generator=g).to(layer.dtype).to(device)
    fused = (torch.empty_like(x), torch.empty_like(x))
    plain = (torch.empty_like(x), torch.empty_like(x))
    y, plan, topk_w = layer.experts_partial(x)
    fused_epilogue(layer, ws, y, plan, topk_w, residual, fused)
    unfused_epilogue(layer, y, plan, topk_w, residual, plain)
    _sync(device)
    # agreement: both sum the same partials, in other orders and roundings (BF16)
    scale = float(plain[0].float().abs().max()) or 1.0
    err_res = float((fused[0].float() - plain[0].float()).abs().max()) / scale
    nscale = float(plain[1].float().abs().max()) or 1.0
    err_norm = float((fused[1].float() - plain[1].float()).abs().max()) / nscale
    if err_res > args.rtol or err_norm > args.rtol:
        raise AssertionError(f"M={m}: fused and unfused epilogues disagree: residual "
                             f"{err_res:.2e}, norm {err_norm:.2e} (relative to the "
                             f"largest value; limit {args.rtol:g})")  # fmt: skip
    gathered = [torch.empty_like(fused[0]) for _ in range(world)]
    dist.all_gather(gathered, fused[0].contiguous())
    same = all(torch.equal(t.view(torch.int16), gathered[0].view(torch.int16))
               for t in gathered)  # fmt: skip
    if not same:
        raise AssertionError(f"M={m}: fused residual_out differs between ranks")

    def layer_fused():
        yy, pp, ww = layer.experts_partial(x)
        fused_epilogue(layer, ws, yy, pp, ww, residual, fused)

    def layer_plain():
        yy, pp, ww = layer.experts_partial(x)
        unfused_epilogue(layer, yy, pp, ww, residual, plain)

    row = {"phase": phase, "tokens": m, "err_residual": err_res, "err_norm": err_norm}
    for name, fn in (
        ("epilogue_fused", lambda: fused_epilogue(layer, ws, y, plan, topk_w, residual,
                                                  fused)),
        ("epilogue_unfused", lambda: unfused_epilogue(layer, y, plan, topk_w, residual,
                                                      plain)),
        ("layer_fused", layer_fused),
        ("layer_unfused", layer_plain),
    ):  # fmt: skip
        us, mode = time_fn(fn, device, args.iters, not args.eager)
        row[name + "_us"] = max_over_ranks(us, device)
        row["timing"] = mode
    row["epilogue_speedup"] = row["epilogue_unfused_us"] / row["epilogue_fused_us"]
    row["layer_speedup"] = row["layer_unfused_us"] / row["layer_fused_us"]
    return row


def run(args) -> dict:
    """The comparison on an initialized process group; returns the results (every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16
    layer = ShardedMoE(args, rank, world, device, dtype)
    sizes = [("decode", m) for m in args.decode] + [("prefill", m) for m in args.prefill]
    ws = moefuse.AllReduceWorkspace(None, max(m for _, m in sizes), args.hidden, dtype, device)
    rows = []
    try:
        for phase, m in sizes:
            rows.append(run_case(args, layer, ws, phase, m, device, world))
    finally:
        _sync(device)
        dist.barrier()
        ws.close()
    fused_name = ("moe_finalize_allreduce_residual_rmsnorm"
                  if hasattr(moefuse, "moe_finalize_allreduce_residual_rmsnorm")
                  else "moe_finalize + allreduce_residual_rmsnorm")  # fmt: skip
    meta = {**run_metadata(), "world_size": world} if device.type == "cuda" else {}
    result = {"meta": meta, "world_size": world, "device": str(device), "fused": fused_name,
              "sharding": "TP of the expert intermediate dim", "hidden": args.hidden,
              "experts": args.experts, "top_k": args.topk, "inter": args.inter,
              "rows": rows}  # fmt: skip
    if rank == 0:
        print(f"TP MoE layer, P={world}, {device}, H={args.hidden} E={args.experts} "
              f"K={args.topk} I={args.inter} (I/P={args.inter // world} per rank), BF16; "
              f"fused = {fused_name}; max over ranks, median of {args.iters}")  # fmt: skip
        print(f"{'phase':8} {'M':>6} {'epi fused':>10} {'epi unfused':>11} {'x':>5} "
              f"{'layer fused':>11} {'layer unfused':>13} {'x':>5}  timing")  # fmt: skip
        for r in rows:
            print(f"agreement M={r['tokens']}: fused vs unfused within {args.rtol:g} (residual "
                  f"{r['err_residual']:.2e}, norm {r['err_norm']:.2e}); fused residual_out "
                  f"bitwise identical on all {world} ranks")  # fmt: skip
        if device.type != "cuda":
            print("CPU run: the kernels ran in Triton's interpreter; the times below check the "
                  "script, they are not performance figures")  # fmt: skip
        for r in rows:
            print(f"{r['phase']:8} {r['tokens']:6d} {r['epilogue_fused_us']:10.1f} "
                  f"{r['epilogue_unfused_us']:11.1f} {r['epilogue_speedup']:5.2f} "
                  f"{r['layer_fused_us']:11.1f} {r['layer_unfused_us']:13.1f} "
                  f"{r['layer_speedup']:5.2f}  {r['timing']}")  # fmt: skip
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            path = os.path.join(args.out, f"tp_moe_layer-p{world}.json")
            with open(path, "w") as f:
                json.dump(result, f, indent=1)
            print(f"wrote {path}")
    return result


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--hidden", type=int, default=None, help="H (default 4096 GPU, 64 CPU)")
    p.add_argument("--experts", type=int, default=None, help="E (default 128 GPU, 8 CPU)")
    p.add_argument("--topk", type=int, default=None, help="K (default 8 GPU, 2 CPU)")
    p.add_argument("--inter", type=int, default=None, help="I, full (default 1536 GPU, 32 CPU)")
    p.add_argument("--decode", type=int, nargs="*", default=None, help="decode token counts")
    p.add_argument("--prefill", type=int, nargs="*", default=None, help="prefill token counts")
    p.add_argument("--iters", type=int, default=None, help="timed calls per case")
    p.add_argument("--rtol", type=float, default=2e-2, help="agreement limit (relative to max)")
    p.add_argument("--eager", action="store_true", help="GPU: time eager launches, no graphs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=("auto", "triton", "reference"), default="auto",
                   help="impl of the moefuse ops (triton on CPU: the interpreter)")
    p.add_argument("--out", default=None, help="directory for tp_moe_layer-p{P}.json")
    args = p.parse_args(argv)
    gpu = args.device == "cuda"
    defaults = dict(hidden=(4096, 64), experts=(128, 8), topk=(8, 2), inter=(1536, 32),
                    decode=([1, 8, 32, 64], [1, 4]), prefill=([512, 2048], [32]),
                    iters=(50, 3))  # fmt: skip
    for key, (g, c) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, g if gpu else c)
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
