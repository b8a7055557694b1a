"""H200 sweep: warps per row tile (tiles.MAX_WARPS: 4 / 8 / 16) for rmsnorm, fused_add_rmsnorm
and rmsnorm_sigmoid_gate, side by side with torch.compile. Warps change the reduction tree, so a
new choice must be a function of the width only (never of M); this script only measures.

Run: PYTHONPATH=src python3 scripts/sweep_norm_warps.py [op,op]
"""

import sys

import torch

from moefuse.bench import harness
from moefuse.bench import norm as bn
from moefuse.norm import tiles

OPS = (("rmsnorm", (4096, 8192), None), ("fused_add_rmsnorm", (4096, 8192), None),
       ("rmsnorm_sigmoid_gate", (4096,), 128))  # fmt: skip
TOKENS = (1, 128, 1024, 2048, 16384)


def main() -> None:
    print(torch.cuda.get_device_name(0), flush=True)
    compiled = {}
    only = set(sys.argv[1].split(",")) if len(sys.argv) > 1 else None
    for op, widths, head_dim in OPS:
        if only and op not in only:
            continue
        for h in widths:
            for m in TOKENS:
                case, _ = bn._make_case(op, m, h, head_dim)
                n = len(case.sets)
                fns = bn._variants(op, compiled)
                t = {}
                for warps in (4, 8, 16):
                    tiles.MAX_WARPS = warps
                    t[f"w{warps}"] = harness.graph_time_us(
                        lambda i: fns["moefuse"](case.sets[i % n]), calls=max(20, n))
                tiles.MAX_WARPS = 8
                t["compile"] = harness.graph_time_us(lambda i: fns["compile"](case.sets[i % n]),
                                                     calls=max(20, n))  # fmt: skip
                best = min((v, k) for k, v in t.items() if k != "compile")
                print(f"{op[:12]:12s} {case.shape:8s} M={m:6d} "
                      + " ".join(f"{k}={v:7.2f}" for k, v in t.items())
                      + f"  best={best[1]} compile/best={t['compile'] / best[0]:.3f} "
                      f"compile/w8={t['compile'] / t['w8']:.3f}", flush=True)


if __name__ == "__main__":
    main()
