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
