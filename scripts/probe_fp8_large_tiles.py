"""Probe: FP8 experts token tiles at large T and the FP16-MMA accumulation, against the default
tile and BF16 moe_experts on the dequantized weights.

    python scripts/probe_fp8_large_tiles.py [--shapes qwen3,...] [--tokens 2048,8192]
        [--variants default,bt128_w4,...] [--mma fp8|fp16] [--accuracy 64] [--json F]

Every variant's output is compared bitwise with the default tile's first (the tile must not move
a bit), then timed (CUDA graph, median of replays).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from moefuse.bench.experts_setup import SHAPES, make_routing  # noqa: E402
from moefuse.bench.harness import graph_time_us  # noqa: E402
from moefuse.bench.moe_experts_fp8 import make_fp8_weights  # noqa: E402
from moefuse.moe import fp8_device  # noqa: E402
from moefuse.moe.experts_fp8 import launch_moe_experts_fp8  # noqa: E402

ORIG_DOT = fp8_device.fp8_block_dot

VARIANTS = {
    "default": (None, None),
    "bt128_w4": (128, {"warps": 4}),
    "bt128_w4_s3": (128, {"warps": 4, "stages": 3}),
    "bt128_w4_s5": (128, {"warps": 4, "stages": 5}),
    "bt128_w8_r128_s3": (128, {"warps": 8, "bn_gate_up": 64, "bn_down": 128, "stages": 3}),
    "bt64_w8_r128": (64, {"warps": 8, "bn_gate_up": 64, "bn_down": 128}),
    "bt64_w4_s5": (64, {"warps": 4, "stages": 5}),
}


@triton.jit
def fp16_block_dot(w, q, PRECISE: tl.constexpr, PTX: tl.constexpr):
    """Every block dot as an FP16 MMA of the exactly widened E4M3 codes (FP32 accumulation)."""
    if PTX:
        a = w.to(tl.float8e4nv, bitcast=True) if w.dtype == tl.uint8 else w
        b = q.to(tl.float8e4nv, bitcast=True) if q.dtype == tl.uint8 else q
        return tl.dot(a.to(tl.float16), b.to(tl.float16), out_dtype=tl.float32)
    else:
        return ORIG_DOT(w, q, PRECISE, PTX)


def _use_fp16_mma() -> None:
    fp8_device.fp8_block_dot = fp16_block_dot


def accuracy(shape, fp8, tokens, dev) -> list[dict]:
    import moefuse

    gq, gs, dq, ds = fp8
    kw = dict(gate_up_proj_scale_inv=gs, down_proj_scale_inv=ds)
    out = []
    for t in tokens:
        x, idx, w = make_routing(t, shape, dev, seed=3 + t)
        got = moefuse.moe_experts(x, gq, dq, idx, w, **kw).double()
        want = moefuse.moe_experts(x, gq, dq, idx, w, impl="reference", **kw).double()
        rel = float((got - want).norm() / want.norm())
        out.append({"T": t, "rel_rms_vs_reference": rel})
        print(f"accuracy T={t}: rel RMS {rel:.3e}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen3,mixtral,deepseek_v3")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default=None)
    ap.add_argument("--mma", default="fp8", choices=("fp8", "fp16"))
    ap.add_argument("--accuracy", default="", help="T list: rel RMS vs the FP64 reference")
    args = ap.parse_args()
    if args.mma == "fp16":
        _use_fp16_mma()
    import moefuse

    dev = torch.device("cuda")
    rows = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        gq, gs, dq, ds, gbf, dbf = make_fp8_weights(shape, dev)
        if args.accuracy:
            acc_t = [int(v) for v in args.accuracy.split(",")]
            for r in accuracy(shape, (gq, gs, dq, ds), acc_t, dev):
                rows.append({"shape": name, "mma": args.mma, **r})
        for t in (int(v) for v in args.tokens.split(",")):
            x, idx, w = make_routing(t, shape, dev, seed=7 * t)
            outs = {}

            def call(tt, tile, o, x=x, idx=idx, w=w):
                launch_moe_experts_fp8(
                    x, gq, gs, dq, ds, idx, w, o, None, None, 1.0, False, True,
                    tile=tile, token_tile=tt,
                )  # fmt: skip
                return o

            ref = None
            for v in args.variants.split(","):
                tt, tile = VARIANTS[v]
                if v != "default" and t < 2048:
                    continue
                o = torch.full((t, shape["hidden"]), float("nan"), dtype=x.dtype, device=dev)
                try:
                    call(tt, tile, o)
                    torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001
                    print(
                        f"{name} {args.mma} T={t} {v}: ERROR {type(exc).__name__}: {str(exc)[:200]}"
                    )
                    continue
                if ref is None:
                    ref = o.clone()
                same = bool(torch.equal(o.view(torch.int16), ref.view(torch.int16)))
                calls = 3 if t * shape["hidden"] * shape["inter"] > 2e11 else 10
                us = graph_time_us(
                    lambda i, tt=tt, tile=tile, o=o: call(tt, tile, o), calls=calls, replays=7
                )
                outs[v] = us
                rows.append(
                    {
                        "shape": name,
                        "mma": args.mma,
                        "T": t,
                        "variant": v,
                        "us": us,
                        "bitwise_default": same,
                    }
                )
                print(
                    f"{name} {args.mma} T={t} {v}: {us:.1f} us  bitwise==default {same}", flush=True
                )
            if args.mma != "fp8":
                continue
            bf = graph_time_us(
                lambda i: moefuse.moe_experts(x, gbf, dbf, idx, w), calls=3, replays=7
            )
            rows.append({"shape": name, "T": t, "variant": "bf16_moefuse", "us": bf})
            best = min(outs, key=outs.get)
            default_x = bf / outs["default"]
            print(
                f"{name} T={t} bf16 {bf:.1f} us; default x bf16 {default_x:.2f}; "
                f"best {best} x bf16 {bf / outs[best]:.2f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
