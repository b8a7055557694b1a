"""Split rows (moefuse.norm.gated) in the interpreter: one program per (row, slice), run as one
launch per phase, must give BITWISE the outputs of the normal mode (one program per row, same
[SLICES, SLICE] tile and chain of slice sums) and write nothing outside the rows. Small tiles with
SLICE = 32 / 64 stand in for the H200's [8, 1024]."""

import dataclasses

import pytest
import torch

import moefuse
from moefuse.norm import gated, tiles
from moefuse.norm import reference as ref
from moefuse.testing import assert_bitwise_equal, assert_close, poison_

pytestmark = pytest.mark.interpreter
BF = torch.bfloat16
F32 = torch.float32

# (width, block, warps, slices): SLICE = block / slices = 32 lanes x warps (x 1 element)
CASES = [(128, 128, 1, 4), (200, 256, 2, 4), (193, 256, 1, 8)]


def _tile(block, warps, slices):
    return tiles.RowTile(block=block, num_chunks=1, rows=1, num_warps=warps, slices=slices)


def _rand(*shape, dtype=BF):
    return torch.randn(*shape, dtype=F32).to(dtype)


def _framed(m, width, dtype):
    buf = poison_(torch.empty(m + 2, width, dtype=dtype))
    return buf, buf[1:-1]


def _assert_frames(bufs):
    for buf in bufs:
        assert torch.isnan(buf[0].float()).all() and torch.isnan(buf[-1].float()).all(), \
            "wrote outside the rows"  # fmt: skip


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_gated_residual_split_bitwise(case, m, with_weight, in_place, seed):
    width, block, warps, slices = case
    tile = _tile(block, warps, slices)
    b, res = _rand(m, width), _rand(m, width, dtype=F32)
    w = _rand(width) if with_weight else None
    a, be = _rand(width, dtype=F32), _rand(width, dtype=F32)

    def run(split):
        ob, oi = _framed(m, width, F32)
        rb, ri = _framed(m, width, F32)
        ri.copy_(res)
        out = ri if in_place else oi
        gated.launch_gated_residual_rmsnorm(b, ri, w, a, be, out, 1e-6, 0.5, False, tile=tile,
                                            split=split)  # fmt: skip
        return rb if in_place else ob

    normal, split = run(False), run(True)
    _assert_frames([normal, split])
    assert_bitwise_equal(split, normal, f"split vs normal {m}x{width}")
    expected = ref.gated_residual_rmsnorm_reference(b, res, w, a, be, 1e-6, 0.5)
    assert_close(split[1:-1], expected, "fp32_stream", "split vs reference")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("alpha_kind", ["one", "scalar", "tensor"])
@pytest.mark.parametrize("extras", [False, True])  # post_weight + router output + in place
def test_gated_residual_next_split_bitwise(case, m, alpha_kind, extras, seed):
    width, block, warps, slices = case
    tile = _tile(block, warps, slices)
    b, res = _rand(m, width), _rand(m, width, dtype=F32)
    nw, be = _rand(width), _rand(width, dtype=F32)
    pw = _rand(width) if extras else None
    alpha = _rand(width, dtype=F32) if alpha_kind == "tensor" else None
    scalar = {"one": 1.0, "scalar": 0.75, "tensor": 1.0}[alpha_kind]

    def run(split):
        rb, ri = _framed(m, width, F32)
        ob, oi = _framed(m, width, F32)
        fb, fi = _framed(m, width, BF)
        tb, ti = _framed(m, width, F32)
        ri.copy_(res)
        ro = ri if extras else oi
        gated.launch_gated_residual_next_rmsnorm(
            b, ri, nw, alpha, scalar, be, pw, ro, fi, ti if extras else None, 1e-6, 1e-5, 0.5,
            1.0, False, tile=tile, split=split,
        )  # fmt: skip
        return (rb if extras else ob), fb, tb

    normal, split = run(False), run(True)
    _assert_frames([*normal[:2], *split[:2]])
    for got, exp, name in zip(split, normal, ("residual_out", "ffn_input", "router_input")):
        assert_bitwise_equal(got, exp, f"split vs normal {name} {m}x{width}")
    if extras:
        _assert_frames([normal[2], split[2]])
        assert_bitwise_equal(split[2][1:-1].to(BF), split[1][1:-1], "ffn = cast(router)")
    exp_ro, _, _ = ref.gated_residual_next_rmsnorm_reference(
        b, res, nw, alpha if alpha is not None else scalar, be, 1e-6, 1e-5, 0.5, pw, 1.0)
    assert_close(split[0][1:-1], exp_ro, "fp32_stream", "split residual_out vs reference")


def test_split_knob_through_the_public_api(monkeypatch, seed):
    """tiles.SPLIT_ROWS = True: the default tile at H = 2048 (2 slices of 1024) runs split."""
    width, m = 2048, 2
    assert tiles.row_tile(width, tiles.GATED_POLICY).slices == 2
    b, res, nw = _rand(m, width), _rand(m, width, dtype=F32), _rand(width)
    a, be = _rand(width, dtype=F32), _rand(width, dtype=F32)
    normal = moefuse.gated_residual_next_rmsnorm(b, res, nw, a, be, impl="triton")
    calls = []
    real = gated._launches
    monkeypatch.setattr(gated, "_launches", lambda *args: calls.append(args[3]) or real(*args))
    monkeypatch.setattr(tiles, "SPLIT_ROWS", True)
    split = moefuse.gated_residual_next_rmsnorm(b, res, nw, a, be, impl="triton")
    assert calls and calls[0] is not None, "split mode did not run"
    for got, exp in zip(split, normal):
        assert_bitwise_equal(got, exp, "knob split vs normal")


def test_split_selection():
    t8 = tiles.row_tile(8192, tiles.GATED_POLICY)
    assert (t8.slices, t8.slice_width()) == (8, 1024)
    assert tiles.row_tile(4096, tiles.GATED_POLICY).slices == 4
    assert tiles.row_tile(2880, tiles.GATED_POLICY).slices == 4
    assert tiles.row_tile(1024, tiles.GATED_POLICY).slices == 1  # multi-row tiles never split
    assert tiles.row_tile(8192).slices == 1  # only the gated policy slices rows
    assert t8.can_split(8192, 16, 132) and not t8.can_split(8192, 17, 132)
    t2 = tiles.row_tile(2048, tiles.GATED_POLICY)
    assert t2.can_split(2048, 1, 132)
    assert not dataclasses.replace(t2, num_chunks=2).can_split(2048, 1, 132)
    small = _tile(256, 1, 8)
    assert not small.can_split(200, 1, 132) and small.can_split(200, 1, 132, force=True)
    # off CUDA the launcher counts one SM: automatic mode never splits in the interpreter
    assert gated._split_mode(t8, 8192, 1, torch.device("cpu"), None) is None
    with pytest.raises(ValueError, match="split rows"):
        gated._split_mode(tiles.row_tile(1024, tiles.GATED_POLICY), 1024, 1,
                          torch.device("cpu"), True)  # fmt: skip


def test_split_many_rows_both_ops(seed):
    """24 rows with slices of very different magnitudes: an order-sensitive chain (a different
    summation order of the slice sums gives other bits on some of these rows)."""
    width, m = 193, 24
    tile = _tile(256, 1, 8)
    scale = torch.logspace(-2, 2, width)
    b = (torch.randn(m, width) * scale).to(BF)
    res, nw = _rand(m, width, dtype=F32), _rand(width)
    a, be = _rand(width, dtype=F32), _rand(width, dtype=F32)
    got = {}
    for split in (False, True):
        out = poison_(torch.empty(m, width))
        gated.launch_gated_residual_rmsnorm(b, res, None, a, be, out, 1e-6, 0.0, False, tile=tile,
                                            split=split)  # fmt: skip
        ro, ffn = poison_(torch.empty(m, width)), poison_(torch.empty(m, width, dtype=BF))
        gated.launch_gated_residual_next_rmsnorm(b, res, nw, a, 1.0, be, None, ro, ffn, None,
                                                 1e-6, 1e-6, 0.0, 0.0, False, tile=tile,
                                                 split=split)  # fmt: skip
        got[split] = (out, ro, ffn)
    for x, y, name in zip(got[True], got[False], ("out", "residual_out", "ffn_input")):
        assert_bitwise_equal(x, y, f"split vs normal {name}")
