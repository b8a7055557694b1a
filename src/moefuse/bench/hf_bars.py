"""Verdicts of the Hugging Face model benchmarks against their bars (pure functions of the rows).

Eager (``python -m moefuse.bench.hf_moe``): the Qwen3-MoE block with moefuse experts at least as
fast as the best transformers implementation at every token count, and patched eager decode at
least as fast as shipped. Compiled (``--compiled``): the CUDA-graph decode step >= 1.15 x
shipped, prefill at 2,048 tokens >= 1.3 x, compiled ``generate`` >= 1.0 x (each generate row),
and no graph break in any row. Each verdict is one line, ``BAR PASS: ...`` or ``BAR FAIL: ...``,
with the figures it compares; a bar whose rows are missing (a stage skipped or failed) says
``BAR MISSING``. The benchmarks print the lines and keep them in the JSON's ``meta["bars"]``.
"""

from __future__ import annotations

#: (op, token count or None, least patched / shipped ratio) of the compiled run
COMPILED_BARS = (
    ("compiled decode step", 1, 1.15),
    ("compiled prefill", 2048, 1.3),
    ("compiled generate", None, 1.0),
    ("compiled generate, one reused cache", None, 1.0),
)


def _verdict(ok: bool, text: str) -> str:
    return f"BAR {'PASS' if ok else 'FAIL'}: {text}"


def eager_bars(rows: list[dict]) -> list[str]:
    """The eager run's verdicts: per token count, the ``moefuse`` block row's
    ``x_best_transformers`` >= 1.0; the patched decode row's ``x_shipped`` >= 1.0."""
    lines = []
    blocks = [r for r in rows if r.get("op") == "qwen3_moe_block" and r["variant"] == "moefuse"]
    for r in sorted(blocks, key=lambda r: r["M"]):
        x = r["x_best_transformers"]
        text = f"eager block T={r['M']}: {r['us']:.1f} us, {x:.2f} x best transformers >= 1.0"
        lines.append(_verdict(x >= 1.0, text))
    if not blocks:
        lines.append("BAR MISSING: eager block (no moefuse block rows)")
    decode = [r for r in rows if r.get("op") == "decode" and "x_shipped" in r]
    for r in decode:
        text = f"eager decode: {r['tok_s']:.1f} tok/s, {r['x_shipped']:.2f} x shipped >= 1.0"
        lines.append(_verdict(r["x_shipped"] >= 1.0, text))
    return lines


def compiled_bars(rows: list[dict]) -> list[str]:
    """The compiled run's verdicts (:data:`COMPILED_BARS`, from the patched rows' ``x_shipped``)
    and one line for graph breaks over every row that counts them."""
    lines = []
    for op, tokens, least in COMPILED_BARS:
        found = [
            r
            for r in rows
            if r.get("op") == op
            and r.get("variant") == "patched"
            and (tokens is None or r.get("M") == tokens)
        ]
        what = op + (f" T={tokens}" if tokens else "")
        if not found or "x_shipped" not in found[0]:
            lines.append(f"BAR MISSING: {what} (no timed patched row)")
            continue
        x = found[0]["x_shipped"]
        lines.append(_verdict(x >= least, f"{what}: {x:.2f} x shipped >= {least}"))
    counted = [r for r in rows if "graph_breaks" in r]
    breaks = sum(r["graph_breaks"] for r in counted)
    text = f"graph breaks: {breaks} over {len(counted)} rows == 0"
    lines.append(_verdict(breaks == 0, text) if counted else "BAR MISSING: graph breaks")
    return lines
