"""Is writing in place what costs the in-place norms their last few % against torch.compile?
(2026-11-30)

The in-place ops (fused_add_rmsnorm, rmsnorm_sigmoid_gate) write into their rotating inputs, as
their API says; the benchmark's torch.compile baseline returns fresh outputs from the CUDA graph's
pool instead. This probe times, per (op, shape, M), CUDA-graph replays rotating the inputs over
sets larger than L2:
  mf       moefuse as the API runs it (in place for the in-place ops, fixed output for rmsnorm)
  mf_inpl  moefuse rmsnorm written over its own input (out=input)
  cmp      torch.compile of the math, outputs from the graph pool (the benchmark's baseline)
  cmp_inpl torch.compile of the same math written back into the inputs (``x.copy_(...)``), i.e.
           the in-place semantics of the moefuse / FlashInfer call
  copy     best SM copy of the same bytes (rotating destination)
and writes inductor's generated code for the compiled functions to $OUT/inductor_code.log.
GPU: TORCH_LOGS=output_code PYTHONPATH=src python scripts/probe_inplace.py 2> $OUT/inductor_code.log
"""

import torch

import moefuse
from moefuse.bench import harness
from moefuse.bench.norm import (
    INPLACE_MATH,
    torch_fused_add_rmsnorm,
    torch_rmsnorm,
    torch_rmsnorm_sigmoid_gate,
)


def time_sets(fn, sets):
    n = len(sets)
    return harness.graph_time_us(lambda i: fn(sets[i % n]), calls=max(20, n), replays=25)


def rms_inplace(x, w):
    x.copy_(torch_rmsnorm(x, w))


fused_add_inplace = INPLACE_MATH["fused_add_rmsnorm"]
sigmoid_inplace = INPLACE_MATH["rmsnorm_sigmoid_gate"]


def main():
    bf, dev = torch.bfloat16, "cuda"
    comp = {name: harness.compile_baseline(f) for name, f in (
        ("torch_rmsnorm", torch_rmsnorm), ("torch_fused_add_rmsnorm", torch_fused_add_rmsnorm),
        ("torch_rmsnorm_sigmoid_gate", torch_rmsnorm_sigmoid_gate), ("rms_inplace", rms_inplace),
        ("fused_add_inplace", fused_add_inplace), ("sigmoid_inplace", sigmoid_inplace),
    )}  # fmt: skip
    print(torch.cuda.get_device_name(0), flush=True)
    cols = ("mf", "mf_inpl", "cmp", "cmp_inpl", "copy")
    print(f"{'case':34s} " + " ".join(f"{c:>9s}" for c in cols), flush=True)
    for op, shapes, per in (("rmsnorm", ((4096,), (8192,)), 4),
                            ("fused_add", ((4096,), (8192,)), 8),
                            ("sigmoid", ((32, 64), (32, 128)), 6)):  # fmt: skip
        for shape in shapes:
            width = shape[0] * (shape[1] if len(shape) > 1 else 1)
            w = torch.randn(width, device=dev).to(bf)
            for m in (1024, 2048, 16384):
                nbytes = per * m * width
                k = harness.rotation_sets(nbytes)
                t = {}
                if op == "rmsnorm":
                    sets = [(torch.randn(m, width, device=dev).to(bf),) for _ in range(k)]
                    out = torch.empty(m, width, device=dev, dtype=bf)
                    t["mf"] = time_sets(lambda s: moefuse.rmsnorm(s[0], w, out=out), sets)
                    t["mf_inpl"] = time_sets(lambda s: moefuse.rmsnorm(s[0], w, out=s[0]), sets)
                    t["cmp"] = time_sets(lambda s: comp["torch_rmsnorm"](s[0], w), sets)
                    t["cmp_inpl"] = time_sets(lambda s: comp["rms_inplace"](s[0], w), sets)
                elif op == "fused_add":
                    sets = [(torch.randn(m, width, device=dev).to(bf),
                             torch.randn(m, width, device=dev).to(bf)) for _ in range(k)]
                    t["mf"] = time_sets(lambda s: moefuse.fused_add_rmsnorm(s[0], s[1], w), sets)
                    t["cmp"] = time_sets(
                        lambda s: comp["torch_fused_add_rmsnorm"](s[0], s[1], w), sets)
                    t["cmp_inpl"] = time_sets(
                        lambda s: comp["fused_add_inplace"](s[0], s[1], w), sets)
                else:
                    sets = [(torch.randn(m, *shape, device=dev).to(bf),
                             torch.randn(m, *shape, device=dev).to(bf)) for _ in range(k)]
                    t["mf"] = time_sets(lambda s: moefuse.rmsnorm_sigmoid_gate(s[0], s[1]), sets)
                    t["cmp"] = time_sets(
                        lambda s: comp["torch_rmsnorm_sigmoid_gate"](s[0], s[1]), sets)
                    t["cmp_inpl"] = time_sets(lambda s: comp["sigmoid_inplace"](s[0], s[1]), sets)
                t["copy"] = harness.copy_time_us(nbytes)
                name = f"{op} {'x'.join(map(str, shape))} M={m}"
                print(f"{name:34s} " + " ".join(
                    f"{t[c]:9.2f}" if c in t else f"{'-':>9s}" for c in cols), flush=True)


if __name__ == "__main__":
    main()
