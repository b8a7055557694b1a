"""Compile the all-gather + norm kernels (comm/all_gather/kernels.py, all_gather/decode.py,
all_gather/persistent.py) for sm_90a on a machine without a GPU and report registers and spills
(ptxas -v), with the launchers' own constexprs (the single-GPU op's tile of the width, both
stepped modes where the rows are stepped), and the CTAs per SM those registers allow. Ops
(``--ops``): rmsnorm, fp8 (E4M3), fp4 (linear and swizzled_128x4 scales), gated (tensor alpha,
post weight, router output).

Run: python scripts/ptx_check.py registers all-gather (or PYTHONPATH=src python -m
     moefuse.tools.compile_check_allgather) [--widths 4096,7168,8192] [--p 2,4]
     [--ops rmsnorm,fp8,fp4,fp4_swz,gated]
"""

import argparse
import re

import triton

from moefuse.bench import harness
from moefuse.comm.all_gather import decode as dec
from moefuse.comm.all_gather import kernels as AG
from moefuse.comm.all_gather import persistent as fused
from moefuse.comm.tiles import resident_ctas_per_sm
from moefuse.norm import tiles
from moefuse.tools.ptxas import TARGET, ptxas_report, specialised_source, with_constexpr_defaults

TYPES = {
    "table_ptr": "*i64",
    "agctrl_ptr": "*i32",
    "status_ptr": "*i32",
    "ctrl_ptr": "*i32",
    "clock_ptr": "*i32",
    "eps": "fp32",
    "gain_center": "fp32",
    "Hf": "fp32",
    "alpha_scalar": "fp32",
    "post_eps": "fp32",
    "post_gc": "fp32",
}
#: integer arguments the JIT sees as multiples of 16 at H = 4096 / 8192, P = 2 (strides, widths,
#: region offset and capacity); pointers are 16-byte aligned
DIVISIBLE = {"s_st", "x_st", "o_st", "g_st", "H", "S", "cap", "ag_off16", "r_st", "ro_st", "rt_st"}


#: pointer types of the fused kernels' op arguments (rmsnorm: the weight's type everywhere)
OP_TYPES = {
    dec.RMSNORM: {},
    dec.FP8: {"out_ptr": "*u8", "aux_ptr": "*fp32"},
    dec.FP4: {"out_ptr": "*u8", "aux_ptr": "*fp32", "sf_ptr": "*u8"},
    dec.GATED: {
        "res_ptr": "*fp32",
        "alpha_ptr": "*fp32",
        "beta_ptr": "*fp32",
        "ro_ptr": "*fp32",
        "rt_ptr": "*fp32",
    },
}
OPS = {
    "rmsnorm": (dec.RMSNORM, "linear"),
    "fp8": (dec.FP8, "linear"),
    "fp4": (dec.FP4, "linear"),
    "fp4_swz": (dec.FP4, "swizzled_128x4"),
    "gated": (dec.GATED, "linear"),
}
#: the gated op compiles with its heaviest options: tensor alpha, post weight, router output
GATED_CONSTS = {"ALPHA_MODE": 2, "HAS_POST_WEIGHT": True, "HAS_ROUTER": True}


def compile_report(kernel, consts: dict, num_warps: int, types: dict | None = None) -> dict:
    """ptxas -v of ``kernel`` for sm_90a with the launch's specialisation: registers, spilled
    bytes, and counts of 16-byte volatile polls / global stores in the PTX."""
    src = specialised_source(
        kernel,
        with_constexpr_defaults(kernel, consts),
        {**TYPES, **(types or {})},
        lambda name, t: t.startswith("*") or name in DIVISIBLE,
    )
    ptx = triton.compile(src, target=TARGET, options={"num_warps": num_warps}).asm["ptx"]
    report = ptxas_report(ptx)
    return {
        "regs": report.regs,
        "spill": report.spills,
        "v4_polls": len(re.findall(r"ld\.volatile\.global\.v4", ptx)),
        "v4_stores": len(re.findall(r"st\.global\.v4", ptx)),
    }


def norm_consts(
    h: int, unroll: bool, op: int = dec.RMSNORM, layout: str = "linear"
) -> tuple[dict, int]:
    """The fused kernels' constexprs for op ``op`` at width ``h`` (the launchers' own:
    ``Epilogue.consts``; rows stepped: ``unroll`` mode), and warps."""
    tile = dec.op_tile(op, h)
    rows = 1 if unroll else tiles.RMSNORM_LOOP_MIN_ROWS
    ep = dec.Epilogue(op, None, None, 1e-6, 0.0, layout=layout)
    consts = ep.consts(tile, h, rows, True)
    if tile.stepped:
        consts["UNROLL"] = unroll
    if op == dec.GATED:
        consts.update(GATED_CONSTS)
    warps = consts.pop("num_warps")
    consts.pop("launch_pdl", None)
    return consts, warps


def report(tag: str, kernel, consts: dict, warps: int, op: int = dec.RMSNORM) -> None:
    r = compile_report(kernel, consts, warps, OP_TYPES[op])
    fit = fused.fits_per_sm(r["regs"], warps)
    per_sm = (
        fused.FUSED_CTAS_PER_SM.get(op) if consts.get("STEPPED") else None
    ) or resident_ctas_per_sm(warps)  # fused_grid's default
    print(
        f"{tag}: {r['regs']} registers, {r['spill']} bytes spilled, {r['v4_polls']} v4 polls, "
        f"{r['v4_stores']} v4 stores, {warps} warps (fits {fit} CTAs/SM; the persistent "
        f"kernel launches {min(fit, per_sm)})",
        flush=True,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="ptx_check.py registers all-gather")
    parser.add_argument("--widths", default="4096,7168,8192")
    parser.add_argument("--p", default="2,4")
    parser.add_argument("--ops", default=",".join(OPS))
    args = parser.parse_args(argv)
    for h in [int(x) for x in args.widths.split(",")]:
        for p in [int(x) for x in args.p.split(",")]:
            block_s, gw = AG.allgather_tile(h // p)
            report(
                f"H={h:5d} P={p} gather                   ",
                AG._allgather_kernel,
                dict(P=p, BLOCK_S=block_s, USE_PDL=True, PTX=True),
                gw,
            )
            for name in args.ops.split(","):
                op, layout = OPS[name]
                if not dec.fusable(op, dec.op_tile(op, h)):
                    print(f"H={h:5d} P={p} {name}: two launches (tile not fusable)")
                    continue
                for unroll in (True, False) if dec.op_tile(op, h).stepped else (True,):
                    consts, warps = norm_consts(h, unroll, op, layout)
                    mode = "unroll" if unroll else "loop  "
                    report(
                        f"H={h:5d} P={p} {name:7s} persistent {mode}",
                        fused._ag_rmsnorm_persistent_kernel,
                        {**consts, "P": p, "BLOCK_S": block_s},
                        warps,
                        op,
                    )
                    if not unroll:
                        continue
                    for pmode in ("early", "slots"):  # the other persistent modes, if eligible
                        with harness.knobs({fused.PERSISTENT_ENV: pmode}):
                            early, slots = fused.persistent_mode(op, dec.op_tile(op, h))
                        if early or slots:
                            report(
                                f"H={h:5d} P={p} {name:7s} persistent {pmode:6s}",
                                fused._ag_rmsnorm_persistent_kernel,
                                {
                                    **consts,
                                    "P": p,
                                    "BLOCK_S": block_s,
                                    "EARLY": early,
                                    "FROM_SLOTS": slots,
                                },
                                warps,
                                op,
                            )
                consts, warps = norm_consts(h, True, op, layout)
                report(
                    f"H={h:5d} P={p} {name:7s} decode           ",
                    dec._ag_rmsnorm_kernel,
                    {**consts, "P": p, "BLOCK_S": block_s},
                    warps,
                    op,
                )
                for mode in ("early", "slots"):  # the other decode modes, where eligible
                    with harness.knobs({dec.DECODE_ENV: mode}):
                        early, slots = dec.decode_mode(op, dec.op_tile(op, h))
                    if early:
                        report(
                            f"H={h:5d} P={p} {name:7s} decode {mode:10s}",
                            dec._ag_rmsnorm_kernel,
                            {
                                **consts,
                                "P": p,
                                "BLOCK_S": block_s,
                                "EARLY": True,
                                "FROM_SLOTS": slots,
                            },
                            warps,
                            op,
                        )


if __name__ == "__main__":
    main()
