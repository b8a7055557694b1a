"""``python -m moefuse bench norm``: the RMSNorm family against PyTorch eager, torch.compile of the
same math, and an SM copy (the bandwidth ceiling), all timed as CUDA-graph replays in one run.

Bytes counted (the minimum each op must move, elements x bytes): rmsnorm 2+2, fused_add 4+4,
gated_residual 2+4 read + 4 written, gated_residual_next 2+4 read + 4+2 written, sigmoid gate
2+2 read + 2 written (per element; weights and gains are negligible).

Output buffers. Inputs rotate over sets larger than L2. torch.compile's (and eager's) outputs come
from the CUDA graph's memory pool, at one fixed address for every call of a case, as an engine's
graph gives them. So ``moefuse`` writes to one fixed output per case too (ops with output
arguments: rmsnorm, the gated ops). ``moefuse_rot_out`` keeps one output per input set, the method
used before 2026-11-30. At sizes whose outputs fit in L2 next to the streamed inputs, a fixed
output is rewritten while still dirty in L2 and costs fewer DRAM writes. That is why compile beat
an SM copy of the same bytes at 1024 x 4096 (notes/gpu-logs/probe-output-policy-2026-11-30.log).
The in-place ops (fused_add_rmsnorm, the sigmoid gate) write into their rotating inputs, as their
API requires, while ``compile`` writes to fixed pool outputs. For them ``compile_inplace`` is the
like-for-like baseline: torch.compile of the same math written back into the inputs
(``x.copy_(...)``, fused by inductor into its kernel), i.e. the semantics of the moefuse and
FlashInfer calls; rows carry ``x_compile_inplace`` beside ``x_compile``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import torch

import moefuse
from moefuse.bench import harness
from moefuse.testing import assert_close

TOKENS = [1, 16, 128, 1024, 2048, 16384]
WIDTHS = [4096, 8192]
HEAD_DIMS = [64, 128]
HEADS = 32
EPS = 1e-6


# ----------------------------------------------------------------------------- unfused PyTorch math
def _inv_rms(x32, eps):
    return torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def torch_rmsnorm(x, w):
    x32 = x.float()
    return (x32 * _inv_rms(x32, EPS) * w.float()).to(x.dtype)


def torch_fused_add_rmsnorm(x, r, w):
    h = x.float() + r.float()
    return (h * _inv_rms(h, EPS) * w.float()).to(x.dtype), h.to(r.dtype)


def torch_gated_residual_rmsnorm(b, r, alpha, beta):
    x = b.float()
    return alpha * r + beta * (x * _inv_rms(x, EPS))


def torch_gated_residual_next_rmsnorm(b, r, nw, alpha, beta):
    x = b.float()
    ro = alpha * r + (beta * x) * _inv_rms(x, EPS)
    return ro, (ro * _inv_rms(ro, EPS) * nw.float()).to(b.dtype)


def torch_rmsnorm_sigmoid_gate(x, g):
    x32 = x.float()
    return (x32 * _inv_rms(x32, 1e-5) * torch.sigmoid(g.float())).to(x.dtype)


def torch_fused_add_rmsnorm_inplace(x, r, w):
    """The in-place semantics of fused_add_rmsnorm: x <- normed, r <- residual out."""
    normed, h = torch_fused_add_rmsnorm(x, r, w)
    x.copy_(normed)
    r.copy_(h)


def torch_rmsnorm_sigmoid_gate_inplace(x, g):
    x.copy_(torch_rmsnorm_sigmoid_gate(x, g))


#: in-place ops -> their in-place PyTorch math (compiled as the like-for-like baseline)
INPLACE_MATH = {
    "fused_add_rmsnorm": torch_fused_add_rmsnorm_inplace,
    "rmsnorm_sigmoid_gate": torch_rmsnorm_sigmoid_gate_inplace,
}


# ----------------------------------------------------------------------------- cases
#: ops with output arguments -> index of the first output buffer in an input set (outputs last)
OUTPUTS_FROM = {"rmsnorm": 2, "gated_residual_rmsnorm": 4, "gated_residual_next_rmsnorm": 5}


@dataclass
class Case:
    op: str
    shape: str
    m: int
    bytes: int
    sets: list = field(default_factory=list)  # per-rotation input tuples
    fixed_out: tuple = ()  # one output buffer set shared by every call (ops with outputs)


def _make_case(op: str, m: int, h: int, head_dim: int | None) -> tuple[Case, dict]:
    dev, bf = "cuda", torch.bfloat16
    per_elem = {
        "rmsnorm": 4,
        "fused_add_rmsnorm": 8,
        "gated_residual_rmsnorm": 10,
        "gated_residual_next_rmsnorm": 12,
        "rmsnorm_sigmoid_gate": 6,
    }[op]
    width = HEADS * head_dim if head_dim else h
    nbytes = per_elem * m * width
    case = Case(op, f"{HEADS}x{head_dim}" if head_dim else f"H={h}", m, nbytes)
    w = torch.randn(h, device=dev).to(bf)
    alpha, beta = torch.rand(h, device=dev), torch.rand(h, device=dev)
    for _ in range(harness.rotation_sets(nbytes)):
        if op == "rmsnorm":
            x = torch.randn(m, h, device=dev).to(bf)
            case.sets.append((x, w, torch.empty_like(x)))
        elif op == "fused_add_rmsnorm":
            case.sets.append(
                (torch.randn(m, h, device=dev).to(bf), torch.randn(m, h, device=dev).to(bf), w)
            )
        elif op == "gated_residual_rmsnorm":
            case.sets.append(
                (
                    torch.randn(m, h, device=dev).to(bf),
                    torch.randn(m, h, device=dev),
                    alpha,
                    beta,
                    torch.empty(m, h, device=dev),
                )
            )
        elif op == "gated_residual_next_rmsnorm":
            case.sets.append(
                (
                    torch.randn(m, h, device=dev).to(bf),
                    torch.randn(m, h, device=dev),
                    w,
                    alpha,
                    beta,
                    torch.empty(m, h, device=dev),
                    torch.empty(m, h, device=dev, dtype=bf),
                )
            )
        else:
            case.sets.append(
                (
                    torch.randn(m, HEADS, head_dim, device=dev).to(bf),
                    torch.randn(m, HEADS, head_dim, device=dev).to(bf),
                )
            )
    if op in OUTPUTS_FROM:  # the output buffers end each set: one more set of them, shared
        case.fixed_out = tuple(torch.empty_like(t) for t in case.sets[0][OUTPUTS_FROM[op] :])
    return case, {}


def _variants(op: str, compiled: dict, fixed_out: tuple):
    """name -> fn(set) for moefuse (PDL on / off; outputs at a fixed address, and rotating with
    the inputs when the op has outputs), eager and compiled PyTorch."""

    def fused(pdl, fixed):
        if op == "rmsnorm":
            return lambda s: moefuse.rmsnorm(
                s[0], s[1], out=fixed[0] if fixed else s[2], enable_pdl=pdl, impl="triton"
            )
        if op == "fused_add_rmsnorm":
            return lambda s: moefuse.fused_add_rmsnorm(*s, enable_pdl=pdl, impl="triton")
        if op == "gated_residual_rmsnorm":
            return lambda s: moefuse.gated_residual_rmsnorm(
                s[0],
                s[1],
                None,
                s[2],
                s[3],
                out=fixed[0] if fixed else s[4],
                enable_pdl=pdl,
                impl="triton",
            )
        if op == "gated_residual_next_rmsnorm":
            return lambda s: moefuse.gated_residual_next_rmsnorm(
                s[0],
                s[1],
                s[2],
                s[3],
                s[4],
                residual_out=fixed[0] if fixed else s[5],
                ffn_input=fixed[1] if fixed else s[6],
                enable_pdl=pdl,
                impl="triton",
            )
        return lambda s: moefuse.rmsnorm_sigmoid_gate(s[0], s[1], enable_pdl=pdl, impl="triton")

    torch_fn = {
        "rmsnorm": lambda s: torch_rmsnorm(s[0], s[1]),
        "fused_add_rmsnorm": lambda s: torch_fused_add_rmsnorm(*s),
        "gated_residual_rmsnorm": lambda s: torch_gated_residual_rmsnorm(s[0], s[1], s[2], s[3]),
        "gated_residual_next_rmsnorm": lambda s: torch_gated_residual_next_rmsnorm(*s[:5]),
        "rmsnorm_sigmoid_gate": lambda s: torch_rmsnorm_sigmoid_gate(s[0], s[1]),
    }[op]
    if op not in compiled:
        raw = {
            "rmsnorm": torch_rmsnorm,
            "fused_add_rmsnorm": torch_fused_add_rmsnorm,
            "gated_residual_rmsnorm": torch_gated_residual_rmsnorm,
            "gated_residual_next_rmsnorm": torch_gated_residual_next_rmsnorm,
            "rmsnorm_sigmoid_gate": torch_rmsnorm_sigmoid_gate,
        }[op]
        compiled[op] = harness.compile_baseline(raw)
    comp = compiled[op]
    comp_fn = {
        "rmsnorm": lambda s: comp(s[0], s[1]),
        "fused_add_rmsnorm": lambda s: comp(*s),
        "gated_residual_rmsnorm": lambda s: comp(s[0], s[1], s[2], s[3]),
        "gated_residual_next_rmsnorm": lambda s: comp(*s[:5]),
        "rmsnorm_sigmoid_gate": lambda s: comp(s[0], s[1]),
    }[op]
    # "moefuse" is the default PDL choice (enable_pdl=None resolves to the family's measured
    # default: on; the gated ops' own default True resolves the same way)
    variants = {"moefuse": fused(None, fixed_out), "moefuse_nopdl": fused(False, fixed_out)}
    if fixed_out:
        variants["moefuse_rot_out"] = fused(None, None)
    variants.update(eager=torch_fn, compile=comp_fn)
    if op in INPLACE_MATH:
        key = op + "_inplace"
        if key not in compiled:
            compiled[key] = harness.compile_baseline(INPLACE_MATH[op])
        comp_in = compiled[key]
        variants["compile_inplace"] = lambda s: comp_in(*s)
    return variants


def pdl_default_bars(rows: list[dict]) -> list[dict]:
    """The PDL bar: the default ``enable_pdl`` ("moefuse") at least as fast as PDL off
    ("moefuse_nopdl") at every case, with 2% allowed for timing noise; one line per op giving
    the worst case's ratio nopdl / default."""
    by = {(r["op"], r["shape"], r["M"], r["variant"]): r["us"] for r in rows}
    worst: dict[str, tuple[float, str]] = {}
    for (op, shape, m, variant), us in by.items():
        off = by.get((op, shape, m, "moefuse_nopdl"))
        if variant != "moefuse" or not us or not off:
            continue
        ratio = off / us
        if op not in worst or ratio < worst[op][0]:
            worst[op] = (ratio, f"{shape} M={m}")
    return [
        {
            "bar": f"{op}: PDL default >= off at every case (2% noise; worst {where})",
            "value": ratio,
            "ok": ratio >= 0.98,
        }
        for op, (ratio, where) in worst.items()
    ]


def _check(op: str, s) -> None:
    """moefuse against the eager math on the first input set (before timing mutates anything)."""
    c = [t.clone() for t in s]
    if op == "rmsnorm":
        moefuse.rmsnorm(c[0], c[1], out=c[2], impl="triton")
        assert_close(c[2], torch_rmsnorm(s[0], s[1]), "rsqrt_half", op)
    elif op == "fused_add_rmsnorm":
        moefuse.fused_add_rmsnorm(*c, impl="triton")
        normed, res = torch_fused_add_rmsnorm(*s)
        assert_close(c[0], normed, "rsqrt_half", op)
        assert_close(c[1], res, "exact", op)
    elif op == "gated_residual_rmsnorm":
        out = moefuse.gated_residual_rmsnorm(c[0], c[1], None, c[2], c[3], impl="triton")
        assert_close(out, torch_gated_residual_rmsnorm(*s[:4]), "fp32_stream", op)
    elif op == "gated_residual_next_rmsnorm":
        ro, _ = moefuse.gated_residual_next_rmsnorm(*c[:5], impl="triton")
        assert_close(ro, torch_gated_residual_next_rmsnorm(*s[:5])[0], "fp32_stream", op)
    else:
        moefuse.rmsnorm_sigmoid_gate(c[0], c[1], impl="triton")
        assert_close(c[0], torch_rmsnorm_sigmoid_gate(s[0], s[1]), "sigmoid_fast", op)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moefuse bench norm")
    parser.add_argument("--save", action="store_true", help="write JSON + PNG under --out")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--quick", action="store_true", help="M in {1, 2048}, H = 4096 only")
    parser.add_argument("--ops", default="", help="comma-separated subset of ops")
    args = parser.parse_args(argv)

    tokens = [1, 2048] if args.quick else TOKENS
    widths = [4096] if args.quick else WIDTHS
    ops = [
        "rmsnorm",
        "fused_add_rmsnorm",
        "gated_residual_rmsnorm",
        "gated_residual_next_rmsnorm",
        "rmsnorm_sigmoid_gate",
    ]
    if args.ops:
        ops = [o for o in ops if o in args.ops.split(",")]
    ceiling = harness.copy_ceiling_tbs()
    print(f"SM copy ceiling: {ceiling:.2f} TB/s")
    rows, compiled = [], {}
    for op in ops:
        shapes = (
            [(None, d) for d in HEAD_DIMS]
            if op == "rmsnorm_sigmoid_gate"
            else [(h, None) for h in widths]
        )
        for h, d in shapes:
            for m in tokens:
                case, _ = _make_case(op, m, h or 0, d)
                _check(op, case.sets[0])
                n = len(case.sets)
                times = {}
                for name, fn in _variants(op, compiled, case.fixed_out).items():
                    times[name] = harness.graph_time_us(
                        lambda i, fn=fn, sets=case.sets, n=n: fn(sets[i % n]), calls=max(20, n)
                    )
                times["sm_copy"] = harness.copy_time_us(case.bytes)
                for name, us in times.items():
                    tbs = case.bytes / (us * 1e-6) / 1e12
                    row = {
                        "op": op,
                        "shape": case.shape,
                        "M": m,
                        "variant": name,
                        "us": us,
                        "tbs": tbs,
                        "frac_ceiling": tbs / ceiling,
                        "x_compile": times["compile"] / us,
                        "x_eager": times["eager"] / us,
                        "x_copy_same_bytes": times["sm_copy"] / us,
                    }
                    if "compile_inplace" in times:
                        row["x_compile_inplace"] = times["compile_inplace"] / us
                    rows.append(row)
                inplace = (
                    f"  x_compile_inplace={times['compile_inplace'] / times['moefuse']:.2f}"
                    if "compile_inplace" in times
                    else ""
                )
                print(
                    f"{op:28s} {case.shape:8s} M={m:6d} "
                    + "  ".join(f"{k}={v:8.2f}us" for k, v in times.items())
                    + f"  moefuse {case.bytes / times['moefuse'] / 1e6:.2f} TB/s"
                    f"  x_compile={times['compile'] / times['moefuse']:.2f}{inplace}"
                    f"  x_copy={times['sm_copy'] / times['moefuse']:.2f}"
                )
    meta = harness.run_metadata()
    meta["bars"] = pdl_default_bars(rows)
    for b in meta["bars"]:
        print(f"{'PASS' if b['ok'] else 'FAIL'}  {b['bar']}  ({b['value']:.3g})")
    meta["ceiling_tbs"] = ceiling
    meta["ceiling_method"] = "Triton SM copy kernel of 1 GiB, CUDA-graph replay"
    meta["outputs"] = (
        "inputs rotate over sets > L2; moefuse / moefuse_nopdl write one fixed "
        "output per case (like compile's graph pool); moefuse_rot_out one output "
        "per input set; in-place ops write into their inputs, like "
        "compile_inplace (compile writes to pool outputs)"
    )
    if args.save:
        paths = harness.save_results("norm", rows, meta, args.out)
        print("wrote", *[str(p) for p in paths if p])
    return 0
