"""Launch variants of the FP8 routed experts at the Qwen3, Mixtral and DeepSeek-V3 shapes (the
launcher's ``tile`` overrides) against the default, CUDA-graph µs, and whether each variant's
output is bitwise the default's: at decode (T = 1, 4, 16) where the two group quantizations run,
at many tokens (T = 2,048, 8,192) the ``tma`` launches, with BF16 moefuse beside them.

    python scripts/bench_fp8_decode_variants.py warm [--jobs N]    compile every variant (parallel)
    python scripts/bench_fp8_decode_variants.py time [--out FILE]  time them (one process)

(``--variants NAME ...`` on both: only these, with ``base``.)

``warm`` runs each (shape, variant) once per token count in its own process (16 experts for
the 128- and 256-expert shapes: the kernels' compile keys do not depend on E, the token tile is
the one of the real E), so that ``time`` finds every kernel in Triton's cache. ``time`` goes
token count first (T = 1 for every shape before T = 4) and appends one JSON line per point to
``--out``. ``base`` is the default (:func:`moefuse.moe.tiles.experts_fp8_decode_tile`), timed
again last; ``sa`` both quantizations by their own launches; ``tq`` the tokens quantized per
K-block inside the gate|up programs, the activation by its own launch; ``tq_fq`` with the
activation quantized by the gate|up kernel's last programs (counters zeroed by a memset);
``tq_dq`` / ``dq`` the activation quantized per K-block inside the down programs, the tokens in
gate|up or by their own launch; ``pf`` every gate|up and down program requests its weight rows
from the L2 before its ``gdc_wait``, ``pf2`` that and the gate|up kernel launches its dependents
right after its wait, ``pf2_fq`` that with the activation quantized by the gate|up kernel,
``pf512_2`` as ``pf2`` with the first 512 bytes of each row only; ``pfd`` each gate|up program
asks the L2 for its slice of its expert's down weights after its products (the down kernel,
next, reads them from there); ``tma*`` the GEMMs with the
tokens on the MMA's M side and the weight tiles by TMA (:mod:`moefuse.moe.experts_fp8_tma`):
gate|up 64 rows and down 128 rows at 8 warps, 3 or 4 stages; 32 / 64 rows at 4 warps; 128 / 128
rows; ``tma_bt64*`` work items of 64 slots at 4 warps (token-tile factor 0.5); ``tma64*`` the same
at a fixed token tile of 64 (the table's second field: a factor of the default's token tile up to
1, a fixed tile above); ``*pd*`` the down tiles (``gpd``: the gate|up tiles) on a persistent
grid of 1 or 2 programs per SM; ``tma_dec`` the decode points on the 64-slot TMA launches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

TOKENS = (1, 4, 16)
LARGE = (2048, 8192)
MANY = (512, 1024, 2048, 4096)
MID = (64, 128, 256)
SHAPE_NAMES = ("qwen3", "mixtral", "deepseek_v3")
_ROW = 1 << 20  # prefetch: every weight row whole
_OFF = {"fuse_tokens_quant": False, "fuse_act_quant": False, "down_act_quant": False}
_TMA = {"tma": True, "bn_gate_up": 64, "bn_down": 128, "warps": 8}
_TMA64 = {"tma": True, "bn_gate_up": 128, "bn_down": 128, "warps": 4, "fuse_act_quant": True}
#: name -> (tile overrides, token-tile factor, token counts it runs at)
VARIANTS = {
    "base": ({}, 1, TOKENS + tuple(sorted(set(LARGE + MANY + MID)))),
    "sa": (_OFF, 1, TOKENS),
    "tq": ({**_OFF, "fuse_tokens_quant": True}, 1, TOKENS),
    "tq_fq": ({**_OFF, "fuse_tokens_quant": True, "fuse_act_quant": True}, 1, TOKENS),
    "tq_dq": ({**_OFF, "fuse_tokens_quant": True, "down_act_quant": True}, 1, TOKENS),
    "dq": ({**_OFF, "down_act_quant": True}, 1, TOKENS),
    "pf": ({"prefetch": _ROW}, 1, TOKENS),
    "pf2": ({"prefetch": _ROW, "early_dependents": True}, 1, TOKENS),
    "pf2_fq": ({"prefetch": _ROW, "early_dependents": True, "fuse_act_quant": True}, 1, TOKENS),
    "pf512_2": ({"prefetch": 512, "early_dependents": True}, 1, TOKENS),
    "pfd": ({"prefetch_down": True}, 1, TOKENS),
    "pf2_fq_st8": (
        {"prefetch": _ROW, "early_dependents": True, "fuse_act_quant": True, "stages": 8},
        1,
        (1,),
    ),
    "tq_dq_st4": (
        {**_OFF, "fuse_tokens_quant": True, "down_act_quant": True, "stages": 4, "down_stages": 4},
        1,
        (1, 4),
    ),
    # many tokens: the pointer kernels (moefuse.moe.tiles.EXPERTS_FP8_NARROW), and the tokens on
    # the MMA's M side with weight tiles by TMA (moefuse.moe.experts_fp8_tma)
    "pointer": ({"tma": False, "bn_gate_up": 32, "bn_down": 64, "warps": 4, "stages": 4}, 1, LARGE),
    "tma": ({**_TMA, "stages": 3}, 1, LARGE),
    "tma_s4": ({**_TMA, "stages": 4}, 1, LARGE),
    "tma_w4": ({**_TMA, "bn_gate_up": 32, "bn_down": 64, "warps": 4, "stages": 4}, 1, LARGE),
    "tma_gu128": ({**_TMA, "bn_gate_up": 128, "stages": 3}, 1, LARGE),
    "tma_gu128_s4": ({**_TMA, "bn_gate_up": 128, "stages": 4}, 1, LARGE),
    # the gate|up programs quantize the activation's 128-channel groups in registers
    "tma_gu128_fq": ({**_TMA, "bn_gate_up": 128, "stages": 3, "fuse_act_quant": True}, 1, LARGE),
    # 64 slots per work item at 4 warps (one warpgroup): two programs per SM that need not run
    # in step, so one program's MMA can run under the other's block scaling
    "tma_bt64": ({**_TMA64, "stages": 2, "down_stages": 3}, 0.5, LARGE),
    "tma_bt64_d4": ({**_TMA64, "stages": 2, "down_stages": 4}, 0.5, LARGE),
    "tma_bt64_gu64": (
        {**_TMA64, "bn_gate_up": 64, "fuse_act_quant": False, "stages": 3, "down_stages": 3},
        0.5,
        LARGE,
    ),
    # the same launches at a fixed token tile of 64 slots, from 512 slots per call (where the
    # default runs the pointer kernels at 32-64 columns or the 128-slot TMA items)
    "tma64_d4": ({**_TMA64, "stages": 2, "down_stages": 4}, 64, (*MID, *MANY, 8192)),
    "tma64_gu64": (
        {**_TMA64, "bn_gate_up": 64, "fuse_act_quant": False, "stages": 3, "down_stages": 3},
        64,
        MANY,
    ),
    # decode on the TMA launches: the weight tiles streamed by TMA (slots on M, mostly empty
    # rows), the plan kernel and the finalize as launches of their own
    "tma_dec": (
        {**_TMA64, "bn_down": 64, "stages": 4, "down_stages": 6}
        | {"inline_plan_slots": 0, "fuse_finalize_slots": 0},
        64,
        TOKENS,
    ),
    # the down tiles on a persistent grid, the tile loop flattened into the K loop
    "tma_pd1": ({"down_persistent": 1}, 1, MANY),
    "tma_gpd1": ({"gate_up_persistent": 1}, 1, MANY),
    "tma_pd1_gpd1": ({"down_persistent": 1, "gate_up_persistent": 1}, 1, MANY),
    "tma64_gu64_pd2": (
        {**_TMA64, "bn_gate_up": 64, "fuse_act_quant": False, "stages": 3, "down_stages": 3}
        | {"down_persistent": 2},
        64,
        MANY,
    ),
    "tma64_gu64_d4": (
        {**_TMA64, "bn_gate_up": 64, "fuse_act_quant": False, "stages": 3, "down_stages": 4},
        64,
        (*MID, *MANY, 8192),
    ),
    # the down GEMM in Gluon (moefuse.moe.experts_fp8_wgmma): block b's MMA in flight while
    # block b - 1 is scaled; on the default's tiles, and with 3 / 4 down stages
    "wgd": ({"down_wgmma": True}, 1, (*MID, *MANY, 8192)),
    "wgd_d3": ({"down_wgmma": True, "down_stages": 3}, 1, (*MID, *MANY, 8192)),
    "wgd_d4": ({"down_wgmma": True, "down_stages": 4}, 1, (*MID, *MANY, 8192)),
}


def _shape(name):
    from moefuse.bench.experts_setup import SHAPES

    return SHAPES[name]


def variant_args(name, variant, t, experts=None):
    """(tile, token_tile) of ``variant`` at T = t for shape ``name`` (token tile of the real E)."""
    from moefuse.moe.tiles import experts_fp8_tile, experts_fp8_token_tile

    shape = _shape(name)
    tile, factor, _ = VARIANTS[variant]
    slots = t * shape["top_k"]
    bt = experts_fp8_token_tile(slots, shape["experts"])
    tile = dict(tile)
    if tile.get("down_stages", 0) is None:  # the gate|up stages alone: the down kernel's default
        tile["down_stages"] = experts_fp8_tile(shape["hidden"], shape["inter"], bt, slots)["stages"]
    if factor > 1:  # a fixed token tile
        return tile, factor
    return tile, min(128, int(bt * factor))


def call(x, idx, w, fp8, tile, bt, out=None):
    from moefuse.moe.experts_fp8 import launch_moe_experts_fp8

    gq, gs, dq, ds = fp8
    out = torch.empty_like(x) if out is None else out
    launch_moe_experts_fp8(
        x, gq, gs, dq, ds, idx, w, out, None, None, 1.0, False, True, tile=tile, token_tile=bt
    )
    return out


def warm_one(name, variant) -> None:
    from moefuse.bench.experts_setup import make_routing

    shape = dict(_shape(name))
    e_real = shape["experts"]
    shape["experts"] = min(e_real, 16)
    dev = torch.device("cuda")
    h, i, e = shape["hidden"], shape["inter"], shape["experts"]
    gq = torch.zeros(e, 2 * i, h, dtype=torch.float8_e4m3fn, device=dev)
    gs = torch.ones(e, -(-2 * i // 128), -(-h // 128), device=dev)
    dq = torch.zeros(e, h, i, dtype=torch.float8_e4m3fn, device=dev)
    ds = torch.ones(e, -(-h // 128), -(-i // 128), device=dev)
    for t in VARIANTS[variant][2]:
        x, idx, w = make_routing(t, shape, dev, seed=t)
        tile, bt = variant_args(name, variant, t)
        t0 = time.time()
        call(x, idx, w, (gq, gs, dq, ds), tile, bt)
        torch.cuda.synchronize()
        print(f"warm {name} {variant} T={t} bt={bt} {time.time() - t0:.1f}s", flush=True)
    if variant == "base":  # the BF16 experts at one token (the bar's baseline)
        import moefuse

        x, idx, w = make_routing(1, shape, dev, seed=1)
        gb = torch.zeros(e, 2 * i, h, dtype=torch.bfloat16, device=dev)
        db = torch.zeros(e, h, i, dtype=torch.bfloat16, device=dev)
        moefuse.moe_experts(x, gb, db, idx, w)
        torch.cuda.synchronize()


def warm(args) -> int:
    jobs = [(n, v) for n in SHAPE_NAMES for v in args.variants]
    running, failed = [], 0
    t0 = time.time()
    while jobs or running:
        while jobs and len(running) < args.jobs:
            n, v = jobs.pop(0)
            cmd = [sys.executable, __file__, "warm-one", n, v]
            running.append((n, v, subprocess.Popen(cmd)))
        time.sleep(0.2)
        for job in list(running):
            if job[2].poll() is not None:
                running.remove(job)
                if job[2].returncode:
                    failed += 1
                    print(f"warm FAILED {job[0]} {job[1]} rc={job[2].returncode}", flush=True)
    print(f"warm done in {time.time() - t0:.0f}s, {failed} failed", flush=True)
    return 0


def timing(args) -> int:
    import moefuse
    from moefuse.bench.experts_setup import make_routing
    from moefuse.bench.harness import datasheet_gpu, graph_time_us
    from moefuse.bench.moe_experts_fp8 import make_fp8_weights

    dev = torch.device("cuda")
    sheet = datasheet_gpu()
    tbs = sheet[1] if sheet else 3.35
    print(f"GPU {torch.cuda.get_device_name(0)} datasheet {tbs} TB/s", flush=True)
    weights = {}
    for n in args.shapes:
        gq, gs, dq, ds, gb, db = make_fp8_weights(_shape(n), dev)
        weights[n] = ((gq, gs, dq, ds), (gb, db))
        per_expert = gq[0].numel() + dq[0].numel() + 4 * (gs[0].numel() + ds[0].numel())
        weights[n] += (per_expert,)
    torch.cuda.synchronize()
    out = open(args.out, "a") if args.out else None
    for t in args.tokens:
        for n in args.shapes:
            shape = _shape(n)
            fp8, bf16, per_expert = weights[n]
            sets = [make_routing(t, shape, dev, seed=1000 * t + s) for s in range(8)]
            distinct = statistics.mean(len(torch.unique(i)) for _, i, _ in sets)
            floor = distinct * per_expert / (tbs * 1e12) * 1e6
            calls = int(max(3, min(20, 20000 / (3 * floor + 20))))
            x0, i0, w0 = sets[0]
            ref = None
            names = [v for v in ["base", *args.variants] if t in VARIANTS[v][2]]
            names = list(dict.fromkeys(names))
            results = {}
            for v in names + ["base"]:  # base again last: the drift of the run
                tile, bt = variant_args(n, v, t)
                got = call(x0, i0, w0, fp8, tile, bt)
                if ref is None:
                    ref = got
                same = bool(torch.equal(got.view(torch.int16), ref.view(torch.int16)))
                fns = [lambda s=s, tl=tile, b=bt: call(*s, fp8, tl, b) for s in sets]
                us = graph_time_us(lambda k, f=fns: f[k % len(f)](), calls=calls, replays=10)
                key = v if v not in results else "base_again"
                results[key] = us
                row = {
                    "shape": n,
                    "T": t,
                    "variant": key,
                    "us": round(us, 2),
                    "bt": bt,
                    "tile": tile,
                    "floor_us": round(floor, 2),
                    "x_floor": round(us / floor, 3),
                    "bitwise_base": same,
                }
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                print(
                    f"{n:12s} T={t:4d} {key:12s} bt={bt:3d} {us:9.1f} us  x floor "
                    f"{us / floor:5.2f}  bits==base {same}",
                    flush=True,
                )
            if t == 1 or t in LARGE or t in MANY:
                gb, db = bf16
                fns = [lambda s=s: moefuse.moe_experts(s[0], gb, db, s[1], s[2]) for s in sets]
                us = graph_time_us(lambda k, f=fns: f[k % len(f)](), calls=calls, replays=10)
                best = min(results.values())
                print(
                    f"{n:12s} T={t:4d} {'bf16':12s}        {us:9.1f} us  x fp8-best "
                    f"{us / best:5.2f} x fp8-base {us / results['base']:5.2f}",
                    flush=True,
                )
                if out:
                    row = {"shape": n, "T": t, "variant": "bf16_moefuse", "us": round(us, 2)}
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warm")
    w.add_argument("--jobs", type=int, default=12)
    w.add_argument("--variants", nargs="+", default=list(VARIANTS))
    one = sub.add_parser("warm-one")
    one.add_argument("shape")
    one.add_argument("variant")
    tm = sub.add_parser("time")
    tm.add_argument("--out")
    tm.add_argument("--shapes", nargs="+", default=list(SHAPE_NAMES))
    tm.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    tm.add_argument("--variants", nargs="+", default=list(VARIANTS))
    args = p.parse_args(argv)
    if args.cmd == "warm":
        return warm(args)
    if args.cmd == "warm-one":
        warm_one(args.shape, args.variant)
        return 0
    return timing(args)


if __name__ == "__main__":
    raise SystemExit(main())
