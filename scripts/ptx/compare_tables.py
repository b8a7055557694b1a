"""Is the compiled code of the communication kernels the same in two source trees? An offline
proof (no GPU) for changes that should move code without changing it: the comm/ rebuild by
fusion family, renamed device functions, split functions, grouped kernel arguments.

Every kernel that a communication launcher runs, and the single-GPU norm / quant kernels whose
row functions the all-gather kernels reuse, is compiled for sm_90a (Triton's CUDA backend, no
device) at the constexprs, compile options and argument types its launcher uses
(H = 4096, P = 2, BF16, PDL on; several patterns, modes and variants per kernel), once per tree;
the norm kernels also in the row modes their default tiles do not reach (``norm_mode_cases``:
one tile per program, the persistent loop with and without prefetch, two passes).
The PTX is then normalised: the debug sections, ``.file`` / ``.loc`` lines, line-info labels and
comments are dropped (line numbers, file names and inlined scopes move with the code) and the
kernel's and every ``.func``'s name is replaced by a placeholder in order of appearance
(kernels and device functions may be renamed). Two kernels are IDENTICAL when their normalised
PTX is the same text.

Each tree is compiled in its own interpreter (``PYTHONPATH=<tree>/src``): a kernel is found by
its name in the first module of its family that the tree has (the flat modules before the
rebuild, ``comm.triton``, ``comm.moe_fusion_triton``, ..., or the family folders after it), so
a kernel that one tree lacks is reported as such (deleted variants drop out).

Run through ``python scripts/ptx_check.py compare [FAMILY ...]`` (families of
:data:`FAMILY_CASES`; options ``--before REV``, ``--after PATH``, ``--only SUBSTRING[,...]``,
``--hidden H``, ``--report FILE.md``, ``--json FILE``, ``--dump DIR``).
(``--before`` / ``--after``: a git revision of this repository, extracted with ``git archive``
into a temporary folder, or a path to a source tree; default HEAD / this checkout.) Exit status 1
when a kernel that both trees have compiles to different PTX, or fails to compile.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))  # scripts/ptx/ -> the repository

#: module of each family, in the order tried: the family folders, then the flat modules of before
MODULES = {
    "all_reduce": ("moefuse.comm.all_reduce.kernels", "moefuse.comm.triton"),
    "all_gather": ("moefuse.comm.all_gather.kernels", "moefuse.comm.allgather_triton"),
    "all_gather.decode": ("moefuse.comm.all_gather.decode", "moefuse.comm.allgather_decode"),
    "all_gather.persistent": ("moefuse.comm.all_gather.persistent", "moefuse.comm.allgather_fused"),
    "moe_reduction": ("moefuse.comm.moe_reduction.kernels", "moefuse.comm.moe_fusion_triton"),
    "expert_norm.tp": ("moefuse.comm.expert_norm.tp_kernels", "moefuse.comm.expert_norm_triton"),
    "expert_norm.ep": ("moefuse.comm.expert_norm.ep_kernels", "moefuse.comm.expert_norm_ep_triton"),
    "norm": ("moefuse.norm.triton",),
    "norm.rms": ("moefuse.norm.rms", "moefuse.norm.triton"),
    "norm.gated": ("moefuse.norm.gated",),
    "norm.gated_residual": ("moefuse.norm.gated_residual", "moefuse.norm.gated"),
    "quant": ("moefuse.quant.fused",),
    "moe": ("moefuse.moe.triton",),
    "moe.experts": ("moefuse.moe.experts_triton",),
    "moe.experts_plan": ("moefuse.moe.experts_plan", "moefuse.moe.experts_triton"),
}

#: pointer types other than BF16, by argument name (per family where names mean different things)
POINTERS = {
    "*": {
        "table_ptr": "*i64",
        "ctrl_ptr": "*i32",
        "clock_ptr": "*i32",
        "agctrl_ptr": "*i32",
        "status_ptr": "*i32",
        "q_ptr": "*u8",
        "sf_ptr": "*u8",
        "scale_ptr": "*fp32",
    },
    "moe_reduction": {"map_ptr": "*i32", "w_ptr": "*fp32", "e_ptr": "*i32"},
    "expert_norm": {"w_ptr": "*fp32", "idx_ptr": "*i32"},
    "all_gather": {"aux_ptr": "*fp32"},
    "norm": {
        "res_ptr": "*fp32",
        "alpha_ptr": "*fp32",
        "beta_ptr": "*fp32",
        "rout_ptr": "*fp32",
        "router_ptr": "*fp32",
    },
    "quant": {
        "p_ptr": "*u8",
        "s_ptr": "*u8",
        "gs_ptr": "*fp32",
        "part_ptr": "*fp32",
        "ctr_ptr": "*i32",
    },
    "moe": {
        "map_ptr": "*i32",
        "eid_ptr": "*i32",
        "inv_ptr": "*i32",
        "buf_ptr": "*fp32",
        "idx_ptr": "*i32",
        "items_ptr": "*i32",
        "sorted_ptr": "*i32",
        "slot_map_ptr": "*i32",
        "count_ptr": "*i32",
        "counts_ptr": "*i32",
        "y_ptr": "*fp32",
    },
}
#: floating-point scalar arguments (all others are i32)
FLOATS = {
    "Hf",
    "eps",
    "weight_bias",
    "gain_center",
    "rsf",
    "alpha_scalar",
    "post_eps",
    "post_gc",
    "next_eps",
    "next_gain_center",
    "post_gain_center",
}
#: integer arguments that are never multiples of 16 at the cases' launches (the rest of the
#: strides, widths and capacities are: H = 4096 rows, P = 2)
NOT_DIVISIBLE = {
    "w_st",
    "idx_st",
    "map_st",
    "w_tst",
    "w_kst",
    "e_st",
    "KB",
    "n_kcols",
    "HEADS",
    "x_sh",
    "o_sh",
    "g_sh",
    "src_kst",
    "lookahead",
    "timeout_us",
}
#: launch keywords that are compile options, not kernel arguments
OPTIONS = ("num_warps", "maxnreg", "enable_fp_fusion", "launch_pdl", "num_stages")

#: the row width of the cases: ``--hidden`` (passed to the per-tree workers in the environment)
H, P, K = int(os.environ.get("COMM_PTX_COMPARE_HIDDEN", "4096")), 2, 8

#: what became of the kernels and constexprs of 872b0f3 that the rebuild deleted
DELETED = {
    "_tp_slot_kernel": "tp_moe_finalize_rmsnorm algorithm='expert_owner_slots', deleted with its "
    "xn_y region (bench/results/expert-norm-h200-p2.json: slower than expert_owner at every M). "
    "The MoE one-shot variant 'twokernel' had no kernel of its own: it ran _moe_partial_kernel "
    "and the all-reduce one-shot, which stay "
    "(bench/results/sweeps/moe-reduction-variants-h200-p2.json: never faster than split or "
    "fused).",
    "PROBE": "the all-reduce one-shot kernels' probe-poll switch (MOEFUSE_COMM_POLL_PROBE, lost "
    "every case of the 2026-11-29 variant sweep) is gone; before is compiled with PROBE=0, the "
    "value its launches passed unless that variable was set, and after without it.",
}


# ----------------------------------------------------------------------------- cases
def _case(family, kernel, tag, consts, **options):
    return {"family": family, "kernel": kernel, "tag": tag, "consts": consts, "options": options}


def _split(consts: dict) -> tuple[dict, dict]:
    """(constexprs, compile options) of a launcher's keyword dict."""
    return (
        {k: v for k, v in consts.items() if k not in OPTIONS},
        {k: v for k, v in consts.items() if k in OPTIONS},
    )


def all_reduce_cases(mods) -> list[dict]:
    from moefuse.comm.tiles import comm_tile, oneshot_variant

    out = []
    for pattern in (0, 1, 2, 3):
        tile = comm_tile(H, pattern)
        common = dict(
            BLOCK_H=tile.block,
            PATTERN=pattern,
            WRITE_NORM=pattern != 0,
            LAYOUT=0,
            KP_BLOCK=tile.kp_block,
            FP32_ACC=True,
            USE_PDL=True,
            PTX=True,
        )
        opts = dict(num_warps=tile.num_warps, launch_pdl=True)
        seen = set()
        for m in (1, 64, 4096):
            var = oneshot_variant(m)
            kernel = "_oneshot_prefetch_kernel" if var.prefetch else "_oneshot_kernel"
            warps = var.num_warps or tile.num_warps
            if (kernel, warps) in seen:
                continue
            seen.add((kernel, warps))
            # PROBE: the deleted probe poll's switch (before only; its launches passed 0)
            out.append(
                _case(
                    "all_reduce",
                    kernel,
                    f"pattern={pattern} warps={warps}",
                    dict(common, P=P, BITS=16, PROBE=0),
                    **dict(opts, num_warps=warps),
                )
            )
        out.append(
            _case(
                "all_reduce",
                "_twoshot_kernel",
                f"pattern={pattern}",
                dict(common, P=P, PP=P, NSLOT=1024, BITS=16),
                **opts,
            )
        )
        out.append(
            _case("all_reduce", "_gathered_kernel", f"pattern={pattern}", dict(common, P=P), **opts)
        )
    return out


def all_gather_cases(mods) -> list[dict]:
    from moefuse.norm import tiles

    ag, dec = mods["all_gather"], mods["all_gather.decode"]
    block_s, warps = ag.allgather_tile(H // P)
    out = [
        _case(
            "all_gather",
            "_allgather_kernel",
            "",
            dict(P=P, BLOCK_S=block_s, USE_PDL=True, PTX=True),
            num_warps=warps,
            launch_pdl=True,
        )
    ]
    ops = (
        ("rmsnorm", dec.RMSNORM, "linear", {}),
        ("fp8", dec.FP8, "linear", {}),
        ("fp4", dec.FP4, "linear", {}),
        ("fp4_swizzled", dec.FP4, "swizzled_128x4", {}),
        (
            "gated",
            dec.GATED,
            "linear",
            {"ALPHA_MODE": 2, "HAS_POST_WEIGHT": True, "HAS_ROUTER": True},
        ),
    )
    for name, op, layout, extra in ops:
        tile = dec.op_tile(op, H)
        if not dec.fusable(op, tile):
            continue
        for unroll in (True, False) if tile.stepped else (True,):
            rows = 1 if unroll else tiles.RMSNORM_LOOP_MIN_ROWS
            ep = dec.Epilogue(op, None, None, 1e-6, 0.0, layout=layout)
            consts, opts = _split(ep.consts(tile, H, rows, True))
            if tile.stepped:
                consts["UNROLL"] = unroll
            consts.update(extra, P=P, BLOCK_S=block_s)
            mode = "unroll" if unroll else "loop"
            modes = [("", {})]
            if unroll:
                modes += [
                    (m, {"EARLY": True, "FROM_SLOTS": m == "slots"}) for m in ("early", "slots")
                ]
            for label, flags in modes:
                out.append(
                    _case(
                        "all_gather.persistent",
                        "_ag_rmsnorm_persistent_kernel",
                        f"{name} {mode} {label}".strip(),
                        dict(consts, **flags),
                        **opts,
                    )
                )
                if unroll:
                    out.append(
                        _case(
                            "all_gather.decode",
                            "_ag_rmsnorm_kernel",
                            f"{name} {label}".strip(),
                            dict(consts, **flags),
                            **opts,
                        )
                    )
    return out


def moe_reduction_cases(mods) -> list[dict]:
    from moefuse.comm.tiles import CommTile, comm_tile

    mt = mods["moe_reduction"]
    out = []
    for pattern, dense, stepwise, bias in (
        (1, False, True, False),
        (3, False, False, True),
        (2, True, True, False),
    ):
        tile = comm_tile(H, pattern)
        for ctas in (1, 2):
            cap = min(255, 65536 // (32 * tile.num_warps * ctas)) // 8 * 8
            opts = dict(
                num_warps=tile.num_warps, enable_fp_fusion=False, launch_pdl=True, maxnreg=cap
            )
            prod = dict(
                K=K,
                KB=mt.rows_per_batch(K, tile, ctas, bias),
                DENSE=dense,
                HAS_W=True,
                HAS_BIAS=bias,
                HAS_RSF=not dense,
                HAS_SHARED=True,
                STEPWISE=stepwise,
            )
            common = dict(
                BLOCK_H=tile.block,
                PATTERN=pattern,
                LAYOUT=0,
                KP_BLOCK=tile.kp_block,
                WRITE_AR=dense,
                USE_PDL=True,
                PTX=True,
            )
            tag = (
                f"pattern={pattern} dense={dense:d} stepwise={stepwise:d} bias={bias:d} "
                f"ctas/SM={ctas}"
            )
            out.append(
                _case(
                    "moe_reduction",
                    "_moe_oneshot_kernel",
                    tag,
                    dict(P=P, BITS=16, **prod, **common),
                    **opts,
                )
            )
            out.append(
                _case(
                    "moe_reduction",
                    "_moe_twoshot_kernel",
                    tag,
                    dict(P=P, PP=P, NSLOT=1024, BITS=16, **prod, **common),
                    **opts,
                )
            )
            if dense:
                continue
            c = 4
            width = CommTile(block=tile.block // c, num_warps=tile.num_warps, kp_block=1)
            split = dict(prod, KB=mt.rows_per_batch(K, width, ctas, bias))
            out.append(
                _case(
                    "moe_reduction",
                    "_moe_split_kernel",
                    f"{tag} C={c}",
                    dict(P=P, BITS=16, C=c, BLOCK_W=tile.block // c, **split, **common),
                    **opts,
                )
            )
        opts = dict(num_warps=tile.num_warps, enable_fp_fusion=False, launch_pdl=True)
        out.append(
            _case(
                "moe_reduction",
                "_moe_partial_kernel",
                tag.rsplit(" ", 1)[0],
                dict(
                    BLOCK_H=tile.block,
                    USE_PDL=True,
                    PTX=True,
                    **dict(prod, KB=mt.rows_per_batch(K, tile, 1, bias)),
                ),
                **opts,
            )
        )
        out.append(
            _case(
                "moe_reduction",
                "_moe_gathered_kernel",
                tag.rsplit(" ", 1)[0],
                dict(P=P, STEPWISE=stepwise, **common),
                **opts,
            )
        )
    return out


def expert_norm_cases(mods) -> list[dict]:
    import triton

    from moefuse.comm.tiles import comm_tile

    tile = comm_tile(H, 1)
    block = -(-K // P)
    opts = dict(num_warps=tile.num_warps, launch_pdl=True)
    base = dict(BLOCK_H=tile.block, USE_PDL=True, PTX=True, K=K, WBN=True)
    tp = dict(base, B=block, NG=-(-K // block))
    peer = dict(tp, P=P)
    out = []
    for kernel in (
        "_tp_expert_owner_kernel",
        "_tp_slot_kernel",
        "_tp_token_owner_kernel",
        "_tp_gathered_kernel",
    ):
        out.append(_case("expert_norm.tp", kernel, "", peer, **opts))
    out.append(
        _case("expert_norm.tp", "_tp_staged_kernel", "", dict(peer, PP=P, NSLOT=1024), **opts)
    )
    for split in (False, True):
        out.append(
            _case(
                "expert_norm.tp",
                "_tp_slot_oneshot_kernel",
                f"split_fold={split:d}",
                dict(peer, SPLIT_FOLD=split, KP=triton.next_power_of_2(K)),
                **opts,
            )
        )
    for prefetch in (False, True):
        out.append(
            _case(
                "expert_norm.ep",
                "_ep_partial_kernel",
                f"prefetch={prefetch:d}",
                dict(base, PREFETCH=prefetch),
                **opts,
            )
        )
        out.append(
            _case(
                "expert_norm.ep",
                "_ep_oneshot_kernel",
                f"prefetch={prefetch:d}",
                dict(base, P=P, PREFETCH=prefetch),
                **opts,
            )
        )
    return out


def norm_quant_cases(mods) -> list[dict]:
    from moefuse.norm import tiles

    nt, qf = mods["norm"], mods["quant"]
    row_consts = getattr(nt, "row_consts", None) or nt._row_consts
    kernels = (
        ("norm.rms", "_rmsnorm_kernel", "rmsnorm", tiles.RMSNORM_POLICY, {"HAS_GATE": False}),
        (
            "norm.rms",
            "_rmsnorm_kernel",
            "sigmoid_gate",
            tiles.SIGMOID_GATE_POLICY,
            {"HAS_GATE": True},
        ),
        ("norm.rms", "_fused_add_rmsnorm_kernel", "", tiles.FUSED_ADD_POLICY, {}),
        (
            "norm.gated_residual",
            "_gated_residual_kernel",
            "",
            tiles.GATED_POLICY,
            {"HAS_WEIGHT": True},
        ),
        (
            "norm.gated",
            "_gated_residual_next_kernel",
            "",
            tiles.GATED_POLICY,
            {"ALPHA_MODE": 2, "HAS_POST_WEIGHT": True, "HAS_ROUTER": True},
        ),
        (
            "quant",
            "_rmsnorm_fp8_kernel",
            "",
            qf.QUANT_POLICY,
            {"HAS_RESIDUAL": False, "FMT": 0, "EVICT_FIRST": True},
        ),
        (
            "quant",
            "_rmsnorm_fp8_kernel",
            "residual",
            qf.QUANT_ADD_POLICY,
            {"HAS_RESIDUAL": True, "FMT": 0, "EVICT_FIRST": True},
        ),
        (
            "quant",
            "_rmsnorm_fp4_kernel",
            "",
            qf.QUANT_FP4_POLICY,
            {
                "HAS_RESIDUAL": False,
                "HAS_NORM_OUT": False,
                "RECIPE": 0,
                "LAYOUT": 0,
                "EVICT_FIRST": True,
            },
        ),
        (
            "quant",
            "_rmsnorm_fp4_kernel",
            "residual",
            qf.QUANT_FP4_POLICY,
            {
                "HAS_RESIDUAL": True,
                "HAS_NORM_OUT": True,
                "RECIPE": 0,
                "LAYOUT": 0,
                "EVICT_FIRST": True,
            },
        ),
    )
    out = []
    for family, kernel, tag, policy, extra in kernels:
        for h in (4096, 7168):
            tile = tiles.row_tile(h, policy)
            for m in (1, 16384) if tile.stepped else (1,):
                consts, opts = _split(row_consts(tile, h, m, None, tiles.STEP_LOOP_MIN_ROWS, True))
                out.append(
                    _case(
                        family, kernel, f"{tag} H={h} M={m}".strip(), dict(consts, **extra), **opts
                    )
                )
    return out


def norm_mode_cases(mods) -> list[dict]:
    """The norm kernels' row modes that the default tiles above do not reach: one tile per
    program for the gated ops and fused_add (their defaults step these widths), the persistent
    row loop with and without prefetch (wide rows and several masked rows per tile, PDL on and
    off), and two passes over chunks (H = 32768)."""
    from moefuse.norm import tiles

    nt = mods["norm"]
    row_consts = getattr(nt, "row_consts", None) or nt._row_consts
    kernels = (
        ("norm.rms", "_rmsnorm_kernel", "rmsnorm", {"HAS_GATE": False}, 4),
        ("norm.rms", "_rmsnorm_kernel", "sigmoid_gate", {"HAS_GATE": True}, 4),
        ("norm.rms", "_fused_add_rmsnorm_kernel", "", {}, 4),
        ("norm.gated_residual", "_gated_residual_kernel", "", {"HAS_WEIGHT": True}, 2),
        (
            "norm.gated",
            "_gated_residual_next_kernel",
            "",
            {"ALPHA_MODE": 2, "HAS_POST_WEIGHT": True, "HAS_ROUTER": True},
            2,
        ),
    )
    one_tile = tiles.TilePolicy(max_warps=4, programs_per_sm=0)
    loop = tiles.TilePolicy(max_warps=4, programs_per_sm=2, prefetch=False)
    loop_prefetch = tiles.TilePolicy(max_warps=4, programs_per_sm=2, prefetch=True)
    modes = (
        ("one tile", 2048, one_tile, True),
        ("persistent", None, loop, True),
        ("prefetch", None, loop_prefetch, True),
        ("prefetch no-pdl", None, loop_prefetch, False),
        ("persistent", 100, loop, True),
        ("prefetch", 100, loop_prefetch, True),
        ("two-pass", 32768, tiles.TilePolicy(), True),
    )
    out = []
    for family, kernel, tag, extra, wide in kernels:
        for mode, h, policy, pdl in modes:
            h = h or wide * 1024
            tile = tiles.row_tile(h, policy)
            if tile.num_chunks > 1 and family != "norm.rms":
                continue  # the gated ops step wide rows: no two-pass mode
            consts, opts = _split(row_consts(tile, h, 1, None, tiles.STEP_LOOP_MIN_ROWS, pdl))
            name = f"{tag} {mode} H={h}".strip()
            out.append(_case(family, kernel, name, dict(consts, **extra), **opts))
    return out


def moe_cases(mods) -> list[dict]:
    """The finalize family (K = 8 unrolled, K = 32 looped at H = 2880: columns masked) and the
    fused experts' kernels (plan kernel or inline plan, split or fused finalize) at their
    launchers' constexprs, H = 4096, I = 1536."""
    from moefuse.moe.tiles import experts_tile, finalize_tile

    out = []
    for h, k, extras in ((4096, 8, False), (4096, 8, True), (2880, 32, True)):
        block, warps = finalize_tile(h)
        consts = dict(
            VEC=8,
            BLOCK=block,
            UNROLL=k if k <= 16 else 0,
            EVEN=h % block == 0,
            EXPANDED=extras,
            HAS_BIAS=extras,
            HAS_RSF=extras,
            HAS_SHARED=extras,
            PTX=True,
            USE_PDL=True,
        )
        tag = f"H={h} K={k}" + (" extras" if extras else "")
        options = dict(num_warps=warps, enable_fp_fusion=False, launch_pdl=True)
        out.append(_case("moe", "_moe_finalize_kernel", tag, consts, **options))
    block, warps = finalize_tile(H)
    pdl = dict(num_warps=warps, launch_pdl=True)
    out.append(
        _case(
            "moe", "_moe_scatter_add_kernel", "", dict(BLOCK=block, PTX=True, USE_PDL=True), **pdl
        )
    )
    out.append(
        _case("moe", "_moe_permute_kernel", "", dict(VEC=8, BLOCK=block, USE_PDL=True), **pdl)
    )
    plan = dict(BS=32, BC=128, EP=128, BT=16, USE_PDL=True)
    out.append(
        _case("moe.experts_plan", "_experts_plan_kernel", "", plan, num_warps=4, launch_pdl=True)
    )
    cfg = experts_tile(H, 1536)
    # w_st_k = 1: weights K-contiguous, which a launch passes as 1 and the JIT makes a constant
    common = dict(
        BK=cfg["bk"],
        STAGES=cfg["stages"],
        PTX=True,
        USE_PDL=True,
        w_st_k=1,
    )
    options = dict(num_warps=cfg["warps"], launch_pdl=True)
    for sp, bt in ((0, 16), (0, 64), (32, 16)):
        gate_up = dict(common, KDIM=H, INTER=1536, BN=cfg["bn_gate_up"], BT=bt, SP=sp)
        out.append(
            _case("moe.experts", "_experts_gate_up_kernel", f"SP={sp} BT={bt}", gate_up, **options)
        )
    for sp, bt, fused, extras in (
        (0, 16, False, (False,) * 3),
        (8, 16, True, (False,) * 3),
        (8, 16, True, (True,) * 3),
    ):
        down = dict(
            common, KDIM=1536, H=H, BN=cfg["bn_down"], BT=bt, SP=sp, FINALIZE=fused, EXTRAS=extras
        )
        tag = (
            f"SP={sp} BT={bt}" + (" finalize" if fused else "") + (" extras" if any(extras) else "")
        )
        out.append(
            _case(
                "moe.experts", "_experts_down_kernel", tag, down, enable_fp_fusion=False, **options
            )
        )
    return out


def quant_mode_cases(mods) -> list[dict]:
    """The fused norm + quant kernels' row modes that the default tiles above do not reach: two
    passes over chunks (H = 32768), the E5M2 stepped hook, one FP8 tile per program and the FP8
    persistent row loop with and without prefetch (with and without the residual, PDL on and
    off, several masked rows per tile at H = 100), and the NVFP4 persistent row loop with and
    without prefetch (a benchmark sweep's tile)."""
    from moefuse.norm import tiles

    nt, qf = mods["norm"], mods["quant"]
    row_consts = getattr(nt, "row_consts", None) or nt._row_consts
    fp8, fp8_add = {"HAS_RESIDUAL": False, "FMT": 1}, {"HAS_RESIDUAL": True, "FMT": 0}
    fp4 = {"HAS_RESIDUAL": True, "HAS_NORM_OUT": True, "RECIPE": 0, "EVICT_FIRST": True}
    one_tile = tiles.TilePolicy(programs_per_sm=0)
    loop = tiles.TilePolicy(programs_per_sm=2, prefetch=False)
    loop_prefetch = tiles.TilePolicy(programs_per_sm=2, prefetch=True)
    grid = (
        ("_rmsnorm_fp8_kernel", "two-pass", 32768, qf.QUANT_POLICY, fp8_add),
        ("_rmsnorm_fp8_kernel", "one tile", 4096, one_tile, fp8),
        ("_rmsnorm_fp8_kernel", "stepped e5m2", 4096, qf.QUANT_ADD_POLICY, dict(fp8_add, FMT=1)),
        ("_rmsnorm_fp8_kernel", "one tile residual", 4096, one_tile, fp8_add),
        ("_rmsnorm_fp8_kernel", "one tile no-pdl", 4096, one_tile, fp8_add),
        ("_rmsnorm_fp8_kernel", "one tile", 100, one_tile, fp8_add),
        ("_rmsnorm_fp8_kernel", "persistent", 4096, loop, fp8),
        ("_rmsnorm_fp8_kernel", "persistent residual", 4096, loop, fp8_add),
        ("_rmsnorm_fp8_kernel", "prefetch residual", 4096, loop_prefetch, fp8_add),
        ("_rmsnorm_fp8_kernel", "prefetch no-pdl", 4096, loop_prefetch, fp8),
        ("_rmsnorm_fp8_kernel", "persistent", 100, loop, fp8_add),
        ("_rmsnorm_fp8_kernel", "prefetch", 100, loop_prefetch, fp8),
        ("_rmsnorm_fp4_kernel", "two-pass", 32768, qf.QUANT_FP4_POLICY, dict(fp4, LAYOUT=1)),
        ("_rmsnorm_fp4_kernel", "persistent", 4096, loop, dict(fp4, LAYOUT=0)),
        ("_rmsnorm_fp4_kernel", "prefetch", 4096, loop_prefetch, dict(fp4, LAYOUT=1)),
    )
    out = []
    for kernel, tag, h, policy, extra in grid:
        tile = tiles.row_tile(h, policy)
        pdl = "no-pdl" not in tag
        consts, opts = _split(row_consts(tile, h, 1, None, tiles.STEP_LOOP_MIN_ROWS, pdl))
        consts = {**consts, "EVICT_FIRST": tile.num_chunks == 1, **extra}
        out.append(_case("quant", kernel, f"{tag} H={h}", consts, **opts))
    return out


#: the case tables of each family (``ptx_check.py compare FAMILY``); "norm" holds the norm and
#: quant row kernels the all-gather kernels reuse, "quant" the quant kernels' other row modes
FAMILY_CASES = {
    "all-reduce": (all_reduce_cases,),
    "all-gather": (all_gather_cases,),
    "moe-reduction": (moe_reduction_cases,),
    "expert-norm": (expert_norm_cases,),
    "norm": (norm_quant_cases, norm_mode_cases),
    "moe": (moe_cases,),
    "quant": (quant_mode_cases,),
}


# ----------------------------------------------------------------------------- compile
def normalise(ptx: str) -> str:
    """``ptx`` without debug sections, ``.file`` / ``.loc`` lines, line-info labels
    (``$L__tmpN:``) and comments, its kernel and function names replaced by ``NAME0``,
    ``NAME1``, ... in order of appearance."""
    cut = re.search(r"^\s*\.section\s+\.debug", ptx, flags=re.M)
    if cut:
        ptx = ptx[: cut.start()]
    lines = []
    for line in ptx.splitlines():
        line = re.sub(r"//.*", "", line).rstrip()
        if not line.strip() or re.match(r"\s*\.(file|loc)\b", line):
            continue
        if re.fullmatch(r"\$L__tmp\d+:", line.strip()):
            continue  # a line-info label (inlined scopes), referenced by the debug sections only
        lines.append(line)
    text = "\n".join(lines) + "\n"
    names = []
    for match in re.finditer(r"\.(entry|func)\s+(?:\([^)]*\)\s*)?([\w$]+)", text):
        if match.group(2) not in names:
            names.append(match.group(2))
    for i, name in sorted(enumerate(names), key=lambda item: -len(item[1])):
        text = re.sub(rf"\b{re.escape(name)}(?=\b|_param_)", f"NAME{i}", text)
    return text


def compile_case(case: dict, mods: dict) -> str:
    """Normalised PTX of one case (raises when its kernel does not compile)."""
    import triton

    ptxas = ptxas_helpers()
    TARGET, specialised_source = ptxas.TARGET, ptxas.specialised_source
    with_constexpr_defaults, tuple_fields = ptxas.with_constexpr_defaults, ptxas.tuple_fields
    leaf_names = ptxas.leaf_names
    kernel = getattr(mods[case["family"]], case["kernel"])
    params = inspect.signature(kernel.fn).parameters
    consts = with_constexpr_defaults(
        kernel, {k: v for k, v in case["consts"].items() if k in params}
    )
    group = case["family"].split(".")[0]
    ptrs = {**POINTERS["*"], **POINTERS.get(group, {})}
    # tuple parameters (nested ones too) are typed element by element, by the names the kernel
    # unpacks them into
    fields = tuple_fields(kernel)
    names = [*params, *leaf_names(fields.values())]
    types = {
        name: ptrs.get(name, "*bf16")
        if name.endswith("_ptr")
        else "fp32"
        if name in FLOATS
        else "i32"
        for name in names
    }
    skip = set(getattr(kernel, "do_not_specialize", ()) or ())
    skip = {params_name(kernel, s) for s in skip}
    # do_not_specialize names a whole parameter: a tuple's elements are all left unspecialised
    skip = {e for s in skip for e in leaf_names(fields.get(s, (s,)))}
    src = specialised_source(
        kernel,
        consts,
        types,
        lambda name, t: (
            t.startswith("*") or (name not in skip and name not in NOT_DIVISIBLE and t == "i32")
        ),
    )
    compiled = triton.compile(src, target=TARGET, options=dict(case["options"]))
    return normalise(compiled.asm["ptx"])


def ptxas_helpers():
    """This checkout's ``moefuse/tools/ptxas.py`` (it imports triton only), loaded by its path:
    the same compile helpers for every tree, whichever revision that tree's src/ is."""
    import importlib.util

    name = "_moefuseptxas_helpers"
    if name not in sys.modules:
        path = os.path.join(ROOT, "src", "moefuse", "tools", "ptxas.py")
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def params_name(kernel, entry) -> str:
    """An entry of ``do_not_specialize`` (a name or an index) as a parameter name."""
    if isinstance(entry, int):
        return list(inspect.signature(kernel.fn).parameters)[entry]
    return entry


def case_id(case: dict) -> str:
    return f"{case['kernel']} [{case['tag']}]" if case["tag"] else case["kernel"]


def worker(dump: str, only: str, families: list[str]) -> int:
    """Compile every case in this interpreter's tree; write ``index.json`` and the normalised
    PTX into ``dump``."""
    import importlib

    mods = {}
    for family, names in MODULES.items():
        for name in names:
            try:
                mods[family] = importlib.import_module(name)
                break
            except ModuleNotFoundError:
                continue
    index = {}
    makers = [make for fam in families for make in FAMILY_CASES[fam]]
    for make in dict.fromkeys(makers):
        for case in make(mods):
            cid = case_id(case)
            if only and not any(part in cid for part in only.split(",")):
                continue
            entry = {
                "kernel": case["kernel"],
                "tag": case["tag"],
                "module": getattr(mods[case["family"]], "__name__", ""),
            }
            if not hasattr(mods[case["family"]], case["kernel"]):
                entry["missing"] = True
            else:
                try:
                    text = compile_case(case, mods)
                except Exception as exc:  # reported per case
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:2000]
                else:
                    fname = hashlib.sha1(cid.encode()).hexdigest()[:16] + ".ptx"
                    with open(os.path.join(dump, fname), "w") as f:
                        f.write(text)
                    entry.update(
                        sha256=hashlib.sha256(text.encode()).hexdigest(),
                        file=fname,
                        lines=text.count("\n"),
                    )
            index[cid] = entry
            print(
                f"{cid}: {entry.get('sha256', '')[:12] or entry.get('error') or 'missing'}",
                flush=True,
            )
    with open(os.path.join(dump, "index.json"), "w") as f:
        json.dump(index, f, indent=1)
    return 0


def run_tree(tree: str, dump: str, only: str, families: list[str]) -> dict:
    """Compile in a fresh interpreter with ``tree``'s src on the path; the worker's index."""
    os.makedirs(dump, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(tree, "src"), HERE])
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", dump, "--only", only]
    cmd += ["--families", ",".join(families)]
    log = os.path.join(dump, "worker.log")
    with open(log, "w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=tree)
    if proc.returncode:
        raise RuntimeError(f"the compile of {tree} failed (exit {proc.returncode}): see {log}")
    with open(os.path.join(dump, "index.json")) as f:
        return json.load(f)


def extract(rev: str, folder: str) -> str:
    """``rev``'s src/ (git archive) in ``folder``; the tree's path."""
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", rev, "src"], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


# ----------------------------------------------------------------------------- what is left
#: why a kernel of the list below was not split or grouped (the others: see LEFT_DEFAULT)
LEFT_WHY: dict[str, str] = {}
LEFT_DEFAULT = (
    "over 32 parameters: grouping them into tuples changes the signature, every "
    "launcher and this script's specialisation; not attempted without a GPU A/B"
)


def left_over(tree: str) -> list[tuple[str, str, int, int]]:
    """(module, function, lines, parameters) of every function of ``tree``'s comm/ over 100
    lines and every ``@triton.jit`` function over 32 parameters (packed source, as committed)."""
    import ast

    out = []
    root = os.path.join(tree, "src", "moefuse", "comm")
    for folder, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            with open(path) as f:
                module = ast.parse(f.read())
            for node in ast.walk(module):
                if not isinstance(node, ast.FunctionDef):
                    continue
                lines = node.end_lineno - node.lineno + 1
                params = len(node.args.args) + len(node.args.kwonlyargs)
                jit = any("jit" in ast.unparse(d) for d in node.decorator_list)
                if lines > 100 or (jit and params > 32):
                    out.append(
                        (os.path.relpath(path, os.path.join(tree, "src")), node.name, lines, params)
                    )
    return out


# ----------------------------------------------------------------------------- report
def compare(before: dict, after: dict, dumps: tuple[str, str]) -> list[dict]:
    rows = []
    for cid in list(before) + [c for c in after if c not in before]:
        b, a = before.get(cid, {"missing": True}), after.get(cid, {"missing": True})
        row = {
            "case": cid,
            "kernel": (a if "module" in a else b)["kernel"],
            "module_before": "" if b.get("missing") else b.get("module", ""),
            "module_after": "" if a.get("missing") else a.get("module", ""),
            "sha256_before": b.get("sha256", ""),
            "sha256_after": a.get("sha256", ""),
            "lines": a.get("lines", b.get("lines", 0)),
        }
        if b.get("missing") and a.get("missing"):
            continue
        if b.get("missing"):
            row["verdict"] = "only after"
        elif a.get("missing"):
            row["verdict"] = "only before"
        elif "error" in a or "error" in b:
            row["verdict"] = "compile error"
            row["error"] = a.get("error") or b.get("error")
        elif a["sha256"] == b["sha256"]:
            row["verdict"] = "identical"
        else:
            row["verdict"] = "different"
            with open(os.path.join(dumps[0], b["file"])) as f:
                old = f.read().splitlines()
            with open(os.path.join(dumps[1], a["file"])) as f:
                new = f.read().splitlines()
            diff = list(difflib.unified_diff(old, new, "before", "after", n=1, lineterm=""))
            row["diff_lines"] = sum(1 for d in diff if d[:1] in "+-") - 2
            row["diff_head"] = diff[:40]
        rows.append(row)
    return rows


def write_report(rows: list[dict], args, path: str) -> None:
    counts = {}
    for row in rows:
        counts[row["verdict"]] = counts.get(row["verdict"], 0) + 1
    kernels = sorted({r["kernel"] for r in rows})
    lines = [
        "# Compiled code of the communication kernels: before / after",
        "",
        f"Made by `python scripts/ptx_check.py compare {' '.join(args.families)} "
        f"--before {args.before_label} --after {args.after_label}"
        + (f" --hidden {args.hidden}" if args.hidden != 4096 else "")
        + (f" --only {args.only}" if args.only else "")
        + "` (offline, sm_90a, Triton's CUDA backend; no GPU).",
        "",
        f"Verdict: {', '.join(f'{n} {v}' for v, n in sorted(counts.items()))} "
        f"({len(rows)} compiled cases of {len(kernels)} kernels).",
        "",
        "Each case is one kernel at one launch's constexprs and compile options "
        f"(H = {args.hidden} unless the case names its own, "
        "P = 2, K = 8, BF16, PDL on; patterns, modes and variants as listed). PTX normalised: "
        "debug sections, `.file` / `.loc` lines, line-info labels (`$L__tmpN:`) and comments "
        'dropped, kernel and function names replaced by placeholders. "only before": the '
        "kernel was deleted (a variant retired by a measurement, see the family's note).",
        "",
        "| case | module before | module after | verdict | PTX lines |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| `{row['case']}` | {row['module_before'] or '-'} | "
            f"{row['module_after'] or '-'} | {row['verdict']} | {row['lines']} |"
        )
    gone = [r["case"] for r in rows if r["verdict"] == "only before"]
    notes = [(k, v) for k, v in DELETED.items() if any(c.startswith(k) for c in gone)]
    if notes:
        lines += ["", "Kernels and switches of before that are gone:", ""]
        lines += [f"* `{k}`: {v}" for k, v in notes]
    if any(
        r["module_before"] != r["module_after"]
        for r in rows
        if r["module_before"] and r["module_after"]
    ):
        lines += ["", f"* `PROBE`: {DELETED['PROBE']}"]  # (a tree of before the rebuild)
    left = args.left
    if left:
        lines += [
            "",
            "## Left for a GPU A/B: functions over 100 lines, kernels over 32 parameters",
            "",
            "Lines of the committed (hand-packed) source; formatted by "
            "ruff, more functions pass 100 lines (the kernels here, the launchers).",
            "",
            "| module | function | lines | parameters | why not changed |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {m} | `{fn}` | {n} | {k} | {LEFT_WHY.get(fn, LEFT_DEFAULT)} |"
            for m, fn, n, k in left
        ]
    for row in rows:
        if row["verdict"] in ("different", "compile error"):
            lines += ["", f"## {row['case']}: {row['verdict']}", "", "```"]
            lines += row.get("diff_head", []) or [row.get("error", "")]
            lines += ["```"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="ptx_check.py compare (table-typed families)",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--families",
        default=",".join(FAMILY_CASES),
        help=f"comma-separated, of {', '.join(FAMILY_CASES)} (default: all)",
    )
    parser.add_argument(
        "--before",
        default="HEAD",
        help="git revision or source tree compiled as 'before' (default HEAD)",
    )
    parser.add_argument(
        "--after",
        default=ROOT,
        help="git revision or source tree compiled as 'after' (default: this "
        "checkout, uncommitted changes included)",
    )
    parser.add_argument(
        "--only",
        default="",
        help="only the cases whose name contains this (or one of these, comma-separated)",
    )
    parser.add_argument(
        "--hidden",
        type=int,
        default=H,
        help="row width H of the cases (default 4096; 8192 reaches the stepped rmsnorm rows)",
    )
    parser.add_argument("--report", default="", help="Markdown report to write")
    parser.add_argument("--json", default="", help="JSON report to write")
    parser.add_argument("--dump", default="", help="keep the normalised PTX in this folder")
    parser.add_argument(
        "--reuse-before",
        action="store_true",
        help="take the 'before' PTX from an earlier run's --dump folder",
    )
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.families = [f for f in args.families.split(",") if f]
    unknown = [f for f in args.families if f not in FAMILY_CASES]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {', '.join(FAMILY_CASES)}")
    if args.worker:
        return worker(args.worker, args.only, args.families)
    os.environ["COMM_PTX_COMPARE_HIDDEN"] = str(args.hidden)
    with tempfile.TemporaryDirectory() as tmp:
        dump = args.dump or tmp
        before = args.before
        args.before_label = before
        if not os.path.isdir(before):
            before = extract(before, tempfile.mkdtemp(dir=tmp))
        after = args.after
        args.after_label = "." if os.path.abspath(after) == ROOT else after
        if not os.path.isdir(after):
            after = extract(after, tempfile.mkdtemp(dir=tmp))
        args.left = left_over(after)
        dumps = (os.path.join(dump, "before"), os.path.join(dump, "after"))
        cached = os.path.join(dumps[0], "index.json")
        if args.reuse_before and os.path.exists(cached):
            with open(cached) as f:
                parts = args.only.split(",")
                first = {k: v for k, v in json.load(f).items() if any(p in k for p in parts)}
            indices = [first, run_tree(after, dumps[1], args.only, args.families)]
        else:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                jobs = [
                    pool.submit(run_tree, tree, d, args.only, args.families)
                    for tree, d in zip((before, after), dumps)
                ]
                indices = [job.result() for job in jobs]
        rows = compare(*indices, dumps)
    for row in rows:
        print(f"{row['verdict']:14s} {row['case']}")
    if args.report:
        write_report(rows, args, args.report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"before": args.before_label, "after": args.after_label, "cases": rows}, f, indent=1
            )
    bad = [r for r in rows if r["verdict"] in ("different", "compile error")]
    print(f"{len(rows)} cases: {len(bad)} different or failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
