"""The one-pass row modes of the norm kernels (rmsnorm, rmsnorm_sigmoid_gate, fused_add_rmsnorm,
gated_residual_rmsnorm and gated_residual_next_rmsnorm) and of the fused RMSNorm + FP8 kernel
(:mod:`moefuse.quant.fused_fp8`): one ``[ROWS, BLOCK]`` row tile per program, or the persistent
row loop, around each kernel's own tile.

A kernel hands :func:`one_pass_rows` three device functions as constexprs:

* ``LOAD(load_args, rows, cols, mask, MASKED, STREAM)`` issues a tile's two activation loads and
  returns them in the stored dtypes (:func:`add_pair`: input + residual, or branch + stream;
  rmsnorm: x and its gate);
* ``COMBINE(a, b)`` is what the tile needs of them before ``gdc_launch_dependents``
  (:func:`keep_pair`: nothing, the tile widens them itself; :func:`widen_pair`: both widened to
  FP32; fused_add_rmsnorm: their FP32 sum);
* ``TILE(v, rows, cols, mask, tile_args)`` does the tile's arithmetic and stores from
  ``v = COMBINE(a, b)``; ``tile_args`` is a tuple of its other arguments.

Both modes call the same functions, so a row's arithmetic is one piece of code; the loop only
chooses which program computes a row. Where COMBINE runs (before or after
``gdc_launch_dependents``; with PREFETCH, before or after the next tile's loads are issued:
``COMBINE_FIRST``) is part of the compiled code (the PTX keeps the order of the source), so
each kernel chooses it: rmsnorm widens in the loop only, a prefetched tile first; fused_add sums
before ``gdc_launch_dependents``; the gated ops widen in their tile.

The extra arguments reach a hook as tuples built in the call and are read by index
(``X: tl.constexpr = args[i]`` for a constexpr): Triton's assignment turns every constexpr it
assigns, a tuple's elements and an integer the launch specialised to 1 included, into a tensor,
so a tuple assigned to a name or unpacked loses them.

Persistent row loop (one-pass tiles, NUM_CHUNKS == 1): program ``pid`` of ``nprog`` computes the
row tiles t = pid, pid + nprog, ... < n_tiles (grid = n_tiles makes it one tile per program).
With PREFETCH, the activation loads of tile t + nprog are issued (raw dtype, row-masked) before
tile t is reduced and stored, so a program has two rows' loads in flight. In-place ops
(fused_add's residual, the sigmoid gate's input, gated ``out is residual``) stay safe: tile
t + nprog belongs to this program alone and is read before it is written.

PDL: the kernel loads its parameters before calling :func:`one_pass_rows`, which waits
(``gdc_wait``) before the first activation load (a kernel with a parameter that the previous
kernel may write, the FP8 scale, waits and loads it itself and passes ``WAITED``);
``gdc_launch_dependents`` follows the loads (and COMBINE) of the program's last tile.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse.norm.triton import _pf_mask, add_load, rms_load, tile_rows


@triton.jit
def add_pair(load_args, rows, cols, mask, MASKED: tl.constexpr, STREAM: tl.constexpr):
    """``LOAD`` hook of two [M, H] activations of one row block: :func:`add_load` with
    ``load_args`` = (a_ptr, b_ptr, a_st, b_st); (a tile, b tile) in the stored dtypes. The
    elements are passed on by index: an unpacking assignment would turn a stride that the launch
    specialised to a constant into a tensor."""
    return add_load(
        load_args[0], load_args[1], rows, cols, mask, load_args[2], load_args[3], MASKED, STREAM
    )


@triton.jit
def head_pair(load_args, rows, cols, mask, MASKED: tl.constexpr, STREAM: tl.constexpr):
    """``LOAD`` hook of an activation and an optional second one (rmsnorm's gate, the FP8
    kernel's residual) with per-head row addressing: :func:`rms_load` with ``load_args`` =
    ((a_ptr, b_ptr), (HEADS, a_st, a_sh, b_st, b_sh), HAS_B); (a tile, b tile or a) in the stored
    dtypes. The integers are read by index (an unpacking assignment would turn one that the
    launch specialised to 1 into a tensor)."""
    a_ptr, b_ptr = load_args[0]
    HAS_B: tl.constexpr = load_args[2]
    return rms_load(
        a_ptr,
        b_ptr,
        rows,
        cols,
        mask,
        load_args[1][0],
        load_args[1][1],
        load_args[1][2],
        load_args[1][3],
        load_args[1][4],
        MASKED,
        STREAM,
        HAS_B,
    )


@triton.jit
def keep_pair(a, b):
    """``COMBINE`` hook of tiles that widen their loads themselves: ``(a, b)`` as loaded."""
    return a, b


@triton.jit
def widen_pair(a, b):
    """``COMBINE`` hook that widens both loaded tiles to FP32: ``(f32(a), f32(b))``."""
    return a.to(tl.float32), b.to(tl.float32)


@triton.jit
def _loop_tile(
    LOAD: tl.constexpr,
    load_args,
    COMBINE: tl.constexpr,
    t,
    nprog,
    a_nx,
    b_nx,
    cols,
    n_rows,
    H,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    PREFETCH: tl.constexpr,
    COMBINE_FIRST: tl.constexpr,
):
    """Row tile ``t`` of the persistent loop: (rows, mask, ``COMBINE`` of its ``LOAD`` pair,
    next first, next second). With PREFETCH the tile comes from the registers loaded one
    iteration earlier (``a_nx``, ``b_nx``; combined before tile ``t + nprog``'s loads are issued
    when COMBINE_FIRST, after them otherwise) and tile ``t + nprog``'s loads are issued now
    (row-masked: past the last tile they read nothing); otherwise it is loaded here and
    ``a_nx``, ``b_nx`` pass through untouched."""
    rows, mask = tile_rows(t, cols, n_rows, H, ROWS)
    if PREFETCH:
        if COMBINE_FIRST:
            v = COMBINE(a_nx, b_nx)
        else:
            a = a_nx
            b = b_nx
        rows_n, mask_n = tile_rows(t + nprog, cols, n_rows, H, ROWS)
        mask_n = _pf_mask(rows_n, mask_n, n_rows, MASKED, ROWS, BLOCK)
        a_nx, b_nx = LOAD(load_args, rows_n, cols, mask_n, True, EVICT_FIRST)
        if not COMBINE_FIRST:
            v = COMBINE(a, b)
    else:
        a, b = LOAD(load_args, rows, cols, mask, MASKED, EVICT_FIRST)
        v = COMBINE(a, b)
    return rows, mask, v, a_nx, b_nx


@triton.jit
def persistent_rows(
    LOAD: tl.constexpr,
    load_args,
    COMBINE: tl.constexpr,
    TILE: tl.constexpr,
    tile_args,
    pid,
    cols,
    n_rows,
    H,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    USE_PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    COMBINE_FIRST: tl.constexpr,
):
    """The persistent row loop of program ``pid`` (after ``gdc_wait``): ``TILE(COMBINE(a, b),
    rows, cols, mask, tile_args)`` of each of its row tiles, ``a, b`` loaded by ``LOAD`` (the
    next tile's loads in flight with PREFETCH); ``gdc_launch_dependents`` in the last
    iteration, after its loads and COMBINE."""
    nprog = tl.num_programs(0)
    n_tiles = tl.cdiv(n_rows, ROWS)
    t = pid
    a_nx = 0.0  # (unused placeholders without PREFETCH)
    b_nx = 0.0
    if PREFETCH:
        rows0, mask0 = tile_rows(t, cols, n_rows, H, ROWS)
        a_nx, b_nx = LOAD(load_args, rows0, cols, mask0, MASKED, EVICT_FIRST)
    while t < n_tiles:
        rows, mask, v, a_nx, b_nx = _loop_tile(
            LOAD,
            load_args,
            COMBINE,
            t,
            nprog,
            a_nx,
            b_nx,
            cols,
            n_rows,
            H,
            ROWS,
            BLOCK,
            MASKED,
            EVICT_FIRST,
            PREFETCH,
            COMBINE_FIRST,
        )
        if USE_PDL:
            if t + nprog >= n_tiles:
                gdc_launch_dependents()
        TILE(v, rows, cols, mask, tile_args)
        t += nprog


@triton.jit
def one_pass_rows(
    LOAD: tl.constexpr,
    load_args,
    COMBINE: tl.constexpr,
    TILE: tl.constexpr,
    tile_args,
    pid,
    cols,
    n_rows,
    H,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    EVICT_FIRST: tl.constexpr,
    USE_PDL: tl.constexpr,
    PERSISTENT: tl.constexpr,
    PREFETCH: tl.constexpr,
    COMBINE_FIRST: tl.constexpr,
    WAITED: tl.constexpr = False,
):
    """Rows that fit one block, after the kernel's parameter loads: ``gdc_wait`` (not when
    WAITED: the kernel waited itself, to load a parameter the previous kernel may write), then
    ``TILE(COMBINE(a, b), rows, cols, mask, tile_args)`` of program ``pid``'s row tile (``a, b =
    LOAD(load_args, rows, cols, mask, MASKED, EVICT_FIRST)``; ``gdc_launch_dependents`` after
    COMBINE) or, when PERSISTENT, of its tiles of the persistent loop
    (:func:`persistent_rows`). COMBINE_FIRST: with PREFETCH, a prefetched tile is combined
    before the next tile's loads are issued (after them otherwise)."""
    if USE_PDL:
        if not WAITED:
            gdc_wait()
    if not PERSISTENT:
        rows, mask = tile_rows(pid, cols, n_rows, H, ROWS)
        a, b = LOAD(load_args, rows, cols, mask, MASKED, EVICT_FIRST)
        v = COMBINE(a, b)
        if USE_PDL:
            gdc_launch_dependents()
        TILE(v, rows, cols, mask, tile_args)
    else:
        persistent_rows(
            LOAD,
            load_args,
            COMBINE,
            TILE,
            tile_args,
            pid,
            cols,
            n_rows,
            H,
            ROWS,
            BLOCK,
            MASKED,
            EVICT_FIRST,
            USE_PDL,
            PREFETCH,
            COMBINE_FIRST,
        )
