"""``moefuse bench <family> --sweep KNOB=a,b [--sweep KNOB2=c,d] [family arguments]``.

Runs the family's benchmark once per combination of the knob values (:mod:`moefuse.knobs`),
each under ``harness.knobs``: the variables are set for the run (and inherited by the rank
processes of the multi-GPU families), then restored. Every results file then records the knobs
it ran under (``harness.save_results``: the ``knobs`` field of its meta and of each row, and
the knobs in the file name), so the runs of a sweep never overwrite each other or the default
results.

Only knobs sweep this way; tile policies that are module constants have their own options
(``bench quant --sweep``: a plain ``--sweep`` with no ``=`` is left to the family).
"""

from __future__ import annotations

import itertools

from moefuse import knobs


def split_sweeps(rest: list[str]) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """``(sweeps, family_args)``: each ``--sweep NAME=v1,v2`` (or ``--sweep=NAME=v1,v2``) of
    ``rest`` as ``(NAME, [v1, v2])``, the other arguments in order. ValueError naming the
    argument for an undeclared knob, a value the knob rejects, or a knob given twice."""
    sweeps: list[tuple[str, list[str]]] = []
    family_args: list[str] = []
    i = 0
    while i < len(rest):
        arg = rest[i]
        spec = None
        if arg.startswith("--sweep=") and "=" in arg[len("--sweep=") :]:
            spec = arg[len("--sweep=") :]
        elif (
            arg == "--sweep"
            and i + 1 < len(rest)
            and "=" in rest[i + 1]
            and not rest[i + 1].startswith("-")
        ):
            spec = rest[i + 1]
            i += 1
        if spec is None:
            family_args.append(arg)
        else:
            sweeps.append(_parse(spec, [name for name, _ in sweeps]))
        i += 1
    return sweeps, family_args


def _parse(spec: str, seen: list[str]) -> tuple[str, list[str]]:
    name, _, values = spec.partition("=")
    if name not in knobs.KNOBS:
        raise ValueError(f"--sweep {spec}: {name} is not a moefuse knob (docs/knobs.md)")
    if name in seen:
        raise ValueError(f"--sweep {spec}: {name} is swept twice")
    out = [v.strip() for v in values.split(",")]
    if not all(out):
        raise ValueError(f"--sweep {spec}: an empty value (give NAME=a,b)")
    for v in out:
        try:
            knobs.parse(name, v)
        except ValueError as exc:
            raise ValueError(f"--sweep {spec}: {exc}") from None
    return name, out


def combinations(sweeps: list[tuple[str, list[str]]]) -> list[dict[str, str]]:
    """Every combination of the swept values, the first knob slowest."""
    names = [name for name, _ in sweeps]
    return [dict(zip(names, values)) for values in itertools.product(*(v for _, v in sweeps))]


def run(family_main, sweeps: list[tuple[str, list[str]]], family_args: list[str]) -> int:
    """``family_main(family_args)`` once per combination (:func:`combinations`) under those
    knobs; the worst exit status."""
    from moefuse.bench import harness

    status = 0
    for env in combinations(sweeps):
        print("== sweep: " + " ".join(f"{k}={v}" for k, v in env.items()), flush=True)
        with harness.knobs(env):
            status = max(status, family_main(list(family_args)) or 0)
    return status
