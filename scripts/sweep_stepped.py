"""H200 check + sweep of the gated ops' stepped rows (moefuse.norm.gated): unrolled vs looped.

1. Bitwise: unrolled == looped for both ops, every optional input (weight / post_weight, alpha
   tensor or scalar, router output, gain centres), PDL on and off, H in {2880, 4096, 5120, 7168,
   8192}, M in {1, 7, 300}; NaN-poisoned outputs; both close to the reference.
2. CUDA-graph replay times (benchmark configuration, inputs rotated over sets larger than L2, PDL
   on): unrolled, looped, torch.compile and an SM copy of the same bytes, to place
   tiles.STEP_LOOP_MIN_ROWS.

Run: PYTHONPATH=src python3 scripts/sweep_stepped.py [--widths ..] [--tokens ..] [--no-check]
"""

import argparse
import sys

import torch

from moefuse.bench import harness
from moefuse.bench import norm as bn
from moefuse.norm import gated
from moefuse.norm import reference as ref
from moefuse.testing import assert_close

DEV, BF, EPS = "cuda", torch.bfloat16, 1e-6


def _nan(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), device=DEV, dtype=dtype)


def _bits(x):
    return x.view(torch.int16 if x.dtype == BF else torch.int32)


def _run_both(b, r, a, be, w, pw, full, pdl, unroll):
    m, h = b.shape
    o, ro, f = _nan(m, h), _nan(m, h), _nan(m, h, dtype=BF)
    rt = _nan(m, h) if full else None
    gated.launch_gated_residual_rmsnorm(b, r, w if full else None, a, be, o, EPS,
                                        1.0 if full else 0.0, pdl, unroll=unroll)  # fmt: skip
    gated.launch_gated_residual_next_rmsnorm(
        b, r, w, a if full else None, 1.0 if full else 0.75, be, pw if full else None, ro, f, rt,
        EPS, 1e-5, 1.0 if full else 0.0, 0.5, pdl, unroll=unroll)  # fmt: skip
    return [o, ro, f] + ([rt] if full else [])


def check() -> int:
    bad = 0
    for h in (2880, 4096, 5120, 7168, 8192):
        for m in (1, 7, 300):
            b, r = torch.randn(m, h, device=DEV).to(BF), torch.randn(m, h, device=DEV)
            a, be = torch.rand(h, device=DEV), torch.rand(h, device=DEV)
            w, pw = torch.randn(h, device=DEV).to(BF), torch.randn(h, device=DEV).to(BF)
            for pdl in (False, True):
                for full in (False, True):
                    args = (b, r, a, be, w, pw, full, pdl)
                    u, lp = _run_both(*args, True), _run_both(*args, False)
                    torch.cuda.synchronize()
                    same = all(torch.equal(_bits(x), _bits(y)) for x, y in zip(u, lp))
                    ok_ref = True
                    try:
                        exp = ref.gated_residual_rmsnorm_reference(b, r, w if full else None, a,
                                                                   be, EPS, 1.0 if full else 0.0)
                        assert_close(u[0], exp, "fp32_stream", "gated")
                        exp_ro, _, _ = ref.gated_residual_next_rmsnorm_reference(
                            b, r, w, a if full else 0.75, be, EPS, 1e-5, 1.0 if full else 0.0,
                            pw if full else None, 0.5)  # fmt: skip
                        assert_close(u[1], exp_ro, "fp32_stream", "residual_out")
                    except AssertionError as e:
                        ok_ref = False
                        print("  reference:", str(e)[:200])
                    bad += not (same and ok_ref)
                    print(f"check H={h:5d} M={m:4d} pdl={pdl:d} full={full:d}: "
                          f"{'bitwise' if same else 'DIFFERENT'} ref {'ok' if ok_ref else 'BAD'}",
                          flush=True)
    return bad


def _launch(op, s, unroll):
    if op == "gated_residual_rmsnorm":
        gated.launch_gated_residual_rmsnorm(s[0], s[1], None, s[2], s[3], s[4], EPS, 0.0, True,
                                            unroll=unroll)  # fmt: skip
    else:
        gated.launch_gated_residual_next_rmsnorm(
            s[0], s[1], s[2], s[3], 1.0, s[4], None, s[5], s[6], None, EPS, EPS, 0.0, 0.0, True,
            unroll=unroll)  # fmt: skip


def sweep(widths, tokens) -> None:
    compiled = {}
    for op in ("gated_residual_rmsnorm", "gated_residual_next_rmsnorm"):
        for h in widths:
            for m in tokens:
                case, _ = bn._make_case(op, m, h, None)
                n = len(case.sets)
                t = {}
                for tag, unroll in (("unroll", True), ("loop", False)):
                    t[tag] = harness.graph_time_us(lambda i: _launch(op, case.sets[i % n], unroll),
                                                   calls=max(20, n))  # fmt: skip
                comp = bn._variants(op, compiled)["compile"]
                t["compile"] = harness.graph_time_us(lambda i: comp(case.sets[i % n]),
                                                     calls=max(20, n))  # fmt: skip
                t["copy"] = harness.copy_time_us(case.bytes)
                best = min(t["unroll"], t["loop"])
                print(f"{op[:14]:14s} H={h:5d} M={m:6d} "
                      + " ".join(f"{k}={v:7.2f}" for k, v in t.items())
                      + f"  best={'unroll' if t['unroll'] <= t['loop'] else 'loop'} "
                      f"compile/best={t['compile'] / best:.3f} copy/best={t['copy'] / best:.3f}",
                      flush=True)
    for kernel in (gated._gated_residual_kernel, gated._gated_residual_next_kernel):
        for cache in kernel.device_caches.values():
            for ck in cache[0].values():
                print(kernel.fn.__name__, "warps", ck.metadata.num_warps, "regs", ck.n_regs,
                      "spills", ck.n_spills)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--widths", default="2880,4096,7168,8192")
    p.add_argument("--tokens", default="1,16,128,256,512,1024,2048,16384")
    args = p.parse_args()
    print(torch.cuda.get_device_name(0), flush=True)
    fails = 0 if args.no_check else check()
    sweep([int(x) for x in args.widths.split(",")], [int(x) for x in args.tokens.split(",")])
    print("check failures:", fails)
    sys.exit(1 if fails else 0)
