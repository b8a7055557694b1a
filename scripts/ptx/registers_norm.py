"""Compile moefuse's norm kernels for sm_90 on a machine without a GPU and report registers and
spills (ptxas -v), so that compile errors and register pressure show up before a GPU run.

Every one-pass kernel is compiled three ways (stepped rows of the gated ops instead: "unroll",
launched at small M, and "loop", at large M): one tile per program ("tile", the launch when the
policy's programs_per_sm is 0), the persistent loop ("loop") and the persistent loop with the next
tile prefetched ("prefetch"), the last two with the launcher's register cap (maxnreg) for the
programs per SM; "*" marks what the tile policy launches.

Run: python scripts/ptx_check.py registers norm quant [--widths 4096,8192] (norm: rmsnorm,
fused_add, gated, gated_next, sigmoid; quant: fp8, fp8_add, fp4, fp4_add; ``--only`` names cases)
"""

import argparse
import dataclasses
import inspect

import triton
from triton.compiler import ASTSource

from moefuse.norm import gated, gated_residual, rms, tiles
from moefuse.tools.ptxas import TARGET, ptxas_report, tuple_fields

FP32_PTRS = {
    "res_ptr_gated",
    "alpha_ptr",
    "beta_ptr",
    "out_ptr_gated",
    "rout_ptr",
    "router_ptr",
    "a_ptr",
    "be_ptr",
}


#: pointer types other than bf16 / fp32 (the fused quant kernels' outputs and scales)
PTR_TYPES = {
    "q_ptr": "*u8",
    "p_ptr": "*u8",
    "s_ptr": "*u8",
    "scale_ptr": "*fp32",
    "gs_ptr": "*fp32",
    "part_ptr": "*fp32",
    "ctr_ptr": "*i32",
}


VARIANTS = (("tile", False, False), ("loop", True, False), ("prefetch", True, True))


def _type(name, consts, fp32_ptrs):
    if name in consts:
        return "constexpr"
    if name in PTR_TYPES:
        return PTR_TYPES[name]
    if name.endswith("_ptr"):
        return "*fp32" if name in fp32_ptrs else "*bf16"
    if name in (
        "eps",
        "gain_center",
        "Hf",
        "alpha_scalar",
        "post_eps",
        "next_eps",
        "next_gain_center",
        "post_gain_center",
    ):
        return "fp32"
    return "i32"


def _signature(kernel, consts, fp32_ptrs):
    """Each parameter's type by name; a tuple parameter's, element by element by the names
    the kernel unpacks it into (moefuse.tools.ptxas.tuple_fields; nested tuples walked)."""
    fields = tuple_fields(kernel)

    def typed(f):
        return tuple(map(typed, f)) if isinstance(f, tuple) else _type(f, consts, fp32_ptrs)

    return {name: typed(fields.get(name, name)) for name in inspect.signature(kernel.fn).parameters}


def compile_report(kernel, consts, num_warps, fp32_ptrs=(), maxnreg=None):
    src = ASTSource(
        fn=kernel, signature=_signature(kernel, consts, set(fp32_ptrs)), constexprs=consts
    )
    options = {"num_warps": num_warps}
    if maxnreg:
        options["maxnreg"] = maxnreg
    ck = triton.compile(src, target=TARGET, options=options)
    report = ptxas_report(ck.asm["ptx"])
    return report.regs, report.spills


#: the cases of each family (``ptx_check.py registers norm quant``)
FAMILY_CASES = {
    "norm": "rmsnorm,fused_add,gated,gated_next,sigmoid",
    "quant": "fp8,fp8_add,fp4,fp4_add",
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ptx_check.py registers norm|quant")
    parser.add_argument("--widths", default="64,128,2880,4096,8192,16384,20000")
    parser.add_argument("--only", default="", help="comma-separated case names")
    args = parser.parse_args(argv)
    only = set(filter(None, args.only.split(",")))
    for width in map(int, args.widths.split(",")):
        for name, kernel, extra, fp32, policy in _cases():
            if only and name not in only:
                continue
            if name.startswith("fp4") and width % 16:
                continue
            t = tiles.row_tile(width, policy)
            extra = dict(extra)
            for warps in sorted({t.num_warps, *extra.pop("_warps", ())}):
                # "tile": one program per row tile (the kernel of before); "loop": persistent
                # loop without prefetch; "prefetch": persistent loop with prefetch. "*" marks the
                # variant the tile policy launches.
                variants = VARIANTS if t.num_chunks == 1 else VARIANTS[:1]
                params = inspect.signature(kernel.fn).parameters
                if t.stepped:
                    variants = (("loop", False, False),)
                    if t.num_chunks <= tiles.STEP_UNROLL_MAX_STEPS:
                        variants = (("unroll", False, False),) + variants
                for label, persistent, prefetch in variants:
                    consts = dict(
                        BLOCK=t.block,
                        NUM_CHUNKS=t.num_chunks,
                        ROWS=t.rows,
                        MASKED=t.rows > 1 or not t.even(width),
                        PTX=True,
                        USE_PDL=True,
                        PERSISTENT=persistent,
                        PREFETCH=prefetch,
                        STEPPED=t.stepped,
                        UNROLL=label == "unroll",
                        **extra,
                    )
                    consts.setdefault("EVICT_FIRST", False)
                    consts = {k: v for k, v in consts.items() if k in params}
                    # persistent variants: the policy's programs per SM (2 where it runs one tile
                    # per program) and the launcher's register cap for them
                    per_sm = (t.programs_per_sm or 2) if persistent else 0
                    vt = dataclasses.replace(t, num_warps=warps, programs_per_sm=per_sm)
                    cap = vt.max_registers()
                    regs, spills = compile_report(kernel, consts, warps, fp32, cap)
                    chosen = (t.programs_per_sm > 0, t.prefetch)
                    mark = "*" if (persistent, prefetch) == chosen and warps == t.num_warps else " "
                    if t.stepped:
                        mark = "*"
                    print(
                        f"H={width:6d} {name:11s} warps={warps:2d} chunks={t.num_chunks} "
                        f"{'stepped ' if t.stepped else ''}"
                        f"{label:8s}{mark} per_sm={per_sm} maxnreg={cap or '-':>3} "
                        f"regs={regs:4d} spills={spills}",
                        flush=True,
                    )
    return 0


def _cases():
    from moefuse.quant import fused as qf

    return [
        ("rmsnorm", rms._rmsnorm_kernel, {"HAS_GATE": False}, (), tiles.RMSNORM_POLICY),
        ("fused_add", rms._fused_add_rmsnorm_kernel, {}, (), tiles.FUSED_ADD_POLICY),
        (
            "gated",
            gated_residual._gated_residual_kernel,
            {"HAS_WEIGHT": True},
            ("res_ptr", "alpha_ptr", "beta_ptr", "out_ptr"),
            tiles.GATED_POLICY,
        ),
        (
            "gated_next",
            gated._gated_residual_next_kernel,
            {"ALPHA_MODE": 2, "HAS_POST_WEIGHT": True, "HAS_ROUTER": True},
            ("res_ptr", "alpha_ptr", "beta_ptr", "rout_ptr", "router_ptr"),
            tiles.GATED_POLICY,
        ),
        ("sigmoid", rms._rmsnorm_kernel, {"HAS_GATE": True}, (), tiles.SIGMOID_GATE_POLICY),
        (
            "fp8",
            qf._rmsnorm_fp8_kernel,
            {"HAS_RESIDUAL": False, "FMT": 0, "EVICT_FIRST": True, "_warps": (4, 8)},
            (),
            qf.QUANT_POLICY,
        ),
        (
            "fp8_add",
            qf._rmsnorm_fp8_kernel,
            {"HAS_RESIDUAL": True, "FMT": 0, "EVICT_FIRST": True},
            (),
            qf.QUANT_ADD_POLICY,
        ),
        (
            "fp4",
            qf._rmsnorm_fp4_kernel,
            {
                "HAS_RESIDUAL": False,
                "HAS_NORM_OUT": False,
                "RECIPE": 0,
                "LAYOUT": 0,
                "EVICT_FIRST": True,
                "_warps": (4, 8),
            },
            (),
            qf.QUANT_FP4_POLICY,
        ),
        (
            "fp4_add",
            qf._rmsnorm_fp4_kernel,
            {
                "HAS_RESIDUAL": True,
                "HAS_NORM_OUT": True,
                "RECIPE": 0,
                "LAYOUT": 0,
                "EVICT_FIRST": True,
            },
            (),
            qf.QUANT_FP4_POLICY,
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(main())
