"""Compile moefuse's norm kernels for sm_90 on a machine without a GPU and report registers and
spills (ptxas -v), so that compile errors and register pressure show up before a GPU run.

Run: PYTHONPATH=src python scripts/compile_check.py [--widths 4096,8192]
"""

import argparse
import inspect
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moefuse.norm import tiles
from moefuse.norm import triton as nt

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
FP32_PTRS = {"res_ptr_gated", "alpha_ptr", "beta_ptr", "out_ptr_gated", "rout_ptr", "router_ptr",
             "a_ptr", "be_ptr"}  # fmt: skip


def _signature(kernel, consts, fp32_ptrs):
    sig = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in consts:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32" if name in fp32_ptrs else "*bf16"
        elif name in ("eps", "gain_center", "Hf", "alpha_scalar", "post_eps", "next_eps",
                      "next_gain_center", "post_gain_center"):  # fmt: skip
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
    return sig


def compile_report(kernel, consts, num_warps, fp32_ptrs=()):
    src = ASTSource(fn=kernel, signature=_signature(kernel, consts, set(fp32_ptrs)),
                    constexprs=consts)  # fmt: skip
    ck = triton.compile(src, target=TARGET, options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ck.asm["ptx"])
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull],
                         capture_output=True, text=True)  # fmt: skip
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr)
    return int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else -1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="64,2880,4096,8192,16384,20000")
    args = parser.parse_args()
    for width in map(int, args.widths.split(",")):
        for name, kernel, extra, fp32, policy in _cases():
            t = tiles.row_tile(width, policy)
            consts = dict(BLOCK=t.block, NUM_CHUNKS=t.num_chunks, ROWS=t.rows,
                          MASKED=t.rows > 1 or not t.even(width), EVICT_FIRST=False, PTX=True,
                          USE_PDL=True, **extra)  # fmt: skip
            regs, spills = compile_report(kernel, consts, t.num_warps, fp32)
            print(f"H={width:6d} {name:11s} warps={t.num_warps:2d} chunks={t.num_chunks} "
                  f"regs={regs:4d} spills={spills}")


def _cases():
    return [
        ("rmsnorm", nt._rmsnorm_kernel, {"HAS_GATE": False}, (), tiles.TilePolicy()),
        ("fused_add", nt._fused_add_rmsnorm_kernel, {}, (), tiles.TilePolicy()),
        ("gated", nt._gated_residual_kernel, {"HAS_WEIGHT": True},
         ("res_ptr", "alpha_ptr", "beta_ptr", "out_ptr"), tiles.GATED_POLICY),
        ("gated_next", nt._gated_residual_next_kernel,
         {"ALPHA_MODE": 2, "HAS_POST_WEIGHT": True, "HAS_ROUTER": True},
         ("res_ptr", "alpha_ptr", "beta_ptr", "rout_ptr", "router_ptr"), tiles.GATED_POLICY),
    ]  # fmt: skip


if __name__ == "__main__":
    main()
