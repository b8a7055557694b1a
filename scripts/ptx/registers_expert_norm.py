"""Offline sm_90a compile of the per-expert-norm kernels (no GPU): ptxas registers / spills.

``python scripts/ptx_check.py registers expert-norm [--widths 4096,7168] [--topk 8]``
(``--only NAME``: the kernels whose name contains NAME)
compiles ``_tp_slot_oneshot_kernel``, ``_tp_expert_owner_kernel``,
``_tp_token_owner_kernel``, ``_tp_staged_kernel``, ``_tp_gathered_kernel``,
``_ep_partial_kernel`` and ``_ep_oneshot_kernel``
(P = 2, BF16, PDL on, weight before norm) with Triton's CUDA backend and runs ptxas
-arch=sm_90a on the PTX: catches GPU-only compile errors and reports registers, spills and
16-byte volatile loads (Lamport polls) per kernel.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys

TYPES = {
    "table_ptr": "*i64",
    "ctrl_ptr": "*i32",
    "clock_ptr": "*i32",
    "idx_ptr": "*i32",
    "w_ptr": "*fp32",
    "eps": "fp32",
    "gain_center": "fp32",
    "Hf": "fp32",
}


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="ptx_check.py registers expert-norm")
    parser.add_argument("--widths", default="4096,7168")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--only", default="", help="compile kernels whose name contains this")
    args = parser.parse_args(argv)
    import triton

    from moefuse.comm.expert_norm import ep_kernels as xe
    from moefuse.comm.expert_norm import tp_kernels as xt
    from moefuse.comm.tiles import comm_tile

    k, p = args.topk, args.world_size
    block = -(-k // p)
    failed = 0
    for h in map(int, args.widths.split(",")):
        tile = comm_tile(h, 1)
        for kernel in (
            xt._tp_slot_oneshot_kernel,
            xt._tp_expert_owner_kernel,
            xt._tp_token_owner_kernel,
            xt._tp_staged_kernel,
            xt._tp_gathered_kernel,
            xe._ep_partial_kernel,
            xe._ep_oneshot_kernel,
        ):
            if args.only not in kernel.fn.__name__:
                continue
            split = kernel is xt._tp_slot_oneshot_kernel  # and its split-fold decode variant
            for extra in ({}, {"SPLIT_FOLD": True, "KP": triton.next_power_of_2(k)})[: 1 + split]:
                failed += compile_one(kernel, h, k, p, block, tile, extra)
    return 1 if failed else 0


def compile_one(kernel, h, k, p, block, tile, extra) -> int:
    """Compile ``kernel`` (constexprs + ``extra``) and print its ptxas report; 1 on failure."""
    import triton

    from moefuse.tools.ptxas import (
        TARGET,
        ptxas_report,
        specialised_source,
        with_constexpr_defaults,
    )

    consts = dict(
        P=p,
        PP=triton.next_power_of_2(p),
        NSLOT=1024,
        K=k,
        B=block,
        KPOW=triton.next_power_of_2(k),
        NG=-(-k // block),
        BLOCK_H=tile.block,
        WBN=True,
        USE_PDL=True,
        PTX=True,
        **extra,
    )
    params = list(inspect.signature(kernel.fn).parameters)
    consts = with_constexpr_defaults(kernel, {n: v for n, v in consts.items() if n in params})
    src = specialised_source(
        kernel,
        consts,
        TYPES,
        lambda name, _: (
            (name.endswith(("_ptr", "_st")) or name == "H")
            and name not in ("w_ptr", "idx_ptr", "w_st", "idx_st")
        ),
    )
    try:
        ck = triton.compile(src, target=TARGET, options={"num_warps": tile.num_warps})
    except Exception as exc:  # reported; main() goes on with the next kernel
        print(f"H={h} {kernel.fn.__name__} {extra}: COMPILE ERROR {exc}", flush=True)
        return 1
    ptx = ck.asm["ptx"]
    report = ptxas_report(ptx)
    v4 = len(re.findall(r"ld\.volatile\.global\.v4", ptx))
    print(
        f"H={h:5d} K={k} P={p} {kernel.fn.__name__:24s} warps={tile.num_warps:2d} "
        f"regs={report.regs} spills={report.spills} ld.volatile.v4={v4} "
        f"ptxas_rc={report.returncode} {'split fold' if extra else ''}",
        flush=True,
    )
    return int(report.returncode != 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
