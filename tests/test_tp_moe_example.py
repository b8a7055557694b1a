"""examples/tp_moe_layer.py on CPU with P = 2 processes (gloo): the moefuse epilogue (Triton
kernels in the interpreter) agrees with the unfused PyTorch / gloo one, is identical on both
ranks, and the script reports a latency row per token count."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from comm_mp import run_group

pytestmark = pytest.mark.interpreter

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tp_moe_layer.py"


def _example():
    spec = importlib.util.spec_from_file_location("tp_moe_layer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(rank, world, argv):
    ex = _example()
    return ex.run(ex.parse_args(argv))


def test_tp_moe_layer_example_cpu(tmp_path):
    argv = ["--device", "cpu", "--iters", "1", "--decode", "3", "--prefill", "17",
            "--hidden", "48", "--inter", "24", "--impl", "triton", "--out", str(tmp_path)]
    results = run_group(2, _run, argv, timeout_s=240)
    for res in results:
        assert res["world_size"] == 2
        assert [r["tokens"] for r in res["rows"]] == [3, 17]
        for row in res["rows"]:
            assert row["err_residual"] <= 2e-2 and row["err_norm"] <= 2e-2
            assert row["epilogue_fused_us"] > 0 and row["layer_unfused_us"] > 0
    assert (tmp_path / "tp_moe_layer-p2.json").exists()
