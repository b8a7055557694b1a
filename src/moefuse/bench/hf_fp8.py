"""transformers' Qwen3-MoE test model quantized to block-scaled FP8, shipped (offline) vs moefuse.

    python -m moefuse.bench.hf_moe --fp8 --out DIR              # eager, one GPU
    python -m moefuse.bench.hf_moe --fp8 --compiled --out DIR   # torch.compile + CUDA graphs
    python -m moefuse.bench.hf_moe --fp8 [--compiled] --smoke --out DIR   # tiny, CPU

The model of the BF16 benchmarks (:func:`moefuse.bench.hf_compiled.qwen3_config`: Qwen3-30B-A3B
block shapes, ``--layers`` layers, random weights, BF16) and its FP8 copy as transformers'
``FineGrainedFP8Config(weight_block_size=(128, 128))`` loads it (:func:`quantize_fp8`: the
modules ``replace_with_fp8_linear`` builds, the weights and scales its ``Fp8Quantize`` writes;
``lm_head`` and the routers stay BF16). Variants: "shipped fp8" (the FP8 model as transformers
runs it: the forward needs kernels from the Hub, so offline the row records the error), "shipped
bf16" (the model before quantization, ``grouped_mm`` experts), "patched bf16" and "patched fp8"
(after ``moefuse.integrations.transformers.patch``).

Eager: the experts module alone (µs per call, host included, interleaved rounds as the BF16
block rows) at ``--tokens`` tokens, and greedy decode tokens / s (``--short`` / ``--long``).
Compiled (stages of :mod:`moefuse.bench.hf_compiled`): the decode step against a static cache
for 1 and ``--batch`` sequences (one CUDA-graph replay; ``graph_bits_equal`` /
``eager_runs_equal``; kernels of one replay of each patched step), prefill at ``--prefill``
tokens (kernels of one replay of each patched model at the largest), ``generate`` with one
reused static cache (``same_tokens_as_first_run``: the greedy tokens of two calls), graph
breaks. Both runs:
``logits``, the mean |logit difference| over the same prompts (eager forward, every position)
of each model to the FP32 copy of the BF16 model, and of each patched model to its own FP32
evaluation: for BF16 the FP32 copy, for FP8 :func:`fp32_reference` (the quantized weights
dequantized exactly, activations quantized per token and 128-channel group by the formula of
the FP8 ops, every product and sum in FP64). Verdicts: :func:`moefuse.bench.hf_bars.fp8_bars`.
"""

from __future__ import annotations

import copy
import time
import types
from functools import partial

import torch

from moefuse.bench.harness import print_table, run_metadata, save_results, sync
from moefuse.bench.hf_bars import fp8_bars

SHIPPED_FP8, SHIPPED, PATCHED, PATCHED_FP8 = (
    "shipped fp8",
    "shipped bf16",
    "patched bf16",
    "patched fp8",
)
#: the patched FP8 model with every moefuse op on its reference (logits rows only)
REFERENCE_OPS = "patched fp8, reference ops"
BLOCK = (128, 128)


# ----------------------------------------------------------------------------- models
def quantize_fp8(
    model, block_size=BLOCK, scale_fmt: str = "float", activation_scheme: str = "dynamic"
):
    """A copy of the BF16 ``model`` as transformers loads it with ``FineGrainedFP8Config``: its
    ``replace_with_fp8_linear`` swaps the modules (``lm_head`` kept, as the quantizer keeps it),
    its ``Fp8Quantize`` writes each weight's E4M3 codes and ``*_scale_inv`` from ``model``'s
    weights (static activation scales, which a checkpoint would hold: 1.0). Raises
    ``ValueError`` for a weight the quantizer leaves unquantized (a dimension that is not a
    multiple of the block)."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize, replace_with_fp8_linear
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    config = FineGrainedFP8Config(
        weight_block_size=tuple(block_size),
        scale_fmt=scale_fmt,
        activation_scheme=activation_scheme,
    )
    quantizer = FineGrainedFP8HfQuantizer(config)
    out = copy.deepcopy(model)
    replace_with_fp8_linear(out, modules_to_not_convert=["lm_head"], quantization_config=config)
    source = dict(model.named_parameters())
    source_device = next(iter(source.values())).device
    convert = Fp8Quantize(quantizer)
    for name, module in out.named_modules():
        params = dict(module.named_parameters(recurse=False))
        if not any(p.is_meta for p in params.values()):
            continue
        new = {}
        for pname, p in params.items():
            key = f"{name}.{pname}"
            if key not in source:
                if pname not in new and "activation_scale" in pname:
                    new[pname] = torch.ones(p.shape, dtype=p.dtype, device=source_device)
                continue
            if p.dtype == torch.float8_e4m3fn:
                written = convert.convert({key: source[key].detach()})
                if written[key].dtype != torch.float8_e4m3fn:
                    raise ValueError(
                        f"quantize_fp8: {key} {tuple(p.shape)} is not a multiple of the "
                        f"{tuple(block_size)} block: transformers leaves it unquantized"
                    )
                new.update({k[len(name) + 1 :]: v for k, v in written.items()})
            else:
                new[pname] = source[key].detach()
        module.load_state_dict(new, strict=True, assign=True)
        for p in module.parameters(recurse=False):
            p.requires_grad_(False)
    out.config.quantization_config = config
    out.hf_quantizer = quantizer
    return out


def _widen(model) -> None:
    """BF16/FP16 parameters and buffers of ``model`` to FP32 in place (FP8 codes and scales
    kept)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is not None and t.dtype in (torch.bfloat16, torch.float16):
                    wide = t.detach().float()
                    table[key] = (
                        torch.nn.Parameter(wide, False) if key in module._parameters else wide
                    )


def _ref_linear(self, x: torch.Tensor) -> torch.Tensor:
    from moefuse.moe.reference_fp8 import dequantize_weight_f64, group_quant_f64

    w64 = dequantize_weight_f64(self.weight, self.weight_scale_inv)
    y = group_quant_f64(x.float().reshape(-1, x.shape[-1])) @ w64.T
    if self.bias is not None:
        y = y + self.bias.double()
    return y.float().view(*x.shape[:-1], -1)


def _ref_experts(self, x: torch.Tensor, top_k_index, top_k_weights) -> torch.Tensor:
    from moefuse.moe.reference_fp8 import dequantize_weight_f64, group_quant_f64

    x = x.float()
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in top_k_index.unique().tolist():
        tok, slot = (top_k_index == e).nonzero(as_tuple=True)
        w = dequantize_weight_f64(self.gate_up_proj[e], self.gate_up_proj_scale_inv[e])
        gate, up = (group_quant_f64(x[tok]) @ w.T).float().chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) * up
        w = dequantize_weight_f64(self.down_proj[e], self.down_proj_scale_inv[e])
        y = group_quant_f64(a) @ w.T
        out.index_add_(0, tok, y * top_k_weights[tok, slot].double()[:, None])
    return out.float()


def fp32_reference(fp8_model):
    """FP32 evaluation of an FP8 model (a copy): every BF16 weight widened to FP32, every FP8
    linear and experts module computing the FP8 ops' formula with the quantized weights
    dequantized exactly and every product and sum in FP64 (activations quantized per token and
    128-channel group, :mod:`moefuse.moe.reference_fp8`), the gate ``silu(g) * u`` in FP32 and
    not rounded to BF16. Slow; for closeness checks."""
    from moefuse.integrations.transformers import unpatch

    ref = copy.deepcopy(fp8_model)
    unpatch(ref)  # transformers' own forwards around the FP8 layers, in FP32
    _widen(ref)
    for module in ref.modules():
        name = type(module).__name__
        if name == "FP8Linear":
            module.forward = types.MethodType(_ref_linear, module)
        elif name == "FP8Experts":
            module.forward = types.MethodType(_ref_experts, module)
    return ref


def offline_error(model, ids) -> str | None:
    """What the forward of ``model`` raises (None if it runs)."""
    try:
        with torch.no_grad():
            model(ids[:, :4])
    except Exception as exc:  # the shipped FP8 model without Hub access: recorded, not raised
        return f"{type(exc).__name__}: {exc}"[:600]
    return None


def _reference_ops_logits(model, ids) -> torch.Tensor:
    """Logits of the patched ``model`` with every moefuse op on its reference (FP64 dots, the
    same BF16 activations as the kernels see); the model is patched as before afterwards."""
    from moefuse.integrations.transformers import patch, unpatch

    unpatch(model)
    patch(model, impl="reference")
    try:
        return model(ids).logits.float()
    finally:
        unpatch(model)
        patch(model)


@torch.no_grad()
def logit_rows(models: dict, fp32_bf16, fp32_fp8, ids) -> list[dict]:
    """Mean |logit difference| (every position of ``ids``, eager forward) of each model to the
    FP32 copy of the BF16 model and of each patched model to its own FP32 evaluation; the
    patched FP8 model also with moefuse's reference ops (:data:`REFERENCE_OPS`: what the BF16
    activations alone cost against the FP32 evaluation, and the kernels' distance to it)."""
    want = fp32_bf16(ids).logits.float()
    want8 = fp32_fp8(ids).logits.float() if fp32_fp8 is not None else None
    rows, got_fp8 = [], None
    if PATCHED_FP8 in models:
        models = {**models, REFERENCE_OPS: models[PATCHED_FP8]}
    for name, model in models.items():
        if name == REFERENCE_OPS:
            got = _reference_ops_logits(model, ids)
        else:
            got = model(ids).logits.float()
        got_fp8 = got if name == PATCHED_FP8 else got_fp8
        row = {"op": "logits", "variant": name, "tokens": ids.numel()}
        row["mean_abs_vs_fp32_bf16"] = float((got - want).abs().mean())
        row["argmax_vs_fp32_bf16"] = float((got.argmax(-1) == want.argmax(-1)).float().mean())
        own = want8 if "fp8" in name else want
        if own is not None and name.startswith("patched"):
            row["mean_abs_vs_own_fp32"] = float((got - own).abs().mean())
            row["own_fp32"] = "fp32 reference of the fp8 model" if "fp8" in name else "fp32 copy"
        if name == REFERENCE_OPS:
            row["mean_abs_vs_patched_fp8"] = float((got - got_fp8).abs().mean())
        rows.append(row)
    if want8 is not None:
        rows.append(
            {
                "op": "logits",
                "variant": "fp32 reference of the fp8 model",
                "tokens": ids.numel(),
                "mean_abs_vs_fp32_bf16": float((want8 - want).abs().mean()),
                "argmax_vs_fp32_bf16": float((want8.argmax(-1) == want.argmax(-1)).float().mean()),
            }
        )
    return rows


def build(args, device):
    """(shipped BF16, patched BF16, FP8 unpatched, prompt ids for the logits) on ``device``."""
    from transformers import Qwen3MoeForCausalLM

    from moefuse.bench.hf_compiled import qwen3_config

    torch.manual_seed(0)
    with torch.device(device):
        shipped = Qwen3MoeForCausalLM(qwen3_config(args, args.layers))
    shipped = shipped.to(torch.bfloat16).eval()
    fp8 = quantize_fp8(shipped)
    patched = copy.deepcopy(shipped)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, args.vocab, (args.logit_prompts, args.logit_tokens), generator=g)
    return shipped, patched, fp8, ids.to(device)


def _meta(args) -> dict:
    meta = run_metadata()
    meta["command"] = args.command
    meta["method"] = __doc__.split("\n\n", 2)[2].strip()
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    return meta


# ----------------------------------------------------------------------------- eager
@torch.inference_mode()
def run_eager(args, device) -> list[dict]:
    from moefuse.bench.harness import interleaved_us, spin
    from moefuse.integrations.transformers import patch

    shipped, patched, fp8, ids = build(args, device)
    rows = [{"op": "forward", "variant": SHIPPED_FP8, "error": offline_error(fp8, ids)}]
    reports = {PATCHED: patch(patched), PATCHED_FP8: patch(fp8)}
    experts = {
        SHIPPED: shipped.model.layers[0].mlp.experts,
        PATCHED: patched.model.layers[0].mlp.experts,
        PATCHED_FP8: fp8.model.layers[0].mlp.experts,
    }
    gate = shipped.model.layers[0].mlp.gate
    for t in args.tokens:
        x = torch.randn(t, args.hidden, device=device, dtype=torch.bfloat16)
        _, w, idx = gate(x)
        fns = {name: partial(m, x, idx, w) for name, m in experts.items()}
        spin(fns[PATCHED_FP8], device, args.warmup_s)
        timed = interleaved_us(fns, device, args.calls, args.repeats)
        for name in fns:
            row = {"op": "experts", "variant": name, "M": t, **timed[name]}
            rows.append(row)
        for name in (PATCHED, PATCHED_FP8):
            r = next(r for r in rows if r["variant"] == name and r.get("M") == t)
            r["x_shipped"] = timed[SHIPPED]["us"] / r["us"]
            r["x_patched_bf16"] = timed[PATCHED]["us"] / r["us"]
    rows += _eager_decode(args, device, {SHIPPED: shipped, PATCHED: patched, PATCHED_FP8: fp8})
    rows += logit_rows(
        {SHIPPED: shipped, PATCHED: patched, PATCHED_FP8: fp8},
        copy.deepcopy(shipped).float(),
        fp32_reference(fp8),
        ids,
    )
    rows[0]["patched"] = reports
    return rows


def _eager_decode(args, device, models: dict) -> list[dict]:
    """Greedy decode tokens / s: ``(long - short) / (t(long) - t(short))``, medians of rounds."""
    prompt = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(device)

    def gen(model, n):
        return model.generate(
            prompt,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )

    rows = []
    for name, model in models.items():
        gen(model, args.short)
        times = {}
        for n in (args.short, args.long):
            samples = []
            for _ in range(args.decode_repeats):
                sync(device)
                t0 = time.perf_counter()
                tokens = gen(model, n)
                sync(device)
                samples.append(time.perf_counter() - t0)
            times[n] = sorted(samples)[len(samples) // 2]
        rate = (args.long - args.short) / (times[args.long] - times[args.short])
        rows.append({"op": "eager decode", "variant": name, "tok_s": rate, "tokens": tokens})
    base = rows[0]["tok_s"]
    for r in rows:
        r["x_shipped"] = r["tok_s"] / base
        r["tokens"] = r["tokens"][0, prompt.shape[1] :].tolist()
    return rows


# ----------------------------------------------------------------------------- compiled
def fp8_ratios(rows: list[dict]) -> None:
    """``x_shipped`` (vs shipped BF16) on the patched rows and ``x_patched_bf16`` on the patched
    FP8 rows, per (op, M): time ratios for µs, rate ratios for tokens / s."""
    by = {(r["op"], r.get("M"), r["variant"]): r for r in rows if "variant" in r}
    for r in rows:
        if r.get("variant") not in (PATCHED, PATCHED_FP8):
            continue
        for base, key in ((SHIPPED, "x_shipped"), (PATCHED, "x_patched_bf16")):
            b = by.get((r["op"], r.get("M"), base))
            if b is None or b is r:
                continue
            if "us" in r and "us" in b:
                r[key] = b["us"] / r["us"]
            elif "tok_s" in r and "tok_s" in b:
                r[key] = r["tok_s"] / b["tok_s"]


@torch.no_grad()  # as generate: with autograd on, the patched modules run their original forwards
def run_compiled(args, device) -> list[dict]:
    import torch._dynamo
    from transformers import CompileConfig

    from moefuse.bench.hf_compiled import Variant, profile_row, profile_step, time_variants
    from moefuse.integrations.transformers import patch

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
    shipped, patched, fp8, ids = build(args, device)
    rows: list[dict] = [{"op": "forward", "variant": SHIPPED_FP8, "error": offline_error(fp8, ids)}]
    report = {PATCHED: patch(patched), PATCHED_FP8: patch(fp8)}
    models = {SHIPPED: shipped, PATCHED: patched, PATCHED_FP8: fp8}
    g = torch.Generator().manual_seed(1)
    # generate last: it resets dynamo (each variant as a fresh process would compile it)
    stages = [s for s in ("step", "logits", "prefill", "generate") if s not in args.skip]
    for stage in stages:
        t0 = time.perf_counter()
        try:
            if stage == "step":
                for batch in (1, args.batch):
                    prompt = torch.randint(0, args.vocab, (batch, args.prompt), generator=g)
                    variants = [Variant(n, m, args, device) for n, m in models.items()]
                    step_rows = [v.step(prompt.to(device)) for v in variants]
                    for r in step_rows:
                        r["M"] = batch
                    items = {v.name: (v.graph, v.run_step) for v in variants}
                    time_variants(step_rows, items, device, args.replays, args.samples)
                    rows += step_rows
                    if device.type == "cuda" and "profile" not in args.skip:
                        for v in variants[1:]:
                            kernels = profile_step(v.graph)
                            rows.append(profile_row(f"step {batch} profile", v.name, kernels))
                    del variants, items
            elif stage == "prefill":
                for t in args.prefill:
                    variants = [Variant(n, m, args, device) for n, m in models.items()]
                    captured = {v.name: v.prefill(t) for v in variants}
                    items = {name: (graph, fn) for name, (_, graph, fn) in captured.items()}
                    prefill_rows = [row for row, _, _ in captured.values()]
                    time_variants(
                        prefill_rows, items, device, max(1, args.replays // 4), args.samples
                    )
                    rows += prefill_rows
                    profiled = device.type == "cuda" and "profile" not in args.skip
                    for v in variants[1:] if profiled and t == max(args.prefill) else ():
                        kernels = profile_step(captured[v.name][1], replays=1)
                        rows.append(profile_row(f"prefill {t} profile", v.name, kernels))
                    del variants, captured, items
            elif stage == "generate":
                config = CompileConfig(backend=args.backend)
                if device.type != "cuda":
                    config.mode, config._compile_all_devices = None, True
                prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=g).to(device)
                for name, model in models.items():
                    torch._dynamo.reset()  # a fresh process's compile state, as hf_compiled
                    row, seq = Variant(name, model, args, device).generate_rate(
                        prompt, config, reuse_cache=True
                    )
                    row["tokens"] = seq[0, prompt.shape[1] :].tolist()
                    rows.append(row)
            elif stage == "logits":
                rows += logit_rows(models, copy.deepcopy(shipped).float(), fp32_reference(fp8), ids)
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
        fp8_ratios(rows)
        args.save(rows, report)
    return rows


def print_summary(rows: list[dict]) -> None:
    table = [r for r in rows if "kernels" not in r]
    cols = [
        "op",
        "variant",
        "M",
        "us",
        "tok_s",
        "x_shipped",
        "x_patched_bf16",
        "graph_breaks",
        "graph_bits_equal",
        "eager_runs_equal",
        "same_tokens_as_first_run",
        "mean_abs_vs_fp32_bf16",
        "mean_abs_vs_own_fp32",
        "argmax_vs_fp32_bf16",
    ]
    print_table(table, cols)
    for r in rows:
        if r.get("error"):
            print(f"{r['variant']} {r['op']}: {r['error']}")
        if "kernels" in r:
            print(
                f"\n{r['op']}, {r['variant']}: {r['us_total']:.1f} us of kernels, "
                f"{r['launches']:.0f} launches per call"
            )
            print_table(r["kernels"][:10], ["us", "launches", "kernel"])


def main(args) -> dict:
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    args.backend = "aot_eager" if device.type != "cuda" else "inductor"
    meta = _meta(args)
    paths = {}
    suffix = "-fp8-compiled" if args.compiled else "-fp8"

    def save(rows, report):
        meta["patched"] = report
        meta["bars"] = fp8_bars(rows)
        paths["json"], paths["png"] = save_results("hf_moe", rows, meta, args.out, suffix=suffix)

    args.save = save
    if args.compiled:
        args.repeats = min(args.repeats, 3)
        rows = run_compiled(args, device)
    else:
        rows = run_eager(args, device)
        save(rows, rows[0].pop("patched"))
    print_summary(rows)
    print("\n".join(meta["bars"]))
    print(f"wrote {paths['json']}" + (f" and {paths['png']}" if paths["png"] else ""))
    return {"rows": rows, "json": str(paths["json"]), "bars": meta["bars"]}
