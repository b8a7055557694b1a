"""transformers' Qwen3-MoE sparse block and whole-model decode, shipped vs moefuse.

    python -m moefuse.bench.hf_moe --out DIR          # one GPU (H200: the issue's perf bar)
    python -m moefuse.bench.hf_moe --smoke --out DIR  # tiny shapes on CPU (checks the script)
    python -m moefuse.bench.hf_moe --compiled --out DIR  # torch.compile + CUDA graphs instead
                                                         # (moefuse.bench.hf_compiled)
    python -m moefuse.bench.hf_moe --fp8 [--compiled] --out DIR  # the model quantized to FP8
                                                         # (moefuse.bench.hf_fp8)

1. Sparse-MoE block (``Qwen3MoeSparseMoeBlock``, router + experts), Qwen3-MoE shapes H = 2048,
   E = 128, K = 8, I = 768, BF16, random weights: µs per block call in EAGER mode (host time
   included: ``calls`` back-to-back calls between two synchronizations) at T = 1 / 16 / 256 /
   2048 / 8192 tokens for the experts implementations "grouped_mm", "batched_mm" (T <= 16 only)
   and "moefuse", and for the block as ``patch(model)`` leaves it ("moefuse+router": "moefuse"
   experts, and the router's softmax, top-k and renormalization on ``router_topk``). Timed in
   ``repeats`` interleaved rounds (every variant once per round, the order rotated; median, min
   and max per variant) after ``--warmup-s`` seconds of block calls. Every variant's output is
   first checked against "grouped_mm" (relative max error <= 3e-2 of the output's max: both are
   BF16 pipelines with other rounding points).
2. Eager greedy decode, batch 1, of a small whole Qwen3-MoE model with the real block shapes
   (``--layers`` layers, random weights from the config): tokens / s as shipped and after
   ``moefuse.integrations.transformers.patch(model)``, from two ``generate`` lengths
   (``(n_long - n_short) / (t_long - t_short)`` of the medians, so prefill cancels out), in
   ``decode_repeats`` rounds that alternate the two variants (``patch`` / ``unpatch`` between
   samples, outside the timings).

Writes ``hf_moe-<gpu>.json`` and ``.png`` (µs per block against T, one line per implementation)
into DIR and prints both tables with the ratios the issue's bar asks for.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from functools import partial

import torch

from moefuse.bench.harness import (
    interleaved_us,
    module_command,
    print_table,
    rotated,
    run_metadata,
    save_results,
    spin,
    sync,
)
from moefuse.bench.hf_bars import eager_bars
from moefuse.bench.hf_compiled import qwen3_config

IMPLS = ("grouped_mm", "batched_mm", "moefuse")
#: the block as ``patch(model)`` leaves it: "moefuse" experts and the router on ``router_topk``
PATCHED_BLOCK = "moefuse+router"


def set_block_impl(block, name: str) -> None:
    """Point a standalone block's experts at ``name`` (what set_experts_implementation does)."""
    block.experts.config._experts_implementation = name


@torch.inference_mode()
def bench_block(args, device) -> list[dict]:
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from moefuse.integrations.transformers import patch, register

    register()
    cfg = qwen3_config(args, 1)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    block = block.to(device=device, dtype=torch.bfloat16).eval()
    # the block as patch(model) leaves it: moefuse experts and the router on router_topk
    patched = copy.deepcopy(block)
    if patch(patched, experts=False, norms=False)["routers"] != 1:
        raise RuntimeError(f"{type(block.gate).__name__}: router not patched (probe disagreed)")
    set_block_impl(patched, "moefuse")
    blocks = {name: block for name in IMPLS} | {PATCHED_BLOCK: patched}
    prepare = {name: partial(set_block_impl, block, name) for name in IMPLS}
    prepare[PATCHED_BLOCK] = lambda: None
    rows = []
    warm = torch.randn(1, max(args.tokens), args.hidden, device=device, dtype=torch.bfloat16)
    set_block_impl(block, "grouped_mm")
    spin(lambda: block(warm), device, args.warmup_s)
    for t in args.tokens:
        x = torch.randn(1, t, args.hidden, device=device, dtype=torch.bfloat16)
        set_block_impl(block, "grouped_mm")
        want = block(x).float()
        scale = float(want.abs().max()) or 1.0
        names = [n for n in blocks if n != "batched_mm" or t <= args.batched_max]
        errors = {}
        for name in names:
            prepare[name]()
            errors[name] = float((blocks[name](x).float() - want).abs().max()) / scale
            if errors[name] > 3e-2:
                raise AssertionError(
                    f"{name} at T={t}: relative error {errors[name]:.3g} vs grouped_mm"
                )
        timed = interleaved_us(
            {n: partial(blocks[n], x) for n in names},
            device,
            args.calls,
            args.repeats,
            prepare={n: prepare[n] for n in names},
        )
        for name in names:
            rows.append(
                {
                    "op": "qwen3_moe_block",
                    "shape": f"H{args.hidden} E{args.experts} K{args.topk} I{args.inter}",
                    "variant": name,
                    "M": t,
                    **timed[name],
                    "rel_err_vs_grouped_mm": errors[name],
                }
            )
    by = {(r["variant"], r["M"]): r["us"] for r in rows}
    for r in rows:
        if r["variant"] in ("moefuse", PATCHED_BLOCK):
            base = [by[(n, r["M"])] for n in IMPLS[:2] if (n, r["M"]) in by]
            r["x_best_transformers"] = min(base) / r["us"]
            r["x_grouped_mm"] = by[("grouped_mm", r["M"])] / r["us"]
    return rows


@torch.inference_mode()
def bench_decode(args, device) -> list[dict]:
    from transformers import Qwen3MoeForCausalLM

    from moefuse.integrations.transformers import patch, unpatch

    cfg = qwen3_config(args, args.layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    prompt = torch.randint(0, args.vocab, (1, 16), device=device)

    def gen(n):
        return model.generate(
            prompt,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )

    def seconds(n):
        sync(device)
        t0 = time.perf_counter()
        out = gen(n)
        sync(device)
        return time.perf_counter() - t0, out

    shipped_experts = model.config._experts_implementation
    report = patch(model)
    variants = {"shipped": lambda: unpatch(model), "moefuse patch": lambda: patch(model)}
    for apply in variants.values():  # warm-up (kernels compiled, caches allocated)
        apply()
        gen(args.short)
    # interleaved rounds (the model is patched and unpatched between samples, outside the
    # timings), so a slow spell of the machine lands on both variants alike
    times = {name: {args.short: [], args.long: []} for name in variants}
    tokens = {}
    for rnd in range(args.decode_repeats):
        for name in rotated(list(variants), rnd):
            variants[name]()
            for n in (args.short, args.long):
                dt, tokens[name] = seconds(n)
                times[name][n].append(dt)
    unpatch(model)

    def rate(name):
        t = {n: statistics.median(v) for n, v in times[name].items()}
        return (args.long - args.short) / (t[args.long] - t[args.short])

    shipped_rate, patched_rate = rate("shipped"), rate("moefuse patch")
    same = float((tokens["moefuse patch"] == tokens["shipped"]).float().mean())
    return [
        {"op": "decode", "variant": "shipped", "tok_s": shipped_rate, "experts": shipped_experts},
        {
            "op": "decode",
            "variant": "moefuse patch",
            "tok_s": patched_rate,
            "experts": "moefuse",
            "patched": report,
            "x_shipped": patched_rate / shipped_rate,
            "greedy_tokens_equal_fraction": same,
        },
    ]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench/results", help="directory for JSON + PNG")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (script check)")
    p.add_argument(
        "--tokens", type=int, nargs="*", help="default 1 16 256 2048 8192 (--fp8: 1 64 2048)"
    )
    p.add_argument("--batched-max", type=int, default=16, help="largest T for batched_mm")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeats", type=int, default=9, help="interleaved timing rounds")
    p.add_argument(
        "--warmup-s", type=float, default=2.0, help="seconds of block calls before the first sample"
    )
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the decode model")
    p.add_argument("--short", type=int, default=8)
    p.add_argument("--long", type=int, default=40)
    p.add_argument("--decode-repeats", type=int, default=4, help="interleaved rounds")
    p.add_argument("--skip-decode", action="store_true")
    c = p.add_argument_group("--compiled (moefuse.bench.hf_compiled)")
    c.add_argument("--compiled", action="store_true", help="compiled model, shipped vs patched")
    c.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    c.add_argument("--new", type=int, default=64, help="greedy tokens per generate")
    c.add_argument("--cache-len", type=int, default=128, help="static cache of the step")
    c.add_argument("--teacher", type=int, default=32, help="teacher-forced steps vs FP32")
    c.add_argument("--prefill", type=int, nargs="*", default=[512, 2048])
    c.add_argument("--replays", type=int, default=40, help="graph replays per timing sample")
    c.add_argument("--samples", type=int, default=7)
    c.add_argument(
        "--generate-passes",
        type=int,
        default=3,
        help="generate stage passes over both variants (tok_s: their median)",
    )
    c.add_argument(
        "--variants", nargs="+", default=["shipped", "patched"], choices=["shipped", "patched"]
    )
    c.add_argument(
        "--skip", nargs="*", default=[], help="stages to skip: step profile fp32 generate prefill"
    )
    f = p.add_argument_group("--fp8 (moefuse.bench.hf_fp8)")
    f.add_argument("--fp8", action="store_true", help="FP8 model: shipped, patched BF16 / FP8")
    f.add_argument("--batch", type=int, default=64, help="sequences of the batched decode step")
    f.add_argument("--logit-prompts", type=int, default=4, help="prompts of the logits rows")
    f.add_argument("--logit-tokens", type=int, default=32, help="tokens per logits prompt")
    args = p.parse_args(argv)
    args.command = module_command("moefuse.bench.hf_moe", sys.argv[1:] if argv is None else argv)
    if args.tokens is None:
        args.tokens = [1, 64, 2048] if args.fp8 else [1, 16, 256, 2048, 8192]
    shapes = dict(
        hidden=2048,
        experts=128,
        topk=8,
        inter=768,
        dense_inter=6144,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
    )
    if args.smoke:
        shapes = dict(
            hidden=64,
            experts=8,
            topk=2,
            inter=32,
            dense_inter=96,
            heads=4,
            kv_heads=2,
            head_dim=16,
            vocab=256,
        )
        args.tokens, args.calls, args.repeats, args.warmup_s = [1, 16, 40], 2, 1, 0.0
        args.layers, args.short, args.long, args.decode_repeats = 2, 2, 4, 1
        args.new, args.teacher, args.prefill, args.replays, args.samples = 6, 4, [24], 2, 1
        args.cache_len = 32
        if args.fp8:  # every FP8 weight a whole number of 128 x 128 blocks
            shapes.update(hidden=128, inter=128, dense_inter=256, heads=2, kv_heads=2, head_dim=64)
            args.tokens, args.batch, args.logit_prompts, args.logit_tokens = [1, 8], 3, 2, 6
    for key, value in shapes.items():
        setattr(args, key, value)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.fp8:
        from moefuse.bench import hf_fp8

        return hf_fp8.main(args)
    if args.compiled:
        from moefuse.bench import hf_compiled

        args.repeats = min(args.repeats, 3)
        return hf_compiled.main(args)
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    rows = bench_block(args, device)
    print_table(
        rows, ["variant", "M", "us", "x_best_transformers", "x_grouped_mm", "rel_err_vs_grouped_mm"]
    )
    if not args.skip_decode:
        decode = bench_decode(args, device)
        print_table(
            decode, ["variant", "experts", "tok_s", "x_shipped", "greedy_tokens_equal_fraction"]
        )
        rows += decode
    meta = run_metadata()
    meta["command"] = args.command
    meta["method"] = (
        "eager: wall time of back-to-back calls between synchronizations / calls "
        "(host time included), median of interleaved rounds (every implementation once per "
        "round, rotated order) after a warm-up; decode: greedy generate, "
        "(n_long - n_short) / (t_long - t_short) of medians over rounds alternating "
        "shipped and patched"
    )
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    meta["bars"] = eager_bars(rows)
    print("\n".join(meta["bars"]))
    json_path, png_path = save_results("hf_moe", rows, meta, args.out)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))
    return {"rows": rows, "json": str(json_path), "bars": meta["bars"]}


if __name__ == "__main__":
    main()
