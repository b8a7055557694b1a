"""The two-shot all-reduce kernel (reduce-scatter to the row owners, all-gather of the sums, with
flag barriers; launched by :func:`moefuse.comm.all_reduce.kernels.launch_allreduce_fusion`, whose
module describes the protocol) and its per-row device functions. The epilogue is
:func:`moefuse.comm.all_reduce.rows._epilogue`; ``epi`` and ``outs`` are its argument groups.
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from moefuse._device import round_to
from moefuse.comm import device as D
from moefuse.comm.all_reduce.rows import _epilogue


@triton.jit
def _scatter_to_owners(
    x_ptr,
    x_st,
    cols,
    cmask,
    pid,
    G,
    n_mine,
    chunk,
    rank,
    chunk_cap,
    table_ptr,
    stage_off16,
    H,
    BITS: tl.constexpr,
):
    """Two-shot phase 1: push this CTA's rows (``pid + i * G``, ``i < n_mine``) that another
    rank owns (``t // chunk``) into that owner's staging slot ``[rank]``."""
    i = 0
    while i < n_mine:
        t = pid + i * G
        o = t // chunk
        if o != rank:
            t64 = t.to(tl.int64)
            x = tl.load(x_ptr + t64 * x_st + cols, mask=cmask, other=0.0)
            row = rank * chunk_cap + (t - o * chunk)
            dst = D.peer_base(table_ptr, o, stage_off16, BITS) + row.to(tl.int64) * H + cols
            tl.store(dst, D.as_bits(x, BITS), mask=cmask)
        i += 1


@triton.jit
def _reduce_owned_row(
    t,
    src,
    own,
    cols,
    cmask,
    H,
    T: tl.constexpr,
    P: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PATTERN: tl.constexpr,
    FP32_ACC: tl.constexpr,
    PTX: tl.constexpr,
):
    """Two-shot phase 2, row ``t`` that this rank owns: sum its P rows in rank order (this
    rank's input, the peers' rows from the staging region), round once to T and push the sum
    into every peer's gather region. ``src`` = (x_ptr, x_st, res_ptr, res_st): the input and
    residual rows; ``own`` = (stage, chunk, chunk_cap, rank, table_ptr, gather_off16): the
    staging region, the owner split and the gather regions. Returns (the T-rounded sum, the
    residual row as FP32 (the FP32 sum when PATTERN 0 has none), ``t`` as int64) for the row's
    epilogue."""
    x_ptr, x_st, res_ptr, res_st = src
    stage, chunk, chunk_cap, rank, table_ptr, gather_off16 = own
    t64 = t.to(tl.int64)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for q in tl.static_range(P):
        if q == rank:
            v = tl.load(x_ptr + t64 * x_st + cols, mask=cmask, other=0.0).to(tl.float32)
        else:
            row = (q * chunk_cap + (t - rank * chunk)).to(tl.int64)
            bits = tl.load(stage + row * H + cols, mask=cmask, other=0, cache_modifier=".cg")
            v = bits.to(T, bitcast=True).to(tl.float32)
        acc = D.accumulate(acc, v, T, FP32_ACC, PTX)
    s = round_to(acc, T, PTX)
    for q in tl.static_range(P):
        if q != rank:
            dst = D.peer_base(table_ptr, q, gather_off16, BITS) + t64 * H + cols
            tl.store(dst, D.as_bits(s, BITS), mask=cmask)
    if PATTERN != 0:
        res = tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0)
        res = res.to(tl.float32)
    else:
        res = acc
    return s, res, t64


@triton.jit
def _gathered_row(
    t,
    gathered,
    src,
    epi,
    outs,
    T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PATTERN: tl.constexpr,
    WRITE_NORM: tl.constexpr,
    LAYOUT: tl.constexpr,
    PTX: tl.constexpr,
):
    """Two-shot phase 3, row ``t`` that another rank owns: its sum from this rank's gather
    region ``gathered`` (written by the owner before the second barrier), then its epilogue.
    ``src`` as :func:`_reduce_owned_row`'s."""
    x_ptr, x_st, res_ptr, res_st = src
    g, cols, cmask, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols = epi
    t64 = t.to(tl.int64)
    bits = tl.load(gathered + t64 * H + cols, mask=cmask, other=0, cache_modifier=".cg")
    s = bits.to(T, bitcast=True).to(tl.float32)
    if PATTERN != 0:
        res = tl.load(res_ptr + t64 * res_st + cols, mask=cmask, other=0.0)
        res = res.to(tl.float32)
    else:
        res = s
    _epilogue(s, res, t64, epi, outs, T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)


@triton.jit
def _finish_twoshot(
    ws,
    rank,
    epoch,
    missing,
    sf_ptr,
    rows,
    n_kcols,
    pid,
    G,
    P: tl.constexpr,
    PATTERN: tl.constexpr,
    LAYOUT: tl.constexpr,
    KP_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    PTX: tl.constexpr,
):
    """End of the two-shot kernel: :func:`moefuse.comm.device.finish` on the two-shot arrival
    word (status word, scale-row padding of PATTERN 3); the last CTA resets the word and
    advances the flag epoch. ``ws`` and ``rows`` as the kernel's."""
    table_ptr, flags_off16, stage_off16, gather_off16, ctrl_ptr, clock_ptr = ws
    M, M_pad = rows
    last = D.finish(
        ctrl_ptr,
        table_ptr,
        rank,
        D.CTRL_ARRIVE_2S,
        missing,
        sf_ptr,
        M,
        M_pad,
        n_kcols,
        pid,
        G,
        P,
        PATTERN,
        LAYOUT,
        KP_BLOCK,
        USE_PDL,
        PTX,
    )
    if last:
        tl.store(ctrl_ptr + D.CTRL_ARRIVE_2S, 0)
        tl.store(ctrl_ptr + D.CTRL_EPOCH, epoch % D.EPOCH_WRAP + 1)


@triton.jit(do_not_specialize=["rows", "rank"])
def _twoshot_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, rout_ptr, nout_ptr, q_ptr, sf_ptr, scale_ptr,
    strides, ws, rows, H, Hf, rank, chunk_cap, n_kcols, norm, timeout_us,
    P: tl.constexpr, PP: tl.constexpr, NSLOT: tl.constexpr, BLOCK_H: tl.constexpr,
    BITS: tl.constexpr, PATTERN: tl.constexpr, WRITE_NORM: tl.constexpr, LAYOUT: tl.constexpr,
    KP_BLOCK: tl.constexpr, FP32_ACC: tl.constexpr, USE_PDL: tl.constexpr, PTX: tl.constexpr,
):  # fmt: skip
    """Two-shot all-reduce (reduce-scatter to the row owners, all-gather of the sums) with the
    one-shot's epilogues. ``strides``, ``rows``, ``norm`` as ``_oneshot_kernel``'s; ``ws`` =
    (table_ptr, flags_off16, stage_off16, gather_off16, ctrl_ptr, clock_ptr)."""
    x_st, res_st, out_st, rout_st, nout_st, q_st = strides
    M, M_pad = rows
    eps, weight_bias = norm
    table_ptr, flags_off16, stage_off16, gather_off16, ctrl_ptr, clock_ptr = ws
    T: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    cmask = cols < H
    g = D.load_gain(w_ptr, cols, cmask, weight_bias, PATTERN)
    if USE_PDL:
        gdc_wait()
    inv_scale, gs, rcp_gs = D.quant_scales(scale_ptr, PATTERN, PTX)
    deadline = D.wait_bound(clock_ptr, timeout_us, table_ptr, rank, PTX)
    epoch = tl.load(ctrl_ptr + D.CTRL_EPOCH)
    healthy = D.healthy(ctrl_ptr, table_ptr, rank, P, PTX)
    n_mine = tl.where(healthy, (M - pid + G - 1) // G, 0)
    chunk = (M + P - 1) // P  # tokens per owner
    epi = (g, cols, cmask, H, Hf, eps, inv_scale, gs, rcp_gs, n_kcols)
    outs = (out_ptr, out_st, rout_ptr, rout_st, nout_ptr, nout_st, q_ptr, q_st, sf_ptr)
    # phase 1: scatter non-owned rows to their owner's staging slot [rank]
    _scatter_to_owners(
        x_ptr,
        x_st,
        cols,
        cmask,
        pid,
        G,
        n_mine,
        chunk,
        rank,
        chunk_cap,
        table_ptr,
        stage_off16,
        H,
        BITS,
    )
    missing = 0
    if healthy:
        D.signal_peers(table_ptr, flags_off16, pid, rank, epoch, P, PP)
        missing = D.wait_peers(
            table_ptr, flags_off16, pid, rank, epoch, deadline, clock_ptr, P, PP, PTX
        )
    # phase 2: reduce the owned rows (rank order) and push the sum into every rank's gather buffer
    stage = D.peer_base(table_ptr, rank, stage_off16, BITS)
    src = (x_ptr, x_st, res_ptr, res_st)
    own = (stage, chunk, chunk_cap, rank, table_ptr, gather_off16)
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t // chunk == rank:
            s, res, t64 = _reduce_owned_row(
                t, src, own, cols, cmask, H, T, P, BITS, BLOCK_H, PATTERN, FP32_ACC, PTX
            )
            # the owner finishes its own rows now, with the sum still in registers
            s = s.to(tl.float32)
            _epilogue(s, res, t64, epi, outs, T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)
        i += 1
    if healthy & (missing == 0):
        D.signal_peers(table_ptr, flags_off16, NSLOT + pid, rank, epoch, P, PP)
        missing = D.wait_peers(
            table_ptr, flags_off16, NSLOT + pid, rank, epoch, deadline, clock_ptr, P, PP, PTX
        )
    # phase 3: epilogue on this CTA's rows owned by other ranks, from the local gather buffer
    gathered = D.peer_base(table_ptr, rank, gather_off16, BITS)
    i = 0
    while (i < n_mine) & (missing == 0):
        t = pid + i * G
        if t // chunk != rank:
            _gathered_row(t, gathered, src, epi, outs, T, BLOCK_H, PATTERN, WRITE_NORM, LAYOUT, PTX)
        i += 1
    _finish_twoshot(
        ws,
        rank,
        epoch,
        missing,
        sf_ptr,
        rows,
        n_kcols,
        pid,
        G,
        P,
        PATTERN,
        LAYOUT,
        KP_BLOCK,
        USE_PDL,
        PTX,
    )
