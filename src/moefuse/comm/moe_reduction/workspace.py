"""The optional peer region of the MoE-reduction family on an :class:`AllReduceWorkspace`: FP32
gather rows for the accumulate="fp32" two-shot (``extra_regions``), and where those rows live
(the kernels and the op layer both ask; neither imports the other for it)."""

from __future__ import annotations

#: optional peer region of FP32 gather rows for accumulate="fp32" two-shot
GATHER32 = "moe_gather32"


def extra_regions(max_tokens: int, hidden_size: int) -> dict[str, int]:
    """``extra_regions`` for an :class:`AllReduceWorkspace` whose accumulate="fp32" two-shot
    should hold ``max_tokens`` (without it the FP32 sums share the T-sized gather region, i.e.
    half the tokens for BF16/FP16)."""
    return {GATHER32: max_tokens * hidden_size * 4}


def fp32_gather_region(ws) -> str:
    return GATHER32 if GATHER32 in ws.regions else "gather"


def fp32_twoshot_fits(ws, m: int) -> bool:
    """accumulate="fp32" two-shot keeps FP32 sums in a gather region: does it hold ``m`` rows?"""
    return m * ws.hidden_size * 4 <= ws.regions[fp32_gather_region(ws)][1]
