"""H200 sweep: warps per row of the gated ops (tile policy GATED_POLICY, 4 warps today) with and
without a register cap that lets two CTAs share an SM.

At H = 8192 the 4-warp one-pass tile holds 64 elements per thread (255 registers, 2 CTAs = 8
warps per SM); 8 warps hold 32 (132 registers measured before: 1 CTA per SM, 128 would give 2 = 16
warps per SM); 16 warps hold 16. Warps change the reduction tree (bits), so a new choice must be a
function of H alone; this script only measures. For gated_residual_rmsnorm and
gated_residual_next_rmsnorm (benchmark configuration) at H in {4096, 8192} and M in {1, 16, 128,
1024, 2048, 16384}: every variant against the 4-warp output (max relative difference; NaN-poisoned
outputs), then CUDA-graph replay times (inputs rotated over sets larger than L2, PDL on) and
torch.compile's. Registers / spills of each compiled variant at the end.

Run: PYTHONPATH=src python3 scripts/sweep_gated_warps.py
"""

import dataclasses

import torch

from moefuse.bench import harness
from moefuse.bench import norm as bn
from moefuse.norm import gated, tiles

OPS = ("gated_residual_rmsnorm", "gated_residual_next_rmsnorm")
TOKENS = (1, 16, 128, 1024, 2048, 16384)
WIDTHS = (4096, 8192)
VARIANTS = (("w4", 4, None), ("w8", 8, None), ("w8r128", 8, 128), ("w16", 16, None),
            ("w16r64", 16, 64))  # fmt: skip
EPS = 1e-6
_KWARGS = gated._kwargs


def _tile(h: int, warps: int, same_slices: bool):
    """The policy's tile with ``warps``; ``same_slices`` keeps its [S, SLICE] shape (then only the
    warps' placement changes: is the per-slice tree, hence every bit, the same?)."""
    base = tiles.row_tile(h, tiles.GATED_POLICY)
    slices = base.slices if same_slices else \
        max(1, base.block // (32 * warps * tiles.ELEMS_PER_THREAD))  # fmt: skip
    return dataclasses.replace(base, num_warps=warps, slices=slices)


def _cap(maxnreg):
    def kwargs(tile, scratch, use_pdl):
        out = _KWARGS(tile, scratch, use_pdl)
        if maxnreg:
            out["maxnreg"] = maxnreg
        return out

    gated._kwargs = kwargs


def _launch(op: str, s, tile) -> None:
    if op == "gated_residual_rmsnorm":
        gated.launch_gated_residual_rmsnorm(s[0], s[1], None, s[2], s[3], s[4], EPS, 0.0, True,
                                            tile=tile, split=False)  # fmt: skip
    else:
        gated.launch_gated_residual_next_rmsnorm(
            s[0], s[1], s[2], s[3], 1.0, s[4], None, s[5], s[6], None, EPS, EPS, 0.0, 0.0, True,
            tile=tile, split=False)  # fmt: skip


def _outs(op: str, s):
    return list(s[5:7]) if op == "gated_residual_next_rmsnorm" else [s[4]]


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--same-slices", action="store_true")
    parser.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = parser.parse_args()
    print(f"{torch.cuda.get_device_name(0)}; us per call (PDL on); same slices: "
          f"{args.same_slices}", flush=True)  # fmt: skip
    compiled = {}
    for op in OPS:
        for h in map(int, args.widths.split(",")):
            for m in map(int, args.tokens.split(",")):
                case, _ = bn._make_case(op, m, h, None)
                s0, n = case.sets[0], len(case.sets)
                results, times = {}, {}
                for tag, warps, cap in VARIANTS:
                    tile = _tile(h, warps, args.same_slices)
                    _cap(cap)
                    for t in _outs(op, s0):
                        t.fill_(float("nan"))
                    _launch(op, s0, tile)
                    torch.cuda.synchronize()
                    results[tag] = [t.float().clone() for t in _outs(op, s0)]
                    times[tag] = harness.graph_time_us(
                        lambda i: _launch(op, case.sets[i % n], tile), calls=max(20, n))
                _cap(None)
                comp = bn._variants(op, compiled)["compile"]
                times["compile"] = harness.graph_time_us(lambda i: comp(case.sets[i % n]),
                                                         calls=max(20, n))  # fmt: skip
                diffs = []
                for tag in results:
                    same = all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                               for a, b in zip(results[tag], results["w4"]))  # fmt: skip
                    d = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
                            for a, b in zip(results[tag], results["w4"]))  # fmt: skip
                    diffs.append(f"{tag}:{'bitwise' if same else f'{d:.1e}'}")
                line = "  ".join(f"{k}={v:8.2f}" for k, v in times.items())
                best = min((v, k) for k, v in times.items() if k != "compile")
                print(f"{op[:14]:14s} H={h:5d} M={m:6d} {line}  best={best[1]} "
                      f"x_compile={times['compile'] / best[0]:.2f} | reldiff {' '.join(diffs)}",
                      flush=True)
    for kernel in (gated._gated_residual_kernel, gated._gated_residual_next_kernel):
        for cache in kernel.device_caches.values():
            for ck in cache[0].values():
                md = ck.metadata
                print(kernel.fn.__name__, "warps", md.num_warps, "maxnreg",
                      getattr(md, "maxnreg", None), "regs", ck.n_regs, "spills", ck.n_spills)


if __name__ == "__main__":
    main()
