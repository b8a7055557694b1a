"""H200 sweep: the gated ops with their parameter vectors loaded before gdc_wait (today) or after
the row reduction (``moefuse.norm.gated.LATE_PARAMS_MIN_BLOCK``; sm_90a registers at H = 8192,
4 warps: gated_residual 255 + 48 B spills -> 178, gated_residual_next 255 -> 168).

For both ops (benchmark configuration: tensor alpha, no weight / post weight, no router output),
H in {4096, 8192}, M in {1, 16, 128, 1024, 2048, 16384}: late vs early bitwise on fresh inputs,
then CUDA-graph replay times (inputs rotated over sets larger than L2, PDL on) of early / late /
late with a 168-register cap (3 CTAs per SM at 4 warps) / torch.compile.

Run: PYTHONPATH=src python3 scripts/sweep_late_params.py
"""

import torch

from moefuse.bench import harness
from moefuse.bench import norm as bn
from moefuse.norm import gated

OPS = ("gated_residual_rmsnorm", "gated_residual_next_rmsnorm")
TOKENS = (1, 16, 128, 1024, 2048, 16384)
WIDTHS = (4096, 8192)
_KWARGS = gated._kwargs


def _set(late: bool, cap: int | None = None) -> None:
    gated.LATE_PARAMS_MIN_BLOCK = 4096 if late else None

    def kwargs(tile, scratch, use_pdl):
        out = _KWARGS(tile, scratch, use_pdl)
        if cap:
            out["maxnreg"] = cap
        return out

    gated._kwargs = kwargs


def main() -> None:
    print(f"{torch.cuda.get_device_name(0)}; us per call (PDL on), ratio early/late", flush=True)
    compiled = {}
    for op in OPS:
        for h in WIDTHS:
            for m in TOKENS:
                case, _ = bn._make_case(op, m, h, None)
                fns = bn._variants(op, compiled)
                fused, comp = fns["moefuse"], fns["compile"]
                s0 = case.sets[0]
                outs = []
                out_tensors = s0[5:7] if "next" in op else s0[4:5]
                for late in (False, True):
                    _set(late)
                    for t in out_tensors:
                        t.fill_(float("nan"))  # poisoned: an unwritten element never compares
                    fused(s0)
                    torch.cuda.synchronize()
                    outs.append([t.clone() for t in out_tensors])
                same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                           for a, b in zip(*outs))  # fmt: skip
                n = len(case.sets)
                times = {}
                for tag, late, cap in (("early", False, None), ("late", True, None),
                                       ("late168", True, 168)):  # fmt: skip
                    _set(late, cap)
                    times[tag] = harness.graph_time_us(lambda i: fused(case.sets[i % n]),
                                                       calls=max(20, n))  # fmt: skip
                _set(False)
                times["compile"] = harness.graph_time_us(lambda i: comp(case.sets[i % n]),
                                                         calls=max(20, n))  # fmt: skip
                line = "  ".join(f"{k}={v:8.2f}" for k, v in times.items())
                best = min(times["late"], times["late168"])
                print(f"{op[:14]:14s} H={h:5d} M={m:6d} bitwise={'ok' if same else 'DIFF'}  "
                      f"{line}  early/late={times['early'] / times['late']:.3f}  "
                      f"compile/best_late={times['compile'] / best:.2f}", flush=True)


if __name__ == "__main__":
    main()
