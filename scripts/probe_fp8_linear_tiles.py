"""Probe: fp8_linear tiles at large M (token columns per program) against the default and BF16
``torch.mm`` on the dequantized weight; every variant checked bitwise against the default first.

    python scripts/probe_fp8_linear_tiles.py [--rows 2048,8192] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from moefuse.bench.fp8_linear import SHAPES, make_weight  # noqa: E402
from moefuse.bench.harness import graph_time_us  # noqa: E402
from moefuse.moe.linear_triton import launch_fp8_linear  # noqa: E402

VARIANTS = {
    "default": None,
    "bt128": {"bt": 128},
    "bt128_s3": {"bt": 128, "stages": 3},
    "bn128_bt64_w8": {"bn": 128, "bt": 64, "warps": 8},
}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2048,8192")
    ap.add_argument("--shapes", default="qwen3_q_proj,qwen3_o_proj,dsv3_o_proj,dsv3_mlp_down")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    out_rows = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        q, s, bf = make_weight(n, k, dev)
        for m in (int(v) for v in args.rows.split(",")):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = None
            for v, tile in VARIANTS.items():
                o = torch.full((m, n), float("nan"), device=dev, dtype=torch.bfloat16)

                def call(tile=tile, o=o):
                    launch_fp8_linear(x, q, s, None, None, o, True, tile=tile)
                    return o

                try:
                    call()
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001
                    print(f"{name} M={m} {v}: ERROR {type(exc).__name__}: {str(exc)[:160]}")
                    continue
                ref = o.clone() if ref is None else ref
                same = bool(torch.equal(o.view(torch.int16), ref.view(torch.int16)))
                us = graph_time_us(lambda i, c=call: c(), calls=5, replays=7)
                out_rows.append({"shape": name, "M": m, "variant": v, "us": us, "bitwise": same})
                print(f"{name} M={m} {v}: {us:.1f} us bitwise==default {same}", flush=True)
            mm = graph_time_us(lambda i: x @ bf.t(), calls=5, replays=7)
            out_rows.append({"shape": name, "M": m, "variant": "bf16_mm", "us": mm})
            print(f"{name} M={m} bf16 torch.mm: {mm:.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": out_rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
