"""transformers' Qwen3-MoE COMPILED (torch.compile + CUDA graphs), shipped vs moefuse-patched.

    python -m moefuse.bench.hf_moe --compiled --out DIR          # one GPU
    python -m moefuse.bench.hf_moe --compiled --smoke --out DIR  # tiny, CPU, aot_eager

The issue's model: Qwen3-30B-A3B block shapes (H 2048, 128 experts, top-8, expert width 768,
32 query / 4 KV heads of 128), ``--layers`` layers, vocabulary 151936, random weights from the
config, BF16, batch 1. "shipped" is the model as transformers builds it (``grouped_mm``
experts); "patched" is a deep copy after ``moefuse.integrations.transformers.patch``. Per variant:

1. ``step``: the compiled forward (``torch.compile(model, dynamic=False)``, inductor default
   mode) of ONE decode token against a static KV cache (prompt prefilled eagerly, max length
   ``--cache-len``), called eagerly, then captured in a CUDA graph: ``graph_bits_equal`` says
   whether replays give the eager compiled call's logits bit for bit; ``us`` is the median µs of
   a replay (``--replays`` replays per sample between two events, median of ``--samples``
   rounds that interleave the variants, order rotated each round; ``us_min`` / ``us_max``).
2. ``profile``: kernels of one replayed step (torch.profiler): name, launches and µs per step.
3. ``fp32``: teacher-forced closeness of the compiled step to an FP32 evaluation (a float copy
   of the same weights, eager): the FP32 model's greedy continuation of the prompt is fed one
   token at a time to the captured step (its inputs updated in place); per step, the RMS of the
   logits' difference from the FP32 logits (median over steps) and whether the argmax agrees.
4. ``generate``: ``generate(..., cache_implementation="static")`` (transformers compiles the
   decode step with mode="reduce-overhead": CUDA graphs), ``--new`` greedy tokens; decode
   tokens / s = (new - 1) / (t(new) - t(1)) (the prefill, eager, cancels out), medians of
   ``--repeats``, in ``--generate-passes`` passes over both variants (the order rotated each
   pass; ``tok_s`` the median of the passes, each in ``tok_s_passes``); greedy-token agreement
   with the other variant and with the FP32 model. Each variant starts from
   ``torch._dynamo.reset()`` (which also drops the CUDA-graph trees), as in a process that
   serves one model: the other model's compiled frames (the two share transformers' forward
   wrapper, so their graphs were entries of one frame's cache) and its recorded graphs are gone
   while it runs.
5. ``prefill``: the compiled forward over ``--prefill`` tokens (no cache, ``logits_to_keep=1``
   as generate's prefill), captured (both variants) and replayed like the step (interleaved);
   on a GPU, the kernels of one replay at the largest ``--prefill`` (row ``prefill <T>
   profile``, as ``profile``; left out with ``--skip profile``).

Every compile is counted: dynamo's ``graph_break`` counter and graph count per stage and variant
(``graph_breaks``, ``graphs``). Writes ``hf_moe-<gpu>-compiled.json`` and ``.png`` after every
stage (a run cut short keeps what it measured) and prints the table with the ratios.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch

from moefuse.bench.harness import (
    interleaved_rounds,
    print_table,
    rotated,
    run_metadata,
    save_results,
    sync,
)
from moefuse.bench.hf_bars import compiled_bars

VARIANTS = ("shipped", "patched")


class Counted:
    """Graph breaks and graphs dynamo counted while the ``with`` block ran, and the graphs for
    which inductor declined its CUDA graphs (``mode="reduce-overhead"``: a graph that mutates an
    input it does not know as static, or one on a CPU tensor, runs without one, i.e. with every
    kernel launched from the host)."""

    def __enter__(self):
        from torch._dynamo.utils import counters

        self._c = counters
        self._breaks = sum(counters["graph_break"].values())
        self._graphs = counters["stats"]["unique_graphs"]
        self._skips = counters["inductor"]["cudagraph_skips"]
        return self

    def __exit__(self, *exc):
        self.breaks = sum(self._c["graph_break"].values()) - self._breaks
        self.graphs = self._c["stats"]["unique_graphs"] - self._graphs
        self.reasons = sorted(self._c["graph_break"])[:10]
        self.cudagraph_skips = self._c["inductor"]["cudagraph_skips"] - self._skips


def capture(fn, device):
    """(graph, output) of ``fn()`` captured in a CUDA graph after two warm calls on a side stream;
    on CPU (smoke) no graph: (None, fn())."""
    if device.type != "cuda":
        return None, fn()
    from moefuse.testing import graph_capture

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):
        out = fn()
    return graph, out


def interleaved_replay_us(items: dict, device, replays: int, samples: int) -> dict:
    """µs of one replay of each of ``items`` (name -> (graph, fn)), timed in ``samples``
    interleaved rounds (:func:`moefuse.bench.harness.interleaved_rounds`): per round, each graph
    replays ``replays`` times back to back between two CUDA events, the order rotated each round
    (one untimed replay each first). Returns name -> ``{"us": median, "us_min", "us_max"}``. On
    CPU (graph None, the smoke run): wall time of eager ``fn()`` calls."""

    def sample(name):
        graph, fn = items[name]
        if graph is None:
            t0 = time.perf_counter()
            for _ in range(replays):
                fn()
            return (time.perf_counter() - t0) / replays * 1e6
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / replays

    for graph, _ in items.values():
        if graph is not None:
            graph.replay()
    return interleaved_rounds(list(items), samples, sample)


def profile_step(graph, replays: int = 3) -> list[dict]:
    """Kernels of ``replays`` graph replays: name, launches and µs per step (largest first)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0:
            k = kernels.setdefault(ev.name, [0, 0.0])
            k[0] += 1
            k[1] += ev.device_time
    rows = [
        {"kernel": name[:90], "launches": n / replays, "us": t / replays}
        for name, (n, t) in kernels.items()
    ]
    return sorted(rows, key=lambda r: -r["us"])


def profile_row(op: str, variant: str, kernels: list[dict]) -> dict:
    """A profile row: the 40 largest kernels, the totals, and moefuse's share (names
    ``*_kernel``)."""
    ours = [k for k in kernels if k["kernel"].endswith("_kernel")]
    return {
        "op": op,
        "variant": variant,
        "kernels": kernels[:40],
        "us_total": sum(k["us"] for k in kernels),
        "launches": sum(k["launches"] for k in kernels),
        "moefuse_us": sum(k["us"] for k in ours),
        "moefuse_launches": sum(k["launches"] for k in ours),
    }


#: the row of ``generate`` with one static cache reset and reused across calls
REUSED_CACHE_OP = "compiled generate, one reused cache"


class Variant:
    """One model (shipped or patched), its compiled forward and its decode-step inputs."""

    def __init__(self, name, model, args, device):
        self.name, self.model, self.args, self.device = name, model, args, device
        self.compiled = torch.compile(model, dynamic=False, backend=args.backend)
        self.rows: dict[str, dict] = {}

    def decode_inputs(self, prompt):
        """Static cache holding ``prompt`` (eager prefill) and the next token's step inputs."""
        from transformers import StaticCache

        n = prompt.shape[1]
        cache = StaticCache(config=self.model.config, max_cache_len=self.args.cache_len)
        pos = torch.arange(n, device=self.device)
        logits = self.model(
            input_ids=prompt,
            past_key_values=cache,
            cache_position=pos,
            use_cache=True,
            logits_to_keep=1,
        ).logits
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        # transformers' static cache layers may keep a device counter of the tokens written (the
        # next write position); it is set back before every step so that every call writes the
        # same slot and sees the same cache (one _foreach_copy_ kernel, captured with the step)
        self.counters = [
            layer.cumulative_length
            for layer in getattr(cache, "layers", [])
            if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)
        ]
        self.start = [c.clone() for c in self.counters]
        where = torch.tensor([n], device=self.device)
        return dict(
            input_ids=nxt,
            past_key_values=cache,
            cache_position=where,
            position_ids=where[None].clone(),
            use_cache=True,
        )

    def run_step(self):
        if self.counters:
            torch._foreach_copy_(self.counters, self.start)
        return self.compiled(**self.kw)

    def step(self, prompt) -> dict:
        """The ``step`` stage's row without its timing (``us``: :func:`time_variants`); keeps
        the captured step in ``self.graph``."""
        self.kw = self.decode_inputs(prompt)
        with Counted() as c:
            eager = [self.run_step().logits.clone() for _ in range(3)]
        self.graph, self.out = capture(self.run_step, self.device)
        graph_same = None
        if self.graph is not None:
            self.out.logits.fill_(float("nan"))
            self.graph.replay()
            sync(self.device)
            graph_same = torch.equal(self.out.logits.view(torch.int16), eager[0].view(torch.int16))
        same = all(torch.equal(e.view(torch.int16), eager[0].view(torch.int16)) for e in eager)
        return {
            "op": "compiled decode step",
            "variant": self.name,
            "M": 1,
            "graph_bits_equal": graph_same,
            "eager_runs_equal": bool(same),
            "graph_breaks": c.breaks,
            "graphs": c.graphs,
            "break_reasons": c.reasons,
        }

    def teacher_forced(self, tokens) -> list[torch.Tensor]:
        """Logits [V] of the captured step fed ``tokens`` one by one from the step's position."""
        kw, out = self.kw, []
        pos = int(kw["cache_position"][0])
        for i, tok in enumerate(tokens):
            kw["input_ids"].fill_(int(tok))
            for t in (kw["cache_position"], kw["position_ids"], *self.start):
                t.fill_(pos + i)
            if self.graph is not None:
                self.graph.replay()
                logits = self.out.logits
            else:
                logits = self.run_step().logits
            out.append(logits[0, -1].float().clone())
        return out

    def generate(self, prompt, n: int, compile_config=None, cache=None, **kw):
        """Greedy ``generate`` of ``n`` tokens with a static cache: a new one per call
        (``cache_implementation="static"``, transformers' default), or ``cache`` reset and
        reused (its tensors keep their addresses from call to call)."""
        if cache is None:
            kw["cache_implementation"] = "static"
        else:
            cache.reset()
            kw["past_key_values"] = cache
        return self.model.generate(
            prompt,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            compile_config=compile_config,
            **kw,
        )

    def generate_rate(self, prompt, compile_config, reuse_cache=False) -> tuple[dict, torch.Tensor]:
        """Decode tokens/s of compiled ``generate``: (new - 1) tokens / (time of ``new`` tokens -
        time of 1), medians of ``repeats`` calls. ``reuse_cache``: every call reuses one static
        cache. With a new cache per call, CUDA-graph trees find the graphs an earlier call
        recorded holding the old cache's addresses and record again (notes/integrations.md)."""
        from transformers import StaticCache

        args = self.args
        cache = None
        if reuse_cache:
            cache = StaticCache(config=self.model.config, max_cache_len=prompt.shape[1] + args.new)
        with Counted() as c:
            tokens = self.generate(prompt, args.new, compile_config, cache)  # compiles, records
        times = {}
        for n in (1, args.new):
            self.generate(prompt, n, compile_config, cache)
            samples = []
            for _ in range(args.repeats):
                sync(self.device)
                t0 = time.perf_counter()
                tokens_n = self.generate(prompt, n, compile_config, cache)
                sync(self.device)
                samples.append(time.perf_counter() - t0)
            times[n] = statistics.median(samples)
        row = {
            "op": REUSED_CACHE_OP if reuse_cache else "compiled generate",
            "variant": self.name,
            "new_tokens": args.new,
            "tok_s": (args.new - 1) / (times[args.new] - times[1]),
            "tok_s_with_prefill": args.new / times[args.new],
            "same_tokens_as_first_run": bool(torch.equal(tokens_n, tokens)),
            "graph_breaks": c.breaks,
            "graphs": c.graphs,
            "break_reasons": c.reasons,
            "cudagraph_skips": c.cudagraph_skips,
        }
        return row, tokens

    def prefill(self, tokens: int) -> tuple[dict, object, object]:
        """The ``prefill`` stage's row for ``tokens`` tokens without its timing, the captured
        forward and the function it captured (timed by :func:`time_variants`)."""
        g = torch.Generator().manual_seed(tokens)
        ids = torch.randint(0, self.args.vocab, (1, tokens), generator=g).to(self.device)

        def run():
            return self.compiled(input_ids=ids, use_cache=False, logits_to_keep=1)

        with Counted() as c:
            run()
        graph, _ = capture(run, self.device)
        row = {
            "op": "compiled prefill",
            "variant": self.name,
            "M": tokens,
            "graph_breaks": c.breaks,
            "graphs": c.graphs,
            "break_reasons": c.reasons,
        }
        return row, graph, run


def time_variants(rows: list[dict], items: dict, device, replays: int, samples: int) -> None:
    """Fill ``us``, ``us_min`` and ``us_max`` of ``rows`` (one per variant, in the order of
    ``items``: name -> (graph, fn)) from :func:`interleaved_replay_us`."""
    timed = interleaved_replay_us(items, device, replays, samples)
    for row, name in zip(rows, items):
        row.update(timed[name])


def _agree(a: torch.Tensor, b: torch.Tensor) -> dict:
    eq = (a == b).flatten()
    prefix = int((~eq).nonzero()[0, 0]) if (~eq).any() else eq.numel()
    return {"equal_fraction": float(eq.float().mean()), "common_prefix": prefix}


def qwen3_config(args, layers: int):
    """The Qwen3-MoE config of the benchmarks (block shapes from ``args``, ``layers`` layers;
    shared by :mod:`moefuse.bench.hf_moe`)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.dense_inter,
        moe_intermediate_size=args.inter,
        num_hidden_layers=layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        initializer_range=0.02,
    )


@torch.no_grad()  # as generate: the patched modules run their original forwards under autograd
def run(args, device) -> list[dict]:
    """Every stage for both variants (module docstring); ``save(rows)`` after each stage."""
    import torch._dynamo
    from transformers import CompileConfig, Qwen3MoeForCausalLM

    from moefuse.integrations.transformers import patch

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16)
    torch.manual_seed(0)
    with torch.device(device):
        shipped = Qwen3MoeForCausalLM(qwen3_config(args, args.layers))
    shipped = shipped.to(torch.bfloat16).eval()
    patched = copy.deepcopy(shipped)
    report = patch(patched)
    models = {"shipped": shipped, "patched": patched}
    variants = [Variant(name, models[name], args, device) for name in args.variants]
    prompt = torch.randint(
        0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1)
    ).to(device)
    rows: list[dict] = []
    stages = [s for s in ("step", "profile", "generate", "prefill", "fp32") if s not in args.skip]
    tokens: dict[str, torch.Tensor] = {}
    for stage in stages:
        t0 = time.perf_counter()
        try:
            if stage == "step":
                step_rows = [v.step(prompt) for v in variants]
                items = {v.name: (v.graph, v.run_step) for v in variants}
                time_variants(step_rows, items, device, args.replays, args.samples)
                rows += step_rows
            elif stage == "profile" and device.type == "cuda":
                rows += [
                    profile_row("step profile", v.name, profile_step(v.graph)) for v in variants
                ]
            elif stage == "fp32":
                rows += fp32_closeness(args, shipped, variants, prompt, tokens)
            elif stage == "generate":
                config = CompileConfig(backend=args.backend)
                if device.type != "cuda":
                    config.mode, config._compile_all_devices = None, True
                passes: dict[tuple, list[dict]] = {}
                for p in range(args.generate_passes):
                    for v in rotated(variants, p):
                        torch._dynamo.reset()  # a fresh process's compile state (docstring, 4.)
                        row, seq = v.generate_rate(prompt, config)
                        tokens[v.name] = seq[:, prompt.shape[1] :]
                        reused = _reused_cache_rate(v, prompt, config, tokens[v.name])
                        for r in (row, reused):
                            passes.setdefault((v.name, r["op"]), []).append(r)
                rows += [
                    merge_passes(passes[(v.name, op)]) for v in variants for op in GENERATE_OPS
                ]
                if len(variants) == 2:
                    agree = _agree(tokens["shipped"], tokens["patched"])
                    rows[-2].update({f"vs_shipped_{k}": x for k, x in agree.items()})
            elif stage == "prefill":
                profiled = "profile" not in args.skip
                for t in args.prefill:
                    captured = {v.name: v.prefill(t) for v in variants}
                    items = {name: (graph, fn) for name, (_, graph, fn) in captured.items()}
                    prefill_rows = [row for row, _, _ in captured.values()]
                    replays = max(1, args.replays // 4)
                    time_variants(prefill_rows, items, device, replays, args.samples)
                    rows += prefill_rows
                    for name, (_, graph, _) in captured.items():
                        if t == max(args.prefill) and graph is not None and profiled:
                            kernels = profile_step(graph, replays=1)
                            rows.append(profile_row(f"prefill {t} profile", name, kernels))
                    del captured, items
        except Exception as exc:  # a stage that fails is reported; the others still run
            rows.append(
                {
                    "op": f"{stage} FAILED",
                    "variant": "-",
                    "error": f"{type(exc).__name__}: {exc}"[:2000],
                }
            )
            print(f"stage {stage} failed: {type(exc).__name__}: {exc}", flush=True)
        print(f"stage {stage}: {time.perf_counter() - t0:.1f} s", flush=True)
        for r in rows:  # greedy tokens of the compiled generate vs the FP32 model's
            if r["op"] == "compiled generate" and {"fp32_generate", r["variant"]} <= set(tokens):
                agree = _agree(tokens[r["variant"]], tokens["fp32_generate"])
                r.update({f"vs_fp32_{k}": x for k, x in agree.items()})
        ratios(rows)
        args.save(rows, report)
    return rows


@torch.no_grad()
def fp32_closeness(args, shipped, variants, prompt, tokens) -> list[dict]:
    """Teacher-forced closeness of each variant's compiled step to the FP32 model (docstring)."""
    fp32 = copy.deepcopy(shipped).float()
    fp32.set_experts_implementation("eager")  # the per-expert loop: FP32 matmuls, no grouped_mm
    n = min(args.teacher, args.new - 1)
    want = fp32.generate(
        prompt,
        max_new_tokens=args.new,
        min_new_tokens=args.new,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens["fp32_generate"] = want.sequences[:, prompt.shape[1] :]
    cont = want.sequences[0, prompt.shape[1] :]
    ref = [lg[0].float() for lg in want.logits]  # ref[i]: logits after the prompt + cont[:i]
    del fp32
    rows = []
    for v in variants:
        # the step's cache holds the prompt; its first token was the variant's own argmax after
        # the prompt: restart from the FP32 continuation's first token at the same position
        v.kw["cache_position"].fill_(prompt.shape[1])
        got = v.teacher_forced(cont[:n])
        err = [
            float(((g - r) ** 2).mean().sqrt() / (r**2).mean().sqrt())
            for g, r in zip(got, ref[1 : n + 1])
        ]
        argmax = [int(g.argmax()) == int(r.argmax()) for g, r in zip(got, ref[1 : n + 1])]
        rows.append(
            {
                "op": "fp32 closeness",
                "variant": v.name,
                "steps": len(err),
                "rel_rms_logit_err_median": statistics.median(err),
                "rel_rms_logit_err_max": max(err),
                "argmax_agrees_fraction": sum(argmax) / len(argmax),
            }
        )
    return rows


def _reused_cache_rate(v, prompt, config, new_cache_tokens) -> dict:
    """The reused-cache row of ``v.generate_rate``; an error row where that path fails (the
    default rows stand either way)."""
    try:
        row, seq = v.generate_rate(prompt, config, reuse_cache=True)
    except Exception as exc:  # reported in the results, the other rows still count
        return {
            "op": REUSED_CACHE_OP,
            "variant": v.name,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
        }
    row["same_tokens_as_new_cache"] = bool(torch.equal(seq[:, prompt.shape[1] :], new_cache_tokens))
    return row


#: the rows of the generate stage, per variant
GENERATE_OPS = ("compiled generate", REUSED_CACHE_OP)


def merge_passes(rows: list[dict]) -> dict:
    """One row from the same generate row of several passes: ``tok_s`` (and
    ``tok_s_with_prefill``) the median over passes, each pass's in ``tok_s_passes``; a flag true
    only if true in every pass, the most graph breaks and graphs of any pass; an error row if
    any pass failed."""
    failed = [r for r in rows if "error" in r]
    if failed:
        return failed[0]
    out = dict(rows[0])
    for key in ("tok_s", "tok_s_with_prefill"):
        out[key] = statistics.median(r[key] for r in rows)
    out["tok_s_passes"] = [r["tok_s"] for r in rows]
    for key, value in rows[0].items():
        if isinstance(value, bool):
            out[key] = all(r[key] for r in rows)
        elif key in ("graph_breaks", "graphs", "cudagraph_skips"):
            out[key] = max(r[key] for r in rows)
    return out


def ratios(rows: list[dict]) -> None:
    """``x_shipped`` on every patched row (time ratios for µs, rate ratios for tokens / s)."""
    base = {(r["op"], r.get("M")): r for r in rows if r.get("variant") == "shipped"}
    for r in rows:
        b = base.get((r["op"], r.get("M")))
        if r.get("variant") != "patched" or b is None:
            continue
        if "us" in r and "us" in b:
            r["x_shipped"] = b["us"] / r["us"]
        if "tok_s" in r and "tok_s" in b:
            r["x_shipped"] = r["tok_s"] / b["tok_s"]


def print_summary(rows: list[dict]) -> None:
    table = [r for r in rows if "kernels" not in r]
    print_table(
        table,
        [
            "op",
            "variant",
            "M",
            "us",
            "tok_s",
            "x_shipped",
            "graph_breaks",
            "graphs",
            "cudagraph_skips",
            "graph_bits_equal",
            "rel_rms_logit_err_median",
            "argmax_agrees_fraction",
            "vs_shipped_equal_fraction",
            "vs_fp32_equal_fraction",
            "error",
        ],
    )
    for r in rows:
        if "kernels" in r:
            print(
                f"\n{r['op']}, {r['variant']}: {r['us_total']:.1f} us of kernels, "
                f"{r['launches']:.0f} launches per call; moefuse's (names *_kernel): "
                f"{r['moefuse_us']:.1f} us, {r['moefuse_launches']:.0f} launches"
            )
            print_table(r["kernels"][:14], ["us", "launches", "kernel"])


def main(args) -> dict:
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    args.backend = "aot_eager" if device.type != "cuda" else "inductor"
    meta = run_metadata()
    meta["command"] = args.command
    meta["method"] = __doc__.split("\n\n", 2)[2].strip()
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    paths = {}

    def save(rows, report):
        meta["patched"] = report
        meta["bars"] = compiled_bars(rows)
        paths["json"], paths["png"] = save_results(
            "hf_moe", rows, meta, args.out, suffix="-compiled"
        )

    args.save = save
    rows = run(args, device)
    print_summary(rows)
    print("\n".join(meta["bars"]))  # the verdicts of the last save: every stage's rows
    print(f"wrote {paths['json']}" + (f" and {paths['png']}" if paths["png"] else ""))
    return {"rows": rows, "json": str(paths["json"]), "bars": meta["bars"]}
