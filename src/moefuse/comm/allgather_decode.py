"""One-launch decode kernel of the all-gather + norm ops (``all_gather_rmsnorm``, ``_fp8``,
``_fp4_quantize``, ``all_gather_gated_residual_next_rmsnorm``): the default at
M <= ONE_LAUNCH_MAX_TOKENS (``MOEFUSE_ALLGATHER_ONE_LAUNCH=0`` turns it off for every op, the
same on every rank). MEASURED for rmsnorm on 2 x H200 (bench allgather, 2026-11-30,
bench/results/allgather-h200-p2.json): one launch vs two at H = 4096: M = 1 3.39 / 3.97 us,
M = 8 4.30 / 5.10, M = 64 4.64 / 5.72; H = 8192: 4.04 / 4.49, 4.92 / 5.72, 6.54 / 7.22 — bitwise
equal to NCCL + rmsnorm in every case (the benchmark checks before it times). The FP8, NVFP4
and gated ops (issue 17e, session 9, same benchmark): one launch vs two at H = 4096, M = 1:
3.79 / 4.15, 3.75 / 4.13, 4.10 / 4.63 us, and faster at every M <= 64 except NVFP4 rows wider
than 4096 at M <= 8 (:data:`FP4_ONE_LAUNCH_MAX_WIDTH`).

The two-launch path is the gather, then the single-GPU op's kernel. At decode sizes the second
launch and its grid-dependency wait are a visible part of the latency, so this kernel does both
in one program per norm tile: program ``pid`` gathers the rows of its own tile (push its
fragments, poll the peers' ones, all through :mod:`moefuse.comm.allgather_triton`'s helpers), a
CTA barrier makes them visible to every thread, and then it runs the SAME device code as the
single-GPU kernel on those rows (``norm_tile``, constexpr ``OP``: ``_rmsnorm_kernel``'s,
``_rmsnorm_fp8_kernel``'s, ``_rmsnorm_fp4_kernel``'s or ``_gated_residual_next_kernel``'s row
functions) — same tile (the op's own tile policy, :func:`op_tile`), same constexprs, same
``num_warps``, rows re-read from the gathered buffer with the same addressing — so the
reduction tree, and the bits, are the single-GPU kernel's.

Eligible launches: one-shot, M <= :data:`ONE_LAUNCH_MAX_TOKENS` (one program per tile, all
co-resident: no cross-rank wait on an unscheduled program), tiles :func:`fusable` accepts
(stepped rows unrolled, or one-pass tiles; not the two-pass chunked rows). NVFP4: the programs
cover the scale layout's padded rows; those of padding rows only gather nothing and write zero
scale bytes, as the single-GPU kernel's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._fastpath import launch
from moefuse.comm import allgather_triton as AG
from moefuse.comm.workspace import CTRL_STATUS
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
OP_FP8: tl.constexpr = tl.constexpr(FP8)
OP_FP4: tl.constexpr = tl.constexpr(FP4)
OP_GATED: tl.constexpr = tl.constexpr(GATED)


@triton.jit(do_not_specialize=["n_rows", "n_norm", "rank"])
def _ag_rmsnorm_kernel(
    shard_ptr, s_st, x_ptr, w_ptr, out_ptr, aux_ptr, sf_ptr,
    res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr,
    n_rows, n_norm, H, Hf, KB, n_kcols, HEADS, x_st, x_sh, o_st, o_sh, eps, gain_center,
    r_st, ro_st, rt_st, alpha_scalar, post_eps, post_gc,
    table_ptr, ag_off16, agctrl_ptr, status_ptr, clock_ptr, S, rank, cap, timeout_us,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr,
    STEPPED: tl.constexpr, UNROLL: tl.constexpr,
    P: tl.constexpr, BLOCK_S: tl.constexpr,
    OP: tl.constexpr = 0, FMT: tl.constexpr = 0, LAYOUT: tl.constexpr = 0,
    RECIPE: tl.constexpr = 0, ALPHA_MODE: tl.constexpr = 0, HAS_POST_WEIGHT: tl.constexpr = False,
    HAS_ROUTER: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    if USE_PDL:
        gdc_wait()
    # --- gather the rows of this program's tile into x_ptr (the gathered buffer)
    deadline, gen, healthy, region, mine = AG.prelude(table_ptr, ag_off16, agctrl_ptr,
                                                      status_ptr, clock_ptr, rank, cap,
                                                      timeout_us, PTX)  # fmt: skip
    scols = tl.arange(0, BLOCK_S)
    scm = scols < S
    first = pid * ROWS
    # (NVFP4 tiles of padding rows only, pid * ROWS >= n_rows, gather nothing)
    n_mine = tl.where(healthy, tl.maximum(tl.minimum(ROWS, n_rows - first), 0), 0)
    push_rows(shard_ptr, s_st, x_ptr, x_st, first, n_mine, scols, scm, table_ptr, ag_off16,
              region, rank, S, H, P)  # fmt: skip
    if USE_PDL:
        # the next kernel may be scheduled now; its own gdc_wait orders its reads and writes
        # after this whole grid (so the residual / weights read below are safe)
        gdc_launch_dependents()
    empty = tl.zeros([BLOCK_S], tl.int16)
    missing = receive_rows(x_ptr, x_st, first, n_mine, scols, scm, mine, region, rank, S, H,
                           deadline, clock_ptr, empty, P, PTX)  # fmt: skip
    # --- the single-GPU op's row tile (OP: rmsnorm, rmsnorm_quant, rmsnorm_fp4_quantize, gated)
    norm_tile(pid, x_ptr, w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr,
              ro_ptr, rt_ptr, n_rows, n_norm, H, Hf, KB, n_kcols, HEADS, x_st, x_sh, o_st, o_sh,
              eps, gain_center, r_st, ro_st, rt_st, alpha_scalar, post_eps, post_gc, BLOCK,
              NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL, OP, FMT, LAYOUT, RECIPE,
              ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER)  # fmt: skip
    AG.finish(agctrl_ptr, status_ptr, gen, missing, pid, G)


@triton.jit
def push_rows(shard_ptr, s_st, x_ptr, x_st, first, n, scols, scm, table_ptr, ag_off16, region,
              rank, S, H, P: tl.constexpr):  # fmt: skip
    """Push rows ``first .. first + n - 1`` of this rank's shard (``AG.push_row``: every peer's
    slot, and this rank's gathered rows ``x_ptr``)."""
    j = 0
    while j < n:  # (while: the interpreter cannot range over a loaded value)
        AG.push_row(shard_ptr, s_st, x_ptr, x_st, first + j, scols, scm, table_ptr, ag_off16,
                    region, rank, rank * S, H, P)  # fmt: skip
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
def norm_tile(t, x_ptr, w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr,
              ro_ptr, rt_ptr, n_rows, n_norm, H, Hf, KB, n_kcols, HEADS, x_st, x_sh, o_st, o_sh,
              eps, gain_center, r_st, ro_st, rt_st, alpha_scalar, post_eps, post_gc,
              BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
              MASKED: tl.constexpr, EVICT_FIRST: tl.constexpr, PTX: tl.constexpr,
              STEPPED: tl.constexpr, UNROLL: tl.constexpr, OP: tl.constexpr, FMT: tl.constexpr,
              LAYOUT: tl.constexpr, RECIPE: tl.constexpr, ALPHA_MODE: tl.constexpr,
              HAS_POST_WEIGHT: tl.constexpr, HAS_ROUTER: tl.constexpr):  # fmt: skip
    """Row tile ``t`` of the single-GPU op ``OP`` (no PDL) on the gathered rows ``x_ptr``: that
    kernel's own row functions with its constexprs, so the same reduction tree and bits.

    * OP_RMSNORM (``moefuse.norm.triton._rmsnorm_kernel``, no gate): stepped rows (ROWS = 1)
      ``_norm_stepped`` unrolled or looped as ``UNROLL`` says; one-pass tiles ``_rms_load`` +
      ``_rms_tile``. ``out_ptr``: the output rows.
    * OP_FP8 (``moefuse.quant.fused._rmsnorm_fp8_kernel``, one-pass tiles, no residual): the tile
      of its row loop, ``_fp8_load`` + ``_widen_h`` + ``_fp8_tile`` (PACKED False, as its loop);
      ``aux_ptr``: the scale, ``out_ptr``: the FP8 bytes.
    * OP_FP4 (``_rmsnorm_fp4_kernel``, one tile per program): ``_fp4_tile``; tiles cover the
      layout's ``n_norm`` padded rows (``KB`` blocks per row, ``n_kcols`` scale columns);
      ``aux_ptr``: the global scale, ``out_ptr``: packed codes (row stride ``o_st``),
      ``sf_ptr``: the scale bytes.
    * OP_GATED (``moefuse.norm.gated._gated_residual_next_kernel``): the gathered rows are the
      branch; ``res_ptr`` the FP32 residual (row stride ``r_st``), ``w_ptr`` / ``eps`` /
      ``gain_center`` the next norm's, ``out_ptr`` ffn_input, ``ro_ptr`` residual_out,
      ``rt_ptr`` the FP32 router output (HAS_ROUTER); stepped rows ``_next_stepped``, one-pass
      tiles ``_add_load`` + ``_gated_next_tile``."""
    if OP == OP_GATED:
        if STEPPED:
            gd._next_stepped(x_ptr, res_ptr, w_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, out_ptr,
                             rt_ptr, t.to(tl.int64), H, Hf, x_st, r_st, ro_st, o_st, rt_st,
                             alpha_scalar, post_eps, eps, gain_center, post_gc, BLOCK, NUM_CHUNKS,
                             UNROLL, MASKED, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER, PTX,
                             False)  # fmt: skip
        else:
            cols = tl.arange(0, BLOCK)
            pm = cols < H
            nw = nt._ld(w_ptr + cols, pm, MASKED, False)[None, :] + gain_center
            pw = 1.0
            if HAS_POST_WEIGHT:
                pw = nt._ld(pw_ptr + cols, pm, MASKED, False)[None, :] + post_gc
            rows, mask = nt._tile_rows(t, cols, n_rows, H, ROWS)
            br, rr = nt._add_load(x_ptr, res_ptr, rows, cols, mask, x_st, r_st, MASKED,
                                  EVICT_FIRST)  # fmt: skip
            gd._gated_next_tile(br.to(tl.float32), rr.to(tl.float32), nw, pw, rows, cols, pm,
                                mask, alpha_ptr, beta_ptr, ro_ptr, out_ptr, rt_ptr, ro_st, o_st,
                                rt_st, alpha_scalar, Hf, post_eps, eps, ALPHA_MODE, MASKED,
                                HAS_POST_WEIGHT, HAS_ROUTER, PTX)  # fmt: skip
    elif OP == OP_FP8:
        cols = tl.arange(0, BLOCK)
        w = nt._ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        inv = tl.math.div_rn(1.0, tl.load(aux_ptr).to(tl.float32))
        rows, mask = nt._tile_rows(t, cols, n_rows, H, ROWS)
        xr, rr = qf._fp8_load(x_ptr, x_ptr, rows, cols, mask, HEADS, x_st, x_sh, 0, 0, MASKED,
                              EVICT_FIRST, False)  # fmt: skip
        qf._fp8_tile(qf._widen_h(xr, rr, False), w, inv, rows, cols, mask, x_ptr, out_ptr, HEADS,
                     0, 0, o_st, o_sh, Hf, eps, MASKED, False, FMT, PTX, False)  # fmt: skip
    elif OP == OP_FP4:
        cols = tl.arange(0, BLOCK)
        w = qf._ld32(w_ptr + cols, cols < H, MASKED, False, PTX)[None, :] + gain_center
        qf._fp4_tile(t, w, x_ptr, x_ptr, aux_ptr, out_ptr, sf_ptr, x_ptr, n_rows, n_norm, H, Hf,
                     KB, n_kcols, x_st, 0, o_st, 0, eps, BLOCK, ROWS, False, False, RECIPE,
                     LAYOUT, EVICT_FIRST, PTX, False, MASKED)  # fmt: skip
    elif STEPPED:
        nt._norm_stepped(x_ptr, x_ptr, w_ptr, out_ptr, nt._row_base(t, HEADS, x_st, x_sh), 0,
                         nt._row_base(t, HEADS, o_st, o_sh), H, Hf, eps, gain_center, x_ptr,
                         BLOCK, NUM_CHUNKS, UNROLL, MASKED, PTX, False, False, "evict_first",
                         nt._no_aux, nt._st_cast)  # fmt: skip
    else:
        cols = tl.arange(0, BLOCK)
        w = nt._ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
        rows, mask = nt._tile_rows(t, cols, n_rows, H, ROWS)
        x, g = nt._rms_load(x_ptr, x_ptr, rows, cols, mask, HEADS, x_st, x_sh, 0, 0, MASKED,
                            EVICT_FIRST, False)  # fmt: skip
        nt._rms_tile(x.to(tl.float32), g.to(tl.float32), w, rows, cols, mask, out_ptr, HEADS,
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
    code (``_fp8_tile``) with the same tile and warps, so the loop changes no bit; the other
    ops' policies never choose their persistent loops, which stay excluded."""
    if tile.stepped:
        return op in (RMSNORM, GATED)
    if tile.num_chunks > 1:
        return False
    return op == FP8 or not nt._persistent(tile)


#: NVFP4 rows wider than this run two launches at up to FP4_WIDE_TWO_LAUNCH_MAX_TOKENS tokens
#: unless MOEFUSE_ALLGATHER_ONE_LAUNCH is set. MEASURED (2 x H200, P = 2, `bench allgather`,
#: session 9, bench/results/allgather-h200-p2.json), µs one launch / two launches: H = 8192
#: M = 1 5.71 / 5.29, M = 8 6.40 / 6.11, M = 64 7.62 / 7.82; H = 4096 one launch wins at every
#: M (3.75 / 4.13 at M = 1). The NVFP4 tile is 4 warps wide, so one CTA gathers a whole
#: 8192-column row with 128 threads, where the gather kernel of two launches has its own tile.
FP4_ONE_LAUNCH_MAX_WIDTH = 4096
FP4_WIDE_TWO_LAUNCH_MAX_TOKENS = 8


def one_launch_tile(width: int, m: int, op: int = 0):
    """The single-GPU op's tile for this width when the one-launch variant can run it at M
    tokens (unless the environment turns it off, or the measured NVFP4 exception applies),
    else None."""
    setting = os.environ.get(ONE_LAUNCH_ENV)
    if setting in ("", "0") or m > ONE_LAUNCH_MAX_TOKENS:
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
    ws.refresh_clock()
    grid = (triton.cdiv(n_norm, tile.rows),)
    launch(_ag_rmsnorm_kernel, grid,
        shard, shard.stride(0), gathered, *ep.pointers(),
        n_rows, n_norm, width, float(width), kb, n_kcols, 1, x_st, x_sh, o_st, 0, float(ep.eps),
        float(ep.gain_center), *ep.gated_scalars(),
        ws.table, ws.offset16("allgather"), state.agctrl, ws.ctrl[CTRL_STATUS:], ws.clock, s,
        ws.rank, ws.max_tokens, ws.timeout_us, P=ws.world_size, BLOCK_S=block_s, **consts,
    )  # fmt: skip
