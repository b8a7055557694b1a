"""What ``moefuse.integrations.transformers.patch`` does to each MoE family of the installed
transformers, on CPU (Triton kernels in the interpreter, ``impl="triton"``; no download).

For every model type whose name marks a MoE family (or is listed in :data:`EXTRA_TYPES`), a tiny
random BF16 model is built from the family's default config with the sizes of :data:`TINY` set
where the config has the field (full attention in every layer, so that a family's attention
options do not need their own sizes). Reported per family: what ``patch`` changed (routers, norms,
fused residual layers, shared-expert blocks), which experts path ran (``moe_experts``: the fused
kernels; ``composed``: plan, permute, grouped GEMMs, finalize; ``declined: <reason>``:
transformers' ``grouped_mm``, announced in the log; ``-``: the family's experts do not use
transformers' experts hook), the relative L2 distance of the unpatched (shipped) and the
patched BF16 model's logits from an FP32 copy of the model (same weights), the same distance for the
first experts module alone on random routed rows (a router with thresholds can turn a last-bit
difference of one layer into another expert choice in the next, which the logits then show), and
``torch.compile(fullgraph=True)`` of the patched model (``aot_eager``): graph breaks and whether
its logits equal the eager ones bit for bit. With ``--inductor`` also the default backend, on
the shipped and on the patched model: graph breaks of the patched one and both compiled models'
distance from FP32 (inductor computes the torch code around the ops with its own arithmetic, so
bits are not compared; what inductor does to the shipped model is the baseline). A family
whose tiny model cannot be built or run unpatched (a config this script's generic sizes do not
fit) is listed as skipped, with the reason.

Run: PYTHONPATH=src python scripts/survey_transformers_moe.py [--only TYPE[,...]] [--inductor]
[--report FILE]. Exit status 1 when a family that runs unpatched fails patched, breaks the graph
or changes bits under compile, or (``--inductor``) breaks the graph under inductor or lands
further from FP32 than :func:`inductor_bound` allows.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import pkgutil
import subprocess
import sys
from datetime import date

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

#: config fields of the tiny models (set where a family's config has them)
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    num_experts=8,
    num_local_experts=8,
    n_routed_experts=8,
    moe_num_experts=8,
    num_experts_per_tok=2,
    moe_k=2,
    max_position_embeddings=64,
    initializer_range=0.1,
    first_k_dense_replace=0,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    n_group=1,
    topk_group=1,
)
#: MoE families whose model type does not say "moe"
EXTRA_TYPES = (
    "mixtral", "gpt_oss", "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "minimax", "phimoe",
    "jetmoe", "olmoe", "dots1", "qwen3_next", "llama4", "longcat_flash",
)  # fmt: skip
#: families left out (not decoder-only language models)
SKIP_TYPES = {"nllb_moe": "encoder-decoder translation model"}


def moe_types() -> list[str]:
    import transformers.models as models

    names = [m.name for m in pkgutil.iter_modules(models.__path__)]
    return sorted(n for n in names if ("moe" in n or n in EXTRA_TYPES) and "vl" not in n)


def build(model_type: str):
    import transformers as tf

    cfg = tf.AutoConfig.for_model(model_type)
    if getattr(cfg, "text_config", None) is not None:
        raise ValueError("a composite (multimodal) config: its text model has a config of its own")
    fields = cfg.to_dict()
    tiny = {k: v for k, v in TINY.items() if k in fields}
    if "qk_rope_head_dim" in fields:  # multi-latent attention: head dims from its qk_* fields
        tiny.pop("head_dim", None)
    if isinstance(fields.get("layer_types"), list):
        tiny["layer_types"] = ["full_attention"] * TINY["num_hidden_layers"]
    # built again from the fields, so that the config derives what depends on them
    cfg = tf.AutoConfig.for_model(model_type, **tiny)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).eval().to(torch.bfloat16)


class _Declines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        if "grouped_mm" in record.getMessage():
            self.messages.append(record.getMessage().split(": ", 2)[-1])


def _distance(logits: torch.Tensor, fp32: torch.Tensor) -> float:
    """Relative L2 distance of ``logits`` from the FP32 model's."""
    return ((logits.float() - fp32).norm() / fp32.norm()).item()


def _experts_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]


def experts_distances(shipped, patched) -> tuple[float, float] | None:
    """(shipped, patched) relative L2 distance of the first experts module's output from the FP32
    module's, on 16 random BF16 rows routed to distinct random experts with softmax weights: the
    experts function alone, without the routing of the layers after it. None when the model has
    no experts module of transformers' layout."""
    mods = [_experts_modules(m) for m in (shipped, patched, copy.deepcopy(shipped).float())]
    if not all(mods):
        return None
    ship, patch, fp32 = (m[0] for m in mods)
    experts, hidden = ship.gate_up_proj.shape[0], shipped.config.hidden_size
    top_k = min(2, experts)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(16)])
    w = torch.randn(16, top_k, generator=gen).softmax(-1).to(torch.bfloat16)
    with torch.no_grad():
        want = fp32(x.float(), idx, w.float())
        return _distance(ship(x, idx, w), want), _distance(patch(x, idx, w), want)


def inductor_bound(row: dict) -> float:
    """Largest distance from FP32 accepted for the inductor-compiled patched logits: 1.5 x the
    larger of the eager patched model's and the inductor-compiled shipped model's distance, +
    0.01 (BF16 rounding of their size, plus a router choice at a near tie)."""
    return 1.5 * max(row["patched_err"], row["inductor_shipped_err"]) + 0.01


def survey(model_type: str, inductor: bool = False) -> dict:
    """One family's row (see the module docstring)."""
    from torch._dynamo.utils import counters

    from moefuse import _runtime
    from moefuse.integrations import transformers as mt

    row = {"type": model_type}
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(5))
    try:
        shipped = build(model_type)
        with torch.no_grad():
            fp32 = copy.deepcopy(shipped).float()(ids).logits
            row["shipped_err"] = _distance(shipped(ids).logits, fp32)
    except Exception as exc:  # the generic tiny config does not fit this family
        return {**row, "skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"}
    model = copy.deepcopy(shipped)
    handler = _Declines()
    logger = logging.getLogger("moefuse")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    _runtime._logged.clear()  # each family's decline is announced again
    seen: set[str] = set()

    def backend(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        seen.update(
            str(n.target).split(".")[1]
            for n in gm.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("moefuse.")
        )
        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    try:
        row["patch"] = mt.patch(model, impl="triton")
        with torch.no_grad():
            eager = model(ids).logits
            row["patched_err"] = _distance(eager, fp32)
            row["experts_err"] = experts_distances(shipped, model)
            counters.clear()
            torch._dynamo.reset()
            got = torch.compile(model, fullgraph=True, backend=backend)(ids).logits
        row["graph_breaks"] = sum(counters["graph_break"].values())
        row["bits_equal"] = torch.equal(got, eager)
        if inductor:
            with torch.no_grad():
                torch._dynamo.reset()
                got = torch.compile(shipped, fullgraph=True)(ids).logits
                row["inductor_shipped_err"] = _distance(got, fp32)
                counters.clear()
                torch._dynamo.reset()
                got = torch.compile(model, fullgraph=True)(ids).logits
            row["inductor_breaks"] = sum(counters["graph_break"].values())
            row["inductor_err"] = _distance(got, fp32)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    if handler.messages:
        row["experts"] = "declined: " + handler.messages[0]
    elif "moe_experts" in seen:
        row["experts"] = "moe_experts"
    elif "moe_finalize" in seen:
        row["experts"] = "composed"
    else:
        row["experts"] = "-"
    return row


def _commit() -> str:
    """This checkout's short commit (``unknown`` outside a git checkout)."""
    proc = subprocess.run(
        ["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
    )
    return proc.stdout.strip() or "unknown"


def markdown(rows: list[dict]) -> str:
    import transformers as tf

    ran = [r for r in rows if "skipped" not in r]
    clean = [r for r in ran if not failures(r)]
    inductor = any("inductor_err" in r for r in rows)
    lines = [
        "# transformers MoE families under `patch(model)`",
        "",
        "Made by `PYTHONPATH=src python scripts/survey_transformers_moe.py"
        + (" --inductor" if inductor else "")
        + f"` on {date.today()} "
        f"at {_commit()} (transformers {tf.__version__}, torch {torch.__version__}, CPU, Triton "
        "interpreter; tiny random models, no download). The script's docstring defines the "
        "columns.",
        "",
        f"{len(clean)} of the {len(ran)} families that run unpatched also run patched and compile "
        "with `fullgraph=True` (no graph break, the compiled logits equal the eager ones bit for "
        "bit"
        + ("; under inductor no graph break and within the FP32 bound" if inductor else "")
        + f"); {len(rows) - len(ran)} were skipped (a composite config, or one that the "
        "script's generic tiny sizes do not fit: the reason is in the table).",
        "",
        "| family | experts | routers | norms | fused layers | shared blocks | logits vs FP32: "
        "shipped / patched | experts module vs FP32: shipped / patched | compiled fullgraph |"
        + (" inductor: breaks, logits vs FP32: shipped / patched (bound) |" if inductor else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if inductor else ""),
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(
                f"| {r['type']} | skipped: {r['skipped']} | | | | | | | |" + inductor * " |"
            )
            continue
        p = r.get("patch", {})
        compiled = (
            r["error"]
            if "error" in r
            else f"{r['graph_breaks']} breaks, "
            + ("bits equal" if r["bits_equal"] else "BITS DIFFER")
        )
        patched = f"{r['patched_err']:.4f}" if "patched_err" in r else "-"
        rel = f"{r['shipped_err']:.4f} / {patched}"
        pair = r.get("experts_err")
        module = f"{pair[0]:.4f} / {pair[1]:.4f}" if pair else "-"
        line = (
            f"| {r['type']} | {r['experts']} | {p.get('routers', '-')} | {p.get('norms', '-')} | "
            f"{p.get('fused_layers', '-')} | {p.get('shared_expert_blocks', '-')} | {rel} | "
            f"{module} | {compiled} |"
        )
        if inductor:
            line += (
                f" {r['inductor_breaks']} breaks, {r['inductor_shipped_err']:.4f} / "
                f"{r['inductor_err']:.4f} ({inductor_bound(r):.4f}) |"
                if "inductor_err" in r
                else " - |"
            )
        lines.append(line)
    return "\n".join(lines) + "\n"


def failures(r: dict) -> list[str]:
    """What went wrong in a family's row (empty: nothing, or the family was skipped)."""
    if "skipped" in r:
        return []
    if "error" in r:
        return [r["error"]]
    bad = [] if not r["graph_breaks"] else [f"{r['graph_breaks']} graph breaks"]
    bad += [] if r["bits_equal"] else ["compiled bits differ"]
    if "inductor_err" in r:
        bad += [] if not r["inductor_breaks"] else [f"inductor: {r['inductor_breaks']} breaks"]
        if r["inductor_err"] > inductor_bound(r):
            bad.append(f"inductor: {r['inductor_err']:.4f} from FP32")
    return bad


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="")
    parser.add_argument("--report", default="")
    parser.add_argument("--inductor", action="store_true", help="also compile with inductor")
    args = parser.parse_args(argv)
    types = args.only.split(",") if args.only else [t for t in moe_types() if t not in SKIP_TYPES]
    rows = []
    for model_type in types:
        row = survey(model_type, args.inductor)
        rows.append(row)
        print({k: v for k, v in row.items()}, flush=True)
    text = markdown(rows)
    print(text)
    if args.report:
        with open(args.report, "w") as f:
            f.write(text)
    return 1 if any(failures(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
