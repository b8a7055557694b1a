"""``python -m moefuse bench moe``: the MoE finalize family on one GPU.

1. Correctness first: the Triton finalize equals the CPU reference bit for bit (with and without
   the extensions), the scatter-add variant and the torch baselines agree to BF16 rounding.
2. Finalize alone, K = 8, H in {4096, 7168}, M in {1, 16, 128, 1024, 2048, 16384}, side by side:
   moefuse deterministic (PDL on / off), the scatter-add variant (FP32 atomics + cast), PyTorch
   eager and ``torch.compile`` of the same gather-sum (FP32 accumulation).
3. The producer -> finalize chain (moefuse permute kernel, then the finalize) with PDL on and off.
4. The whole layer pipeline (route, permute, grouped GEMMs, finalize) with both finalize modes.

Bytes counted for the finalize: reads M*K*H + writes M*H elements, plus the M*K indices and
scales (int32 + FP32). The ceiling is an SM copy kernel measured in the same run. The issue's bars
(>= 3.5 TB/s at K=8, H=4096, M >= 2048; <= 2.5 us at M=1; deterministic no slower than
scatter-add at every M) are checked and reported in the table, the JSON and the exit message.
"""

from __future__ import annotations

import argparse
import sys

import torch

from moefuse.bench import harness

DEFAULT_TOKENS = (1, 16, 128, 1024, 2048, 16384)
QUICK_TOKENS = (1, 128, 2048)
DEFAULT_HIDDEN = (4096, 7168)
TOP_K = 8
NUM_EXPERTS = 64


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="moefuse bench moe", description=__doc__.split("\n")[0])
    p.add_argument("--save", action="store_true", help="write JSON + PNG under --out")
    p.add_argument("--out", default="bench/results", help="results directory")
    p.add_argument("--quick", action="store_true", help="fewer shapes (M in 1, 128, 2048; H 4096)")
    p.add_argument("--tokens", type=int, nargs="+", help="token counts M (overrides the default)")
    p.add_argument("--hidden", type=int, nargs="+", help="hidden sizes H (overrides the default)")
    p.add_argument("--top-k", type=int, default=TOP_K)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--no-layer", action="store_true", help="skip the layer pipeline")
    p.add_argument(
        "--layer-intermediate",
        type=int,
        default=1024,
        help="expert intermediate size of the layer pipeline",
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="also sweep the finalize tile (BLOCK x warps): bits never change",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- inputs
def make_inputs(m: int, k: int, h: int, device, *, seed: int = 0, dtype=torch.bfloat16):
    """A real routing: router logits -> top-k -> expert-sorted rows (every slot valid)."""
    from moefuse.moe.routing import route_topk, sort_by_expert

    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(m, NUM_EXPERTS, device=device, generator=g)
    weights, ids = route_topk(logits, k)
    plan = sort_by_expert(ids, NUM_EXPERTS)
    rows = torch.randn(plan.num_rows, h, device=device, generator=g).to(dtype)
    return rows, plan, weights


def torch_finalize(rows, idx, scales):
    """The same gather-sum in plain PyTorch: FP32 products summed over k, one rounding."""
    valid = (idx >= 0) & (idx < rows.shape[0])
    gathered = rows[idx.clamp(0, rows.shape[0] - 1).long()].float()  # [M, K, H]
    terms = torch.where(valid[..., None], gathered * scales.float()[..., None], 0.0)
    return terms.sum(dim=1).to(rows.dtype)


def finalize_bytes(m: int, k: int, h: int, elem: int = 2) -> int:
    return m * k * h * elem + m * h * elem + m * k * (4 + 4)


# ----------------------------------------------------------------------------- correctness
def check_correctness(device, h: int = 4096, k: int = TOP_K, m: int = 128) -> list[str]:
    """Problems found (empty list = all good)."""
    import moefuse
    from moefuse.moe import reference as ref
    from moefuse.testing import bits

    problems = []
    rows, plan, w = make_inputs(m, k, h, device, seed=1)
    idx = plan.expanded_idx_to_permuted_idx
    g = torch.Generator(device=device).manual_seed(2)
    ext = dict(
        bias=torch.randn(NUM_EXPERTS, h, device=device, generator=g).bfloat16(),
        expert_ids=torch.randint(
            0, NUM_EXPERTS, (m, k), device=device, generator=g, dtype=torch.int32
        ),
        routed_scaling_factor=2.5,
        shared_expert_output=torch.randn(m, h, device=device, generator=g).bfloat16(),
    )
    for name, kw in (("plain", {}), ("extensions", ext)):
        got = moefuse.moe_finalize(rows, idx, w, impl="triton", **kw)
        cpu_kw = {a: (b.cpu() if isinstance(b, torch.Tensor) else b) for a, b in kw.items()}
        want = ref.moe_finalize_reference(rows.cpu(), idx.cpu(), w.cpu(), **cpu_kw)
        if not torch.equal(bits(got), bits(want)):
            problems.append(f"finalize ({name}) differs bitwise from the CPU reference")
    det = moefuse.moe_finalize(rows, idx, w, impl="triton")
    for name, other in (
        (
            "scatter-add",
            moefuse.moe_finalize_scatter_add(
                rows, plan.permuted_idx_to_expanded_idx, w, impl="triton"
            ),
        ),
        ("torch eager", torch_finalize(rows, idx, w)),
    ):
        # FP32 summation order, rounded products and FTZ only: about one BF16 rounding apart
        if not torch.allclose(other.float(), det.float(), rtol=1.6e-2, atol=1e-3):
            err = float((other.float() - det.float()).abs().max())
            problems.append(f"{name} differs from the deterministic finalize by up to {err:.3g}")
    return problems


# ----------------------------------------------------------------------------- timing
def _row(op, shape, m, variant, us, nbytes, extra=None):
    r = {
        "op": op,
        "shape": shape,
        "M": m,
        "variant": variant,
        "us": us,
        "tbs": (nbytes / (us * 1e-6) / 1e12) if us and nbytes else None,
    }
    r.update(extra or {})
    return r


def _time(fn, calls=20, replays=15):
    try:
        return harness.graph_time_us(fn, calls=calls, replays=replays)
    except Exception as exc:  # a baseline that cannot be captured is reported, not fatal
        print(f"  (timing failed: {type(exc).__name__}: {str(exc)[:120]})", file=sys.stderr)
        return None


def _finalize_variants(sets, outs, compiled, use_pdl) -> dict:
    """Callables ``fn(i)`` (i = call index, rotating over ``sets``) of every finalize variant."""
    import moefuse

    n = len(sets)

    def det(pdl):
        def fn(i):
            rows, plan, w = sets[i % n]
            moefuse.moe_finalize(
                rows, plan.expanded_idx_to_permuted_idx, w, out=outs[i % n], enable_pdl=pdl
            )

        return fn

    def scatter(i):
        rows, plan, w = sets[i % n]
        moefuse.moe_finalize_scatter_add(
            rows, plan.permuted_idx_to_expanded_idx, w, out=outs[i % n]
        )

    def baseline(f):
        def fn(i):
            rows, plan, w = sets[i % n]
            f(rows, plan.expanded_idx_to_permuted_idx, w)

        return fn

    variants = {
        "moefuse": det(use_pdl),
        "moefuse no-PDL": det(False),
        "scatter-add": scatter,
        "torch eager": baseline(torch_finalize),
    }
    if compiled is not None:
        variants["torch.compile"] = baseline(compiled)
    return variants


def _tile_variant(sets, outs, block, warps, use_pdl):
    from moefuse.moe.triton import launch_moe_finalize

    def fn(i):
        rows, plan, w = sets[i % len(sets)]
        launch_moe_finalize(
            rows,
            plan.expanded_idx_to_permuted_idx,
            w,
            outs[i % len(sets)],
            None,
            None,
            1.0,
            None,
            False,
            use_pdl,
            block=block,
            num_warps=warps,
        )

    return fn


TUNE_TILES = ((256, 1), (512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 4), (2048, 8))


def bench_finalize(device, tokens, hidden, k, use_compile, tune) -> list[dict]:
    from moefuse._runtime import resolve_pdl

    use_pdl = resolve_pdl(None, device)
    compiled = harness.compile_baseline(torch_finalize) if use_compile else None
    rows_out = []
    for h in hidden:
        for m in tokens:
            nbytes = finalize_bytes(m, k, h)
            sets = [
                make_inputs(m, k, h, device, seed=s) for s in range(harness.rotation_sets(nbytes))
            ]
            outs = [torch.empty(m, h, dtype=torch.bfloat16, device=device) for _ in sets]
            variants = _finalize_variants(sets, outs, compiled, use_pdl)
            times = {name: _time(fn) for name, fn in variants.items()}
            shape = f"K={k} H={h}"
            for name, us in times.items():
                extra = {}
                for base in ("torch.compile", "torch eager", "scatter-add"):
                    if us and times.get(base) and name != base:
                        extra[f"x_vs_{base}"] = times[base] / us
                rows_out.append(_row("finalize", shape, m, name, us, nbytes, extra))
            if tune:
                for block, warps in TUNE_TILES:
                    us = _time(_tile_variant(sets, outs, block, warps, use_pdl))
                    rows_out.append(
                        _row("finalize tile", shape, m, f"{block}x{warps}w", us, nbytes)
                    )
    return rows_out


def _chain_variant(sets, k, pdl):
    import moefuse

    def fn(i):
        x, xp, plan, w, out = sets[i % len(sets)]
        moefuse.moe_permute(x, plan.permuted_idx_to_expanded_idx, k, out=xp, enable_pdl=pdl)
        moefuse.moe_finalize(xp, plan.expanded_idx_to_permuted_idx, w, out=out, enable_pdl=pdl)

    return fn


def bench_chain(device, tokens, h, k) -> list[dict]:
    """moefuse permute (the producer) -> moefuse finalize, PDL on, off and the default
    (``enable_pdl=None``: the measured table in ``moefuse.moe.tiles``)."""
    rows_out = []
    for m in tokens:
        nbytes = 2 * finalize_bytes(m, k, h)  # permute writes R rows; finalize reads them back
        sets = []
        for s in range(harness.rotation_sets(nbytes)):
            rows, plan, w = make_inputs(m, k, h, device, seed=s)
            x = torch.randn(m, h, device=device).bfloat16()
            sets.append((x, rows, plan, w, torch.empty(m, h, dtype=torch.bfloat16, device=device)))
        on, off = _time(_chain_variant(sets, k, True)), _time(_chain_variant(sets, k, False))
        default = _time(_chain_variant(sets, k, None))
        shape = f"K={k} H={h}"
        rows_out.append(
            _row(
                "permute->finalize",
                shape,
                m,
                "PDL on",
                on,
                nbytes,
                {"x_vs_PDL off": (off / on) if on and off else None},
            )
        )
        rows_out.append(_row("permute->finalize", shape, m, "PDL off", off, nbytes))
        best = min(on, off) if on and off else None
        rows_out.append(
            _row(
                "permute->finalize",
                shape,
                m,
                "PDL default",
                default,
                nbytes,
                {"x_vs_best of on/off": best / default if best and default else None},
            )
        )
    return rows_out


def _layer_variant(xs, outs, weights, k, fused):
    import moefuse

    def fn(i):
        moefuse.moe_layer(
            xs[i % len(xs)], weights, k, use_fused_finalize=fused, out=outs[i % len(xs)], pad_to=16
        )

    return fn


def bench_layer(device, tokens, h, k, intermediate) -> list[dict]:
    import moefuse

    weights = moefuse.MoEWeights.random(NUM_EXPERTS, h, intermediate, device=device)
    rows_out = []
    for m in tokens:
        xs = [torch.randn(m, h, device=device).bfloat16() for _ in range(2)]
        outs = [torch.empty(m, h, dtype=torch.bfloat16, device=device) for _ in range(2)]
        det = _time(_layer_variant(xs, outs, weights, k, False), calls=5, replays=7)
        sc = _time(_layer_variant(xs, outs, weights, k, True), calls=5, replays=7)
        shape = f"K={k} H={h} I={intermediate} E={NUM_EXPERTS}"
        rows_out.append(
            _row(
                "layer",
                shape,
                m,
                "deterministic finalize",
                det,
                0,
                {"x_vs_scatter-add": (sc / det) if det and sc else None},
            )
        )
        rows_out.append(_row("layer", shape, m, "scatter-add finalize", sc, 0))
    return rows_out


# ----------------------------------------------------------------------------- bars
def check_bars(rows: list[dict], k: int) -> list[dict]:
    """The issue's performance bar, evaluated on the measured rows."""
    by = {(r["op"], r["shape"], r["M"], r["variant"]): r for r in rows}
    bars = []
    for (op, shape, m, variant), r in by.items():
        if (
            op == "permute->finalize"
            and variant == "PDL default"
            and r.get("x_vs_best of on/off") is not None
        ):
            value = r["x_vs_best of on/off"]
            bars.append(
                {
                    "bar": f"{shape} M={m}: PDL default >= faster of on/off (2% noise)",
                    "value": value,
                    "ok": value >= 0.98,
                }
            )
        if op != "finalize" or variant != "moefuse" or r["us"] is None:
            continue
        if shape == f"K={k} H=4096" and m >= 2048:
            bars.append(
                {"bar": f"{shape} M={m}: >= 3.5 TB/s", "value": r["tbs"], "ok": r["tbs"] >= 3.5}
            )
        if m == 1:
            bars.append({"bar": f"{shape} M=1: <= 2.5 us", "value": r["us"], "ok": r["us"] <= 2.5})
        sc = by.get((op, shape, m, "scatter-add"))
        if sc and sc["us"]:
            bars.append(
                {
                    "bar": f"{shape} M={m}: deterministic <= scatter-add",
                    "value": r["us"] / sc["us"],
                    "ok": r["us"] <= sc["us"],
                }
            )
    return bars


def run(args: argparse.Namespace, device: torch.device) -> int:
    k = args.top_k
    tokens = tuple(args.tokens or (QUICK_TOKENS if args.quick else DEFAULT_TOKENS))
    hidden = tuple(args.hidden or ((4096,) if args.quick else DEFAULT_HIDDEN))
    problems = check_correctness(device, h=hidden[0], k=k)
    print("correctness:", "OK (bitwise vs CPU reference)" if not problems else problems)
    ceiling = harness.copy_ceiling_tbs()
    print(f"SM copy ceiling: {ceiling:.2f} TB/s")
    rows = bench_finalize(device, tokens, hidden, k, not args.no_compile, args.tune)
    rows += bench_chain(device, [m for m in tokens if m <= 2048], hidden[0], k)
    if not args.no_layer:
        layer_tokens = [m for m in tokens if m <= (2048 if args.quick else 16384)]
        rows += bench_layer(device, layer_tokens, hidden[0], k, args.layer_intermediate)
    for r in rows:
        if r.get("tbs") is not None:
            r["of_ceiling"] = r["tbs"] / ceiling
    harness.print_table(
        rows,
        [
            "op",
            "shape",
            "M",
            "variant",
            "us",
            "tbs",
            "of_ceiling",
            "x_vs_torch.compile",
            "x_vs_torch eager",
            "x_vs_scatter-add",
            "x_vs_PDL off",
            "x_vs_best of on/off",
        ],
    )
    bars = check_bars(rows, k)
    for b in bars:
        print(f"{'PASS' if b['ok'] else 'FAIL'}  {b['bar']}  ({b['value']:.3g})")
    if args.save:
        meta = harness.run_metadata()
        meta.update(
            ceiling_tbs=ceiling,
            correctness=problems or "ok",
            bars=bars,
            bytes="finalize: M*K*H + M*H BF16 elements + M*K*(4+4) index/scale bytes",
        )
        paths = harness.save_results("moe", rows, meta, args.out)
        print("wrote", *[p for p in paths if p])
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("moefuse bench moe: needs a CUDA GPU", file=sys.stderr)
        return 2
    return run(args, torch.device("cuda"))
