"""Offline sm_90a compile checks of moefuse's kernels (no GPU): one tool, families as arguments.

    python scripts/ptx_check.py compare [FAMILY ...] [--before REV] [--after TREE] [--report F]
    python scripts/ptx_check.py registers [FAMILY ...] [options of the family's report]
    python scripts/ptx_check.py sass [--widths 4096] [--warps 8] [--ops] [--dump DIR]

``compare`` proves that a change moved code without changing it: every kernel of the named
families is compiled for sm_90a in two source trees (``--before``: a git revision or a folder,
default HEAD; ``--after``: default this checkout, uncommitted changes included) and its
normalised PTX compared (exit status 1 on a difference). The families of ``ptx/compare_tables.py``
(all-reduce, all-gather, moe-reduction, expert-norm, norm, moe, quant) type each kernel argument
from tables of names at the launchers' constexprs; those of ``ptx/compare_launch.py``
(gated-next, experts) run the launcher itself on CPU tensors and catch its launches, comparing
the SASS too. Default: every table-typed family.

``registers`` compiles each kernel of the named families at its launch tiles and reports
registers, spills (ptxas -v) and what the family's design relies on: norm, quant
(``ptx/registers_norm.py``), experts, moe-reduction, expert-norm (``ptx/registers_*.py``),
all-gather (``moefuse.tools.compile_check_allgather``). Default: every family.

``sass`` counts the static SASS instructions of the NVFP4 / FP8 quant kernels (``ptx/sass.py``).

Run from the repository root; the tool puts ``src/`` on the path itself.
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

COMPARE_TABLES = (
    "all-reduce",
    "all-gather",
    "moe-reduction",
    "expert-norm",
    "norm",
    "moe",
    "quant",
)
COMPARE_LAUNCH = ("gated-next", "experts", "linear", "experts-fp8")
REGISTERS = ("norm", "quant", "experts", "moe-reduction", "expert-norm", "all-gather")
USAGE = (
    "usage: ptx_check.py {compare,registers,sass} [FAMILY ...] [options]\n"
    f"  compare families: {', '.join(COMPARE_TABLES + COMPARE_LAUNCH)}\n"
    f"  registers families: {', '.join(REGISTERS)}\n"
    "  (`ptx_check.py <command> --help` for a command's options)"
)


def _split(args: list[str], known: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(the family names at the front of ``args``, the options after them)."""
    fams = []
    while args and not args[0].startswith("-"):
        if args[0] not in known:
            raise SystemExit(f"ptx_check.py: unknown family {args[0]!r}; known: {', '.join(known)}")
        fams.append(args.pop(0))
    return fams, args


def _keep(opts: list[str], names: tuple[str, ...]) -> list[str]:
    """The options of ``opts`` (``--name value`` or ``--name=value``) named in ``names``."""
    out, i = [], 0
    while i < len(opts):
        name = opts[i].split("=", 1)[0]
        flag = "=" in opts[i] or i + 1 == len(opts) or opts[i + 1].startswith("-")
        take = 1 if flag else 2
        if name in names:
            out += opts[i : i + take]
        i += take
    return out


def compare(args: list[str]) -> int:
    import compare_launch
    import compare_tables

    fams, opts = _split(args, COMPARE_TABLES + COMPARE_LAUNCH)
    if "-h" in opts or "--help" in opts:
        return compare_tables.main(["--help"])
    fams = fams or list(COMPARE_TABLES)
    status = 0
    tables = [f for f in fams if f in COMPARE_TABLES]
    if tables:
        status |= compare_tables.main(["--families", ",".join(tables), *opts])
    for fam in (f for f in fams if f in COMPARE_LAUNCH):
        launch_opts = _keep(opts, ("--before", "--after", "--report"))
        if "--report" in launch_opts and tables:  # one report per kind: FILE-<family>.md
            i = launch_opts.index("--report") + 1
            stem, ext = os.path.splitext(launch_opts[i])
            launch_opts[i] = f"{stem}-{fam}{ext}"
        status |= compare_launch.main(["--family", fam, *launch_opts])
    return status


def registers(args: list[str]) -> int:
    fams, opts = _split(args, REGISTERS)
    help_only = "-h" in opts or "--help" in opts
    status = 0
    for fam in fams or REGISTERS:
        print(f"# {fam}", flush=True)
        if fam in ("norm", "quant"):
            import registers_norm

            only = (
                []
                if help_only or "--only" in opts
                else ["--only", registers_norm.FAMILY_CASES[fam]]
            )
            status |= registers_norm.main([*only, *opts]) or 0
        elif fam == "all-gather":
            from moefuse.tools import compile_check_allgather

            status |= compile_check_allgather.main(opts) or 0
        else:
            module = __import__(f"registers_{fam.replace('-', '_')}")
            status |= module.main(opts) or 0
        if help_only:
            break
    return status


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        print(__doc__)
        return 0
    sys.path[:0] = [os.path.join(HERE, "ptx"), os.path.join(ROOT, "src")]
    command, rest = argv[0], list(argv[1:])
    if command == "compare":
        return compare(rest)
    if command == "registers":
        return registers(rest)
    if command == "sass":
        import sass

        return sass.main(rest)
    print(USAGE)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
