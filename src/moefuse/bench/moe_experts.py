"""Fused routed experts (:func:`moefuse.moe_experts`) against transformers' experts functions.

    python -m moefuse bench moe-experts [--save] [--out DIR] [--quick]

For the Qwen3-MoE (H 2048, I 768, E 128, K 8), Mixtral (H 4096, I 14336, E 8, K 2) and
DeepSeek-V3 (H 7168, I 2048, E 256, K 8) expert shapes, BF16, random weights and random routing
(distinct experts per token, softmax weights; fixed seed) at T = 1, 4, 16, 64, 256 tokens:

* checks first: ``moe_experts`` against each baseline (max error over the output's max) and
  against its FP64-product reference (relative norm error, T <= 64), and a token's output bits
  alone against the same token inside batches of 64 and 256 (three tokens per shape);
* CUDA-graph µs (median of replays; each call uses another of several routing sets, so the
  weights of one call are not in L2 from the one before) of ``moe_experts`` ("moefuse"),
  transformers' ``grouped_mm`` and ``batched_mm`` experts functions (``batched_mm`` copies each
  slot's expert matrices: skipped where that copy exceeds 16 GB), and moefuse's composed path
  ("moefuse_composed": routing plan, permute, grouped GEMMs from torch, finalize) on a small
  module with the attributes those functions read;
* the floor: bytes of the gate, up and down weights of the distinct routed experts over the
  datasheet bandwidth of the GPU the run is on (:func:`moefuse.bench.harness.datasheet_tbs`;
  none for a GPU the table does not know), and the same bytes over the SM copy ceiling measured
  in this run (``x_floor_copy``);
* per-kernel µs of one moefuse call (torch.profiler, eager: the device time of each kernel).

Writes ``moe-experts-<gpu>.json`` and ``.png`` with ``--save``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moefuse.bench.experts_setup import (
    BATCHED_MAX_BYTES,
    ROUTING_SETS,
    SHAPES,
    TOKENS,
    FakeExperts,
    expert_bytes,
    kernel_times,
    make_routing,
    make_weights,
)
from moefuse.bench.harness import (
    bandwidth_line,
    copy_ceiling_tbs,
    datasheet_gpu,
    graph_time_us,
    print_table,
    run_metadata,
    save_results,
)


def check_invariance(shape: dict, gu, dn, device) -> bool:
    """A token's bits alone == inside batches of 64 and 256 (tokens 0, 17, 63)."""
    import moefuse

    x, idx, w = make_routing(256, shape, device, seed=99)
    full = moefuse.moe_experts(x, gu, dn, idx, w)
    b64 = moefuse.moe_experts(x[:64], gu, dn, idx[:64], w[:64])
    ok = True
    for j in (0, 17, 63):
        alone = moefuse.moe_experts(x[j : j + 1], gu, dn, idx[j : j + 1], w[j : j + 1])
        for batch in (b64, full):
            ok &= bool(torch.equal(alone[0].view(torch.int16), batch[j].view(torch.int16)))
    return ok


def bench_shape(name: str, shape: dict, tokens_list, args, device, ceiling_tbs) -> list[dict]:
    import moefuse
    from moefuse.integrations import _experts as ex

    gu, dn = make_weights(shape, device)
    module = FakeExperts(gu, dn)
    module.__dict__[ex.IMPL_ATTR] = "auto"
    import transformers.integrations.moe as tf_moe

    invariant = check_invariance(shape, gu, dn, device)
    desc = f"{name} H{shape['hidden']} I{shape['inter']} E{shape['experts']} K{shape['top_k']}"
    rows = []
    for t in tokens_list:
        sets = [make_routing(t, shape, device, seed=1000 * t + s) for s in range(ROUTING_SETS)]
        distinct = statistics.mean(len(torch.unique(idx)) for _, idx, _ in sets)
        nbytes = distinct * expert_bytes(shape)
        sheet = datasheet_gpu()
        floor = nbytes / (sheet[1] * 1e12) * 1e6 if sheet else None
        floor_copy = nbytes / (ceiling_tbs * 1e12) * 1e6

        def composed(x, idx, w):
            ex.FUSED = False
            try:
                return ex.moefuse_experts_forward(module, x, idx, w)
            finally:
                ex.FUSED = True

        variants = {"moefuse": lambda x, idx, w: moefuse.moe_experts(x, gu, dn, idx, w)}
        for base in ("grouped_mm", "batched_mm"):
            fn = getattr(tf_moe, f"{base}_experts_forward", None)
            if fn is not None:
                variants[base] = lambda x, idx, w, fn=fn: fn(module, x, idx, w)
        variants["moefuse_composed"] = composed
        if t * shape["top_k"] * expert_bytes(shape) > BATCHED_MAX_BYTES:
            variants.pop("batched_mm", None)
        x0, i0, w0 = sets[0]
        got = variants["moefuse"](x0, i0, w0).float()
        errs = {}
        for base in ("grouped_mm", "batched_mm", "moefuse_composed"):
            if base not in variants:
                continue
            try:  # transformers versions differ: a baseline that cannot run is left out
                want = variants[base](x0, i0, w0).float()
            except Exception as exc:  # noqa: BLE001
                print(f"{name} T={t}: {base} left out: {type(exc).__name__}: {exc}")
                variants.pop(base)
                continue
            errs[base] = float((got - want).abs().max()) / (float(want.abs().max()) or 1.0)
        if t <= 64:
            want = moefuse.moe_experts(x0, gu, dn, i0, w0, impl="reference").float()
            errs["reference"] = float((got - want).norm() / want.norm())
        calls = int(max(3, min(20, 20000 / (3 * floor_copy + 20))))
        times = {}
        for vname, fn in variants.items():
            times[vname] = graph_time_us(
                lambda i, f=fn, sets=sets: f(*sets[i % len(sets)]),
                calls=calls,
                replays=args.replays,
            )
        kernels = kernel_times(lambda f=variants["moefuse"], a=sets[0]: f(*a), device)
        for vname, us in times.items():
            row = {
                "op": "moe_experts",
                "shape": desc,
                "M": t,
                "variant": vname,
                "us": us,
                "distinct_experts": distinct,
                "floor_us": floor,
                "x_floor": us / floor if floor else None,
                "floor_copy_us": floor_copy,
                "x_floor_copy": us / floor_copy,
            }
            if vname == "moefuse":
                row.update(rel_err=errs, batch_invariant=invariant, kernels_us=kernels)
                for base in ("grouped_mm", "batched_mm", "moefuse_composed"):
                    if base in times:
                        row[f"x_{base}"] = times[base] / us
            rows.append(row)
        print_table(
            [r for r in rows if r["M"] == t],
            ["shape", "M", "variant", "us", "floor_us", "x_floor", "x_floor_copy", "x_grouped_mm"],
        )
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--save", action="store_true", help="write JSON + PNG under --out")
    p.add_argument("--out", default="bench/results", help="results directory")
    p.add_argument("--quick", action="store_true", help="T in 1, 64 only; fewer replays")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    p.add_argument("--replays", type=int, default=8)
    p.add_argument(
        "--dtype",
        choices=("bf16", "fp8"),
        default="bf16",
        help="fp8: block-scaled FP8 weights (moefuse.bench.moe_experts_fp8)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.replays = [1, 64], 5
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dtype == "fp8":
        from moefuse.bench import moe_experts_fp8

        return moe_experts_fp8.main(argv)
    if not torch.cuda.is_available():
        print("moe-experts: needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    ceiling = copy_ceiling_tbs()
    print(bandwidth_line(ceiling))
    rows = []
    for name in args.shapes:
        rows += bench_shape(name, SHAPES[name], args.tokens, args, device, ceiling)
        torch.cuda.empty_cache()  # the shape's weights are gone with bench_shape's frame
        if args.save:  # after every shape: a run cut short keeps what it measured
            save(rows, ceiling, args)
    print_table(
        [r for r in rows if r["variant"] == "moefuse"],
        [
            "shape",
            "M",
            "distinct_experts",
            "us",
            "floor_us",
            "x_floor",
            "x_floor_copy",
            "x_grouped_mm",
            "x_batched_mm",
            "x_moefuse_composed",
            "batch_invariant",
        ],
    )
    for r in rows:
        if r["variant"] == "moefuse":
            top = ", ".join(
                f"{k.split('(')[0][:32]} {v:.1f}" for k, v in list(r["kernels_us"].items())[:5]
            )
            print(f"{r['shape'].split()[0]} T={r['M']}: {top}")
    return 0


def save(rows, ceiling, args) -> None:
    """Write the JSON + PNG of the rows so far (with the run metadata)."""
    meta = run_metadata()
    sheet = datasheet_gpu()
    meta.update(
        copy_ceiling_tbs=ceiling,
        datasheet_tbs=sheet[1] if sheet else None,
        datasheet_gpu=sheet[0] if sheet else "unknown",
        routing_sets=ROUTING_SETS,
        floor="bytes of gate+up+down of the distinct routed experts / this GPU's datasheet "
        "bandwidth (datasheet_tbs; none where unknown); x_floor_copy: the same bytes over the "
        "copy ceiling measured in this run",
        baseline_note="transformers.integrations.moe grouped_mm / batched_mm experts "
        "functions and moefuse's composed path, same inputs",
    )
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    json_path, png_path = save_results("moe-experts", rows, meta, args.out)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))


if __name__ == "__main__":
    raise SystemExit(main())
