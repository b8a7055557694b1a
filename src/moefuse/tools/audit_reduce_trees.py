"""Which row-sum order does each kernel compile to? An offline audit (no GPU) of the kernels
that moefuse promises give the same bits: the single-GPU norms and the all-gather + norm kernels
that claim bitwise equality with them, and a single-GPU op's variants (gated_next with and
without router_input).

Triton lowers ``tl.sum`` over a row in the register layout it chose for the summed tensor: the
elements each thread holds along the row are added in register order, then lanes, then warps.
That layout comes from the memory operations around the sum (16-byte vectors: 4 FP32 or 8
16-bit elements per thread), so two kernels running the same row code can sum in different
orders. This script compiles each kernel for sm_90a with the launch's specialisation (16-byte
aligned pointers, strides and widths divisible by 16: without them every layout is [1, 1] and
all kernels look alike), lists the layout of every ``tt.reduce`` in program order, and compares
each kernel with the single-GPU op it must match. ``DIFF`` means the two sum at least one row
statistic in different orders (bits may differ, now and then, by an ulp); a kernel that sums
one statistic twice, in two layouts, shows more sums than its reference.

The per-token-group quant fusions are compared with rmsnorm / fused_add_rmsnorm too: storing
their 8-bit codes 16 to a vector once laid the whole tile out 16 elements per thread, row sum
included, at the one-pass 4096-column tile (caught here, offline).

Written after an H200 run (notes/norm.md) found gated_next's ffn_input differing with
and without router_input on one-pass rows; this audit showed the two layouts before any GPU time
and MATCH after the fix. tests/test_reduce_trees.py runs it in CI (exit status 1 on any DIFF).
Run: PYTHONPATH=src python -m moefuse.tools.audit_reduce_trees [--widths 1024,2048,4096] [--p 2]
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys

import triton

from moefuse.comm.all_gather import decode as dec
from moefuse.comm.all_gather import kernels as AG
from moefuse.comm.all_gather import persistent as fused
from moefuse.norm import gated, rms, tiles
from moefuse.norm import triton as nt
from moefuse.quant import group_fused
from moefuse.tools.compile_check_allgather import DIVISIBLE, OP_TYPES, TYPES, norm_consts
from moefuse.tools.ptxas import TARGET, specialised_source, with_constexpr_defaults

#: FP32 pointers of the single-GPU gated_next kernel (the others hold the branch dtype)
GATED_FP32 = {"res_ptr", "alpha_ptr", "beta_ptr", "rout_ptr", "router_ptr"}
#: store chunks of rmsnorm_group_quant's re-read rows that are audited where a tile takes them
RELOAD_WIDTHS = (1024, 2048, 4096)
#: integer arguments equal to 1 at a launch of 2-D rows, which Triton specialises as constants
EQUAL_TO_ONE = {"HEADS": 1}


def int_values(h: int, p: int) -> dict[str, int]:
    """The integer arguments whose divisibility by 16 the launch sees, for contiguous [M, h] rows
    (row strides h, shard width h / P, head strides 0); other names of compile_check_allgather's
    DIVISIBLE list (capacities, offsets in 16-byte units) count as multiples of 16."""
    rows = {
        name: h for name in ("H", "b_st", "r_st", "ro_st", "f_st", "rt_st", "x_st", "o_st", "g_st")
    }
    return {
        **{name: 16 for name in DIVISIBLE},
        **rows,
        "x_sh": 0,
        "o_sh": 0,
        "g_sh": 0,
        "S": h // p,
        "s_st": h // p,
    }


def ttgir(kernel, consts: dict, num_warps: int, types: dict, ints: dict[str, int]) -> str:
    """TTGIR of ``kernel`` compiled for sm_90a with the launch's specialisation: pointers 16-byte
    aligned, the integer arguments of ``ints`` divisible by 16 where their values are."""
    params = inspect.signature(kernel.fn).parameters
    consts = {**{k: v for k, v in EQUAL_TO_ONE.items() if k in params}, **consts}
    consts = with_constexpr_defaults(kernel, {k: v for k, v in consts.items() if k in params})
    src = specialised_source(
        kernel, consts, types, lambda name, t: t.startswith("*") or ints.get(name, 1) % 16 == 0
    )
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps}).asm["ttgir"]


def reduce_trees(ir: str) -> list[str]:
    """The layout of every float ``tt.reduce`` along a row (the last axis), in program order."""
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.blocked<\{.*?\}>)", ir, flags=re.M))
    out = []
    for head in re.finditer(r'"tt\.reduce"\(%[\w.]+\) <\{axis = (\d+) : i32\}>', ir):
        end = re.compile(r"\}\) : \(tensor<([\dx]+)x(\w+), (#\w+)>\)").search(ir, head.end())
        axis, (shape, dtype, name) = int(head.group(1)), end.groups()
        if not dtype.startswith("f") or axis != shape.count("x"):
            continue  # not a float sum along the row (e.g. a poll over the slots of a tile)
        fields = re.findall(
            r"(sizePerThread|threadsPerWarp|warpsPerCTA) = (\[[^\]]*\])", layouts.get(name, name)
        )
        out.append(f"axis {axis} of {shape}: " + " ".join(f"{k}={v}" for k, v in fields))
    return out


def single_gated_next(h: int, router: bool, m: int) -> list[str]:
    tile = tiles.row_tile(h, tiles.GATED_POLICY)
    consts = nt._row_consts(tile, h, m, None, tiles.STEP_LOOP_MIN_ROWS, True)
    consts.update(ALPHA_MODE=2, HAS_POST_WEIGHT=True, HAS_ROUTER=router)
    warps = consts.pop("num_warps")
    types = {n: "*fp32" for n in GATED_FP32} | {
        n: "fp32"
        for n in (
            "Hf",
            "alpha_scalar",
            "post_eps",
            "next_eps",
            "next_gain_center",
            "post_gain_center",
        )
    }
    return reduce_trees(
        ttgir(gated._gated_residual_next_kernel, consts, warps, types, int_values(h, 1))
    )


def single_rmsnorm(h: int, m: int) -> list[str]:
    tile = tiles.row_tile(h, tiles.RMSNORM_POLICY)
    consts = nt._row_consts(tile, h, m, None, tiles.RMSNORM_LOOP_MIN_ROWS, True)
    consts["HAS_GATE"] = False
    warps = consts.pop("num_warps")
    types = {"Hf": "fp32", "eps": "fp32", "gain_center": "fp32"}
    return reduce_trees(ttgir(rms._rmsnorm_kernel, consts, warps, types, int_values(h, 1)))


def single_fused_add(h: int, m: int) -> list[str]:
    tile = tiles.row_tile(h, tiles.FUSED_ADD_POLICY)
    consts = nt._row_consts(tile, h, m, None, tiles.FUSED_ADD_LOOP_MIN_ROWS, True)
    warps = consts.pop("num_warps")
    types = {"Hf": "fp32", "eps": "fp32", "gain_center": "fp32"}
    return reduce_trees(
        ttgir(rms._fused_add_rmsnorm_kernel, consts, warps, types, int_values(h, 1))
    )


def group_quant_trees(
    h: int, residual: bool, m: int, per_sm: int = 0, reload: int = 0
) -> list[str]:
    """rmsnorm_group_quant / fused_add_rmsnorm_group_quant (E4M3, groups of 128): their row sums
    must be those of rmsnorm / fused_add_rmsnorm (fused == unfused bitwise), with one tile per
    program and in the persistent row loop with prefetch at ``per_sm`` programs per SM (one-pass
    rows; other rows ignore it), the store on the norm's tile or re-reading the row in chunks
    of ``reload`` columns. The group maxima are integer reductions and are not listed."""
    tile = group_fused.norm_group_tile(h, residual, per_sm)
    loop_min = (
        group_fused.GROUP_ADD_LOOP_MIN_ROWS if residual else group_fused.GROUP_RMSNORM_LOOP_MIN_ROWS
    )
    consts = nt._row_consts(tile, h, m, None, loop_min, True)
    consts.update(
        HAS_RESIDUAL=residual, GW=min(128, tile.block), QMAX=448.0, UE8M0=False, INT8=False,
        E8M0=False, RCP=True, SUB=reload, NSUB=-(-h // reload) if reload else 0,
    )  # fmt: skip
    warps = consts.pop("num_warps")
    types = {
        "Hf": "fp32", "eps": "fp32", "gain_center": "fp32", "qeps": "fp32", "q_ptr": "*u8",
        "s_ptr": "*fp32",
    }  # fmt: skip
    ints = {**int_values(h, 1), "q_st": h, "s_st": 16, "s_sg": 1, "G": 16}
    return reduce_trees(ttgir(group_fused._norm_group_quant_kernel, consts, warps, types, ints))


def allgather_trees(op: int, h: int, p: int, router: bool | None) -> dict[str, list[str]]:
    """The decode (one-launch) and persistent kernels of the all-gather op, unrolled mode."""
    block_s, _ = AG.allgather_tile(h // p)
    out = {}
    consts, warps = norm_consts(h, True, op)
    if router is not None:
        consts["HAS_ROUTER"] = router
    types = {**TYPES, **OP_TYPES[op]}
    for name, kernel in (
        ("decode", dec._ag_rmsnorm_kernel),
        ("persistent", fused._ag_rmsnorm_persistent_kernel),
    ):
        ir = ttgir(kernel, {**consts, "P": p, "BLOCK_S": block_s}, warps, types, int_values(h, p))
        out[name] = reduce_trees(ir)
    return out


def _compare(tag: str, ref: list[str], got: list[str]) -> bool:
    same = ref == got
    print(f"{'MATCH' if same else 'DIFF '} {tag}")
    if not same:
        for line in ref:
            print(f"        reference: {line}")
        for line in got:
            print(f"        this     : {line}")
    return same


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", default="1024,2048,2880,4096")
    parser.add_argument("--p", type=int, default=2)
    args = parser.parse_args()
    diffs = 0
    for h in map(int, args.widths.split(",")):
        with_router = single_gated_next(h, True, 16384)
        without = single_gated_next(h, False, 16384)
        diffs += not _compare(
            f"H={h} gated_next: without router_input vs with", with_router, without
        )
        if dec.fusable(dec.GATED, dec.op_tile(dec.GATED, h)) and h % args.p == 0:
            for router, ref in ((True, with_router), (False, without)):
                for kname, trees in allgather_trees(dec.GATED, h, args.p, router).items():
                    diffs += not _compare(
                        f"H={h} all_gather gated {kname} (router={router}) vs gated_next",
                        ref,
                        trees,
                    )
        if dec.fusable(dec.RMSNORM, dec.op_tile(dec.RMSNORM, h)) and h % args.p == 0:
            ref = single_rmsnorm(h, 16384)
            for kname, trees in allgather_trees(dec.RMSNORM, h, args.p, None).items():
                diffs += not _compare(f"H={h} all_gather rmsnorm {kname} vs rmsnorm", ref, trees)
        for per_sm in (0, group_fused.GROUP_PROGRAMS_PER_SM):
            loop = f" (persistent, {per_sm} per SM)" if per_sm else ""
            diffs += not _compare(
                f"H={h} rmsnorm_group_quant{loop} vs rmsnorm",
                single_rmsnorm(h, 16384),
                group_quant_trees(h, False, 16384, per_sm),
            )
            diffs += not _compare(
                f"H={h} fused_add_rmsnorm_group_quant{loop} vs fused_add_rmsnorm",
                single_fused_add(h, 16384),
                group_quant_trees(h, True, 16384, per_sm),
            )
            tile = group_fused.norm_group_tile(h, False, per_sm)
            for sub in RELOAD_WIDTHS if not per_sm else ():
                if group_fused.reloadable(tile, False, sub, min(128, tile.block)):
                    diffs += not _compare(
                        f"H={h} rmsnorm_group_quant{loop}, store re-reading {sub} columns, "
                        "vs rmsnorm",
                        single_rmsnorm(h, 16384),
                        group_quant_trees(h, False, 16384, per_sm, sub),
                    )
    print(f"TOTAL differing kernels: {diffs}")
    return diffs


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
