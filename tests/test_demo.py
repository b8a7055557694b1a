"""The demo runs every op against the reference and reports success (CPU: interpreter)."""

import pytest

from moefuse.demo import run_demo

pytestmark = pytest.mark.interpreter


def test_demo_passes_at_a_small_size(capsys):
    assert run_demo(hidden=64, tokens=3) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "moe_finalize" in out and "fp4_quantize" in out
