"""H200 sweep of the persistent, prefetching row loop (norm/tiles.py ``programs_per_sm``,
``prefetch``; notes/norm.md) against one program per row tile, for every kernel that has it.

For each op, width H (4096, 8192; sigmoid gate: 32 heads x D in {64, 128}) and token count M:
1. bitwise check: every variant against "old" (one program per row tile, PERSISTENT=False, the
   kernel of before) on fresh random inputs with poisoned outputs; a mismatch prints "DIFF";
2. timing (CUDA-graph replay, inputs rotated over sets that overflow L2, like the benchmarks):
   old | the policy's default (dflt) | prefetch with 2, 4, 8 programs per SM (P2/P4/P8; register
   cap = the launcher's maxnreg for that many resident programs) | P4u = 4 per SM without the cap;
   FP8 / NVFP4 (no residual) at 4 and 8 warps (suffix w4 / w8).
   One line per (op, H, M): ``tag us TB/s`` per variant.
Then registers / spills of every compiled variant (from ``kernel.device_caches``).

Run on one GPU (about 3 minutes, most of it Triton compiles on a cold cache):
    PYTHONPATH=src python3 scripts/sweep_persistent.py [--ops fp8,rmsnorm] [--tokens 2048,16384]
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moefuse.bench import harness
from moefuse.norm import gated, tiles
from moefuse.norm import triton as nt
from moefuse.quant import fused as qf
from moefuse.quant.formats import scale_layout_shape

BF, F32, U8 = torch.bfloat16, torch.float32, torch.uint8
TOKENS = [1, 16, 128, 1024, 2048, 16384]
WIDTHS = [4096, 8192]
HEAD_DIMS = [64, 128]
HEADS = 32
PER_SM = [2, 4, 8]
EPS = 1e-6


@dataclass
class Op:
    kernel: object  # the @triton.jit kernel (for registers / spills)
    policy: Callable[[], tiles.TilePolicy]
    bpe: float  # bytes moved per element
    make: Callable[[int, int], dict]  # (M, H) -> tensors
    run: Callable[[dict, tiles.RowTile], None]
    outs: tuple[str, ...]  # names of the tensors the op writes
    warps: tuple[int, ...] = ()  # warps to sweep besides the policy's
    widths: tuple = tuple(WIDTHS)


def _r(*shape, dtype=BF):
    return torch.randn(*shape, device="cuda", dtype=F32).to(dtype)


def _e(*shape, dtype):
    return torch.empty(*shape, device="cuda", dtype=dtype)


def _fp4_make(m, h, residual):
    rows_p, cols = scale_layout_shape(m, h // 16, "swizzled_128x4")
    return dict(x=_r(m, h), res=_r(m, h) if residual else None, w=_r(h),
                gs=torch.tensor([300.0], device="cuda"), p=_e(m, h // 2, dtype=U8),
                s=_e(rows_p, cols, dtype=U8))  # fmt: skip


OPS = {
    "rmsnorm": Op(
        nt._rmsnorm_kernel, lambda: tiles.TilePolicy(), 4,
        lambda m, h: dict(x=_r(m, h), w=_r(h), o=_e(m, h, dtype=BF)),
        lambda d, t: nt.launch_rmsnorm(d["x"], d["w"], d["o"], EPS, 0.0, True, tile=t), ("o",)),
    "sigmoid_gate": Op(
        nt._rmsnorm_kernel, lambda: tiles.SIGMOID_GATE_POLICY, 6,
        lambda m, d: dict(x=_r(m, HEADS, d), g=_r(m, HEADS, d)),
        lambda d, t: nt.launch_rmsnorm(d["x"], None, d["x"], 1e-5, 0.0, True, gate=d["g"], tile=t),
        ("x",), widths=tuple(HEAD_DIMS)),
    "fused_add": Op(
        nt._fused_add_rmsnorm_kernel, lambda: tiles.FUSED_ADD_POLICY, 8,
        lambda m, h: dict(x=_r(m, h), res=_r(m, h), w=_r(h)),
        lambda d, t: nt.launch_fused_add_rmsnorm(d["x"], d["res"], d["w"], EPS, 0.0, True, tile=t),
        ("x", "res")),
    "gated_residual": Op(
        gated._gated_residual_kernel, lambda: tiles.GATED_POLICY, 10,
        lambda m, h: dict(b=_r(m, h), res=_r(m, h, dtype=F32), a=_r(h, dtype=F32),
                          be=_r(h, dtype=F32), o=_e(m, h, dtype=F32)),
        lambda d, t: gated.launch_gated_residual_rmsnorm(d["b"], d["res"], None, d["a"], d["be"],
                                                      d["o"], EPS, 0.0, True, tile=t), ("o",)),
    "gated_next": Op(
        gated._gated_residual_next_kernel, lambda: tiles.GATED_POLICY, 12,
        lambda m, h: dict(b=_r(m, h), res=_r(m, h, dtype=F32), nw=_r(h), a=_r(h, dtype=F32),
                          be=_r(h, dtype=F32), ro=_e(m, h, dtype=F32), f=_e(m, h, dtype=BF)),
        lambda d, t: gated.launch_gated_residual_next_rmsnorm(
            d["b"], d["res"], d["nw"], d["a"], 1.0, d["be"], None, d["ro"], d["f"], None, EPS,
            EPS, 0.0, 0.0, True, tile=t), ("ro", "f")),
    "fp8": Op(
        qf._rmsnorm_fp8_kernel, lambda: qf.QUANT_POLICY, 3,
        lambda m, h: dict(x=_r(m, h), w=_r(h), sc=torch.tensor([0.02], device="cuda"),
                          q=_e(m, h, dtype=U8)),
        lambda d, t: qf.launch_rmsnorm_fp8(d["x"], None, d["w"], d["sc"], d["q"], 0, EPS, 0.0,
                                           True, tile=t), ("q",), warps=(4, 8)),
    "fp8_add": Op(
        qf._rmsnorm_fp8_kernel, lambda: qf.QUANT_ADD_POLICY, 7,
        lambda m, h: dict(x=_r(m, h), res=_r(m, h), w=_r(h),
                          sc=torch.tensor([0.02], device="cuda"), q=_e(m, h, dtype=U8)),
        lambda d, t: qf.launch_rmsnorm_fp8(d["x"], d["res"], d["w"], d["sc"], d["q"], 0, EPS,
                                           0.0, True, tile=t), ("q", "res")),
    "fp4": Op(
        qf._rmsnorm_fp4_kernel, lambda: qf.QUANT_FP4_POLICY, 2.5625,
        lambda m, h: _fp4_make(m, h, False),
        lambda d, t: qf.launch_rmsnorm_fp4(d["x"], None, d["w"], d["gs"], d["p"], d["s"], None,
                                           EPS, 0.0, "swizzled_128x4", "fast", True, tile=t),
        ("p", "s"), warps=(4, 8)),
    "fp4_add": Op(
        qf._rmsnorm_fp4_kernel, lambda: qf.QUANT_FP4_POLICY, 6.5625,
        lambda m, h: _fp4_make(m, h, True),
        lambda d, t: qf.launch_rmsnorm_fp4(d["x"], d["res"], d["w"], d["gs"], d["p"], d["s"],
                                           None, EPS, 0.0, "swizzled_128x4", "fast", True,
                                           tile=t), ("p", "s", "res")),
}  # fmt: skip


def variants(op: Op, h: int) -> list[tuple[str, tiles.RowTile]]:
    """(tag, tile): old (one tile per program) and prefetch P2/P4/P8 per warps, the default."""
    base = tiles.row_tile(h, op.policy())
    out = [("dflt", base)]
    for warps in sorted({base.num_warps, *op.warps}):
        w = f"w{warps}" if op.warps else ""
        t = dataclasses.replace(base, num_warps=warps)
        out.append((f"old{w}", dataclasses.replace(t, programs_per_sm=0, prefetch=False)))
        if base.num_chunks == 1:
            out += [(f"P{k}{w}", dataclasses.replace(t, programs_per_sm=k, prefetch=True))
                    for k in PER_SM]  # fmt: skip
            # 4 per SM without the register cap: fewer resident programs instead of spills
            out.append((f"P4u{w}", dataclasses.replace(t, programs_per_sm=4, prefetch=True,
                                                        fit_registers=False)))  # fmt: skip
    return out


def _compiled(kernel) -> dict[int, object]:
    return {id(ck): ck for cache in kernel.device_caches.values() for ck in cache[0].values()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(U8)


def check(op: Op, m: int, h: int, vs, regs: dict) -> str:
    """Bitwise: every variant vs the old kernel of the same warps, fresh inputs, poisoned outputs.
    Records registers / spills of kernels compiled on the way."""
    src = op.make(m, h)
    ref: dict[int, list[torch.Tensor]] = {}
    bad = []
    for tag, tile in sorted(vs, key=lambda v: not v[0].startswith("old")):
        d = {k: (v.clone() if v is not None else None) for k, v in src.items()}
        for name in op.outs:
            if name not in ("x", "res"):  # in-place operands keep their inputs
                d[name].view(U8).fill_(0xA5)
        before = _compiled(op.kernel)
        op.run(d, tile)
        torch.cuda.synchronize()
        for key, ck in _compiled(op.kernel).items():
            if key not in before:
                md = ck.metadata
                regs[(id(op), h, tag)] = (md.num_warps, getattr(md, "maxnreg", None), ck.n_regs,
                                          ck.n_spills)  # fmt: skip
        got = [_bits(d[name]) for name in op.outs]
        if tag.startswith("old"):
            ref[tile.num_warps] = got
        elif not all(torch.equal(a, b) for a, b in zip(got, ref[tile.num_warps], strict=True)):
            bad.append(tag)
    return "bitwise ok" if not bad else "DIFF " + ",".join(bad)


def time_variants(op: Op, m: int, h: int, vs) -> str:
    elems = m * h * (HEADS if op.widths == tuple(HEAD_DIMS) else 1)
    nbytes = int(op.bpe * elems)
    n = harness.rotation_sets(nbytes)
    sets = [op.make(m, h) for _ in range(n)]
    line = ""
    for tag, tile in vs:
        us = harness.graph_time_us(lambda i, t=tile: op.run(sets[i % n], t), calls=max(10, n),
                                   replays=10)  # fmt: skip
        line += f" | {tag} {us:8.2f}us {nbytes / us / 1e6:5.2f}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = parser.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: {sms} SMs; us and TB/s per variant", flush=True)
    regs: dict = {}
    for name in args.ops.split(","):
        op = OPS[name]
        for h in op.widths:
            vs = variants(op, h)
            desc = ", ".join(f"{tag}={t.programs_per_sm}/SM{'+pf' if t.prefetch else ''}"
                             f" w{t.num_warps} cap{t.max_registers() or '-'}"
                             for tag, t in vs if tag == "dflt")  # fmt: skip
            print(f"# {name} H={h}: {desc}", flush=True)
            for m in tokens:
                verdict = check(op, m, h, vs, regs)
                print(f"{name:14s} H={h:5d} M={m:6d} {verdict}{time_variants(op, m, h, vs)}",
                      flush=True)  # fmt: skip
            for tag, tile in vs:
                # a variant equal to an earlier one (e.g. dflt) compiled nothing new
                same = [g for g, t in vs if t == tile and (id(op), h, g) in regs]
                if same:
                    warps, maxnreg, n_regs, n_spills = regs[(id(op), h, same[0])]
                    print(f"  regs {name} H={h} {tag}: warps={warps} maxnreg={maxnreg} "
                          f"regs={n_regs} spills={n_spills}", flush=True)


if __name__ == "__main__":
    main()
