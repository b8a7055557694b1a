"""Merge the JSON files of several runs of one multi-GPU benchmark into one results file.

A full sweep of ``bench all-gather`` or ``bench moe-reduction`` can outlast one 10-minute device
call; it then runs as one call per width (``--hidden``), each with ``--save --out DIR_i``. This
joins their rows into ``<out>/<family>-<gpu>-p<P>.json`` with the PNG beside it, recomputes the bar
lines of the whole table with the benchmark's own ``bar_checks``, and keeps every run's
metadata (commit, command, peer-copy bandwidth) under ``meta["runs"]``.

    python scripts/merge_bench_results.py --family allgather --out bench/results A.json B.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from moefuse.bench import all_gather, harness, moe_reduction  # noqa: E402

BARS = {
    "all-gather": lambda rows, p: all_gather.bar_checks(rows),
    "moe-reduction": lambda rows, p: moe_reduction.bar_checks(rows, p),
}


def merge(family: str, paths: list[Path], note: str = "") -> tuple[list[dict], dict]:
    """(rows of every run, metadata: the first run's, with each run's under "runs" and
    ``note`` — say there which rows of which run were left out, if any — under "merge_note")."""
    runs = [json.loads(p.read_text()) for p in paths]
    rows = [r for run in runs for r in run["rows"]]
    worlds = {run["meta"].get("world_size") for run in runs}
    if len(worlds) != 1:
        raise SystemExit(f"runs of different world sizes: {sorted(worlds, key=str)}")
    meta = dict(runs[0]["meta"])
    meta["runs"] = [
        {
            k: run["meta"].get(k)
            for k in ("commit", "command", "date", "peer_copy_GBps")
            if k in run["meta"]
        }
        for run in runs
    ]
    meta["command"] = " ; ".join(run["meta"].get("command", "?") for run in runs)
    meta["bar"] = BARS[family](rows, worlds.pop())
    if note:
        meta["merge_note"] = note
    return rows, meta


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(BARS), required=True)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--note", default="", help="how the inputs were chosen (kept in meta)")
    parser.add_argument("inputs", nargs="+", type=Path)
    args = parser.parse_args()
    rows, meta = merge(args.family, args.inputs, args.note)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # named after the GPU the runs measured, not this machine's
    stem = out / f"{args.family}-{harness.gpu_slug(meta['gpu'])}-p{meta['world_size']}"
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    harness.plot_rows(
        rows, stem.with_suffix(".png"), title=f"moefuse {args.family} on {meta['gpu']}"
    )
    for line in meta["bar"]:
        print(line)
    print("wrote", stem.with_suffix(".json"), stem.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
