"""The persistent row loop (norm/tiles.py ``programs_per_sm``, ``prefetch``) in the interpreter:
a few programs looping over many row tiles must give BITWISE the outputs of one program per row
tile, and write nothing outside the rows (outputs are views into poisoned buffers with one extra
row on each side). Off CUDA the launchers count one SM, so ``programs_per_sm = 3`` is a grid of 3.
"""

import dataclasses

import pytest
import torch

from moefuse.norm import gated, gated_residual, rms, tiles
from moefuse.quant import fused as qf
from moefuse.testing import assert_bitwise_equal, poison_

pytestmark = pytest.mark.interpreter
BF = torch.bfloat16
F32 = torch.float32
# 200: 8-row masked tiles; 2048: one unmasked row per tile (the prefetch's row-only mask);
# 3008: one masked row per tile
WIDTHS = [200, 2048, 3008]
# the gated ops' rows wider than 2048 are stepped (one row per program, tests/test_norm_stepped.py)
GATED_WIDTHS = [200, 2048]
ROWS = 13  # (PDL off: the interpreter has no griddepcontrol)
# 13 rows over 3 programs: 4-5 one-row tiles per program, 2 programs of 8-row tiles
PROGRAMS = 3


def _rand(*shape, dtype=BF):
    return torch.randn(*shape, dtype=F32).to(dtype)


def _framed(*shape, dtype):
    """A poisoned buffer with one extra row before and after, and the view of its inner rows."""
    buf = poison_(torch.empty(shape[0] + 2, *shape[1:], dtype=dtype))
    return buf, buf[1:-1]


def _tiles(width, policy):
    base = tiles.row_tile(width, policy)
    one = dataclasses.replace(base, programs_per_sm=0, prefetch=False)
    return one, [
        dataclasses.replace(base, programs_per_sm=PROGRAMS, prefetch=p) for p in (False, True)
    ]


def _check(run, width, policy, n_outputs, unframed=()):
    """``run(tile)`` -> tuple of poisoned-frame buffers (but the indices in ``unframed``); compare
    each persistent variant with one program per tile, and check that frame rows stayed poisoned."""
    one, persistent = _tiles(width, policy)
    expected = run(one)
    assert len(expected) == n_outputs
    for i, buf in enumerate(expected):
        if i in unframed:
            continue
        if buf.dtype != torch.uint8:
            assert torch.isnan(buf[0]).all() and torch.isnan(buf[-1]).all(), "wrote outside rows"
        else:
            assert (buf[0] == 0xA5).all() and (buf[-1] == 0xA5).all(), "wrote outside rows"
    for tile in persistent:
        assert tile.persistent_grid(-(-ROWS // tile.rows), 1)[0] <= PROGRAMS
        for got, exp in zip(run(tile), expected, strict=True):
            assert_bitwise_equal(got, exp, f"prefetch={tile.prefetch} width={width}")


@pytest.mark.parametrize("width", WIDTHS)
def test_rmsnorm_and_sigmoid_gate(width, seed):
    x, w = _rand(ROWS, width), _rand(width)

    def run(tile):
        buf, out = _framed(ROWS, width, dtype=BF)
        rms.launch_rmsnorm(x, w, out, 1e-6, 0.0, False, tile=tile)
        return (buf,)

    _check(run, width, tiles.TilePolicy(), 1)

    # sigmoid gate in place on a 3-D [tokens, heads, D] view with a padded token stride
    heads = 2
    xg = _rand(ROWS, heads, width + 8)[..., :width]
    gate = _rand(ROWS, heads, width)

    def run_gate(tile):
        buf, inp = _framed(ROWS, heads, width + 8, dtype=BF)
        inp = inp[..., :width]
        inp.copy_(xg)
        rms.launch_rmsnorm(inp, None, inp, 1e-5, 0.0, False, gate=gate, tile=tile)
        return (buf,)

    _check(run_gate, width, tiles.SIGMOID_GATE_POLICY, 1)


@pytest.mark.parametrize("width", WIDTHS)
def test_fused_add_rmsnorm(width, seed):
    x, res, w = _rand(ROWS, width), _rand(ROWS, width), _rand(width)

    def run(tile):
        xb, xi = _framed(ROWS, width, dtype=BF)
        rb, ri = _framed(ROWS, width, dtype=BF)
        xi.copy_(x)
        ri.copy_(res)
        rms.launch_fused_add_rmsnorm(xi, ri, w, 1e-6, 0.0, False, tile=tile)
        return xb, rb

    _check(run, width, tiles.FUSED_ADD_POLICY, 2)


@pytest.mark.parametrize("width", GATED_WIDTHS)
def test_gated_residual_in_place(width, seed):
    b, res = _rand(ROWS, width), _rand(ROWS, width, dtype=F32)
    w, a, be = _rand(width), _rand(width, dtype=F32), _rand(width, dtype=F32)

    def run(tile):
        rb, ri = _framed(ROWS, width, dtype=F32)
        ri.copy_(res)
        gated_residual.launch_gated_residual_rmsnorm(
            b, ri, w, a, be, ri, 1e-6, 0.0, False, tile=tile
        )
        return (rb,)

    _check(run, width, tiles.GATED_POLICY, 1)


@pytest.mark.parametrize("width", GATED_WIDTHS)
def test_gated_residual_next_in_place(width, seed):
    b, res = _rand(ROWS, width), _rand(ROWS, width, dtype=F32)
    nw, pw = _rand(width), _rand(width)
    a, be = _rand(width, dtype=F32), _rand(width, dtype=F32)

    def run(tile):
        rb, ri = _framed(ROWS, width, dtype=F32)
        fb, fi = _framed(ROWS, width, dtype=BF)
        tb, ti = _framed(ROWS, width, dtype=F32)
        ri.copy_(res)
        gated.launch_gated_residual_next_rmsnorm(
            b, ri, nw, a, 1.0, be, pw, ri, fi, ti, 1e-6, 1e-6, 0.0, 0.0, False, tile=tile
        )
        return rb, fb, tb

    _check(run, width, tiles.GATED_POLICY, 3)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_fp8(width, residual, seed):
    x, res, w = _rand(ROWS, width), _rand(ROWS, width), _rand(width)
    scale = torch.tensor([0.05])

    def run(tile):
        qb, qi = _framed(ROWS, width, dtype=torch.uint8)
        rb, ri = _framed(ROWS, width, dtype=BF)
        ri.copy_(res)
        qf.launch_rmsnorm_fp8(
            x, ri if residual else None, w, scale, qi, 0, 1e-6, 0.0, False, tile=tile
        )
        return (qb, rb) if residual else (qb,)

    _check(run, width, qf.QUANT_ADD_POLICY if residual else qf.QUANT_POLICY, 1 + residual)


@pytest.mark.parametrize("width", [208, 2048])
@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_fp4(width, residual, seed):
    """Swizzled 128x4 scales: the loop also covers the tiles of padding rows 13..127."""
    x, res, w = _rand(ROWS, width), _rand(ROWS, width), _rand(width)
    gs = torch.tensor([300.0])
    shape = qf.scale_layout_shape(ROWS, width // 16, "swizzled_128x4")

    def run(tile):
        pb, pi = _framed(ROWS, width // 2, dtype=torch.uint8)
        sb = poison_(torch.empty(shape, dtype=torch.uint8))
        rb, ri = _framed(ROWS, width, dtype=BF)
        yb, yi = _framed(ROWS, width, dtype=BF)
        ri.copy_(res)
        qf.launch_rmsnorm_fp4(
            x,
            ri if residual else None,
            w,
            gs,
            pi,
            sb,
            yi,
            1e-6,
            0.0,
            "swizzled_128x4",
            "fast",
            False,
            tile=tile,
        )
        return pb, sb, rb, yb

    _check(run, width, qf.QUANT_FP4_POLICY, 4, unframed=(1,))
