"""Is the compiled code of a single-GPU kernel the same in two source trees, at the
specialisations its launcher really produces? An offline proof (no GPU) for changes that regroup
a kernel's arguments (tuples) without meaning to change its code.

Unlike scripts/comm_ptx_compare.py, which types each argument from tables of names, this script
runs the launcher itself on CPU tensors, catches the launch (kernel, arguments, constexprs and
options), and hands the arguments to Triton's own binder for an sm_90a backend: the signature,
the constexprs and the divisibility / equal-to-one specialisation are the ones a launch on the
H200 computes from the same values (tuple arguments included, element by element). The PTX is
compiled for sm_90a and normalised as in comm_ptx_compare.py (debug sections, ``.loc`` lines,
comments and names dropped). Besides the PTX, the flattened kernel parameter list (the types
the compiled kernel takes, in order) is compared: grouping arguments into tuples must leave it
unchanged.

Cases: ``gated_residual_next_rmsnorm``'s launcher at widths 64, 2048 (one-pass tiles), 4096 and
7168 (stepped rows, unrolled and looped), with alpha as a tensor or a scalar (1.0 and not),
with and without post_weight and router_input; BF16 branch, FP32 stream, PDL on.

Run: python scripts/launch_ptx_compare.py [--before REV] [--after PATH] [--report FILE]
(``--before``: a git revision, extracted with ``git archive``, or a source tree; default HEAD;
``--after``: default this checkout.) Exit status 1 when a case differs or fails to compile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WIDTHS = (64, 2048, 4096, 7168)
#: (label, alpha kind, post_weight, router_input)
VARIANTS = (
    ("alpha=tensor post_weight router", "tensor", True, True),
    ("alpha=1.0", 1.0, False, False),
    ("alpha=0.5 post_weight", 0.5, True, False),
    ("alpha=tensor router", "tensor", False, True),
)


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

                out.append((f"_gated_residual_next_kernel [H={width} {mode} {label}]", run))
    return out


def compile_launch(kernel, args, consts) -> tuple[str, list[str]]:
    """(normalised PTX, flattened parameter types) of ``kernel[grid](*args, **consts)`` as the
    JIT would compile it for sm_90a."""
    import triton
    from comm_ptx_compare import normalise, ptxas_helpers
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
    return normalise(ck.asm["ptx"]), flat


def worker(out_path: str) -> int:
    """Run every case in this interpreter's tree, writing {case: {ptx, params} | {error}}."""
    import moefuse.norm.gated as gated
    import moefuse.norm.triton as nt

    caught = []
    nt._grid = lambda tile, n_tiles, device: (n_tiles,)  # no SM count to look up on the CPU
    gated._launch = lambda kernel, grid, args, consts, tile: caught.append((kernel, args, consts))
    index = {}
    for cid, run in _gated_next_cases():
        caught.clear()
        try:
            run()
            ((kernel, args, consts),) = caught
            ptx, flat = compile_launch(kernel, args, consts)
            index[cid] = {"ptx": ptx, "params": flat}
        except Exception as exc:  # reported per case
            index[cid] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
        print(cid, "error" if "error" in index[cid] else "ok", flush=True)
    with open(out_path, "w") as f:
        json.dump(index, f)
    return 0


def run_tree(tree: str, out_path: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(tree, "src"), HERE])
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", out_path],
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="HEAD")
    parser.add_argument("--after", default=ROOT)
    parser.add_argument("--report", default="")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker)
    from comm_ptx_compare import extract

    with tempfile.TemporaryDirectory() as tmp:
        trees = []
        for rev in (args.before, args.after):
            if not os.path.isdir(rev):
                rev = extract(rev, tempfile.mkdtemp(dir=tmp))
            trees.append(rev)
        before, after = (run_tree(t, os.path.join(tmp, f"{i}.json")) for i, t in enumerate(trees))
    rows = []
    for cid in before:
        b, a = before[cid], after.get(cid, {"error": "missing"})
        if "error" in a or "error" in b:
            verdict = "compile error: " + (a.get("error") or b.get("error"))
        elif a["params"] != b["params"]:
            verdict = "parameters differ"
        else:
            verdict = "identical" if a["ptx"] == b["ptx"] else "different"
        lines = a.get("ptx", "").count("\n")
        rows.append((cid, verdict, lines, len(a.get("params", ()))))
        print(f"{verdict:18s} {cid}")
    bad = [r for r in rows if r[1] != "identical"]
    print(f"{len(rows)} cases: {len(bad)} different or failed")
    if args.report:
        after_label = "." if os.path.abspath(args.after) == ROOT else args.after
        text = [
            f"Made by `python scripts/launch_ptx_compare.py --before {args.before} "
            f"--after {after_label}` (offline, sm_90a, Triton's binder on the launcher's "
            "own arguments; no GPU).",
            "",
            f"Verdict: {len(rows) - len(bad)} of {len(rows)} cases identical.",
            "",
            "| case | verdict | PTX lines | kernel parameters (flattened) |",
            "|---|---|---|---|",
        ]
        text += [f"| `{c}` | {v} | {n} | {k} |" for c, v, n, k in rows]
        with open(args.report, "w") as f:
            f.write("\n".join(text) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
