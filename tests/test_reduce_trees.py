"""Kernels that must give the same bits sum their rows in the same order: the layouts of their
row sums, read from the TTGIR that Triton compiles for sm_90a (no GPU needed).

moefuse.tools.audit_reduce_trees runs in a subprocess without TRITON_INTERPRET (this process has
the interpreter on, which cannot compile). It compares gated_next with and without router_input
the all-gather + norm kernels with their single-GPU ops, and the per-token-group quant fusions with
rmsnorm / fused_add_rmsnorm, one-pass and stepped rows."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WIDTHS = "64,2048,4096"  # one-pass tiles of 32 rows and of one row, stepped rows
CASES_PER_WIDTH = 11  # gated_next router / no router; all-gather gated x 4, rmsnorm x 2;
# rmsnorm_group_quant, fused_add_rmsnorm_group_quant, each also in the persistent row loop
#: rmsnorm_group_quant's store re-reading the row, every chunk its tile takes (one tile per
#: program): 2048 columns 1024 / 2048, 4096 columns 1024 / 2048 / 4096
RELOAD_CASES = 5


def test_kernels_sum_rows_in_the_same_order():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    out = subprocess.run(
        [sys.executable, "-m", "moefuse.tools.audit_reduce_trees", "--widths", WIDTHS],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    lines = [line for line in out.stdout.splitlines() if line.startswith(("MATCH", "DIFF"))]
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert len(lines) == CASES_PER_WIDTH * len(WIDTHS.split(",")) + RELOAD_CASES, out.stdout
    assert all(line.startswith("MATCH") for line in lines), out.stdout


def test_audit_tells_layouts_apart():
    """The parser reads each float row sum's layout and skips sums along another axis, so a
    kernel that sums with 8 columns per thread does not pass for one that sums with 4."""
    from moefuse.tools import audit_reduce_trees as audit

    template = (
        "#blocked = #ttg.blocked<{sizePerThread = [1, SPT], threadsPerWarp = [4, 8], "
        "warpsPerCTA = [4, 1], order = [1, 0]}>\n"
        '%p = "tt.reduce"(%m) <{axis = 0 : i32}> ({\n  tt.reduce.return %x : i32\n'
        "}) : (tensor<32xi32, #blocked>) -> i32\n"
        '%r = "tt.reduce"(%s) <{axis = 1 : i32}> ({\n  tt.reduce.return %y : f32\n'
        "}) : (tensor<32x64xf32, #blocked>) -> tensor<32xf32>\n"
    )

    def ir(spt: str) -> str:
        return template.replace("SPT", spt)

    four, eight = audit.reduce_trees(ir("4")), audit.reduce_trees(ir("8"))
    assert four == [
        "axis 1 of 32x64: sizePerThread=[1, 4] threadsPerWarp=[4, 8] warpsPerCTA=[4, 1]"
    ]
    assert four != eight
    assert not audit._compare("four vs eight", four, eight)
