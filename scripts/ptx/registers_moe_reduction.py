"""Compile the MoE communication fusion kernels (comm/moe_reduction/kernels.py) for sm_90a on a
machine without a GPU and report registers and spills (ptxas -v): compile errors and register
pressure show up before a GPU run. Each case uses the launcher's own tile, rows per batch and
register cap (maxnreg) for the given CTAs per SM.

Run: python scripts/ptx_check.py registers moe-reduction [--widths 4096,7168] [--top-k 8]
"""

import argparse
import inspect

import triton
from triton.compiler import ASTSource

from moefuse.comm.moe_reduction import kernels as mt
from moefuse.comm.tiles import CommTile, comm_tile
from moefuse.tools.ptxas import TARGET, ptxas_report

PTR = {
    "map_ptr": "*i32",
    "w_ptr": "*fp32",
    "e_ptr": "*i32",
    "q_ptr": "*u8",
    "sf_ptr": "*u8",
    "scale_ptr": "*fp32",
    "table_ptr": "*i64",
    "ctrl_ptr": "*i32",
    "clock_ptr": "*i32",
}
FLOATS = {"Hf", "eps", "weight_bias", "rsf"}


def _signature(kernel, consts):
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name in PTR:
            sig[name] = PTR[name]
        elif name.endswith("_ptr"):
            sig[name] = "*bf16"
        elif name in FLOATS:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_report(kernel, consts, num_warps, maxnreg=None):
    src = ASTSource(fn=kernel, signature=_signature(kernel, consts), constexprs=consts)
    options = {"num_warps": num_warps, "enable_fp_fusion": False}
    if maxnreg:
        options["maxnreg"] = maxnreg
    ck = triton.compile(src, target=TARGET, options=options)
    report = ptxas_report(ck.asm["ptx"])
    return report.regs, report.spills


def _variants(h, tile, top_ks, resident) -> None:
    """The one-shot variants at the launcher's register cap for ``resident`` co-resident CTAs
    per SM: the column-split kernel for each CTAs-per-row count."""
    cap = min(255, 65536 // (32 * tile.num_warps * resident)) // 8 * 8
    common = dict(
        P=2,
        BITS=16,
        BLOCK_H=tile.block,
        LAYOUT=0,
        KP_BLOCK=tile.kp_block,
        WRITE_AR=False,
        USE_PDL=True,
        PTX=True,
    )
    for k in top_ks:
        for c in (2, 4, 8, 16):
            if tile.block // c < 32:
                continue
            width = CommTile(block=tile.block // c, num_warps=tile.num_warps, kp_block=1)
            for stepwise, pattern, bias in ((True, 1, False), (False, 3, True)):
                kb = mt.rows_per_batch(k, width, resident, bias)
                consts = dict(
                    K=k,
                    KB=kb,
                    DENSE=False,
                    HAS_W=True,
                    HAS_BIAS=bias,
                    HAS_RSF=True,
                    HAS_SHARED=True,
                    STEPWISE=stepwise,
                    PATTERN=pattern,
                    C=c,
                    BLOCK_W=tile.block // c,
                    **common,
                )
                regs, spill = compile_report(mt._moe_split_kernel, consts, tile.num_warps, cap)
                print(
                    f"H={h:5d} K={k} split C={c:2d} KB={kb} stepwise={stepwise:d} "
                    f"pattern={pattern} bias={bias:d}: {regs} registers (cap {cap}), "
                    f"{spill} bytes spilled",
                    flush=True,
                )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ptx_check.py registers moe-reduction")
    parser.add_argument("--widths", default="2880,4096,7168")
    parser.add_argument("--top-k", default="2,8")
    parser.add_argument("--ctas", default="1,2")
    parser.add_argument(
        "--variants-only", action="store_true", help="only the split one-shot variant"
    )
    args = parser.parse_args(argv)
    for h in [int(x) for x in args.widths.split(",")]:
        tile = comm_tile(h, 1)
        if args.variants_only:
            for ctas in [int(x) for x in args.ctas.split(",")]:
                _variants(h, tile, [int(x) for x in args.top_k.split(",")], ctas)
            continue
        for k in [int(x) for x in args.top_k.split(",")]:
            for ctas in [int(x) for x in args.ctas.split(",")]:
                cap = min(255, 65536 // (32 * tile.num_warps * ctas)) // 8 * 8
                for dense, stepwise, pattern, bias in (
                    (False, True, 1, False),
                    (False, False, 3, True),
                    (True, True, 2, False),
                ):
                    kb = mt.rows_per_batch(k, tile, ctas, bias)
                    prod = dict(
                        K=k,
                        KB=kb,
                        DENSE=dense,
                        HAS_W=True,
                        HAS_BIAS=bias,
                        HAS_RSF=not dense,
                        HAS_SHARED=True,
                        STEPWISE=stepwise,
                    )
                    common = dict(
                        BLOCK_H=tile.block,
                        PATTERN=pattern,
                        LAYOUT=0,
                        KP_BLOCK=tile.kp_block,
                        WRITE_AR=dense,
                        USE_PDL=True,
                        PTX=True,
                    )
                    one = dict(P=2, BITS=16, **prod, **common)
                    two = dict(P=2, PP=2, NSLOT=1024, BITS=16, **prod, **common)
                    for name, kern, consts in (
                        ("oneshot", mt._moe_oneshot_kernel, one),
                        ("twoshot", mt._moe_twoshot_kernel, two),
                    ):
                        regs, spill = compile_report(kern, consts, tile.num_warps, cap)
                        print(
                            f"H={h:5d} K={k} ctas/SM={ctas} KB={kb} {name:8s} dense={dense:d} "
                            f"stepwise={stepwise:d} pattern={pattern} bias={bias:d}: "
                            f"{regs} registers (cap {cap}), {spill} bytes spilled",
                            flush=True,
                        )
        for ctas in [int(x) for x in args.ctas.split(",")]:
            _variants(h, tile, [int(x) for x in args.top_k.split(",")], ctas)
        consts = dict(
            BLOCK_H=tile.block,
            K=8,
            KB=mt.rows_per_batch(8, tile),
            DENSE=False,
            HAS_W=True,
            HAS_BIAS=False,
            HAS_RSF=True,
            HAS_SHARED=True,
            STEPWISE=True,
            USE_PDL=True,
            PTX=True,
        )
        print(f"H={h:5d} partial:", compile_report(mt._moe_partial_kernel, consts, tile.num_warps))
        consts = dict(
            P=2,
            BLOCK_H=tile.block,
            PATTERN=1,
            LAYOUT=0,
            KP_BLOCK=tile.kp_block,
            STEPWISE=False,
            WRITE_AR=True,
            USE_PDL=True,
            PTX=True,
        )
        print(
            f"H={h:5d} gathered:", compile_report(mt._moe_gathered_kernel, consts, tile.num_warps)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
