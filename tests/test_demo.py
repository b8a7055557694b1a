"""The demo runs every op against the reference and reports success (CPU: interpreter)."""

import pytest

from moefuse.demo import run_demo


@pytest.mark.interpreter
def test_demo_passes_at_a_small_size(capsys):
    assert run_demo(hidden=64, tokens=3) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "moe_finalize" in out and "fp4_quantize" in out
    # interpreted kernels get no time: every timing cell of the table is '-'
    assert "times: none" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("op "))
    rows = [line for line in lines[header + 1 :] if "triton (interpreter)" in line]
    assert len(rows) == 10
    for line in rows:
        assert line.split()[-4:] == ["-", "-", "-", "ok"], line


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # masked-out lanes in the interpreter
def test_demo_timing_callables_run():
    """The GPU-only timing callables (the kernel alone, the plain-PyTorch math that the demo
    compiles) run here too: eagerly, and the kernels in the interpreter."""
    import torch

    from moefuse.demo import _steps

    for step in _steps(3, 64, "cpu"):
        if step.kernel is not None:
            step.kernel()
        assert step.torch_math is not None, step.op
        for t in (lambda r: r if isinstance(r, tuple) else (r,))(step.torch_math()):
            assert torch.isfinite(t.float()).all(), step.op


@pytest.mark.gpu
def test_demo_on_gpu_prints_graph_times(capsys):
    assert run_demo() == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "  triton  " in line]
    assert len(rows) == 10
    for line in rows:
        kernel_us, compile_us, ratio = line.split()[-4:-1]
        assert 0 < float(kernel_us) < 100 and float(compile_us) > 0 and float(ratio) > 0, line
