"""The performance-bar verdicts the benchmarks print (pure functions of the rows; no GPU)."""

from __future__ import annotations

from moefuse.bench.all_reduce import bar_checks


def _rows(world_size, h, m, times):
    return [{"H": h, "M": m, "P": world_size, "variant": v, "us": us} for v, us in times.items()]


BASE = {"nccl+compile": 20.0, "symm1+compile": 18.0, "symm2+compile": float("nan")}


def test_p8_bar_needs_twice_the_best_unfused_at_small_m():
    rows = _rows(8, 7168, 64, {"moefuse": 8.9, **BASE}) + _rows(
        8, 7168, 512, {"moefuse": 17.0, **BASE}
    )
    lines = bar_checks(rows, 8)
    assert "BAR PASS: P=8 H=7168 M=64: 8.90 us <= best unfused 18.00 / 2" in lines
    assert "BAR PASS: P=8 H=7168 M=512: 17.00 us <= best unfused 18.00" in lines
    assert not any("P=8 H=7168 M=512" in line and "/ 2" in line for line in lines)
    lines = bar_checks(_rows(8, 7168, 1, {"moefuse": 9.5, **BASE}), 8)
    assert "BAR FAIL: P=8 H=7168 M=1: 9.50 us <= best unfused 18.00 / 2" in lines


def test_p2_flashinfer_bar_reports_both_methods():
    times = {"moefuse": 5.60, "moefuse_same_inputs": 5.75, **BASE}
    lines = bar_checks(_rows(2, 4096, 64, times), 2)
    assert any(line.startswith("BAR PASS") and "5.60 us (inputs rotated)" in line for line in lines)
    assert any(line.startswith("BAR FAIL") and "5.75 us (same inputs" in line for line in lines)


def test_hf_eager_bars_read_every_token_count_and_the_decode():
    from moefuse.bench.hf_bars import eager_bars

    def block(m, x):
        return {"op": "qwen3_moe_block", "variant": "moefuse", "M": m, "us": 9.0,
                "x_best_transformers": x}  # fmt: skip

    rows = [block(16, 3.7), block(1, 0.62), {"op": "qwen3_moe_block", "variant": "grouped_mm"}]
    rows.append({"op": "decode", "variant": "moefuse patch", "tok_s": 260.4, "x_shipped": 1.43})
    lines = eager_bars(rows)
    assert lines[0] == "BAR FAIL: eager block T=1: 9.0 us, 0.62 x best transformers >= 1.0"
    assert lines[1].startswith("BAR PASS: eager block T=16")
    assert lines[2] == "BAR PASS: eager decode: 260.4 tok/s, 1.43 x shipped >= 1.0"
    assert eager_bars([])[0].startswith("BAR MISSING: eager block")
    assert eager_bars([])[1].startswith("BAR MISSING: eager decode")
    no_decode = eager_bars(rows[:-1])  # the block rows alone: the decode bar is missing, not met
    assert no_decode[-1].startswith("BAR MISSING: eager decode") and len(no_decode) == 3


def test_hf_compiled_bars_need_each_ratio_and_no_graph_break():
    from moefuse.bench.hf_bars import compiled_bars

    def row(op, x, m=None, breaks=0):
        r = {"op": op, "variant": "patched", "x_shipped": x, "graph_breaks": breaks}
        return r | ({"M": m} if m else {})

    rows = [
        row("compiled decode step", 1.35, 1),
        row("compiled prefill", 0.9, 512),
        row("compiled prefill", 1.29, 2048),
        row("compiled generate", 1.14, breaks=1),
        {"op": "compiled decode step", "variant": "shipped", "graph_breaks": 0},
    ]
    lines = compiled_bars(rows)
    assert lines[0] == "BAR PASS: compiled decode step T=1: 1.35 x shipped >= 1.15"
    assert lines[1] == "BAR FAIL: compiled prefill T=2048: 1.29 x shipped >= 1.3"
    assert lines[2] == "BAR PASS: compiled generate: 1.14 x shipped >= 1.0"
    assert lines[3].startswith("BAR MISSING: compiled generate, one reused cache")
    assert lines[4] == "BAR FAIL: graph breaks: 1 over 5 rows == 0"


def test_hf_bars_of_the_committed_h200_results():
    """The committed results give the verdicts their notes state: every bar met."""
    import json
    from pathlib import Path

    from moefuse.bench.hf_bars import compiled_bars, eager_bars

    results = Path(__file__).resolve().parents[1] / "bench" / "results"
    eager = eager_bars(json.loads((results / "hf_moe-h200.json").read_text())["rows"])
    compiled = compiled_bars(
        json.loads((results / "hf_moe-h200-compiled.json").read_text())["rows"]
    )
    assert [line.split(":")[0] for line in eager] == ["BAR PASS"] * 6, eager
    assert all(line.startswith("BAR PASS") for line in compiled), compiled
    assert len(compiled) == 5


def test_hf_fp8_bars_compare_patched_fp8_with_each_baseline():
    from moefuse.bench.hf_bars import fp8_bars

    def step(variant, m, us, **kw):
        flags = {"eager_runs_equal": True, "graph_bits_equal": True, **kw}
        return {"op": "compiled decode step", "variant": variant, "M": m, "us": us,
                "graph_breaks": 0, **flags}  # fmt: skip

    rows = [step("shipped bf16", 64, 700.0), step("patched bf16", 64, 600.0)]
    rows += [step("patched fp8", 64, 450.0), step("patched bf16", 1, 500.0)]
    rows += [step("patched fp8", 1, 510.0, graph_bits_equal=False)]
    rows += [{"op": "compiled prefill", "variant": v, "M": 2048, "us": us, "graph_breaks": 1}
             for v, us in (("patched bf16", 3600.0), ("patched fp8", 2900.0))]  # fmt: skip
    rows += [{"op": "logits", "variant": "patched bf16", "mean_abs_vs_own_fp32": 0.01},
             {"op": "logits", "variant": "patched fp8", "mean_abs_vs_own_fp32": 0.02},
             {"op": "compiled generate, one reused cache", "variant": "patched fp8",
              "same_tokens_as_first_run": True, "graph_breaks": 0}]  # fmt: skip
    lines = fp8_bars(rows)
    assert lines[0].startswith("BAR PASS: compiled decode step M=64: patched fp8 vs patched bf16")
    assert lines[0].endswith("1.33 x >= 1.3")
    assert lines[1].startswith("BAR FAIL: compiled decode step M=64: patched fp8 vs shipped bf16")
    assert lines[2].startswith("BAR FAIL: compiled decode step M=1") and "0.98 x" in lines[2]
    assert lines[3].startswith("BAR PASS: compiled prefill M=2048") and "1.24 x" in lines[3]
    assert lines[4].startswith("BAR FAIL: faithful FP8: mean |logit diff| to its FP32 eval")
    assert lines[5].startswith("BAR FAIL: FP8 step logits bitwise equal run to run False")
    assert lines[6] == "BAR FAIL: graph breaks: 2 over 8 rows == 0"
    assert fp8_bars([])[0].startswith("BAR MISSING: faithful FP8")  # eager rows: no step bars
