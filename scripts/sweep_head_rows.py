"""H200 sweep: rows per program (and warps) of rmsnorm_sigmoid_gate's head-row tiles.

A head row of 64 / 128 columns is reduced inside one warp (8 elements per thread, then a lane
butterfly) for every tile of >= 16 rows, so rows per program and warps should not change a row's
bits; the script checks that bitwise against the default tile on fresh inputs, then times each
variant (CUDA-graph replays, inputs rotated over sets larger than L2, PDL on) beside
torch.compile at M in {1, 128, 1024, 2048, 16384} (32 heads).

Run: PYTHONPATH=src python3 scripts/sweep_head_rows.py
"""

import dataclasses

import torch

from moefuse.bench import harness
from moefuse.bench import norm as bn
from moefuse.norm import tiles
from moefuse.norm import triton as nt

VARIANTS = ((1, 8), (2, 8), (4, 8), (8, 8), (1, 4), (2, 4), (4, 16))  # (rows x, warps)


def _tile(head_dim, scale, warps):
    base = tiles.row_tile(head_dim, tiles.SIGMOID_GATE_POLICY)
    return dataclasses.replace(base, rows=base.rows * scale, num_warps=warps)


def main() -> None:
    print(torch.cuda.get_device_name(0), flush=True)
    compiled = {}
    bad = 0
    for head_dim in (64, 128):
        base = tiles.row_tile(head_dim, tiles.SIGMOID_GATE_POLICY)
        print("default tile", base, flush=True)
        for m in (1, 128, 1024, 2048, 16384):
            case, _ = bn._make_case("rmsnorm_sigmoid_gate", m, 4096, head_dim)
            n = len(case.sets)
            x0, g0 = case.sets[0]
            ref = None
            t = {}
            for scale, warps in VARIANTS:
                tile = _tile(head_dim, scale, warps)
                out = torch.full_like(x0, float("nan"))
                nt.launch_rmsnorm(x0, None, out, 1e-5, 0.0, False, gate=g0, tile=tile)
                torch.cuda.synchronize()
                if ref is None:
                    ref = out
                same = torch.equal(out.view(torch.int16), ref.view(torch.int16))
                bad += not same
                tag = f"r{tile.rows}w{warps}" + ("" if same else "!DIFF")
                t[tag] = harness.graph_time_us(
                    lambda i, tl_=tile: nt.launch_rmsnorm(case.sets[i % n][0], None,
                                                          case.sets[i % n][0], 1e-5, 0.0, True,
                                                          gate=case.sets[i % n][1], tile=tl_),
                    calls=max(20, n))  # fmt: skip
            comp = bn._variants("rmsnorm_sigmoid_gate", compiled)["compile"]
            t["compile"] = harness.graph_time_us(lambda i: comp(case.sets[i % n]),
                                                 calls=max(20, n))  # fmt: skip
            best = min((v, k) for k, v in t.items() if k != "compile")
            first = next(iter(t))
            print(f"32x{head_dim} M={m:6d} " + " ".join(f"{k}={v:7.2f}" for k, v in t.items())
                  + f"  best={best[1]} compile/best={t['compile'] / best[0]:.3f} "
                  f"compile/default={t['compile'] / t[first]:.3f}", flush=True)
    print("bitwise mismatches:", bad)


if __name__ == "__main__":
    main()
