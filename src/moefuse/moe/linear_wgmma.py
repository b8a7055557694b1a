"""``fp8_linear``'s many-row launch written in Gluon, with each K-block's FP8 MMA in flight while
the block before it is scaled into the sum (tile key ``wgmma``, GPU only).

The product, its order and its bits are :mod:`moefuse.moe.linear_tma`'s (tokens on the MMA's M
side, both operands by TMA, per K-block ``b`` ascending ``acc = fma(dot_b, xs[t, b] * Ws[n / 128,
b], acc)``, the chunk sums added in ascending order from +0.0, then the bias). What changes is
when a block's product is scaled. Triton waits for every block's MMA before its scaling FMA, so
the tensor cores idle while a warpgroup scales (the FMA epilogue touches every accumulator
element once per block). Here the loop issues the MMA of block ``b`` asynchronously
(``warpgroup_mma(..., is_async=True)``, a zero accumulator: the same four k32 steps from zero as
``tl.dot``), waits only until at most that one MMA is outstanding (``warpgroup_mma_wait(1)``: block
``b - 1`` is done), scales block ``b - 1`` into the sum while block ``b`` runs, then hands block
``b - 1``'s shared-memory stage back to the TMA loads. A thread holds three accumulators (the sum,
the block in flight, the block being scaled); the chunk sum lives in shared memory.

Gluon compiles only for the GPU (Triton's interpreter does not run it): the CPU suite checks
:mod:`moefuse.moe.linear_tma`, whose bits this launch must equal; the GPU tests compare the two.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._fastpath import launch
from moefuse._runtime import pdl_launch_kwargs
from moefuse.moe.linear_tma import fp8_linear_metadata

#: bits of 2^-127, the FP32 value of the UE8M0 byte 0 (a subnormal)
_E8M0_ZERO_BITS = gl.constexpr(0x00400000)


@gluon.jit
def block_scale(s_row, b, s_st, E8M0: gl.constexpr):
    """FP32 value of the weight block scale ``s_row[b * s_st]``: FP32 as is, UE8M0 bytes as
    2^(byte - 127) (0: 2^-127, 255: NaN), as :func:`moefuse.moe.fp8_device.scale_f32`."""
    s = gl.load(s_row + b * s_st)
    if E8M0:
        bits = s.to(gl.uint32)
        v = (bits << 23).to(gl.float32, bitcast=True)
        tiny = gl.full([], _E8M0_ZERO_BITS, gl.uint32).to(gl.float32, bitcast=True)
        v = gl.where(bits == 0, tiny, v)
        return gl.where(bits == 255, float("nan"), v)
    else:
        return s


@gluon.jit
def _issue_block(x_desc, w_desc, a_bufs, w_bufs, ready, b, t0, n0, STAGES: gl.constexpr):
    """TMA loads of K-block ``b``'s token codes [BT, 128] and weight codes [BN, 128] into stage
    ``b % STAGES``, arriving on that stage's barrier."""
    s = b % STAGES
    bar = ready.index(s)
    mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [t0, b * 128], bar, a_bufs.index(s))
    tma.async_copy_global_to_shared(w_desc, [n0, b * 128], bar, w_bufs.index(s))


@gluon.jit(launch_metadata=fp8_linear_metadata)
def _fp8_linear_wgmma_kernel(
    x_desc,
    w_desc,
    xs_ptr,
    s_ptr,
    bias_ptr,
    out_ptr,
    m_rows,
    xs_st,
    s_st,
    out_st,
    N: gl.constexpr,
    KDIM: gl.constexpr,
    BN: gl.constexpr,
    BT: gl.constexpr,
    CHUNK: gl.constexpr,
    STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    E8M0: gl.constexpr,
    USE_PDL: gl.constexpr,
):
    """``out[t, n]`` for ``BT`` token rows from ``program_id(1) * BT`` and ``BN`` weight rows
    (<= 128, inside one 128-row scale block) from ``program_id(0) * BN`` (module docstring).
    ``CHUNK`` > 0: the sum restarts from +0.0 every ``CHUNK`` blocks and the chunk sums are
    added in ascending order from +0.0."""
    n0 = gl.program_id(0) * BN
    t0 = gl.program_id(1) * BT
    n_blocks: gl.constexpr = (KDIM + 127) // 128
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[gl.num_warps(), 1], instr_shape=[16, BN, 32]
    )
    rows: gl.constexpr = gl.SliceLayout(1, mma)
    cols: gl.constexpr = gl.SliceLayout(0, mma)
    t = t0 + gl.arange(0, BT, layout=rows)
    n = n0 + gl.arange(0, BN, layout=cols)
    r_in = t < m_rows
    xs_rows = xs_ptr + t.to(gl.int64) * xs_st
    s_row = s_ptr + (n0 // 128).to(gl.int64) * s_st

    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BT, 128], x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, 128], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    if CHUNK > 0:
        total_smem = gl.allocate_shared_memory(
            gl.float32,
            [BT, BN],
            gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0]),
        )
        total_smem.store(gl.zeros([BT, BN], gl.float32, layout=mma))
    if USE_PDL:
        gdc_wait()
    for i in gl.static_range(STAGES):
        if i < n_blocks:
            _issue_block(x_desc, w_desc, a_bufs, w_bufs, ready, i, t0, n0, STAGES)

    zero = gl.zeros([BT, BN], gl.float32, layout=mma)
    acc = gl.zeros([BT, BN], gl.float32, layout=mma)
    mbarrier.wait(ready.index(0), 0)
    tok = warpgroup_mma(
        a_bufs.index(0), w_bufs.index(0).permute((1, 0)), zero, use_acc=False, is_async=True
    )
    scale = gl.load(xs_rows, mask=r_in, other=0.0) * block_scale(s_row, 0, 1, E8M0)
    for b in range(1, n_blocks):
        stage = b % STAGES
        mbarrier.wait(ready.index(stage), (b // STAGES) & 1)
        nxt = warpgroup_mma(
            a_bufs.index(stage),
            w_bufs.index(stage).permute((1, 0)),
            zero,
            use_acc=False,
            is_async=True,
        )
        nxt_scale = gl.load(xs_rows + b, mask=r_in, other=0.0) * block_scale(s_row, b, 1, E8M0)
        prev = warpgroup_mma_wait(1, deps=(tok,))
        if b - 1 + STAGES < n_blocks:
            _issue_block(x_desc, w_desc, a_bufs, w_bufs, ready, b - 1 + STAGES, t0, n0, STAGES)
        acc = gl.fma(prev, gl.expand_dims(scale, 1), acc)
        if CHUNK > 0:
            if b % CHUNK == 0:
                total_smem.store(total_smem.load(mma) + acc)
                acc = gl.zeros([BT, BN], gl.float32, layout=mma)
        tok = nxt
        scale = nxt_scale
    last = warpgroup_mma_wait(0, deps=(tok,))
    acc = gl.fma(last, gl.expand_dims(scale, 1), acc)
    if CHUNK > 0:
        acc = total_smem.load(mma) + acc
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    if USE_PDL:
        gdc_launch_dependents()
    n_in = n < N
    if HAS_BIAS:
        acc = acc + gl.expand_dims(gl.load(bias_ptr + n, mask=n_in, other=0.0).to(gl.float32), 0)
    ptrs = out_ptr + gl.expand_dims(t.to(gl.int64) * out_st, 1) + gl.expand_dims(n.to(gl.int64), 0)
    mask = gl.expand_dims(r_in, 1) & gl.expand_dims(n_in, 0)
    gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def wgmma_descriptors(x: torch.Tensor, weight: torch.Tensor, bt: int, bn: int):
    """Gluon TMA descriptors of the codes [M, K] (block [bt, 128]) and the weight codes [N, K]
    (block [bn, 128]), 128-byte swizzled for the MMA."""
    x_layout = gl.NVMMASharedLayout.get_default_for([bt, 128], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    return (
        TensorDescriptor.from_tensor(x, [bt, 128], x_layout),
        TensorDescriptor.from_tensor(weight, [bn, 128], w_layout),
    )


def launch_fp8_linear_wgmma(
    x, xs, weight, scale, bias, out, cfg: dict, e8m0: bool, use_pdl: bool, chunk: int
):
    """``out`` [M, N] from the E4M3 codes ``x`` [M, K] with their scales ``xs`` [M, ceil(K/128)],
    the weight codes [N, K] and its block scales ``scale`` (FP32 or UE8M0 bytes, unit stride along
    K); ``chunk`` > 0: the chunk order of a split (N, K); ``use_pdl``: wait for the kernel
    before (and let the next one launch) by programmatic dependent launch. ``cfg``: ``bn`` (64
    or 128), ``bt``, ``warps`` (``bt`` / 16), ``stages``."""
    m, k = x.shape
    n = weight.shape[0]
    bn, bt = cfg["bn"], cfg["bt"]
    x_desc, w_desc = wgmma_descriptors(x, weight, bt, bn)
    launch(
        _fp8_linear_wgmma_kernel,
        (triton.cdiv(n, bn), triton.cdiv(m, bt)),
        x_desc,
        w_desc,
        xs,
        scale,
        bias if bias is not None else out,
        out,
        m,
        xs.stride(0),
        scale.stride(0),
        out.stride(0),
        N=n,
        KDIM=k,
        BN=bn,
        BT=bt,
        CHUNK=chunk,
        STAGES=cfg["stages"],
        HAS_BIAS=bias is not None,
        E8M0=e8m0,
        USE_PDL=use_pdl,
        num_warps=cfg["warps"],
        enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
    )


def compile_offline(n: int, k: int, cfg: dict, chunk: int, e8m0: bool = False):
    """The launch's kernel compiled for sm_90a without a GPU (BF16 output and bias, PDL on):
    Triton's compiled kernel (``.asm["ptx"]``, ``.metadata.shared``). For the CPU tests, which
    cannot run Gluon, and for reading the loop's PTX."""
    from moefuse.tools.ptxas import compile_gluon

    bt, bn = cfg["bt"], cfg["bn"]
    descs = {
        "x_desc": gl.NVMMASharedLayout.get_default_for([bt, 128], gl.float8e4nv),
        "w_desc": gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv),
    }
    sig = {
        name: f"tensordesc<fp8e4nv[{b}, 128],{lay!r}>"
        for (name, lay), b in zip(descs.items(), (bt, bn))
    }
    sig.update(xs_ptr="*fp32", s_ptr="*u8" if e8m0 else "*fp32", bias_ptr="*bf16", out_ptr="*bf16")
    sig.update(m_rows="i32", xs_st="i32", s_st="i32", out_st="i32")
    consts = dict(N=n, KDIM=k, BN=bn, BT=bt, CHUNK=chunk, STAGES=cfg["stages"], HAS_BIAS=True)
    consts.update(E8M0=e8m0, USE_PDL=True)
    return compile_gluon(_fp8_linear_wgmma_kernel, sig, consts, cfg["warps"])
