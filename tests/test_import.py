"""``import moefuse`` imports neither Triton nor torch._dynamo (Triton is imported when a kernel
first runs), so ``TRITON_INTERPRET=1`` set after the import still selects the interpreter."""

import os
import subprocess
import sys

import torch

import moefuse._runtime as rt


def _fresh(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.path.join(root, "src")
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_loads_neither_triton_nor_dynamo():
    out = _fresh(
        "import sys, moefuse; print(sorted(m for m in ('triton', 'torch._dynamo') "
        "if m in sys.modules))"
    )
    assert out.strip() == "[]", out


def test_interpreter_chosen_after_import():
    out = _fresh(
        "import os, torch, moefuse\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "x = torch.randn(2, 40).bfloat16(); w = torch.rand(40).bfloat16()\n"
        "y = moefuse.rmsnorm(x, w, impl='triton')\n"
        "r = moefuse.rmsnorm(x, w, impl='reference')\n"
        "print((y.float() - r.float()).abs().max().item() < 0.05)\n"
    )
    assert out.strip().endswith("True"), out


def test_device_reason_is_a_compile_time_constant_for_dynamo():
    """The mark moefuse sets by hand is the one torch.compiler.assume_constant_result sets."""
    marked = torch.compiler.assume_constant_result(lambda: None)
    names = {n for n in vars(marked) if n.startswith("_dynamo")}
    assert names and all(getattr(rt.kernel_device_reason, n, None) is True for n in names)
