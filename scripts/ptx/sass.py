"""Static SASS of the NVFP4 (and FP8) quant kernels for sm_90a, compiled on a machine without a GPU.

Compiles ``_rmsnorm_fp4_kernel`` / ``_rmsnorm_fp8_kernel`` (quant.fused) and the standalone
``_fp4_quantize_kernel`` (quant.triton) with Triton for ``GPUTarget("cuda", 90, 32)`` (pointer and
stride arguments marked 16-divisible, as the JIT specializes them at run time; without that every
load is scalar and the counts mean nothing), assembles the PTX with the ptxas bundled with Triton
(``-arch=sm_90a -v``) and disassembles the cubin with the bundled ``cuobjdump -sass`` (or
``nvdisasm``). Reports registers, spill bytes, the SASS instruction count (NOPs and the trailing
BRA-to-self excluded), the "body" (instructions up to the last EXIT: without the out-of-line slow
path of IEEE division that ptxas appends after it) and the body per element of the thread's tile,
and a breakdown by opcode class. Static counts: branches not taken (padding-row programs) count too.

Run: python scripts/ptx_check.py sass [--widths 4096] [--warps 8] [--ops] [--dump DIR]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.compiler import ASTSource

from moefuse.norm.tiles import RowTile
from moefuse.quant import fused as qf
from moefuse.quant import triton as qt
from moefuse.tools.ptxas import PTXAS, TARGET, disassemble

# opcode (first dot-separated part) -> class
_CLASSES = {
    "int": {"IADD3", "IMAD", "LOP3", "SHF", "LEA", "IMNMX", "ISETP", "SEL", "PRMT", "IABS",
            "POPC", "FLO", "BFE", "BFI", "SGXT", "VIMNMX", "IMUL", "IADD", "I2IP", "BMSK",
            "LEA.HI", "VIADD", "IDP", "BREV", "PLOP3", "P2R", "R2P", "VIMNMX3", "VIADDMNMX",
            "IMNMX3"},
    "fp32": {"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK", "FSET"},
    "fp16x2": {"HFMA2", "HADD2", "HMUL2", "HSETP2", "HMNMX2", "HSET2"},
    "cvt": {"F2F", "I2F", "F2I", "F2FP", "FRND", "I2FP", "F2IP"},
    "mufu": {"MUFU"},
    "mov": {"MOV", "S2R", "S2UR", "CS2R", "R2UR", "UMOV", "ULDC", "MOV32I"},
    "shfl/red": {"SHFL", "REDUX", "VOTE", "MATCH"},
    "mem": {"LDG", "STG", "LDS", "STS", "LDC", "LD", "ST", "ATOM", "ATOMG", "RED", "LDL", "STL",
            "LDSM", "STSM"},
    "ctrl": {"BRA", "EXIT", "BAR", "BSSY", "BSYNC", "WARPSYNC", "CALL", "RET", "ACQBULK",
             "DEPBAR", "YIELD", "ELECT", "BPT", "PREEXIT"},
}  # fmt: skip


def _cls(op: str) -> str:
    base = op.split(".")[0]
    if base.startswith("U") and base not in ("UMOV",):
        return "uniform"
    for name, ops in _CLASSES.items():
        if base in ops:
            return name
    return "other"


def _signature(kernel, consts):
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("p_ptr", "s_ptr", "q_ptr"):
            sig[name] = "*u8"
        elif name == "gs_ptr" or name == "scale_ptr":
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = "*bf16"
        elif name in ("eps", "gain_center", "Hf"):
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def _attrs(kernel, sig):
    """16-divisibility for pointers, strides and widths (what the JIT sees at H = 4096)."""
    names = list(inspect.signature(kernel.fn).parameters)
    div = {"H", "KB", "n_kcols", "x_st", "r_st", "p_st", "y_st", "q_st", "x_sh", "r_sh", "q_sh"}
    return {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if sig[n].startswith("*") or n in div
    }


def compile_sass(kernel, consts, num_warps, dump=None, tag="k"):
    sig = _signature(kernel, consts)
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=_attrs(kernel, sig))
    ck = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        cubin = os.path.join(d, "k.cubin")
        with open(ptx, "w") as f:
            f.write(ck.asm["ptx"])
        out = subprocess.run(
            [PTXAS, "-arch=sm_90a", "-v", ptx, "-o", cubin],
            capture_output=True,
            text=True,
            check=True,
        )
        sass = disassemble(cubin)
    if dump:
        os.makedirs(dump, exist_ok=True)
        with open(os.path.join(dump, f"{tag}.ptx"), "w") as f:
            f.write(ck.asm["ptx"])
        with open(os.path.join(dump, f"{tag}.sass"), "w") as f:
            f.write(sass)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr)
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops.append(m.group(2))
    # drop NOPs and the trailing "BRA self" of the kernel end
    ops = [o for o in ops if o != "NOP"]
    while ops and ops[-1].startswith("BRA"):
        ops.pop()
        break
    exits = [i for i, o in enumerate(ops) if o.startswith("EXIT")]
    body = exits[-1] + 1 if exits else len(ops)
    by_cls = collections.Counter(_cls(o) for o in ops)
    by_op = collections.Counter(o.split(".")[0] for o in ops)
    return {
        "regs": int(regs.group(1)) if regs else -1,
        "spills": int(spill.group(1)) if spill else -1,
        "instr": len(ops),
        "body": body,
        "classes": by_cls,
        "ops": by_op,
    }


def _fp4_fused_case(width, warps, residual=False, norm_out=False, layout=0, recipe=0):
    t = qf.quant_fp4_row_tile(width, residual)
    if warps:
        t = RowTile(t.block, t.num_chunks, t.rows, warps)
    consts = dict(
        BLOCK=t.block,
        NUM_CHUNKS=t.num_chunks,
        ROWS=t.rows,
        HAS_RESIDUAL=residual,
        HAS_NORM_OUT=norm_out,
        RECIPE=recipe,
        LAYOUT=layout,
        EVICT_FIRST=t.num_chunks == 1,
        PTX=True,
        USE_PDL=True,
        PERSISTENT=False,
        PREFETCH=False,
        MASKED=t.rows > 1 or not t.even(width),
    )
    return qf._rmsnorm_fp4_kernel, consts, t.num_warps, t.rows * t.block * t.num_chunks


def _fp8_fused_case(width, warps):
    t = qf.quant_row_tile(width)
    if warps:
        t = RowTile(t.block, t.num_chunks, t.rows, warps)
    consts = dict(
        BLOCK=t.block,
        NUM_CHUNKS=t.num_chunks,
        ROWS=t.rows,
        MASKED=t.rows > 1 or not t.even(width),
        HAS_RESIDUAL=False,
        FMT=0,
        EVICT_FIRST=t.num_chunks == 1,
        PTX=True,
        USE_PDL=True,
        PERSISTENT=False,
        PREFETCH=False,
        STEPPED=False,
        UNROLL=False,
    )
    return qf._rmsnorm_fp8_kernel, consts, t.num_warps, t.rows * t.block * t.num_chunks


def _fp4_standalone_case(width, warps, layout=0, recipe=0):
    bm, bk, w = qt._fp4_tile(width // 16, qt.FP4_QUANT_MAX_BLOCKS)
    consts = dict(BLOCK_M=bm, BLOCK_K=bk, RECIPE=recipe, LAYOUT=layout, PTX=True, USE_PDL=True)
    return qt._fp4_quantize_kernel, consts, warps or w, bm * bk * 16


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ptx_check.py sass")
    parser.add_argument("--widths", default="4096")
    parser.add_argument("--warps", type=int, default=0, help="override num_warps (0 = policy)")
    parser.add_argument("--ops", action="store_true", help="print the per-opcode counts too")
    parser.add_argument("--dump", default=None, help="write PTX and SASS into this folder")
    args = parser.parse_args(argv)
    for width in map(int, args.widths.split(",")):
        cases = [
            ("rmsnorm_fp4", *_fp4_fused_case(width, args.warps)),
            ("fused_add_fp4", *_fp4_fused_case(width, args.warps, residual=True)),
            ("rmsnorm_fp4_ieee_lin", *_fp4_fused_case(width, args.warps, layout=2, recipe=1)),
            ("fp4_quantize", *_fp4_standalone_case(width, args.warps)),
            ("rmsnorm_fp8", *_fp8_fused_case(width, args.warps)),
        ]
        for name, kernel, consts, warps, elems in cases:
            r = compile_sass(kernel, consts, warps, args.dump, f"{name}_H{width}")
            per_thread = elems / (32 * warps)
            cls = " ".join(f"{k}={v}" for k, v in sorted(r["classes"].items()))
            print(
                f"H={width} {name:21s} warps={warps} elem/thr={per_thread:5.1f} "
                f"regs={r['regs']:3d} spills={r['spills']} instr={r['instr']:4d} "
                f"body={r['body']:4d} ({r['body'] / per_thread:5.1f}/elem)  {cls}"
            )
            if args.ops:
                print("    " + " ".join(f"{k}={v}" for k, v in r["ops"].most_common()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
