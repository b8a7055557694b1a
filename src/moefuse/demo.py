"""``python -m moefuse demo``: one MoE decoder layer's epilogue, every op checked against the
reference on the best device present, printed as one table. Exit status 1 if any check fails.

On a GPU the Triton kernels run at a real model's width (hidden 4096, 128 tokens). Without one,
the reference runs and the same Triton kernels run in Triton's interpreter at a reduced size.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
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
    #: (reference outputs, kernel outputs) -> expected outputs, for outputs whose SPEC meaning
    #: is a function of another output (None: the reference outputs)
    expect: Callable[[tuple, tuple], tuple] | None = None


def _steps(m: int, h: int, dev: str) -> list[Step]:
    import moefuse

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

    steps = [
        Step("rmsnorm", f"{m}x{h}", lambda impl: moefuse.rmsnorm(x, w, impl=impl), "rsqrt_half"),
        Step("gemma_rmsnorm", f"{m}x{h}", lambda impl: moefuse.gemma_rmsnorm(x, w, impl=impl),
             "rsqrt_half"),  # fmt: skip
        Step("fused_add_rmsnorm", f"{m}x{h}", fused_add, ("rsqrt_half", "exact")),
        Step("gated_residual_rmsnorm", f"{m}x{h}",
             lambda impl: moefuse.gated_residual_rmsnorm(branch, stream, w, alpha, beta,
                                                         impl=impl), "fp32_stream"),  # fmt: skip
        Step("gated_residual_next_rmsnorm", f"{m}x{h}",
             lambda impl: moefuse.gated_residual_next_rmsnorm(branch, stream, w, alpha, beta,
                                                              impl=impl),
             ("fp32_stream", "rsqrt_half"), expect=_ffn_of_own_stream(w)),  # fmt: skip
        Step("rmsnorm_sigmoid_gate", f"{m}x{heads}x{d}", sigmoid_gate, "sigmoid_fast"),
    ]
    return steps + _moe_steps(m, h, dev, rnd) + _quant_steps(m, h, dev, x, res, w)


def _ffn_of_own_stream(weight):
    """gated_residual_next_rmsnorm: residual_out against the reference, ffn_input against the
    next norm of the kernel's OWN residual_out (SPEC §1.4). residual_out may differ from the
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
    return [
        Step("moe_finalize (K=8, E=64)", f"{m}x{k}x{h}",
             lambda impl: moefuse.moe_finalize(rows, plan.expanded_idx_to_permuted_idx, weights,
                                               shared_expert_output=shared, impl=impl),
             "exact"),  # fmt: skip
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

    return [
        Step("fused_add_rmsnorm_quant (FP8)", f"{m}x{h}", add_norm_fp8, ("fp8_code", "exact")),
        Step("rmsnorm_fp4_quantize (scales)", f"{m}x{h}", norm_fp4, "exact"),
        Step("fp4_quantize (NVFP4)", f"{m}x{h}",
             lambda impl: moefuse.fp4_quantize(x, gs, recipe="ieee", impl=impl), "exact"),
    ]


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _timed(fn: Callable[[], object], dev: str) -> tuple[object, float]:
    out = fn()  # warm-up (compiles)
    if dev == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            out = fn()
        end.record()
        end.synchronize()
        return out, start.elapsed_time(end) * 100.0  # µs per call
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e6


def run_demo(hidden: int | None = None, tokens: int | None = None) -> int:
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
    rows, failed = [], 0
    for step in _steps(m, h, dev):
        expected = _as_tuple(step.run("reference"))
        got, us = _timed(lambda step=step: step.run("triton"), dev)
        got = _as_tuple(got)
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
        rows.append((step.op, backend, step.shape, f"{err:.3g}", f"{us:.1f}", status))
    header = ("op", "backend", "shape", "max abs err", "µs/call", "check")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print("  ".join(str(v).ljust(wd) for v, wd in zip(r, widths)))
    print(f"\n{len(rows) - failed} passed, {failed} failed (tolerances: "
          f"{', '.join(sorted(TOLERANCES))}; see moefuse.testing)")  # fmt: skip
    return 1 if failed else 0


def print_env() -> None:
    import moefuse
    from moefuse._runtime import interpreter_active, kernel_device_reason

    print("moefuse", moefuse.__version__, "torch", torch.__version__)
    try:
        import triton

        print("triton", triton.__version__)
    except ImportError:
        print("triton not installed")
    print("TRITON_INTERPRET:", interpreter_active())
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            dev = torch.device("cuda", i)
            reason = kernel_device_reason(dev)
            print(f"cuda:{i}", torch.cuda.get_device_name(i), "kernels:", reason or "supported")
    else:
        reason = kernel_device_reason(torch.device("cpu"))
        print("no CUDA device; kernels:", reason or "interpreter")
