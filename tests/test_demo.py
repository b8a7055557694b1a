"""The demo checks every op, a communication fusion and a patched transformers model against
their references and says what it checked (CPU: the kernels in the interpreter, no times)."""

import json

import pytest

from moefuse.demo import run_demo


@pytest.mark.interpreter
def test_demo_passes_at_a_small_size(capsys, tmp_path):
    assert run_demo(hidden=64, tokens=3, save=str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "14 of 14 checks passed" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("op "))
    assert "µs" not in lines[header]  # interpreted kernels get no time column
    rows = lines[header + 1 : header + 13]
    ops = [line.split()[0] for line in rows]
    for op in ("rmsnorm", "moe_finalize", "fp4_quantize", "moe_experts", "router_topk"):
        assert op in ops, ops
    assert all(line.rstrip().endswith("ok") for line in rows), rows
    assert "times: none" in out
    # the communication fusion on two interpreter ranks, checked against both ranks' inputs
    assert "allreduce_residual_rmsnorm 4x64 per rank: residual_out bitwise equal" in out
    # the patched model: what runs now, what it replaced, tokens against the shipped model
    assert "experts now 'moefuse' (replaced 'grouped_mm')" in out
    assert "greedy tokens, patched vs shipped: the first 6 of 6 equal" in out
    assert "the same next token at 6 of 6 positions: ok" in out
    saved = json.loads((tmp_path / "demo-cpu.json").read_text())
    assert saved["meta"]["commit"] and len(saved["ops"]) == 12
    assert saved["communication"]["ranks_bitwise"] and saved["model"]["tokens_equal_leading"] == 6
    assert (tmp_path / "demo-cpu.txt").read_text().count("\n") > 20


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked-out lanes in the interpreter
def test_demo_timing_callables_run():
    """The GPU-only timing callables (the kernel alone, the plain-PyTorch math that the demo
    compiles, the baselines timed as they are) run here too: eagerly, and the kernels in the
    interpreter."""
    import torch

    from moefuse.demo import _all_steps

    for step in _all_steps(3, 64, "cpu", on_gpu=False):
        if step.kernel is not None:
            step.kernel()
        base = step.baseline or step.torch_math
        assert base is not None, step.op
        for t in (lambda r: r if isinstance(r, tuple) else (r,))(base()):
            assert torch.isfinite(t.float()).all(), step.op


def test_a_failed_check_is_reported_and_counted():
    """A step whose kernel output is off fails its row (the check can fail)."""
    import torch

    from moefuse.demo import Step, _check

    step = Step("x", "1", lambda impl: torch.ones(3), "exact")
    assert _check(step, (torch.ones(3),), (torch.ones(3),))[0] == "ok"
    status, err = _check(step, (torch.ones(3),), (torch.tensor([1.0, 1.0, 2.0]),))
    assert status.startswith("FAIL") and err == 1.0
    own = Step("y", "1", lambda impl: None, "exact", check=lambda e, g: "ids differ")
    assert _check(own, (torch.ones(1),), (torch.ones(1),))[0] == "FAIL: ids differ"


@pytest.mark.gpu
def test_demo_on_gpu_prints_graph_times(capsys):
    assert run_demo(with_compile=False) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("op "))
    col = lines[header].index("kernel µs")
    for line in lines[header + 1 : header + 13]:
        assert float(line[col:].split()[0]) > 0, line  # the kernel's µs per call
    assert "decode step (eager, batch 1): shipped" in out
