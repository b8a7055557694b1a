"""Gated residual RMSNorm kernels (SPEC §1.3, §1.4), their launchers and the split-row mode.

Row layout (one-pass tiles, :mod:`moefuse.norm.tiles`): a tile of one row is held as
``[SLICES, SLICE]`` (SLICE = 32 lanes x warps x 8, element ``(s, c)`` is column ``s * SLICE + c``);
multi-row tiles (narrow rows) keep ``[ROWS, BLOCK]`` (SLICES = 1). The statistic of a sliced row is
the ascending chain ``((p_0 + p_1) + p_2) + ...`` of the per-slice sums ``p = tl.sum(sq, axis=1)``.

Split mode (small M): program ``(row, s)`` runs the same code with the loads and stores of the
other slices masked off (zeros), so its ``p[s]`` has the bits of the normal mode's ``p[s]``; it
publishes ``p[s]`` in a per-device scratch, waits for the row's other slices and forms the same
chain: the outputs are bitwise those of the normal mode (batch invariance: a row's bits depend on
neither M nor the mode). The wait is a ticket barrier on a per-(row, SLICES) counter that is never
reset (launches and CUDA-graph replays just continue the tickets), bounded by ``%globaltimer``; a
timeout is counted in the scratch's error word (:func:`split_rows_timeouts`). It needs every
program resident at once: split mode runs only when rows x SLICES <= SMs. In Triton's interpreter
programs run one after another, so the split mode runs as one launch per phase (PHASE = 1, 2, [3]:
publish, then read the partials and continue), through the same per-slice code.

Scratch (per device and stream, allocated outside CUDA-graph capture; while capturing without one
the normal mode runs, same bits): FP32 partials ``[rows, 2, SLICES]`` and int32 ``[error,
counters[rows, 8]]``. Launches on one stream are ordered, so their tickets never interleave; a
CUDA graph keeps its capture stream's scratch, so replays of graphs captured on one stream must not
run concurrently with each other (see ``_SCRATCH``).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer

from moefuse._runtime import interpreter_active, sm_count
from moefuse.norm import tiles
from moefuse.norm import triton as nt
from moefuse.norm.tiles import GATED_POLICY, RowTile, row_tile
from moefuse.norm.triton import _inv_rms, _ld, _ld_raw, _st, _tile

#: counters per row (one per log2(SLICES)): tickets of different SLICES never mix
_CTR_PER_ROW = 8


# ----------------------------------------------------------------------------- slab helpers
@triton.jit
def _slab_offs(BLOCK: tl.constexpr, SLICES: tl.constexpr):
    """Column of each tile element: [1, BLOCK] (SLICES = 1) or [SLICES, BLOCK // SLICES]."""
    return (tl.arange(0, SLICES)[:, None] * (BLOCK // SLICES)
            + tl.arange(0, BLOCK // SLICES)[None, :])  # fmt: skip


@triton.jit
def _col_mask(offs, H, sid, SLICES: tl.constexpr, SPLIT: tl.constexpr):
    """Valid columns; in split mode only the program's own slice ``sid``."""
    m = offs < H
    if SPLIT:
        m = m & (tl.arange(0, SLICES) == sid)[:, None]
    return m


@triton.jit
def _slab_rows(t, offs, n_rows, H, sid, ROWS: tl.constexpr, SLICES: tl.constexpr,
               SPLIT: tl.constexpr):  # fmt: skip
    """Row of each tile row ([ROWS * SLICES]) of row tile ``t`` and the element mask."""
    rows = t * ROWS + tl.arange(0, ROWS * SLICES) // SLICES
    return rows, (rows < n_rows)[:, None] & _col_mask(offs, H, sid, SLICES, SPLIT)


@triton.jit
def _slab_pf_mask(rows, mask, n_rows, MASKED: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr, SLICES: tl.constexpr):  # fmt: skip
    """Prefetch mask: row-masked even for unmasked tiles (see norm.triton._pf_mask)."""
    if MASKED:
        return mask
    else:
        return tl.broadcast_to((rows < n_rows)[:, None], (ROWS * SLICES, BLOCK // SLICES))


@triton.jit
def _slab_load(a_ptr, b_ptr, rows, offs, mask, a_st, b_st, MASKED: tl.constexpr,
               STREAM: tl.constexpr):  # fmt: skip
    r64 = rows.to(tl.int64)[:, None]
    a = _ld_raw(a_ptr + r64 * a_st + offs, mask, MASKED, STREAM)
    b = _ld_raw(b_ptr + r64 * b_st + offs, mask, MASKED, STREAM)
    return a, b


# ----------------------------------------------------------------------------- row statistic
@triton.jit
def _loop_tile(t, nprog, b_nx, r_nx, b_ptr, res_ptr, offs, n_rows, H, sid, b_st, r_st,
               ROWS: tl.constexpr, SLICES: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr,
               EVICT_FIRST: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    """Row tile ``t`` of the persistent loop: (rows, mask, branch, residual, next branch, next
    residual). With PREFETCH the tile comes from the registers loaded one iteration earlier
    (``b_nx``, ``r_nx``) and tile ``t + nprog``'s loads are issued now; otherwise it is loaded
    here and ``b_nx``, ``r_nx`` pass through untouched."""
    rows, mask = _slab_rows(t, offs, n_rows, H, sid, ROWS, SLICES, False)
    if PREFETCH:
        br = b_nx
        rr = r_nx
        rows_n, mask_n = _slab_rows(t + nprog, offs, n_rows, H, sid, ROWS, SLICES, False)
        mask_n = _slab_pf_mask(rows_n, mask_n, n_rows, MASKED, ROWS, BLOCK, SLICES)
        b_nx, r_nx = _slab_load(b_ptr, res_ptr, rows_n, offs, mask_n, b_st, r_st, True,
                                EVICT_FIRST)  # fmt: skip
    else:
        br, rr = _slab_load(b_ptr, res_ptr, rows, offs, mask, b_st, r_st, MASKED, EVICT_FIRST)
    return rows, mask, br, rr, b_nx, r_nx


@triton.jit
def _chain(p, SLICES: tl.constexpr):
    """``((p_0 + p_1) + p_2) + ...``; each p_i is extracted exactly (the other terms are +0.0)."""
    idx = tl.arange(0, SLICES)
    total = tl.sum(tl.where(idx == 0, p, 0.0), axis=0)
    for i in tl.static_range(1, SLICES):
        total += tl.sum(tl.where(idx == i, p, 0.0), axis=0)
    return total


@triton.jit
def _wait_row(ctr_ptr, row, SLICES: tl.constexpr, LOG2S: tl.constexpr,
              TIMEOUT_NS: tl.constexpr):  # fmt: skip
    """Ticket barrier of a row's SLICES programs (GPU, one launch).

    The CTA barrier makes the partial store part of what the acq_rel ticket releases. Tickets of
    one phase of one launch are ``[k * S, (k + 1) * S)`` (launches are stream-ordered; a second
    phase starts only after all first-phase tickets), so a program waits for ``(k + 1) * S``. uint32
    arithmetic: S divides 2^32, so the groups survive the counter's wrap-around. After the bound
    the error word counts the timeout and the program goes on (its row is garbage, nothing hangs).
    """
    tl.debug_barrier()
    cptr = ctr_ptr + 1 + row * 8 + LOG2S
    t = tl.atomic_add(cptr, 1, sem="acq_rel", scope="gpu").to(tl.uint32, bitcast=True)
    target = (t | (SLICES - 1)) + 1
    wait = (((t + 1) - target).to(tl.int32, bitcast=True) < 0).to(tl.int32)
    expired = wait * 0
    deadline = globaltimer() + TIMEOUT_NS
    while (wait != 0) & (expired == 0):
        seen = tl.atomic_add(cptr, 0, sem="acquire", scope="gpu").to(tl.uint32, bitcast=True)
        wait = ((seen - target).to(tl.int32, bitcast=True) < 0).to(tl.int32)
        expired = (globaltimer() > deadline).to(tl.int32)
    if wait != 0:
        tl.atomic_add(ctr_ptr, 1, sem="relaxed", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _row_sumsq(sq, t, sid, part_ptr, ctr_ptr, SLOT: tl.constexpr, SLICES: tl.constexpr,
               SPLIT: tl.constexpr, PHASE: tl.constexpr, PUBLISH: tl.constexpr,
               LOG2S: tl.constexpr, TIMEOUT_NS: tl.constexpr):  # fmt: skip
    """Row sum of ``sq``: [ROWS, 1] for SLICES = 1, else the (scalar) chain of slice sums.

    Split mode: PHASE 0 publishes this program's slice sum, waits for the row's others and chains
    the published values; PHASE == PUBLISH (interpreter) only publishes; a later PHASE reads what
    an earlier launch published.
    """
    p = tl.sum(sq, axis=1)
    if SLICES == 1:
        return p[:, None]
    else:
        if SPLIT:
            idx = tl.arange(0, SLICES)
            base = part_ptr + (t.to(tl.int64) * 2 + SLOT) * SLICES
            if (PHASE == 0) or (PHASE == PUBLISH):
                tl.store(base + sid, tl.sum(tl.where(idx == sid, p, 0.0), axis=0))
            if PHASE == 0:
                _wait_row(ctr_ptr, t, SLICES, LOG2S, TIMEOUT_NS)
            return _chain(tl.load(base + idx, volatile=True), SLICES)
        else:
            return _chain(p, SLICES)


# ----------------------------------------------------------------------------- per-tile code
@triton.jit
def _gated_tile(x, res, a, be, w, t, sid, rows, offs, mask, out_ptr, o_st, Hf, eps, part_ptr,
                ctr_ptr, MASKED: tl.constexpr, HAS_WEIGHT: tl.constexpr, PTX: tl.constexpr,
                SLICES: tl.constexpr, SPLIT: tl.constexpr, PHASE: tl.constexpr,
                LOG2S: tl.constexpr, TIMEOUT_NS: tl.constexpr):  # fmt: skip
    """out = alpha * res + beta * (x * r), x = branch [* w] (FP32). PHASE 1 only publishes."""
    if HAS_WEIGHT:
        x = x * w
    ss = _row_sumsq(x * x, t, sid, part_ptr, ctr_ptr, 0, SLICES, SPLIT, PHASE, 1, LOG2S,
                    TIMEOUT_NS)  # fmt: skip
    if PHASE != 1:
        r = tl.broadcast_to(_inv_rms(ss, Hf, eps), x.shape)
        o_row = rows.to(tl.int64)[:, None] * o_st
        _st(out_ptr + o_row + offs, tl.fma(a, res, be * (x * r)), mask, MASKED, PTX)


@triton.jit
def _stream_update(res, b, a_ptr, be_ptr, offs, pmask, alpha_scalar, r1,
                   ALPHA_MODE: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """residual_out = u + (beta * b) * r1; u = residual, scalar * residual or alpha * residual."""
    if ALPHA_MODE == 1:
        res = alpha_scalar * res
    elif ALPHA_MODE == 2:
        res = _ld(a_ptr + offs, pmask, MASKED, False) * res
    be = _ld(be_ptr + offs, pmask, MASKED, False)
    # explicit FMA: left to the compiler, contraction can differ between copies of the expression
    # that Triton rematerialises for different layouts, giving two values of one element
    return tl.fma(be * b, tl.broadcast_to(r1, b.shape), res)


@triton.jit
def _store_ffn(ffn_ptrs, router_ptrs, y, mask, MASKED: tl.constexpr, HAS_ROUTER: tl.constexpr,
               PTX: tl.constexpr):  # fmt: skip
    """ffn_input = cast(y) and, when asked, router_input = y (FP32).

    With a router output, ffn_input is rounded from the stored router values re-read by the same
    threads: Triton may recompute ``y`` in a second register layout for the 16-bit store, and on
    H200 that copy differed from the FP32 one by an ulp now and then (ffn != cast(router)).
    """
    if HAS_ROUTER:
        _st(router_ptrs, y, mask, MASKED, PTX)
        tl.debug_barrier()
        y = _ld(router_ptrs, mask, MASKED, False)
    _st(ffn_ptrs, y, mask, MASKED, PTX)


@triton.jit
def _gated_next_tile(b, res, nw, pw, t, sid, rows, offs, pmask, mask, alpha_ptr, beta_ptr,
                     rout_ptr, ffn_ptr, router_ptr, ro_st, f_st, rt_st, alpha_scalar, Hf,
                     post_eps, next_eps, part_ptr, ctr_ptr, ALPHA_MODE: tl.constexpr,
                     MASKED: tl.constexpr, HAS_POST_WEIGHT: tl.constexpr,
                     HAS_ROUTER: tl.constexpr, PTX: tl.constexpr, SLICES: tl.constexpr,
                     SPLIT: tl.constexpr, PHASE: tl.constexpr, LOG2S: tl.constexpr,
                     TIMEOUT_NS: tl.constexpr):  # fmt: skip
    """One-pass tile of _gated_residual_next_kernel from the FP32 branch and stream.

    Interpreter split phases: 1 publishes the slice sum of b; 2 stores residual_out and publishes
    its slice sum; 3 re-reads the stored FP32 residual_out (the same bits) and writes ffn/router.
    """
    r64 = rows.to(tl.int64)[:, None]
    ro_ptrs = rout_ptr + r64 * ro_st + offs
    if PHASE != 3:
        if HAS_POST_WEIGHT:
            b = b * pw
        ss1 = _row_sumsq(b * b, t, sid, part_ptr, ctr_ptr, 0, SLICES, SPLIT, PHASE, 1, LOG2S,
                         TIMEOUT_NS)  # fmt: skip
        if PHASE != 1:
            r1 = _inv_rms(ss1, Hf, post_eps)
            ro = _stream_update(res, b, alpha_ptr, beta_ptr, offs, pmask, alpha_scalar, r1,
                                ALPHA_MODE, MASKED)  # fmt: skip
            _st(ro_ptrs, ro, mask, MASKED, PTX)
    else:
        ro = _ld(ro_ptrs, mask, MASKED, False)
    if PHASE != 1:
        # padded / masked-off columns hold ro = 0 (b = res = 0 there): they add nothing
        ss2 = _row_sumsq(ro * ro, t, sid, part_ptr, ctr_ptr, 1, SLICES, SPLIT, PHASE, 2, LOG2S,
                         TIMEOUT_NS)  # fmt: skip
        if PHASE != 2:
            r2 = tl.broadcast_to(_inv_rms(ss2, Hf, next_eps), ro.shape)
            _store_ffn(ffn_ptr + r64 * f_st + offs, router_ptr + r64 * rt_st + offs,
                       (ro * r2) * nw, mask, MASKED, HAS_ROUTER, PTX)  # fmt: skip


# ----------------------------------------------------------------------------- kernels
# One-pass tiles: straight-line (one row tile per program, or one (row, slice) in split mode) or
# the persistent row loop (see norm.triton; never split). PDL: parameters before gdc_wait; every
# store and atomic (split mode's partials and tickets included) after it.
@triton.jit(do_not_specialize=["n_rows"])
def _gated_residual_kernel(
    b_ptr, res_ptr, w_ptr, alpha_ptr, beta_ptr, out_ptr, part_ptr, ctr_ptr,
    n_rows, H, Hf,
    b_st, r_st, o_st,
    eps, gain_center,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr, PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr, SLICES: tl.constexpr, SPLIT: tl.constexpr, PHASE: tl.constexpr,
    LOG2S: tl.constexpr, TIMEOUT_NS: tl.constexpr,
):  # fmt: skip
    """x = f32(branch) [* (f32(w) + c)]; out = alpha * residual + beta * (x * r)  (all FP32)."""
    pid = tl.program_id(0)
    if NUM_CHUNKS == 1:
        sid = 0
        if SPLIT:
            sid = tl.program_id(1)
        offs = _slab_offs(BLOCK, SLICES)
        pm = _col_mask(offs, H, sid, SLICES, SPLIT)
        a = _ld(alpha_ptr + offs, pm, MASKED, False)
        be = _ld(beta_ptr + offs, pm, MASKED, False)
        w = 1.0
        if HAS_WEIGHT:
            w = _ld(w_ptr + offs, pm, MASKED, False) + gain_center
        if USE_PDL:
            gdc_wait()
        if not PERSISTENT:
            rows, mask = _slab_rows(pid, offs, n_rows, H, sid, ROWS, SLICES, SPLIT)
            br, rr = _slab_load(b_ptr, res_ptr, rows, offs, mask, b_st, r_st, MASKED, EVICT_FIRST)
            if USE_PDL:
                gdc_launch_dependents()
            _gated_tile(br.to(tl.float32), rr.to(tl.float32), a, be, w, pid, sid, rows, offs,
                        mask, out_ptr, o_st, Hf, eps, part_ptr, ctr_ptr, MASKED, HAS_WEIGHT, PTX,
                        SLICES, SPLIT, PHASE, LOG2S, TIMEOUT_NS)  # fmt: skip
        else:
            nprog = tl.num_programs(0)
            n_tiles = tl.cdiv(n_rows, ROWS)
            t = pid
            b_nx = 0.0
            r_nx = 0.0
            if PREFETCH:
                rows0, mask0 = _slab_rows(t, offs, n_rows, H, sid, ROWS, SLICES, False)
                b_nx, r_nx = _slab_load(b_ptr, res_ptr, rows0, offs, mask0, b_st, r_st, MASKED,
                                        EVICT_FIRST)  # fmt: skip
            while t < n_tiles:
                rows, mask, br, rr, b_nx, r_nx = _loop_tile(
                    t, nprog, b_nx, r_nx, b_ptr, res_ptr, offs, n_rows, H, sid, b_st, r_st, ROWS,
                    SLICES, BLOCK, MASKED, EVICT_FIRST, PREFETCH)  # fmt: skip
                if USE_PDL:
                    if t + nprog >= n_tiles:
                        gdc_launch_dependents()
                _gated_tile(br.to(tl.float32), rr.to(tl.float32), a, be, w, t, sid, rows, offs,
                            mask, out_ptr, o_st, Hf, eps, part_ptr, ctr_ptr, MASKED, HAS_WEIGHT,
                            PTX, SLICES, False, 0, LOG2S, TIMEOUT_NS)  # fmt: skip
                t += nprog
    else:
        rows, cols, mask = _tile(pid, 0, n_rows, H, ROWS, BLOCK)
        b_row = rows.to(tl.int64)[:, None] * b_st
        r_row = rows.to(tl.int64)[:, None] * r_st
        o_row = rows.to(tl.int64)[:, None] * o_st
        if USE_PDL:
            gdc_wait()
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            x = _ld(b_ptr + b_row + cols[None, :], mask, MASKED, False)
            if HAS_WEIGHT:
                x = x * (_ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center)
            acc += x * x
        r = _inv_rms(tl.sum(acc, axis=1), Hf, eps)[:, None]
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            cmask = cols < H
            x = _ld(b_ptr + b_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            if HAS_WEIGHT:
                x = x * (_ld(w_ptr + cols, cmask, MASKED, False)[None, :] + gain_center)
            res = _ld(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            a = _ld(alpha_ptr + cols, cmask, MASKED, False)[None, :]
            be = _ld(beta_ptr + cols, cmask, MASKED, False)[None, :]
            _st(out_ptr + o_row + cols[None, :], tl.fma(a, res, be * (x * r)), mask, MASKED, PTX)
        if USE_PDL:
            gdc_launch_dependents()


@triton.jit(do_not_specialize=["n_rows"])
def _gated_residual_next_kernel(
    b_ptr, res_ptr, nw_ptr, alpha_ptr, beta_ptr, pw_ptr, rout_ptr, ffn_ptr, router_ptr,
    part_ptr, ctr_ptr,
    n_rows, H, Hf,
    b_st, r_st, ro_st, f_st, rt_st,
    alpha_scalar, post_eps, next_eps, next_gain_center, post_gain_center,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    ALPHA_MODE: tl.constexpr, HAS_POST_WEIGHT: tl.constexpr, HAS_ROUTER: tl.constexpr,
    PTX: tl.constexpr, USE_PDL: tl.constexpr, PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr, SLICES: tl.constexpr, SPLIT: tl.constexpr, PHASE: tl.constexpr,
    LOG2S: tl.constexpr, TIMEOUT_NS: tl.constexpr,
):  # fmt: skip
    """SPEC §1.4: gated stream update, then the next RMSNorm of the FP32 residual_out.

    ALPHA_MODE: 0 = scalar 1.0 (u = residual), 1 = other scalar, 2 = per-channel tensor.
    """
    pid = tl.program_id(0)
    if NUM_CHUNKS == 1:
        sid = 0
        if SPLIT:
            sid = tl.program_id(1)
        offs = _slab_offs(BLOCK, SLICES)
        pm = _col_mask(offs, H, sid, SLICES, SPLIT)
        nw = _ld(nw_ptr + offs, pm, MASKED, False) + next_gain_center
        pw = 1.0
        if HAS_POST_WEIGHT:
            pw = _ld(pw_ptr + offs, pm, MASKED, False) + post_gain_center
        if USE_PDL:
            gdc_wait()
        if not PERSISTENT:
            rows, mask = _slab_rows(pid, offs, n_rows, H, sid, ROWS, SLICES, SPLIT)
            br, rr = _slab_load(b_ptr, res_ptr, rows, offs, mask, b_st, r_st, MASKED, EVICT_FIRST)
            if USE_PDL:
                gdc_launch_dependents()
            _gated_next_tile(br.to(tl.float32), rr.to(tl.float32), nw, pw, pid, sid, rows, offs,
                             pm, mask, alpha_ptr, beta_ptr, rout_ptr, ffn_ptr, router_ptr, ro_st,
                             f_st, rt_st, alpha_scalar, Hf, post_eps, next_eps, part_ptr,
                             ctr_ptr, ALPHA_MODE, MASKED, HAS_POST_WEIGHT, HAS_ROUTER, PTX,
                             SLICES, SPLIT, PHASE, LOG2S, TIMEOUT_NS)  # fmt: skip
        else:
            nprog = tl.num_programs(0)
            n_tiles = tl.cdiv(n_rows, ROWS)
            t = pid
            b_nx = 0.0
            r_nx = 0.0
            if PREFETCH:
                rows0, mask0 = _slab_rows(t, offs, n_rows, H, sid, ROWS, SLICES, False)
                b_nx, r_nx = _slab_load(b_ptr, res_ptr, rows0, offs, mask0, b_st, r_st, MASKED,
                                        EVICT_FIRST)  # fmt: skip
            while t < n_tiles:
                rows, mask, br, rr, b_nx, r_nx = _loop_tile(
                    t, nprog, b_nx, r_nx, b_ptr, res_ptr, offs, n_rows, H, sid, b_st, r_st, ROWS,
                    SLICES, BLOCK, MASKED, EVICT_FIRST, PREFETCH)  # fmt: skip
                if USE_PDL:
                    if t + nprog >= n_tiles:
                        gdc_launch_dependents()
                _gated_next_tile(br.to(tl.float32), rr.to(tl.float32), nw, pw, t, sid, rows,
                                 offs, pm, mask, alpha_ptr, beta_ptr, rout_ptr, ffn_ptr,
                                 router_ptr, ro_st, f_st, rt_st, alpha_scalar, Hf, post_eps,
                                 next_eps, part_ptr, ctr_ptr, ALPHA_MODE, MASKED, HAS_POST_WEIGHT,
                                 HAS_ROUTER, PTX, SLICES, False, 0, LOG2S, TIMEOUT_NS)  # fmt: skip
                t += nprog
    else:
        rows, cols, mask = _tile(pid, 0, n_rows, H, ROWS, BLOCK)
        b_row = rows.to(tl.int64)[:, None] * b_st
        r_row = rows.to(tl.int64)[:, None] * r_st
        ro_row = rows.to(tl.int64)[:, None] * ro_st
        f_row = rows.to(tl.int64)[:, None] * f_st
        rt_row = rows.to(tl.int64)[:, None] * rt_st
        if USE_PDL:
            gdc_wait()
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            b = _ld(b_ptr + b_row + cols[None, :], mask, MASKED, False)
            if HAS_POST_WEIGHT:
                b = b * (_ld(pw_ptr + cols, cols < H, MASKED, False)[None, :] + post_gain_center)
            acc += b * b
        r1 = _inv_rms(tl.sum(acc, axis=1), Hf, post_eps)[:, None]
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            cmask = cols < H
            b = _ld(b_ptr + b_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            if HAS_POST_WEIGHT:
                b = b * (_ld(pw_ptr + cols, cmask, MASKED, False)[None, :] + post_gain_center)
            res = _ld(res_ptr + r_row + cols[None, :], mask, MASKED, EVICT_FIRST)
            ro = _stream_update(res, b, alpha_ptr, beta_ptr, cols[None, :], cmask[None, :],
                                alpha_scalar, r1, ALPHA_MODE, MASKED)  # fmt: skip
            _st(rout_ptr + ro_row + cols[None, :], ro, mask, MASKED, PTX)
            acc += ro * ro
        if USE_PDL:
            gdc_launch_dependents()
        r2 = _inv_rms(tl.sum(acc, axis=1), Hf, next_eps)[:, None]
        # make this program's residual_out stores visible to all of its threads before re-reading
        tl.debug_barrier()
        for c in tl.range(NUM_CHUNKS):
            rows, cols, mask = _tile(pid, c, n_rows, H, ROWS, BLOCK)
            nw = _ld(nw_ptr + cols, cols < H, MASKED, False)[None, :] + next_gain_center
            ro = _ld(rout_ptr + ro_row + cols[None, :], mask, MASKED, False)
            _store_ffn(ffn_ptr + f_row + cols[None, :], router_ptr + rt_row + cols[None, :],
                       (ro * r2) * nw, mask, MASKED, HAS_ROUTER, PTX)  # fmt: skip


# ----------------------------------------------------------------------------- split scratch
#: one scratch per (device, stream): launches on one stream are ordered, so their tickets never
#: interleave; split launches on two streams at once get different counters. A CUDA graph keeps
#: the scratch of the stream it was captured on: replays of graphs captured on one stream must not
#: overlap each other (nor eager split launches on that stream) — the usual rule for per-stream
#: workspaces such as cuBLAS's.
_SCRATCH: dict[tuple[str, int | None, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _stream_key(device: torch.device) -> tuple[str, int | None, int]:
    if device.type != "cuda":
        return (device.type, device.index, 0)
    return (device.type, device.index, torch.cuda.current_stream(device).cuda_stream)


def _scratch(device: torch.device, n_rows: int, slices: int):
    """(partials FP32, [error, counters] int32) of ``device`` and the current stream for
    ``n_rows`` x ``slices``; None while a CUDA graph is being captured and no large enough scratch
    exists for the capturing stream (no allocation then: the normal mode runs, same bits).
    """
    key = _stream_key(device)
    cur = _SCRATCH.get(key)
    if cur is not None and cur[0].numel() >= 2 * n_rows * slices and \
            cur[1].numel() >= 1 + _CTR_PER_ROW * n_rows:  # fmt: skip
        return cur
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    # CUDA: rows x slices <= SMs, so one SM-sized buffer serves every launch and never moves
    rows = max(n_rows * slices, sm_count(device) if device.type == "cuda" else 64)
    cur = (torch.zeros(2 * rows, dtype=torch.float32, device=device),
           torch.zeros(1 + _CTR_PER_ROW * rows, dtype=torch.int32, device=device))  # fmt: skip
    _SCRATCH[key] = cur
    return cur


def split_rows_timeouts(device: torch.device | str | None = None, reset: bool = False) -> int:
    """Split-mode programs of ``device`` (all streams) whose cross-program wait timed out (0 =
    none; their rows were wrong). Reads the device (synchronizes); ``reset`` zeroes the count."""
    device = torch.device(device if device is not None else "cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    n = 0
    for key, cur in _SCRATCH.items():
        if key[:2] == (device.type, device.index):
            n += int(cur[1][0].item())
            if reset:
                cur[1][0].zero_()
    return n


def _split_mode(tile: RowTile, width: int, n_rows: int, device: torch.device,
                split: bool | None):  # fmt: skip
    """The scratch when this launch runs split, else None.

    ``split=None`` follows ``tiles.SPLIT_ROWS`` (None = automatic: width >= SPLIT_MIN_WIDTH and
    rows x slices <= SMs; True = wherever the tile and grid allow). ``split=True`` forces it
    (ValueError when the tile is not split-capable or, on a GPU, the grid would exceed the SMs).
    """
    knob = tiles.SPLIT_ROWS if split is None else split
    if knob is False:
        return None
    force = knob is True
    sms = sm_count(device) if (device.type == "cuda" or not force) else 0
    if not tile.can_split(width, n_rows, sms, force=force):
        if split is True:
            raise ValueError(f"split rows: tile {tile} cannot split {n_rows} rows of width {width}"
                             f" on {device}")  # fmt: skip
        return None
    return _scratch(device, n_rows, tile.slices)


def _split_consts(tile: RowTile, split: bool, phase: int) -> dict:
    return dict(SLICES=tile.slices, SPLIT=split, PHASE=phase,
                LOG2S=tile.slices.bit_length() - 1, TIMEOUT_NS=tiles.SPLIT_TIMEOUT_NS)  # fmt: skip


def _launches(tile: RowTile, n_rows: int, device: torch.device, scratch, phases: int):
    """(grid, constexprs) of each launch: normal mode, split in one launch (GPU), or split as
    ``phases`` launches (interpreter: no program may wait for a later one)."""
    if scratch is None:
        return [(nt._grid(tile, tile.grid(n_rows)[0], device), _split_consts(tile, False, 0))]
    grid = (n_rows, tile.slices)
    if not interpreter_active():
        return [(grid, _split_consts(tile, True, 0))]
    return [(grid, _split_consts(tile, True, p)) for p in range(1, phases + 1)]


def _kwargs(tile: RowTile, scratch, use_pdl: bool) -> dict:
    # split launches are never persistent: no register cap
    return nt._launch_kwargs(tile if scratch is None else replace(tile, programs_per_sm=0), use_pdl)


def _scratch_args(scratch, beta: torch.Tensor):
    # normal mode never touches them: beta (and an int32 view of it) keep the signature fixed
    return scratch if scratch is not None else (beta, beta.view(torch.int32))


# ----------------------------------------------------------------------------- launchers
def launch_gated_residual_rmsnorm(
    branch: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor | None,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    out: torch.Tensor,
    eps: float,
    gain_center: float,
    use_pdl: bool,
    tile: RowTile | None = None,
    split: bool | None = None,
) -> None:
    n_rows, width = branch.shape
    if n_rows == 0:
        return
    tile = tile or row_tile(width, GATED_POLICY)
    scratch = _split_mode(tile, width, n_rows, branch.device, split)
    masked = tile.rows > 1 or not tile.even(width) or scratch is not None
    part, ctr = _scratch_args(scratch, beta)
    for grid, consts in _launches(tile, n_rows, branch.device, scratch, 2):
        _gated_residual_kernel[grid](
            branch, residual, weight if weight is not None else alpha, alpha, beta, out, part, ctr,
            n_rows, width, float(width),
            branch.stride(0), residual.stride(0), out.stride(0),
            eps, gain_center,
            BLOCK=tile.block, NUM_CHUNKS=tile.num_chunks, ROWS=tile.rows, MASKED=masked,
            EVICT_FIRST=nt.STREAM_EVICT_FIRST,
            HAS_WEIGHT=weight is not None, PTX=not interpreter_active(), USE_PDL=use_pdl,
            PERSISTENT=nt._persistent(tile) and scratch is None,
            PREFETCH=nt._prefetch(tile) and scratch is None, **consts,
            num_warps=tile.num_warps, **_kwargs(tile, scratch, use_pdl),
        )  # fmt: skip


def launch_gated_residual_next_rmsnorm(
    branch: torch.Tensor,
    residual: torch.Tensor,
    next_weight: torch.Tensor,
    alpha: torch.Tensor | None,
    alpha_scalar: float,
    beta: torch.Tensor,
    post_weight: torch.Tensor | None,
    residual_out: torch.Tensor,
    ffn_input: torch.Tensor,
    router_input: torch.Tensor | None,
    post_eps: float,
    next_eps: float,
    next_gain_center: float,
    post_gain_center: float,
    use_pdl: bool,
    tile: RowTile | None = None,
    split: bool | None = None,
) -> None:
    n_rows, width = branch.shape
    if n_rows == 0:
        return
    tile = tile or row_tile(width, GATED_POLICY)
    scratch = _split_mode(tile, width, n_rows, branch.device, split)
    masked = tile.rows > 1 or not tile.even(width) or scratch is not None
    alpha_mode = 2 if alpha is not None else (0 if alpha_scalar == 1.0 else 1)
    router = router_input if router_input is not None else residual_out
    part, ctr = _scratch_args(scratch, beta)
    for grid, consts in _launches(tile, n_rows, branch.device, scratch, 3):
        _gated_residual_next_kernel[grid](
            branch, residual, next_weight, alpha if alpha is not None else beta, beta,
            post_weight if post_weight is not None else next_weight,
            residual_out, ffn_input, router, part, ctr,
            n_rows, width, float(width),
            branch.stride(0), residual.stride(0), residual_out.stride(0), ffn_input.stride(0),
            router.stride(0),
            alpha_scalar, post_eps, next_eps, next_gain_center, post_gain_center,
            BLOCK=tile.block, NUM_CHUNKS=tile.num_chunks, ROWS=tile.rows, MASKED=masked,
            EVICT_FIRST=nt.STREAM_EVICT_FIRST,
            ALPHA_MODE=alpha_mode, HAS_POST_WEIGHT=post_weight is not None,
            HAS_ROUTER=router_input is not None, PTX=not interpreter_active(), USE_PDL=use_pdl,
            PERSISTENT=nt._persistent(tile) and scratch is None,
            PREFETCH=nt._prefetch(tile) and scratch is None, **consts,
            num_warps=tile.num_warps, **_kwargs(tile, scratch, use_pdl),
        )  # fmt: skip
