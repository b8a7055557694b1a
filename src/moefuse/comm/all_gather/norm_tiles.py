"""Device code of the one-launch all-gather + norm kernels (``_ag_rmsnorm_kernel`` of
:mod:`moefuse.comm.all_gather.decode`, ``_ag_rmsnorm_persistent_kernel`` of
:mod:`moefuse.comm.all_gather.persistent`): the push and receive of a norm tile's rows
(:mod:`moefuse.comm.all_gather.kernels`'s helpers) and the single-GPU op's row tile run on them,
after the gather (:func:`norm_tile`) or with the op's parameters loaded before it
(:func:`norm_tile_early`). The row code is the single-GPU kernels' own, with their constexprs:
same tile, same reduction tree, same bits.

Arguments as the kernels group them: ``ptrs`` / ``counts`` as ``_ag_rmsnorm_kernel``'s; ``dims``
= (width, fp4_grid, strides, heads, norm, gate): the rows' dimensions and the op's scalars in
groups, which :func:`norm_tile` and :func:`norm_tile_early` hand on, each row function taking
the groups it uses: ``width`` = (H, Hf), the row width as int and float; ``fp4_grid`` = (KB,
n_kcols), NVFP4's 16-element blocks per row and scale layout columns; ``strides`` = (x_st, o_st),
the row strides of the gathered rows and of the output; ``heads`` = (HEADS, x_sh, o_sh), heads per
row and the head strides of both (the rmsnorm and FP8 tiles after the gather; one head
elsewhere); ``norm`` = (eps, gain_center), the norm's; ``gate`` = (r_st, ro_st, rt_st,
alpha_scalar, post_eps, post_gc), the row strides of the gated op's residual, residual_out and
router output, and its scalars;
``gather`` = (scols, scm, empty, mine, region, rank, S, deadline, clock_ptr): the shard columns
and their mask, an empty slot row, this rank's slots, the generation's region, this rank, the
shard width and the wait bound; ``dst`` = (table_ptr, ag_off16, region, rank, S): where a push
goes. Constexpr tuples: ``TILE`` = (BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED,
UNROLL), the op's tile; ``OPC`` = (OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT,
HAS_ROUTER), the op.
"""

import triton
import triton.language as tl

from moefuse.comm.all_gather import kernels as AG
from moefuse.norm import gated as gd
from moefuse.norm import triton as nt
from moefuse.quant import fused as qf

#: the single-GPU op a fused launch ends with (host ints; OP_* the kernels' constexprs)
RMSNORM, FP8, FP4, GATED = 0, 1, 2, 3
OP_RMSNORM: tl.constexpr = tl.constexpr(RMSNORM)
OP_FP8: tl.constexpr = tl.constexpr(FP8)
OP_FP4: tl.constexpr = tl.constexpr(FP4)
OP_GATED: tl.constexpr = tl.constexpr(GATED)


# ----------------------------------------------------------------------------- gather
@triton.jit
def push_rows(
    shard_ptr,
    s_st,
    x_ptr,
    x_st,
    first,
    n,
    scols,
    scm,
    dst,
    H,
    P: tl.constexpr,
    OWN_SLOT: tl.constexpr = False,
):
    """Push rows ``first .. first + n - 1`` of this rank's shard (``AG.push_row``: every peer's
    slot, and this rank's gathered rows ``x_ptr``, or with ``OWN_SLOT`` its own slot)."""
    table_ptr, ag_off16, region, rank, S = dst
    j = 0
    while j < n:  # (while: the interpreter cannot range over a loaded value)
        AG.push_row(
            shard_ptr,
            s_st,
            x_ptr,
            x_st,
            first + j,
            scols,
            scm,
            table_ptr,
            ag_off16,
            region,
            rank,
            rank * S,
            H,
            P,
            OWN_SLOT,
        )
        j += 1


@triton.jit
def receive_rows(x_ptr, x_st, first, n, gather, H, P: tl.constexpr, PTX: tl.constexpr):
    """Receive rows ``first .. first + n - 1`` from every peer into the gathered rows
    (``AG.receive_row``; stops at the first expired wait), then a CTA barrier so that every
    thread sees every gathered word. Returns the bit mask of peers that did not deliver."""
    scols, scm, empty, mine, region, rank, S, deadline, clock_ptr = gather
    missing = 0
    j = 0
    while (j < n) & (missing == 0):
        missing = missing | AG.receive_row(
            x_ptr,
            x_st,
            first + j,
            scols,
            scm,
            mine,
            region,
            rank,
            S,
            H,
            deadline,
            clock_ptr,
            empty,
            P,
            PTX,
        )
        j += 1
    tl.debug_barrier()  # the gathered rows, written by every thread, are visible to all of them
    return missing


@triton.jit
def _stepped_rows(
    row,
    live,
    n_mine,
    first,
    gather,
    H,
    x_ptr,
    x_st,
    T: tl.constexpr,
    STEP: tl.constexpr,
    STEPS: tl.constexpr,
    MASKED: tl.constexpr,
    P: tl.constexpr,
    PTX: tl.constexpr,
    FROM_SLOTS: tl.constexpr,
):
    """Gathered row ``row`` as its STEPS FP32 [1, STEP] steps (the values of the single-GPU
    stepped kernels' ``ldp`` loads), straight from the slots (``AG.receive_steps``) or from
    the gathered buffer after :func:`receive_rows`; and the bit mask of late peers."""
    if FROM_SLOTS:
        scols, scm, empty, mine, region, rank, S, deadline, clock_ptr = gather
        vs, missing = AG.receive_steps(
            mine, region, row, live, S, H, deadline, clock_ptr, T, STEP, STEPS, MASKED, P, PTX
        )
    else:
        missing = receive_rows(x_ptr, x_st, first, n_mine, gather, H, P, PTX)
        vs = ()
        for k in tl.static_range(STEPS):
            cols, cm = nt.step_cols(k, H, STEP)
            vs = vs + (nt.ldp(x_ptr + row * x_st + cols, cm, MASKED, "evict_first"),)
    return vs, missing


# ----------------------------------------------------------------------------- one-pass tiles
@triton.jit
def one_pass_params(
    w_ptr,
    aux_ptr,
    cols,
    H,
    gain_center,
    BLOCK: tl.constexpr,
    MASKED: tl.constexpr,
    PTX: tl.constexpr,
    OP: tl.constexpr,
    LOAD: tl.constexpr = True,
):
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
def one_pass_tile(x, w, inv, t, rows, cols, mask, x_ptr, ptrs, counts, dims, TILE, OPC):
    """The single-GPU op ``OP``'s one-pass tile ``t`` on its rows ``x`` [ROWS, BLOCK] (stored
    dtype, masked elements 0) with the parameters of :func:`one_pass_params`: the row code of
    ``_rmsnorm_kernel`` (``rms_tile``), ``_rmsnorm_fp8_kernel`` (``fp8_tile``) or
    ``_rmsnorm_fp4_kernel`` (``fp4_tile`` with the rows given), so the same tree and bits.
    One head (the rows are in registers): of ``heads``, the output's head stride."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    width, fp4_grid, strides, heads, norm, _gate = dims
    H, Hf = width
    KB, n_kcols = fp4_grid
    _x_st, o_st = strides
    _HEADS, _x_sh, o_sh = heads
    eps, gain_center = norm
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER = OPC
    if OP == OP_FP8:
        qf.fp8_tile(
            qf.widen_h(x, x, False),
            w,
            inv,
            rows,
            cols,
            mask,
            x_ptr,
            out_ptr,
            1,
            0,
            0,
            o_st,
            o_sh,
            Hf,
            eps,
            MASKED,
            False,
            FMT,
            PTX,
            False,
        )
    elif OP == OP_FP4:
        qf.fp4_tile(
            t,
            w,
            x_ptr,
            x_ptr,
            aux_ptr,
            out_ptr,
            sf_ptr,
            x_ptr,
            n_rows,
            n_norm,
            H,
            Hf,
            KB,
            n_kcols,
            0,
            0,
            o_st,
            0,
            eps,
            BLOCK,
            ROWS,
            False,
            False,
            RECIPE,
            LAYOUT,
            EVICT_FIRST,
            PTX,
            False,
            MASKED,
            x,
            True,
        )
    else:
        xf = x.to(tl.float32)
        nt.rms_tile(
            xf, xf, w, rows, cols, mask, out_ptr, 1, o_st, o_sh, Hf, eps, MASKED, False, PTX
        )


# ----------------------------------------------------------------------------- parameters first
@triton.jit
def norm_tile_early(
    t,
    n_mine,
    first,
    gather,
    x_ptr,
    ptrs,
    counts,
    dims,
    TILE,
    OPC,
    P: tl.constexpr,
    FROM_SLOTS: tl.constexpr,
):
    """Row tile ``t`` of the single-GPU op ``OP`` (as :func:`norm_tile`: the same row code, so
    the same tree and bits) with the op's parameters (and the gated op's residual) loaded
    BEFORE the wait for the peers, so that their latency hides behind it; :func:`norm_tile`
    loads them after. One-pass tiles of rmsnorm, FP8 and NVFP4, and the unrolled stepped rows
    of rmsnorm (``nt.norm_unrolled_row``) and the gated op (``gd.next_unrolled_row``). The
    rows come from the gathered buffer after
    :func:`receive_rows`, or with ``FROM_SLOTS`` straight from this rank's slot
    (``AG.receive_tile`` / ``AG.receive_steps``: polled in the op's own tile, no gathered
    round trip, no CTA barrier). Returns the bit mask of the peers that did not deliver.
    One head per row: of ``heads``, the one-pass tiles use the output's head stride."""
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER = OPC
    width, _fp4_grid, strides, _heads, norm, gate = dims
    live = n_mine > 0
    if OP == OP_RMSNORM and STEPPED:  # unrolled (ROWS = 1): BLOCK = STEP, NUM_CHUNKS = STEPS
        missing = _early_rms_stepped(
            t, live, n_mine, first, gather, x_ptr, ptrs, width, strides, norm, TILE, P, FROM_SLOTS
        )
    elif OP == OP_GATED:  # stepped rows, unrolled (ROWS = 1): BLOCK = STEP, NUM_CHUNKS = STEPS
        missing = _early_gated(
            t,
            live,
            n_mine,
            first,
            gather,
            x_ptr,
            ptrs,
            width,
            strides,
            norm,
            gate,
            TILE,
            OPC,
            P,
            FROM_SLOTS,
        )
    else:
        missing = _early_one_pass(
            t, live, n_mine, first, gather, x_ptr, ptrs, counts, dims, TILE, OPC, P, FROM_SLOTS
        )
    return missing


@triton.jit
def _early_rms_stepped(
    t,
    live,
    n_mine,
    first,
    gather,
    x_ptr,
    ptrs,
    width,
    strides,
    norm,
    TILE,
    P: tl.constexpr,
    FROM_SLOTS: tl.constexpr,
):
    """:func:`norm_tile_early` for the unrolled stepped rows of rmsnorm."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    H, Hf = width
    x_st, o_st = strides
    eps, gain_center = norm
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    T: tl.constexpr = x_ptr.dtype.element_ty
    row = t.to(tl.int64)
    ws = nt.step_params(w_ptr, H, gain_center, BLOCK, NUM_CHUNKS, MASKED, True)
    vs, missing = _stepped_rows(
        row,
        live,
        n_mine,
        first,
        gather,
        H,
        x_ptr,
        x_st,
        T,
        BLOCK,
        NUM_CHUNKS,
        MASKED,
        P,
        PTX,
        FROM_SLOTS,
    )
    nt.norm_unrolled_row(
        vs,
        ws,
        out_ptr,
        row * o_st,
        H,
        Hf,
        eps,
        aux_ptr,
        BLOCK,
        NUM_CHUNKS,
        MASKED,
        PTX,
        nt.no_aux,
        nt.st_cast,
    )
    return missing


@triton.jit
def _early_gated(
    t,
    live,
    n_mine,
    first,
    gather,
    x_ptr,
    ptrs,
    width,
    strides,
    norm,
    gate,
    TILE,
    OPC,
    P: tl.constexpr,
    FROM_SLOTS: tl.constexpr,
):
    """:func:`norm_tile_early` for the gated op's unrolled stepped rows (its FP32 residual
    loaded with the parameters)."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    H, Hf = width
    x_st, o_st = strides
    eps, gain_center = norm
    r_st, ro_st, rt_st, alpha_scalar, post_eps, post_gc = gate
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER = OPC
    T: tl.constexpr = x_ptr.dtype.element_ty
    row = t.to(tl.int64)
    nws = nt.step_params(w_ptr, H, gain_center, BLOCK, NUM_CHUNKS, MASKED, True)
    pws = nt.step_params(pw_ptr, H, post_gc, BLOCK, NUM_CHUNKS, MASKED, HAS_POST_WEIGHT)
    als = nt.step_params(alpha_ptr, H, 0.0, BLOCK, NUM_CHUNKS, MASKED, ALPHA_MODE == 2)
    bes = nt.step_params(beta_ptr, H, 0.0, BLOCK, NUM_CHUNKS, MASKED, True)
    rs = ()
    for k in tl.static_range(NUM_CHUNKS):
        cols, cm = nt.step_cols(k, H, BLOCK)
        rs = rs + (nt.ldp(res_ptr + row * r_st + cols, cm, MASKED, "evict_first"),)
    bs, missing = _stepped_rows(
        row,
        live,
        n_mine,
        first,
        gather,
        H,
        x_ptr,
        x_st,
        T,
        BLOCK,
        NUM_CHUNKS,
        MASKED,
        P,
        PTX,
        FROM_SLOTS,
    )
    gd.next_unrolled_row(
        bs,
        rs,
        nws,
        pws,
        als,
        bes,
        ro_ptr,
        out_ptr,
        rt_ptr,
        row * ro_st,
        row * o_st,
        row * rt_st,
        H,
        Hf,
        alpha_scalar,
        post_eps,
        eps,
        BLOCK,
        NUM_CHUNKS,
        MASKED,
        ALPHA_MODE,
        HAS_POST_WEIGHT,
        HAS_ROUTER,
        PTX,
    )
    return missing


@triton.jit
def _early_one_pass(
    t,
    live,
    n_mine,
    first,
    gather,
    x_ptr,
    ptrs,
    counts,
    dims,
    TILE,
    OPC,
    P: tl.constexpr,
    FROM_SLOTS: tl.constexpr,
):
    """:func:`norm_tile_early` for the one-pass tiles of rmsnorm, FP8 and NVFP4."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    width, _fp4_grid, strides, _heads, norm, _gate = dims
    H, _Hf = width
    x_st, _o_st = strides
    _eps, gain_center = norm
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER = OPC
    T: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    rows, mask = nt.tile_rows(t, cols, n_rows, H, ROWS)
    w, inv = one_pass_params(w_ptr, aux_ptr, cols, H, gain_center, BLOCK, MASKED, PTX, OP)
    if FROM_SLOTS:
        scols, scm, empty, mine, region, rank, S, deadline, clock_ptr = gather
        x, missing = AG.receive_tile(
            mine, region, rows, cols, mask, live, S, H, deadline, clock_ptr, T, MASKED, P, PTX
        )
    else:
        missing = receive_rows(x_ptr, x_st, first, n_mine, gather, H, P, PTX)
        x = nt.ld_raw(x_ptr + (rows * x_st)[:, None] + cols[None, :], mask, MASKED, EVICT_FIRST)
    one_pass_tile(x, w, inv, t, rows, cols, mask, x_ptr, ptrs, counts, dims, TILE, OPC)
    return missing


# ----------------------------------------------------------------------------- after the gather
@triton.jit
def norm_tile(t, x_ptr, ptrs, counts, dims, TILE, OPC):
    """Row tile ``t`` of the single-GPU op ``OP`` (no PDL) on the gathered rows ``x_ptr``: that
    kernel's own row functions with its constexprs, so the same reduction tree and bits.

    * OP_RMSNORM (``moefuse.norm.triton._rmsnorm_kernel``, no gate): stepped rows (ROWS = 1)
      ``norm_stepped`` unrolled or looped as ``UNROLL`` says; one-pass tiles ``rms_load`` +
      ``rms_tile``. ``out_ptr``: the output rows.
    * OP_FP8 (``moefuse.quant.fused._rmsnorm_fp8_kernel``, one-pass tiles, no residual): the tile
      of its row loop, ``rms_load`` + ``widen_h`` + ``fp8_tile`` (PACKED False, as its loop);
      ``aux_ptr``: the scale, ``out_ptr``: the FP8 bytes.
    * OP_FP4 (``_rmsnorm_fp4_kernel``, one tile per program): ``fp4_tile``; tiles cover the
      layout's ``n_norm`` padded rows (``KB`` blocks per row, ``n_kcols`` scale columns);
      ``aux_ptr``: the global scale, ``out_ptr``: packed codes (row stride ``o_st``),
      ``sf_ptr``: the scale bytes.
    * OP_GATED (``moefuse.norm.gated._gated_residual_next_kernel``): the gathered rows are the
      branch; ``res_ptr`` the FP32 residual (row stride ``r_st``), ``w_ptr`` / ``eps`` /
      ``gain_center`` the next norm's, ``out_ptr`` ffn_input, ``ro_ptr`` residual_out,
      ``rt_ptr`` the FP32 router output (HAS_ROUTER); stepped rows ``next_stepped``, one-pass
      tiles ``add_load`` + ``gated_next_tile``."""
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER = OPC
    width, fp4_grid, strides, heads, norm, gate = dims
    if OP == OP_GATED:
        if STEPPED:
            _gated_stepped(t, x_ptr, ptrs, width, strides, norm, gate, TILE, OPC)
        else:
            _gated_one_pass(t, x_ptr, ptrs, counts, width, strides, norm, gate, TILE, OPC)
    elif OP == OP_FP8:
        _fp8_one_pass(t, x_ptr, ptrs, counts, width, strides, heads, norm, TILE, OPC)
    elif OP == OP_FP4:
        _fp4_one_pass(t, x_ptr, ptrs, counts, width, fp4_grid, strides, norm, TILE, OPC)
    elif STEPPED:
        _rms_stepped(t, x_ptr, ptrs, width, strides, heads, norm, TILE)
    else:
        _rms_one_pass(t, x_ptr, ptrs, counts, width, strides, heads, norm, TILE)


@triton.jit
def _gated_stepped(t, x_ptr, ptrs, width, strides, norm, gate, TILE, OPC):
    """:func:`norm_tile` for the gated op's stepped rows: ``gd.next_stepped``."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    H, Hf = width
    x_st, o_st = strides
    eps, gain_center = norm
    r_st, ro_st, rt_st, alpha_scalar, post_eps, post_gc = gate
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER = OPC
    gd.next_stepped(
        x_ptr,
        res_ptr,
        w_ptr,
        alpha_ptr,
        beta_ptr,
        pw_ptr,
        ro_ptr,
        out_ptr,
        rt_ptr,
        t.to(tl.int64),
        H,
        Hf,
        x_st,
        r_st,
        ro_st,
        o_st,
        rt_st,
        alpha_scalar,
        post_eps,
        eps,
        gain_center,
        post_gc,
        BLOCK,
        NUM_CHUNKS,
        UNROLL,
        MASKED,
        ALPHA_MODE,
        HAS_POST_WEIGHT,
        HAS_ROUTER,
        PTX,
        False,
    )


@triton.jit
def _gated_one_pass(t, x_ptr, ptrs, counts, width, strides, norm, gate, TILE, OPC):
    """:func:`norm_tile` for the gated op's one-pass tiles: ``add_load`` + ``gated_next_tile``."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    H, Hf = width
    x_st, o_st = strides
    eps, gain_center = norm
    r_st, ro_st, rt_st, alpha_scalar, post_eps, post_gc = gate
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER = OPC
    cols = tl.arange(0, BLOCK)
    pm = cols < H
    nw = nt.ld(w_ptr + cols, pm, MASKED, False)[None, :] + gain_center
    pw = 1.0
    if HAS_POST_WEIGHT:
        pw = nt.ld(pw_ptr + cols, pm, MASKED, False)[None, :] + post_gc
    rows, mask = nt.tile_rows(t, cols, n_rows, H, ROWS)
    br, rr = nt.add_load(x_ptr, res_ptr, rows, cols, mask, x_st, r_st, MASKED, EVICT_FIRST)
    gd.gated_next_tile(
        br.to(tl.float32),
        rr.to(tl.float32),
        nw,
        pw,
        rows,
        cols,
        pm,
        mask,
        alpha_ptr,
        beta_ptr,
        ro_ptr,
        out_ptr,
        rt_ptr,
        ro_st,
        o_st,
        rt_st,
        alpha_scalar,
        Hf,
        post_eps,
        eps,
        ALPHA_MODE,
        MASKED,
        HAS_POST_WEIGHT,
        HAS_ROUTER,
        PTX,
    )


@triton.jit
def _fp8_one_pass(t, x_ptr, ptrs, counts, width, strides, heads, norm, TILE, OPC):
    """:func:`norm_tile` for FP8: ``rms_load`` + ``widen_h`` + ``fp8_tile``."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    H, Hf = width
    x_st, o_st = strides
    HEADS, x_sh, o_sh = heads
    eps, gain_center = norm
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER = OPC
    cols = tl.arange(0, BLOCK)
    w = nt.ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
    inv = tl.math.div_rn(1.0, tl.load(aux_ptr).to(tl.float32))
    rows, mask = nt.tile_rows(t, cols, n_rows, H, ROWS)
    xr, rr = nt.rms_load(
        x_ptr, x_ptr, rows, cols, mask, HEADS, x_st, x_sh, 0, 0, MASKED, EVICT_FIRST, False
    )
    qf.fp8_tile(
        qf.widen_h(xr, rr, False),
        w,
        inv,
        rows,
        cols,
        mask,
        x_ptr,
        out_ptr,
        HEADS,
        0,
        0,
        o_st,
        o_sh,
        Hf,
        eps,
        MASKED,
        False,
        FMT,
        PTX,
        False,
    )


@triton.jit
def _fp4_one_pass(t, x_ptr, ptrs, counts, width, fp4_grid, strides, norm, TILE, OPC):
    """:func:`norm_tile` for NVFP4: ``fp4_tile``."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    H, Hf = width
    KB, n_kcols = fp4_grid
    x_st, o_st = strides
    eps, gain_center = norm
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    OP, FMT, LAYOUT, RECIPE, ALPHA_MODE, HAS_POST_WEIGHT, HAS_ROUTER = OPC
    cols = tl.arange(0, BLOCK)
    w = qf.ld32(w_ptr + cols, cols < H, MASKED, False, PTX)[None, :] + gain_center
    qf.fp4_tile(
        t,
        w,
        x_ptr,
        x_ptr,
        aux_ptr,
        out_ptr,
        sf_ptr,
        x_ptr,
        n_rows,
        n_norm,
        H,
        Hf,
        KB,
        n_kcols,
        x_st,
        0,
        o_st,
        0,
        eps,
        BLOCK,
        ROWS,
        False,
        False,
        RECIPE,
        LAYOUT,
        EVICT_FIRST,
        PTX,
        False,
        MASKED,
    )


@triton.jit
def _rms_stepped(t, x_ptr, ptrs, width, strides, heads, norm, TILE):
    """:func:`norm_tile` for rmsnorm's stepped rows: ``norm_stepped``."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    H, Hf = width
    x_st, o_st = strides
    HEADS, x_sh, o_sh = heads
    eps, gain_center = norm
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    nt.norm_stepped(
        x_ptr,
        x_ptr,
        w_ptr,
        out_ptr,
        nt.row_base(t, HEADS, x_st, x_sh),
        0,
        nt.row_base(t, HEADS, o_st, o_sh),
        H,
        Hf,
        eps,
        gain_center,
        x_ptr,
        BLOCK,
        NUM_CHUNKS,
        UNROLL,
        MASKED,
        PTX,
        False,
        False,
        "evict_first",
        nt.no_aux,
        nt.st_cast,
    )


@triton.jit
def _rms_one_pass(t, x_ptr, ptrs, counts, width, strides, heads, norm, TILE):
    """:func:`norm_tile` for rmsnorm's one-pass tiles: ``rms_load`` + ``rms_tile``."""
    w_ptr, out_ptr, aux_ptr, sf_ptr, res_ptr, alpha_ptr, beta_ptr, pw_ptr, ro_ptr, rt_ptr = ptrs
    n_rows, n_norm = counts
    H, Hf = width
    x_st, o_st = strides
    HEADS, x_sh, o_sh = heads
    eps, gain_center = norm
    BLOCK, NUM_CHUNKS, ROWS, MASKED, EVICT_FIRST, PTX, STEPPED, UNROLL = TILE
    cols = tl.arange(0, BLOCK)
    w = nt.ld(w_ptr + cols, cols < H, MASKED, False)[None, :] + gain_center
    rows, mask = nt.tile_rows(t, cols, n_rows, H, ROWS)
    x, g = nt.rms_load(
        x_ptr, x_ptr, rows, cols, mask, HEADS, x_st, x_sh, 0, 0, MASKED, EVICT_FIRST, False
    )
    nt.rms_tile(
        x.to(tl.float32),
        g.to(tl.float32),
        w,
        rows,
        cols,
        mask,
        out_ptr,
        HEADS,
        o_st,
        o_sh,
        Hf,
        eps,
        MASKED,
        False,
        PTX,
    )
