"""ptxas on the PTX of a Triton kernel compiled for sm_90a, for the offline compile checks (no
GPU needed): registers per thread, bytes spilled, ptxas's exit status.

Shared by scripts/compile_check*.py, compile_expert_norm.py and sweep_comm_variants.py (run as
``python scripts/<name>.py``: this folder is then first on ``sys.path``).
"""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

#: the H100 / H200 target every check compiles for
TARGET = GPUTarget("cuda", 90, 32)
#: the ptxas that ships with Triton's NVIDIA backend
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def with_constexpr_defaults(kernel, consts: dict) -> dict:
    """``consts`` plus every constexpr parameter of ``kernel`` it leaves out, at its default, as
    at a launch (else an offline compile would take it as a run-time int and compile both sides
    of every ``if`` on it)."""
    params = inspect.signature(kernel.fn).parameters
    return {**{name: p.default for name, p in params.items()
               if "constexpr" in str(p.annotation) and p.default is not p.empty}, **consts}


def specialised_source(kernel, consts: dict, types: dict, divisible) -> ASTSource:
    """``kernel``'s source as a launch would compile it: ``consts`` as constexprs, the other
    arguments typed from ``types`` (pointers default to BF16, the rest to i32), and the
    divisibility-by-16 attribute on each argument for which ``divisible(name, type)`` is true,
    as the JIT's specialisation gives it (it changes vector widths and register layouts)."""
    sig, attrs = {}, {}
    for i, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in consts:
            sig[name] = "constexpr"
            continue
        sig[name] = types.get(name, "*bf16" if name.endswith("_ptr") else "i32")
        if divisible(name, sig[name]):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)


@dataclass(frozen=True)
class PtxasReport:
    """``regs``: registers per thread (-1 when ptxas did not say); ``spills``: bytes of spill
    stores (-1 likewise); ``returncode``: ptxas's exit status; ``log``: its stderr."""

    regs: int
    spills: int
    returncode: int
    log: str


def ptxas_report(ptx: str) -> PtxasReport:
    """Assemble ``ptx`` for sm_90a with ``ptxas -v`` (output discarded) and read its report."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", path, "-o", os.devnull],
                             capture_output=True, text=True)  # fmt: skip
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr)
    return PtxasReport(int(regs.group(1)) if regs else -1, int(spill.group(1)) if spill else -1,
                       out.returncode, out.stderr)  # fmt: skip
