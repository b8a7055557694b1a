"""H200 sweep: stepped rows (norm/triton.py `norm_stepped`) for rmsnorm and fused_add_rmsnorm at
other thread layouts than the policy's, against the one-pass tile and torch.compile.

A stepped tile is (warps, columns per thread per step): STEP = 32 x warps x vec. Each layout is a
different reduction tree, so a choice must stay a function of the width (tiles.RMSNORM_POLICY,
tiles.FUSED_ADD_POLICY); within a layout, the unrolled (row in registers) and looped (two passes)
modes must give the same bits.

1. Bitwise: unrolled == looped for every layout, H in {2880, 4096, 8192}, M in {1, 7, 300}; both
   against the reference (residual bitwise, normed within tolerance).
2. CUDA-graph replay times (inputs rotated over sets > L2, PDL on): the op as the library runs it
   (its policy), each layout unrolled and looped, torch.compile (pool outputs) and, for fused_add,
   torch.compile written back in place.

History (2026-11-30): the first version of this script carried its own copies of the kernels to
also try other load policies and a residual stored after the row's sum; its logs are
notes/gpu-logs/sweep-stepped-norms-2026-11-30[-run1].log and
sweep-stepped-fused-add-early-2026-11-30.log, the outcome is in notes/norm.md.

Run: PYTHONPATH=src python3 scripts/sweep_stepped_norms.py [fused_add,rmsnorm] [4096,7168,8192]
"""

import sys

import torch

from moefuse.bench import harness
from moefuse.bench.norm import INPLACE_MATH, torch_fused_add_rmsnorm, torch_rmsnorm
from moefuse.norm import reference as ref
from moefuse.norm import tiles
from moefuse.norm import triton as nt
from moefuse.testing import assert_close

DEV, BF, EPS = "cuda", torch.bfloat16, 1e-6
LAYOUTS = ((8, 8), (16, 8), (16, 4))  # (warps, columns per thread per step)


def _tile(h, warps, vec):
    step = 32 * warps * vec
    return tiles.RowTile(block=step, num_chunks=-(-h // step), rows=1, num_warps=warps,
                         stepped=True)  # fmt: skip


def _modes(tile):
    return (True, False) if tile.num_chunks <= tiles.STEP_UNROLL_MAX_STEPS else (False,)


def fused_add(x, r, w, tile=None, unroll=None):
    nt.launch_fused_add_rmsnorm(x, r, w, EPS, 0.0, True, tile=tile, unroll=unroll)


def rmsnorm(x, w, out, tile=None, unroll=None):
    nt.launch_rmsnorm(x, w, out, EPS, 0.0, True, tile=tile, unroll=unroll)


def check() -> int:
    bad = 0
    for h in (2880, 4096, 8192):
        for m in (1, 7, 300):
            x, r, w = (torch.randn(m, h, device=DEV).to(BF), torch.randn(m, h, device=DEV).to(BF),
                       torch.randn(h, device=DEV).to(BF))  # fmt: skip
            normed, r_ref = ref.fused_add_rmsnorm_reference(x, r, w, EPS)
            rms_ref = ref.rmsnorm_reference(x, w, EPS)
            for warps, vec in LAYOUTS:
                tile, fa, rm = _tile(h, warps, vec), [], []
                for unroll in _modes(tile):
                    xi, ri = x.clone(), r.clone()
                    fused_add(xi, ri, w, tile, unroll)
                    fa.append((xi, ri))
                    o = torch.full_like(x, float("nan"))
                    rmsnorm(x, w, o, tile, unroll)
                    rm.append(o)
                torch.cuda.synchronize()
                same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                           for a, b in zip(fa[0], fa[-1])) and torch.equal(
                    rm[0].view(torch.int16), rm[-1].view(torch.int16))  # fmt: skip
                ok = torch.equal(fa[0][1], r_ref)
                try:
                    assert_close(fa[0][0], normed, "rsqrt_half", "fused_add normed")
                    assert_close(rm[0], rms_ref, "rsqrt_half", "rmsnorm")
                except AssertionError as e:
                    ok = False
                    print("  reference:", str(e)[:200])
                bad += not (same and ok)
                print(f"check H={h:5d} M={m:4d} {warps}w x {vec}: "
                      f"{'bitwise' if same else 'DIFFERENT'} ref {'ok' if ok else 'BAD'}",
                      flush=True)  # fmt: skip
    return bad


def time_sets(fn, sets):
    n = len(sets)
    return harness.graph_time_us(lambda i: fn(sets[i % n]), calls=max(20, n), replays=20)


def sweep(ops, widths) -> None:
    c_fa = harness.compile_baseline(torch_fused_add_rmsnorm)
    c_fa_in = harness.compile_baseline(INPLACE_MATH["fused_add_rmsnorm"])
    c_rms = harness.compile_baseline(torch_rmsnorm)
    for op in ops:
        for h in widths:
            w = torch.randn(h, device=DEV).to(BF)
            for m in (1, 16, 128, 1024, 2048, 4096, 16384):
                k = harness.rotation_sets((8 if op == "fused_add" else 4) * m * h)
                out = torch.empty(m, h, device=DEV, dtype=BF)
                sets = [(torch.randn(m, h, device=DEV).to(BF),
                         torch.randn(m, h, device=DEV).to(BF)) for _ in range(k)]  # fmt: skip
                if op == "fused_add":
                    def run(s, tile=None, unroll=None):
                        fused_add(s[0], s[1], w, tile, unroll)
                else:
                    def run(s, tile=None, unroll=None):
                        rmsnorm(s[0], w, out, tile, unroll)
                t = {"library": time_sets(run, sets)}
                for warps, vec in LAYOUTS:
                    tile = _tile(h, warps, vec)
                    for unroll in _modes(tile):
                        t[f"{warps}x{vec}{'u' if unroll else 'l'}"] = time_sets(
                            lambda s, tl_=tile, u=unroll: run(s, tl_, u), sets)
                if m in (1, 128, 2048, 16384):
                    if op == "fused_add":
                        t["cmp"] = time_sets(lambda s: c_fa(s[0], s[1], w), sets)
                        t["cmp_in"] = time_sets(lambda s: c_fa_in(s[0], s[1], w), sets)
                    else:
                        t["cmp"] = time_sets(lambda s: c_rms(s[0], w), sets)
                print(f"{op:9s} H={h:5d} M={m:6d} " + " ".join(f"{n}={v:7.2f}" for n, v in
                                                              t.items()), flush=True)  # fmt: skip


def main(check_fn, sweep_fn) -> None:
    """Command line of the stepped-row sweeps: [ops (fused_add,rmsnorm)] [widths], the check
    first, then the timings, then the number of failed checks."""
    print(torch.cuda.get_device_name(0), flush=True)
    ops = sys.argv[1].split(",") if len(sys.argv) > 1 else ["fused_add", "rmsnorm"]
    widths = [int(v) for v in sys.argv[2].split(",")] if len(sys.argv) > 2 else [4096, 7168, 8192]
    failures = check_fn()
    sweep_fn(ops, widths)
    print("check failures:", failures)


if __name__ == "__main__":
    main(check, sweep)
