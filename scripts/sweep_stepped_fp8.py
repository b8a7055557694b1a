"""H200 sweep: stepped FP8 rows (quant/fused.py ``_rmsnorm_fp8_kernel`` with STEPPED: the norm's
``norm_stepped`` with the FP8 output hooks) against the one-pass tile and torch.compile, for
rmsnorm_quant and fused_add_rmsnorm_quant.

A stepped tile is (warps, columns per thread per step): STEP = 32 x warps x vec. Each layout is a
different reduction tree, so a choice must stay a function of the width (quant.fused policies);
within a layout the unrolled (row in registers) and looped (two passes) modes give the same bits.

1. Check: unrolled == looped (codes and residual) for every layout, H in {2880, 4096, 8192},
   M in {1, 7, 300}; codes within one step of the reference, residual bitwise.
2. CUDA-graph replay times (inputs rotated over sets > L2, PDL on, one fixed output per set as
   in ``bench quant``): the library's tile, each stepped layout unrolled and looped, and
   torch.compile of norm-then-quantize (``bench quant``'s baseline).

Run: PYTHONPATH=src python3 scripts/sweep_stepped_fp8.py [fused_add,rmsnorm] [4096,7168,8192]
"""

import torch
from sweep_stepped_norms import LAYOUTS, _modes, _tile, main, time_sets  # layouts, timing, CLI

from moefuse.bench import harness
from moefuse.bench.quant import torch_fused_add_rmsnorm_quant, torch_rmsnorm_quant
from moefuse.quant import formats as F
from moefuse.quant import fused as qf
from moefuse.quant import reference as qref

DEV, BF, EPS = "cuda", torch.bfloat16, 1e-6
E4M3 = torch.float8_e4m3fn


def run(x, r, w, scale, q, tile=None, unroll=None):
    qf.launch_rmsnorm_fp8(x, r, w, scale, q.view(torch.uint8), 0, EPS, 0.0, True, tile=tile,
                          unroll=unroll)  # fmt: skip


def check() -> int:
    bad = 0
    scale = torch.tensor([0.02], device=DEV)
    for h in (2880, 4096, 8192):
        for m in (1, 7, 300):
            x, r0, w = (torch.randn(m, h, device=DEV).to(BF), torch.randn(m, h, device=DEV).to(BF),
                        torch.randn(h, device=DEV).to(BF))  # fmt: skip
            q_add, r_ref = qref.fused_add_rmsnorm_quant_reference(x, r0.clone(), w, scale, EPS)
            q_rms = qref.rmsnorm_quant_reference(x, w, scale, EPS)
            for warps, vec in LAYOUTS:
                tile, outs = _tile(h, warps, vec), []
                for unroll in _modes(tile):
                    r = r0.clone()
                    qa = torch.full((m, h), 0x7F, device=DEV, dtype=torch.uint8).view(E4M3)
                    qr = torch.full((m, h), 0x7F, device=DEV, dtype=torch.uint8).view(E4M3)
                    run(x, r, w, scale, qa, tile, unroll)
                    run(x, None, w, scale, qr, tile, unroll)
                    outs.append((qa.view(torch.uint8), r, qr.view(torch.uint8)))
                torch.cuda.synchronize()
                same = all(torch.equal(a, b) for a, b in zip(outs[0], outs[-1]))
                ok = torch.equal(outs[0][1], r_ref)
                da = int(F.fp8_code_distance(outs[0][0].view(E4M3), q_add).max())
                dr = int(F.fp8_code_distance(outs[0][2].view(E4M3), q_rms).max())
                ok = ok and da <= 1 and dr <= 1
                bad += not (same and ok)
                print(f"check H={h:5d} M={m:4d} {warps}w x {vec}: "
                      f"{'bitwise' if same else 'DIFFERENT'} ref {'ok' if ok else 'BAD'} "
                      f"(code steps {da}/{dr})", flush=True)  # fmt: skip
    return bad


def sweep(ops, widths) -> None:
    c_add = harness.compile_baseline(torch_fused_add_rmsnorm_quant)
    c_rms = harness.compile_baseline(torch_rmsnorm_quant)
    scale = torch.tensor([0.02], device=DEV)
    inv = 1.0 / scale
    for op in ops:
        for h in widths:
            w = torch.randn(h, device=DEV).to(BF)
            for m in (1, 128, 2048, 4096, 16384):
                k = harness.rotation_sets((7 if op == "fused_add" else 3) * m * h)
                sets = [(torch.randn(m, h, device=DEV).to(BF),
                         torch.randn(m, h, device=DEV).to(BF),
                         torch.empty(m, h, device=DEV, dtype=E4M3)) for _ in range(k)]  # fmt: skip
                if op == "fused_add":
                    def fn(s, tile=None, unroll=None):
                        run(s[0], s[1], w, scale, s[2], tile, unroll)
                else:
                    def fn(s, tile=None, unroll=None):
                        run(s[0], None, w, scale, s[2], tile, unroll)
                t = {"library": time_sets(fn, sets)}
                for warps, vec in LAYOUTS:
                    tile = _tile(h, warps, vec)
                    for unroll in _modes(tile):
                        t[f"{warps}x{vec}{'u' if unroll else 'l'}"] = time_sets(
                            lambda s, tl_=tile, u=unroll: fn(s, tl_, u), sets)
                if m in (2048, 16384):
                    if op == "fused_add":
                        t["cmp"] = time_sets(lambda s: c_add(s[0], s[1], w, inv), sets)
                    else:
                        t["cmp"] = time_sets(lambda s: c_rms(s[0], w, inv), sets)
                print(f"{op:9s} H={h:5d} M={m:6d} " + " ".join(f"{n}={v:7.2f}" for n, v in
                                                              t.items()), flush=True)  # fmt: skip


if __name__ == "__main__":
    main(check, sweep)
