"""PDL on / off for the MoE producer -> finalize chain, per token count (H200 measurement for
the ``enable_pdl=None`` table in moefuse.moe.tiles).

    PYTHONPATH=src python scripts/sweep_pdl_moe.py [--out DIR]

Times CUDA-graph replays of moe_permute -> moe_finalize with each op's PDL forced on or off
(4 combinations) and the default (enable_pdl=None), K = 8, H = 4096 and 7168; prints a table and
writes sweep_pdl_moe.json.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

import moefuse
from moefuse.bench import harness
from moefuse.bench.moe import finalize_bytes, make_inputs

TOKENS = (1, 8, 16, 32, 48, 64, 96, 128, 256, 512, 1024, 2048)
K = 8


def chain(sets, pdl_permute, pdl_finalize):
    def fn(i):
        x, xp, plan, w, out = sets[i % len(sets)]
        moefuse.moe_permute(x, plan.permuted_idx_to_expanded_idx, K, out=xp,
                            enable_pdl=pdl_permute)
        moefuse.moe_finalize(xp, plan.expanded_idx_to_permuted_idx, w, out=out,
                             enable_pdl=pdl_finalize)

    return fn


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--hidden", default="4096,7168")
    args = ap.parse_args(argv)
    dev = torch.device("cuda", 0)
    rows = []
    for h in [int(v) for v in args.hidden.split(",")]:
        for m in TOKENS:
            sets = []
            for s in range(harness.rotation_sets(2 * finalize_bytes(m, K, h))):
                rws, plan, w = make_inputs(m, K, h, dev, seed=s)
                x = torch.randn(m, h, device=dev).bfloat16()
                sets.append((x, rws, plan, w, torch.empty(m, h, dtype=torch.bfloat16, device=dev)))
            row = {"H": h, "M": m}
            for name, a, b in (("on/on", True, True), ("off/off", False, False),
                               ("off/on", False, True), ("on/off", True, False),
                               ("default", None, None)):
                row[name] = harness.graph_time_us(chain(sets, a, b), calls=20, replays=15)
            rows.append(row)
            print(f"H={h} M={m:5d} " + " ".join(f"{k}={v:7.2f}" for k, v in row.items()
                                                 if k not in ("H", "M")), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "sweep_pdl_moe.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
