"""``python -m moefuse demo``: one MoE decoder layer's epilogue, every op checked against the
reference on the best device present, printed as one table. Exit status 1 if any check fails.

On a GPU the Triton kernels run at a real model's width (hidden 4096, 128 tokens), and the table
gives each kernel's time per call from CUDA-graph replays (the method of ``moefuse bench``, with
the same inputs every call: L2-resident at the default size) next to ``torch.compile`` of the same
math in plain PyTorch, timed the same way (``--no-compile`` skips it: compiling takes longer than
the rest of the demo). Without a GPU, the reference runs and the same Triton kernels run in Triton's
interpreter at a reduced size; no time is printed then (interpreted kernels run on the CPU, one
program after another: their times say nothing about the kernels).
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Step:
    op: str
    shape: str
    run: Callable[[str], object]  # impl -> outputs (tensor or tuple)
    tol: str | tuple[str, ...]
    #: (reference outputs, kernel outputs) -> expected outputs, for outputs whose spec meaning
    #: is a function of another output (None: the reference outputs)
    expect: Callable[[tuple, tuple], tuple] | None = None
    #: GPU timing: the kernel call alone (None: ``run("triton")``; in-place ops give a call on
    #: buffers of their own so the timed call is not a clone + the op) and the same math in
    #: plain PyTorch, which the demo times under torch.compile
    kernel: Callable[[], object] | None = None
    torch_math: Callable[[], object] | None = None


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


def _gpu_times(step: Step, with_compile: bool) -> tuple[float, float | None, str | None]:
    """(kernel µs, torch.compile µs or None, note) per call, each the median of CUDA-graph
    replays of 20 captured calls (moefuse.bench.harness.graph_time_us)."""
    from moefuse.bench import harness

    kernel = step.kernel or (lambda: step.run("triton"))
    us = harness.graph_time_us(lambda i: kernel(), calls=20, replays=10)
    if not with_compile or step.torch_math is None:
        return us, None, None
    try:
        compiled = harness.compile_baseline(step.torch_math)
        return us, harness.graph_time_us(lambda i: compiled(), calls=20, replays=10), None
    except Exception as exc:  # a baseline that does not compile must not fail the demo
        return us, None, f"{step.op}: torch.compile failed ({type(exc).__name__}: {exc})"[:160]


def run_demo(
    hidden: int | None = None, tokens: int | None = None, with_compile: bool = True
) -> int:
    from moefuse.testing import TOLERANCES, assert_close, max_abs_error

    on_gpu = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
    if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
        # the interpreter must be on before triton (and its own @jit library) is first imported,
        # which torch may already have done in this process: run the demo in a fresh one
        cmd = [sys.executable, "-m", "moefuse", "demo"]
        cmd += [f"--hidden={hidden}"] if hidden else []
        cmd += [f"--tokens={tokens}"] if tokens else []
        return subprocess.call(cmd, env={**os.environ, "TRITON_INTERPRET": "1"})
    dev = "cuda" if on_gpu else "cpu"
    if not on_gpu:  # numpy warnings from masked-out lanes in the interpreter are noise here
        warnings.filterwarnings("ignore", category=RuntimeWarning)
    h = hidden or (4096 if on_gpu else 256)
    m = tokens or (128 if on_gpu else 4)
    backend = "triton" if on_gpu else "triton (interpreter)"
    name = torch.cuda.get_device_name() if on_gpu else "CPU"
    print(f"moefuse demo on {name}: hidden {h}, {m} tokens; each op against the reference\n")
    rows, failed, notes = [], 0, []
    for step in _steps(m, h, dev):
        expected = _as_tuple(step.run("reference"))
        got = _as_tuple(step.run("triton"))
        if step.expect is not None:
            expected = step.expect(expected, got)
        tols = step.tol if isinstance(step.tol, tuple) else (step.tol,) * len(got)
        status, err = "ok", 0.0
        for gt, ex, tol in zip(got, expected, tols):
            err = max(err, max_abs_error(gt, ex))
            try:
                assert_close(gt, ex, tol, step.op)
            except AssertionError as exc:
                status = f"FAIL: {str(exc)[:80]}"
        failed += status != "ok"
        us = comp = None
        if on_gpu:  # timed after the check: the in-place kernels' timing buffers are separate
            us, comp, note = _gpu_times(step, with_compile)
            notes += [note] if note else []
        rows.append(
            (
                step.op,
                backend,
                step.shape,
                f"{err:.3g}",
                _us(us),
                _us(comp),
                f"{comp / us:.2f}" if us and comp else "-",
                status,
            )
        )
    header = (
        "op",
        "backend",
        "shape",
        "max abs err",
        "kernel µs",
        "compile µs",
        "x compile",
        "check",
    )
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(v).ljust(wd) for v, wd in zip(r, widths)))
    if on_gpu:
        print(
            "\ntimes: µs per call, median of CUDA-graph replays (20 calls per graph, the same "
            "inputs every call: L2-resident at the default size); compile = torch.compile of "
            "the same math in plain PyTorch, timed the same way"
            + ("" if with_compile else " (skipped: --no-compile)")
        )
    else:
        print(
            "\ntimes: none (the kernels ran in Triton's interpreter on the CPU, where a time "
            "says nothing about the kernel)"
        )
    for note in notes:
        print("note:", note)
    print(
        f"\n{len(rows) - failed} passed, {failed} failed (tolerances: "
        f"{', '.join(sorted(TOLERANCES))}; see moefuse.testing)"
    )
    return 1 if failed else 0


def _us(us: float | None) -> str:
    return "-" if us is None else f"{us:.2f}"
