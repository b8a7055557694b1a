"""GPU probe of the FP8 kernels: checks, then CUDA-graph µs of tile variants.

    PYTHONPATH=src python scripts/probe_fp8.py experts [--shapes ..] [--tokens ..] [--variants JSON]
    PYTHONPATH=src python scripts/probe_fp8.py linear [--shapes ..] [--rows ..] [--variants JSON]

``experts``: per shape, FP8 weights block-quantized from random FP32 ones (one expert at a time),
BF16 weights dequantized from them (moefuse BF16 experts: the baseline of the bars); per T the
default policy against the FP64 reference (relative RMS, T <= 64), every variant's bits against
the default's, a token alone against batches of 64 and 256, then CUDA-graph µs (routing rotated
over 8 sets) of each variant and of BF16 ``moe_experts``; per-kernel µs of one eager call at the
first T. ``linear``: the same for ``fp8_linear`` at (N, K) projection shapes against BF16
``torch.mm`` and ``F.scaled_mm`` where it runs. Variants are JSON ``{"name": {tile keys}}``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import moefuse
from moefuse.bench.experts_setup import SHAPES, kernel_times, make_routing
from moefuse.bench.harness import bandwidth_line, copy_ceiling_tbs, datasheet_gpu, graph_time_us
from moefuse.moe import reference_fp8 as r8
from moefuse.moe.experts_fp8 import launch_moe_experts_fp8
from moefuse.moe.linear_triton import launch_fp8_linear

LINEAR_SHAPES = {  # (N, K) of the projections
    "qwen3_q": (4096, 2048),
    "qwen3_o": (2048, 4096),
    "dsv3_q_b": (24576, 1536),
    "dsv3_o": (7168, 16384),
    "dsv3_mlp_gate_up": (36864, 7168),
    "dsv3_mlp_down": (7168, 18432),
}


def fp8_experts(shape, device, seed=0):
    """FP8 weights and scales, and BF16 weights dequantized from them, one expert at a time."""
    g = torch.Generator(device=device).manual_seed(seed)
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    out = {}
    for name, (n, k) in (("gu", (2 * i, h)), ("dn", (h, i))):
        q = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=device)
        s = torch.empty(e, r8.cdiv(n, 128), r8.cdiv(k, 128), device=device)
        bf = torch.empty(e, n, k, dtype=torch.bfloat16, device=device)
        for j in range(e):
            w = torch.randn(n, k, generator=g, device=device) * k**-0.5
            q[j], s[j] = r8.quantize_weight_blocks(w)
            bf[j] = r8.dequantize_weight_f64(q[j], s[j]).to(torch.bfloat16)
        out[name] = (q, s, bf)
    return out


def active(variants: dict, size: int) -> dict:
    """The variants that run at this token / row count: a variant's ``"at"`` list names its
    sizes (every size without one); the tile keys without ``"at"``."""
    return {
        name: {k: v for k, v in tile.items() if k != "at"}
        for name, tile in variants.items()
        if size in tile.get("at", [size])
    }


def bits_equal(a, b):
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def experts(args, device, sheet, ceiling):
    variants = json.loads(args.variants) if args.variants else {}
    for name in args.shapes:
        shape = SHAPES[name]
        w = fp8_experts(shape, device)
        gq, gs, gbf = w["gu"]
        dq, ds, dbf = w["dn"]
        per_expert = 3 * shape["hidden"] * shape["inter"]
        scale_bytes = (gs[0].numel() + ds[0].numel()) * 4

        def fp8(x, idx, wt, tile=None, token_tile=None):
            out = torch.empty_like(x)
            tile = dict(tile or {})
            token_tile = tile.pop("bt", token_tile)
            launch_moe_experts_fp8(
                x, gq, gs, dq, ds, idx, wt, out, None, None, 1.0, False, True,
                tile=tile, token_tile=token_tile,
            )  # fmt: skip
            return out

        # invariance: a token alone == in batches of 64 and 256
        x, idx, wt = make_routing(256, shape, device, seed=99)
        full, b64 = fp8(x, idx, wt), fp8(x[:64], idx[:64], wt[:64])
        inv = all(
            bits_equal(fp8(x[j : j + 1], idx[j : j + 1], wt[j : j + 1])[0], b[j])
            for j in (0, 17, 63)
            for b in (b64, full)
        )
        print(f"{name}: batch invariant (alone vs 64 / 256): {inv}")
        for t in args.tokens:
            sets = [make_routing(t, shape, device, seed=1000 * t + s) for s in range(8)]
            distinct = statistics.mean(len(torch.unique(i)) for _, i, _ in sets)
            nbytes = distinct * (per_expert + scale_bytes)
            floor = nbytes / (sheet[1] * 1e12) * 1e6 if sheet else float("nan")
            x0, i0, w0 = sets[0]
            base = fp8(x0, i0, w0)
            line = f"{name} T={t} distinct={distinct:.1f} floor={floor:.1f}us"
            if t <= 64:
                want = moefuse.moe_experts(
                    x0, gq, dq, i0, w0, gate_up_proj_scale_inv=gs, down_proj_scale_inv=ds,
                    impl="reference",
                ).float()  # fmt: skip
                line += f" relrms={float((base.float() - want).norm() / want.norm()):.2e}"
            same = {}
            here = active(variants, t)
            for v, c in here.items():
                try:
                    same[v] = bits_equal(fp8(x0, i0, w0, tile=c), base)
                except Exception as exc:  # noqa: BLE001 (a variant that does not build)
                    same[v] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
            line += f" bits={same}"
            print(line, flush=True)
            calls = int(max(3, min(20, 20000 / (3 * floor + 20))))
            times = {"fp8": graph_time_us(lambda i, s=sets: fp8(*s[i % 8]), calls=calls)}
            for v, c in here.items():
                if same[v] in (True, False):
                    times[v] = graph_time_us(
                        lambda i, s=sets, c=c: fp8(*s[i % 8], tile=c), calls=calls
                    )
            times["bf16"] = graph_time_us(
                lambda i, s=sets: moefuse.moe_experts(
                    s[i % 8][0], gbf, dbf, s[i % 8][1], s[i % 8][2]
                ),
                calls=calls,
            )
            cols = "  ".join(f"{k} {v:.1f}" for k, v in times.items())
            print(f"  us: {cols}  x_floor {times['fp8'] / floor:.2f}  "
                  f"bf16/fp8 {times['bf16'] / times['fp8']:.2f}", flush=True)  # fmt: skip
            if t <= 16:
                k = kernel_times(lambda: fp8(x0, i0, w0), device)
                print("  kernels:", {n[:40]: round(u, 1) for n, u in list(k.items())[:6]})


def scaled_mm_fn(x, wbf, wq, ws):
    """F.scaled_mm, block-wise (1x128 activation, 128x128 weight) where it runs, else row-wise;
    returns (fn, recipe) or (None, reason)."""
    import torch.nn.functional as F

    st = getattr(F, "ScalingType", None)
    if st is None:
        return None, "no F.scaled_mm"
    m, k = x.shape
    xq, xs = moefuse.per_token_group_quant_8bit(x, 128)
    errors = []
    for recipe in ("block", "row"):
        try:
            if recipe == "block":

                def fn(xq=xq, xs=xs):
                    return F.scaled_mm(
                        xq,
                        wq.t(),
                        xs.t().contiguous().t(),
                        st.BlockWise1x128,
                        ws,
                        st.BlockWise128x128,
                        output_dtype=torch.bfloat16,
                    )
            else:
                wr = wbf.float().abs().amax(1, keepdim=True) / 448
                wrq = (wbf.float() / wr).to(torch.float8_e4m3fn)
                xr = x.float().abs().amax(1, keepdim=True).clamp_min(1e-10) / 448
                xrq = (x.float() / xr).to(torch.float8_e4m3fn)

                def fn(xrq=xrq, xr=xr, wrq=wrq, wr=wr):
                    return F.scaled_mm(xrq, wrq.t(), xr, st.RowWise, wr.t(), st.RowWise,
                                       output_dtype=torch.bfloat16)  # fmt: skip

            fn()
            torch.cuda.synchronize()
            return fn, recipe
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{recipe}: {type(exc).__name__}: {str(exc)[:120]}")
    return None, "; ".join(errors)


def linear(args, device, sheet, ceiling):
    variants = json.loads(args.variants) if args.variants else {}
    g = torch.Generator(device=device).manual_seed(0)
    for name in args.shapes:
        n, k = LINEAR_SHAPES[name]
        w = torch.randn(n, k, generator=g, device=device) * k**-0.5
        wq, ws = r8.quantize_weight_blocks(w)
        wbf = r8.dequantize_weight_f64(wq, ws).to(torch.bfloat16)
        del w
        nbytes = wq.numel() + ws.numel() * 4
        for m in args.rows:
            sets = [torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
                    for _ in range(4)]  # fmt: skip

            def run(x, tile=None):
                out = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=device)
                launch_fp8_linear(x, wq, ws, None, None, out, True, tile=tile)
                return out

            floor = nbytes / (sheet[1] * 1e12) * 1e6 if sheet else float("nan")
            flop_floor = 2 * m * n * k / 989e12 * 1e6
            base = run(sets[0])
            line = f"{name} N={n} K={k} M={m} floor={floor:.1f}us"
            if m <= 256:
                want = moefuse.fp8_linear(sets[0], wq, ws, impl="reference").float()
                line += f" relrms={float((base.float() - want).norm() / want.norm()):.2e}"
                j = min(1, m - 1)
                one = run(sets[0][j : j + 1])
                line += f" alone==batch {bits_equal(one[0], base[j])}"
            same = {}
            here = active(variants, m)
            for v, c in here.items():
                try:
                    same[v] = bits_equal(run(sets[0], tile=c), base)
                except Exception as exc:  # noqa: BLE001 (a variant that does not build)
                    same[v] = f"failed: {type(exc).__name__}: {str(exc)[:80]}"
            print(line + f" bits={same}", flush=True)
            calls = int(max(3, min(20, 20000 / (3 * max(floor, flop_floor) + 20))))
            times = {"fp8": graph_time_us(lambda i: run(sets[i % 4]), calls=calls)}
            for v, c in here.items():
                if same[v] in (True, False):
                    times[v] = graph_time_us(lambda i, c=c: run(sets[i % 4], tile=c), calls=calls)
            times["bf16_mm"] = graph_time_us(lambda i: sets[i % 4] @ wbf.t(), calls=calls)
            fn, recipe = scaled_mm_fn(sets[0], wbf, wq, ws)
            if fn is not None:
                times[f"scaled_mm_{recipe}"] = graph_time_us(lambda i: fn(), calls=calls)
            else:
                print(f"  scaled_mm: {recipe}")
            cols = "  ".join(f"{kk} {v:.1f}" for kk, v in times.items())
            print(f"  us: {cols}  x_floor {times['fp8'] / floor:.2f}", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("experts", "linear"))
    p.add_argument("--shapes", nargs="+")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 2048])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 2048, 8192])
    p.add_argument("--variants", default="")
    args = p.parse_args()
    device = torch.device("cuda")
    sheet = datasheet_gpu()
    ceiling = copy_ceiling_tbs()
    print(bandwidth_line(ceiling), flush=True)
    if args.what == "experts":
        args.shapes = args.shapes or list(SHAPES)
        experts(args, device, sheet, ceiling)
    else:
        args.shapes = args.shapes or list(LINEAR_SHAPES)
        linear(args, device, sheet, ceiling)


if __name__ == "__main__":
    main()
