"""``python -m moefuse bench quant``: FP8 / NVFP4 quantizers and the fused RMSNorm + quant ops
against PyTorch eager and ``torch.compile`` of the same math (norm, then quantize), with the SM copy
ceiling measured in the same run; CUDA-graph replays, median µs.

Bytes counted per element (the minimum each op must move): fp8_quantize 2 + 1; fp4_quantize
2 + 0.5 + 1/16 (packed codes and E4M3 scales); rmsnorm_quant 2 + 1; fused_add_rmsnorm_quant
4 read + 2 + 1 written; rmsnorm_fp4_quantize 2 + 0.5625; fused_add_rmsnorm_fp4_quantize
4 + 2 + 0.5625 (weights, scales and padding bytes are negligible and not counted).

Bar: at M >= 2048, H = 4096 the fused norm + quant ops reach >= 0.85 x the copy ceiling
and >= 1.5 x torch.compile of norm-then-quantize; the run prints PASS/FAIL per case.
``--sweep`` additionally times the fused kernels under alternative row tiles (rows per program,
warps) to pick the tile policy from measurements.
"""

from __future__ import annotations

import argparse

import torch

import moefuse
from moefuse.bench import harness, quant_group
from moefuse.quant import formats as F
from moefuse.quant import reference as ref

TOKENS = [1, 2048, 16384]
WIDTHS = [4096]
EPS = 1e-6
DEV = "cuda"  # the benchmark runs on the current CUDA device
E4M3 = torch.float8_e4m3fn
BYTES_PER_ELEM = {
    "fp8_quantize": 3.0,
    "fp4_quantize": 2.5625,
    "rmsnorm_quant": 3.0,
    "fused_add_rmsnorm_quant": 7.0,
    "rmsnorm_fp4_quantize": 2.5625,
    "fused_add_rmsnorm_fp4_quantize": 6.5625,
}
FUSED = (
    "rmsnorm_quant",
    "fused_add_rmsnorm_quant",
    "rmsnorm_fp4_quantize",
    "fused_add_rmsnorm_fp4_quantize",
)
_R6 = F.R6
_THRESHOLDS = (
    (0.25, True),
    (0.75, False),
    (1.25, True),
    (1.75, False),
    (2.5, True),
    (3.5, False),
    (5.0, True),
)


# ----------------------------------------------------------------------------- PyTorch math
def torch_fp8(v32, inv):
    return (v32 * inv).clamp(-448.0, 448.0).to(E4M3)


def torch_nvfp4(y, gs):
    """NVFP4 in plain PyTorch ("fast" recipe with IEEE reciprocals, SWIZZLED_128x4 scales)."""
    m, h = y.shape
    b = y.float().reshape(m, h // 16, 16)
    a = b.abs()
    sf = (gs * (a.amax(-1) * _R6)).clamp(max=448.0).to(E4M3)
    s = sf.float()
    os = torch.where(s == 0, torch.zeros_like(s), 1.0 / (s * (1.0 / gs)))
    q = a * os.unsqueeze(-1)
    code = torch.zeros_like(q, dtype=torch.uint8)
    for t, strict in _THRESHOLDS:
        code = code + (q > t if strict else q >= t).to(torch.uint8)
    nib = (code | (b < 0).to(torch.uint8) * 8).reshape(m, h)
    packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
    kb = h // 16
    rows, kp = -(-m // 128) * 128, -(-kb // 4) * 4
    pad = torch.nn.functional.pad(sf.view(torch.uint8), (0, kp - kb, 0, rows - m))
    scales = pad.reshape(rows // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4).reshape(rows, kp)
    return packed, scales


def _norm32(x32, w, eps=EPS):
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def torch_rmsnorm_quant(x, w, inv):
    return torch_fp8(_norm32(x.float(), w), inv)


def torch_fused_add_rmsnorm_quant(x, r, w, inv):
    h = x.float() + r.float()
    return torch_fp8(_norm32(h, w), inv), h.to(r.dtype)


def torch_rmsnorm_fp4(x, w, gs):
    return torch_nvfp4(_norm32(x.float(), w).to(x.dtype), gs)


def torch_fused_add_rmsnorm_fp4(x, r, w, gs):
    h = x.float() + r.float()
    return torch_nvfp4(_norm32(h, w).to(x.dtype), gs), h.to(r.dtype)


def torch_fp8_quantize(x, inv):
    return torch_fp8(x.float(), inv)


def torch_fp4_quantize(x, gs):
    return torch_nvfp4(x, gs)


TORCH_FNS = {
    "fp8_quantize": torch_fp8_quantize,
    "fp4_quantize": torch_fp4_quantize,
    "rmsnorm_quant": torch_rmsnorm_quant,
    "fused_add_rmsnorm_quant": torch_fused_add_rmsnorm_quant,
    "rmsnorm_fp4_quantize": torch_rmsnorm_fp4,
    "fused_add_rmsnorm_fp4_quantize": torch_fused_add_rmsnorm_fp4,
}


# ----------------------------------------------------------------------------- cases
def _make_outs(op: str, m: int, h: int) -> tuple:
    """One set of ``op``'s output buffers: (packed, scales) for NVFP4, (q,) for FP8."""
    if "fp4" in op:
        return (
            torch.empty(m, h // 2, dtype=torch.uint8, device=DEV),
            torch.empty(moefuse.scale_shape(m, h), dtype=torch.uint8, device=DEV),
        )
    return (torch.empty(m, h, dtype=E4M3, device=DEV),)


def _make_sets(op: str, m: int, h: int, n_sets: int):
    """Per-rotation inputs: (x, r, outputs...) with fixed weight/scale tensors shared."""
    sets = []
    for _ in range(n_sets):
        x = torch.randn(m, h, device=DEV).to(torch.bfloat16)
        r = torch.randn(m, h, device=DEV).to(torch.bfloat16) if "add" in op else None
        sets.append((x, r, *_make_outs(op, m, h)))
    return sets


def _moefuse_fn(op: str, w, scale, gs, pdl: bool):
    if op == "fp8_quantize":
        return lambda s: moefuse.fp8_quantize(s[0], scale, out=s[2], enable_pdl=pdl, impl="triton")
    if op == "fp4_quantize":
        return lambda s: moefuse.fp4_quantize(
            s[0], gs, out=s[2], scale_out=s[3], enable_pdl=pdl, impl="triton"
        )
    if op == "rmsnorm_quant":
        return lambda s: moefuse.rmsnorm_quant(
            s[0], w, scale, out=s[2], enable_pdl=pdl, impl="triton"
        )
    if op == "fused_add_rmsnorm_quant":
        return lambda s: moefuse.fused_add_rmsnorm_quant(
            s[0], s[1], w, scale, out=s[2], enable_pdl=pdl, impl="triton"
        )
    if op == "rmsnorm_fp4_quantize":
        return lambda s: moefuse.rmsnorm_fp4_quantize(
            s[0], w, gs, out=s[2], scale_out=s[3], enable_pdl=pdl, impl="triton"
        )
    return lambda s: moefuse.fused_add_rmsnorm_fp4_quantize(
        s[0], s[1], w, gs, out=s[2], scale_out=s[3], enable_pdl=pdl, impl="triton"
    )


def _torch_call(op: str, fn, w, inv, gs):
    if op == "fp8_quantize":
        return lambda s: fn(s[0], inv)
    if op == "fp4_quantize":
        return lambda s: fn(s[0], gs)
    arg = gs if "fp4" in op else inv
    if "add" in op:
        return lambda s: fn(s[0], s[1], w, arg)
    return lambda s: fn(s[0], w, arg)


def _unfused_moefuse(op: str, w, scale, gs):
    """moefuse's own two-kernel path (norm, then the standalone quantizer) for the fused ops."""
    if op == "rmsnorm_quant":
        return lambda s: moefuse.fp8_quantize(
            moefuse.rmsnorm(s[0], w, impl="triton"), scale, out=s[2], impl="triton"
        )
    if op == "rmsnorm_fp4_quantize":
        return lambda s: moefuse.fp4_quantize(
            moefuse.rmsnorm(s[0], w, impl="triton"), gs, out=s[2], scale_out=s[3], impl="triton"
        )
    return None


def _check(op: str, s, w, scale, gs) -> None:
    """moefuse against the reference on the first input set (before timing mutates anything)."""
    x, r = s[0], (s[1].clone() if s[1] is not None else None)
    if op == "fp8_quantize":
        got = moefuse.fp8_quantize(x, scale, impl="triton")
        assert torch.equal(
            got.view(torch.uint8), ref.fp8_quantize_reference(x, scale).view(torch.uint8)
        ), op
    elif op == "fp4_quantize":
        p, sc = moefuse.fp4_quantize(x, gs, recipe="ieee", impl="triton")
        ep, es = ref.fp4_quantize_reference(x, gs, recipe="ieee")
        assert torch.equal(p, ep) and torch.equal(sc, es), op
        tp, ts = torch_nvfp4(x, gs)
        assert torch.equal(ts, es), "torch baseline scales"
    elif op in ("rmsnorm_quant", "fused_add_rmsnorm_quant"):
        if r is None:
            got = moefuse.rmsnorm_quant(x, w, scale, impl="triton")
            exp = ref.rmsnorm_quant_reference(x, w, scale)
        else:
            got = moefuse.fused_add_rmsnorm_quant(x, r, w, scale, impl="triton")
            exp, res = ref.fused_add_rmsnorm_quant_reference(x, s[1], w, scale)
            assert torch.equal(r, res), f"{op} residual"
        d = F.fp8_code_distance(got, exp)
        assert int(d.max()) <= 1 and (d > 0).float().mean().item() < 1e-3, op
    else:
        y = torch.empty_like(x)
        if r is None:
            p, sc = moefuse.rmsnorm_fp4_quantize(x, w, gs, norm_out=y, recipe="ieee", impl="triton")
        else:
            p, sc = moefuse.fused_add_rmsnorm_fp4_quantize(
                x, r, w, gs, norm_out=y, recipe="ieee", impl="triton"
            )
        ep, es = ref.fp4_quantize_reference(y, gs, recipe="ieee")
        assert torch.equal(p, ep) and torch.equal(sc, es), op


def _time(fn, sets) -> float:
    n = len(sets)
    return harness.graph_time_us(lambda i: fn(sets[i % n]), calls=max(20, n))


def _tile_fn(op: str, tile, w, scale, gs):
    """The fused launcher of ``op`` with an explicit tile (PDL on)."""
    from moefuse.quant import fused as qf

    if "fp4" in op:
        res = "add" in op
        return lambda s: qf.launch_rmsnorm_fp4(
            s[0],
            s[1] if res else None,
            w,
            gs,
            s[2],
            s[3],
            None,
            EPS,
            0.0,
            "swizzled_128x4",
            "fast",
            True,
            tile=tile,
        )
    return lambda s: qf.launch_rmsnorm_fp8(
        s[0], None, w, scale, s[2].view(torch.uint8), 0, EPS, 0.0, True, tile=tile
    )


def _sweep(widths, tokens, ceiling) -> list[dict]:
    """Time the fused kernels under alternative tiles (rows per program x warps)."""
    from moefuse.norm.tiles import RowTile
    from moefuse.quant import fused as qf

    rows_out = []
    for h in widths:
        w = torch.randn(h, device=DEV).to(torch.bfloat16)
        scale, gs = torch.tensor([0.02], device=DEV), torch.tensor([300.0], device=DEV)
        for m in tokens:
            for op in ("rmsnorm_quant", "rmsnorm_fp4_quantize", "fused_add_rmsnorm_fp4_quantize"):
                # the op's own tile (the label's "default"); alternatives keep its block
                base = (
                    qf.quant_fp4_row_tile(h, "add" in op) if "fp4" in op else qf.quant_row_tile(h)
                )
                nbytes = int(BYTES_PER_ELEM[op] * m * h)
                sets = _make_sets(op, m, h, harness.rotation_sets(nbytes))
                line = []
                for rows in (1, 2, 4):
                    for warps in (4, 8, 16):
                        if base.num_chunks > 1 and rows > 1:
                            continue
                        tile = RowTile(base.block, base.num_chunks, rows, warps)
                        us = _time(_tile_fn(op, tile, w, scale, gs), sets)
                        tbs = nbytes / (us * 1e-6) / 1e12
                        rows_out.append(
                            {
                                "op": op,
                                "shape": f"H={h}",
                                "M": m,
                                "variant": f"sweep r{rows}w{warps}",
                                "us": us,
                                "tbs": tbs,
                                "frac_ceiling": tbs / ceiling,
                            }
                        )
                        line.append(f"r{rows}w{warps} {us:7.2f}us {tbs:.2f}")
                print(
                    f"sweep {op:30s} H={h} M={m:6d} (default r{base.rows}w{base.num_warps}) | "
                    + " | ".join(line)
                )
    return rows_out


def _case_times(op: str, m: int, h: int, w, scale, inv, gs, compiled_fn) -> tuple[int, dict]:
    """``(bytes moved, {variant: median us})`` of one case: checked against the reference first,
    then moefuse's variants, the eager and compiled torch baselines and the same-bytes copy."""
    nbytes = int(BYTES_PER_ELEM[op] * m * h)
    sets = _make_sets(op, m, h, harness.rotation_sets(nbytes))
    _check(op, sets[0], w, scale, gs)
    # outputs: one fixed set per case, like compile's graph-pool outputs (norm.py's
    # docstring); moefuse_rot_out writes one output set per input set instead
    fixed = _make_outs(op, m, h)
    fixed_sets = [(x, r, *fixed) for x, r, *_ in sets]
    mf = {
        "moefuse": _moefuse_fn(op, w, scale, gs, True),
        "moefuse_nopdl": _moefuse_fn(op, w, scale, gs, False),
    }
    unfused = _unfused_moefuse(op, w, scale, gs)
    if unfused is not None:
        mf["moefuse_unfused"] = unfused
    times = {name: _time(fn, fixed_sets) for name, fn in mf.items()}
    times["moefuse_rot_out"] = _time(mf["moefuse"], sets)
    baselines = {
        "eager": _torch_call(op, TORCH_FNS[op], w, inv, gs),
        "compile": _torch_call(op, compiled_fn, w, inv, gs),
    }
    times.update({name: _time(fn, sets) for name, fn in baselines.items()})
    times["sm_copy"] = harness.copy_time_us(nbytes)
    return nbytes, times


def _print_bar(verdicts: list[dict]) -> None:
    """One PASS / FAIL line per fused case of the bar."""
    print(
        "\nbar (M >= 2048, H = 4096: >= 0.85 x ceiling [rotating outputs] and >= 1.5 x "
        "torch.compile [fixed outputs, like compile's]):"
    )
    for v in verdicts:
        print(
            f"  {'PASS' if v['pass'] else 'FAIL'} {v['op']:31s} M={v['M']:6d} "
            f"{v['frac_ceiling']:.2f} x ceiling ({v['frac_ceiling_fixed_outputs']:.2f} fixed)  "
            f"{v['x_compile']:.2f} x compile  "
            f"{v['x_copy_same_bytes']:.2f} x same-bytes copy"
        )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moefuse bench quant")
    parser.add_argument("--save", action="store_true", help="write JSON + PNG under --out")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--quick", action="store_true", help="M in {2048, 16384}, H = 4096")
    parser.add_argument("--ops", default="", help="comma-separated subset of ops")
    parser.add_argument("--widths", default="", help="comma-separated H values (default 4096)")
    parser.add_argument("--sweep", action="store_true", help="also time alternative row tiles")
    parser.add_argument(
        "--tokens", default="", help="comma-separated M values (per-token-group ops only)"
    )
    args = parser.parse_args(argv)

    tokens = [2048, 16384] if args.quick else TOKENS
    widths = [int(v) for v in args.widths.split(",")] if args.widths else WIDTHS
    ops = [o for o in BYTES_PER_ELEM if not args.ops or o in args.ops.split(",")]
    group_ops = [o for o in quant_group.OPS if not args.ops or o in args.ops.split(",")]
    ceiling = harness.copy_ceiling_tbs()
    print(f"SM copy ceiling: {ceiling:.2f} TB/s")
    if group_ops:
        _group_main(args, group_ops, ceiling)
    if not ops:
        return 0
    rows, compiled, verdicts = [], {}, []
    for op in ops:
        if op not in compiled:
            compiled[op] = harness.compile_baseline(TORCH_FNS[op])
        for h in widths:
            w = torch.randn(h, device=DEV).to(torch.bfloat16)
            scale = torch.tensor([0.02], device=DEV)
            inv = 1.0 / scale
            gs = torch.tensor([448.0 * 6.0 / 5.0], device=DEV)
            for m in tokens:
                nbytes, times = _case_times(op, m, h, w, scale, inv, gs, compiled[op])
                for name, us in times.items():
                    tbs = nbytes / (us * 1e-6) / 1e12
                    rows.append(
                        {
                            "op": op,
                            "shape": f"H={h}",
                            "M": m,
                            "variant": name,
                            "us": us,
                            "tbs": tbs,
                            "frac_ceiling": tbs / ceiling,
                            "x_compile": times["compile"] / us,
                            "x_eager": times["eager"] / us,
                            "x_copy_same_bytes": times["sm_copy"] / us,
                        }
                    )
                best = min(times["moefuse"], times["moefuse_nopdl"])
                # the ceiling fraction from the rotating outputs (DRAM writes of every output,
                # the conservative reading); x compile from the fixed ones (compile's policy)
                frac = nbytes / (times["moefuse_rot_out"] * 1e-6) / 1e12 / ceiling
                frac_fixed = nbytes / (best * 1e-6) / 1e12 / ceiling
                x_comp = times["compile"] / best
                x_copy = times["sm_copy"] / times["moefuse_rot_out"]
                print(
                    f"{op:31s} H={h:5d} M={m:6d} "
                    + "  ".join(f"{k}={v:8.2f}us" for k, v in times.items())
                    + f"  | moefuse {frac:.2f} x ceiling ({frac_fixed:.2f} fixed outputs),"
                    f" {x_comp:.2f} x compile, {x_copy:.2f} x same-bytes copy"
                )
                if op in FUSED and m >= 2048 and h == 4096:
                    ok = frac >= 0.85 and x_comp >= 1.5
                    verdicts.append(
                        {
                            "op": op,
                            "M": m,
                            "H": h,
                            "frac_ceiling": frac,
                            "frac_ceiling_fixed_outputs": frac_fixed,
                            "x_compile": x_comp,
                            "x_copy_same_bytes": x_copy,
                            "pass": ok,
                        }
                    )
    if args.sweep:
        rows += _sweep(widths, [t for t in tokens if t >= 2048] or tokens, ceiling)
    _print_bar(verdicts)
    meta = harness.run_metadata()
    meta.update(
        ceiling_tbs=ceiling,
        bytes_per_element=BYTES_PER_ELEM,
        bar=verdicts,
        ceiling_method="best Triton SM copy kernel over 1 GiB, CUDA-graph replay",
        outputs="inputs rotate over sets > L2; moefuse / moefuse_nopdl / moefuse_unfused "
        "write one fixed output set per case (like compile's graph pool); "
        "moefuse_rot_out one output set per input set",
    )
    if args.save:
        paths = harness.save_results("quant", rows, meta, args.out)
        print("wrote", *[str(p) for p in paths if p])
    return 0


def _group_main(args, ops, ceiling) -> None:
    """The per-token-group ops (:mod:`moefuse.bench.quant_group`), saved as ``quant-group``."""
    widths = [int(v) for v in args.widths.split(",")] if args.widths else quant_group.WIDTHS
    tokens = [int(v) for v in args.tokens.split(",")] if args.tokens else quant_group.TOKENS
    rows, verdicts = quant_group.run(ops, widths, tokens, ceiling)
    if args.sweep:
        rows += quant_group.sweep(ops, widths, tokens)
    quant_group.print_bars(verdicts)
    meta = harness.run_metadata()
    meta.update(
        ceiling_tbs=ceiling,
        bytes_per_element=quant_group.BYTES_PER_ELEM,
        bars=verdicts,
        ceiling_method="best Triton SM copy kernel over 1 GiB, CUDA-graph replay",
        baseline="torch.compile of the unfused chain, M dynamic, H static",
        outputs="inputs rotate over sets > L2; moefuse / moefuse_unfused write one fixed output "
        "set per case (like compile's graph pool); moefuse_rot_out one output set per input set",
    )
    if args.save:
        paths = harness.save_results("quant-group", rows, meta, args.out)
        print("wrote", *[str(p) for p in paths if p])
