"""scripts/ holds only tools that a user or CI runs: every one answers ``--help`` (exit status 0,
its usage printed) on a CPU machine, so none of them rots unnoticed, and `make test` lints them
(ruff check src tests scripts). Tools that tests import live in ``moefuse.tools`` and answer
``python -m moefuse.tools.<name> --help`` the same way."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh"))
TOOLS = sorted(p.stem for p in (ROOT / "src" / "moefuse" / "tools").glob("*.py")
               if "def main(" in p.read_text())  # fmt: skip


def test_scripts_are_only_python_and_shell_tools_and_make_lints_them():
    # scripts/ptx/ holds the modules of the one compile tool, scripts/ptx_check.py (run by it)
    others = [
        p.name
        for p in (ROOT / "scripts").iterdir()
        if p.suffix not in (".py", ".sh") and p.name not in ("ptx", "__pycache__")
    ]
    assert not others and SCRIPTS and len(SCRIPTS) <= 10, (others, SCRIPTS)
    helpers = sorted(p for p in (ROOT / "scripts" / "ptx").iterdir() if p.name != "__pycache__")
    assert helpers and all(p.suffix == ".py" for p in helpers), helpers
    assert "ptx_check.py" in SCRIPTS
    assert TOOLS == ["audit_reduce_trees", "compile_check_allgather", "loopback_gpu_check"]
    make = (ROOT / "Makefile").read_text()
    assert re.search(r"^\t\$\(PY\) -m ruff check .*\bscripts\b", make, re.M)


@pytest.mark.parametrize("name", [*SCRIPTS, *(f"moefuse.tools.{t}" for t in TOOLS)])
def test_tool_answers_help(name):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    if name.startswith("moefuse."):
        cmd = [sys.executable, "-m", name]
    else:
        cmd = [sys.executable if name.endswith(".py") else "bash", str(ROOT / "scripts" / name)]
    out = subprocess.run(
        [*cmd, "--help"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    text = out.stdout.strip()
    assert len(text.splitlines()) >= 2, text
    if not name.endswith(".sh"):
        assert text.startswith("usage:"), text
