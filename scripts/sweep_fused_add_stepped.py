"""H200 check + sweep: stepped rows for fused_add_rmsnorm (norm/triton.py, the gated ops' layout:
16 warps x 4 columns per step, per-thread accumulation, one tl.sum) vs the one-pass tile.

1. Bitwise: unrolled == looped, H in {2880, 4096, 5120, 7168, 8192}, M in {1, 7, 300}, PDL on / off;
   both against the reference (residual bitwise, normed within tolerance).
2. CUDA-graph replay times (benchmark configuration, PDL on) of the one-pass tile (today's
   policy), stepped unrolled, stepped looped and torch.compile.

Run: PYTHONPATH=src python3 scripts/sweep_fused_add_stepped.py [columns per thread per step: 4]
"""

import dataclasses
import sys

import torch

from moefuse.bench import harness
from moefuse.bench import norm as bn
from moefuse.norm import reference as ref
from moefuse.norm import tiles
from moefuse.norm import triton as nt
from moefuse.testing import assert_close

DEV, BF, EPS = "cuda", torch.bfloat16, 1e-6
VEC = int(sys.argv[1]) if len(sys.argv) > 1 else 4
STEPPED = dataclasses.replace(tiles.FUSED_ADD_POLICY, step_min_width=2048, step_vec=VEC)


def _stepped(h):
    return tiles.row_tile(h, STEPPED)


def check() -> int:
    bad = 0
    for h in (2880, 4096, 5120, 7168, 8192):
        for m in (1, 7, 300):
            x, r, w = (torch.randn(m, h, device=DEV).to(BF), torch.randn(m, h, device=DEV).to(BF),
                       torch.randn(h, device=DEV).to(BF))  # fmt: skip
            for pdl in (False, True):
                outs = []
                for unroll in (True, False):
                    xi, ri = x.clone(), r.clone()
                    nt.launch_fused_add_rmsnorm(xi, ri, w, EPS, 0.0, pdl, tile=_stepped(h),
                                                unroll=unroll)  # fmt: skip
                    outs.append((xi, ri))
                torch.cuda.synchronize()
                same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                           for a, b in zip(*outs))  # fmt: skip
                normed, r_out = ref.fused_add_rmsnorm_reference(x, r, w)
                ok = torch.equal(outs[0][1], r_out)
                try:
                    assert_close(outs[0][0], normed, "rsqrt_half", "normed")
                except AssertionError as e:
                    ok = False
                    print("  reference:", str(e)[:200])
                bad += not (same and ok)
                print(f"check H={h:5d} M={m:4d} pdl={pdl:d}: {'bitwise' if same else 'DIFFERENT'}"
                      f" ref {'ok' if ok else 'BAD'}", flush=True)
    return bad


def sweep() -> None:
    compiled = {}
    op = "fused_add_rmsnorm"
    for h in (2880, 4096, 7168, 8192):
        for m in (1, 16, 128, 512, 1024, 2048, 16384):
            case, _ = bn._make_case(op, m, h, None)
            n = len(case.sets)
            t = {}
            variants = (("onepass", None, None), ("unroll", _stepped(h), True),
                        ("loop", _stepped(h), False))  # fmt: skip
            for tag, tile, unroll in variants:
                t[tag] = harness.graph_time_us(
                    lambda i: nt.launch_fused_add_rmsnorm(*case.sets[i % n], EPS, 0.0, True,
                                                          tile=tile, unroll=unroll),
                    calls=max(20, n))  # fmt: skip
            comp = bn._variants(op, compiled)["compile"]
            t["compile"] = harness.graph_time_us(lambda i: comp(case.sets[i % n]),
                                                 calls=max(20, n))  # fmt: skip
            best = min(t["unroll"], t["loop"])
            print(f"fused_add H={h:5d} M={m:6d} " + " ".join(f"{k}={v:7.2f}" for k, v in t.items())
                  + f"  compile/stepped={t['compile'] / best:.3f} "
                  f"compile/onepass={t['compile'] / t['onepass']:.3f}", flush=True)


if __name__ == "__main__":
    print(torch.cuda.get_device_name(0), "step_vec", VEC, flush=True)
    fails = check()
    sweep()
    print("check failures:", fails)
    sys.exit(1 if fails else 0)
