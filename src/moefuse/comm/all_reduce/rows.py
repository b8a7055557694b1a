"""Device functions the all-reduce kernels share (:mod:`moefuse.comm.all_reduce.oneshot`,
:mod:`moefuse.comm.all_reduce.twoshot`, :mod:`moefuse.comm.all_reduce.kernels`), with their
arguments grouped by role: the epilogue of one reduced row (every kernel) and the rank-order sum
of one row from the Lamport slots (the one-shot kernels).
"""

import triton
import triton.language as tl

from moefuse.comm import device as D


@triton.jit
def _epilogue(
    s,
    res,
    t,
    epi,
    outs,
    T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PATTERN: tl.constexpr,
    WRITE_NORM: tl.constexpr,
    LAYOUT: tl.constexpr,
    PTX: tl.constexpr,
):
    """:func:`moefuse.comm.device.epilogue_row` of row ``t``: ``s`` the T-rounded rank sum as
    FP32, ``res`` the residual row as FP32; ``epi`` = (g, cols, cmask, H, Hf, eps, inv_scale,
    gs, rcp_gs, n_kcols): the gain, the columns and the norm / quantization scalars; ``outs`` =
    (out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr): the outputs
    and their row strides. Writes the outputs of PATTERN (nothing returned)."""
    g, cols, cmask, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols = epi
    out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr = outs
    D.epilogue_row(
        s,
        res,
        g,
        t,
        cols,
        cmask,
        H,
        Hf,
        eps,
        inv_scale,
        gs,
        rcp_gs,
        n_kcols,
        out_ptr,
        out_st,
        rout_ptr,
        rout_st,
        nout_ptr,
        nout_st,
        q_ptr,
        q_st,
        sf_ptr,
        T,
        BLOCK_H,
        PATTERN,
        WRITE_NORM,
        LAYOUT,
        PTX,
    )


@triton.jit
def _receive(
    x,
    t,
    mine,
    lam,
    wait,
    cols,
    cmask,
    H,
    T: tl.constexpr,
    P: tl.constexpr,
    BITS: tl.constexpr,
    FP32_ACC: tl.constexpr,
    PTX: tl.constexpr,
):
    """:func:`moefuse.comm.device.receive_sum` of row ``t`` (this rank's row ``x``, the peers'
    polled from this rank's Lamport slots at ``mine``, each re-armed): ``lam`` = (table_ptr,
    lam_off16, region, rank), ``wait`` = (deadline, clock_ptr, empty row). Returns (the T-rounded
    sum as FP32, bit mask of the peers whose row did not arrive in time)."""
    table_ptr, lam_off16, region, rank = lam
    deadline, clock_ptr, empty = wait
    return D.receive_sum(
        x,
        t,
        mine,
        region,
        rank,
        cols,
        cmask,
        H,
        deadline,
        clock_ptr,
        empty,
        T,
        P,
        BITS,
        FP32_ACC,
        PTX,
    )
