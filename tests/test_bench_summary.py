"""`moefuse bench summary` (speed-up over the best baseline, SUMMARY.md, plots, README block) and
`moefuse bench all` (plan, runner, progress) without a GPU."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from moefuse.bench import all as bench_all
from moefuse.bench import registry, summary

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def _write(path: Path, rows, **meta) -> Path:
    path.write_text(
        json.dumps(
            {
                "meta": {
                    "gpu": "NVIDIA H200",
                    "date": "2026-11-30",
                    "commit": "abc",
                    "command": "python -m moefuse bench x --save",
                    **meta,
                },  # fmt: skip
                "rows": rows,
            }
        )
    )
    return path


def _rows(op, shape, m, **us):
    return [{"op": op, "shape": shape, "M": m, "variant": v, "us": t} for v, t in us.items()]


def test_speedup_is_best_baseline_over_ours(tmp_path):
    # our own variants (moefuse_nopdl) and the ceiling (sm_copy) are never the baseline
    rows = _rows(
        "rmsnorm", "H=4096", 1, moefuse=2.0, moefuse_nopdl=1.0, sm_copy=0.5, eager=9.0, compile=3.0
    )
    rows += _rows("rmsnorm", "H=4096", 16, moefuse=4.0, compile=5.0, compile_inplace=3.0)
    rows += _rows("rmsnorm", "H=4096", 64, moefuse=4.0, moefuse_nopdl=5.0)  # no baseline: left out
    _write(tmp_path / "norm-h200.json", rows)
    (res,) = summary.load(tmp_path)
    assert res.family == "norm"
    got = {c.m: (c.best, c.speedup) for c in res.cases}
    assert got == {1: ("compile", 1.5), 16: ("compile_inplace", 0.75)}


def test_family_overrides_and_formats(tmp_path):
    # moe: the layer pipeline's ours is "deterministic finalize"; PDL on/off has no baseline
    rows = _rows("layer", "K=8", 1, **{"deterministic finalize": 2.0, "scatter-add finalize": 3.0})
    rows += _rows("permute->finalize", "K=8", 1, **{"PDL on": 2.0, "PDL off": 1.0})
    _write(tmp_path / "moe-h200.json", rows)
    # moe-reduction is not taken for moe; the file may name its baselines itself
    rows = _rows("moe_finalize_allreduce", "P=2", 8, moefuse=2.0, moefuse_unfused=4.0, nccl=8.0)
    _write(tmp_path / "moe-reduction-h200-p2.json", rows, baselines=["moefuse_unfused", "nccl"])
    # overhead: impl / us_per_call, no M; F.rms_norm's row ("rms_norm") is rmsnorm's baseline
    _write(
        tmp_path / "overhead-h200.json",
        [
            {"op": "rmsnorm", "impl": "moefuse", "us_per_call": 5.0, "x_rms_norm": 1.25},
            {"op": "rmsnorm", "impl": "flashinfer", "us_per_call": 10.0},
            {"op": "rms_norm", "impl": "torch", "us_per_call": 4.0},
            {"op": "moe_finalize", "impl": "moefuse", "us_per_call": 6.0, "x_rms_norm": 1.5},
            {"op": "moe_finalize", "impl": "torch", "us_per_call": 12.0},
            {"op": "moe_permute", "impl": "moefuse", "us_per_call": 4.4, "x_rms_norm": 1.1},
            {
                "op": "allreduce",
                "impl": "moefuse",
                "us_per_call": 9.0,
                "ranks": "loopback",
                "x_allreduce_residual_rmsnorm": 0.9,
            },  # fmt: skip
        ],
    )
    (tmp_path / "bench-all-h200.json").write_text(json.dumps({"runs": []}))  # not a result
    by_family = {r.family: r for r in summary.load(tmp_path)}
    assert list(by_family) == ["moe", "overhead", "moe-reduction"]  # registry order
    (layer,) = by_family["moe"].cases
    assert (layer.op, layer.best, layer.speedup) == ("layer", "scatter-add finalize", 1.5)
    (mc,) = by_family["moe-reduction"].cases
    assert (mc.best, mc.speedup) == ("moefuse_unfused", 2.0)
    got = {(c.op, c.m, c.best, c.speedup) for c in by_family["overhead"].cases}
    assert got == {("rmsnorm", None, "torch", 0.8), ("moe_finalize", None, "torch", 2.0)}
    # a host-time file says what it measures: every op against F.rms_norm's host µs
    host = (
        "eager host µs per call, single-GPU ops against F.rms_norm: worst 1.50 x "
        "(moe_finalize), 1 of 3 within 1.2 x; communication ops (loopback ranks) against "
        "allreduce_residual_rmsnorm: worst 0.90 x (allreduce), 1 of 1 within 1.5 x"
    )
    assert by_family["overhead"].host == host and by_family["moe"].host is None
    lines = summary.status_lines([by_family["overhead"]], "b.md")
    assert f"(NVIDIA H200, 2026-11-30): {host} ·" in lines and "best baseline" not in lines
    assert host in summary.overview_table([by_family["overhead"]])
    assert registry.family_of("moe-reduction-h200-p2").name == "moe-reduction"
    assert registry.family_of("moe-h200").name == "moe"
    assert registry.family_of("other-h200") is None


def test_write_summary_and_readme_block(tmp_path):
    _write(tmp_path / "norm-h200.json", _rows("rmsnorm", "H=4096", 1, moefuse=2.0, compile=3.0))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nbefore\n{summary.START}\nold table\n{summary.END}\nafter\n")
    (tmp_path / "docs").mkdir()
    docs = tmp_path / "docs" / "benchmarks.md"
    docs.write_text(f"# b\n{summary.DOC_START}\nold\n{summary.DOC_END}\ntail\n")
    written = summary.write_summary(tmp_path, readme, docs)
    md = (tmp_path / "SUMMARY.md").read_text()
    assert "| norm | norm-h200.json |" in md and "1.50 x compile (2.00 µs)" in md
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# x\nbefore\n") and "after" in text
    assert (
        "* **norm** (NVIDIA H200, 2026-11-30): 1.50 x the best baseline (median of 1 cases, "
        "1.50-1.50) · [details](docs/benchmarks.md#norm-h200)"
    ) in text
    page = docs.read_text()
    assert page.startswith("# b\n") and page.endswith("tail\n") and "\nold\n" not in page
    assert "| 1.50 / 1.50 / 1.50 | 1 / 1 |" in page and "### norm-h200" in page
    assert "[norm-h200.json](../norm-h200.json)" in page and docs in written
    pytest.importorskip("matplotlib")
    assert tmp_path / "norm-h200-speedup.png" in written
    assert (tmp_path / "norm-h200-speedup.png").stat().st_size > 0
    readme.write_text("no markers\n")
    summary.write_summary(tmp_path, readme)
    assert readme.read_text() == "no markers\n"
    # a results file without its run's command: the whole summary is refused, nothing written
    (tmp_path / "SUMMARY.md").unlink()
    data = json.loads((tmp_path / "norm-h200.json").read_text())
    del data["meta"]["command"]
    (tmp_path / "quant-h200.json").write_text(json.dumps(data))
    with pytest.raises(summary.MissingMeta, match="quant-h200.json: meta has no command"):
        summary.write_summary(tmp_path, readme)
    assert not (tmp_path / "SUMMARY.md").exists()
    assert summary.main(["--dir", str(tmp_path)]) == 2


def test_committed_summary_is_current(tmp_path):
    """bench/results/SUMMARY.md is what `moefuse bench summary` makes of the committed JSON
    (re-run it after adding results)."""
    for p in [*RESULTS.glob("*.json"), *RESULTS.glob("*.png")]:
        shutil.copy(p, tmp_path)
    results = summary.load(tmp_path)
    stale = "stale: run `python -m moefuse bench summary` from the repository root and commit"
    assert summary.summary_markdown(results) == (RESULTS / "SUMMARY.md").read_text(), stale
    root = RESULTS.parent.parent
    lines = summary.status_lines(results, "docs/benchmarks.md")
    assert f"{summary.START}\n{lines}\n{summary.END}" in (root / "README.md").read_text(), stale
    details = summary.details_markdown(results, "../bench/results/")
    page = (root / "docs" / "benchmarks.md").read_text()
    assert f"{summary.DOC_START}\n{details}\n{summary.DOC_END}" in page, stale
    for res in results:  # every status line links to a section of the page
        assert f"\n### {res.path.stem}\n" in page
    for res in results:
        if res.cases:
            assert (RESULTS / f"{res.path.stem}-speedup.png").is_file(), stale


def test_every_committed_results_file_names_its_run():
    """Every JSON under bench/results/ (results, the demo's figures, the fault bench) carries
    the meta that `bench summary` requires: GPU, date, commit, command."""
    files = sorted(RESULTS.glob("*.json"))
    assert files
    for path in files:
        meta = json.loads(path.read_text()).get("meta") or {}
        missing = [k for k in summary.REQUIRED_META if not meta.get(k)]
        assert not missing, f"{path.name}: meta has no {missing}"


# ----------------------------------------------------------------------------- bench all
def test_plan_skips_what_the_machine_cannot_run(monkeypatch):
    fams = (
        registry.Family("norm", "moefuse.bench.norm"),
        registry.Family("ghost", "moefuse.bench.no_such_module"),
        registry.Family("all-reduce", "moefuse.bench.all_reduce", min_gpus=2, multi_rank=True),
        registry.Family("overhead", "moefuse.bench.norm", quick=False, optional_world_size=True),
    )
    monkeypatch.setattr(bench_all, "FAMILIES", fams)
    jobs = {j.label: j for j in bench_all.plan(2, "OUT", quick=True, world_sizes=(2, 4))}
    assert list(jobs) == ["norm", "ghost", "all-reduce P=2", "all-reduce P=4", "overhead"]
    assert jobs["norm"].skip is None and jobs["norm"].argv == [
        "norm",
        "--save",
        "--out",
        "OUT",
        "--quick",
    ]
    assert "not in this build" in jobs["ghost"].skip
    assert jobs["all-reduce P=2"].skip is None and jobs["all-reduce P=2"].argv[-2:] == [
        "--world-size",
        "2",
    ]
    assert jobs["all-reduce P=4"].skip == "needs 4 GPUs, this machine has 2"
    assert jobs["overhead"].argv == ["overhead", "--save", "--out", "OUT", "--world-size", "2"]
    one_gpu = {j.label: j for j in bench_all.plan(1, "OUT", world_sizes=(2,))}
    assert "--world-size" not in one_gpu["overhead"].argv
    assert all(j.skip for j in bench_all.plan(0, "OUT", world_sizes=(2,)))


def test_run_command_logs_and_times_out(tmp_path, capsys):
    progress = bench_all._Progress(2)
    log = tmp_path / "x.log"
    rc, _ = bench_all.run_command(
        [sys.executable, "-c", "print('case 1'); print('case 2')"],
        log,
        progress,
        "fake",
        timeout_s=60,
    )
    assert rc == 0 and "case 2" in log.read_text()
    rc, secs = bench_all.run_command(
        [sys.executable, "-c", "import time; time.sleep(60)"], log, progress, "hang", timeout_s=1
    )
    progress.close()
    assert rc == 124 and secs < 30 and "killed after" in log.read_text()


def test_bench_all_on_a_cpu_machine(capsys):
    from moefuse import cli

    assert cli.main(["bench", "all", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "norm" in out and "all-reduce P=2" in out
    with pytest.raises(ValueError, match="--only"):
        cli.main(["bench", "all", "--only", "nope"])


def test_bench_all_runs_the_plan_then_the_summary(monkeypatch, tmp_path, capsys):
    """The orchestration of `bench all` on a pretend 1-GPU machine: runnable families run (here
    a stand-in that writes a results file), the others are recorded as skipped with the reason,
    the manifest and the summary are written, and a failure sets the exit status."""
    import torch

    from moefuse.bench import harness

    fams = (
        registry.Family("norm", "moefuse.bench.norm"),
        registry.Family("quant", "moefuse.bench.quant"),
        registry.Family("all-reduce", "moefuse.bench.all_reduce", min_gpus=2, multi_rank=True),
    )
    monkeypatch.setattr(bench_all, "FAMILIES", fams)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(harness, "gpu_slug", lambda: "fake")
    monkeypatch.setattr(harness, "run_metadata", lambda: {"gpu": "fake"})
    ran = []

    def fake_run(cmd, log, progress, label, timeout_s):
        ran.append(cmd[cmd.index("bench") + 1 :])
        if label == "quant":
            return 3, 0.1
        _write(tmp_path / "norm-fake.json", _rows("rmsnorm", "H=8", 1, moefuse=1.0, compile=2.0))
        return 0, 0.1

    monkeypatch.setattr(bench_all, "run_command", fake_run)
    rc = bench_all.main(["--out", str(tmp_path), "--world-sizes", "2"])
    assert rc == 1  # quant failed
    assert ran == [
        ["norm", "--save", "--out", str(tmp_path)],
        ["quant", "--save", "--out", str(tmp_path)],
    ]
    runs = json.loads((tmp_path / "bench-all-fake.json").read_text())["runs"]
    status = {r["label"]: r["status"] for r in runs}
    assert status == {"norm": "ok", "quant": "failed (exit 3)", "all-reduce P=2": "skipped"}
    assert "2.00 x compile" in (tmp_path / "SUMMARY.md").read_text()


def test_tp_moe_layer_example_file(tmp_path):
    # examples/tp_moe_layer.py writes <part>_fused_us / <part>_unfused_us per token count
    rows = [
        {
            "phase": "decode",
            "tokens": 1,
            "epilogue_fused_us": 12.0,
            "epilogue_unfused_us": 42.0,
            "layer_fused_us": 200.0,
            "layer_unfused_us": 250.0,
            "timing": "graph",
        },
        {
            "phase": "prefill",
            "tokens": 512,
            "epilogue_fused_us": 40.0,
            "epilogue_unfused_us": 240.0,
            "layer_fused_us": 1000.0,
            "layer_unfused_us": 900.0,
        },
    ]
    fields = {"world_size": 2, "hidden": 4096, "experts": 128, "top_k": 8, "rows": rows}
    path = tmp_path / "tp_moe_layer-h200-p2.json"
    path.write_text(json.dumps(fields))
    with pytest.raises(summary.MissingMeta, match="tp_moe_layer-h200-p2.json: meta has no gpu"):
        summary.load(tmp_path)  # refused, not summarised with question marks
    meta = {"gpu": "NVIDIA H200", "date": "2026-11-30", "commit": "abc", "command": "torchrun"}
    path.write_text(json.dumps({"meta": meta, **fields}))
    (res,) = summary.load(tmp_path)
    got = {(c.op, c.m): (c.best, round(c.speedup, 3)) for c in res.cases}
    assert got == {
        ("tp_moe_layer epilogue", 1): ("unfused", 3.5),
        ("tp_moe_layer layer", 1): ("unfused", 1.25),
        ("tp_moe_layer epilogue", 512): ("unfused", 6.0),
        ("tp_moe_layer layer", 512): ("unfused", 0.9),
    }
    assert {c.shape for c in res.cases} == {"P=2 H=4096 E=128 K=8"}
    assert "x 2" in summary.overview_table([res])  # world size from the file's own fields
