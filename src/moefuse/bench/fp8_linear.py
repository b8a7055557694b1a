"""Block-scaled FP8 linear layers (:func:`moefuse.fp8_linear`) against torch's.

    python -m moefuse bench fp8-linear [--save] [--out DIR] [--quick]
                                       [--tiles 64x128x4 tma128x128x8x4 ...]

At the projection shapes of Qwen3-30B-A3B and DeepSeek-V3 (N x K of the weight) and M = 1 ..
8,192 rows: random E4M3 codes with FP32 128 x 128 block scales and the BF16 weight they
dequantize to; BF16 activations.

* checks first: a row alone == the same row inside the batch (bits), and at M <= 256 the
  relative RMS difference from the FP64 reference of the formula;
* CUDA-graph µs (inputs rotated over 4 sets, weights over copies of the same values until they
  span twice the L2, :func:`weight_copies`) of ``fp8_linear`` ("moefuse"), BF16 ``torch.mm``
  on the dequantized weight ("bf16_mm") and ``F.scaled_mm`` with block-wise scales (1 x 128
  activation groups, 128 x 128 weight blocks: the same recipe) where it runs, else row-wise
  ("scaled_mm_block" / "scaled_mm_row"; the activation quantization is not timed);
* the floor: weight codes and scales over this GPU's datasheet bandwidth (and over the copy
  ceiling of this run); BAR lines for the issue's bars.

Writes ``fp8-linear-<gpu>.json`` and ``.png`` with ``--save``.
"""

from __future__ import annotations

import argparse

import torch
from triton.runtime.errors import OutOfResources

from moefuse.bench.harness import (
    bandwidth_line,
    copy_ceiling_tbs,
    datasheet_gpu,
    graph_time_us,
    print_table,
    run_metadata,
    save_results,
)

#: (N, K) of the weights
SHAPES = {
    "qwen3_q_proj": (4096, 2048),
    "qwen3_o_proj": (2048, 4096),
    "qwen3_kv_proj": (512, 2048),
    "dsv3_q_b_proj": (24576, 1536),
    "dsv3_kv_b_proj": (32768, 512),
    "dsv3_o_proj": (7168, 16384),
    "dsv3_mlp_down": (7168, 18432),
}
ROWS = (1, 4, 16, 64, 256, 2048, 8192)
BIG_WEIGHT = 32 << 20


def make_weight(n: int, k: int, device, seed: int = 0):
    """(E4M3 codes [N, K], FP32 block scales, the BF16 weight they dequantize to)."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = (torch.randn(n, k, generator=g, device=device) * 64).to(torch.float8_e4m3fn)
    s = (torch.rand(-(-n // 128), -(-k // 128), generator=g, device=device) + 1) / (128 * k**0.5)
    full = s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return q, s, (q.float() * full).to(torch.bfloat16)


def weight_copies(weight_bytes: int, l2_bytes: int) -> int:
    """Copies of a weight the timed calls rotate over so that their weights span at least twice
    the L2 (at most 8): a replayed call then reads its weight from DRAM, as a layer does between
    other layers' weights, not from the L2 the previous call filled."""
    return max(1, min(8, -(-2 * l2_bytes // max(1, weight_bytes))))


def l2_bytes(device) -> int:
    """This GPU's L2 size (50 MiB where torch does not say: an H100's)."""
    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)


def scaled_mm_fn(x, wq, ws, wbf):
    """``(fn, recipe)``: ``F.scaled_mm`` block-wise where it runs, else row-wise; ``(None,
    reason)`` when neither does. The activation is quantized outside the timed call."""
    import torch.nn.functional as F

    import moefuse

    st = getattr(F, "ScalingType", None)
    if st is None:
        return None, "this torch has no F.scaled_mm"
    errors = []
    xq, xs = moefuse.per_token_group_quant_8bit(x, 128)
    wr = wbf.float().abs().amax(1).clamp_min(1e-12) / 448
    wrq = (wbf.float() / wr[:, None]).to(torch.float8_e4m3fn)
    xr = x.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / 448
    xrq = (x.float() / xr).to(torch.float8_e4m3fn)
    cands = {
        # cuBLAS wants the activation's group scales outer-dim major
        "block": lambda: F.scaled_mm(
            xq,
            wq.t(),
            xs.t().contiguous().t(),
            st.BlockWise1x128,
            ws,
            st.BlockWise128x128,
            output_dtype=torch.bfloat16,
        ),
        "row": lambda: F.scaled_mm(
            xrq, wrq.t(), xr, st.RowWise, wr[None, :], st.RowWise, output_dtype=torch.bfloat16
        ),
    }
    for recipe, fn in cands.items():
        try:
            fn()
            torch.cuda.synchronize()
            return fn, recipe
        except Exception as exc:  # noqa: BLE001 (reported, not fatal)
            errors.append(f"{recipe}: {type(exc).__name__}: {str(exc)[:120]}")
    return None, "; ".join(errors)


def parse_tile(text: str) -> dict:
    """``[tma|wgmma]BNxBTxWARPS[xSTAGES]`` -> a ``launch_fp8_linear`` tile override (one launch:
    the chunks summed in registers; ``tma``: the tokens on the MMA's M side, TMA loads,
    :mod:`moefuse.moe.linear_tma`; ``wgmma``: the same with each block's MMA in flight while
    the block before is scaled, :mod:`moefuse.moe.linear_wgmma`); or ``fused`` / ``reduce``:
    the default launch (PDL on) with the split programs' chunk sums added by each tile's last
    program / by a kernel of their own (tile key ``fused_reduce``)."""
    if text in ("fused", "reduce"):
        return {"fused_reduce": text == "fused", "pdl": True}
    wgmma = text.startswith("wgmma")
    tma = wgmma or text.startswith("tma")
    try:
        parts = [int(p) for p in text.removeprefix("wgmma").removeprefix("tma").split("x")]
    except ValueError:
        parts = []
    if len(parts) not in (3, 4):
        raise argparse.ArgumentTypeError(f"tile {text!r}: [tma|wgmma]BNxBTxWARPS[xSTAGES]")
    tile = {"bn": parts[0], "bt": parts[1], "warps": parts[2], "split_programs": False}
    if len(parts) == 4:
        tile["stages"] = parts[3]
    if tma:
        tile["tma"] = True
    if wgmma:
        tile["wgmma"] = True
    return tile


def tile_name(tile: dict) -> str:
    if "bn" not in tile:
        return "fused" if tile["fused_reduce"] else "reduce"
    kind = "wgmma" if tile.get("wgmma") else "tma" if tile.get("tma") else ""
    name = kind + f"{tile['bn']}x{tile['bt']}x{tile['warps']}"
    return name + (f"x{tile['stages']}" if "stages" in tile else "")


def tile_fn(x0, want, wq, ws, tile):
    """The launch with ``tile`` as ``run(x, (wq, ws, ...))``, checked bitwise against the
    default's output ``want`` first (no bit may depend on the tile)."""
    from moefuse.moe.linear_triton import launch_fp8_linear

    pdl = bool(tile.get("pdl"))
    tile = {k: v for k, v in tile.items() if k != "pdl"}

    def run(x, w=(wq, ws)):
        out = torch.empty(x.shape[0], w[0].shape[0], dtype=x.dtype, device=x.device)
        launch_fp8_linear(x, w[0], w[1], None, None, out, pdl, tile=tile)
        return out

    if not torch.equal(run(x0).view(torch.int16), want.view(torch.int16)):
        raise AssertionError(f"fp8_linear tile {tile_name(tile)} changed the bits")
    return run


def prefetch_fn(x0, want, wq, ws, nbytes: int):
    """The default launch (PDL on) with each program's first ``nbytes`` of every weight row
    requested from the L2 before its ``gdc_wait``, as ``run(x, (wq, ws, ...))``, checked
    bitwise against ``want`` first."""
    from moefuse.moe.linear_triton import launch_fp8_linear

    def run(x, w=(wq, ws)):
        out = torch.empty(x.shape[0], w[0].shape[0], dtype=x.dtype, device=x.device)
        launch_fp8_linear(x, w[0], w[1], None, None, out, True, tile={"prefetch": nbytes})
        return out

    if not torch.equal(run(x0).view(torch.int16), want.view(torch.int16)):
        raise AssertionError(f"fp8_linear prefetch {nbytes} changed the bits")
    return run


def bench_shape(name, n, k, rows_list, args, device, ceiling) -> list[dict]:
    import moefuse

    wq, ws, wbf = make_weight(n, k, device)
    nbytes = wq.numel() + ws.numel() * 4
    copies = [(wq, ws, wbf)] + [
        (wq.clone(), ws.clone(), wbf.clone())
        for _ in range(weight_copies(nbytes, l2_bytes(device)) - 1)
    ]
    sheet = datasheet_gpu()
    floor = nbytes / (sheet[1] * 1e12) * 1e6 if sheet else None
    floor_copy = nbytes / (ceiling * 1e12) * 1e6
    g = torch.Generator(device=device).manual_seed(1)
    rows = []
    notes = set()
    for m in rows_list:
        sets = [torch.randn(m, k, generator=g, device=device).to(torch.bfloat16) for _ in range(4)]
        x0 = sets[0]
        got = moefuse.fp8_linear(x0, wq, ws)
        j = m // 2
        invariant = bool(
            torch.equal(
                moefuse.fp8_linear(x0[j : j + 1], wq, ws)[0].view(torch.int16),
                got[j].view(torch.int16),
            )
        )
        errs = {}
        if m <= 256:
            want = moefuse.fp8_linear(x0, wq, ws, impl="reference").float()
            errs["reference"] = float((got.float() - want).norm() / want.norm())
        variants = {  # f(x, c): on the weight's copy c
            "moefuse": lambda x, c: moefuse.fp8_linear(x, copies[c][0], copies[c][1]),
            "bf16_mm": lambda x, c: x @ copies[c][2].t(),
        }
        for request in args.prefetch:  # (not ``nbytes``: the weight's bytes, used below)
            run = prefetch_fn(x0, got, wq, ws, request)
            variants[f"prefetch_{request}"] = lambda x, c, r=run: r(x, copies[c])
        for tile in args.tiles:
            try:
                run = tile_fn(x0, got, wq, ws, tile)
                variants[f"tile_{tile_name(tile)}"] = lambda x, c, r=run: r(x, copies[c])
            except OutOfResources as exc:  # a tile that does not fit is reported
                notes.add(f"tile {tile_name(tile)}: {str(exc)[:80]}")
        fn, recipe = scaled_mm_fn(x0, wq, ws, wbf)
        if fn is not None:  # one call per copy (the activation's quantization is not timed)
            fns = [fn] + [scaled_mm_fn(x0, *c)[0] for c in copies[1:]]
            variants[f"scaled_mm_{recipe}"] = lambda x, c, f=fns: f[c]()
        else:
            notes.add(f"scaled_mm: {recipe}")
        flops_us = 2 * m * n * k / 1e12  # µs at 1 PFLOP/s (for the call count only)
        calls = int(max(3, min(20, 20000 / (3 * max(floor_copy, flops_us) + 20))))
        times = {
            v: graph_time_us(
                lambda i, f=f, s=sets: f(s[i % 4], i % len(copies)),
                calls=calls,
                replays=args.replays,
            )
            for v, f in variants.items()
        }
        torch_times = {v: us for v, us in times.items() if v == "bf16_mm" or "scaled_mm" in v}
        best_torch = min(torch_times.values())
        for v, us in times.items():
            row = {
                "op": "fp8_linear",
                "shape": f"{name} N{n} K{k}",
                "M": m,
                "variant": v,
                "us": us,
                "weight_bytes": nbytes,
                "weight_copies": len(copies),
                "floor_us": floor,
                "x_floor": us / floor if floor else None,
                "floor_copy_us": floor_copy,
                "x_floor_copy": us / floor_copy,
            }
            if v == "moefuse":
                row.update(
                    rel_err=errs,
                    batch_invariant=invariant,
                    x_best_torch=best_torch / us,
                    **{f"x_{b}": times[b] / us for b in times if b != "moefuse"},
                )
            rows.append(row)
        print_table(
            [r for r in rows if r["M"] == m], ["shape", "M", "variant", "us", "floor_us", "x_floor"]
        )
    for note in sorted(notes):
        print(f"{name}: {note}")
        for r in rows:
            r.setdefault("scaled_mm_note", note)
    return rows


def bar_lines(rows: list[dict]) -> list[str]:
    lines = []
    ours = [r for r in rows if r["variant"] == "moefuse"]
    for r in ours:
        if r["M"] <= 16 and r["weight_bytes"] >= BIG_WEIGHT and r["x_floor"] is not None:
            ok = r["x_floor"] <= 1.3
            lines.append(
                f"BAR {'PASS' if ok else 'FAIL'} fp8_linear M={r['M']} {r['shape']}: "
                f"{r['x_floor']:.2f} x floor <= 1.3"
            )
        elif r["M"] <= 16:
            ok = r.get("x_bf16_mm", 0) >= 1.0
            lines.append(
                f"BAR {'PASS' if ok else 'FAIL'} fp8_linear M={r['M']} {r['shape']} (under 32 MiB):"
                f" {r.get('x_bf16_mm', float('nan')):.2f} x bf16 torch.mm >= 1.0"
            )
        if r["M"] >= 2048:
            ok = r["x_best_torch"] >= 1.0
            lines.append(
                f"BAR {'PASS' if ok else 'FAIL'} fp8_linear M={r['M']} {r['shape']}: "
                f"{r['x_best_torch']:.2f} x the best of scaled_mm / bf16 mm >= 1.0"
            )
    inv = all(r["batch_invariant"] for r in ours)
    lines.append(f"BAR {'PASS' if inv else 'FAIL'} fp8_linear bitwise batch invariance")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--save", action="store_true", help="write JSON + PNG under --out")
    p.add_argument("--out", default="bench/results", help="results directory")
    p.add_argument("--quick", action="store_true", help="M in 1, 16, 2048 only; fewer replays")
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    p.add_argument("--replays", type=int, default=8)
    p.add_argument(
        "--prefetch",
        type=int,
        nargs="+",
        default=[],
        help="also time the default launch with these bytes of each weight row requested from "
        "the L2 before the kernel's gdc_wait (checked bitwise first)",
    )
    p.add_argument(
        "--tiles",
        type=parse_tile,
        nargs="+",
        default=[],
        help="also time these one-launch tiles, [tma|wgmma]BNxBTxWARPS[xSTAGES], or `fused` / "
        "`reduce` (the default launch, its split programs' chunk sums added by each tile's last "
        "program / by a kernel of their own); each checked bitwise against the default first",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.replays = [1, 16, 2048], 5
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("fp8-linear: needs a CUDA GPU")
        return 1
    device = torch.device("cuda")
    ceiling = copy_ceiling_tbs()
    print(bandwidth_line(ceiling))
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        rows += bench_shape(name, n, k, args.rows, args, device, ceiling)
        if args.save:
            save(rows, ceiling, args)
    print_table(
        [r for r in rows if r["variant"] == "moefuse"],
        ["shape", "M", "us", "floor_us", "x_floor", "x_bf16_mm", "x_best_torch", "batch_invariant"],
    )
    for line in bar_lines(rows):
        print(line)
    return 0


def save(rows, ceiling, args) -> None:
    meta = run_metadata()
    sheet = datasheet_gpu()
    meta.update(
        copy_ceiling_tbs=ceiling,
        datasheet_tbs=sheet[1] if sheet else None,
        datasheet_gpu=sheet[0] if sheet else "unknown",
        floor="bytes of the weight's E4M3 codes and FP32 block scales / this GPU's datasheet "
        "bandwidth; x_floor_copy: over the copy ceiling measured in this run",
        baseline_note="bf16_mm: x @ W.t() on the dequantized BF16 weight; scaled_mm_*: "
        "F.scaled_mm on pre-quantized activations (block-wise or row-wise scales)",
        bars=bar_lines(rows),
    )
    json_path, png_path = save_results("fp8-linear", rows, meta, args.out)
    print(f"wrote {json_path}" + (f" and {png_path}" if png_path else ""))


if __name__ == "__main__":
    raise SystemExit(main())
