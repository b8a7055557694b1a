"""One-launch decode kernel of the all-gather + norm ops (``all_gather_rmsnorm``, ``_fp8``,
``_fp4_quantize``, ``all_gather_gated_residual_next_rmsnorm``): the default at
M <= ONE_LAUNCH_MAX_TOKENS (``MOEFUSE_ALLGATHER_ONE_LAUNCH=0`` turns it off for every op, the
same on every rank). MEASURED for rmsnorm on 2 x H200 (bench all-gather, 2026-11-30,
bench/results/all-gather-h200-p2.json): one launch vs two at H = 4096: M = 1 3.39 / 3.97 us,
M = 8 4.30 / 5.10, M = 64 4.64 / 5.72; H = 8192: 4.04 / 4.49, 4.92 / 5.72, 6.54 / 7.22 — bitwise
equal to NCCL + rmsnorm in every case (the benchmark checks before it times). The FP8, NVFP4
and gated ops (2 x H200, same benchmark): one launch vs two at H = 4096, M = 1:
3.79 / 4.15, 3.75 / 4.13, 4.10 / 4.63 us, and faster at every M <= 64 except NVFP4 rows wider
than 4096 at M <= 8 (:data:`FP4_ONE_LAUNCH_MAX_WIDTH`).

The two-launch path is the gather, then the single-GPU op's kernel. At decode sizes the second
launch and its grid-dependency wait are a visible part of the latency, so this kernel does both
in one program per norm tile: program ``pid`` gathers the rows of its own tile (push its
fragments, poll the peers' ones, all through :mod:`moefuse.comm.all_gather.kernels`'s helpers), a
CTA barrier makes them visible to every thread, and then it runs the SAME device code as the
single-GPU kernel on those rows (``norm_tile``, constexpr ``OP``: ``_rmsnorm_kernel``'s,
``_rmsnorm_fp8_kernel``'s, ``_rmsnorm_fp4_kernel``'s or ``_gated_residual_next_kernel``'s row
functions) — same tile (the op's own tile policy, :func:`op_tile`), same constexprs, same
``num_warps``, rows re-read from the gathered buffer with the same addressing — so the
reduction tree, and the bits, are the single-GPU kernel's.

Three modes (:func:`decode_mode`; ``MOEFUSE_ALLGATHER_DECODE=late|early|slots`` forces one):
``late`` = the above (:func:`norm_tile`: the op's parameters are loaded after the wait, with
the rows); ``early`` = the parameters (and the gated op's residual) loaded before the wait for
the peers, the rows from the gathered buffer after it; ``slots`` = parameters early, and every
rank (this one too) pushes its fragment into this rank's slot, where the program polls the
rows in the op's own tile, straight into registers: no gathered round trip, no CTA barrier
(:func:`norm_tile_early`; the values and tile shape are those of the single-GPU kernel's loads,
so the tree is the same: the tests check the bits). MEASURED on one H200 as two loopback ranks
(moefuse.tools.loopback_gpu_check, PDL on, per case the median over 3 alternating
rounds of the faster rank's median; notes/comm-all-gather.md has the tables), µs late -> slots:
FP8 H = 4096, M = 1 / 8 / 64: 3.93 -> 3.23, 4.43 -> 4.05, 5.31 -> 4.64; H = 8192: 4.74 ->
4.33, 5.25 -> 4.62, 6.58 -> 6.20; rmsnorm H = 4096 (one-pass tile): 0.2-0.5 µs less; ``early``
alone did not beat ``late`` for FP8. NVFP4: all modes within the noise (``late`` kept). The
gated op at H = 8192: late 4.82 / 5.68 / 8.42, early 5.30 / 5.98 / 8.46, slots 5.26 / 5.97 /
8.84 (``late`` kept). Defaults: :data:`DECODE_DEFAULT`. Loopback "links" run at L2 speed; on
NVLink the wait is longer, which may favour hoisting the parameters more: ``bench all-gather``
times every mode beside the default (``moefuse_late`` / ``_early`` / ``_slots``).

Eligible launches: one-shot, M <= :data:`ONE_LAUNCH_MAX_TOKENS` (one program per tile, all
co-resident: no cross-rank wait on an unscheduled program), tiles :func:`fusable` accepts
(stepped rows unrolled, or one-pass tiles; not the two-pass chunked rows). NVFP4: the programs
cover the scale layout's padded rows; those of padding rows only gather nothing and write zero
scale bytes, as the single-GPU kernel's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse import knobs
from moefuse._fastpath import launch
from moefuse.comm.all_gather import kernels as AG
from moefuse.norm import gated as gd
from moefuse.norm import tiles
from moefuse.norm import triton as nt
from moefuse.norm.tiles import GATED_POLICY, RMSNORM_POLICY, row_tile
from moefuse.quant import fused as qf
from moefuse.quant.formats import LAYOUTS, RECIPES, scale_layout_shape

ONE_LAUNCH_ENV = "MOEFUSE_ALLGATHER_ONE_LAUNCH"
#: largest M of the one-launch variant (programs = tiles <= 64: all resident on every rank)
ONE_LAUNCH_MAX_TOKENS = 64
#: the single-GPU op a fused launch ends with (host ints; OP_* the kernels' constexprs)
RMSNORM, FP8, FP4, GATED = 0, 1, 2, 3
#: the benchmark's op names (moefuse.bench.all_gather) -> the ops above
OP_CODES = {"rmsnorm": RMSNORM, "fp8": FP8, "fp4": FP4, "gated": GATED}
DECODE_ENV = "MOEFUSE_ALLGATHER_DECODE"
DECODE_MODES = knobs.KNOBS[DECODE_ENV].choices
#: the decode kernel's mode per op (see :func:`decode_mode` and the module docstring: measured
#: on one H200 as two loopback ranks)
DECODE_DEFAULT = {RMSNORM: "slots", FP8: "slots", FP4: "late", GATED: "late"}
#: the same for stepped rows (rmsnorm 6145-8192 columns, the gated op)
DECODE_DEFAULT_STEPPED = {RMSNORM: "late", GATED: "late"}
OP_RMSNORM: tl.constexpr = tl.constexpr(RMSNORM)
OP_FP8: tl.constexpr = tl.constexpr(FP8)
OP_FP4: tl.constexpr = tl.constexpr(FP4)
OP_GATED: tl.constexpr = tl.constexpr(GATED)


@triton.jit(do_not_specialize=["counts", "rank"])
def _ag_rmsnorm_kernel(
    shard_ptr, s_st, x_ptr, ptrs, counts, dims, ws, S, rank, cap, timeout_us,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr,
    STEPPED: tl.constexpr, UNROLL: tl.constexpr,
    P: tl.constexpr, BLOCK_S: tl.constexpr,
    OP: tl.constexpr = 0, FMT: tl.constexpr = 0, LAYOUT: tl.constexpr = 0,
    RECIPE: tl.constexpr = 0, ALPHA_MODE: tl.constexpr = 0, HAS_POST_WEIGHT: tl.constexpr = False,
    HAS_ROUTER: tl.constexpr = False, EARLY: tl.constexpr = False,
    FROM_SLOTS: tl.constexpr = False,
):  # fmt: skip
    """Gather this program's rows, then run the op's row tile on them (module docstring).
    ``ptrs`` = (w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr,
    rt_ptr) (``Epilogue.pointers``); ``counts`` = (n_rows, n_norm) (not specialised); ``dims`` =
    (H, Hf, KB, n_kcols, HEADS, x_st, x_sh, o_st, o_sh, eps, gain_center, r_st, ro_st, rt_st,
    alpha_scalar, post_eps, post_gc); ``ws`` = (table_ptr, ag_off16, agctrl_ptr, ctrl_ptr,
    clock_ptr)."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    (H, Hf, KB, n_kcols, HEADS, x_st, x_sh, o_st, o_sh, eps, gain_center, r_st, ro_st, rt_st,
     alpha_scalar, post_eps, post_gc) = dims
    table_ptr, ag_off16, agctrl_ptr, ctrl_ptr, clock_ptr = ws
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    if USE_PDL:
        gdc_wait()
    # --- gather the rows of this program's tile into x_ptr (the gathered buffer), or with
    # FROM_SLOTS into every rank's slot of this rank (read back as a register tile below)
    deadline, gen, healthy, region, mine = AG.prelude(table_ptr, ag_off16, agctrl_ptr,
                                                      ctrl_ptr, clock_ptr, rank, cap,
                                                      timeout_us, P, PTX)  # fmt: skip
    scols = tl.arange(0, BLOCK_S)
    scm = scols < S
    first = pid * ROWS
    # (NVFP4 tiles of padding rows only, pid * ROWS >= n_rows, gather nothing)
    n_mine = tl.where(healthy, tl.maximum(tl.minimum(ROWS, n_rows - first), 0), 0)
    push_rows(shard_ptr, s_st, x_ptr, x_st, first, n_mine, scols, scm, table_ptr, ag_off16,
              region, rank, S, H, P, FROM_SLOTS)  # fmt: skip
    if USE_PDL:
        # the next kernel may be scheduled now; its own gdc_wait orders its reads and writes
        # after this whole grid (so the residual / weights read below are safe)
        gdc_launch_dependents()
    empty = tl.zeros([BLOCK_S], tl.int16)
    if EARLY:
        # --- the op's parameters first, then its tile (from the slots, or the gathered rows)
        missing = norm_tile_early(pid, n_mine, first, scols, scm, empty, mine, region, rank, S,
                                  deadline, clock_ptr, x_ptr, ptrs, counts, dims, BLOCK,
                                  NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, OP, FMT, LAYOUT,
                                  RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER, P, FROM_SLOTS,
                                  STEPPED)  # fmt: skip
    else:
        missing = receive_rows(x_ptr, x_st, first, n_mine, scols, scm, mine, region, rank, S, H,
                               deadline, clock_ptr, empty, P, PTX)  # fmt: skip
        # --- the single-GPU op's row tile (OP: rmsnorm, rmsnorm_quant, rmsnorm_fp4_quantize,
        # gated)
        norm_tile(pid, x_ptr, ptrs, counts, dims, BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST,
                  PTX, STEPPED, UNROLL, OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT,
                  HAS_ROUTER)  # fmt: skip
    AG.finish(agctrl_ptr, ctrl_ptr, table_ptr, rank, gen, missing, pid, G, P, PTX)


@triton.jit
def norm_tile_early(t, n_mine, first, scols, scm, empty, mine, region, rank, S, deadline,
                    clock_ptr, x_ptr, ptrs, counts, dims, BLOCK: tl.constexpr,
                    NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
                    MASKED: tl.constexpr, EVICT_FIRST: tl.constexpr, PTX: tl.constexpr,
                    OP: tl.constexpr, FMT: tl.constexpr, LAYOUT: tl.constexpr,
                    RECIPE: tl.constexpr, ALPHA_MODE: tl.constexpr,
                    HAS_POST_WEIGHT: tl.constexpr, HAS_ROUTER: tl.constexpr, P: tl.constexpr,
                    FROM_SLOTS: tl.constexpr, STEPPED: tl.constexpr):  # fmt: skip
    """Row tile ``t`` of the single-GPU op ``OP`` (as :func:`norm_tile`: the same row code, so
    the same tree and bits) with the op's parameters (and the gated op's residual) loaded
    BEFORE the wait for the peers, so that their latency hides behind it; :func:`norm_tile`
    loads them after. One-pass tiles of rmsnorm, FP8 and NVFP4, and the unrolled stepped rows
    of rmsnorm (``nt.norm_unrolled_row``) and the gated op (``gd.next_unrolled_row``). The
    rows come from the gathered buffer after
    :func:`receive_rows`, or with ``FROM_SLOTS`` straight from this rank's slot
    (``AG.receive_tile`` / ``AG.receive_steps``: polled in the op's own tile, no gathered
    round trip, no CTA barrier). Returns the bit mask of the peers that did not deliver.
    ``ptrs``, ``counts``, ``dims``: as ``_ag_rmsnorm_kernel``'s (HEADS and x_sh unused)."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    (H, Hf, KB, n_kcols, HEADS, x_st, x_sh, o_st, o_sh, eps, gain_center, r_st, ro_st, rt_st,
     alpha_scalar, post_eps, post_gc) = dims
    T: tl.constexpr = x_ptr.dtype.element_ty
    live = n_mine > 0
    if OP == OP_RMSNORM and STEPPED:  # unrolled (ROWS = 1): BLOCK = STEP, NUM_CHUNKS = STEPS
        row = t.to(tl.int64)
        ws = nt.step_params(w_ptr, H, gain_center, BLOCK, NUM_CHUNKS, MASKED, True)
        vs, missing = _stepped_rows(row, live, n_mine, first, scols, scm, empty, mine, region,
                                    rank, S, H, deadline, clock_ptr, x_ptr, x_st, T, BLOCK,
                                    NUM_CHUNKS, MASKED, P, PTX, FROM_SLOTS)  # fmt: skip
        nt.norm_unrolled_row(vs, ws, out_ptr, row * o_st, H, Hf, eps, aux_ptr, BLOCK,
                              NUM_CHUNKS, MASKED, PTX, nt.no_aux, nt.st_cast)  # fmt: skip
    elif OP == OP_GATED:  # stepped rows, unrolled (ROWS = 1): BLOCK = STEP, NUM_CHUNKS = STEPS
        row = t.to(tl.int64)
        nws = nt.step_params(w_ptr, H, gain_center, BLOCK, NUM_CHUNKS, MASKED, True)
        pws = nt.step_params(pw_ptr, H, post_gc, BLOCK, NUM_CHUNKS, MASKED, HAS_POST_WEIGHT)
        als = nt.step_params(alpha_ptr, H, 0.0, BLOCK, NUM_CHUNKS, MASKED, ALPHA_MODE == 2)
        bes = nt.step_params(beta_ptr, H, 0.0, BLOCK, NUM_CHUNKS, MASKED, True)
        rs = ()
        for k in tl.static_range(NUM_CHUNKS):
            cols, cm = nt.step_cols(k, H, BLOCK)
            rs = rs + (nt.ldp(res_ptr + row * r_st + cols, cm, MASKED, "evict_first"),)
        bs, missing = _stepped_rows(row, live, n_mine, first, scols, scm, empty, mine, region,
                                    rank, S, H, deadline, clock_ptr, x_ptr, x_st, T, BLOCK,
                                    NUM_CHUNKS, MASKED, P, PTX, FROM_SLOTS)  # fmt: skip
        gd.next_unrolled_row(bs, rs, nws, pws, als, bes, ro_ptr, out_ptr, rt_ptr, row * ro_st,
                              row * o_st, row * rt_st, H, Hf, alpha_scalar, post_eps, eps,
                              BLOCK, NUM_CHUNKS, MASKED, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER,
                              PTX)  # fmt: skip
    else:
        cols = tl.arange(0, BLOCK)
        rows, mask = nt.tile_rows(t, cols, n_rows, H, ROWS)
        w, inv = one_pass_params(w_ptr, aux_ptr, cols, H, gain_center, BLOCK, MASKED, PTX, OP)
        if FROM_SLOTS:
            x, missing = AG.receive_tile(mine, region, rows, cols, mask, live, S, H, deadline,
                                         clock_ptr, T, MASKED, P, PTX)  # fmt: skip
        else:
            missing = receive_rows(x_ptr, x_st, first, n_mine, scols, scm, mine, region, rank, S,
                                   H, deadline, clock_ptr, empty, P, PTX)  # fmt: skip
            x = nt.ld_raw(x_ptr + (rows * x_st)[:, None] + cols[None, :], mask, MASKED,
                           EVICT_FIRST)  # fmt: skip
        one_pass_tile(x, w, inv, t, rows, cols, mask, x_ptr, out_ptr, aux_ptr, sf_ptr, n_rows,
                      n_norm, H, Hf, KB, n_kcols, o_st, o_sh, eps, BLOCK, ROWS, MASKED,
                      EVICT_FIRST, PTX, OP, FMT, LAYOUT, RECIPE)  # fmt: skip
    return missing


@triton.jit
def _stepped_rows(row, live, n_mine, first, scols, scm, empty, mine, region, rank, S, H, deadline,
                  clock_ptr, x_ptr, x_st, T: tl.constexpr, STEP: tl.constexpr,
                  STEPS: tl.constexpr, MASKED: tl.constexpr, P: tl.constexpr, PTX: tl.constexpr,
                  FROM_SLOTS: tl.constexpr):  # fmt: skip
    """Gathered row ``row`` as its STEPS FP32 [1, STEP] steps (the values of the single-GPU
    stepped kernels' ``ldp`` loads), straight from the slots (``AG.receive_steps``) or from
    the gathered buffer after :func:`receive_rows`; and the bit mask of late peers."""
    if FROM_SLOTS:
        vs, missing = AG.receive_steps(mine, region, row, live, S, H, deadline, clock_ptr, T,
                                       STEP, STEPS, MASKED, P, PTX)  # fmt: skip
    else:
        missing = receive_rows(x_ptr, x_st, first, n_mine, scols, scm, mine, region, rank, S, H,
                               deadline, clock_ptr, empty, P, PTX)  # fmt: skip
        vs = ()
        for k in tl.static_range(STEPS):
            cols, cm = nt.step_cols(k, H, STEP)
            vs = vs + (nt.ldp(x_ptr + row * x_st + cols, cm, MASKED, "evict_first"),)
    return vs, missing


@triton.jit
def one_pass_params(w_ptr, aux_ptr, cols, H, gain_center, BLOCK: tl.constexpr,
                    MASKED: tl.constexpr, PTX: tl.constexpr, OP: tl.constexpr,
                    LOAD: tl.constexpr = True):  # fmt: skip
    """The parameters of a one-pass tile of op ``OP`` (rmsnorm, FP8, NVFP4), loaded as the
    single-GPU kernels load them: ``(f32(weight) + gain_center [1, BLOCK], 1 / FP8 scale or
    1.0)``; constants without loads unless ``LOAD`` (unused loads are not removed by the
    compiler: they would cost registers)."""
    w = tl.full([1, BLOCK], 1.0, tl.float32)
    inv = tl.full([], 1.0, tl.float32)
    if LOAD:
        if OP == OP_FP4:
            w = qf.ld32(w_ptr + cols, cols < H, MASKED, False, PTX)[None, :] + gain_center
        else:
            w = nt.ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        if OP == OP_FP8:
            inv = tl.math.div_rn(1.0, tl.load(aux_ptr).to(tl.float32))
    return w, inv


@triton.jit
def one_pass_tile(x, w, inv, t, rows, cols, mask, x_ptr, out_ptr, aux_ptr, sf_ptr, n_rows,
                  n_norm, H, Hf, KB, n_kcols, o_st, o_sh, eps, BLOCK: tl.constexpr,
                  ROWS: tl.constexpr, MASKED: tl.constexpr, EVICT_FIRST: tl.constexpr,
                  PTX: tl.constexpr, OP: tl.constexpr, FMT: tl.constexpr, LAYOUT: tl.constexpr,
                  RECIPE: tl.constexpr):  # fmt: skip
    """The single-GPU op ``OP``'s one-pass tile ``t`` on its rows ``x`` [ROWS, BLOCK] (stored
    dtype, masked elements 0) with the parameters of :func:`one_pass_params`: the row code of
    ``_rmsnorm_kernel`` (``rms_tile``), ``_rmsnorm_fp8_kernel`` (``fp8_tile``) or
    ``_rmsnorm_fp4_kernel`` (``fp4_tile`` with the rows given), so the same tree and bits."""
    if OP == OP_FP8:
        qf.fp8_tile(qf.widen_h(x, x, False), w, inv, rows, cols, mask, x_ptr, out_ptr, 1, 0, 0,
                     o_st, o_sh, Hf, eps, MASKED, False, FMT, PTX, False)  # fmt: skip
    elif OP == OP_FP4:
        qf.fp4_tile(t, w, x_ptr, x_ptr, aux_ptr, out_ptr, sf_ptr, x_ptr, n_rows, n_norm, H, Hf,
                     KB, n_kcols, 0, 0, o_st, 0, eps, BLOCK, ROWS, False, False, RECIPE, LAYOUT,
                     EVICT_FIRST, PTX, False, MASKED, x, True)  # fmt: skip
    else:
        xf = x.to(tl.float32)
        nt.rms_tile(xf, xf, w, rows, cols, mask, out_ptr, 1, o_st, o_sh, Hf, eps, MASKED, False,
                     PTX)  # fmt: skip


@triton.jit
def push_rows(shard_ptr, s_st, x_ptr, x_st, first, n, scols, scm, table_ptr, ag_off16, region,
              rank, S, H, P: tl.constexpr, OWN_SLOT: tl.constexpr = False):  # fmt: skip
    """Push rows ``first .. first + n - 1`` of this rank's shard (``AG.push_row``: every peer's
    slot, and this rank's gathered rows ``x_ptr``, or with ``OWN_SLOT`` its own slot)."""
    j = 0
    while j < n:  # (while: the interpreter cannot range over a loaded value)
        AG.push_row(shard_ptr, s_st, x_ptr, x_st, first + j, scols, scm, table_ptr, ag_off16,
                    region, rank, rank * S, H, P, OWN_SLOT)  # fmt: skip
        j += 1


@triton.jit
def receive_rows(x_ptr, x_st, first, n, scols, scm, mine, region, rank, S, H, deadline,
                 clock_ptr, empty, P: tl.constexpr, PTX: tl.constexpr):  # fmt: skip
    """Receive rows ``first .. first + n - 1`` from every peer into the gathered rows
    (``AG.receive_row``; stops at the first expired wait), then a CTA barrier so that every
    thread sees every gathered word. Returns the bit mask of peers that did not deliver."""
    missing = 0
    j = 0
    while (j < n) & (missing == 0):
        missing = missing | AG.receive_row(x_ptr, x_st, first + j, scols, scm, mine, region, rank,
                                           S, H, deadline, clock_ptr, empty, P, PTX)  # fmt: skip
        j += 1
    tl.debug_barrier()  # the gathered rows, written by every thread, are visible to all of them
    return missing


@triton.jit
def norm_tile(t, x_ptr, ptrs, counts, dims, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
              ROWS: tl.constexpr,
              MASKED: tl.constexpr, EVICT_FIRST: tl.constexpr, PTX: tl.constexpr,
              STEPPED: tl.constexpr, UNROLL: tl.constexpr, OP: tl.constexpr, FMT: tl.constexpr,
              LAYOUT: tl.constexpr, RECIPE: tl.constexpr, ALPHA_MODE: tl.constexpr,
              HAS_POST_WEIGHT: tl.constexpr, HAS_ROUTER: tl.constexpr):  # fmt: skip
    """Row tile ``t`` of the single-GPU op ``OP`` (no PDL) on the gathered rows ``x_ptr``: that
    kernel's own row functions with its constexprs, so the same reduction tree and bits.

    * OP_RMSNORM (``moefuse.norm.triton._rmsnorm_kernel``, no gate): stepped rows (ROWS = 1)
      ``norm_stepped`` unrolled or looped as ``UNROLL`` says; one-pass tiles ``rms_load`` +
      ``rms_tile``. ``out_ptr``: the output rows.
    * OP_FP8 (``moefuse.quant.fused._rmsnorm_fp8_kernel``, one-pass tiles, no residual): the tile
      of its row loop, ``fp8_load`` + ``widen_h`` + ``fp8_tile`` (PACKED False, as its loop);
      ``aux_ptr``: the scale, ``out_ptr``: the FP8 bytes.
    * OP_FP4 (``_rmsnorm_fp4_kernel``, one tile per program): ``fp4_tile``; tiles cover the
      layout's ``n_norm`` padded rows (``KB`` blocks per row, ``n_kcols`` scale columns);
      ``aux_ptr``: the global scale, ``out_ptr``: packed codes (row stride ``o_st``),
      ``sf_ptr``: the scale bytes.
    * OP_GATED (``moefuse.norm.gated._gated_residual_next_kernel``): the gathered rows are the
      branch; ``res_ptr`` the FP32 residual (row stride ``r_st``), ``w_ptr`` / ``eps`` /
      ``gain_center`` the next norm's, ``out_ptr`` ffn_input, ``ro_ptr`` residual_out,
      ``rt_ptr`` the FP32 router output (HAS_ROUTER); stepped rows ``next_stepped``, one-pass
      tiles ``add_load`` + ``gated_next_tile``.

    ``ptrs``, ``counts``, ``dims``: as ``_ag_rmsnorm_kernel``'s."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    (H, Hf, KB, n_kcols, HEADS, x_st, x_sh, o_st, o_sh, eps, gain_center, r_st, ro_st, rt_st,
     alpha_scalar, post_eps, post_gc) = dims
    if OP == OP_GATED:
        if STEPPED:
            gd.next_stepped(x_ptr, res_ptr, w_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, out_ptr,
                             rt_ptr, t.to(tl.int64), H, Hf, x_st, r_st, ro_st, o_st, rt_st,
                             alpha_scalar, post_eps, eps, gain_center, post_gc, BLOCK, NUM_CHUNKS,
                             UNROLL, MASKED, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER, PTX,
                             False)  # fmt: skip
        else:
            cols = tl.arange(0, BLOCK)
            pm = cols < H
            nw = nt.ld(w_ptr + cols, pm, MASKED, False)[None, :] + gain_center
            pw = 1.0
            if HAS_POST_WEIGHT:
                pw = nt.ld(pw_ptr + cols, pm, MASKED, False)[None, :] + post_gc
            rows, mask = nt.tile_rows(t, cols, n_rows, H, ROWS)
            br, rr = nt.add_load(x_ptr, res_ptr, rows, cols, mask, x_st, r_st, MASKED,
                                  EVICT_FIRST)  # fmt: skip
            gd.gated_next_tile(br.to(tl.float32), rr.to(tl.float32), nw, pw, rows, cols, pm,
                                mask, alpha_ptr, beta_ptr, ro_ptr, out_ptr, rt_ptr, ro_st, o_st,
                                rt_st, alpha_scalar, Hf, post_eps, eps, ALPHA_MODE, MASKED,
                                HAS_POST_WEIGHT, HAS_ROUTER, PTX)  # fmt: skip
    elif OP == OP_FP8:
        cols = tl.arange(0, BLOCK)
        w = nt.ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        inv = tl.math.div_rn(1.0, tl.load(aux_ptr).to(tl.float32))
        rows, mask = nt.tile_rows(t, cols, n_rows, H, ROWS)
        xr, rr = qf.fp8_load(x_ptr, x_ptr, rows, cols, mask, HEADS, x_st, x_sh, 0, 0, MASKED,
                              EVICT_FIRST, False)  # fmt: skip
        qf.fp8_tile(qf.widen_h(xr, rr, False), w, inv, rows, cols, mask, x_ptr, out_ptr, HEADS,
                     0, 0, o_st, o_sh, Hf, eps, MASKED, False, FMT, PTX, False)  # fmt: skip
    elif OP == OP_FP4:
        cols = tl.arange(0, BLOCK)
        w = qf.ld32(w_ptr + cols, cols < H, MASKED, False, PTX)[None, :] + gain_center
        qf.fp4_tile(t, w, x_ptr, x_ptr, aux_ptr, out_ptr, sf_ptr, x_ptr, n_rows, n_norm, H, Hf,
                     KB, n_kcols, x_st, 0, o_st, 0, eps, BLOCK, ROWS, False, False, RECIPE,
                     LAYOUT, EVICT_FIRST, PTX, False, MASKED)  # fmt: skip
    elif STEPPED:
        nt.norm_stepped(x_ptr, x_ptr, w_ptr, out_ptr, nt.row_base(t, HEADS, x_st, x_sh), 0,
                         nt.row_base(t, HEADS, o_st, o_sh), H, Hf, eps, gain_center, x_ptr,
                         BLOCK, NUM_CHUNKS, UNROLL, MASKED, PTX, False, False, "evict_first",
                         nt.no_aux, nt.st_cast)  # fmt: skip
    else:
        cols = tl.arange(0, BLOCK)
        w = nt.ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        rows, mask = nt.tile_rows(t, cols, n_rows, H, ROWS)
        x, g = nt.rms_load(x_ptr, x_ptr, rows, cols, mask, HEADS, x_st, x_sh, 0, 0, MASKED,
                            EVICT_FIRST, False)  # fmt: skip
        nt.rms_tile(x.to(tl.float32), g.to(tl.float32), w, rows, cols, mask, out_ptr, HEADS,
                     o_st, o_sh, Hf, eps, MASKED, False, PTX)  # fmt: skip


def op_tile(op: int, width: int):
    """The single-GPU op's own tile for rows of ``width`` (its tile policy)."""
    if op == FP8:
        return qf.quant_row_tile(width)
    if op == FP4:
        return qf.quant_fp4_row_tile(width)
    if op == GATED:
        return row_tile(width, GATED_POLICY)
    return row_tile(width, RMSNORM_POLICY)


def _loop_min_rows(op: int, tile, width: int) -> int:
    """Row count from which the single-GPU op runs stepped rows looped."""
    if op == GATED:
        return tiles.STEP_LOOP_MIN_ROWS
    return qf.fp8_loop_min_rows(tile, width) if op == FP8 else tiles.RMSNORM_LOOP_MIN_ROWS


def fusable(op: int, tile) -> bool:
    """Whether ``norm_tile`` runs the single-GPU op's ``tile``: one-pass tiles, and the stepped
    rows of rmsnorm and the gated op; not the two-pass chunked rows (> 16384 columns). FP8
    one-pass tiles are persistent in the single-GPU kernel: its loop runs the same per-tile
    code (``fp8_tile``) with the same tile and warps, so the loop changes no bit; the other
    ops' policies never choose their persistent loops, which stay excluded."""
    if tile.stepped:
        return op in (RMSNORM, GATED)
    if tile.num_chunks > 1:
        return False
    return op == FP8 or not nt._persistent(tile)


#: NVFP4 rows wider than this run two launches at up to FP4_WIDE_TWO_LAUNCH_MAX_TOKENS tokens
#: unless MOEFUSE_ALLGATHER_ONE_LAUNCH is set. MEASURED (2 x H200, P = 2, `bench all-gather`,
#: bench/results/all-gather-h200-p2.json), µs one launch / two launches: H = 8192
#: M = 1 5.71 / 5.29, M = 8 6.40 / 6.11, M = 64 7.62 / 7.82; H = 4096 one launch wins at every
#: M (3.75 / 4.13 at M = 1). The NVFP4 tile is 4 warps wide, so one CTA gathers a whole
#: 8192-column row with 128 threads, where the gather kernel of two launches has its own tile.
FP4_ONE_LAUNCH_MAX_WIDTH = 4096
FP4_WIDE_TWO_LAUNCH_MAX_TOKENS = 8


def one_launch_tile(width: int, m: int, op: int = 0):
    """The single-GPU op's tile for this width when the one-launch variant can run it at M
    tokens (unless the environment turns it off, or the measured NVFP4 exception applies),
    else None."""
    setting = knobs.get(ONE_LAUNCH_ENV)
    if setting is False or m > ONE_LAUNCH_MAX_TOKENS:
        return None
    if (setting is None and op == FP4 and width > FP4_ONE_LAUNCH_MAX_WIDTH
            and m <= FP4_WIDE_TWO_LAUNCH_MAX_TOKENS):  # fmt: skip
        return None
    tile = op_tile(op, width)
    if not fusable(op, tile):
        return None
    if tile.stepped and not nt._unroll(tile, m, None, _loop_min_rows(op, tile, width)):
        return None
    return tile


def one_pass_in_registers(op: int, tile) -> bool:
    """Whether ``tile`` is a one-pass tile whose row code :func:`one_pass_tile` runs on rows
    in registers (rmsnorm, FP8, NVFP4; not stepped, not the two-pass chunked rows)."""
    return not tile.stepped and tile.num_chunks == 1 and op in (RMSNORM, FP8, FP4)


def decode_mode(op: int, tile) -> tuple[bool, bool]:
    """``(EARLY, FROM_SLOTS)`` of the decode kernel for ``op`` on ``tile``
    (:func:`norm_tile_early`): eligible are one-pass tiles of rmsnorm, FP8 and NVFP4 and the
    stepped rows of rmsnorm and the gated op (unrolled: :func:`one_launch_tile` never gives the
    decode kernel looped rows). ``MOEFUSE_ALLGATHER_DECODE`` = ``late`` | ``early`` | ``slots``
    (the same on every rank) forces a mode where eligible; unset, :data:`DECODE_DEFAULT` /
    :data:`DECODE_DEFAULT_STEPPED` decide per op."""
    setting = knobs.get(DECODE_ENV)
    eligible = op in (RMSNORM, GATED) if tile.stepped else one_pass_in_registers(op, tile)
    defaults = DECODE_DEFAULT_STEPPED if tile.stepped else DECODE_DEFAULT
    mode = (setting or defaults.get(op, "late")) if eligible else "late"
    return mode != "late", mode == "slots"


@dataclass(frozen=True)
class Epilogue:
    """The single-GPU op a one-launch all-gather ends with (``op``: RMSNORM, FP8, FP4, GATED), its
    outputs and parameters. ``out``: rmsnorm rows / FP8 bytes (uint8) / NVFP4 packed codes;
    ``aux``: the FP8 scale / NVFP4 global scale; ``scales``: the NVFP4 scale bytes (the layout's
    padded ``[rows, cols]``)."""

    op: int
    weight: torch.Tensor
    out: torch.Tensor
    eps: float
    gain_center: float
    aux: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    fmt: int = 0
    layout: str = "linear"
    recipe: str = "fast"
    #: the gated op (``out`` = ffn_input, ``weight`` / ``eps`` / ``gain_center`` the next norm's):
    #: its stream tensors and parameters
    gated: GatedArgs | None = None

    def rows_and_blocks(self, m: int, width: int) -> tuple[int, int, int]:
        """(rows the norm tiles cover, NVFP4 blocks per row, scale columns): the layout's padded
        rows for NVFP4 (tiles of padding rows write zero scale bytes), M otherwise."""
        if self.op != FP4:
            return m, 0, 0
        rows_p, n_kcols = scale_layout_shape(m, width // 16, self.layout)
        return rows_p, width // 16, n_kcols

    def pointers(self) -> tuple:
        """The kernels' pointer arguments from ``w_ptr`` to ``rt_ptr``; unused ones carry the
        weight."""
        w, g = self.weight, self.gated
        ops = (w, self.out, self.aux if self.aux is not None else w,
               self.scales if self.scales is not None else w)  # fmt: skip
        if g is None:
            return ops + (w,) * 6
        return ops + (g.residual, g.alpha if g.alpha is not None else g.beta, g.beta,
                      g.post_weight if g.post_weight is not None else w, g.residual_out,
                      g.router_input if g.router_input is not None else g.residual_out)

    def gated_scalars(self) -> tuple:
        """(r_st, ro_st, rt_st, alpha_scalar, post_eps, post_gc) of the kernels."""
        g = self.gated
        if g is None:
            return (0, 0, 0, 1.0, 0.0, 0.0)
        rt = g.router_input if g.router_input is not None else g.residual_out
        return (g.residual.stride(0), g.residual_out.stride(0), rt.stride(0),
                float(g.alpha_scalar), float(g.post_eps), float(g.post_gain_center))

    def consts(self, tile, width: int, m: int, use_pdl: bool) -> dict:
        """The single-GPU launcher's constexprs and warps for ``tile`` at M rows (without its
        persistent-loop fields) plus the op's own."""
        consts = nt._row_consts(tile, width, m, None, _loop_min_rows(self.op, tile, width),
                                use_pdl)  # fmt: skip
        for key in ("PERSISTENT", "PREFETCH", "maxnreg"):
            consts.pop(key, None)
        consts.update(OP=self.op, FMT=self.fmt, LAYOUT=LAYOUTS[self.layout],
                      RECIPE=RECIPES[self.recipe])  # fmt: skip
        if self.op in (FP8, FP4):
            consts["EVICT_FIRST"] = qf._evict(tile)
        g = self.gated
        if g is not None:
            consts.update(ALPHA_MODE=2 if g.alpha is not None else
                          (0 if g.alpha_scalar == 1.0 else 1),
                          HAS_POST_WEIGHT=g.post_weight is not None,
                          HAS_ROUTER=g.router_input is not None)  # fmt: skip
        return consts


@dataclass(frozen=True)
class GatedArgs:
    """The stream side of ``gated_residual_next_rmsnorm`` (see its launcher): residual [M, H]
    FP32, alpha [H] FP32 or None (then ``alpha_scalar``), beta [H], post weight or None,
    residual_out (may be residual), FP32 router output or None."""

    residual: torch.Tensor
    alpha: torch.Tensor | None
    alpha_scalar: float
    beta: torch.Tensor
    post_weight: torch.Tensor | None
    residual_out: torch.Tensor
    router_input: torch.Tensor | None
    post_eps: float
    post_gain_center: float


def launch_ag_rmsnorm(ws, state, shard: torch.Tensor, gathered: torch.Tensor, ep: Epilogue,
                      use_pdl: bool, tile) -> None:  # fmt: skip
    """Gather + the op of ``ep`` in one launch (``tile`` from :func:`one_launch_tile`)."""
    m, s = shard.shape
    width = gathered.shape[1]
    n_rows, x_st, x_sh = nt._row_strides(gathered)
    o_st = ep.out.stride(0)
    n_norm, kb, n_kcols = ep.rows_and_blocks(m, width)
    block_s, _ = AG.allgather_tile(s)
    consts = ep.consts(tile, width, n_rows, use_pdl)
    consts["EARLY"], consts["FROM_SLOTS"] = decode_mode(ep.op, tile)
    ws.refresh_clock()
    grid = (triton.cdiv(n_norm, tile.rows),)
    launch(_ag_rmsnorm_kernel, grid,
        shard, shard.stride(0), gathered, ep.pointers(), (n_rows, n_norm),
        (width, float(width), kb, n_kcols, 1, x_st, x_sh, o_st, 0, float(ep.eps),
         float(ep.gain_center), *ep.gated_scalars()),
        (ws.table, ws.offset16("allgather"), state.agctrl, ws.ctrl, ws.clock), s,
        ws.rank, ws.max_tokens, ws.timeout_us, P=ws.world_size, BLOCK_S=block_s, **consts,
    )  # fmt: skip
