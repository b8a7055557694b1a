"""ptxas on the PTX of a Triton kernel compiled for sm_90a, for the offline compile checks (no
GPU needed): registers per thread, bytes spilled, ptxas's exit status.

Shared by the compile checks (``moefuse.tools.compile_check_allgather``,
``moefuse.tools.audit_reduce_trees``, ``scripts/ptx_check.py registers``) and
``scripts/ptx_check.py compare``, which loads this file by its path (it imports triton only), so
that it serves source trees of any revision.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import tempfile
import textwrap
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

#: the H100 / H200 target every check compiles for
TARGET = GPUTarget("cuda", 90, 32)
#: the CUDA tools that ship with Triton's NVIDIA backend (ptxas, cuobjdump, nvdisasm)
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
#: the ptxas that ships with Triton's NVIDIA backend
PTXAS = os.path.join(BIN, "ptxas")


def with_constexpr_defaults(kernel, consts: dict) -> dict:
    """``consts`` plus every constexpr parameter of ``kernel`` it leaves out, at its default, as
    at a launch (else an offline compile would take it as a run-time int and compile both sides
    of every ``if`` on it)."""
    params = inspect.signature(kernel.fn).parameters
    return {
        **{
            name: p.default
            for name, p in params.items()
            if "constexpr" in str(p.annotation) and p.default is not p.empty
        },
        **consts,
    }


def tuple_fields(kernel) -> dict[str, tuple]:
    """The element names of ``kernel``'s tuple parameters, read from the kernel's own unpacking
    statements at the top level of its body or of an ``if`` there (``b_st, r_st = strides``): a
    grouped argument list keeps the names that ``types``, ``consts`` and ``divisible`` below use
    for its elements. An element that the kernel unpacks in turn (``H, Hf = width`` after
    ``width, norm = dims``: a nested tuple argument) is the tuple of its own element names."""
    params = set(inspect.signature(kernel.fn).parameters)
    body = list(ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0].body)
    unpacked = {}
    for node in body:
        if isinstance(node, ast.If):
            body.extend(node.body + node.orelse)
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.value, ast.Name)
            and (node.value.id in params or node.value.id in leaf_names(unpacked.values()))
            and isinstance(node.targets[0], ast.Tuple)
            and all(isinstance(e, ast.Name) for e in node.targets[0].elts)
        ):
            unpacked[node.value.id] = tuple(e.id for e in node.targets[0].elts)

    def nested(name: str) -> tuple:
        return tuple(nested(e) if e in unpacked else e for e in unpacked[name])

    return {name: nested(name) for name in unpacked if name in params}


def leaf_names(fields) -> list[str]:
    """The element names of ``fields`` (a tuple parameter's :func:`tuple_fields` entry, or
    several), nested tuples walked in order."""
    out = []
    for f in fields:
        out.extend(leaf_names(f) if isinstance(f, tuple) else [f])
    return out


def specialised_source(kernel, consts: dict, types: dict, divisible) -> ASTSource:
    """``kernel``'s source as a launch would compile it: ``consts`` as constexprs, the other
    arguments typed from ``types`` (pointers default to BF16, the rest to i32), and the
    divisibility-by-16 attribute on each argument for which ``divisible(name, type)`` is true,
    as the JIT's specialisation gives it (it changes vector widths and register layouts).
    A tuple parameter (:func:`tuple_fields`, nested ones too) is typed, made constant and
    specialised element by element under its elements' names, as the JIT does at a launch."""
    sig, attrs, constexprs = {}, {}, {}
    fields = tuple_fields(kernel)

    def element(elem, path):
        if isinstance(elem, tuple):
            return tuple(element(e, (*path, j)) for j, e in enumerate(elem))
        if elem in consts:
            constexprs[path] = consts[elem]
            return "constexpr"
        t = types.get(elem, "*bf16" if elem.endswith("_ptr") else "i32")
        if divisible(elem, t):
            attrs[path] = [["tt.divisibility", 16]]
        return t

    for i, name in enumerate(inspect.signature(kernel.fn).parameters):
        if name in consts:
            sig[name] = "constexpr"
            constexprs[(i,)] = consts[name]
        else:
            sig[name] = element(fields[name], (i,)) if name in fields else element(name, (i,))
    return ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)


def compile_gluon(kernel, sig: dict, consts: dict, num_warps: int):
    """A Gluon ``kernel`` compiled for :data:`TARGET` without a GPU: ``sig`` types its run-time
    arguments in their order (pointers, ``*_ptr``, marked 16-byte divisible as the JIT's
    specialisation gives them), ``consts`` its constexprs, FP fusion off as at every launch.
    Returns Triton's compiled kernel (``.asm["ptx"]``, ``.metadata.shared``)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    names = [*sig, *consts]
    source = GluonASTSource(
        fn=kernel,
        signature={**sig, **{name: "constexpr" for name in consts}},
        constexprs={(names.index(name),): v for name, v in consts.items()},
        attrs={
            (i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name.endswith("_ptr")
        },
    )
    options = {"num_warps": num_warps, "enable_fp_fusion": False}
    return triton.compile(source, target=TARGET, options=options)


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
        out = subprocess.run(
            [PTXAS, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True
        )
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spill = re.search(r"(\d+) bytes spill stores", out.stderr)
    return PtxasReport(
        int(regs.group(1)) if regs else -1,
        int(spill.group(1)) if spill else -1,
        out.returncode,
        out.stderr,
    )


def disassemble(cubin: str) -> str:
    """SASS listing of the cubin file ``cubin``: the bundled ``cuobjdump -sass``, or ``nvdisasm
    -c`` where cuobjdump does not ship; empty when neither does."""
    cuobjdump, nvdisasm = os.path.join(BIN, "cuobjdump"), os.path.join(BIN, "nvdisasm")
    if os.path.exists(cuobjdump):
        args = [cuobjdump, "-sass", cubin]
    elif os.path.exists(nvdisasm):
        args = [nvdisasm, "-c", cubin]
    else:
        return ""
    return subprocess.run(args, capture_output=True, text=True, check=True).stdout
