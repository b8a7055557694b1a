"""``python -m moefuse bench expert-norm --world-size P``: the per-expert-norm MoE finalize
fusions (``tp_moe_finalize_rmsnorm``, ``moe_finalize_rmsnorm_allreduce``) on P GPUs.

    python -m moefuse bench expert-norm --world-size 2 --save --out DIR [--quick] [--tokens ..]

Two per-rank functions, each timing one (M, H, K) inside the run's NCCL group:

* :func:`time_tp_case` — ``tp_moe_finalize_rmsnorm`` (variants ``moefuse`` = auto,
  ``moefuse_slot_oneshot``, ``moefuse_expert_owner``,
  ``moefuse_token_owner``, ``moefuse_staged``, ``moefuse_torch``; ``moefuse_slot_oneshot_fold1``:
  slot_oneshot with ``MOEFUSE_TP_SPLIT_FOLD=0``, one CTA folding each token; the EP op's
  ``moefuse_oneshot_slotwise``: ``MOEFUSE_EP_PREFETCH_ROWS=0``)
  against the unfused chain FlashInfer's op replaces: NCCL ``all_reduce`` of the per-expert
  partial rows ``[R, H]``, then gather + per-expert RMSNorm + weighted sum, ``unfused_eager``
  and ``unfused_compile``
  (``torch.compile`` of the local part; the NCCL call stays outside the compiled graph).
* :func:`time_ep_case` — ``moe_finalize_rmsnorm_allreduce`` (auto, oneshot, twoshot) against
  local gather + norm + weighted sum (eager / compiled) then NCCL ``all_reduce`` of ``[M, H]``.

Correctness first (every fused algorithm bitwise equal to the others and close to the oracle of
all ranks' inputs), then each variant is timed with ``harness.graph_time_us`` (CUDA-graph replays,
inputs rotated over sets larger than L2) and the figure is the MAX over ranks. The unfused chains
all-reduce in place, so their rows grow across replays (timing does not depend on values). Bytes
(per rank, minimum local traffic): TP ``valid rows read M*K*H*2 + output M*H*2``; EP the same.
Returns one dict per variant: op, variant, M, H, K, P, us, tbs, x_best_unfused.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moefuse.bench import ranks

TOKENS = [1, 8, 64, 512, 2048, 16384]
WIDTHS = [4096, 7168]
EPS = 1e-6
NO_MULTICAST = ranks.NO_MULTICAST
UNFUSED = ("unfused_eager", "unfused_compile")


# ----------------------------------------------------------------------------- unfused pieces
def expert_norm_weighted_sum(rows, idx, weights, norm_weight, eps=EPS, gain_center=0.0):
    """Gather the slots' rows, per-expert RMSNorm (weight before norm), weighted FP32 sum, BF16.
    Invalid slots read row 0 and are masked afterwards (what an unfused torch layer does)."""
    r = rows.shape[0]
    valid = (idx >= 0) & (idx < r)
    x = rows[idx.clamp(0, max(r - 1, 0)).long()].float()  # [M, K, H]
    z = x * (norm_weight.float() + gain_center)
    y = z * torch.rsqrt(z.pow(2).mean(-1, keepdim=True) + eps)
    y = torch.where(valid[..., None], y, 0.0)
    w = torch.where(valid, weights.float(), 0.0)
    return (y * w[..., None]).sum(1).to(torch.bfloat16)


def _max_over_ranks(us: float, group, dev) -> float:
    import torch.distributed as dist

    t = torch.tensor([us], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _time_variants(harness, variants: dict, n: int, group, dev, replays: int) -> dict:
    import torch.distributed as dist

    times = {}
    for name, fn in variants.items():
        dist.barrier(group=group)
        torch.cuda.synchronize(dev)
        try:
            us = harness.graph_time_us(fn, calls=max(20, n), replays=replays)
        except Exception as exc:  # a failing baseline must not stop the run (reported as NaN)
            print(f"rank {dist.get_rank(group)}: {name} failed: {exc}", flush=True)
            us = float("nan")
        times[name] = _max_over_ranks(us, group, dev)
    return times


def _rows(op, times, m, h, k, p, nbytes, extra=None) -> list[dict]:
    best = min((times[b] for b in UNFUSED if times[b] == times[b]), default=float("nan"))
    out = []
    for name, us in times.items():
        out.append(
            {
                "op": op,
                "shape": f"P={p} H={h} K={k}",
                "variant": name,
                "M": m,
                "H": h,
                "K": k,
                "P": p,
                "us": us,
                "tbs": nbytes / (us * 1e-6) / 1e12,
                "x_best_unfused": best / us,
                **(extra or {}),
            }
        )
    return out


def _tp_inputs(m, h, k, p, rank, dev, seed):
    """Rows [M*K, H] (this rank's partials), a random permutation map (every slot valid),
    weights; replicated tensors from a shared seed."""
    g = torch.Generator(device=dev).manual_seed(seed)
    idx = torch.randperm(m * k, generator=g, device=dev).view(m, k).to(torch.int32)
    w = torch.rand(m, k, generator=g, device=dev)
    gr = torch.Generator(device=dev).manual_seed(seed * 131 + rank + 1)
    rows = torch.randn(m * k, h, generator=gr, device=dev).to(torch.bfloat16)
    return rows, idx, w


# ----------------------------------------------------------------------------- TP
def time_tp_case(
    group, m: int, h: int, k: int, *, workspace=None, replays: int = 15, post_compiled=None
) -> list[dict]:
    """Time ``tp_moe_finalize_rmsnorm`` against its unfused chain on this rank (collective over
    ``group``; every rank calls with the same arguments). ``workspace``: an
    :class:`ExpertNormWorkspace` for (H, K) (created and closed here when None);
    ``post_compiled``: a cached ``harness.compile_baseline(expert_norm_weighted_sum)``."""
    import torch.distributed as dist

    import moefuse
    from moefuse.bench import harness
    from moefuse.comm.expert_norm import reference as ref
    from moefuse.comm.expert_norm.tp_kernels import SPLIT_FOLD_ENV

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    own = workspace is None
    xws = moefuse.ExpertNormWorkspace(group, h, k, dev) if own else workspace
    post_c = post_compiled or harness.compile_baseline(expert_norm_weighted_sum)
    nw = (torch.rand(h, generator=torch.Generator(device=dev).manual_seed(7), device=dev) + 0.5).to(
        torch.bfloat16
    )
    nbytes = m * k * h * 2 + m * h * 2
    n = harness.rotation_sets(nbytes)
    sets = [_tp_inputs(m, h, k, p, rank, dev, 100 + i) for i in range(n)]
    out = torch.empty(m, h, dtype=torch.bfloat16, device=dev)
    opts = dict(eps=EPS, gain_center=0.0, weight_before_norm=True)

    # correctness first: algorithms bitwise equal; close to the oracle of all ranks' rows
    rows, idx, w = sets[0]
    parts = [torch.empty_like(rows) for _ in range(p)]
    dist.all_gather(parts, rows, group=group)
    want = ref.tp_moe_finalize_rmsnorm_from_ranks(parts, w, idx, nw, **opts)
    first = None
    for algo in ("slot_oneshot", "expert_owner", "token_owner", "staged", "torch"):
        got = moefuse.tp_moe_finalize_rmsnorm(
            rows, w, idx, nw, workspace=xws, algorithm=algo, impl="triton", **opts
        )
        first = got if first is None else first
        if not torch.equal(got.view(torch.int16), first.view(torch.int16)):
            raise AssertionError(f"TP M={m} H={h} K={k}: {algo} differs bitwise")
    with harness.knobs({SPLIT_FOLD_ENV: "0"}):  # slot_oneshot's fold in one CTA: the same bits
        got = moefuse.tp_moe_finalize_rmsnorm(
            rows, w, idx, nw, workspace=xws, algorithm="slot_oneshot", impl="triton", **opts
        )
        if not torch.equal(got.view(torch.int16), first.view(torch.int16)):
            raise AssertionError(f"TP M={m} H={h} K={k}: slot_oneshot folded by one CTA differs")
    err = (first.float() - want.float()).abs().max().item()
    if not err <= 2.0**-6 * max(1.0, want.float().abs().max().item()):
        raise AssertionError(f"TP M={m} H={h} K={k}: max |fused - oracle| = {err}")
    nccl_bufs = [s[0].clone() for s in sets]  # all-reduced in place by the unfused chain

    def fused(algo):
        return lambda i: moefuse.tp_moe_finalize_rmsnorm(
            sets[i % n][0],
            sets[i % n][2],
            sets[i % n][1],
            nw,
            out,
            workspace=xws,
            algorithm=algo,
            impl="triton",
            **opts,
        )

    def unfused(post):
        def call(i):
            buf = nccl_bufs[i % n]
            dist.all_reduce(buf, group=group)
            return post(buf, sets[i % n][1], sets[i % n][2], nw)

        return call

    variants = {
        "moefuse": fused("auto"),
        "moefuse_slot_oneshot": fused("slot_oneshot"),
        "moefuse_expert_owner": fused("expert_owner"),
        "moefuse_token_owner": fused("token_owner"),
        "moefuse_staged": fused("staged"),
        "moefuse_torch": fused("torch"),
        "unfused_eager": unfused(expert_norm_weighted_sum),
        "unfused_compile": unfused(post_c),
    }
    times = _time_variants(harness, variants, n, group, dev, replays)
    with harness.knobs({SPLIT_FOLD_ENV: "0"}):  # slot_oneshot with one folding CTA per token
        times.update(
            _time_variants(
                harness,
                {"moefuse_slot_oneshot_fold1": fused("slot_oneshot")},
                n,
                group,
                dev,
                replays,
            )
        )
    xws.check()
    auto = xws.choose_algorithm(m)
    if own:
        xws.close()
    return _rows("tp_moe_finalize_rmsnorm", times, m, h, k, p, nbytes, {"auto_algorithm": auto})


# ----------------------------------------------------------------------------- EP
def time_ep_case(
    group, m: int, h: int, k: int, *, workspace=None, replays: int = 15, pre_compiled=None
) -> list[dict]:
    """Time ``moe_finalize_rmsnorm_allreduce`` (EP: each rank owns ~K/P of every token's routes)
    against local finalize + norm (eager / compiled) then NCCL ``all_reduce`` of [M, H]."""
    import torch.distributed as dist

    import moefuse
    from moefuse.bench import harness
    from moefuse.comm.expert_norm.ep_kernels import PREFETCH_ENV

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device())
    own = workspace is None
    ws = moefuse.AllReduceWorkspace(group, m, h, torch.bfloat16, dev) if own else workspace
    pre_c = pre_compiled or harness.compile_baseline(expert_norm_weighted_sum)
    nw = (torch.rand(h, generator=torch.Generator(device=dev).manual_seed(7), device=dev) + 0.5).to(
        torch.bfloat16
    )
    nbytes = m * k * h * 2 // p + m * h * 2
    n = harness.rotation_sets(nbytes)
    sets = []
    for i in range(n):
        rows, idx, w = _tp_inputs(m, h, k, p, rank, dev, 500 + i)
        local = (torch.arange(k, device=dev) % p == rank).expand(m, k)  # slot k on rank k mod P
        sets.append((rows, torch.where(local, idx, -1).to(torch.int32), w))
    out = torch.empty(m, h, dtype=torch.bfloat16, device=dev)
    opts = dict(eps=EPS, gain_center=0.0, weight_before_norm=True)
    rows, idx, w = sets[0]
    first = None
    for algo in ("oneshot", "twoshot", "torch"):
        got = moefuse.moe_finalize_rmsnorm_allreduce(
            rows, w, idx, nw, workspace=ws, algorithm=algo, impl="triton", **opts
        )
        first = got if first is None else first
        if not torch.equal(got.view(torch.int16), first.view(torch.int16)):
            raise AssertionError(f"EP M={m} H={h} K={k}: {algo} differs bitwise")
    want = expert_norm_weighted_sum(rows, idx, w, nw).float()
    dist.all_reduce(want, group=group)
    err = (first.float() - want).abs().max().item()
    if not err <= 2.0**-6 * max(1.0, want.abs().max().item()):
        raise AssertionError(f"EP M={m} H={h} K={k}: max |fused - unfused| = {err}")

    def fused(algo):
        return lambda i: moefuse.moe_finalize_rmsnorm_allreduce(
            sets[i % n][0],
            sets[i % n][2],
            sets[i % n][1],
            nw,
            out,
            workspace=ws,
            algorithm=algo,
            impl="triton",
            **opts,
        )

    def unfused(pre):
        def call(i):
            part = pre(sets[i % n][0], sets[i % n][1], sets[i % n][2], nw)
            dist.all_reduce(part, group=group)
            return part

        return call

    variants = {
        "moefuse": fused("auto"),
        "moefuse_oneshot": fused("oneshot"),
        "moefuse_twoshot": fused("twoshot"),
        "unfused_eager": unfused(expert_norm_weighted_sum),
        "unfused_compile": unfused(pre_c),
    }
    times = _time_variants(harness, variants, n, group, dev, replays)
    outs = {}
    for setting in ("0", "1"):  # the one-shot kernel loading slot by slot / all rows first
        with harness.knobs({PREFETCH_ENV: setting}):
            outs[setting] = fused("oneshot")(0).clone()
    if not torch.equal(outs["0"].view(torch.int16), outs["1"].view(torch.int16)):
        raise AssertionError(f"EP M={m} H={h} K={k}: rows first vs slot by slot differ bitwise")
    with harness.knobs({PREFETCH_ENV: "0"}):
        times.update(
            _time_variants(
                harness, {"moefuse_oneshot_slotwise": fused("oneshot")}, n, group, dev, replays
            )
        )
    ws.check()
    if own:
        ws.close()
    return _rows("moe_finalize_rmsnorm_allreduce", times, m, h, k, p, nbytes)


# ----------------------------------------------------------------------------- bar + command
def bar_checks(rows: list[dict]) -> list[str]:
    """The bar for tp_moe_finalize_rmsnorm: >= 2 x the unfused chain at M <= 64, >= 1.0 x
    at every M (best unfused = the faster of eager and compiled)."""
    out = []
    for r in rows:
        if r["op"] != "tp_moe_finalize_rmsnorm" or r["variant"] != "moefuse":
            continue
        need = 2.0 if r["M"] <= 64 else 1.0
        ok = r["x_best_unfused"] >= need
        out.append(
            f"BAR {'PASS' if ok else 'FAIL'}: tp_moe_finalize_rmsnorm P={r['P']} "
            f"H={r['H']} K={r['K']} M={r['M']}: {r['us']:.2f} us, "
            f"{r['x_best_unfused']:.2f} x best unfused (need >= {need})"
        )
    return out


def _worker(rank: int, world_size: int, args, init_method: str | None) -> None:
    dev = ranks.init_rank(rank, world_size, init_method)
    import torch.distributed as dist

    import moefuse
    from moefuse.bench import harness

    group = dist.group.WORLD
    rank = dist.get_rank()
    tokens, widths = ranks.token_and_width_lists(args, TOKENS, WIDTHS, [1, 8, 64, 2048])
    replays = 8 if args.quick else 15
    post_c = harness.compile_baseline(expert_norm_weighted_sum)
    rows = []
    for h in widths:
        xws = moefuse.ExpertNormWorkspace(group, h, args.topk, dev)
        ws = moefuse.AllReduceWorkspace(group, max(tokens), h, torch.bfloat16, dev)
        for m in tokens:
            case = time_tp_case(
                group, m, h, args.topk, workspace=xws, replays=replays, post_compiled=post_c
            )
            if not args.tp_only:
                case += time_ep_case(
                    group, m, h, args.topk, workspace=ws, replays=replays, pre_compiled=post_c
                )
            rows += case
            if rank == 0:
                for r in case:
                    print(
                        f"{r['op']:31s} {r['shape']:16s} M={m:6d} {r['variant']:22s} "
                        f"{r['us']:9.2f} us  {r['x_best_unfused']:5.2f} x",
                        flush=True,
                    )
        xws.close()
        ws.close()
    if rank == 0:
        bar = bar_checks(rows)
        for line in bar:
            print(line)
    if rank == 0 and args.save:  # JSON only: bench summary draws the speed-up figure
        meta = harness.run_metadata()
        meta.update(
            world_size=world_size,
            top_k=args.topk,
            bar=bar,
            command="python -m moefuse bench expert-norm " + " ".join(args.argv),
        )
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"expert-norm-{harness.gpu_slug()}-p{world_size}.json"
        path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print("wrote", path)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = ranks.rank_parser("moefuse bench expert-norm", "M in {1, 8, 64, 2048}, H = 4096")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--tp-only", action="store_true", help="skip the EP op")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    # the children unpickle the worker by its module name (this file may be running as __main__)
    from moefuse.bench import expert_norm

    return ranks.run_ranks(expert_norm._worker, args)


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
