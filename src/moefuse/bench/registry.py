"""The benchmark families `moefuse bench all` runs and `moefuse bench summary` reads.

A family is a module ``moefuse.bench.<module>`` with ``main(argv)`` that accepts ``--save`` and
``--out DIR`` and writes ``<name>-<gpu>[-pP].json`` = ``{"meta": {...}, "rows": [...]}``, one row
per (op, shape, M, variant) with its time in µs (``us``; the overhead family writes
``us_per_call`` and names the variant ``impl``). Families listed here whose module is not in
this build (being written on other branches) are skipped with that reason, never an error.

Which variant is moefuse and which are baselines: by default ``"moefuse"`` is ours, and every
variant whose name does not start with ``moefuse`` and is not a ceiling (``sm_copy``) is a
baseline (``moefuse_nopdl``, ``moefuse_rot_out``, ... are our own variants, not baselines). A
family overrides that below, and a JSON file can override it for itself with
``meta["ours"]`` / ``meta["baselines"]`` (lists of variant names) or per row with ``"role"``
(``"baseline"`` marks the baselines of that row's case).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

#: variants that are a bandwidth ceiling or a reference point, never a baseline to beat
CEILINGS = ("sm_copy",)


@dataclass(frozen=True)
class Family:
    name: str  # `python -m moefuse bench <name>`; its JSON files are named <name>-<gpu>...
    module: str  # moefuse.bench.<module>
    min_gpus: int = 1
    multi_rank: bool = False  # takes --world-size P (one process per GPU)
    quick: bool = True  # accepts --quick
    #: our variant, first match per (op, shape, M) group (a family may name it per op)
    ours: tuple[str, ...] = ("moefuse",)
    #: variants that are neither ours nor baselines, beyond the default rule
    not_baselines: tuple[str, ...] = ()
    #: a single-GPU family that also times its communication ops given ``--world-size P``
    optional_world_size: bool = False
    #: (op name in a baseline row, op it is the baseline of), e.g. F.rms_norm's row for rmsnorm
    op_aliases: tuple[tuple[str, str], ...] = ()


FAMILIES: tuple[Family, ...] = (
    Family("norm", "moefuse.bench.norm"),
    Family("quant", "moefuse.bench.quant"),
    # finalize: "moefuse"; the layer pipeline: "deterministic finalize" against the scatter-add
    # (atomics) finalize; permute -> finalize: PDL on against off (no baseline: not summarised)
    Family(
        "moe",
        "moefuse.bench.moe",
        ours=("moefuse", "deterministic finalize", "PDL on"),
        not_baselines=("PDL off", "PDL default"),
    ),
    # fused routed experts against transformers' grouped_mm / batched_mm experts functions and
    # moefuse's composed path ("moefuse_composed", one of ours: not a baseline of the summary)
    Family("moe-experts", "moefuse.bench.moe_experts", not_baselines=("moefuse_composed",)),
    # FP8 routed experts (`bench moe-experts --dtype fp8` runs the same) against moe_experts on
    # the dequantized BF16 weights ("bf16_moefuse"), grouped_mm and F.scaled_grouped_mm
    Family("moe-experts-fp8", "moefuse.bench.moe_experts_fp8"),
    # fp8_linear against BF16 torch.mm and F.scaled_mm
    Family("fp8-linear", "moefuse.bench.fp8_linear"),
    # host µs per eager call; F.rms_norm (op "rms_norm", impl "torch") is rmsnorm's baseline
    Family(
        "overhead",
        "moefuse.bench.overhead",
        quick=False,
        optional_world_size=True,
        op_aliases=(("rms_norm", "rmsnorm"),),
    ),
    Family("all-reduce", "moefuse.bench.all_reduce", min_gpus=2, multi_rank=True),
    # MoE-reduction and MoE-finalize all-reduce fusions: "fused" (algorithm and variant
    # "auto"); its rows carry "role" ("fused" | "baseline": the unfused chains), which names the
    # baselines
    Family(
        "moe-reduction",
        "moefuse.bench.moe_reduction",
        min_gpus=2,
        multi_rank=True,
        ours=("fused", "moefuse"),
    ),
    # per-expert-norm finalize (tp_moe_finalize_rmsnorm, moe_finalize_rmsnorm_allreduce):
    # "moefuse" against the unfused chains (the naming rule)
    Family("expert-norm", "moefuse.bench.expert_norm", min_gpus=2, multi_rank=True),
    Family("all-gather", "moefuse.bench.all_gather", min_gpus=2, multi_rank=True),
)


def missing_reason(family: Family) -> str | None:
    """Why this build cannot run ``family`` (None when its module is present)."""
    try:
        found = importlib.util.find_spec(family.module) is not None
    except ModuleNotFoundError:
        found = False
    return None if found else f"{family.module} is not in this build"


def family_of(stem: str) -> Family | None:
    """The family of a results file stem such as ``moe-reduction-h200-p2`` (longest name first,
    so ``moe-reduction`` is not taken for ``moe``)."""
    for fam in sorted(FAMILIES, key=lambda f: -len(f.name)):
        if stem == fam.name or stem.startswith(fam.name + "-"):
            return fam
    return None


def roles(family: Family | None, meta: dict, variants: set[str]) -> tuple[str | None, set[str]]:
    """(our variant, baseline variants) among ``variants`` of one (op, shape, M) group."""
    ours_names = tuple(meta.get("ours") or (family.ours if family else ("moefuse",)))
    ours = next((v for v in ours_names if v in variants), None)
    if meta.get("baselines"):
        return ours, {v for v in variants if v in meta["baselines"]}
    skip = set(CEILINGS) | set(ours_names) | set(family.not_baselines if family else ())
    return ours, {v for v in variants if v not in skip and not v.startswith("moefuse")}
