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
single-GPU kernel on those rows (``norm_tiles.norm_tile``, constexpr ``OP``: ``_rmsnorm_kernel``'s,
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
rounds of the faster rank's median; notes/comm-all-gather.md has the figures), µs late -> slots:
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
from moefuse.comm.all_gather.norm_tiles import (
    FP4,
    FP8,
    GATED,
    RMSNORM,
    norm_tile,
    norm_tile_early,
    push_rows,
    receive_rows,
)
from moefuse.norm import tiles
from moefuse.norm import triton as nt
from moefuse.norm.tiles import GATED_POLICY, RMSNORM_POLICY, row_tile
from moefuse.quant import fused as qf
from moefuse.quant.formats import LAYOUTS, RECIPES, scale_layout_shape

ONE_LAUNCH_ENV = "MOEFUSE_ALLGATHER_ONE_LAUNCH"
#: largest M of the one-launch variant (programs = tiles <= 64: all resident on every rank)
ONE_LAUNCH_MAX_TOKENS = 64
#: the benchmark's op names (moefuse.bench.all_gather) -> the ops above
OP_CODES = {"rmsnorm": RMSNORM, "fp8": FP8, "fp4": FP4, "gated": GATED}
DECODE_ENV = "MOEFUSE_ALLGATHER_DECODE"
DECODE_MODES = knobs.KNOBS[DECODE_ENV].choices
#: the decode kernel's mode per op (see :func:`decode_mode` and the module docstring: measured
#: on one H200 as two loopback ranks)
DECODE_DEFAULT = {RMSNORM: "slots", FP8: "slots", FP4: "late", GATED: "late"}
#: the same for stepped rows (rmsnorm 6145-8192 columns, the gated op)
DECODE_DEFAULT_STEPPED = {RMSNORM: "late", GATED: "late"}


@triton.jit(do_not_specialize=["counts", "rank"])
def _ag_rmsnorm_kernel(
    shard_ptr,
    s_st,
    x_ptr,
    ptrs,
    counts,
    dims,
    ws,
    S,
    rank,
    cap,
    timeout_us,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PTX: tl.constexpr,
    USE_PDL: tl.constexpr,
    STEPPED: tl.constexpr,
    UNROLL: tl.constexpr,
    P: tl.constexpr,
    BLOCK_S: tl.constexpr,
    OP: tl.constexpr = 0,
    FMT: tl.constexpr = 0,
    LAYOUT: tl.constexpr = 0,
    RECIPE: tl.constexpr = 0,
    ALPHA_MODE: tl.constexpr = 0,
    HAS_POST_WEIGHT: tl.constexpr = False,
    HAS_ROUTER: tl.constexpr = False,
    EARLY: tl.constexpr = False,
    FROM_SLOTS: tl.constexpr = False,
):
    """Gather this program's rows, then run the op's row tile on them (module docstring).
    ``ptrs`` = (w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr,
    rt_ptr) (``Epilogue.pointers``); ``counts`` = (n_rows, n_norm) (not specialised); ``dims`` =
    (width, fp4_grid, addressing, norm, gate), the groups of
    :mod:`moefuse.comm.all_gather.norm_tiles` but ``addressing`` = (HEADS, x_st, x_sh, o_st,
    o_sh), which splits into the tile code's ``strides`` and ``heads``; ``ws`` = (table_ptr,
    ag_off16, agctrl_ptr, ctrl_ptr, clock_ptr). The tile code is
    :mod:`moefuse.comm.all_gather.norm_tiles`'s."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    # every group named here: offline compiles type its elements by these names (ptxas.tuple_fields)
    width, fp4_grid, addressing, norm, gate = dims
    H, Hf = width
    KB, n_kcols = fp4_grid
    HEADS, x_st, x_sh, o_st, o_sh = addressing
    eps, gain_center = norm
    r_st, ro_st, rt_st, alpha_scalar, post_eps, post_gc = gate
    table_ptr, ag_off16, agctrl_ptr, ctrl_ptr, clock_ptr = ws
    # the tile code's groups (norm_tiles)
    tile_dims = (width, fp4_grid, (x_st, o_st), (HEADS, x_sh, o_sh), norm, gate)
    TILE: tl.constexpr = (BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL)
    OPC: tl.constexpr = (OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER)
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    if USE_PDL:
        gdc_wait()
    # --- gather the rows of this program's tile into x_ptr (the gathered buffer), or with
    # FROM_SLOTS into every rank's slot of this rank (read back as a register tile below)
    deadline, gen, healthy, region, mine = AG.prelude(
        table_ptr, ag_off16, agctrl_ptr, ctrl_ptr, clock_ptr, rank, cap, timeout_us, P, PTX
    )
    scols = tl.arange(0, BLOCK_S)
    scm = scols < S
    first = pid * ROWS
    # (NVFP4 tiles of padding rows only, pid * ROWS >= n_rows, gather nothing)
    n_mine = tl.where(healthy, tl.maximum(tl.minimum(ROWS, n_rows - first), 0), 0)
    dst = (table_ptr, ag_off16, region, rank, S)
    push_rows(shard_ptr, s_st, x_ptr, x_st, first, n_mine, scols, scm, dst, H, P, FROM_SLOTS)
    if USE_PDL:
        # the next kernel may be scheduled now; its own gdc_wait orders its reads and writes
        # after this whole grid (so the residual / weights read below are safe)
        gdc_launch_dependents()
    empty = tl.zeros([BLOCK_S], tl.int16)
    gather = (scols, scm, empty, mine, region, rank, S, deadline, clock_ptr)
    if EARLY:
        # --- the op's parameters first, then its tile (from the slots, or the gathered rows)
        missing = norm_tile_early(
            pid, n_mine, first, gather, x_ptr, ptrs, counts, tile_dims, TILE, OPC, P, FROM_SLOTS
        )
    else:
        missing = receive_rows(x_ptr, x_st, first, n_mine, gather, H, P, PTX)
        # --- the single-GPU op's row tile (OP: rmsnorm, rmsnorm_quant, rmsnorm_fp4_quantize,
        # gated)
        norm_tile(pid, x_ptr, ptrs, counts, tile_dims, TILE, OPC)
    AG.finish(agctrl_ptr, ctrl_ptr, table_ptr, rank, gen, missing, pid, G, P, PTX)


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
    if (
        setting is None
        and op == FP4
        and width > FP4_ONE_LAUNCH_MAX_WIDTH
        and m <= FP4_WIDE_TWO_LAUNCH_MAX_TOKENS
    ):
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
        ops = (
            w,
            self.out,
            self.aux if self.aux is not None else w,
            self.scales if self.scales is not None else w,
        )
        if g is None:
            return ops + (w,) * 6
        return ops + (
            g.residual,
            g.alpha if g.alpha is not None else g.beta,
            g.beta,
            g.post_weight if g.post_weight is not None else w,
            g.residual_out,
            g.router_input if g.router_input is not None else g.residual_out,
        )

    def norm_scalars(self) -> tuple:
        """(eps, gain_center) of the kernels: the norm's (the gated op's next norm's)."""
        return (float(self.eps), float(self.gain_center))

    def gated_scalars(self) -> tuple:
        """(r_st, ro_st, rt_st, alpha_scalar, post_eps, post_gc) of the kernels."""
        g = self.gated
        if g is None:
            return (0, 0, 0, 1.0, 0.0, 0.0)
        rt = g.router_input if g.router_input is not None else g.residual_out
        return (
            g.residual.stride(0),
            g.residual_out.stride(0),
            rt.stride(0),
            float(g.alpha_scalar),
            float(g.post_eps),
            float(g.post_gain_center),
        )

    def consts(self, tile, width: int, m: int, use_pdl: bool) -> dict:
        """The single-GPU launcher's constexprs and warps for ``tile`` at M rows (without its
        persistent-loop fields) plus the op's own."""
        consts = nt._row_consts(tile, width, m, None, _loop_min_rows(self.op, tile, width), use_pdl)
        for key in ("PERSISTENT", "PREFETCH", "maxnreg"):
            consts.pop(key, None)
        consts.update(
            OP=self.op, FMT=self.fmt, LAYOUT=LAYOUTS[self.layout], RECIPE=RECIPES[self.recipe]
        )
        if self.op in (FP8, FP4):
            consts["EVICT_FIRST"] = qf._evict(tile)
        g = self.gated
        if g is not None:
            consts.update(
                ALPHA_MODE=2 if g.alpha is not None else (0 if g.alpha_scalar == 1.0 else 1),
                HAS_POST_WEIGHT=g.post_weight is not None,
                HAS_ROUTER=g.router_input is not None,
            )
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


def launch_ag_rmsnorm(
    ws, state, shard: torch.Tensor, gathered: torch.Tensor, ep: Epilogue, use_pdl: bool, tile
) -> None:
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
    launch(
        _ag_rmsnorm_kernel,
        grid,
        shard,
        shard.stride(0),
        gathered,
        ep.pointers(),
        (n_rows, n_norm),
        (
            (width, float(width)),
            (kb, n_kcols),
            (1, x_st, x_sh, o_st, 0),
            ep.norm_scalars(),
            ep.gated_scalars(),
        ),
        (ws.table, ws.offset16("allgather"), state.agctrl, ws.ctrl, ws.clock),
        s,
        ws.rank,
        ws.max_tokens,
        ws.timeout_us,
        P=ws.world_size,
        BLOCK_S=block_s,
        **consts,
    )
