"""Tile variants of the fused experts kernels at the benchmark's shapes (CUDA-graph µs, each call
on another routing set), per-kernel µs of the default, and bitwise equality of the token tiles
for each down-kernel tile. ``python scripts/sweep_experts.py [--out DIR]``"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from moefuse.bench.harness import graph_time_us
from moefuse.bench.moe_experts import (
    PEAK_TBS,
    SHAPES,
    expert_bytes,
    kernel_times,
    make_routing,
    make_weights,
)
from moefuse.moe.experts_triton import launch_moe_experts

VARIANTS = {
    "default": {},
    "down_bn32": {"bn_down": 32},
    "bk64": {"bk": 64},
    "gu_bn16": {"bn_gate_up": 16},
}
CASES = {"qwen3": ((1, 4, 16, 64, 256), list(VARIANTS)),
         "mixtral": ((1, 64, 256), ["default", "down_bn32"]),
         "deepseek_v3": ((1, 256), ["default", "down_bn32"])}  # fmt: skip


def run(x, idx, w, gu, dn, tile, token_tile=None):
    out = torch.empty_like(x)
    launch_moe_experts(x, gu, dn, idx, w, out, None, None, 1.0, False, True, tile=tile,
                       token_tile=token_tile)  # fmt: skip
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for name, (tokens, variants) in CASES.items():
        rows += sweep_shape(name, tokens, variants, dev)
        torch.cuda.empty_cache()
    with open(f"{args.out}/sweep_experts.json", "w") as f:
        json.dump(rows, f, indent=1)


def sweep_shape(name, tokens, variants, dev):
    rows = []
    if True:
        shape = SHAPES[name]
        gu, dn = make_weights(shape, dev)
        x, idx, w = make_routing(64, shape, dev, seed=5)
        for vname in ("default", "down_bn32"):
            ref = run(x, idx, w, gu, dn, VARIANTS[vname], 16)
            same = all(torch.equal(run(x, idx, w, gu, dn, VARIANTS[vname], bt), ref)
                       for bt in (32, 64, 128))  # fmt: skip
            alone = all(torch.equal(run(x[j:j + 1], idx[j:j + 1], w[j:j + 1], gu, dn,
                                        VARIANTS[vname])[0], ref[j])
                        for j in (0, 9, 63))  # fmt: skip
            print(f"{name} {vname}: token tiles equal {same}, alone == batch {alone}")
            rows.append({"shape": name, "variant": vname, "token_tiles_equal": same,
                         "alone_equal": alone})  # fmt: skip
        for t in tokens:
            sets = [make_routing(t, shape, dev, seed=100 * t + s) for s in range(8)]
            distinct = statistics.mean(len(torch.unique(i)) for _, i, _ in sets)
            floor = distinct * expert_bytes(shape) / (PEAK_TBS * 1e12) * 1e6
            for vname in variants:
                tile = VARIANTS[vname]
                us = graph_time_us(lambda i, tile=tile, sets=sets: run(*sets[i % 8], gu, dn, tile),
                                   calls=int(max(3, min(20, 20000 / (3 * floor + 20)))),
                                   replays=8)  # fmt: skip
                row = {"shape": name, "T": t, "variant": vname, "us": us, "floor_us": floor,
                       "x_floor": us / floor}  # fmt: skip
                if vname == "default" and t in (1, 64, 256):
                    row["kernels_us"] = kernel_times(lambda a=sets[0]: run(*a, gu, dn, {}), dev)
                rows.append(row)
                print(f"{name:12s} T={t:4d} {vname:10s} {us:9.1f} us  floor {floor:8.1f}  "
                      f"x{us / floor:5.2f}", flush=True)
                if "kernels_us" in row:
                    print("    ", {k[:40]: round(v, 1) for k, v in row["kernels_us"].items()})
    return rows


if __name__ == "__main__":
    main()
