"""examples/tp_moe_layer.py with P = 2 processes: on CPU (gloo, the Triton kernels in the
interpreter) and on 2 GPUs (NCCL). The script itself checks that the moefuse epilogue agrees with
the unfused PyTorch one and is identical on both ranks; the tests check its report."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from comm_mp import run_group

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "tp_moe_layer.py"


def _example():
    spec = importlib.util.spec_from_file_location("tp_moe_layer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(rank, world, argv):
    ex = _example()
    return ex.run(ex.parse_args(argv))


@pytest.mark.interpreter
def test_tp_moe_layer_example_cpu(tmp_path):
    argv = [
        "--device",
        "cpu",
        "--iters",
        "1",
        "--decode",
        "3",
        "--prefill",
        "17",
        "--hidden",
        "48",
        "--inter",
        "24",
        "--impl",
        "triton",
        "--out",
        str(tmp_path),
    ]
    results = run_group(2, _run, argv, timeout_s=240)
    for res in results:
        assert res["world_size"] == 2
        assert [r["tokens"] for r in res["rows"]] == [3, 17]
        for row in res["rows"]:
            assert row["err_residual"] <= 2e-2 and row["err_norm"] <= 2e-2
            assert row["epilogue_fused_us"] > 0 and row["layer_unfused_us"] > 0
    assert (tmp_path / "tp_moe_layer-p2.json").exists()


@pytest.mark.multigpu
def test_tp_moe_layer_example_two_gpus(tmp_path):
    """The example on 2 GPUs (NCCL; the Triton kernels, CUDA graphs) at a decode and a prefill
    size: agreement and cross-rank identity are checked inside; timings are reported (the issue's
    1.3 x bar is judged from the printed table, not asserted here)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    argv = [
        "--device",
        "cuda",
        "--iters",
        "10",
        "--decode",
        "1",
        "64",
        "--prefill",
        "512",
        "--out",
        str(tmp_path),
    ]
    results = run_group(2, _run, argv, backend="nccl", timeout_s=600)
    for row in results[0]["rows"]:
        assert row["timing"] == "graph", row
        assert row["epilogue_fused_us"] > 0 and row["epilogue_unfused_us"] > 0
