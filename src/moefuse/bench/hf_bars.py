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
    if not decode:
        lines.append("BAR MISSING: eager decode (no patched decode row with x_shipped)")
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


#: (op, token count, variant it is compared with, least ratio) of the FP8 compiled run: the
#: patched FP8 row's time against that variant's (``python -m moefuse.bench.hf_moe --fp8``)
FP8_BARS = (
    ("compiled decode step", 64, "patched bf16", 1.3),
    ("compiled decode step", 64, "shipped bf16", 1.6),
    ("compiled decode step", 1, "patched bf16", 1.0),
    ("compiled prefill", 2048, "patched bf16", 1.2),
)


def fp8_bars(rows: list[dict]) -> list[str]:
    """The FP8 run's verdicts: :data:`FP8_BARS` (compiled rows only), the faithfulness of the
    FP8 model (its logits as close to its FP32 evaluation as patched BF16's to its FP32 copy),
    determinism (every patched FP8 step's logits equal run to run and in the graph, greedy
    tokens of two ``generate`` calls equal) and graph breaks (compiled rows)."""
    lines = []
    us = {(r["op"], r.get("M"), r["variant"]): r.get("us") for r in rows if "variant" in r}
    compiled = any(r.get("op") == "compiled decode step" for r in rows)
    for op, tokens, base, least in FP8_BARS if compiled else ():
        what = f"{op} M={tokens}: patched fp8 vs {base}"
        a, b = us.get((op, tokens, "patched fp8")), us.get((op, tokens, base))
        if a is None or b is None:
            lines.append(f"BAR MISSING: {what} (no timed rows)")
            continue
        text = f"{what}: {a:.1f} vs {b:.1f} us, {b / a:.2f} x >= {least}"
        lines.append(_verdict(b / a >= least, text))
    own = {r["variant"]: r.get("mean_abs_vs_own_fp32") for r in rows if r.get("op") == "logits"}
    fp8, bf16 = own.get("patched fp8"), own.get("patched bf16")
    if fp8 is None or bf16 is None:
        lines.append("BAR MISSING: faithful FP8 (no logits rows)")
    else:
        text = (
            f"faithful FP8: mean |logit diff| to its FP32 evaluation {fp8:.4g} <= patched "
            f"bf16's to its FP32 copy {bf16:.4g}"
        )
        ref = own.get("patched fp8, reference ops")
        if ref is not None:  # what the BF16 activations cost alone, the kernels' ops replaced
            text += f" (the FP8 model on moefuse's reference ops: {ref:.4g})"
        lines.append(_verdict(fp8 <= bf16, text))
    steps = [
        r for r in rows if r.get("op") == "compiled decode step" and r["variant"] == "patched fp8"
    ]
    gens = [r for r in rows if "same_tokens_as_first_run" in r and r["variant"] == "patched fp8"]
    if compiled:
        if not steps or not gens:
            lines.append("BAR MISSING: FP8 bits and tokens run to run")
        else:
            bits = all(r["eager_runs_equal"] and r["graph_bits_equal"] is not False for r in steps)
            same = all(r["same_tokens_as_first_run"] for r in gens)
            text = f"FP8 step logits bitwise equal run to run {bits}, greedy tokens equal {same}"
            lines.append(_verdict(bits and same, text))
        counted = [r for r in rows if "graph_breaks" in r]
        breaks = sum(r["graph_breaks"] for r in counted)
        lines.append(_verdict(breaks == 0, f"graph breaks: {breaks} over {len(counted)} rows == 0"))
    return lines
