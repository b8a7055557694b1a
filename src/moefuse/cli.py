"""``python -m moefuse demo | bench <family> | env`` — argument parsing only."""

from __future__ import annotations

import argparse
import importlib
import sys

BENCH_FAMILIES = (
    "norm",
    "moe",
    "moe-experts",
    "moe-experts-fp8",
    "fp8-linear",
    "quant",
    "all-reduce",
    "overhead",
    "all-gather",
    "moe-reduction",
    "expert-norm",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moefuse")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="the epilogue ops, routed experts, router, a communication fusion and a patched "
        "transformers model, each checked against its reference (timed on a GPU)",
    )
    demo.add_argument("--hidden", type=int, default=None, help="hidden size (default: by device)")
    demo.add_argument("--tokens", type=int, default=None, help="token count (default: by device)")
    demo.add_argument(
        "--no-compile", action="store_true", help="GPU: skip the torch.compile times (faster start)"
    )
    demo.add_argument(
        "--save", default=None, metavar="DIR", help="also write demo-<gpu>.txt / .json / .png"
    )
    bench = sub.add_parser(
        "bench",
        help="benchmarks; see `moefuse bench <family> --help`",
        epilog="Any family also takes --sweep KNOB=a,b (repeatable): one run per value of the "
        "MOEFUSE_* knob (docs/knobs.md), each results file labelled with its knobs.",
    )
    # all / summary: every family in turn / the markdown summary from saved JSON (bench.all,
    # bench.summary)
    bench.add_argument("family", choices=(*BENCH_FAMILIES, "all", "summary"))
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="arguments of the family benchmark")
    env = sub.add_parser("env", help="versions, GPUs, peer access, PDL, what impl='auto' picks")
    env.add_argument("--json", action="store_true", help="one JSON object instead of text")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from moefuse.demo import run_demo

        return run_demo(
            hidden=args.hidden,
            tokens=args.tokens,
            with_compile=not args.no_compile,
            save=args.save,
        )
    if args.command == "bench":
        from moefuse.bench import sweep

        try:
            sweeps, rest = sweep.split_sweeps(args.rest)
        except ValueError as exc:
            print(f"moefuse bench {args.family}: {exc}")
            return 2
        missing = _bench_requirement(args.family, rest)
        if missing:
            print(f"moefuse bench {args.family}: {missing}")
            return 2
        module = importlib.import_module(f"moefuse.bench.{args.family.replace('-', '_')}")
        if sweeps:
            return sweep.run(module.main, sweeps, rest)
        return module.main(rest)
    if args.command == "env":
        from moefuse.env import main as env_main

        return env_main(["--json"] if args.json else [])
    return 2


def _bench_requirement(family: str, rest: list[str]) -> str | None:
    """What this machine lacks for ``bench family`` (None: it can run; help texts always can)."""
    if family in ("all", "summary") or {"-h", "--help"} & set(rest):
        return None
    import torch

    from moefuse.bench.registry import FAMILIES

    need = next((f.min_gpus for f in FAMILIES if f.name == family), 1)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have >= need:
        return None
    if have == 0:
        what = "a CUDA GPU" if need == 1 else f"{need} CUDA GPUs"
        return f"needs {what}; none is visible here"
    return f"needs {need} CUDA GPUs; {have} visible here"


if __name__ == "__main__":
    sys.exit(main())
