"""Split rows of the gated ops on one GPU (H200): correctness first, then timing.

1. For gated_residual_rmsnorm and gated_residual_next_rmsnorm, H in {2880, 4096, 7168, 8192},
   M in {1, 2, 5, 8, 16}: fresh random inputs, poisoned outputs; split mode (one program per
   (row, slice)) with PDL on / off and as a CUDA-graph replay must equal the normal mode (one
   program per row) BITWISE, and the same rows inside a batch of 300 (normal mode); against the
   FP32 reference within the moefuse.testing tolerances; no split-mode wait may time out.
2. CUDA-graph replay times (inputs rotated over sets larger than L2, PDL on) of split vs normal
   vs torch.compile of the same math at M in {1, 4, 16}, H in {4096, 8192}.

Run: PYTHONPATH=src python3 scripts/check_split_rows.py [--no-timing]
"""

import argparse
import sys

import torch

import moefuse
from moefuse.bench import harness
from moefuse.bench.norm import torch_gated_residual_next_rmsnorm, torch_gated_residual_rmsnorm
from moefuse.norm import gated, tiles
from moefuse.norm import reference as ref
from moefuse.testing import assert_bitwise_equal, assert_close, poison_

DEV = "cuda"
BF = torch.bfloat16
EPS = 1e-6
WIDTHS = (2880, 4096, 7168, 8192)
TOKENS = (1, 2, 5, 8, 16)
BIG = 300  # normal mode (rows x slices > SMs)


def _inputs(m, h, op, variant):
    b, r = torch.randn(m, h, device=DEV).to(BF), torch.randn(m, h, device=DEV)
    a, be = torch.rand(h, device=DEV), torch.rand(h, device=DEV)
    w = torch.randn(h, device=DEV).to(BF)
    if op == "gated":
        return dict(b=b, r=r, w=w if variant else None, a=a, be=be)
    alpha = a if variant else None
    return dict(b=b, r=r, nw=w, a=alpha, scalar=1.0, be=be,
                pw=torch.randn(h, device=DEV).to(BF) if variant else None,
                router=variant)  # fmt: skip


def _outputs(x, op):
    m, h = x["b"].shape
    if op == "gated":
        return [poison_(torch.empty(m, h, device=DEV))]
    outs = [poison_(torch.empty(m, h, device=DEV)),
            poison_(torch.empty(m, h, device=DEV, dtype=BF))]
    if x["router"]:
        outs.append(poison_(torch.empty(m, h, device=DEV)))
    return outs


def _run(x, op, outs, pdl, split):
    if op == "gated":
        gated.launch_gated_residual_rmsnorm(x["b"], x["r"], x["w"], x["a"], x["be"], outs[0], EPS,
                                            1.0, pdl, split=split)  # fmt: skip
    else:
        gated.launch_gated_residual_next_rmsnorm(
            x["b"], x["r"], x["nw"], x["a"], x["scalar"], x["be"], x["pw"], outs[0], outs[1],
            outs[2] if x["router"] else None, EPS, EPS, 0.0, 1.0, pdl, split=split,
        )  # fmt: skip


def _graph(x, op, split):
    outs = _outputs(x, op)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _run(x, op, outs, True, split)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(x, op, outs, True, split)
    for _ in range(4):
        for o in outs:
            poison_(o)
        graph.replay()
    torch.cuda.synchronize()
    return outs


def _check_reference(x, op, outs, what):
    if op == "gated":
        exp = ref.gated_residual_rmsnorm_reference(x["b"], x["r"], x["w"], x["a"], x["be"], EPS,
                                                   1.0)  # fmt: skip
        assert_close(outs[0], exp, "fp32_stream", what)
        return
    alpha = x["a"] if x["a"] is not None else x["scalar"]
    exp_ro, _, _ = ref.gated_residual_next_rmsnorm_reference(
        x["b"], x["r"], x["nw"], alpha, x["be"], EPS, EPS, 0.0, x["pw"], 1.0)
    assert_close(outs[0], exp_ro, "fp32_stream", what + " residual_out")
    own = (outs[0] * ref.inv_rms(outs[0], EPS)) * ref.gain(x["nw"], 0.0)
    assert_close(outs[1], own.to(BF), "rsqrt_half", what + " ffn_input")
    if x["router"]:
        assert_bitwise_equal(outs[2].to(BF), outs[1], what + " ffn = cast(router)")


def check() -> int:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 0
    for op in ("gated", "gated_next"):
        for h in WIDTHS:
            tile = tiles.row_tile(h, tiles.GATED_POLICY)
            for m in TOKENS:
                for variant in (False, True):
                    what = f"{op} H={h} M={m} variant={variant}"
                    assert tile.can_split(h, m, sms), what + ": automatic mode would not split"
                    x = _inputs(m, h, op, variant)
                    normal = _outputs(x, op)
                    _run(x, op, normal, False, False)
                    runs = {}
                    for pdl in (True, False):
                        runs[f"split pdl={pdl}"] = _outputs(x, op)
                        _run(x, op, runs[f"split pdl={pdl}"], pdl, True)
                    runs["normal pdl=True"] = _outputs(x, op)
                    _run(x, op, runs["normal pdl=True"], True, False)
                    runs["auto"] = _outputs(x, op)
                    _run(x, op, runs["auto"], True, None)
                    runs["split graph"] = _graph(x, op, True)
                    # the same rows inside a larger batch (normal mode): batch invariance
                    big = {k: (v.repeat(BIG // m + 1, 1)[:BIG] if isinstance(v, torch.Tensor)
                               and v.dim() == 2 else v) for k, v in x.items()}  # fmt: skip
                    big_outs = _outputs(big, op)
                    _run(big, op, big_outs, True, None)
                    runs["in a batch of 300"] = [o[:m] for o in big_outs]
                    torch.cuda.synchronize()
                    for name, outs in runs.items():
                        for got, exp in zip(outs, normal, strict=True):
                            assert_bitwise_equal(got, exp, f"{what}: {name} vs normal")
                    _check_reference(x, op, runs["split pdl=True"], what)
                    n += 1
            timeouts = moefuse.norm.split_rows_timeouts(DEV)
            assert timeouts == 0, f"{op} H={h}: {timeouts} split-mode waits timed out"
            print(f"ok {op} H={h}: M {TOKENS} split == normal (pdl on/off, graph, auto, "
                  f"batch of {BIG}) bitwise, reference ok", flush=True)
    return n


def _time(fn, sets):
    k = len(sets)
    return harness.graph_time_us(lambda i: fn(sets[i % k]), calls=max(20, k))


def timing() -> None:
    comp_g = harness.compile_baseline(torch_gated_residual_rmsnorm)
    comp_n = harness.compile_baseline(torch_gated_residual_next_rmsnorm)
    for h in (4096, 8192):
        for m in (1, 4, 16):
            for op in ("gated", "gated_next"):
                nbytes = (10 if op == "gated" else 12) * m * h
                a, be = torch.rand(h, device=DEV), torch.rand(h, device=DEV)
                nw = torch.randn(h, device=DEV).to(BF)
                sets = []
                for _ in range(harness.rotation_sets(nbytes + 12 * 4 * h)):
                    x = dict(b=torch.randn(m, h, device=DEV).to(BF),
                             r=torch.randn(m, h, device=DEV), w=None, nw=nw, a=a, scalar=1.0,
                             be=be, pw=None, router=False)  # fmt: skip
                    x["outs"] = _outputs(x, "gated" if op == "gated" else "gated_next")
                    sets.append(x)
                res = {}
                for name, split in (("split", True), ("normal", False)):
                    res[name] = _time(lambda s, sp=split: _run(s, op, s["outs"], True, sp), sets)
                if op == "gated":
                    res["compile"] = _time(lambda s: comp_g(s["b"], s["r"], s["a"], s["be"]), sets)
                else:
                    res["compile"] = _time(
                        lambda s: comp_n(s["b"], s["r"], s["nw"], s["a"], s["be"]), sets)
                print(f"{op:10s} H={h} M={m:2d}: split {res['split']:6.2f} us | normal "
                      f"{res['normal']:6.2f} us | compile {res['compile']:6.2f} us | "
                      f"compile/split {res['compile'] / res['split']:.2f} x | "
                      f"normal/split {res['normal'] / res['split']:.2f} x", flush=True)
    timeouts = moefuse.norm.split_rows_timeouts(DEV)
    assert timeouts == 0, f"{timeouts} split-mode waits timed out while timing"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs; timeouts so far "
          f"{moefuse.norm.split_rows_timeouts(DEV)}", flush=True)
    print(f"{check()} cases bitwise ok", flush=True)
    if not args.no_timing:
        timing()
    return 0


if __name__ == "__main__":
    sys.exit(main())
