"""Is the compiled code of a single-GPU kernel the same in two source trees, at the
specialisations its launcher really produces? An offline proof (no GPU) for changes that regroup
a kernel's arguments (tuples) or retune a policy without meaning to change a given launch.

Unlike the table-typed families (``compare_tables``), which type each argument from tables of
names, these families run the launcher itself on CPU tensors, catch the launch (kernel,
arguments, constexprs and options), and hand the arguments to Triton's own binder for an sm_90a
backend: the signature, the constexprs and the divisibility / equal-to-one specialisation are
the ones a launch on the H200 computes from the same values (tuple arguments included, element
by element). The PTX is compiled for sm_90a and normalised as in compare_tables.py (debug
sections, ``.loc`` lines, comments and names dropped). Besides the PTX, the flattened kernel
parameter list (the types the compiled kernel takes, in order) is compared: grouping arguments
into tuples must leave it unchanged. The launch grid is compared as well. Constexprs are not
compared by name (a constexpr the kernel no longer reads may be dropped, one it ignores at this
value added): the report lists the ones that differ beside the verdict, and the PTX shows
whether any mattered. The PTX is also assembled for sm_90a with the ptxas bundled with Triton
and disassembled with its ``cuobjdump`` (``moefuse.tools.ptxas.disassemble``). Verdicts:
``identical`` (the same normalised PTX); ``same SASS`` (the PTX differs, the SASS instructions,
addresses and encodings left out, do not); ``reordered`` (the same normalised PTX lines, some in
another order, and different SASS); ``different``; ``parameters differ`` (with ``(same
SASS)`` where the machine code is the same: a parameter no instruction reads); ``grid A -> B``;
``error: ...``.

Families (``ptx_check.py compare gated-next experts experts-fp8 linear``):
* ``gated-next``: ``gated_residual_next_rmsnorm``'s launcher at widths 64, 2048 (one-pass tiles),
  4096 and 7168 (stepped rows, unrolled and looped), with alpha as a tensor or a scalar (1.0 and
  not), with and without post_weight and router_input; BF16 branch, FP32 stream, PDL on.
* ``experts``: ``moe_experts``' launcher (``launch_moe_experts``: the plan kernel when it runs,
  gate|up, down, the finalize when it is not fused) at decode token counts, T = 1, 2 and 4, for
  the Qwen3-30B-A3B, Mixtral-8x7B and DeepSeek-V3 expert shapes (:data:`EXPERT_SHAPES`); BF16,
  random distinct expert ids, PDL on. Every launch of a call is a case of its own.
* ``experts-fp8``: ``moe_experts``' FP8 launcher (``launch_moe_experts_fp8``: the quantization
  launches, the plan kernel when it runs, gate|up, down, the finalize when it is not fused) at
  :data:`EXPERT_SHAPES` x :data:`EXPERT_FP8_TOKENS` (the decode launches and the TMA launches
  above 512 token-slots), E4M3 weights with FP32 block scales, stacked gate|up, PDL on.
* ``linear``: ``fp8_linear``'s launcher (``launch_fp8_linear``: the activation's quantization,
  the product, the split programs' reduce when it runs) at the default launches of
  :data:`LINEAR_SHAPES` x :data:`LINEAR_ROWS`.

Run: python scripts/ptx_check.py compare gated-next|experts|experts-fp8|linear [--before REV]
     [--after REV]
     [--report FILE]
(``--before`` / ``--after``: a git revision, extracted with ``git archive``, or a source tree;
default HEAD / this checkout.) Exit status 1 when a case is neither ``identical`` nor ``same
SASS``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # scripts/ptx/ -> the repository

WIDTHS = (64, 2048, 4096, 7168)
#: (label, alpha kind, post_weight, router_input)
VARIANTS = (
    ("alpha=tensor post_weight router", "tensor", True, True),
    ("alpha=1.0", 1.0, False, False),
    ("alpha=0.5 post_weight", 0.5, True, False),
    ("alpha=tensor router", "tensor", False, True),
)
#: (model, hidden H, experts E, top-k K, expert width I) of the ``experts`` family
EXPERT_SHAPES = (
    ("Qwen3-30B-A3B", 2048, 128, 8, 768),
    ("Mixtral-8x7B", 4096, 8, 2, 14336),
    ("DeepSeek-V3", 7168, 256, 8, 2048),
)
EXPERT_TOKENS = (1, 2, 4)


def _gated_next_cases():
    """(case id, callable that runs the launcher once) for every case."""
    import torch

    from moefuse.norm import gated, tiles

    out = []
    for width in WIDTHS:
        stepped = tiles.row_tile(width, tiles.GATED_POLICY).stepped
        for mode in ("unroll", "loop") if stepped else ("one-pass",):
            for label, alpha, post, router in VARIANTS:
                m = 4

                def run(width=width, mode=mode, alpha=alpha, post=post, router=router, m=m):
                    f32 = torch.float32
                    b = torch.randn(m, width, dtype=torch.bfloat16)
                    res = torch.randn(m, width, dtype=f32)
                    nw = torch.randn(width, dtype=torch.bfloat16)
                    be = torch.rand(width, dtype=f32)
                    a = torch.rand(width, dtype=f32) if alpha == "tensor" else None
                    scalar = 1.0 if alpha == "tensor" else alpha
                    pw = torch.randn(width, dtype=torch.bfloat16) if post else None
                    ro = torch.empty(m, width, dtype=f32)
                    ffn = torch.empty(m, width, dtype=torch.bfloat16)
                    rt = torch.empty(m, width, dtype=f32) if router else None
                    unroll = None if mode == "one-pass" else mode == "unroll"
                    gated.launch_gated_residual_next_rmsnorm(
                        b,
                        res,
                        nw,
                        a,
                        scalar,
                        be,
                        pw,
                        ro,
                        ffn,
                        rt,
                        1e-6,
                        1e-5,
                        0.0,
                        1.0,
                        True,
                        unroll=unroll,
                    )

                out.append((f"H={width} {mode} {label}", run))
    return out


def _routing(tokens: int, hidden: int, experts: int, top_k: int, weights_dtype):
    """``(x [T, H] BF16, distinct expert ids [T, K], routing weights [T, K], out [T, H])`` of
    the experts families, drawn from a generator seeded with the token count."""
    import torch

    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16, generator=gen)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen).to(weights_dtype)
    return x, ids, weights, torch.empty(tokens, hidden, dtype=torch.bfloat16)


def _experts_cases():
    """(case label, callable that runs ``launch_moe_experts`` once) for every case; the weights
    are left uninitialised (only their shapes, strides and alignment reach the compiler)."""
    import torch

    from moefuse.moe.experts_triton import launch_moe_experts

    out = []
    for model, hidden, experts, top_k, inter in EXPERT_SHAPES:
        for tokens in EXPERT_TOKENS:

            def run(hidden=hidden, experts=experts, top_k=top_k, inter=inter, tokens=tokens):
                bf16 = torch.bfloat16
                x, ids, weights, out = _routing(tokens, hidden, experts, top_k, bf16)
                gate_up = torch.empty(experts, 2 * inter, hidden, dtype=bf16)
                down = torch.empty(experts, hidden, inter, dtype=bf16)
                launch_moe_experts(
                    x, gate_up, down, ids, weights, out, None, None, 1.0, False, True
                )

            out.append((f"{model} T={tokens}", run))
    return out


#: (N, K) of the ``linear`` family's weights and its token counts M (decode split programs, the
#: 64-row and 128-row TMA launches)
LINEAR_SHAPES = ((4096, 2048), (7168, 16384), (576, 7168))
LINEAR_ROWS = (1, 16, 64, 600, 2048)


def _linear_cases():
    """(case label, callable that runs ``launch_fp8_linear`` once): the default launches of
    :data:`LINEAR_SHAPES` x :data:`LINEAR_ROWS`, FP32 weight scales, BF16 input and bias, PDL on."""
    import torch

    from moefuse.moe.linear_triton import launch_fp8_linear

    out = []
    for n, k in LINEAR_SHAPES:
        for m in LINEAR_ROWS:

            def run(n=n, k=k, m=m):
                x = torch.randn(m, k, dtype=torch.bfloat16)
                weight = torch.empty(n, k, dtype=torch.float8_e4m3fn)
                scale = torch.ones(-(-n // 128), -(-k // 128))
                bias = torch.zeros(n, dtype=torch.bfloat16)
                out = torch.empty(m, n, dtype=torch.bfloat16)
                launch_fp8_linear(x, weight, scale, bias, None, out, True)

            out.append((f"N={n} K={k} M={m}", run))
    return out


#: token counts of the ``experts-fp8`` family: the decode launches (inline plan, the plan kernel)
#: and, above 512 token-slots, the TMA launches with the slots on the MMA's M side
EXPERT_FP8_TOKENS = (1, 4, 16, 128)


def _experts_fp8_cases():
    """(case label, callable that runs ``launch_moe_experts_fp8`` once) at
    :data:`EXPERT_SHAPES` x :data:`EXPERT_FP8_TOKENS`: E4M3 weights (uninitialised), FP32 block
    scales, stacked gate|up, random distinct expert ids, PDL on."""
    import torch

    from moefuse.moe.experts_fp8 import launch_moe_experts_fp8

    out = []
    for model, hidden, experts, top_k, inter in EXPERT_SHAPES:
        for tokens in EXPERT_FP8_TOKENS:

            def run(hidden=hidden, experts=experts, top_k=top_k, inter=inter, tokens=tokens):
                e4m3 = torch.float8_e4m3fn
                x, ids, weights, out = _routing(tokens, hidden, experts, top_k, torch.float32)
                gate_up = torch.empty(experts, 2 * inter, hidden, dtype=e4m3)
                down = torch.empty(experts, hidden, inter, dtype=e4m3)
                gs = torch.ones(experts, -(-2 * inter // 128), -(-hidden // 128))
                ds = torch.ones(experts, -(-hidden // 128), -(-inter // 128))
                launch_moe_experts_fp8(
                    x, gate_up, gs, down, ds, ids, weights, out, None, None, 1.0, False, True
                )

            out.append((f"{model} T={tokens}", run))
    return out


def _catch_gated_next(caught: list) -> None:
    import moefuse.norm.gated as gated
    import moefuse.norm.triton as nt

    nt._grid = lambda tile, n_tiles, device: (n_tiles,)  # no SM count to look up on the CPU
    gated._launch = lambda kernel, grid, args, consts, tile: caught.append(
        (kernel, grid, args, consts)
    )


def _catch_experts(caught: list) -> None:
    """Every module of a tree that launches a kernel of ``launch_moe_experts`` (the plan kernel
    sat in ``experts_triton`` before it had a module of its own) records instead."""
    _catch_modules(
        caught, ("moefuse.moe.experts_triton", "moefuse.moe.experts_plan", "moefuse.moe.triton")
    )


def _catch_modules(caught: list, names) -> None:
    """The modules ``names`` of a tree (those it has) record their launches in ``caught``."""
    import importlib
    import importlib.util

    def record(kernel, grid, *args, **consts):
        caught.append((kernel, grid, args, consts))

    for name in names:
        if importlib.util.find_spec(name) is not None:
            module = importlib.import_module(name)
            if hasattr(module, "launch"):
                module.launch = record


def _catch_linear(caught: list) -> None:
    """Every module of a tree that launches a kernel of ``fp8_linear`` records instead."""
    _catch_modules(
        caught,
        (
            "moefuse.moe.linear_triton",
            "moefuse.moe.linear_tma",
            "moefuse.moe.experts_fp8_quant",
            "moefuse.quant.group_triton",
        ),
    )


def _catch_experts_fp8(caught: list) -> None:
    """Every module of a tree that launches a kernel of ``launch_moe_experts_fp8`` records
    instead."""
    _catch_modules(
        caught,
        (
            "moefuse.moe.experts_fp8",
            "moefuse.moe.experts_fp8_tma",
            "moefuse.moe.experts_fp8_quant",
            "moefuse.moe.experts_plan",
            "moefuse.moe.experts_triton",
            "moefuse.moe.triton",
            "moefuse.quant.group_triton",
        ),
    )


#: verdicts of a case whose launch runs the same machine code
PASS = ("identical", "same SASS")
#: family -> (cases, installs the launch catcher into a list)
FAMILIES = {
    "gated-next": (_gated_next_cases, _catch_gated_next),
    "experts": (_experts_cases, _catch_experts),
    "linear": (_linear_cases, _catch_linear),
    "experts-fp8": (_experts_fp8_cases, _catch_experts_fp8),
}


def compile_launch(kernel, args, consts) -> tuple[str, list[str], str]:
    """(normalised PTX, flattened parameter types, SASS instructions) of
    ``kernel[grid](*args, **consts)`` as the JIT would compile it for sm_90a."""
    import triton
    from compare_tables import normalise, ptxas_helpers
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    TARGET = ptxas_helpers().TARGET
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, kwargs = binder(*args, **consts)
    options, sig, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, spec, kwargs)
    ck = triton.compile(
        ASTSource(kernel, sig, constexprs, attrs), target=TARGET, options=options.__dict__
    )
    flat = []

    def walk(t):
        if isinstance(t, tuple):
            for e in t:
                walk(e)
        elif t != "constexpr":
            flat.append(t)

    for t in sig.values():
        walk(t)
    return normalise(ck.asm["ptx"]), flat, sass_text(ck.asm["cubin"])


def sass_text(cubin: bytes) -> str:
    """The SASS instructions of ``cubin`` (moefuse.tools.ptxas.disassemble: the disassembler
    bundled with Triton), one per line, without addresses, encodings or the kernel's name;
    empty when no disassembler ships."""
    from compare_tables import ptxas_helpers

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = ptxas_helpers().disassemble(f.name)
    instructions = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", out)
    return "\n".join(instructions)


def _constexprs(kernel, consts: dict) -> dict:
    """The constexpr parameters of a launch (compile options such as num_warps left out), as
    printable values; ``PTX`` (inline PTX on, always true off the interpreter) is dropped."""
    names = {p.name for p in kernel.params if p.is_constexpr}
    return {k: repr(v) for k, v in sorted(consts.items()) if k in names and k != "PTX"}


def worker(family: str, out_path: str) -> int:
    """Run every case of ``family`` in this interpreter's tree, writing
    {case: {ptx, params, grid, constexprs} | {error}}; a case that launches several kernels
    gives one entry per launch, ``<kernel> [<case>]`` (``<kernel> #2 [<case>]`` for the same
    kernel's second launch)."""
    cases, install = FAMILIES[family]
    caught = []
    install(caught)
    index = {}
    for label, run in cases():
        caught.clear()
        try:
            run()
        except Exception as exc:  # reported per case
            index[f"? [{label}]"] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(label, "error", flush=True)
            continue
        for kernel, grid, args, consts in caught:
            cid, nth = f"{kernel.fn.__name__} [{label}]", 2
            while cid in index:  # the same kernel launched again in this case
                cid, nth = f"{kernel.fn.__name__} #{nth} [{label}]", nth + 1
            try:
                ptx, flat, sass = compile_launch(kernel, args, consts)
                index[cid] = {
                    "ptx": ptx,
                    "sass": sass,
                    "params": flat,
                    "grid": [int(g) for g in grid],
                    "constexprs": _constexprs(kernel, consts),
                }
            except Exception as exc:  # reported per case
                index[cid] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(cid, "error" if "error" in index[cid] else "ok", flush=True)
    with open(out_path, "w") as f:
        json.dump(index, f)
    return 0


def _constexpr_change(before: dict, after: dict) -> str:
    """``-NAME=v`` for a constexpr only ``before`` passes, ``+NAME=v`` for one only ``after``
    passes, ``NAME: v -> w`` for a changed value; empty when they match."""
    b, a = before.get("constexprs", {}), after.get("constexprs", {})
    parts = [f"-{k}={v}" for k, v in b.items() if k not in a]
    parts += [f"+{k}={v}" for k, v in a.items() if k not in b]
    parts += [f"{k}: {b[k]} -> {a[k]}" for k in b if k in a and a[k] != b[k]]
    return ", ".join(parts)


def run_tree(tree: str, family: str, out_path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(tree, "src"), HERE])
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--family", family, "--worker", out_path],
        env=env,
        capture_output=True,
        text=True,
        cwd=tree,
    )
    if proc.returncode:
        raise RuntimeError(
            f"the cases of {tree} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
        )
    with open(out_path) as f:
        return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="ptx_check.py compare (launcher-captured families)",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--family", choices=sorted(FAMILIES), default="gated-next")
    parser.add_argument("--before", default="HEAD")
    parser.add_argument("--after", default=ROOT)
    parser.add_argument("--report", default="")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.family, args.worker)
    from compare_tables import extract

    with tempfile.TemporaryDirectory() as tmp:
        trees = []
        for rev in (args.before, args.after):
            if not os.path.isdir(rev):
                rev = extract(rev, tempfile.mkdtemp(dir=tmp))
            trees.append(rev)
        before, after = (
            run_tree(t, args.family, os.path.join(tmp, f"{i}.json")) for i, t in enumerate(trees)
        )
    rows = []
    for cid in list(before) + [c for c in after if c not in before]:
        b = before.get(cid, {"error": "missing before"})
        a = after.get(cid, {"error": "missing after"})
        if "error" in a or "error" in b:
            verdict = "error: " + (a.get("error") or b.get("error"))
        elif a["params"] != b["params"]:
            verdict = "parameters differ"
            if a["sass"] and a["sass"] == b["sass"]:  # a parameter no instruction reads
                verdict += " (same SASS)"
        elif a["grid"] != b["grid"]:
            verdict = f"grid {b['grid']} -> {a['grid']}"
        elif a["ptx"] == b["ptx"]:
            verdict = "identical"
        elif a["sass"] and a["sass"] == b["sass"]:
            verdict = "same SASS"  # the PTX differs, the machine code ptxas makes of it does not
        elif sorted(a["ptx"].splitlines()) == sorted(b["ptx"].splitlines()):
            verdict = "reordered"  # the same instruction lines, some in another order
        else:
            verdict = "different"
        lines = a.get("ptx", "").count("\n")
        sass_b, sass_a = (len(x.get("sass", "").splitlines()) for x in (b, a))
        sass = f"{sass_a}" if sass_a == sass_b else f"{sass_b} -> {sass_a}"
        grid = "x".join(str(g) for g in a.get("grid", ()))
        change = _constexpr_change(b, a)
        rows.append((cid, verdict, grid, lines, sass, len(a.get("params", ())), change))
        print(f"{verdict:18s} {cid}" + (f"  (constexprs: {change})" if change else ""))
    bad = [r for r in rows if r[1] not in PASS]
    print(f"{len(rows)} cases: {len(bad)} different or failed")
    if args.report:
        same_ptx = sum(r[1] == "identical" for r in rows)
        after_label = "." if os.path.abspath(args.after) == ROOT else args.after
        text = [
            f"Made by `python scripts/ptx_check.py compare {args.family} --before "
            f"{args.before} --after {after_label}` (offline, sm_90a, Triton's binder on the "
            "launcher's own arguments; no GPU).",
            "",
            f"Verdict: {len(rows) - len(bad)} of {len(rows)} cases compile to the same machine "
            f"code with the same kernel parameters and grid ({same_ptx} of them to the same PTX "
            "too).",
            "",
            "| case | verdict | grid | PTX lines | SASS instructions | kernel parameters "
            "(flattened) | constexprs "
            "that differ |",
            "|---|---|---|---|---|---|---|",
        ]
        text += [f"| `{r[0]}` | " + " | ".join(map(str, r[1:])) + " |" for r in rows]
        with open(args.report, "w") as f:
            f.write("\n".join(text) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
