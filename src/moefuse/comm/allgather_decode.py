"""One-launch decode variant of :func:`moefuse.all_gather_rmsnorm`: the default at
M <= ONE_LAUNCH_MAX_TOKENS (``MOEFUSE_ALLGATHER_ONE_LAUNCH=0`` turns it off, the same on every
rank). MEASURED on 2 x H200 (bench allgather, 2026-11-30, bench/results/allgather-h200-p2.json):
one launch vs two at H = 4096: M = 1 3.39 / 3.97 us, M = 8 4.30 / 5.10, M = 64 4.64 / 5.72;
H = 8192: 4.04 / 4.49, 4.92 / 5.72, 6.54 / 7.22 — bitwise equal to NCCL + rmsnorm in every case
(the benchmark checks before it times).

The default fused path is two launches (gather, then ``moefuse.rmsnorm``'s kernel). At decode
sizes the second launch and its grid-dependency wait are a visible part of the latency, so this
kernel does both in one program per norm tile: program ``pid`` gathers the rows of its own
tile (push its fragments, poll the peers' ones, all through
:mod:`moefuse.comm.allgather_triton`'s helpers), a CTA barrier makes them visible to every
thread, and then it runs the SAME device code as ``moefuse.norm.triton._rmsnorm_kernel`` on
those rows — same tile (``row_tile(H, RMSNORM_POLICY)``), same constexprs, same ``num_warps``,
rows re-read from the gathered buffer with the same addressing — so the reduction tree, and the
bits, are the single-GPU kernel's. The GPU tests compare the two bitwise; only where they pass
should this become the default for small M.

Eligible launches: one-shot, M <= :data:`ONE_LAUNCH_MAX_TOKENS` (one program per tile, all
co-resident: no cross-rank wait on an unscheduled program), tiles the single-GPU kernel runs
straight-line (stepped rows unrolled, or one-pass tiles without the persistent loop).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._fastpath import launch
from moefuse.comm import allgather_triton as AG
from moefuse.comm.workspace import CTRL_STATUS
from moefuse.norm import tiles
from moefuse.norm import triton as nt
from moefuse.norm.tiles import RMSNORM_POLICY, row_tile

ONE_LAUNCH_ENV = "MOEFUSE_ALLGATHER_ONE_LAUNCH"
#: largest M of the one-launch variant (programs = tiles <= 64: all resident on every rank)
ONE_LAUNCH_MAX_TOKENS = 64


@triton.jit(do_not_specialize=["n_rows", "rank"])
def _ag_rmsnorm_kernel(
    shard_ptr, s_st, x_ptr, w_ptr, out_ptr,
    n_rows, H, Hf, HEADS, x_st, x_sh, o_st, o_sh, eps, gain_center,
    table_ptr, ag_off16, agctrl_ptr, status_ptr, clock_ptr, S, rank, cap, timeout_us,
    BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr, MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr, PTX: tl.constexpr, USE_PDL: tl.constexpr,
    STEPPED: tl.constexpr, UNROLL: tl.constexpr,
    P: tl.constexpr, BLOCK_S: tl.constexpr,
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
    n_mine = tl.where(healthy, tl.minimum(ROWS, n_rows - first), 0)
    push_rows(shard_ptr, s_st, x_ptr, x_st, first, n_mine, scols, scm, table_ptr, ag_off16,
              region, rank, S, H, P)  # fmt: skip
    if USE_PDL:
        gdc_launch_dependents()  # every input of this launch is read
    empty = tl.zeros([BLOCK_S], tl.int16)
    missing = receive_rows(x_ptr, x_st, first, n_mine, scols, scm, mine, region, rank, S, H,
                           deadline, clock_ptr, empty, P, PTX)  # fmt: skip
    # --- the single-GPU rmsnorm of the tile (moefuse.norm.triton._rmsnorm_kernel, no gate)
    norm_tile(pid, x_ptr, w_ptr, out_ptr, n_rows, H, Hf, HEADS, x_st, x_sh, o_st, o_sh, eps,
              gain_center, BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED,
              UNROLL)  # fmt: skip
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
def norm_tile(t, x_ptr, w_ptr, out_ptr, n_rows, H, Hf, HEADS, x_st, x_sh, o_st, o_sh, eps,
              gain_center, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, ROWS: tl.constexpr,
              MASKED: tl.constexpr, EVICT_FIRST: tl.constexpr, PTX: tl.constexpr,
              STEPPED: tl.constexpr, UNROLL: tl.constexpr):  # fmt: skip
    """Row tile ``t`` of ``moefuse.norm.triton._rmsnorm_kernel`` (no gate, no PDL) on the
    gathered rows ``x_ptr``: the single-GPU kernel's own row functions with its constexprs, so
    the same reduction tree. Stepped rows (ROWS = 1): ``_norm_stepped`` unrolled or looped as
    ``UNROLL`` says; one-pass tiles: ``_rms_load`` + ``_rms_tile``."""
    if STEPPED:
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


def one_launch_tile(width: int, m: int):
    """The single-GPU rmsnorm tile for this width when the one-launch variant can run it at M
    tokens (unless the environment turns it off), else None."""
    if os.environ.get(ONE_LAUNCH_ENV, "1") in ("", "0") or m > ONE_LAUNCH_MAX_TOKENS:
        return None
    tile = row_tile(width, RMSNORM_POLICY)
    if nt._persistent(tile) or (tile.num_chunks > 1 and not tile.stepped):
        return None
    if tile.stepped and not nt._unroll(tile, m, None, tiles.RMSNORM_LOOP_MIN_ROWS):
        return None
    return tile


def launch_ag_rmsnorm(ws, state, shard: torch.Tensor, weight: torch.Tensor, gathered, out,
                      eps: float, gain_center: float, use_pdl: bool, tile) -> None:  # fmt: skip
    """Gather + rmsnorm in one launch (``tile`` from :func:`one_launch_tile`)."""
    m, s = shard.shape
    width = gathered.shape[1]
    n_rows, x_st, x_sh = nt._row_strides(gathered)
    _, o_st, o_sh = nt._row_strides(out)
    block_s, _ = AG.allgather_tile(s)
    consts = nt._row_consts(tile, width, n_rows, None, tiles.RMSNORM_LOOP_MIN_ROWS, use_pdl)
    consts.pop("PERSISTENT")
    consts.pop("PREFETCH")
    consts.pop("maxnreg", None)
    ws.refresh_clock()
    grid = (triton.cdiv(n_rows, tile.rows),)
    launch(_ag_rmsnorm_kernel, grid,
        shard, shard.stride(0), gathered, weight, out,
        n_rows, width, float(width), 1, x_st, x_sh, o_st, o_sh, float(eps), float(gain_center),
        ws.table, ws.offset16("allgather"), state.agctrl, ws.ctrl[CTRL_STATUS:], ws.clock, s,
        ws.rank, ws.max_tokens, ws.timeout_us, P=ws.world_size, BLOCK_S=block_s, **consts,
    )  # fmt: skip
