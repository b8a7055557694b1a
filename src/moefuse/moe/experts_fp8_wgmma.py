"""The FP8 experts' down GEMM at many tokens written in Gluon, with each K-block's FP8 MMA in
flight while the block before it is scaled into the sum (tile key ``down_wgmma``, GPU only).

The product, its order and its bits are the Triton down kernel's
(:mod:`moefuse.moe.experts_fp8_tma`): ``BT`` slots of one work item on the MMA's M side, ``BN``
rows of H (one 128-row scale block), per K-block ``b`` ascending
``acc = fma(dot_b, as[s, b] * Wds[e][h / 128, b], acc)`` from +0.0, the FP32 sum stored
unrounded. The loop is :mod:`moefuse.moe.linear_wgmma`'s: block ``b``'s MMA is issued
asynchronously from a zero accumulator, the wait leaves it in flight, and block ``b - 1`` is
scaled meanwhile. The weight tiles arrive by TMA (one barrier per stage); the slots' activation
rows are gathered by the plan's order, so they arrive by ``cp.async`` (one commit group per
stage, an empty group where no block is left, so that every wait counts the same groups).

Gluon compiles only for the GPU: the GPU tests compare its bits with the Triton launch's, which
the CPU suite checks in the interpreter.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._fastpath import launch
from moefuse._runtime import pdl_launch_kwargs
from moefuse.moe.experts_fp8_tma import _rows_view, fp8_gemm_metadata
from moefuse.moe.linear_wgmma import block_scale


@gluon.jit
def _issue_down_block(src, bufs, b, KDIM: gl.constexpr, STAGES: gl.constexpr):
    """K-block ``b`` into stage ``b % STAGES``: the weight tile by TMA (arriving on the stage's
    barrier), the slots' activation codes by ``cp.async`` (rows past the item and columns past
    ``KDIM`` as zeros); commits one copy group, empty past the last block. ``src`` = (activation
    row pointers [BT, 1], rows in use [BT, 1], the block's columns [128], weight descriptor, first
    weight row), ``bufs`` = (activation stages, weight stages, the stages' barriers)."""
    a_rows, a_live, kk, w_desc, w_row = src
    a_bufs, w_bufs, ready = bufs
    if b < (KDIM + 127) // 128:
        stage = b % STAGES
        bar = ready.index(stage)
        mbarrier.expect(bar, w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(w_desc, [w_row, b * 128], bar, w_bufs.index(stage))
        cols = b * 128 + kk
        mask = a_live & gl.expand_dims(cols < KDIM, 0)
        async_copy.async_copy_global_to_shared(
            a_bufs.index(stage), a_rows + gl.expand_dims(cols, 0), mask=mask
        )
    async_copy.commit_group()


@gluon.jit
def _down_block_sum(
    src, bufs, scales, zero, KDIM: gl.constexpr, STAGES: gl.constexpr, E8M0: gl.constexpr
):
    """``acc = fma(dot_b, as[s, b] * Ws[b], acc)`` over the K-blocks ``b`` ascending from +0.0
    (``zero``: [BT, BN] in the MMA's layout), block ``b``'s MMA in flight while block ``b - 1``
    is scaled; the first ``STAGES`` blocks already issued (:func:`_issue_down_block`, same
    ``src`` and ``bufs``). ``scales`` = (activation scale row pointers [BT], rows in use, weight
    scale row pointer, its block stride)."""
    as_rows, r_in, s_row, s_st_k = scales
    a_bufs, w_bufs, ready = bufs
    n_blocks: gl.constexpr = (KDIM + 127) // 128
    acc = zero
    # block 0: its copies are the oldest of STAGES committed groups
    async_copy.wait_group(STAGES - 1)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.wait(ready.index(0), 0)
    tok = warpgroup_mma(
        a_bufs.index(0), w_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True
    )
    scale = gl.load(as_rows, mask=r_in, other=0.0) * block_scale(s_row, 0, s_st_k, E8M0)
    for b in range(1, n_blocks):
        stage = b % STAGES
        # committed: STAGES + b - 1 groups, block b's is followed by STAGES - 2 of them
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.wait(ready.index(stage), (b // STAGES) & 1)
        nxt = warpgroup_mma(
            a_bufs.index(stage),
            w_bufs.index(stage).permute((1, 0)),
            zero,
            use_acc=False,
            is_async=True,
        )
        nxt_scale = gl.load(as_rows + b, mask=r_in, other=0.0) * block_scale(s_row, b, s_st_k, E8M0)
        prev = warpgroup_mma_wait(1, deps=(tok,))
        gl.thread_barrier()  # every warpgroup is done with block b - 1's stage
        _issue_down_block(src, bufs, b - 1 + STAGES, KDIM, STAGES)
        acc = gl.fma(prev, gl.expand_dims(scale, 1), acc)
        tok = nxt
        scale = nxt_scale
    last = warpgroup_mma_wait(0, deps=(tok,))
    acc = gl.fma(last, gl.expand_dims(scale, 1), acc)
    async_copy.wait_group(0)
    return acc


@gluon.jit(launch_metadata=fp8_gemm_metadata)
def _experts_fp8_down_wgmma_kernel(
    a_ptr,
    as_ptr,
    w_desc,
    s_ptr,
    items_ptr,
    sorted_ptr,
    y_ptr,
    strides,
    KDIM: gl.constexpr,
    H: gl.constexpr,
    BN: gl.constexpr,
    BT: gl.constexpr,
    STAGES: gl.constexpr,
    E8M0: gl.constexpr,
    USE_PDL: gl.constexpr,
):
    """y[s, h] (FP32, unrounded) for the ``BT`` slots of work item ``program_id(0)`` and the
    ``BN`` rows of H from ``program_id(1) * BN`` (module docstring); ``w_desc`` reads row
    ``e * H + h`` of the weight viewed as [E * H, I]; ``strides`` = (activation row, its scale
    row, y row, weight scale expert / row / block)."""
    a_st, as_st, y_st, s_st_e, s_st_n, s_st_k = strides
    warps: gl.constexpr = gl.num_warps()
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, BN, 32]
    )
    gather: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [warps, 1], [1, 0])
    if USE_PDL:
        gdc_wait()  # the activation's codes and the plan's items
    rec = items_ptr + gl.program_id(0) * 3
    e = gl.load(rec)
    if e >= 0:
        start = gl.load(rec + 1)
        used = gl.load(rec + 2)
        n0 = gl.program_id(1) * BN
        # the slots as the gather's rows and as the accumulator's rows
        rg = gl.arange(0, BT, layout=gl.SliceLayout(1, gather))
        sg = gl.load(sorted_ptr + start + rg, mask=rg < used, other=0).to(gl.int64)
        # rows 16-byte aligned (the launcher's check): 16-byte copies
        a_rows = a_ptr + gl.expand_dims(gl.multiple_of(sg * a_st, 16), 1)
        a_live = gl.expand_dims(rg < used, 1)
        kk = gl.arange(0, 128, layout=gl.SliceLayout(0, gather))
        r = gl.arange(0, BT, layout=gl.SliceLayout(1, mma))
        r_in = r < used
        s = gl.load(sorted_ptr + start + r, mask=r_in, other=0).to(gl.int64)
        as_rows = as_ptr + s * as_st
        s_row = s_ptr + e.to(gl.int64) * s_st_e + (n0 // 128) * s_st_n

        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, 128], gl.float8e4nv)
        a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BT, 128], a_layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, 128], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
        src = (a_rows, a_live, kk, w_desc, e * H + n0)
        bufs = (a_bufs, w_bufs, ready)
        for i in gl.static_range(STAGES):
            _issue_down_block(src, bufs, i, KDIM, STAGES)

        zero = gl.zeros([BT, BN], gl.float32, layout=mma)
        scales = (as_rows, r_in, s_row, s_st_k)
        acc = _down_block_sum(src, bufs, scales, zero, KDIM, STAGES, E8M0)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
        if USE_PDL:
            gdc_launch_dependents()
        n = n0 + gl.arange(0, BN, layout=gl.SliceLayout(0, mma))
        ptrs = y_ptr + gl.expand_dims(s * y_st, 1) + gl.expand_dims(n, 0)
        gl.store(ptrs, acc, mask=gl.expand_dims(r_in, 1) & gl.expand_dims(n < H, 0))


def launch_down_fp8_wgmma(a, a_s, weight, scale, e8m0, plan, cfg, use_pdl):
    """:func:`moefuse.moe.experts_fp8_tma.launch_down_fp8_tma`'s output (``plan.y`` [T*K, H],
    FP32) by the Gluon kernel: the same arguments (``cfg``: ``bn_down`` 64 or 128, ``down_warps``
    or ``warps`` = ``plan.bt`` / 16, ``down_stages`` or ``stages``), one program per tile."""
    hidden, inter = weight.shape[1], weight.shape[2]
    bn = cfg["bn_down"]
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    w_desc = TensorDescriptor.from_tensor(_rows_view(weight), [bn, 128], w_layout)
    launch(
        _experts_fp8_down_wgmma_kernel,
        (plan.n_items, triton.cdiv(hidden, bn)),
        a,
        a_s,
        w_desc,
        scale,
        plan.items,
        plan.sorted_slots,
        plan.y,
        (a.stride(0), a_s.stride(0), plan.y.stride(0), *scale.stride()),
        KDIM=inter,
        H=hidden,
        BN=bn,
        BT=plan.bt,
        STAGES=cfg.get("down_stages", cfg["stages"]),
        E8M0=e8m0,
        USE_PDL=use_pdl,
        num_warps=cfg.get("down_warps", cfg["warps"]),
        enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
    )


def compile_offline(hidden: int, inter: int, bt: int, bn: int, stages: int, e8m0: bool = False):
    """The down kernel compiled for sm_90a without a GPU (PDL on, ``bt`` / 16 warps): Triton's
    compiled kernel. For the CPU tests, which cannot run Gluon."""
    from moefuse.tools.ptxas import compile_gluon

    w_layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    sig = {
        "a_ptr": "*fp8e4nv",
        "as_ptr": "*fp32",
        "w_desc": f"tensordesc<fp8e4nv[{bn}, 128],{w_layout!r}>",
        "s_ptr": "*u8" if e8m0 else "*fp32",
        "items_ptr": "*i32",
        "sorted_ptr": "*i32",
        "y_ptr": "*fp32",
    }
    sig["strides"] = ("i32",) * 6
    consts = dict(KDIM=inter, H=hidden, BN=bn, BT=bt, STAGES=stages, E8M0=e8m0, USE_PDL=True)
    return compile_gluon(_experts_fp8_down_wgmma_kernel, sig, consts, bt // 16)
