"""``bench hf_moe`` (eager): interleaved timing rounds and the CPU smoke run of the script."""

import json
from pathlib import Path

import pytest
import torch

from moefuse.bench import harness, hf_moe


def test_interleaved_rounds_rotate_the_order_and_skip_the_first():
    """Every function runs ``calls`` calls per round, one untimed round first, the order rotated
    by one each round; a slow spell in one round lands on every function of that round."""
    order = []
    fns = {name: (lambda name=name: order.append(name)) for name in "abc"}
    out = harness.interleaved_us(fns, torch.device("cpu"), calls=2, repeats=3)
    rounds = [order[i : i + 6 : 2] for i in range(0, len(order), 6)]
    assert rounds == [list("abc"), list("abc"), list("bca"), list("cab")]
    for row in out.values():
        assert row["us_min"] <= row["us"] <= row["us_max"]


def test_eager_smoke_run_writes_both_tables_and_leaves_no_patch(tmp_path, monkeypatch):
    """The script's tiny CPU run: block rows for every variant at every T with the spread of the
    rounds (the patched block's router runs router_topk), and a decode pair from alternating
    rounds (patched, then unpatched again)."""
    pytest.importorskip("transformers")
    from moefuse.integrations import transformers as integ

    patched = []
    real_patch = integ.patch
    monkeypatch.setattr(
        integ, "patch", lambda model, **kw: patched.append(model) or real_patch(model, **kw)
    )
    result = hf_moe.main(["--smoke", "--decode-repeats", "2", "--out", str(tmp_path)])
    rows = result["rows"]
    block = [r for r in rows if r["op"] == "qwen3_moe_block"]
    variants = (*hf_moe.IMPLS, hf_moe.PATCHED_BLOCK)
    assert {(r["variant"], r["M"]) for r in block} == {
        *((v, t) for v in variants for t in (1, 16)),
        *((v, 40) for v in variants if v != "batched_mm"),
    }
    assert all(r["us_min"] <= r["us"] <= r["us_max"] for r in block)
    assert all("x_best_transformers" in r for r in block if r["variant"].startswith("moefuse"))
    decode = {r["variant"]: r for r in rows if r["op"] == "decode"}
    assert decode["moefuse patch"]["experts"] == "moefuse"
    assert all("tok_s" in r for r in decode.values())  # timed; any value (two tiny lengths)
    # a verdict per token count and the decode, in the JSON too (values: CPU timings, any)
    bars = json.loads(Path(result["json"]).read_text())["meta"]["bars"]
    assert bars == result["bars"] and len(bars) == 4
    assert all(line.startswith(("BAR PASS: eager", "BAR FAIL: eager")) for line in bars)
    block_model, *decode_models = patched  # the block's router, then the decode model's rounds
    assert integ.is_patched(block_model) and len(decode_models) >= 3  # report, warm-up, round
    assert len({id(m) for m in decode_models}) == 1 and not integ.is_patched(decode_models[0])


def test_compiled_replays_are_timed_in_rotated_rounds():
    """``--compiled``'s step and prefill timings: the variants alternate round by round (on CPU,
    where there is no graph, the captured function's eager calls stand in for replays)."""
    from moefuse.bench.hf_compiled import interleaved_replay_us, time_variants

    order = []
    items = {name: (None, lambda name=name: order.append(name)) for name in ("shipped", "patched")}
    rows = [{"variant": "shipped"}, {"variant": "patched"}]
    time_variants(rows, items, torch.device("cpu"), replays=1, samples=4)
    assert order == ["shipped", "patched", "patched", "shipped"] * 2
    assert all(r["us_min"] <= r["us"] <= r["us_max"] for r in rows)
    assert set(interleaved_replay_us(items, torch.device("cpu"), 1, 1)) == {"shipped", "patched"}


def test_generate_passes_merge_into_one_row():
    """The generate stage's passes: the median rate, every pass's rate, a flag only if it held in
    every pass, the most graph breaks and CUDA-graph skips; a failed pass makes the row an error
    row."""
    from moefuse.bench.hf_compiled import merge_passes

    a = {"op": "g", "tok_s": 10.0, "tok_s_with_prefill": 8.0, "same": True, "graph_breaks": 0}
    a["cudagraph_skips"] = 1
    b = {**a, "tok_s": 30.0, "tok_s_with_prefill": 9.0, "same": False, "graph_breaks": 2}
    b["cudagraph_skips"] = 0
    c = {**a, "tok_s": 20.0}
    row = merge_passes([a, b, c])
    assert (row["tok_s"], row["tok_s_with_prefill"], row["tok_s_passes"]) == (
        20.0,
        8.0,
        [10, 30, 20],
    )
    assert row["same"] is False and row["graph_breaks"] == 2 and row["cudagraph_skips"] == 1
    assert merge_passes([a, {"op": "g", "error": "boom"}])["error"] == "boom"


def test_fp8_smoke_run_records_the_shipped_error_and_every_variant(tmp_path):
    """``--fp8``'s tiny CPU run: the shipped FP8 model's forward fails here (transformers' FP8
    kernels come from the Hub and need a GPU) and is recorded; the experts and decode rows of
    the three models that run, the logits rows against both FP32 evaluations, the verdicts."""
    pytest.importorskip("transformers.integrations.finegrained_fp8")
    from moefuse.bench import hf_fp8

    result = hf_moe.main(["--fp8", "--smoke", "--out", str(tmp_path)])
    rows = result["rows"]
    assert rows[0]["variant"] == hf_fp8.SHIPPED_FP8 and rows[0]["error"]
    runs = (hf_fp8.SHIPPED, hf_fp8.PATCHED, hf_fp8.PATCHED_FP8)
    experts = {(r["variant"], r["M"]) for r in rows if r["op"] == "experts"}
    assert experts == {(v, t) for v in runs for t in (1, 8)}
    assert {r["variant"] for r in rows if r["op"] == "eager decode"} == set(runs)
    logits = {r["variant"]: r for r in rows if r["op"] == "logits"}
    assert "mean_abs_vs_own_fp32" in logits[hf_fp8.PATCHED_FP8]
    assert "mean_abs_vs_patched_fp8" in logits[hf_fp8.REFERENCE_OPS]
    meta = json.loads(Path(result["json"]).read_text())["meta"]
    assert meta["bars"] == result["bars"] and len(meta["bars"]) == 1
    assert "faithful FP8" in meta["bars"][0]
    # the run's own options, its machine's output folder hidden
    assert meta["command"] == "python -m moefuse.bench.hf_moe --fp8 --smoke --out <out>"


def test_results_record_the_command_without_machine_folders():
    from moefuse.bench.harness import module_command, shown_args

    assert shown_args(["--x", "--out", "/abs/dir", "--n", "2"]) == "--x --out <out> --n 2"
    assert shown_args(["--out=/abs/dir"]) == "--out=<out>"
    assert shown_args(["--out", "bench/results", "/abs/not-an-out"]) == (
        "--out bench/results /abs/not-an-out"
    )
    assert module_command("m.n", []) == "python -m m.n"
