"""``python -m moefuse bench all``: every benchmark family this machine can run, one after the
other, then the markdown summary and speed-up plots (``moefuse bench summary``).

Each family runs as ``python -m moefuse bench <family> --save --out DIR`` in its own process (a
failing or hanging family cannot take the others down, and each starts with an empty GPU and
compile cache); its output goes to ``DIR/<family>-<gpu>[-pP].log`` and is echoed with a progress
bar (tqdm when installed, else plain lines). Multi-GPU families run at every world size in
``--world-sizes`` (default: 2, 4, 8) that this machine has GPUs for, and are skipped otherwise;
families whose module is not in this build are skipped with that reason. A manifest of what ran,
what was skipped and why, and each family's exit status and wall time is written to
``DIR/bench-all-<gpu>.json``. Exit status: 0 when every family that ran succeeded, 1 when one
failed, 2 when nothing could run (no GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from moefuse.bench.registry import FAMILIES, Family, missing_reason
from moefuse.bench.summary import first_paragraph

#: NVLink multicast stays off for every multi-GPU run (the machines' NVLS is not usable)
NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@dataclass
class Job:
    family: Family
    label: str  # e.g. "allreduce P=2"
    argv: list[str]  # arguments after `python -m moefuse bench`
    suffix: str  # of the log and results files: "" or "-pP"
    skip: str | None = None  # reason it does not run here


def plan(
    gpus: int,
    out_dir: str,
    *,
    quick: bool = False,
    only: list[str] | None = None,
    world_sizes: tuple[int, ...] = (2, 4, 8),
) -> list[Job]:
    """The jobs of one ``bench all`` run on a machine with ``gpus`` CUDA GPUs."""
    jobs = []
    for fam in FAMILIES:
        if only and fam.name not in only:
            continue
        base = [fam.name, "--save", "--out", out_dir] + (["--quick"] if quick and fam.quick else [])
        missing = missing_reason(fam)
        if not fam.multi_rank:
            skip = missing or (None if gpus >= 1 else "needs a CUDA GPU")
            fits = [p for p in world_sizes if 2 <= p <= gpus]
            if fam.optional_world_size and fits:  # its communication ops too, at the largest P
                base += ["--world-size", str(max(fits))]
            jobs.append(Job(fam, fam.name, base, "", skip))
            continue
        sizes = [p for p in world_sizes if p >= fam.min_gpus]
        for p in sizes:
            skip = missing or (None if gpus >= p else f"needs {p} GPUs, this machine has {gpus}")
            jobs.append(
                Job(fam, f"{fam.name} P={p}", [*base, "--world-size", str(p)], f"-p{p}", skip)
            )
    return jobs


class _Progress:
    """tqdm over the jobs when installed; otherwise numbered plain lines."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, unit="family", dynamic_ncols=True)
        self.total, self.done = total, 0

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_description(label)
        else:
            print(f"[{self.done + 1}/{self.total}] {label}", flush=True)

    def line(self, label: str, text: str) -> None:
        if self.bar is not None:
            self.bar.write(f"{label}: {text}")
        else:
            print(f"  {label}: {text}", flush=True)

    def finish(self, label: str, status: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{label} {status}")
            self.bar.update(1)
        else:
            print(f"[{self.done}/{self.total}] {label}: {status}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_command(
    cmd: list[str], log_path: Path, progress: _Progress, label: str, timeout_s: float
) -> tuple[int, float]:
    """Run ``cmd``, teeing its output (stdout + stderr) into ``log_path`` and the progress
    display; returns (exit status, wall seconds). Past ``timeout_s`` the process and its
    children (the multi-GPU families spawn one per rank) are killed and the status is 124."""
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in NO_MULTICAST.items()}}
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.monotonic()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        # a process group of its own, so that a timeout can end the whole process group
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )

        def pump():  # a thread, so that a family printing nothing cannot stall the deadline
            for text in proc.stdout:
                log.write(text)
                progress.line(label, text.rstrip())

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        reader.join(timeout=10)
        if rc == 124:
            log.write(f"\nkilled after {timeout_s:.0f} s\n")
    return rc, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moefuse bench all", description=first_paragraph(__doc__))
    parser.add_argument("--out", default="bench/results", help="results directory")
    parser.add_argument("--quick", action="store_true", help="pass --quick to the families")
    parser.add_argument("--only", default="", help="comma-separated families (default: all)")
    parser.add_argument(
        "--world-sizes",
        default="2,4,8",
        help="world sizes for the multi-GPU families (those that fit)",
    )
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per family")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--no-summary", action="store_true", help="skip bench summary after")
    args = parser.parse_args(argv)

    import torch

    from moefuse.bench import harness

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    only = [f for f in args.only.split(",") if f]
    unknown = sorted(set(only) - {f.name for f in FAMILIES})
    if unknown:
        raise ValueError(f"moefuse bench all: argument '--only' names unknown families {unknown}")
    sizes = tuple(int(p) for p in args.world_sizes.split(",") if p)
    jobs = plan(gpus, args.out, quick=args.quick, only=only, world_sizes=sizes)
    runnable = [j for j in jobs if j.skip is None]
    print(f"moefuse bench all: {gpus} GPU(s); {len(runnable)} of {len(jobs)} runs")
    for j in jobs:
        print(
            f"  {j.label:<16} "
            + (f"skipped: {j.skip}" if j.skip else "python -m moefuse bench " + " ".join(j.argv))
        )
    if args.dry_run:
        return 0
    if not runnable:
        print("nothing to run on this machine")
        return 2

    slug = harness.gpu_slug()
    out = Path(args.out)
    progress = _Progress(len(runnable))
    records = [
        {"family": j.family.name, "label": j.label, "status": "skipped", "reason": j.skip}
        for j in jobs
        if j.skip
    ]
    try:
        for j in runnable:
            progress.start(j.label)
            cmd = [sys.executable, "-m", "moefuse", "bench", *j.argv]
            log = out / f"{j.family.name}-{slug}{j.suffix}.log"
            rc, secs = run_command(cmd, log, progress, j.label, args.timeout)
            status = "ok" if rc == 0 else f"failed (exit {rc})"
            progress.finish(j.label, status)
            records.append(
                {
                    "family": j.family.name,
                    "label": j.label,
                    "status": status,
                    "rc": rc,
                    "seconds": round(secs, 1),
                    "log": str(log),
                    "command": " ".join(cmd[1:]),
                }
            )
    finally:
        progress.close()
    meta = harness.run_metadata()
    (out / f"bench-all-{slug}.json").write_text(
        json.dumps({"meta": meta, "runs": records}, indent=1) + "\n"
    )
    for r in records:
        print(
            f"  {r['label']:<16} {r['status']}"
            + (f" ({r['seconds']} s)" if "rc" in r else f": {r['reason']}")
        )
    if not args.no_summary:
        from moefuse.bench import summary

        summary.main(["--dir", str(out)])
    return 1 if any(r.get("rc") for r in records) else 0
