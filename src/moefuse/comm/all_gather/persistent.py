"""Persistent one-launch all-gather + norm ops for M above the decode range (large M;
``all_gather_rmsnorm``, ``_fp8``, ``_fp4_quantize`` and the gated op: the
``OP`` constexpr of ``norm_tile``): NVLink pushes and the norm overlap inside one kernel.

MEASURED for every op (notes/comm-all-gather.md "Current measurements"): rmsnorm, FP8 and NVFP4
0.75-0.94 x the NVLink bound at M >= 4096, ahead of the chunk pipeline everywhere. The gated op's
first kernel (one 16-warp CTA per SM, rows gathered) lost to the chunk pipeline above 512 tokens on
2 x H200 (123.3 / 473.0 against 102.8 / 360.5 µs at H = 4096, M = 4096 / 16384). It now runs at two
CTAs per SM (H <= 4096) or with the residual and parameters requested before the poll (H > 4096):
0.70-0.71 and 0.77-0.80 of its old time in loopback (see :data:`PERSISTENT_DEFAULT`), which, applied
to the 2 x H200 figures, puts it 7-18 % ahead of the chunk pipeline at M = 4096 / 16384: a
PREDICTION, so it is now the default at every M for the gated op's stepped rows (> 2048 columns;
:data:`GATED_ONE_PASS_PERSISTENT_MAX_TOKENS` for the narrower ones) and ``bench all-gather`` times
``moefuse_chunked`` beside it (the next 2-GPU run confirms or reverts).

The chunked pipeline (gather chunk c+1 on a communication stream while chunk c is normed) left
the norm visible at large M. Here every CTA of one persistent grid does both, tile by tile:

* grid ``G`` = co-resident CTAs (the workspace's MIN-reduced SM count x CTAs per SM; identical on
  every rank), CTA ``pid`` owns the single-GPU op's row tiles ``pid, pid + G, ...`` (NVFP4:
  tiles over the scale layout's padded rows; those of padding rows only gather nothing and
  write zero scale bytes);
* prologue: push the fragments of its first ``lookahead`` tiles (``push_rows`` of
  :mod:`moefuse.comm.all_gather.decode`: Lamport stores into every peer's slot, own fragment into
  the local gathered rows);
* iteration i: push tile i + lookahead (one-row tiles: from registers loaded one iteration
  earlier, then load the next one), receive tile i (poll, re-arm, decode into the gathered
  rows, CTA barrier), then norm tile i with the single-GPU kernel's row functions and
  constexprs (``norm_tile``; stepped rows unrolled / looped exactly as the single-GPU op does
  at this M), so the output is bitwise the single-GPU op of the gathered rows;
* or, mode "slots" (``MOEFUSE_ALLGATHER_PERSISTENT``, default per op and width:
  :func:`persistent_mode`): every rank pushes into this rank's slot too, and iteration i polls
  tile i straight from the slot in the op's own tile (``AG.receive_tile``) and runs the op's
  one-pass row code on it in registers (``one_pass_tile``), with the parameters loaded once
  per CTA (NVFP4: per tile): no gathered store, CTA barrier or re-read; stepped rows (rmsnorm
  6145-8192 columns, the gated op) run the decode kernel's row code
  (``norm_tiles.norm_tile_early``: the steps polled from the slots, ``AG.receive_steps``);
* or, mode "early": the decode kernel's row code with the rows gathered: the op's parameters
  and the gated op's FP32 residual are requested before the poll, so their latency overlaps it.

No deadlock: CTA j of rank r only waits for tiles of its own list, which CTA j of every peer
pushes ``lookahead`` iterations (or the prologue) before it waits for anything of that tile or a
later one; by induction every awaited fragment is pushed by a CTA that is not itself blocked on
this CTA. This needs every CTA of the grid to be resident on every rank (the grid never
exceeds the co-resident count); in the interpreter, which runs CTAs one after another, CTA j of
every rank runs at the same time as CTA j of the peers. Waits are bounded as in the all-gather
kernel (prelude / poll / finish of :mod:`moefuse.comm.all_gather.kernels`): a CTA that gives up
stops, ORs the missing ranks into the status word, and later launches skip communication.

Knobs (read at launch; the same on every rank):

* ``MOEFUSE_ALLGATHER_LARGE`` = ``fused`` (default) | ``chunked`` (the old two-launch path, with
  its chunk pipeline from :data:`moefuse.comm.all_gather.ops.CHUNK_MIN_TOKENS` tokens); the
  persistent kernel runs above the decode range (M > 64), and at M <= 64 when the decode kernel
  cannot run only if the variable is set to ``fused`` explicitly (tests);
* ``MOEFUSE_ALLGATHER_LOOKAHEAD`` (default :data:`LOOKAHEAD`): tiles pushed ahead of the one
  being received (>= 1; a run-time argument, no recompilation);
* ``MOEFUSE_ALLGATHER_FUSED_CTAS_PER_SM`` (default: :data:`FUSED_CTAS_PER_SM` for the op, else
  ``resident_ctas_per_sm(num_warps)``, the conservative count of the other peer kernels),
  ``MOEFUSE_ALLGATHER_FUSED_MAXNREG`` (a register cap for experiments; 0 = none),
  ``MOEFUSE_ALLGATHER_FUSED_UNROLL`` (0 / 1: stepped rows looped / unrolled; default
  :func:`persistent_unroll`) and ``MOEFUSE_ALLGATHER_FUSED_GRID`` (a cap on
  the grid; tests use it to give each CTA several tiles). Either way the CTAs per SM are capped
  at what the compiled kernel's registers and shared memory allow (:func:`fits_per_sm`): a grid
  beyond the co-resident count could deadlock.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse import knobs
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active
from moefuse.comm.all_gather import decode as dec
from moefuse.comm.all_gather import kernels as AG
from moefuse.comm.all_gather.norm_tiles import (
    OP_FP4,
    norm_tile,
    norm_tile_early,
    one_pass_params,
    one_pass_tile,
    push_rows,
    receive_rows,
)
from moefuse.comm.tiles import resident_ctas_per_sm
from moefuse.norm import triton as nt
from moefuse.norm.tiles import STEP_UNROLL_MAX_STEPS

LARGE_ENV = "MOEFUSE_ALLGATHER_LARGE"
LARGE_MODES = knobs.KNOBS[LARGE_ENV].choices
LOOKAHEAD_ENV = "MOEFUSE_ALLGATHER_LOOKAHEAD"
CTAS_PER_SM_ENV = "MOEFUSE_ALLGATHER_FUSED_CTAS_PER_SM"
MAXNREG_ENV = "MOEFUSE_ALLGATHER_FUSED_MAXNREG"
GRID_ENV = "MOEFUSE_ALLGATHER_FUSED_GRID"
PERSISTENT_ENV = "MOEFUSE_ALLGATHER_PERSISTENT"
PERSISTENT_MODES = knobs.KNOBS[PERSISTENT_ENV].choices
#: the persistent kernel reads its tiles from the slots by default for these ops up to this
#: tile width (:func:`persistent_mode`). MEASURED on one H200 as two loopback ranks
#: (moefuse.tools.loopback_gpu_check, 2 alternating rounds, µs gathered -> slots at
#: M = 512 / 4096 / 16384): rmsnorm H = 4096 12.7 -> 10.1, 98.5 -> 74.1, 385.5 -> 279.6 (PDL
#: on), H = 2880 10.3 -> 10.6, 74.9 -> 70.2, 285.8 -> 264.5; FP8 (PDL off) H = 2880 11.9 ->
#: 11.3, 88.5 -> 83.4, 339.6 -> 316.0, H = 4096 12.5 -> 11.5, 92.5 -> 78.9, 355.7 -> 297.0,
#: but H = 7168 151.5 -> 161.3 and 590.9 -> 631.5 and H = 8192 160.1 -> 161.7 and 626.6 ->
#: 630.8 at M = 4096 / 16384 (its 8192-column tile keeps 32 weights per thread for the whole
#: loop: 128 registers against 109-113); NVFP4 (weights reloaded per tile) slower at H = 4096:
#: 72.9 -> 81.2, 276.9 -> 319.2. Stepped rows (rmsnorm 6145-8192) are not eligible. Loopback
#: ranks move the "NVLink" bytes through the same HBM, so these favour saved HBM traffic more
#: than 2 x H200 would: the 2-GPU bench (``moefuse_gathered`` / ``_slots`` columns) decides.
PERSISTENT_SLOTS_MAX_BLOCK = {dec.RMSNORM: 8192, dec.FP8: 4096}
#: the persistent kernel's mode for stepped rows (rmsnorm 6145-8192 columns, the gated op;
#: :func:`persistent_mode`). MEASURED on one H200 as two loopback ranks (PDL off,
#: 2 alternating rounds, notes/comm-all-gather.md "The gated op's persistent kernel"), µs
#: gathered / early / slots:
#: rmsnorm H = 8192 M = 4096 170.4 / 167.1 / 163.4, M = 16384 662.0 / 650.1 / 630.2; the gated
#: op (tensor alpha) at H = 8192, M = 512 / 4096 / 16384: gathered at 1 CTA per SM 53.5 / 399 /
#: 1607, at 2 CTAs per SM (looped rows) 42.5 / 343.6 / 1390, early (unrolled rows, 1 CTA per
#: SM: 116-128 registers) 43.5 / 318 / 1242; at H = 4096 gathered at 2 CTAs per SM wins: 23.0 /
#: 162.7 / 656 against early 27.4 / 193 / 749 (and 32.4 / 234 / 921 at 1 CTA per SM). Capping
#: early at 64 registers to fit 2 CTAs spilled (80 / 244 bytes): 26.3 / 187 / 745 at H = 4096,
#: 2.3 x slower at 8192. So the gated op runs early from GATED_EARLY_MIN_STEPS steps. Mid M
#: (call 3), µs default / unrolled at 1 CTA per SM / early / slots: H = 4096 M = 128 7.73 /
#: 7.84 / 7.98 / 7.40, M = 300 15.07 / 14.94 / 15.24 / 14.57, M = 512 23.08 / 28.06 / 27.2 /
#: 25.9 (the old kernel 8.86 / 18.0 / 32.6); H = 7168 (early) M = 128 / 300 / 512 / 4096 10.28 /
#: 24.98 / 39.97 / 290 against gathered at 2 CTAs per SM 12.5 / 32.4 / 51.7 / 375 and slots
#: 11.1 / 25.1 / 39.9 / 295; H = 8192 early 11.1 / 28.3 / 44.4 / 322, slots 11.05 / 27.2 /
#: 43.2 / 335 (slots' 0.3-1 µs at M <= 512 is not worth a second rule).
PERSISTENT_DEFAULT = {dec.RMSNORM: "slots", dec.GATED: "gathered"}
GATED_EARLY_MIN_STEPS = 3
#: CTAs per SM of the persistent kernel per op on stepped rows (default, and on one-pass
#: tiles: ``resident_ctas_per_sm``), capped by what the compiled kernel fits
#: (:func:`fits_per_sm`): the gated op's gathered rows, looped (64 registers at 16 warps), run 2
#: per SM (measurements above)
FUSED_CTAS_PER_SM = {dec.GATED: 2}
UNROLL_ENV = "MOEFUSE_ALLGATHER_FUSED_UNROLL"
#: tiles pushed ahead of the tile being received. MEASURED on 2 x H200
#: (90f68c0:scripts/bench_allgather_large.py, bench/results/sweeps/allgather_large-h200-p2.json):
#: lookahead 1 was as fast or faster than 2 in 6 of 6 cases (H = 4096 M = 4096: 58.8 vs
#: 61.7 us; H = 8192 M = 4096: 102.9 vs 106.8), 4 the slowest everywhere: one tile ahead per
#: CTA already keeps ~1 MiB in flight
LOOKAHEAD = 1


@triton.jit(do_not_specialize=["counts", "rank", "lookahead"])
def _ag_rmsnorm_persistent_kernel(
    shard_ptr, s_st, x_ptr, ptrs, counts, dims, ws, S, rank, cap, timeout_us, lookahead,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr,
    STEPPED: tl.constexpr, UNROLL: tl.constexpr,
    P: tl.constexpr, BLOCK_S: tl.constexpr,
    OP: tl.constexpr = 0, FMT: tl.constexpr = 0, LAYOUT: tl.constexpr = 0,
    RECIPE: tl.constexpr = 0, ALPHA_MODE: tl.constexpr = 0, HAS_POST_WEIGHT: tl.constexpr = False,
    HAS_ROUTER: tl.constexpr = False, FROM_SLOTS: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):  # fmt: skip
    """``ptrs``, ``counts``, ``ws`` as ``dec._ag_rmsnorm_kernel``'s; ``dims`` = (width,
    fp4_grid, strides, norm, gate) as :mod:`moefuse.comm.all_gather.norm_tiles` describes them
    (one head, no head strides). The tile code is :mod:`moefuse.comm.all_gather.norm_tiles`'s."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    # every group named here: offline compiles type its elements by these names (ptxas.tuple_fields)
    width, fp4_grid, strides, norm, gate = dims
    H, Hf = width
    KB, n_kcols = fp4_grid
    x_st, o_st = strides
    eps, gain_center = norm
    r_st, ro_st, rt_st, alpha_scalar, post_eps, post_gc = gate
    table_ptr, ag_off16, agctrl_ptr, ctrl_ptr, clock_ptr = ws
    # the tile code's groups (norm_tiles): HEADS 1 and head strides 0 as constants
    tile_dims = (width, fp4_grid, strides, (1, 0, 0), norm, gate)
    TILE: tl.constexpr = (BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL)
    OPC: tl.constexpr = (OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    # one-pass FROM_SLOTS (not EARLY): the parameters once per CTA, constant over the launch
    # (bound outside any constexpr `if`: a name bound inside one is not seen in the loop below);
    # NVFP4 reloads them per tile instead (its 4-warp tile would hold 32-64 weights per thread)
    IN_LOOP: tl.constexpr = FROM_SLOTS and not EARLY
    cols = tl.arange(0, BLOCK)
    LOAD: tl.constexpr = IN_LOOP and OP != OP_FP4
    w, inv = one_pass_params(w_ptr, aux_ptr, cols, H, gain_center, BLOCK, MASKED, PTX, OP, LOAD)
    if USE_PDL:
        gdc_wait()  # the shard is the previous kernel's output
    deadline, gen, healthy, region, mine = AG.prelude(
        table_ptr, ag_off16, agctrl_ptr, ctrl_ptr, clock_ptr, rank, cap, timeout_us, P, PTX
    )
    scols = tl.arange(0, BLOCK_S)
    scm = scols < S
    src = (shard_ptr, s_st, x_ptr, x_st)
    dst = (table_ptr, ag_off16, region, rank, S)
    # norm tiles cover n_norm rows (NVFP4: the layout's padded rows, whose tiles only write zero
    # scale bytes); the gathered ones are the first cdiv(n_rows, ROWS): this CTA's first n_gat
    n_mine = tl.where(healthy, (tl.cdiv(n_norm, ROWS) - pid + G - 1) // G, 0)
    n_gat = tl.minimum(n_mine, (tl.cdiv(n_rows, ROWS) - pid + G - 1) // G)
    k = 0
    while k < tl.minimum(lookahead, n_gat):  # prologue: the first `lookahead` tiles' fragments
        _push_tile(src, pid + k * G, n_rows, scols, scm, dst, H, ROWS, P, FROM_SLOTS)
        k += 1
    if USE_PDL:
        # every CTA is resident (grid <= co-resident count): the next kernel may be scheduled
        # into the space left; its own gdc_wait orders it after this whole grid
        gdc_launch_dependents()
    empty = tl.zeros([BLOCK_S], tl.int16)
    gather = (scols, scm, empty, mine, region, rank, S, deadline, clock_ptr)
    # one-row tiles: the shard fragment of the next tile to push is loaded one iteration early,
    # so its HBM latency overlaps the poll and the norm instead of delaying them
    x_nx = _prefetch(shard_ptr, s_st, pid + lookahead * G, lookahead < n_gat, scols, scm, ROWS)
    missing = 0
    i = 0
    while (i < n_mine) & (missing == 0):
        if i + lookahead < n_gat:
            t_push = pid + (i + lookahead) * G
            if ROWS == 1:
                _store_fragment(x_nx, x_ptr, x_st, t_push, scols, scm, dst, H, P, FROM_SLOTS)
                x_nx = _prefetch(
                    shard_ptr, s_st, t_push + G, i + lookahead + 1 < n_gat, scols, scm, ROWS
                )
            else:
                _push_tile(src, t_push, n_rows, scols, scm, dst, H, ROWS, P, FROM_SLOTS)
        t = pid + i * G
        first = t * ROWS
        if EARLY:  # the decode kernel's tile code: parameters (and residual) before the poll
            n_t = tl.where(i < n_gat, tl.minimum(ROWS, n_rows - first), 0)
            missing = norm_tile_early(
                t, n_t, first, gather, x_ptr, ptrs, counts, tile_dims, TILE, OPC, P, FROM_SLOTS
            )
        elif FROM_SLOTS:  # the tile polled straight from the slots (decode "slots" mode)
            missing = _slots_tile(
                t, i, n_gat, w, inv, cols, gather, x_ptr, ptrs, counts, tile_dims, TILE, OPC, P
            )
        else:
            if i < n_gat:
                n_t = tl.minimum(ROWS, n_rows - first)
                missing = receive_rows(x_ptr, x_st, first, n_t, gather, H, P, PTX)
            norm_tile(t, x_ptr, ptrs, counts, tile_dims, TILE, OPC)
        i += 1
    AG.finish(agctrl_ptr, ctrl_ptr, table_ptr, rank, gen, missing, pid, G, P, PTX)


@triton.jit
def _slots_tile(
    t, i, n_gat, w, inv, cols, gather, x_ptr, ptrs, counts, dims, TILE, OPC, P: tl.constexpr
):
    """One-pass tile ``t`` (the CTA's ``i``-th; gathered when ``i < n_gat``) polled straight
    from the slots (``AG.receive_tile``) and normed in registers (``one_pass_tile``) with the
    CTA's parameters ``w`` / ``inv`` (NVFP4: reloaded per tile); ``dims`` as ``norm_tile``'s.
    Returns the bit mask of late peers."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    width, _fp4_grid, _strides, _heads, norm, _gate = dims
    H, _Hf = width
    _eps, gain_center = norm
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER = OPC
    scols, scm, empty, mine, region, rank, S, deadline, clock_ptr = gather
    rows, mask = nt.tile_rows(t, cols, n_rows, H, ROWS)
    wt, invt = one_pass_params(
        w_ptr, aux_ptr, cols, H, gain_center, BLOCK, MASKED, PTX, OP, OP == OP_FP4
    )
    x, missing = AG.receive_tile(
        mine,
        region,
        rows,
        cols,
        mask,
        i < n_gat,
        S,
        H,
        deadline,
        clock_ptr,
        x_ptr.dtype.element_ty,
        MASKED,
        P,
        PTX,
    )
    if OP != OP_FP4:
        wt, invt = w, inv
    one_pass_tile(x, wt, invt, t, rows, cols, mask, x_ptr, ptrs, counts, dims, TILE, OPC)
    return missing


@triton.jit
def _prefetch(shard_ptr, s_st, t, valid, scols, scm, ROWS: tl.constexpr):
    """Shard fragment of one-row tile ``t`` when ``valid`` (else nothing is read); a dummy for
    tiles of several rows (pushed row by row by :func:`_push_tile`)."""
    if ROWS == 1:
        return AG.load_fragment(shard_ptr, s_st, t, scols, scm & valid)
    else:
        return tl.zeros([1], tl.float32)


@triton.jit
def _store_fragment(x, x_ptr, x_st, t, scols, scm, dst, H, P: tl.constexpr, OWN_SLOT: tl.constexpr):
    """``AG.store_fragment`` of one-row tile ``t``'s prefetched fragment ``x`` (``dst`` as
    :func:`norm_tiles.push_rows`'s)."""
    table_ptr, ag_off16, region, rank, S = dst
    AG.store_fragment(
        x, x_ptr, x_st, t, scols, scm, table_ptr, ag_off16, region, rank, rank * S, H, P, OWN_SLOT
    )


@triton.jit
def _push_tile(
    src,
    t,
    n_rows,
    scols,
    scm,
    dst,
    H,
    ROWS: tl.constexpr,
    P: tl.constexpr,
    OWN_SLOT: tl.constexpr = False,
):
    """Push this rank's fragments of the rows of norm tile ``t`` (clipped to ``n_rows``); ``src``
    = (shard_ptr, s_st, x_ptr, x_st), ``dst`` as :func:`norm_tiles.push_rows`'s."""
    shard_ptr, s_st, x_ptr, x_st = src
    first = t * ROWS
    n = tl.minimum(ROWS, n_rows - first)
    push_rows(shard_ptr, s_st, x_ptr, x_st, first, n, scols, scm, dst, H, P, OWN_SLOT)


# ----------------------------------------------------------------------------- host side
def large_mode() -> str:
    """``MOEFUSE_ALLGATHER_LARGE``: "fused" (default) or "chunked"; ValueError otherwise."""
    return knobs.get(LARGE_ENV) or "fused"


def fused_tile(width: int, m: int | None = None, op: int = dec.RMSNORM):
    """The single-GPU op's tile for rows of ``width`` when the persistent kernel runs it at
    ``m`` tokens, else None: mode "fused", M above the decode range (at M <= 64 only when
    MOEFUSE_ALLGATHER_LARGE=fused is set explicitly: ``MOEFUSE_ALLGATHER_ONE_LAUNCH=0`` alone
    still means two launches there), and a tile ``norm_tile`` can run (:func:`dec.fusable`:
    not the two-pass chunked rows; the gated op's one-pass tiles only up to
    :data:`GATED_ONE_PASS_PERSISTENT_MAX_TOKENS` unless the variable is set)."""
    if large_mode() != "fused":
        return None
    if m is not None and m <= dec.ONE_LAUNCH_MAX_TOKENS and not knobs.is_set(LARGE_ENV):
        return None
    tile = dec.op_tile(op, width)
    if (
        op == dec.GATED
        and not tile.stepped
        and m is not None
        and m > GATED_ONE_PASS_PERSISTENT_MAX_TOKENS
        and not knobs.is_set(LARGE_ENV)
    ):
        return None
    return tile if dec.fusable(op, tile) else None


#: the gated op's one-pass tiles (rows up to 2048 columns) keep the chunk pipeline above this
#: many tokens, as every gated width once did (its persistent kernel was measured
#: only on stepped rows: module docstring)
GATED_ONE_PASS_PERSISTENT_MAX_TOKENS = 512


def persistent_mode(op: int, tile) -> tuple[bool, bool]:
    """``(EARLY, FROM_SLOTS)`` of the persistent kernel for ``op`` on ``tile``;
    ``MOEFUSE_ALLGATHER_PERSISTENT`` = ``gathered`` | ``early`` | ``slots`` forces one where
    eligible (the same on every rank), else :data:`PERSISTENT_DEFAULT` /
    :data:`PERSISTENT_SLOTS_MAX_BLOCK` decide.

    * one-pass tiles of rmsnorm, FP8 and NVFP4: ``slots`` polls each tile straight from the
      slots with the parameters loaded once per CTA (NVFP4: per tile; held for the whole loop,
      its 4-warp tiles' 32-64 weights per thread took 146 registers at H = 4096 on sm_90a, 3
      CTAs per SM instead of 4, and spilled at 7168 / 8192); ``early`` runs the decode kernel's
      tile code (:func:`norm_tile_early`: parameters per tile, rows gathered);
    * stepped rows of rmsnorm and the gated op that can be unrolled (at most
      ``STEP_UNROLL_MAX_STEPS`` steps): ``early`` / ``slots`` run
      :func:`norm_tile_early` per row: the parameters and the gated op's FP32 residual
      requested before the poll, the row from the gathered buffer or straight from the slots.
      The unrolled row code gives the bits of the looped one (the tests compare with the
      single-GPU op, which loops at these M);
    * anything else: ``gathered``."""
    setting = knobs.get(PERSISTENT_ENV)
    if dec.one_pass_in_registers(op, tile):
        mode = setting or (
            "slots" if tile.block <= PERSISTENT_SLOTS_MAX_BLOCK.get(op, 0) else "gathered"
        )
        return mode == "early", mode == "slots"
    if tile.stepped and op in (dec.RMSNORM, dec.GATED) and tile.num_chunks <= STEP_UNROLL_MAX_STEPS:
        mode = setting or PERSISTENT_DEFAULT.get(op, "gathered")
        if not setting and op == dec.GATED and tile.num_chunks >= GATED_EARLY_MIN_STEPS:
            mode = "early"
        return mode != "gathered", mode == "slots"
    return False, False


def fits_per_sm(regs: int, warps: int, shared: int = 0, smem_per_sm: int = 228 << 10) -> int:
    """CTAs of ``warps`` warps at ``regs`` registers per thread and ``shared`` bytes of shared
    memory that fit one sm_90 SM (64K registers allocated per warp in units of 256, 64 warps,
    228 KiB of shared memory with 1 KiB reserved per CTA)."""
    per_warp = -(-max(1, regs) * 32 // 256) * 256
    by_smem = smem_per_sm // (shared + 1024)
    return max(1, min(65536 // (per_warp * warps), 64 // warps, by_smem))


_FITS: dict[tuple, int] = {}


def _compiled_fit(args, consts) -> int:
    """CTAs per SM of the compiled persistent kernel for these arguments (compiles it if
    needed; the GPU only), cached per device, constexprs and 16-divisibility of the arguments
    (what selects the compiled variant)."""
    dev = torch.cuda.current_device()
    spec = _divisibility(args)
    key = (dev, spec, tuple(sorted(consts.items())))
    fit = _FITS.get(key)
    if fit is None:
        ck = _ag_rmsnorm_persistent_kernel.warmup(*args, grid=(1,), **consts)
        ck._init_handles()
        fit = _FITS[key] = fits_per_sm(ck.n_regs, consts["num_warps"], ck.metadata.shared)
    return fit


def _divisibility(args) -> tuple:
    """Per argument (tuples walked): 16-byte alignment of a tensor, divisibility by 16 of an
    int, None otherwise; what, with the constexprs, selects the compiled variant."""
    return tuple(
        _divisibility(a)
        if isinstance(a, tuple)
        else a.data_ptr() % 16 == 0
        if isinstance(a, torch.Tensor)
        else (a % 16 == 0 if isinstance(a, int) else None)
        for a in args
    )


def persistent_unroll(op: int, tile, unroll: bool) -> bool:
    """UNROLL of the persistent kernel's gathered stepped rows: the gated op's rows loop (64
    registers, 2 CTAs per SM, against 116-128 unrolled: 1) whatever the single-GPU op's choice
    ``unroll`` at this M (the same bits); ``MOEFUSE_ALLGATHER_FUSED_UNROLL`` = 0 / 1 forces it
    (where the rows can be unrolled)."""
    forced = knobs.get(UNROLL_ENV)
    if not tile.stepped:
        return unroll
    if forced is not None:
        return forced and tile.num_chunks <= STEP_UNROLL_MAX_STEPS
    return False if op == dec.GATED else unroll


def fused_grid(ws, tile, n_tiles: int, fit=None, op: int = dec.RMSNORM) -> int:
    """CTAs of the persistent launch: min(row tiles, SMs x CTAs per SM [, the grid cap]). A
    function of the workspace (MIN-reduced SM count), the width, M and the compiled kernel: the
    same on every rank. ``fit()``: CTAs per SM the compiled kernel's registers and shared memory
    allow (a grid beyond the co-resident count could deadlock; H = 16384 needs 216 registers
    at 8 warps: 1 CTA per SM, not the default 2)."""
    default = FUSED_CTAS_PER_SM.get(op) if tile.stepped else None
    per_sm = knobs.get(CTAS_PER_SM_ENV) or default or resident_ctas_per_sm(tile.num_warps)
    if fit is not None:
        per_sm = min(per_sm, fit())
    ctas = min(n_tiles, ws.num_sms * per_sm)
    cap = knobs.get(GRID_ENV)
    return max(1, min(ctas, cap) if cap else ctas)


def launch_ag_rmsnorm_persistent(
    ws, state, shard: torch.Tensor, gathered: torch.Tensor, ep: dec.Epilogue, use_pdl: bool, tile
) -> None:
    """Gather + the op of ``ep`` over M rows in one persistent launch (``tile`` from
    :func:`fused_tile`). ``gathered`` [M, H] rows contiguous; collective (same M on every
    rank)."""
    m, s = shard.shape
    width = gathered.shape[1]
    block_s, _ = AG.allgather_tile(s)
    lookahead = knobs.get(LOOKAHEAD_ENV) or LOOKAHEAD
    n_norm, kb, n_kcols = ep.rows_and_blocks(m, width)
    consts = ep.consts(tile, width, m, use_pdl)
    consts["EARLY"], consts["FROM_SLOTS"] = persistent_mode(ep.op, tile)
    consts["UNROLL"] = persistent_unroll(ep.op, tile, consts["UNROLL"])
    ws.refresh_clock()
    args = (
        shard,
        shard.stride(0),
        gathered,
        ep.pointers(),
        (m, n_norm),
        (
            (width, float(width)),
            (kb, n_kcols),
            (gathered.stride(0), ep.out.stride(0)),
            ep.norm_scalars(),
            ep.gated_scalars(),
        ),
        (ws.table, ws.offset16("allgather"), state.agctrl, ws.ctrl, ws.clock),
        s,
        ws.rank,
        ws.max_tokens,
        ws.timeout_us,
        lookahead,
    )
    consts.update(P=ws.world_size, BLOCK_S=block_s)
    maxnreg = knobs.get(MAXNREG_ENV)
    if maxnreg and not interpreter_active():
        consts["maxnreg"] = maxnreg
    fit = None if interpreter_active() else (lambda: _compiled_fit(args, consts))
    grid = (fused_grid(ws, tile, triton.cdiv(n_norm, tile.rows), fit, ep.op),)
    if consts["EARLY"] or ep.op == dec.GATED:  # rows unrolled (EARLY) / looped whatever M
        launch(_ag_rmsnorm_persistent_kernel, grid, *args, **consts)
    else:  # (nt._launch: a launch that compiles stepped rows also compiles the other UNROLL mode)
        nt._launch(_ag_rmsnorm_persistent_kernel, grid, args, consts, tile)


def run_one_launch(
    ws,
    state,
    shard: torch.Tensor,
    gathered: torch.Tensor,
    ep: dec.Epilogue,
    use_pdl: bool,
    unchunked: bool,
) -> bool:
    """Gather + the op of ``ep`` as one kernel when one can run it (else False: the caller
    runs the two-launch path): the decode kernel at M <= 64 (``unchunked``: the two-launch path
    would run one chunk), the persistent kernel above it unless MOEFUSE_ALLGATHER_LARGE=chunked.
    The choice is a function of M, H, the op and the environment: the same on every rank."""
    m, width = gathered.shape
    tile = dec.one_launch_tile(width, m, ep.op) if unchunked else None
    if tile is not None:
        dec.launch_ag_rmsnorm(ws, state, shard, gathered, ep, use_pdl, tile)
        return True
    tile = fused_tile(width, m, ep.op)
    if tile is None:
        return False
    launch_ag_rmsnorm_persistent(ws, state, shard, gathered, ep, use_pdl, tile)
    return True
