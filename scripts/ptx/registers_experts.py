"""Offline SM90 compile of the fused experts kernels (no GPU): registers, spills, shared memory
and the instructions the design relies on (MMAs, 16-byte weight loads, PDL), per model shape and
token tile. ``python scripts/ptx_check.py registers experts``"""

from __future__ import annotations

import argparse
import re

import triton

import moefuse.moe.experts_plan as xp
import moefuse.moe.experts_triton as xt
from moefuse.moe.tiles import experts_tile
from moefuse.tools.ptxas import TARGET, ptxas_report, specialised_source, with_constexpr_defaults

SHAPES = {"qwen3": (2048, 768), "mixtral": (4096, 14336), "deepseek_v3": (7168, 2048)}


def _divisible(name, typ):
    return typ.startswith("*") or name.endswith("_st") or name.startswith("w_st")


def build(kernel, consts, warps):
    consts = with_constexpr_defaults(kernel, consts)
    types = {
        "items_ptr": "*i32",
        "sorted_ptr": "*i32",
        "y_ptr": "*fp32",
        "idx_ptr": "*i64",
        "slot_map_ptr": "*i32",
        "counts_ptr": "*i32",
    }
    src = specialised_source(kernel, consts, types, _divisible)
    opts = {"num_warps": warps, "launch_pdl": consts.get("USE_PDL", False)}
    return triton.compile(src, target=TARGET, options=opts)


def main(argv=None) -> int:
    argparse.ArgumentParser(
        prog="ptx_check.py registers experts", description=__doc__.split("\n\n")[0]
    ).parse_args(argv)
    rows = []
    for name, (h, i) in SHAPES.items():
        for bt, slots in ((16, 0), (128, 0), (128, 16384), (256, 0)):
            tile = experts_tile(h, i, bt, slots)
            # w_st_k = 1: weights stored [E, N, K] with K contiguous, which a launch passes as
            # 1 and the JIT makes a constant (an integer argument equal to 1 is specialised so)
            common = dict(
                BK=tile["bk"], BT=bt, BR=tile["tail_tile"], STAGES=tile["stages"], SP=0,
                PTX=True, USE_PDL=True, w_st_k=1,
            )  # fmt: skip
            for kern, consts in (
                (
                    xt._experts_gate_up_kernel,
                    dict(KDIM=h, INTER=i, BN=tile["bn_gate_up"], **common),
                ),
                (
                    xt._experts_down_kernel,
                    dict(
                        KDIM=i,
                        H=h,
                        BN=tile["bn_down"],
                        FINALIZE=False,
                        EXTRAS=(False,) * 3,
                        **common,
                    ),
                ),
            ):
                c = build(kern, consts, tile["warps"])
                weight_rows = consts["BN"] * (2 if "INTER" in consts else 1)
                ptx = c.asm["ptx"]
                rep = ptxas_report(ptx)
                rows.append(
                    (
                        name,
                        f"{bt}/{tile['tail_tile']}/{weight_rows}",
                        kern.fn.__name__,
                        rep.regs,
                        rep.spills,
                        c.metadata.shared,
                        "mma" if "mma.sync" in ptx else ("wgmma" if "wgmma" in ptx else "-"),
                        bool(re.search(r"cp\.async\.\w+\.shared\.global.*(?:16|0x10)", ptx)),
                        "griddepcontrol.wait" in ptx,
                    )
                )
    plan = dict(BS=xp.PLAN_SLOTS, BC=xp.PLAN_CHUNK, EP=256, BT=16, USE_PDL=True)
    for tag, kern, consts, warps in (
        ("plan", xp._experts_plan_kernel, dict(plan, CB=0), xp.PLAN_WIDE_CHUNK_WARPS),
        ("plan two-phase", xp._experts_plan_kernel, dict(plan, CB=16), xp.PLAN_WIDE_CHUNK_WARPS),
        ("block counts", xp._experts_block_counts_kernel, dict(BS=1024, EP=256, USE_PDL=True), 4),
    ):
        c = build(kern, consts, warps)
        rep = ptxas_report(c.asm["ptx"])
        pdl = "griddepcontrol.wait" in c.asm["ptx"]
        rows.append(
            (tag, 16, kern.fn.__name__, rep.regs, rep.spills, c.metadata.shared, "-", False, pdl)
        )
    print("shape bt/tail/rows kernel regs spills smem mma cp.async16 pdl")
    for r in rows:
        print(*r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
