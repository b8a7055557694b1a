"""``python -m moefuse bench moe-reduction --world-size P``: the MoE-reduction and MoE-finalize
all-reduce fusions on P GPUs.

Spawns P processes (one GPU each, NCCL group; or runs in place under ``torchrun``). For every
(H, M) each *case provider* checks correctness first (every algorithm bitwise equal; residual_out
bitwise against the oracle of all ranks' inputs for M <= 2048), then times, side by side in the
same run:

* ``fused`` (algorithm "auto", accumulate "stepwise"), ``fused_fp32`` (accumulate "fp32"),
  ``fused_oneshot`` / ``fused_twoshot``, ``fused_twoshot_1cta_per_sm`` (two-shot with
  MOEFUSE_MOE_COMM_CTAS_PER_SM=1: the A/B of its 2-CTA default from 2048 tokens),
  ``fused_2ctas_per_sm`` (MOEFUSE_MOE_COMM_CTAS_PER_SM=2, finalize only),
  ``fused_split[_fp32]`` / ``fused_single_cta_rows`` (one-shot with MOEFUSE_MOE_COMM_VARIANT=
  split / fused, finalize only: auto takes split up to 64 tokens)
  — the moefuse fusion;
* ``(a) moe_finalize+ar_norm`` — moefuse's own unfused chain: the deterministic finalize into an
  [M, H] partial, then ``allreduce_residual_rmsnorm``;
* ``(b) moe_finalize+nccl+compile`` — the same finalize, NCCL ``all_reduce``, compiled
  residual + RMSNorm; ``(b') compile_finalize+nccl+compile`` — a ``torch.compile``'d
  gather + weighted sum instead of moefuse's finalize;
* ``(c) flashinfer`` — only noted: FlashInfer is optional and its IPC-workspace call is not wired
  in (meta["flashinfer"] says whether it was importable; the issue's anchors are printed).

Providers (``PROVIDERS``): ``finalize_cases`` (the MoE-finalize fusion, K routes through a
random permutation) and ``reduction_cases`` (the MoE-reduction fusion, E_loc = K expert rows per
token); the per-expert-norm finalize ops are ``bench expert-norm``'s. A provider is
``fn(ctx: Ctx) -> list[dict]`` returning rows with ``op``, ``H``, ``M``, ``variant``, ``us``
(max over ranks) and ``role`` ("fused" | "baseline"); the driver adds the ratios. Figures are the
median per-call µs of CUDA-graph replays (``harness.graph_time_us``), inputs rotating over sets
larger than L2, max over ranks. Bytes per call and rank: K*M*H*2 (expert rows) + 2*M*H*2
(residual in/out) + M*H*2 (norm out) + routing data, and (P-1)*M*H*2 over NVLink.
``--save`` writes ``bench/results/moe-reduction-<gpu>-p<P>.json/.png``.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moefuse.bench import ranks

TOKENS = [1, 8, 64, 512, 2048, 16384]
WIDTHS = [4096, 7168]
TOP_K = 8
EPS = 1e-6
CHECK_MAX_TOKENS = 2048
NO_MULTICAST = ranks.NO_MULTICAST
#: FlashInfer's anchors on 2 x H200, H = 4096, K = 8 (µs at M = 1 / 8 / 64 / 512 / 2048)
FLASHINFER_ANCHORS = {
    "moe_finalize_allreduce_residual_rmsnorm": {1: 6.9, 8: 7.1, 64: 23.5, 512: 255.0, 2048: 999.0},
    "moe_allreduce_residual_rmsnorm": {1: 6.0, 8: 6.8, 64: 18.0, 512: 199.0, 2048: 806.0},
}


def residual_rmsnorm(s, residual, weight):
    """The unfused epilogue: ``h = T(s + residual)``, ``n = T(h * rsqrt(mean(h^2) + eps) * w)``."""
    h = (s.float() + residual.float()).to(s.dtype)
    hf = h.float()
    n = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
    return h, n.to(s.dtype)


def gather_finalize(rows, idx, w):
    """Compiled-baseline finalize: gather K rows per token, weight, sum (FP32), round once."""
    x = rows.index_select(0, idx.reshape(-1).long()).view(idx.shape[0], idx.shape[1], -1)
    return (x.float() * w.float().unsqueeze(-1)).sum(1).to(rows.dtype)


@dataclass
class Ctx:
    """What a case provider gets: the group, the shapes and shared helpers."""

    rank: int
    world_size: int
    group: object
    device: torch.device
    tokens: list[int]
    widths: list[int]
    top_k: int
    replays: int
    harness: object
    moefuse: object
    norm_c: Callable
    finalize_c: Callable
    _workspaces: dict = field(default_factory=dict)

    def workspace(self, h: int):
        """One AllReduceWorkspace per H (one-shot capacity for every M), shared by providers."""
        if h not in self._workspaces:
            from moefuse.comm.moe_reduction.ops import extra_regions

            m = max(self.tokens)
            self._workspaces[h] = self.moefuse.AllReduceWorkspace(
                self.group,
                m,
                h,
                torch.bfloat16,
                self.device,
                oneshot_max_tokens=m,
                extra_regions=extra_regions(m, h),
            )
        return self._workspaces[h]

    def time(self, fn) -> float:
        """Max over ranks of the median per-call µs (NaN when the variant fails)."""
        import torch.distributed as dist

        dist.barrier(group=self.group)
        torch.cuda.synchronize(self.device)
        try:
            us = self.harness.graph_time_us(fn, calls=20, replays=self.replays)
        except Exception as exc:  # a baseline missing from this build must not stop the run
            print(f"rank {self.rank}: variant failed: {exc}", flush=True)
            us = float("nan")
        t = torch.tensor([us], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def close(self) -> None:
        for ws in self._workspaces.values():
            ws.close()


#: the peer kernels at 1 CTA per SM: the A/B of the two-shot's 2-CTA default from 2048 tokens
ONE_CTA_PER_SM = {"MOEFUSE_MOE_COMM_CTAS_PER_SM": "1"}


def with_env(env: dict[str, str], fn):
    """``fn`` with the knobs ``env`` set around every call (warm-up and capture alike): the
    launchers read them at launch, and launch plans record what they saw, so the plans are
    dropped on entry and on exit (else a variant would replay the default's launches)."""

    from moefuse.bench import harness

    def call(i):
        with harness.knobs(env):
            return fn(i)

    return call


def _gather(ctx, t):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t.contiguous(), group=ctx.group)
    return parts


def _rows(op, h, m, k, p, variants: dict, nbytes: int) -> list[dict]:
    """``nbytes``: the HBM bytes the fused op must move per rank (inputs read once, outputs
    written once; peer slots and NVLink traffic not counted) -> ``GBps``."""
    return [
        {
            "op": op,
            "shape": f"P={p} H={h} K={k}",
            "P": p,
            "H": h,
            "M": m,
            "K": k,
            "variant": name,
            "us": us,
            "role": role,
            "bytes": nbytes,
            "GBps": nbytes / (us * 1e3) if us == us else float("nan"),
        }
        for name, (us, role) in variants.items()
    ]


# ----------------------------------------------------------------------------- MoE finalize
def _over_shapes(ctx: Ctx, case) -> list[dict]:
    """Rows of ``case(ctx, ws, h, m)`` for every width (one workspace each) and token count."""
    out = []
    for h in ctx.widths:
        ws = ctx.workspace(h)
        for m in ctx.tokens:
            out += case(ctx, ws, h, m)
        ws.check()
    return out


def finalize_cases(ctx: Ctx) -> list[dict]:
    return _over_shapes(ctx, _finalize_case)


def _finalize_case(ctx: Ctx, ws, h: int, m: int) -> list[dict]:
    import torch.distributed as dist

    from moefuse.comm.moe_reduction import reference as mref
    from moefuse.testing import assert_bitwise_equal

    mf, k, dev, bf = ctx.moefuse, ctx.top_k, ctx.device, torch.bfloat16
    per_call = (k + 3) * m * h * 2
    n = ctx.harness.rotation_sets(per_call, cap=8)
    g = torch.Generator(device=dev).manual_seed(17 + ctx.rank)
    torch.manual_seed(4321)  # routing, residual, gain: the same on every rank
    maps = [torch.randperm(m * k, device=dev).to(torch.int32).view(m, k) for _ in range(n)]
    wts = [torch.rand(m, k, device=dev) for _ in range(n)]
    res = [torch.randn(m, h, device=dev).to(bf) for _ in range(n)]
    w = (torch.rand(h, device=dev) + 0.5).to(bf)
    rows = [torch.randn(m * k, h, generator=g, device=dev).to(bf) for _ in range(n)]
    ro, no, part = (torch.empty(m, h, dtype=bf, device=dev) for _ in range(3))

    def fused(algo, acc="stepwise"):
        return lambda i: mf.moe_finalize_allreduce_residual_rmsnorm(
            rows[i % n],
            res[i % n],
            w,
            maps[i % n],
            workspace=ws,
            expert_scale_factor=wts[i % n],
            accumulate=acc,
            algorithm=algo,
            impl="triton",
            residual_out=ro,
            norm_out=no,
        )

    two_ctas = with_env({"MOEFUSE_MOE_COMM_CTAS_PER_SM": "2"}, fused("auto"))
    twoshot_one_cta = with_env(ONE_CTA_PER_SM, fused("twoshot"))
    # one-shot variants by name (the two-kernel variant never won: scripts/
    # bench_moe_reduction_variants.py times it); "fused" is the auto choice above 64 tokens
    single, split, split_fp32 = (
        with_env({"MOEFUSE_MOE_COMM_VARIANT": v}, fused("oneshot", acc))
        for v, acc in (("fused", "stepwise"), ("split", "stepwise"), ("split", "fp32"))
    )

    def chain_a(i):
        mf.moe_finalize(rows[i % n], maps[i % n], wts[i % n], out=part, impl="triton")
        return mf.allreduce_residual_rmsnorm(
            part, res[i % n], w, workspace=ws, impl="triton", residual_out=ro, norm_out=no
        )

    def chain_b(i):
        mf.moe_finalize(rows[i % n], maps[i % n], wts[i % n], out=part, impl="triton")
        dist.all_reduce(part, group=ctx.group)
        return ctx.norm_c(part, res[i % n], w)

    def chain_b2(i):
        s = ctx.finalize_c(rows[i % n], maps[i % n], wts[i % n])
        dist.all_reduce(s, group=ctx.group)
        return ctx.norm_c(s, res[i % n], w)

    # correctness first: every algorithm bitwise equal, residual_out against the oracle
    first = None
    for name, fn in (
        ("auto", fused("auto")),
        ("oneshot", fused("oneshot")),
        ("twoshot", fused("twoshot")),
        ("torch", fused("torch")),
        ("2 CTAs per SM", two_ctas),
        ("split", split),
        ("single-CTA rows", single),
    ):
        got = fn(0)
        first = first or tuple(t.clone() for t in got)
        for a, b in zip(got, first):
            assert_bitwise_equal(a, b, f"finalize H={h} M={m} {name} vs auto")
    if m <= CHECK_MAX_TOKENS:
        want = mref.moe_finalize_allreduce_from_ranks(
            _gather(ctx, rows[0]), maps[0], res[0], w, expert_scale_factors=wts[0]
        )
        assert_bitwise_equal(first[0], want["residual_out"], f"finalize H={h} M={m}")
    variants = {
        "fused": (ctx.time(fused("auto")), "fused"),
        "fused_fp32": (ctx.time(fused("auto", "fp32")), "fused"),
        "fused_oneshot": (ctx.time(fused("oneshot")), "fused"),
        "fused_twoshot": (ctx.time(fused("twoshot")), "fused"),
        "fused_2ctas_per_sm": (ctx.time(two_ctas), "fused"),
        "fused_twoshot_1cta_per_sm": (ctx.time(twoshot_one_cta), "fused"),
        "fused_split": (ctx.time(split), "fused"),
        "fused_split_fp32": (ctx.time(split_fp32), "fused"),
        "fused_single_cta_rows": (ctx.time(single), "fused"),
        "(a) moe_finalize+ar_norm": (ctx.time(chain_a), "baseline"),
        "(b) moe_finalize+nccl+compile": (ctx.time(chain_b), "baseline"),
        "(b') compile_finalize+nccl+compile": (ctx.time(chain_b2), "baseline"),
    }
    nbytes = (k + 3) * m * h * 2 + m * k * 8  # rows, residual, 2 outputs, map + weights
    rows_out = _rows(
        "moe_finalize_allreduce_residual_rmsnorm", h, m, k, ctx.world_size, variants, nbytes
    )
    _progress(ctx, rows_out)
    return rows_out


# ----------------------------------------------------------------------------- MoE reduction
def reduction_cases(ctx: Ctx) -> list[dict]:
    return _over_shapes(ctx, _reduction_case)


def _reduction_case(ctx: Ctx, ws, h: int, m: int) -> list[dict]:
    import torch.distributed as dist

    from moefuse.comm.moe_reduction import reference as mref
    from moefuse.testing import assert_bitwise_equal

    mf, e, dev, bf = ctx.moefuse, ctx.top_k, ctx.device, torch.bfloat16
    n = ctx.harness.rotation_sets((e + 4) * m * h * 2, cap=8)
    g = torch.Generator(device=dev).manual_seed(29 + ctx.rank)
    torch.manual_seed(1234)
    res = [torch.randn(m, h, device=dev).to(bf) for _ in range(n)]
    w = (torch.rand(h, device=dev) + 0.5).to(bf)
    xs = [torch.randn(e, m, h, generator=g, device=dev).to(bf) for _ in range(n)]
    scs = [torch.rand(e, m, generator=g, device=dev) for _ in range(n)]
    scs_t = [s.t().contiguous() for s in scs]  # [M, E] for moe_finalize (outside timing)
    toks = [torch.randn(m, h, generator=g, device=dev).to(bf) for _ in range(n)]
    # the chains finalize x viewed as [E*M, H] rows through map[t, e] = e*M + t
    idx = (torch.arange(e, device=dev)[None, :] * m + torch.arange(m, device=dev)[:, None]).to(
        torch.int32
    )
    ro, no, part = (torch.empty(m, h, dtype=bf, device=dev) for _ in range(3))

    def fused(algo, acc="stepwise"):
        return lambda i: mf.moe_allreduce_residual_rmsnorm(
            xs[i % n],
            scs[i % n],
            toks[i % n],
            res[i % n],
            w,
            workspace=ws,
            accumulate=acc,
            algorithm=algo,
            impl="triton",
            residual_out=ro,
            norm_out=no,
        )

    def finalize(i):
        return mf.moe_finalize(
            xs[i % n].view(e * m, h),
            idx,
            scs_t[i % n],
            out=part,
            shared_expert_output=toks[i % n],
            impl="triton",
        )

    def chain_a(i):
        finalize(i)
        return mf.allreduce_residual_rmsnorm(
            part, res[i % n], w, workspace=ws, impl="triton", residual_out=ro, norm_out=no
        )

    def chain_b(i):
        finalize(i)
        dist.all_reduce(part, group=ctx.group)
        return ctx.norm_c(part, res[i % n], w)

    first = None
    for algo in ("auto", "oneshot", "twoshot", "torch"):
        got = fused(algo)(0)
        first = first or tuple(t.clone() for t in got)
        for a, b in zip(got, first):
            assert_bitwise_equal(a, b, f"reduction H={h} M={m} {algo} vs auto")
    if m <= CHECK_MAX_TOKENS:
        want = mref.moe_allreduce_from_ranks(
            _gather(ctx, xs[0]), _gather(ctx, scs[0]), _gather(ctx, toks[0]), res[0], w
        )
        assert_bitwise_equal(first[0], want["residual_out"], f"reduction H={h} M={m}")
    variants = {
        "fused": (ctx.time(fused("auto")), "fused"),
        "fused_fp32": (ctx.time(fused("auto", "fp32")), "fused"),
        "fused_oneshot": (ctx.time(fused("oneshot")), "fused"),
        "fused_twoshot": (ctx.time(fused("twoshot")), "fused"),
        "fused_twoshot_1cta_per_sm": (
            ctx.time(with_env(ONE_CTA_PER_SM, fused("twoshot"))),
            "fused",
        ),
        "(a) moe_finalize+ar_norm": (ctx.time(chain_a), "baseline"),
        "(b) moe_finalize+nccl+compile": (ctx.time(chain_b), "baseline"),
    }
    nbytes = (e + 4) * m * h * 2 + e * m * 4  # experts, token, residual, 2 outputs, scales
    rows_out = _rows("moe_allreduce_residual_rmsnorm", h, m, e, ctx.world_size, variants, nbytes)
    _progress(ctx, rows_out)
    return rows_out


#: case providers, run in order
PROVIDERS: list[Callable[[Ctx], list[dict]]] = [finalize_cases, reduction_cases]


def _progress(ctx, rows) -> None:
    if ctx.rank == 0 and rows:
        r = rows[0]
        print(
            f"{r['op']} H={r['H']} M={r['M']}: "
            + "  ".join(f"{x['variant']}={x['us']:.2f}" for x in rows)
            + " us",
            flush=True,
        )


# ----------------------------------------------------------------------------- ratios, bar
def add_ratios(rows: list[dict]) -> None:
    """``x_best_unfused`` = best baseline µs / this row's µs, per (op, H, M)."""
    best: dict[tuple, float] = {}
    for r in rows:
        if r.get("role") == "baseline" and r["us"] == r["us"]:
            key = (r["op"], r["H"], r["M"])
            best[key] = min(best.get(key, float("inf")), r["us"])
    for r in rows:
        b = best.get((r["op"], r["H"], r["M"]))
        r["x_best_unfused"] = b / r["us"] if b and r["us"] == r["us"] else float("nan")
        fi = FLASHINFER_ANCHORS.get(r["op"], {}).get(r["M"]) if r["H"] == 4096 else None
        r["x_flashinfer_anchor"] = fi / r["us"] if fi else None


def bar_checks(rows: list[dict], world_size: int) -> list[str]:
    """The bar (P = 2, H = 4096, K = 8) evaluated on this run: PASS / FAIL lines."""
    out = []

    def verdict(ok: bool, text: str) -> None:
        out.append(f"BAR {'PASS' if ok else 'FAIL'}: {text}")

    for r in rows:
        if r["variant"] != "fused" or r["op"] not in FLASHINFER_ANCHORS:
            continue
        h, m, us, x = r["H"], r["M"], r["us"], r["x_best_unfused"]
        name = f"{r['op']} P={world_size} H={h} M={m}: {us:.2f} us"
        verdict(x >= 1.0, f"{name}, {x:.2f} x the best unfused chain (>= 1.0)")
        if m <= 64:
            verdict(x >= 1.2, f"{name}, {x:.2f} x the best unfused chain (>= 1.2 at M <= 64)")
        if world_size == 2 and h == 4096:
            if m == 1 and r["op"] == "moe_finalize_allreduce_residual_rmsnorm":
                verdict(us <= 4.0, f"{name} <= 4.0 us")
            fi = FLASHINFER_ANCHORS[r["op"]].get(m)
            if m >= 512 and fi is not None:
                verdict(
                    us * 3 <= fi,
                    f"{name} >= 3 x FlashInfer's fused kernel ({fi} us, "
                    "issue anchor, not measured in this run)",
                )
    return out


# ----------------------------------------------------------------------------- worker
def _worker(rank: int, world_size: int, args, init_method: str | None) -> None:
    dev = ranks.init_rank(rank, world_size, init_method)
    import torch.distributed as dist

    import moefuse
    from moefuse.bench import harness

    group = dist.group.WORLD
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tokens, widths = ranks.token_and_width_lists(args, TOKENS, WIDTHS, [1, 64, 2048])
    ctx = Ctx(
        rank=rank,
        world_size=world_size,
        group=group,
        device=dev,
        tokens=tokens,
        widths=widths,
        top_k=args.top_k,
        replays=8 if args.quick else 15,
        harness=harness,
        moefuse=moefuse,
        norm_c=harness.compile_baseline(residual_rmsnorm),
        finalize_c=harness.compile_baseline(gather_finalize),
    )
    rows = []
    for provider in PROVIDERS:
        rows += provider(ctx)
    ctx.close()
    if rank == 0:
        add_ratios(rows)
        bar = bar_checks(rows, world_size)
        harness.print_table(
            rows,
            ["op", "shape", "M", "variant", "us", "GBps", "x_best_unfused", "x_flashinfer_anchor"],
        )
        for line in bar:
            print(line)
        fi = importlib.util.find_spec("flashinfer") is not None
        meta = harness.run_metadata()
        meta.update(
            world_size=world_size,
            bar=bar,
            flashinfer_importable=fi,
            flashinfer_anchors=FLASHINFER_ANCHORS,
            note="(c) FlashInfer's fused kernels are not timed by this benchmark "
            f"(importable here: {fi}); x_flashinfer_anchor uses the "
            "2 x H200 anchors (H = 4096, K = 8)",
        )
        if args.save:
            paths = harness.save_results(
                "moe-reduction", rows, meta, args.out, suffix=f"-p{world_size}"
            )
            print("wrote", *[str(p) for p in paths if p])
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    parser = ranks.rank_parser("moefuse bench moe-reduction", "M in {1, 64, 2048}, H = 4096")
    parser.add_argument("--top-k", type=int, default=TOP_K)
    args = parser.parse_args(argv)
    return ranks.run_ranks(_worker, args)
