"""``python -m moefuse demo``: what moefuse does, in one screen. Every op is checked against its
reference on the best device present; exit status 1 if any check fails.

1. The ops of one MoE decoder layer, as one table: the epilogue (norms, fused residual adds,
   the deterministic MoE finalize, FP8 / NVFP4 quantization fused into the norms), the routed
   experts (``moe_experts``) and the router (``router_topk``).
2. A communication fusion: ``allreduce_residual_rmsnorm`` on two ranks that are threads of this
   process sharing one device (loopback ranks), each rank's outputs against the reference of
   both ranks' inputs.
3. A transformers Qwen3-MoE model as shipped and after ``patch(model)``: what the patch replaced,
   and the greedy tokens of both.

On a GPU (SM90+) the Triton kernels run at a real model's sizes and the table gives each
kernel's time per call from CUDA-graph replays (the method of ``moefuse bench``, the same inputs
every call) next to a baseline timed the same way: ``torch.compile`` of the same math in plain
PyTorch for the epilogue ops (``--no-compile`` skips it: compiling takes longer than the rest of
the demo), transformers' ``grouped_mm`` experts function, and the router tail transformers runs;
the model section gives the µs per greedy decode step of both models (eager, batch 1). The
communication fusion is checked, not timed (two ranks sharing one GPU's SMs say nothing about
two GPUs: ``moefuse bench all-reduce`` times it). Without a GPU, the references run and the same
Triton kernels run in Triton's interpreter at reduced sizes; no time is printed then
(interpreted kernels run on the CPU, one program after another). ``--save DIR`` also writes the
printed text, a JSON of the figures and a PNG (``demo-<gpu>.*``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from moefuse.demo_system import Step


def _steps(m: int, h: int, dev: str) -> list[Step]:
    import moefuse
    from moefuse.bench import norm as bn  # the benchmark's plain-PyTorch math (baselines)

    bf = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

    x, res, w = rnd(m, h), rnd(m, h), rnd(h)
    stream, branch = rnd(m, h, dtype=torch.float32), rnd(m, h)
    alpha, beta = torch.rand(h, generator=g).to(dev), torch.rand(h, generator=g).to(dev)
    heads, d = max(1, h // 128), 128 if h >= 128 else h
    attn, gate = rnd(m, heads, d), rnd(m, heads, d, scale=2.0)

    def fused_add(impl):
        a, b = x.clone(), res.clone()
        moefuse.fused_add_rmsnorm(a, b, w, impl=impl)
        return a, b

    def sigmoid_gate(impl):
        a = attn.clone()
        return moefuse.rmsnorm_sigmoid_gate(a, gate, impl=impl)

    # in-place ops are timed on buffers of their own (repeated calls keep them finite)
    xa, rb, attn_t = x.clone(), res.clone(), attn.clone()

    steps = [
        Step(
            "rmsnorm",
            f"{m}x{h}",
            lambda impl: moefuse.rmsnorm(x, w, impl=impl),
            "rsqrt_half",
            torch_math=lambda: bn.torch_rmsnorm(x, w),
        ),
        Step(
            "gemma_rmsnorm",
            f"{m}x{h}",
            lambda impl: moefuse.gemma_rmsnorm(x, w, impl=impl),
            "rsqrt_half",
            torch_math=lambda: bn.torch_rmsnorm(x, w.float() + 1.0),
        ),
        Step(
            "fused_add_rmsnorm",
            f"{m}x{h}",
            fused_add,
            ("rsqrt_half", "exact"),
            kernel=lambda: moefuse.fused_add_rmsnorm(xa, rb, w, impl="triton"),
            torch_math=lambda: bn.torch_fused_add_rmsnorm(x, res, w),
        ),
        Step(
            "gated_residual_rmsnorm",
            f"{m}x{h}",
            lambda impl: moefuse.gated_residual_rmsnorm(branch, stream, w, alpha, beta, impl=impl),
            "fp32_stream",
            torch_math=lambda: bn.torch_gated_residual_rmsnorm(
                branch.float() * w.float(), stream, alpha, beta
            ),
        ),
        Step(
            "gated_residual_next_rmsnorm",
            f"{m}x{h}",
            lambda impl: moefuse.gated_residual_next_rmsnorm(
                branch, stream, w, alpha, beta, impl=impl
            ),
            ("fp32_stream", "rsqrt_half"),
            expect=_ffn_of_own_stream(w),
            torch_math=lambda: bn.torch_gated_residual_next_rmsnorm(branch, stream, w, alpha, beta),
        ),
        Step(
            "rmsnorm_sigmoid_gate",
            f"{m}x{heads}x{d}",
            sigmoid_gate,
            "sigmoid_fast",
            kernel=lambda: moefuse.rmsnorm_sigmoid_gate(attn_t, gate, impl="triton"),
            torch_math=lambda: bn.torch_rmsnorm_sigmoid_gate(attn, gate),
        ),
    ]
    return steps + _moe_steps(m, h, dev, rnd) + _quant_steps(m, h, dev, x, res, w)


def _all_steps(m: int, h: int, dev: str, on_gpu: bool) -> list[Step]:
    from moefuse.demo_system import system_steps

    return _steps(m, h, dev) + system_steps(m, dev, on_gpu)


def _ffn_of_own_stream(weight):
    """gated_residual_next_rmsnorm: residual_out against the reference, ffn_input against the
    next norm of the kernel's OWN residual_out (spec). residual_out may differ from the
    reference by a few FP32 ulp (fp32_stream); where the stream nearly cancels, that is a large
    relative change of a tiny element, which the next norm carries into ffn_input unchanged, so
    comparing ffn_input with the reference's would measure the stream twice."""
    from moefuse.norm import reference as ref

    def expect(expected, got):
        return expected[0], ref.rmsnorm_reference(got[0], weight).to(got[1].dtype)

    return expect


def _moe_steps(m, h, dev, rnd) -> list[Step]:
    """Route -> expert-sorted rows -> deterministic finalize (top-8 of 64 experts)."""
    import moefuse

    k, experts = 8, 64
    logits = rnd(m, experts, dtype=torch.float32)
    weights, ids = moefuse.route_topk(logits, k)
    plan = moefuse.sort_by_expert(ids, experts)
    rows = rnd(plan.num_rows, h)
    shared = rnd(m, h)

    from moefuse.bench.moe import torch_finalize  # imported here, not inside the traced math

    def torch_math():  # the benchmark's gather-sum in FP32, plus the shared expert
        idx = plan.expanded_idx_to_permuted_idx
        return (torch_finalize(rows, idx, weights).float() + shared.float()).to(rows.dtype)

    return [
        Step(
            "moe_finalize (K=8, E=64)",
            f"{m}x{k}x{h}",
            lambda impl: moefuse.moe_finalize(
                rows,
                plan.expanded_idx_to_permuted_idx,
                weights,
                shared_expert_output=shared,
                impl=impl,
            ),
            "exact",
            torch_math=torch_math,
        ),
    ]


def _quant_steps(m, h, dev, x, res, w) -> list[Step]:
    """The next GEMM's activations: FP8 after the residual norm, NVFP4 of the normed rows."""
    import moefuse

    scale = torch.tensor([0.02], device=dev)
    gs = torch.tensor([448.0 * 6 / 8.0], device=dev)

    def add_norm_fp8(impl):
        r = res.clone()
        out = moefuse.fused_add_rmsnorm_quant(x, r, w, scale, impl=impl)
        return out, r

    def norm_fp4(impl):
        packed, sf = moefuse.rmsnorm_fp4_quantize(x, w, gs, recipe="ieee", impl=impl)
        return sf

    from moefuse.bench import quant as bq  # the benchmark's plain-PyTorch FP8 / NVFP4 math

    r_t, inv = res.clone(), 1.0 / scale
    return [
        Step(
            "fused_add_rmsnorm_quant (FP8)",
            f"{m}x{h}",
            add_norm_fp8,
            ("fp8_code", "exact"),
            kernel=lambda: moefuse.fused_add_rmsnorm_quant(x, r_t, w, scale, impl="triton"),
            torch_math=lambda: bq.torch_fused_add_rmsnorm_quant(x, res, w, inv),
        ),
        Step(
            "rmsnorm_fp4_quantize (scales)",
            f"{m}x{h}",
            norm_fp4,
            "exact",
            kernel=lambda: moefuse.rmsnorm_fp4_quantize(x, w, gs, recipe="ieee", impl="triton"),
            torch_math=lambda: bq.torch_rmsnorm_fp4(x, w, gs),
        ),
        Step(
            "fp4_quantize (NVFP4)",
            f"{m}x{h}",
            lambda impl: moefuse.fp4_quantize(x, gs, recipe="ieee", impl=impl),
            "exact",
            torch_math=lambda: bq.torch_fp4_quantize(x, gs),
        ),
    ]


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _gpu_times(step: Step, with_compile: bool) -> tuple[float, float | None, str, str | None]:
    """(kernel µs, baseline µs or None, baseline name, note) per call, each the median of
    CUDA-graph replays of 20 captured calls (moefuse.bench.harness.graph_time_us)."""
    from moefuse.bench import harness

    kernel = step.kernel or (lambda: step.run("triton"))
    us = harness.graph_time_us(lambda i: kernel(), calls=20, replays=10)
    if step.baseline is not None:
        base, name = step.baseline, step.baseline_name
    elif with_compile and step.torch_math is not None:
        base, name = None, "torch.compile"
    else:
        return us, None, "-", None
    try:
        if base is None:
            base = harness.compile_baseline(step.torch_math)
        return us, harness.graph_time_us(lambda i: base(), calls=20, replays=10), name, None
    except Exception as exc:  # a baseline that fails must not fail the demo
        return us, None, "-", f"{step.op}: {name} failed ({type(exc).__name__}: {exc})"[:160]


def _check(step: Step, expected: tuple, got: tuple) -> tuple[str, float]:
    """("ok" or "FAIL: ...", max abs error over the outputs)."""
    from moefuse.testing import assert_close, max_abs_error

    err = max(max_abs_error(gt, ex) for gt, ex in zip(got, expected))
    if step.check is not None:
        why = step.check(expected, got)
        return ("ok" if why is None else f"FAIL: {why}"[:90]), err
    tols = step.tol if isinstance(step.tol, tuple) else (step.tol,) * len(got)
    for gt, ex, tol in zip(got, expected, tols):
        try:
            assert_close(gt, ex, tol, step.op)
        except AssertionError as exc:
            return f"FAIL: {str(exc)[:80]}", err
    return "ok", err


def run_demo(
    hidden: int | None = None,
    tokens: int | None = None,
    with_compile: bool = True,
    save: str | None = None,
) -> int:
    from moefuse.testing import TOLERANCES

    if not torch.cuda.is_initialized():  # the loopback ranks of section 2 share one context:
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")  # every module loaded at start-up
    on_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter must be on before triton (and its own @jit library) is first imported,
        # which torch may already have done in this process: run the demo in a fresh one
        cmd = [sys.executable, "-m", "moefuse", "demo"]
        cmd += [f"--hidden={hidden}"] if hidden else []
        cmd += [f"--tokens={tokens}"] if tokens else []
        cmd += [f"--save={save}"] if save else []
        return subprocess.call(cmd, env={**os.environ, "TRITON_INTERPRET": "1"})
    dev = "cuda" if on_gpu else "cpu"
    if not on_gpu:  # numpy warnings from masked-out lanes in the interpreter are noise here
        warnings.filterwarnings("ignore", category=RuntimeWarning)
    h = hidden or (4096 if on_gpu else 256)
    m = tokens or (128 if on_gpu else 4)
    backend = "Triton" if on_gpu else "Triton's interpreter (CPU)"
    name = torch.cuda.get_device_name() if on_gpu else "CPU"
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    say(f"moefuse demo on {name}: kernels run in {backend}; every op against its reference")
    say(f"\n1. The ops of an MoE decoder layer ({m} tokens, hidden {h} for the epilogue ops)")
    rows, failed, notes = [], 0, []
    for step in _all_steps(m, h, dev, on_gpu):
        expected = _as_tuple(step.run("reference"))
        got = _as_tuple(step.run("triton"))
        if step.expect is not None:
            expected = step.expect(expected, got)
        status, err = _check(step, expected, got)
        failed += status != "ok"
        tols = step.tol if isinstance(step.tol, tuple) else (step.tol,)
        row = dict(op=step.op, shape=step.shape, max_abs_err=err, check=status)
        row["checked"] = step.check_text or " / ".join(dict.fromkeys(tols))
        if on_gpu:  # timed after the check: the in-place kernels' timing buffers are separate
            us, base, base_name, note = _gpu_times(step, with_compile)
            notes += [note] if note else []
            row.update(kernel_us=us, baseline_us=base, baseline=base_name)
            row["x_baseline"] = base / us if base and us else None
        rows.append(row)
    _table(say, rows, on_gpu)
    if on_gpu:
        say(
            "times: µs per call, median of CUDA-graph replays (20 calls per graph, the same "
            "inputs every call); x = baseline µs / kernel µs"
            + ("" if with_compile else "; torch.compile baselines skipped (--no-compile)")
        )
    else:
        say(
            "times: none (the kernels ran in Triton's interpreter on the CPU, where a time says "
            "nothing about the kernel)"
        )
    for note in notes:
        say(f"note: {note}")
    comm, model = _system_sections(say, on_gpu)
    failed += bool(comm["fails"]) + bool(model.get("fails"))
    checks = len(rows) + 2
    say(
        f"\n{checks - failed} of {checks} checks passed (tolerances: "
        f"{', '.join(sorted(TOLERANCES))}; see moefuse.testing)"
    )
    if save:
        _save(Path(save), name, lines, rows, comm, model)
    return 1 if failed else 0


def _table(say, rows: list[dict], timed: bool) -> None:
    """One line per op; the time columns only where the kernels were timed (GPU)."""
    header = ("op", "shape", "max abs err", "checked against the reference", "check")
    times = ("kernel µs", "baseline µs", "x", "baseline")
    header = header[:3] + times + header[4:] if timed else header
    cells = []
    for r in rows:
        cell = (r["op"], r["shape"], f"{r['max_abs_err']:.3g}", r["checked"], r["check"])
        if timed:
            x = f"{r['x_baseline']:.2f}" if r.get("x_baseline") else "-"
            t = (_us(r.get("kernel_us")), _us(r.get("baseline_us")), x, r.get("baseline", "-"))
            cell = cell[:3] + t + cell[4:]
        cells.append(cell)
    widths = [max(len(str(c[i])) for c in [header, *cells]) for i in range(len(header))]
    for c in [header, *cells]:
        say("  ".join(str(v).ljust(wd) for v, wd in zip(c, widths)).rstrip())


def _system_sections(say, on_gpu: bool) -> tuple[dict, dict]:
    from moefuse.demo_system import comm_section, model_section

    comm = comm_section(on_gpu)
    where = "threads sharing one GPU" if on_gpu else "threads, kernels in the interpreter"
    say(f"\n2. A communication fusion on two loopback ranks ({where})")
    say(
        f"{comm['op']} {comm['shape']} per rank: residual_out bitwise "
        f"{'equal' if comm['residual_bitwise'] else 'NOT equal'} to the reference of both "
        f"ranks' inputs, norm_out within {comm['norm_max_ulp']} ulp, the two ranks "
        f"{'bitwise equal' if comm['ranks_bitwise'] else 'DIFFERENT'}: "
        + ("ok" if not comm["fails"] else "FAIL: " + "; ".join(comm["fails"]))
    )
    say(
        "(not timed: two ranks on one GPU share its SMs; `moefuse bench all-reduce` times it)"
        if on_gpu
        else "(not timed: interpreter)"
    )
    model = model_section(on_gpu)
    say("\n3. transformers: patch(model)")
    if "skipped" in model:
        say(f"skipped: {model['skipped']}")
        return comm, model
    rep = model["report"]
    say(f"{model['model']}")
    say(
        f"patch(model): experts now {rep['experts_running']!r} (replaced "
        f"{rep['experts_replaced']!r}), {rep['routers']} routers on router_topk, "
        f"{rep['norms']} RMSNorms, {rep['fused_layers']} residual adds fused into the next norm"
    )
    lead, new = model["tokens_equal_leading"], model["new_tokens"]
    tokens = f"greedy tokens, patched vs shipped: the first {lead} of {new} equal"
    if lead < new:
        tokens += (
            f" (at token {lead + 1} the shipped model's logits of the two choices are "
            f"{model['first_difference_gap']:.3g} apart: a near-tie, decided by BF16 rounding)"
        )
    say(tokens)
    say(
        f"logits of both models on the shipped continuation: within "
        f"{model['logits_max_diff']:.3g} of each other (bf16_model_logits: "
        f"<= {model['logits_atol']}), the same next token at {model['teacher_forced_agree']} of "
        f"{new} positions: " + ("ok" if not model["fails"] else "FAIL: " + model["fails"][0])
    )
    if "shipped_step_us" in model:
        s, p = model["shipped_step_us"], model["patched_step_us"]
        say(f"decode step (eager, batch 1): shipped {s:.0f} µs, patched {p:.0f} µs, {s / p:.2f} x")
    else:
        say("decode step: not timed (interpreter)")
    return comm, model


def _save(out: Path, name: str, lines, rows, comm, model) -> None:
    """``demo-<gpu>.txt`` (what was printed), ``.json`` (the figures and the run's meta) and
    ``.png`` (moefuse.demo_system.plot) under ``out``."""
    from moefuse.bench.harness import gpu_slug, run_metadata
    from moefuse.demo_system import plot

    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"demo-{gpu_slug()}"
    meta = run_metadata()
    head = f"{meta['gpu']}, {meta['date'][:10]}, commit {meta['commit']}: {meta['command']}"
    stem.with_suffix(".txt").write_text(head + "\n\n" + "\n".join(lines) + "\n")
    model = {k: v for k, v in model.items() if k != "report"} | {"report": model.get("report")}
    data = {"meta": meta, "ops": rows, "communication": comm, "model": model}
    stem.with_suffix(".json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    try:
        plot(stem.with_suffix(".png"), f"moefuse demo on {name} ({head})", rows, model)
    except ImportError:
        pass
    print(f"wrote {stem}.txt / .json / .png")


def _us(us: float | None) -> str:
    return "-" if us is None else f"{us:.2f}"
