"""Host profile of compiled static-cache ``generate``, shipped vs patched Qwen3-MoE, on one GPU.

The model of ``python -m moefuse.bench.hf_moe --compiled`` (Qwen3-30B-A3B block shapes, 4 layers,
random weights, BF16). Per variant, each in a fresh compile state (``torch._dynamo.reset()``):
two warm ``generate`` calls of 64 tokens with one static cache reset per call, then decode tokens/s
((64 - 1) tokens over the time of 64 minus that of 1, medians of 3 calls), then one call under
cProfile (the 40 functions with the most own time and the 60 with the most cumulative time) and
one of 16 tokens under torch.profiler (CPU and CUDA, by self CPU time).

    PYTHONPATH=src python scripts/profile_generate_host.py [shipped patched]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("variants", nargs="*", default=["shipped", "patched"])
    variants = p.parse_args().variants
    from transformers import CompileConfig, Qwen3MoeForCausalLM, StaticCache

    from moefuse.bench import hf_compiled
    from moefuse.bench.hf_moe import parse_args
    from moefuse.integrations.transformers import patch

    args = parse_args(["--compiled"])
    args.backend = "inductor"  # what the bench compiles with on a GPU (Variant's torch.compile)
    dev = torch.device("cuda")
    torch.manual_seed(0)
    with torch.device(dev):
        shipped = Qwen3MoeForCausalLM(hf_compiled.qwen3_config(args, args.layers))
    shipped = shipped.to(torch.bfloat16).eval()
    patched = copy.deepcopy(shipped)
    patch(patched)
    models = {"shipped": shipped, "patched": patched}
    prompt = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(dev)
    for name in variants:
        variant = hf_compiled.Variant(name, models[name], args, dev)
        torch._dynamo.reset()
        config = CompileConfig()
        cache = StaticCache(config=variant.model.config, max_cache_len=16 + 64)

        def gen(n, variant=variant, config=config, cache=cache):
            return variant.generate(prompt, n, config, cache)  # resets the cache first

        for _ in range(2):
            gen(64)
        times = {}
        for n in (1, 64):
            samples = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                gen(n)
                torch.cuda.synchronize()
                samples.append(time.perf_counter() - t0)
            times[n] = statistics.median(samples)
        per_token = (times[64] - times[1]) / 63
        print(f"== {name} tok/s {1 / per_token:.1f} ms/token {per_token * 1e3:.3f}", flush=True)
        prof = cProfile.Profile()
        prof.enable()
        gen(64)
        torch.cuda.synchronize()
        prof.disable()
        for key, rows in (("tottime", 40), ("cumulative", 60)):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(rows)
            print(out.getvalue(), flush=True)
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as tp:
            gen(16)
            torch.cuda.synchronize()
        print(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=40), flush=True)


if __name__ == "__main__":
    main()
