"""``python -m moefuse bench summary``: the markdown summary and the speed-up plots, rebuilt from
the saved benchmark JSON files alone (no GPU needed).

For every ``<family>-<gpu>[-pP].json`` under ``--dir`` (default ``bench/results``):

* speed-up of a case (op, shape, M) = the best (smallest) baseline time / moefuse's time, both
  from the same run (> 1: moefuse is faster). Which variant is ours and which are baselines is
  decided by :func:`moefuse.bench.registry.roles`; cases without a baseline are left out.
* ``<stem>-speedup.png``: one panel per (op, shape), speed-up against M on a linear axis with
  1.0 marked, each point labelled with the baseline that was best there (the µs-per-call plots
  beside it, ``<stem>.png``, are log-log: a 1.3 x gain is hard to see on them);
* ``SUMMARY.md``: an overview table (one line per file) and a table per file (op x M).

Every results file carries ``meta`` with at least :data:`REQUIRED_META` (GPU, date, commit,
command): a file without them is refused (:class:`MissingMeta`, nothing written), never summarised
with question marks. The overhead family's files measure host time, not kernels: their line is
the eager host µs of every op against ``F.rms_norm``'s (worst ratio, how many ops within the
1.2 x bar; the communication ops against ``allreduce_residual_rmsnorm``'s, bar 1.5 x).

Two marked blocks in the repository's docs are generated from the same files; nothing outside a
block changes, and a file without its markers is left alone:

* ``--write PATH`` (default: ``docs/benchmarks.md`` when it holds the markers and ``--dir`` is
  ``bench/results``): the overview table and every file's op x M table, between
  ``<!-- bench-details:start -->`` and ``<!-- bench-details:end -->``;
* ``--readme PATH`` (default: ``README.md`` likewise): one status line per results file (its
  median speed-up and a link to its section of the ``--write`` file), between
  ``<!-- bench-summary:start -->`` and ``<!-- bench-summary:end -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from moefuse.bench.registry import FAMILIES, family_of, roles

START, END = "<!-- bench-summary:start -->", "<!-- bench-summary:end -->"
DOC_START, DOC_END = "<!-- bench-details:start -->", "<!-- bench-details:end -->"
DOCS = "docs/benchmarks.md"
#: what every results file's ``meta`` must name: a figure without them cannot be traced
REQUIRED_META = ("gpu", "date", "commit", "command")
#: host-time bars of the overhead family (moefuse.bench.overhead.add_ratios)
HOST_BAR, COMM_HOST_BAR = 1.2, 1.5


class MissingMeta(ValueError):
    """Results files whose ``meta`` lacks a field of :data:`REQUIRED_META`."""


@dataclass
class Case:
    op: str
    shape: str
    m: int | None
    ours_us: float
    best: str  # the best baseline's variant name
    best_us: float

    @property
    def speedup(self) -> float:
        return self.best_us / self.ours_us


@dataclass
class Result:
    path: Path
    family: str
    meta: dict
    cases: list[Case]
    host: str | None = None  # the overhead family's host-time figure (host_time_figure)


def _row_fields(r: dict) -> tuple[str | None, float | None]:
    """(variant, µs) of a row in any family's format (overhead: ``impl`` / ``us_per_call``)."""
    variant = r.get("variant", r.get("impl"))
    us = r.get("us", r.get("us_per_call"))
    return variant, (float(us) if isinstance(us, (int, float)) and us > 0 else None)


def cases_of(family_name: str, meta: dict, rows: list[dict]) -> list[Case]:
    """Speed-up cases of one results file: one per (op, shape, M) with ours and a baseline."""
    fam = family_of(family_name)
    aliases = dict(fam.op_aliases) if fam else {}
    groups: dict[tuple, dict[str, float]] = {}
    declared: dict[tuple, set[str]] = {}  # baselines of rows that carry "role": "baseline"
    for r in rows:
        variant, us = _row_fields(r)
        if variant is None or us is None:
            continue
        op = str(r.get("op", ""))
        key = (aliases.get(op, op), str(r.get("shape", "")), r.get("M"))
        groups.setdefault(key, {})[str(variant)] = us
        if "role" in r:
            declared.setdefault(key, set())
            if r["role"] == "baseline":
                declared[key].add(str(variant))
    out = []
    for (op, shape, m), times in groups.items():
        ours, baselines = roles(fam, meta, set(times))
        if (op, shape, m) in declared:  # the rows say which are baselines (moe-reduction)
            baselines = declared[(op, shape, m)]
        if ours is None or not baselines:
            continue
        best = min(baselines, key=lambda v: (times[v], v))
        out.append(Case(op, shape, m, times[ours], best, times[best]))
    return out


#: examples/tp_moe_layer.py's rows: ``<part>_fused_us`` against ``<part>_unfused_us`` per token
#: count, for the MoE epilogue alone and for the whole layer
_EXAMPLE_PARTS = ("epilogue", "layer")


def _example_rows(data: dict) -> tuple[dict, list[dict]]:
    """(meta, rows) of a results file written by examples/tp_moe_layer.py, in the families'
    format: variant "moefuse" (the fused epilogue) against "unfused" per (part, shape, M)."""
    meta = dict(data.get("meta") or {})
    meta.setdefault("world_size", data.get("world_size"))
    shape = (
        f"P={data.get('world_size')} H={data.get('hidden')} E={data.get('experts')} "
        f"K={data.get('top_k')}"
    )
    rows = []
    for r in data["rows"]:
        for part in _EXAMPLE_PARTS:
            for variant, kind in (("moefuse", "fused"), ("unfused", "unfused")):
                us = r.get(f"{part}_{kind}_us")
                if us is not None:
                    rows.append(
                        {
                            "op": f"tp_moe_layer {part}",
                            "shape": shape,
                            "M": r.get("tokens"),
                            "variant": variant,
                            "us": us,
                        }
                    )
    return meta, rows


def host_time_figure(rows: list[dict]) -> str | None:
    """What an overhead file measures, in one line: every single-GPU op's eager host µs against
    ``F.rms_norm``'s (worst ratio, how many ops within 1.2 x) and every communication op's
    against ``allreduce_residual_rmsnorm``'s (worst, how many within 1.5 x); None without
    such ratios."""

    def worst(pairs, bar, label):
        x, op = max(pairs)
        n = sum(v <= bar for v, _ in pairs)
        return f"{label}: worst {x:.2f} x ({op}), {n} of {len(pairs)} within {bar} x"

    ours = [r for r in rows if isinstance(r, dict) and r.get("impl") == "moefuse"]
    single, comm_gpus, comm = [], [], []
    for r in ours:
        x, op = r.get("x_rms_norm"), str(r["op"])
        if isinstance(x, (int, float)) and not r.get("ranks") and not op.startswith("allreduce"):
            single.append((float(x), op))
        elif isinstance(r.get("x_allreduce_residual_rmsnorm"), (int, float)):
            comm.append((float(r["x_allreduce_residual_rmsnorm"]), op))
        elif isinstance(x, (int, float)):  # files from before that ratio: F.rms_norm's, 2 x
            comm_gpus.append((float(x), op))
    parts = []
    if single:
        parts.append(worst(single, HOST_BAR, "single-GPU ops against F.rms_norm"))
    if comm:
        kinds = sorted({str(r.get("ranks")) for r in ours if "x_allreduce_residual_rmsnorm" in r})
        label = (
            f"communication ops ({' and '.join(kinds)} ranks) against allreduce_residual_rmsnorm"
        )
        parts.append(worst(comm, COMM_HOST_BAR, label))
    if comm_gpus:
        parts.append(worst(comm_gpus, 2.0, "communication ops against F.rms_norm"))
    return "eager host µs per call, " + "; ".join(parts) if parts else None


def load(results_dir: str | Path) -> list[Result]:
    """Every benchmark results file under ``results_dir`` (files without ``rows`` are skipped),
    in the registry's family order. Raises :class:`MissingMeta` naming every results file whose
    ``meta`` lacks a field of :data:`REQUIRED_META`."""
    order = {f.name: i for i, f in enumerate(FAMILIES)}
    results = []
    refused = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
            continue
        fam = family_of(path.stem)
        name = fam.name if fam else path.stem
        meta, rows = data.get("meta") or {}, data["rows"]
        missing = [k for k in REQUIRED_META if not meta.get(k)]
        if missing:
            refused.append(f"{path.name}: meta has no {', '.join(missing)}")
            continue
        host = host_time_figure(rows) if name == "overhead" else None
        if any(f"{_EXAMPLE_PARTS[0]}_fused_us" in r for r in rows if isinstance(r, dict)):
            meta, rows = _example_rows(data)
        results.append(Result(path, name, meta, cases_of(name, meta, rows), host))
    if refused:
        raise MissingMeta(
            "refusing results files without their run's meta (GPU, date, commit, command; "
            "moefuse.bench.harness.run_metadata writes them): " + "; ".join(refused)
        )
    results.sort(key=lambda r: (order.get(r.family, len(order)), r.path.name))
    return results


# ----------------------------------------------------------------------------- markdown
def _fmt_x(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def _fmt_us(us: float) -> str:
    return f"{us:.2f}" if us < 100 else f"{us:.0f}"


def overview_table(results: list[Result]) -> str:
    lines = [
        "| family | file | GPU | date | commit | cases | speed-up over best baseline "
        "(min / median / max) | cases >= 1.0 x | plots |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        xs = sorted(c.speedup for c in res.cases)
        m = res.meta
        gpu = str(m["gpu"]) + (f" x {m['world_size']}" if m.get("world_size") else "")
        stem = res.path.stem
        plots = [f"[µs]({stem}.png)"] if res.path.with_suffix(".png").exists() else []
        if xs:
            plots.append(f"[speed-up]({stem}-speedup.png)")
        span = (
            f"{_fmt_x(xs[0])} / {_fmt_x(statistics.median(xs))} / {_fmt_x(xs[-1])}"
            if xs
            else "no baseline in the file"
        )
        wins = f"{sum(x >= 1.0 for x in xs)} / {len(xs)}" if xs else "-"
        if res.host:  # host time, not a kernel race: say what it measures
            span, wins = res.host, "-"
        lines.append(
            f"| {res.family} | {res.path.name} | {gpu} | {str(m['date'])[:10]} "
            f"| {str(m['commit'])[:10]} | {len(xs)} | {span} | {wins} | "
            f"{' · '.join(plots) or '-'} |"
        )
    return "\n".join(lines)


def _label_m(m) -> str:
    return "M" if m is None else f"M={m}"


def detail_table(res: Result) -> str:
    """op/shape rows x M columns; a cell is 'speed-up x best baseline (moefuse µs)'."""
    ms = sorted({c.m for c in res.cases}, key=lambda m: (m is None, m or 0))
    keys = list(dict.fromkeys((c.op, c.shape) for c in res.cases))
    cell = {(c.op, c.shape, c.m): c for c in res.cases}
    lines = [
        "| op | shape | " + " | ".join(_label_m(m) for m in ms) + " |",
        "|---|---|" + "---|" * len(ms),
    ]
    for op, shape in keys:
        cells = []
        for m in ms:
            c = cell.get((op, shape, m))
            cells.append(
                "" if c is None else f"{_fmt_x(c.speedup)} x {c.best} ({_fmt_us(c.ours_us)} µs)"
            )
        lines.append(f"| {op} | {shape} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary_markdown(results: list[Result]) -> str:
    parts = [
        "# moefuse benchmark summary",
        "",
        "Generated by `python -m moefuse bench summary` from the JSON files in this directory "
        "(written by `python -m moefuse bench <family> --save` or `bench all`). Speed-up = the "
        "best baseline's µs / moefuse's µs for the same op, shape and M in the same run (> 1: "
        "moefuse is faster); times are medians of CUDA-graph replays (see each file's `meta`). "
        "Baselines are every non-moefuse variant of the run except the SM-copy ceiling "
        "(`moefuse.bench.registry`).",
        "",
        overview_table(results),
    ]
    for res in results:
        if not res.cases:
            continue
        m = res.meta
        parts += [
            "",
            f"## {res.family}: {res.path.name}",
            "",
            f"{m['gpu']}, commit {m['commit']}, {m['date']}; "
            f"command `{m['command']}`. "
            + (f"{res.host[0].upper()}{res.host[1:]}. " if res.host else "")
            + "Cell: speed-up x the best baseline at that M (moefuse's µs per call).",
            "",
            detail_table(res),
        ]
    return "\n".join(parts) + "\n"


def _where(res: Result) -> str:
    m = res.meta
    gpu = str(m["gpu"]) + (f" x {m['world_size']}" if m.get("world_size") else "")
    return f"{gpu}, {str(m['date'])[:10]}"


def status_lines(results: list[Result], details: str) -> str:
    """One line per results file: its median speed-up over the best baseline, the range, and a
    link to its section of the details page ``details`` (a relative link)."""
    lines = []
    for res in results:
        xs = sorted(c.speedup for c in res.cases)
        if res.host:
            figure = res.host
        elif xs:
            figure = (
                f"{_fmt_x(statistics.median(xs))} x the best baseline (median of "
                f"{len(xs)} cases, {_fmt_x(xs[0])}-{_fmt_x(xs[-1])})"
            )
        else:
            figure = "times only (no baseline in the file)"
        lines.append(
            f"* **{res.family}** ({_where(res)}): {figure} · "
            f"[details]({details}#{res.path.stem.lower()})"
        )
    return "\n".join(lines)


def details_markdown(results: list[Result], prefix: str) -> str:
    """The overview table and one section per results file (heading = the file's stem), with
    links to the results files prefixed by ``prefix`` (the path from the page to them)."""
    parts = [overview_table(results).replace("](", f"]({prefix}")]
    for res in results:
        m = res.meta
        link = f"[{res.path.name}]({prefix}{res.path.name})"
        parts += [
            "",
            f"### {res.path.stem}",
            "",
            f"{res.family} · {link} · {_where(res)} · commit {m['commit']} · "
            f"command `{m['command']}`.",
        ]
        if res.host:
            parts += ["", f"{res.host[0].upper()}{res.host[1:]}."]
        if res.cases:
            parts += [
                "",
                "Cell: speed-up x the best baseline at that M (moefuse's µs per call).",
                "",
                detail_table(res),
            ]
        else:
            parts += ["", "No baseline in the file: see its plot and JSON for the times."]
    return "\n".join(parts)


# ----------------------------------------------------------------------------- plots
def plot_speedup(res: Result, path: Path) -> Path | None:
    """The speed-up plot of one results file (None when it has no case or no matplotlib)."""
    if not res.cases:
        return None
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[str, list[Case]] = {}
    for c in res.cases:  # cases without M (host overhead: one per op) share one bar panel
        key = f"{c.op} {c.shape}".strip() if c.m is not None else "per op (no M)"
        panels.setdefault(key, []).append(c)
    cols = min(4, len(panels))
    nrows = (len(panels) + cols - 1) // cols
    bars = max((len(c) for k, c in panels.items() if c[0].m is None), default=0)
    width = max(4.2 * cols, 6.0, 0.45 * bars + 2.0)
    fig, axes = plt.subplots(nrows, cols, figsize=(width, 3.3 * nrows + 0.3), squeeze=False)
    for ax, (key, cases) in zip(axes.flat, panels.items()):
        by_m = [c for c in cases if c.m is not None]
        if by_m:  # speed-up against M
            by_m.sort(key=lambda c: c.m)
            xs, ys = [c.m for c in by_m], [c.speedup for c in by_m]
            ax.plot(xs, ys, marker="o", ms=3, color="tab:blue")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("M (tokens)", fontsize=7)
            labelled = by_m
        else:  # no M (host overhead): one bar per op
            xs, ys = list(range(len(cases))), [c.speedup for c in cases]
            ax.bar(xs, ys, color="tab:blue")
            ax.set_xticks(xs, [f"{c.op} {c.shape}".strip() for c in cases], rotation=45, ha="right")
            labelled = cases
        for x, c in zip(xs, labelled):
            ax.annotate(
                c.best,
                (x, c.speedup),
                fontsize=5,
                rotation=30,
                xytext=(2, 3),
                textcoords="offset points",
            )
        ax.axhline(1.0, color="tab:red", lw=1, ls="--")
        ax.set_ylim(0, max(1.2, 1.15 * max(ys)))
        ax.set_title(key, fontsize=8)
        ax.set_ylabel("speed-up over best baseline", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    meta = res.meta
    fig.suptitle(
        f"moefuse {res.family}: speed-up over the best baseline\n"
        f"{meta['gpu']}, {str(meta['date'])[:10]}, {res.path.name}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- entry points
def has_markers(path: Path, start: str = START, end: str = END) -> bool:
    """Whether ``path`` is a file holding ``start`` before ``end``."""
    if not path.is_file():
        return False
    text = path.read_text()
    return start in text and end in text and text.index(start) < text.index(end)


def update_readme(readme: Path, table: str, start: str = START, end: str = END) -> bool:
    """Replace the text between the markers in ``readme`` by ``table``; False when the file or
    its markers are missing (nothing written then)."""
    if not has_markers(readme, start, end):
        return False
    head, rest = readme.read_text().split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{table}\n{end}{tail}")
    return True


def write_summary(
    results_dir: str | Path = "bench/results",
    readme: str | Path | None = None,
    docs: str | Path | None = None,
) -> list[Path]:
    """Write SUMMARY.md and the speed-up plots under ``results_dir``, the details block of
    ``docs`` and the status block of ``readme`` (each when given and marked); returns the paths."""
    out = Path(results_dir)
    results = load(out)
    written = []
    for res in results:
        png = plot_speedup(res, out / f"{res.path.stem}-speedup.png")
        if png is not None:
            written.append(png)
    md = out / "SUMMARY.md"
    md.write_text(summary_markdown(results))
    written.append(md)
    if docs is not None:
        block = details_markdown(results, _rel(out, Path(docs).parent))
        if update_readme(Path(docs), block, DOC_START, DOC_END):
            written.append(Path(docs))
    if readme is not None:
        page = Path(docs) if docs is not None else Path(DOCS)
        lines = status_lines(results, _rel_file(page, Path(readme).parent))
        if update_readme(Path(readme), lines):
            written.append(Path(readme))
    return written


def _rel_file(path: Path, base: Path) -> str:
    """Relative link from the folder ``base`` to ``path`` (``..`` steps where needed)."""
    return Path(os.path.relpath(path.resolve(), base.resolve())).as_posix()


def _rel(results_dir: Path, base: Path) -> str:
    """Link prefix from a page's folder ``base`` to ``results_dir`` (e.g. ``../bench/results/``)."""
    return _rel_file(results_dir, base) + "/"


def first_paragraph(doc: str) -> str:
    """A module docstring's first paragraph as one line (argparse descriptions)."""
    return " ".join(doc.strip().split("\n\n")[0].split())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="moefuse bench summary", description=first_paragraph(__doc__)
    )
    parser.add_argument("--dir", default="bench/results", help="results directory")
    parser.add_argument(
        "--readme",
        default=None,
        help="file whose marked block receives one status line per results file "
        "(default: README.md when it has the markers)",
    )
    parser.add_argument(
        "--write",
        default=None,
        metavar="PATH",
        help="page whose marked block receives the overview and per-file tables "
        f"(default: {DOCS} when it has the markers)",
    )
    args = parser.parse_args(argv)
    if not Path(args.dir).is_dir():
        print(
            f"moefuse bench summary: no results directory {args.dir!r} here; run it from the "
            "repository root or pass --dir with the path of bench/results"
        )
        return 2
    readme, docs = args.readme, args.write
    # the README and the docs page describe the committed results: only they update them by default
    default_dir = Path(args.dir).resolve() == Path("bench/results").resolve()
    if readme is None and default_dir and has_markers(Path("README.md")):
        readme = "README.md"
    if docs is None and default_dir and has_markers(Path(DOCS), DOC_START, DOC_END):
        docs = DOCS
    try:
        written = write_summary(args.dir, readme, docs)
    except MissingMeta as exc:
        print(f"moefuse bench summary: {exc}")
        return 2
    for path in written:
        print("wrote", path)
    return 0
