"""Fused routed experts: tile variants of ``launch_moe_experts`` side by side on one GPU.

For each shape and token count: every variant's output bits against the first variant's (a
variant may only move time, never bits), CUDA-graph µs per call (routing rotated over 8 sets),
and at T = 1 (every T with ``--kernels``) the device µs per kernel of one eager call
(torch.profiler). A variant that fails to build or run is reported with its error.

    python scripts/probe_experts_variants.py [--shapes qwen3 ...] [--tokens 1 2 4]
        [--variant NAME=JSON ...] [--only] [--kernels] [--out DIR]

``--variant plan='{"inline_plan_slots": 0}'`` overrides keys of
:func:`moefuse.moe.tiles.experts_tile` (``"tail_tile"`` included), ``"token_tile"`` forces the
token columns, and ``"plan_chunk"`` / ``"plan_warps"`` / ``"plan_two_phase"`` set the plan
kernel's ids per histogram step, its warps and the two-phase plan
(:func:`moefuse.moe.experts_plan.launch_experts_plan`). Default variants: the default tile, the
plan kernel, the separate finalize (``--only`` drops them). Writes ``experts_variants.json``
under ``--out`` (default: the current directory) after every row.
"""

from __future__ import annotations

import argparse
import json
import os

DEFAULT_VARIANTS = {
    "default": {},
    "plan_kernel": {"inline_plan_slots": 0},
    "finalize_kernel": {"fuse_finalize_slots": 0},
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen3", "deepseek_v3"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help='NAME=JSON tile overrides ("token_tile": forced token columns)',
    )
    p.add_argument(
        "--only",
        action="store_true",
        help="only the --variant ones (the first one's bits are the others' reference)",
    )
    p.add_argument("--kernels", action="store_true", help="per-kernel us at every T, not only 1")
    p.add_argument("--out", default=".")
    args = p.parse_args(argv)
    import torch

    from moefuse.bench.harness import graph_time_us
    from moefuse.bench.moe_experts import (
        SHAPES,
        expert_bytes,
        kernel_times,
        make_routing,
        make_weights,
    )
    from moefuse.moe.experts_triton import launch_moe_experts

    variants = {} if args.only else dict(DEFAULT_VARIANTS)
    for spec in args.variant:
        name, _, tile = spec.partition("=")
        variants[name] = json.loads(tile)
    dev = torch.device("cuda")
    rows = []
    for name in args.shapes:
        shape = SHAPES[name]
        gu, dn = make_weights(shape, dev)
        for t in args.tokens:
            sets = [make_routing(t, shape, dev, seed=1000 * t + s) for s in range(8)]
            distinct = sum(len(torch.unique(i)) for _, i, _ in sets) / len(sets)
            row = {"shape": name, "T": t, "floor_us": distinct * expert_bytes(shape) / 4.8e12 * 1e6}
            first = None
            for var, tile in variants.items():
                tile = dict(tile)
                token_tile = tile.pop("token_tile", None)

                def call(i, tile=tile, token_tile=token_tile):
                    x, idx, w = sets[i % len(sets)]
                    out = torch.empty(t, shape["hidden"], dtype=torch.bfloat16, device=dev)
                    launch_moe_experts(
                        x, gu, dn, idx, w, out, None, None, 1.0, False, True, tile=tile,
                        token_tile=token_tile,
                    )  # fmt: skip
                    return out

                try:
                    bits = call(0).view(torch.int16)
                    first = bits if first is None else first
                    row[var] = {
                        "us": graph_time_us(call, calls=20, replays=15),
                        "same_bits": bool(torch.equal(bits, first)),
                    }
                    if t == 1 or args.kernels:
                        row[var]["kernels_us"] = kernel_times(lambda: call(0), dev)
                except Exception as exc:  # a tile that does not build is reported, not fatal
                    row[var] = {"us": float("nan"), "same_bits": False, "error": repr(exc)[:300]}
            rows.append(row)
            print(
                name,
                t,
                f"floor {row['floor_us']:.1f}",
                " ".join(
                    f"{v} {row[v]['us']:.1f}{'' if row[v]['same_bits'] else ' BITS!'}"
                    for v in variants
                ),
                flush=True,
            )
            if args.kernels:
                for v in variants:
                    print("   ", v, row[v].get("kernels_us") or row[v].get("error"), flush=True)
            with open(os.path.join(args.out, "experts_variants.json"), "w") as f:
                json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
