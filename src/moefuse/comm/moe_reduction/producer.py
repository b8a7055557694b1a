"""Device functions of the MoE-reduction family (the spec's MoE-reduction and MoE-finalize
all-reduce fusions), shared by its kernels (:mod:`~moefuse.comm.moe_reduction.oneshot`,
:mod:`~moefuse.comm.moe_reduction.twoshot`, :mod:`~moefuse.comm.moe_reduction.torch_path`): the
producer stage (this rank's MoE partial row, from the permuted GEMM2 rows through the index map or
from the dense expert rows), the rank-order step and the epilogue wrapper. One copy of each: every
algorithm computes the same bits. The kernels pass their arguments grouped into tuples (pointers,
strides, constexprs: each function's docstring names the elements).

``PTX`` (constexpr) is False in Triton's interpreter; the off-path computes the same values.
"""

import triton
import triton.language as tl

from moefuse._device import fma_ftz, round_to, widen_f32
from moefuse.comm import device as D


# ----------------------------------------------------------------------------- producer
@triton.jit
def _slot_meta(t, src, strides, counts, PROD):
    """Routing data of token ``t``'s K slots: ``(valids, row pointers, weights, bias valids,
    bias row pointers)``, tuples of K scalars. ``src`` = (src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr,
    e_ptr), ``strides`` = (src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st), ``counts``
    = (n_rows, n_experts) and the constexprs ``PROD`` = (K, KB, DENSE, HAS_W, HAS_BIAS, HAS_RSF,
    HAS_SHARED, STEPWISE, PTX), as the kernels group them.

    DENSE (the spec's MoE-reduction fusion): rows ``src[k, t]`` (``src_kst`` expert stride,
    ``src_st`` token stride), all valid. Otherwise (MoE finalize): row ``map[t, k]``, invalid —
    never loaded — outside
    ``[0, n_rows)``. Weight ``w[t * w_tst + k * w_kst]`` when HAS_W (else 1). HAS_BIAS: expert
    ``e_ptr[t, k]``'s bias row (moefuse extension, the spec's moe_finalize; ids outside [0, E):
    none)."""
    src_ptr, map_ptr, w_ptr, sh_ptr, b_ptr, e_ptr = src
    src_st, src_kst, map_st, w_tst, w_kst, sh_st, b_st, e_st = strides
    n_rows, n_experts = counts
    K, KB, DENSE, HAS_W, HAS_BIAS, HAS_RSF, HAS_SHARED, STEPWISE, PTX = PROD
    t64 = t.to(tl.int64)
    valids = ()
    ptrs = ()
    ws = ()
    has_bs = ()
    bptrs = ()
    for k in tl.static_range(K):
        if DENSE:
            valid = t >= 0
            # expert offset in int64 (E * M * H may pass 2^31)
            ptr = src_ptr + t64 * src_st + (t64 * 0 + src_kst) * k
        else:
            idx = tl.load(map_ptr + t64 * map_st + k)
            valid = (idx >= 0) & (idx < n_rows)
            ptr = src_ptr + tl.where(valid, idx, 0).to(tl.int64) * src_st
        if HAS_W:
            w = widen_f32(tl.load(w_ptr + t64 * w_tst + k * w_kst), PTX)
        else:
            w = tl.full([], 1.0, tl.float32)
        if HAS_BIAS:
            e = tl.load(e_ptr + t64 * e_st + k)
            has_b = valid & (e >= 0) & (e < n_experts)
            bptr = b_ptr + tl.where(has_b, e, 0).to(tl.int64) * b_st
        else:
            has_b = valid
            bptr = ptr
        valids = valids + (valid,)
        ptrs = ptrs + (ptr,)
        ws = ws + (w,)
        has_bs = has_bs + (has_b,)
        bptrs = bptrs + (bptr,)
    return valids, ptrs, ws, has_bs, bptrs


@triton.jit
def _load_batch(meta, b: tl.constexpr, cols, cmask, KB: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Rows (and bias rows) of batch ``b`` of the routing data ``meta``: KB independent loads,
    invalid slots never read. Returns ``(rows, bias rows)``, tuples of KB raw T values."""
    valids, ptrs, ws, has_bs, bptrs = meta
    xs = ()
    bs = ()
    for j in tl.static_range(KB):
        xs = xs + (tl.load(ptrs[b * KB + j] + cols, mask=cmask & valids[b * KB + j], other=0.0),)
        if HAS_BIAS:
            bs = bs + (
                tl.load(bptrs[b * KB + j] + cols, mask=cmask & has_bs[b * KB + j], other=0.0),
            )
    return xs, bs


@triton.jit
def _first_loads(
    meta,
    t,
    cols,
    cmask,
    sh_ptr,
    sh_st,
    KB: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    PTX: tl.constexpr,
):
    """The loads a partial starts with — the first batch of rows and the shared-expert row — as
    a value for :func:`_partial_from_first`. A kernel issues them before its control-word
    round trip (whose CTA-wide reduction is a barrier no later load can pass), so that a decode
    CTA waits for one memory round trip before its push instead of two."""
    xs, bs = _load_batch(meta, 0, cols, cmask, KB, HAS_BIAS)
    if HAS_SHARED:
        sh = widen_f32(tl.load(sh_ptr + t.to(tl.int64) * sh_st + cols, mask=cmask, other=0.0), PTX)
    else:
        sh = tl.zeros(cols.shape, tl.float32)
    return xs, bs, sh


@triton.jit
def _partial_from_first(meta, first, cols, cmask, rsf, T: tl.constexpr, PROD):
    """This rank's partial of a token from its routing data ``meta`` (:func:`_slot_meta`) and
    its :func:`_first_loads` (constexprs ``PROD`` as :func:`_slot_meta`'s): FP32 values of a
    T-rounded row, masked lanes 0. Rows are loaded in batches of KB (all K at once when they fit
    in registers) and chained in ascending k: KB and where the first batch was loaded change the
    schedule, never the bits."""
    K, KB, DENSE, HAS_W, HAS_BIAS, HAS_RSF, HAS_SHARED, STEPWISE, PTX = PROD
    valids, ptrs, ws, has_bs, bptrs = meta
    xs0, bs0, sh = first
    acc = tl.zeros(sh.shape, tl.float32)
    for b in tl.static_range(K // KB):  # KB divides K (rows_per_batch)
        if b == 0:
            xs, bs = xs0, bs0
        else:
            xs, bs = _load_batch(meta, b, cols, cmask, KB, HAS_BIAS)
        for j in tl.static_range(KB):
            x = widen_f32(xs[j], PTX)
            if HAS_BIAS:  # FP32 add before the weight, never rounded in between
                x = tl.where(has_bs[b * KB + j], x + widen_f32(bs[j], PTX), x)
            if STEPWISE:
                if HAS_W:
                    x = widen_f32(round_to(x * ws[b * KB + j], T, PTX), PTX)
                acc = tl.where(valids[b * KB + j], widen_f32(round_to(acc + x, T, PTX), PTX), acc)
            else:
                acc = tl.where(valids[b * KB + j], fma_ftz(x, ws[b * KB + j], acc, PTX), acc)
    if STEPWISE:
        if HAS_RSF:
            acc = widen_f32(round_to(acc * rsf, T, PTX), PTX)
        if HAS_SHARED:
            acc = widen_f32(round_to(acc + sh, T, PTX), PTX)
    else:
        if HAS_RSF:
            acc = acc * rsf
        if HAS_SHARED:
            acc = acc + sh
        acc = widen_f32(round_to(acc, T, PTX), PTX)
    return tl.where(cmask, acc, 0.0)


@triton.jit
def _partial_row(t, cols, cmask, src, strides, counts, rsf, T: tl.constexpr, PROD):
    """:func:`_slot_meta`, :func:`_first_loads` then :func:`_partial_from_first` for token ``t``
    (arguments grouped as :func:`_slot_meta`'s)."""
    K, KB, DENSE, HAS_W, HAS_BIAS, HAS_RSF, HAS_SHARED, STEPWISE, PTX = PROD
    meta = _slot_meta(t, src, strides, counts, PROD)
    sh_ptr, sh_st = src[3], strides[5]
    first = _first_loads(meta, t, cols, cmask, sh_ptr, sh_st, KB, HAS_BIAS, HAS_SHARED, PTX)
    return _partial_from_first(meta, first, cols, cmask, rsf, T, PROD)


@triton.jit
def _finish_row(s, res, t, cols, cmask, g, norm, scales, outs, T: tl.constexpr, EPI):
    """``allreduce_out = T(s)`` (when WRITE_AR), then the shared epilogue with recipe "fast".
    ``s`` is the rank-order sum: T-rounded (stepwise) or FP32 (rounded once with the residual);
    ``res`` the residual row widened to FP32. ``norm`` = (H, Hf, eps, n_kcols), ``scales`` =
    (inv_scale, gs, rcp_gs) (:func:`moefuse.comm.device.quant_scales`), ``outs`` = (arout_ptr,
    arout_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr), constexprs ``EPI`` =
    (BLOCK_H, PATTERN, LAYOUT, WRITE_AR, PTX)."""
    H, Hf, eps, n_kcols = norm
    inv_scale, gs, rcp_gs = scales
    arout_ptr, arout_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr = outs
    BLOCK_H, PATTERN, LAYOUT, WRITE_AR, PTX = EPI
    t64 = t.to(tl.int64)
    if WRITE_AR:
        tl.store(arout_ptr + t64 * arout_st + cols, round_to(s, T, PTX), mask=cmask)
    D.epilogue_row(
        s,
        res,
        g,
        t64,
        cols,
        cmask,
        H,
        Hf,
        eps,
        inv_scale,
        gs,
        rcp_gs,
        n_kcols,
        rout_ptr,
        0,
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
        True,
        LAYOUT,
        PTX,
        0,
    )


@triton.jit
def _rank_step(acc, v, T: tl.constexpr, STEPWISE: tl.constexpr, PTX: tl.constexpr):
    """One step of the rank-order sum: T-rounded after every add, or FP32 (rounded later)."""
    if STEPWISE:
        return widen_f32(round_to(acc + v, T, PTX), PTX)
    else:
        return acc + v
