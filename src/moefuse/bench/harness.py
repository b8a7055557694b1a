"""Timing, ceiling and reporting helpers shared by every benchmark family.

Method: each variant is captured ``calls`` times in one
CUDA graph, rotating over enough input sets that the working set exceeds the L2 cache; the graph is
replayed and the median per-call time of the replays is reported. The bandwidth ceiling is an SM
copy kernel measured in the same run (a graph-captured ``copy_`` becomes a memcpy node that runs on
the copy engines, well below what SM kernels reach).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moefuse import knobs as _knobs
from moefuse.testing import graph_capture

L2_BYTES_DEFAULT = 60 * 1024 * 1024


def l2_bytes() -> int:
    try:
        return int(torch.cuda.get_device_properties(0).L2_cache_size)
    except Exception:
        return L2_BYTES_DEFAULT


def rotation_sets(bytes_per_call: int, cap: int = 32) -> int:
    """How many distinct input sets to rotate over so one graph sweep overflows the L2 cache."""
    need = (3 * l2_bytes()) // max(1, bytes_per_call) + 1
    return int(max(1, min(cap, need)))


def graph_time_us(
    fn: Callable[[int], object],
    *,
    calls: int = 20,
    replays: int = 15,
    warmup: int = 3,
) -> float:
    """Median per-call µs of ``fn(i)`` (i = call index) captured ``calls`` times in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(warmup):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph):  # a capture that fails costs this call, not the process
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rotated(names: list, rnd: int) -> list:
    """``names`` rotated left by ``rnd``: the order of round ``rnd`` of an interleaved timing, so
    that each variant runs first, in between and last equally often."""
    shift = rnd % len(names)
    return names[shift:] + names[:shift]


def interleaved_rounds(names: list, rounds: int, sample: Callable[[str], float]) -> dict:
    """``sample(name)`` (one timing in µs) of every name in each of ``rounds`` rounds, the order
    rotated each round (:func:`rotated`): a slow spell of the machine (clocks ramping up after a
    start, another process) lands on every variant alike instead of on whichever ran during it.
    Returns name -> ``{"us": median, "us_min", "us_max"}`` over the rounds."""
    times: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(rounds):
        for name in rotated(names, rnd):
            times[name].append(sample(name))
    return {
        name: {"us": statistics.median(t), "us_min": min(t), "us_max": max(t)}
        for name, t in times.items()
    }


def compile_baseline(fn: Callable) -> Callable:
    """``torch.compile`` (default mode, static shapes) of a baseline, allowed one graph per shape:
    with dynamo's default limit of 8 recompilations, later shapes would silently run eagerly."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 512)
    return torch.compile(fn, dynamic=False)


# Datasheet HBM bandwidth (TB/s) by the device name torch reports, most specific pattern first
# ("H20" must not take "H200"'s row, "H100 PCIe" not the SXM's). A floor is the bytes a kernel
# must move over this figure; the SM copy ceiling measured in the same run is printed beside it,
# since no kernel reaches the datasheet. A name no pattern matches gets no floor (None), never
# another GPU's figure.
DATASHEET_TBS: tuple[tuple[str, str, float], ...] = (
    (r"\bGB200\b", "GB200", 8.0),
    (r"\bB200\b", "B200", 8.0),
    (r"\bB300\b", "B300", 8.0),
    (r"\bH200\b", "H200", 4.8),  # SXM and NVL: 141 GB HBM3e
    (r"\bH20\b", "H20", 4.0),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe", 2.0),
    (r"\bH100\b.*\bNVL\b", "H100 NVL", 3.9),
    (r"\bH100\b.*(\bSXM|\b80GB HBM3\b)", "H100 SXM", 3.35),
    (r"\bH800\b.*\bPCIe\b", "H800 PCIe", 2.0),
    (r"\bH800\b", "H800 SXM", 3.35),
    (r"\bA100\b.*\b80GB\b.*\bPCIe\b", "A100 80GB PCIe", 1.935),
    (r"\bA100\b.*\bSXM4?-80GB\b", "A100 SXM 80GB", 2.039),
    (r"\bA100\b.*\b40GB\b", "A100 40GB", 1.555),
    (r"\bL40S\b", "L40S", 0.864),
)


def datasheet_gpu(name: str | None = None) -> tuple[str, float] | None:
    """``(label, TB/s)`` of the :data:`DATASHEET_TBS` row naming ``name`` (by default this
    machine's GPU), or None for a GPU the table does not know."""
    import re

    if name is None:
        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(0)
    for pattern, label, tbs in DATASHEET_TBS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label, tbs
    return None


def datasheet_tbs(name: str | None = None) -> float | None:
    """Datasheet HBM bandwidth (TB/s) of the GPU called ``name`` (default: this machine's), or
    None where :data:`DATASHEET_TBS` does not know it."""
    found = datasheet_gpu(name)
    return found[1] if found else None


def bandwidth_line(ceiling_tbs: float, name: str | None = None) -> str:
    """One line naming both bandwidths a floor is taken from: the datasheet figure of this GPU
    (or that it is unknown) and the SM copy ceiling measured in this run."""
    if name is None:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    found = datasheet_gpu(name)
    sheet = (
        f"datasheet {found[1]:.2f} TB/s ({found[0]})"
        if found
        else "datasheet bandwidth unknown for this GPU (no datasheet floor)"
    )
    return f"{name}: {sheet}; SM copy ceiling {ceiling_tbs:.2f} TB/s (read + write, this run)"


def copy_ceiling_tbs(nbytes: int = 1 << 30) -> float:
    """Bandwidth (bytes read + written per second, in TB/s) of the best of a few SM copy kernels
    (Triton, 16-bit elements, several tile sizes) over ``nbytes``."""
    from moefuse.bench._copy import COPY_CONFIGS, sm_copy

    n = nbytes // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    best = float("inf")
    for block, warps in COPY_CONFIGS:
        us = graph_time_us(lambda i, b=block, w=warps: sm_copy(src, dst, b, w), calls=5, replays=10)
        best = min(best, us)
    return 2 * nbytes / (best * 1e-6) / 1e12


def copy_time_us(nbytes: int) -> float:
    """Median µs of the best SM copy moving ``nbytes`` in all (half read, half written), timed
    like the kernels it is compared with: CUDA-graph replays rotating over input sets larger than
    L2. A short kernel cannot reach the 1 GiB ceiling (launch, ramp-up and tail are not hidden):
    this is the copy "at the same size" printed beside each case."""
    from moefuse.bench._copy import COPY_CONFIGS, sm_copy

    n = max(1, nbytes // 4)  # 16-bit elements copied
    sets = [
        (
            torch.empty(n, device="cuda", dtype=torch.bfloat16).normal_(),
            torch.empty(n, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(rotation_sets(nbytes))
    ]
    k = len(sets)
    best = float("inf")
    for block, warps in COPY_CONFIGS:
        us = graph_time_us(
            lambda i, b=block, w=warps: sm_copy(sets[i % k][0], sets[i % k][1], b, w),
            calls=max(20, k),
        )
        best = min(best, us)
    return best


def git_commit() -> str:
    env = _knobs.get("MOEFUSE_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, check=True
        )
        return out.stdout.strip()
    except Exception:
        return "unknown"


#: the option whose value is a folder of this machine: recorded as ``<out>`` when absolute
_OUT_OPTION = "--out"


def shown_args(argv: list[str]) -> str:
    """``argv`` as a results file records it: an absolute ``--out`` folder (a path of the machine
    that ran it) shown as ``<out>``; everything else as given."""
    shown, hide_next = [], False
    for arg in argv:
        if hide_next:
            shown.append("<out>" if os.path.isabs(arg) else arg)
            hide_next = False
        elif arg.startswith(_OUT_OPTION + "="):
            value = arg.split("=", 1)[1]
            shown.append(f"{_OUT_OPTION}=<out>" if os.path.isabs(value) else arg)
        else:
            shown.append(arg)
            hide_next = arg == _OUT_OPTION
    return " ".join(shown)


def module_command(module: str, argv: list[str]) -> str:
    """``python -m <module> <argv>`` as a results file records it (:func:`shown_args`)."""
    return f"python -m {module} {shown_args(argv)}".strip()


def _command_line() -> str:
    """How this process was started: ``python -m moefuse ...`` for the CLI (whose argv[0] is
    moefuse's ``__main__``), a module's or script's own path otherwise (repo-relative); the
    arguments as :func:`shown_args` shows them."""
    prog = sys.argv[0] if sys.argv else ""
    args = shown_args(sys.argv[1:])
    if prog.endswith(("moefuse/__main__.py", "-c")) or not prog:
        return f"python -m moefuse {args}".strip()
    path = Path(prog).resolve()
    try:
        shown = str(path.relative_to(Path.cwd()))
    except ValueError:
        shown = path.name
    if "/src/moefuse/" in f"/{shown}" or shown.startswith("src/moefuse/"):
        module = shown.removeprefix("src/").removesuffix(".py").replace("/", ".")
        return f"python -m {module} {args}".strip()
    return f"python {shown} {args}".strip()


def run_metadata() -> dict:
    import triton

    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return {
        "gpu": props.name if props else "cpu",
        "sm_count": props.multi_processor_count if props else 0,
        "capability": list(torch.cuda.get_device_capability(0)) if props else [],
        "gpu_count": torch.cuda.device_count(),
        "commit": git_commit(),
        "command": _command_line(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": "median per-call time of CUDA-graph replays (calls rotated over input sets "
        "larger than L2); TB/s = minimum bytes read + written / time",
    }


def gpu_slug(name: str | None = None) -> str:
    """File-name form of a GPU name ("NVIDIA H200" -> "h200"); by default this machine's GPU."""
    if name is None:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return name.lower().replace("nvidia", "").strip().replace(" ", "-")


def save_results(
    family: str,
    rows: list[dict],
    meta: dict,
    out_dir: str | os.PathLike = "bench/results",
    *,
    suffix: str = "",
    plot_metric: str = "us",
) -> tuple[Path, Path | None]:
    """Write ``<family>-<gpu><suffix>.json`` and a PNG plot beside it; returns both paths.

    Run under knobs (:func:`run_knobs`: ``MOEFUSE_*`` variables set, ``moefuse bench <family>
    --sweep``), the meta and every row get ``knobs`` and the file name ends with them, so such
    a run never overwrites the default results."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{family}-{gpu_slug()}{suffix}"
    ran_under = run_knobs()
    if ran_under:
        label = " ".join(f"{k}={v}" for k, v in ran_under.items())
        meta = {**meta, "knobs": ran_under}
        rows = [{**r, "knobs": label} for r in rows]
        stem += "".join(f"-{k.removeprefix('MOEFUSE_').lower()}-{v}" for k, v in ran_under.items())
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    png_path = out / f"{stem}.png"
    try:
        title = f"moefuse {family} on {meta.get('gpu')}"
        plot_rows(rows, png_path, title=title, metric=plot_metric)
    except ImportError:
        png_path = None
    return json_path, png_path


def plot_rows(rows: list[dict], path: Path, *, title: str, metric: str = "us") -> None:
    """One panel per (op, shape) with ``metric`` against M, one line per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in rows:
        if r.get(metric) is None:
            continue
        key = f"{r['op']} {r.get('shape', '')}".strip()
        panels.setdefault(key, {}).setdefault(r["variant"], []).append((r["M"], r[metric]))
    n = len(panels)
    if n == 0:
        return
    # one colour per variant across all panels (a panel without some variant keeps the others')
    names = sorted({v for variants in panels.values() for v in variants})
    palette = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    color = {name: palette(i % palette.N) for i, name in enumerate(names)}
    cols = min(4, n)
    nrows = (n + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.3 * nrows), squeeze=False)
    for ax, (key, variants) in zip(axes.flat, panels.items()):
        for variant, pts in sorted(variants.items()):
            pts.sort()
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                ms=3,
                label=variant,
                color=color[variant],
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(key, fontsize=8)
        ax.set_xlabel("M (tokens)", fontsize=7)
        ax.set_ylabel("µs per call" if metric == "us" else metric, fontsize=7)
        ax.tick_params(labelsize=6)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) >= 0.1 else f"{v:.3g}"
    return "-" if v is None else str(v)


def run_knobs() -> dict[str, str]:
    """The ``MOEFUSE_*`` knobs set for this run (``MOEFUSE_COMMIT`` aside): what a results file
    records beside its rows."""
    return {k: v for k, v in _knobs.settings().items() if k != "MOEFUSE_COMMIT"}


@contextlib.contextmanager
def knobs(env: dict[str, str]):
    """Set the environment knobs ``env`` (same on every rank) for the block, then restore them;
    eager launch plans are dropped around it (recorded plans do not read the environment).
    ValueError for a name that :mod:`moefuse.knobs` does not declare or a value it rejects."""
    from moefuse import _fastpath as fastpath

    for key, value in env.items():
        if key not in _knobs.KNOBS:
            raise ValueError(f"{key} is not a moefuse knob (docs/knobs.md lists them)")
        _knobs.parse(key, value)

    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    if env:
        fastpath.clear()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if env:
            fastpath.clear()


def interleaved_us(fns: dict, device, calls: int, repeats: int, prepare=None) -> dict:
    """µs per eager call of each function in ``fns`` (name -> zero-argument callable): one
    untimed sample of ``calls`` calls each first, then ``repeats`` rounds in which every function
    runs ``calls`` back-to-back calls between two synchronizations, the order rotated each round
    (:func:`moefuse.bench.harness.interleaved_rounds`). ``prepare`` (name -> callable, optional)
    runs before each of that function's samples, outside the timing. Returns name -> ``{"us":
    median, "us_min", "us_max"}``."""

    def sample(name):
        fn = fns[name]
        if prepare and name in prepare:
            prepare[name]()
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync(device)
        return (time.perf_counter() - t0) / calls * 1e6

    for name in fns:
        sample(name)
    return interleaved_rounds(list(fns), repeats, sample)


def spin(fn, device, seconds: float) -> None:
    """Call ``fn`` until ``seconds`` have passed (GPU and CPU clocks up before the first sample)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn()
        sync(device)
