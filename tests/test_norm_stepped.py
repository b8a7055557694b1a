"""Stepped rows of the gated ops (moefuse.norm.gated), of rmsnorm (6145-8192 columns) and of
fused_add_rmsnorm (4096 and 6554-8192 columns; moefuse.norm.triton) in the interpreter: the
unrolled and the looped mode must give BITWISE the same outputs (same per-step code, same
per-thread accumulation order), a row alone must equal the same row inside a batch that runs the
other mode, nothing may be written outside the rows, and the outputs must match the reference.
Small steps (tiles with STEP = 64 or 32 columns) stand in for the GPU's 2048 / 4096, so that rows
have several steps and a masked last step at interpreter-friendly widths."""

import pytest
import torch

import moefuse
from moefuse.norm import gated, gated_residual, rms, tiles
from moefuse.norm import reference as ref
from moefuse.norm import triton as nt
from moefuse.quant import formats as F
from moefuse.testing import assert_bitwise_equal, assert_close, poison_

pytestmark = pytest.mark.interpreter
BF = torch.bfloat16
F32 = torch.float32

# (width, step): 3 full steps; 4 steps with a masked last one; 1 step; 7 steps (> the unroll
# limit of 4: looped only)
CASES = [(192, 64), (200, 64), (64, 64), (217, 32)]


def _tile(width, step):
    return tiles.RowTile(
        block=step, num_chunks=-(-width // step), rows=1, num_warps=1, stepped=True
    )


def _modes(tile):
    return (False, True) if tile.num_chunks <= tiles.STEP_UNROLL_MAX_STEPS else (False,)


def _rand(*shape, dtype=BF):
    return torch.randn(*shape, dtype=F32).to(dtype)


def _framed(m, width, dtype):
    buf = poison_(torch.empty(m + 2, width, dtype=dtype))
    return buf, buf[1:-1]


def _assert_frames(bufs):
    for buf in bufs:
        assert torch.isnan(buf[0].float()).all() and torch.isnan(buf[-1].float()).all(), (
            "wrote outside the rows"
        )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_gated_residual_stepped(case, with_weight, in_place, seed):
    width, step = case
    tile, m = _tile(width, step), 3
    b, res = _rand(m, width), _rand(m, width, dtype=F32)
    w = _rand(width) if with_weight else None
    a, be = _rand(width, dtype=F32), _rand(width, dtype=F32)
    outs = []
    for unroll in _modes(tile):
        rb, ri = _framed(m, width, F32)
        ri.copy_(res)
        ob, oi = (rb, ri) if in_place else _framed(m, width, F32)
        gated_residual.launch_gated_residual_rmsnorm(
            b, ri, w, a, be, oi, 1e-6, 0.5, False, tile=tile, unroll=unroll
        )
        _assert_frames([ob])
        outs.append(ob)
    for other in outs[1:]:
        assert_bitwise_equal(other, outs[0], "unrolled vs looped")
    expected = ref.gated_residual_rmsnorm_reference(b, res, w, a, be, 1e-6, 0.5)
    assert_close(outs[0][1:-1], expected, "fp32_stream", "gated stepped")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("alpha_mode", ["one", "scalar", "tensor"])
@pytest.mark.parametrize("extras", [False, True])
def test_gated_residual_next_stepped(case, alpha_mode, extras, seed):
    width, step = case
    tile, m = _tile(width, step), 3
    b, res = _rand(m, width), _rand(m, width, dtype=F32)
    nw, pw = _rand(width), _rand(width) if extras else None
    a, be = _rand(width, dtype=F32), _rand(width, dtype=F32)
    alpha, scalar = {"one": (None, 1.0), "scalar": (None, 0.75), "tensor": (a, 1.0)}[alpha_mode]
    outs = []
    for unroll in _modes(tile):
        rob, roi = _framed(m, width, F32)
        roi.copy_(res)  # in place: residual_out is the residual
        fb, fi = _framed(m, width, BF)
        tb, ti = _framed(m, width, F32) if extras else (None, None)
        gated.launch_gated_residual_next_rmsnorm(
            b,
            roi,
            nw,
            alpha,
            scalar,
            be,
            pw,
            roi,
            fi,
            ti,
            1e-6,
            1e-5,
            1.0,
            0.5,
            False,
            tile=tile,
            unroll=unroll,
        )
        got = [rob, fb] + ([tb] if extras else [])
        _assert_frames(got)
        outs.append(got)
    for other in outs[1:]:
        for x, y in zip(other, outs[0]):
            assert_bitwise_equal(x, y, "unrolled vs looped")
    ro, ffn = outs[0][0][1:-1], outs[0][1][1:-1]
    full_alpha = a if alpha_mode == "tensor" else scalar
    exp_ro, _, _ = ref.gated_residual_next_rmsnorm_reference(
        b, res, nw, full_alpha, be, 1e-6, 1e-5, 1.0, pw, 0.5
    )
    assert_close(ro, exp_ro, "fp32_stream", "residual_out")
    own = (ro * ref.inv_rms(ro, 1e-5)) * ref.gain(nw, 1.0)
    assert_close(ffn, own.to(BF), "rsqrt_half", "ffn_input")
    if extras:
        assert_bitwise_equal(outs[0][2][1:-1].to(BF), ffn, "ffn = cast(router)")


def test_row_alone_equals_row_in_a_looped_batch(monkeypatch, seed):
    """The default launch picks the mode from M: with the loop threshold lowered to 4 rows, a
    batch of 6 runs looped and each row alone runs unrolled; the bits must not change."""
    monkeypatch.setattr(tiles, "STEP_LOOP_MIN_ROWS", 4)
    width, m = 2500, 6  # GATED_POLICY: stepped, 2 steps of 2048 (the second masked)
    assert tiles.row_tile(width, tiles.GATED_POLICY).stepped
    b, res = _rand(m, width), _rand(m, width, dtype=F32)
    nw, a, be = _rand(width), _rand(width, dtype=F32), _rand(width, dtype=F32)
    out = moefuse.gated_residual_rmsnorm(b, res, None, a, be, impl="triton")
    ro, ffn = moefuse.gated_residual_next_rmsnorm(b, res, nw, a, be, impl="triton")
    for i in (0, m - 1):
        alone = moefuse.gated_residual_rmsnorm(
            b[i : i + 1], res[i : i + 1], None, a, be, impl="triton"
        )
        assert_bitwise_equal(alone, out[i : i + 1], "gated row alone")
        ro_i, ffn_i = moefuse.gated_residual_next_rmsnorm(
            b[i : i + 1], res[i : i + 1], nw, a, be, impl="triton"
        )
        assert_bitwise_equal(ro_i, ro[i : i + 1], "residual_out row alone")
        assert_bitwise_equal(ffn_i, ffn[i : i + 1], "ffn_input row alone")


def test_unroll_beyond_the_register_limit_is_refused():
    width, step = 217, 32  # 7 steps > STEP_UNROLL_MAX_STEPS
    b, res = _rand(1, width), _rand(1, width, dtype=F32)
    a, be = _rand(width, dtype=F32), _rand(width, dtype=F32)
    out = poison_(torch.empty(1, width))
    with pytest.raises(ValueError, match="unrolled stepped rows"):
        gated_residual.launch_gated_residual_rmsnorm(
            b, res, None, a, be, out, 1e-6, 0.0, False, tile=_tile(width, step), unroll=True
        )
    assert torch.isnan(out).all()


def test_a_compiling_launch_also_compiles_the_other_mode(monkeypatch):
    """norm.triton._launch (GPU path, faked here): a launch that grows Triton's kernel cache warms
    the other stepped mode once; cached launches and unsteppable tiles warm nothing."""

    class FakeKernel:
        def __init__(self):
            self.device_caches = {0: ({}, None)}
            self.launches, self.warmed = [], []

        def _compile(self, unroll):
            self.device_caches[0][0].setdefault(unroll, "binary")

        def __getitem__(self, grid):
            def run(*args, **consts):
                self.launches.append(consts["UNROLL"])
                self._compile(consts["UNROLL"])

            return run

        def warmup(self, *args, grid, **consts):
            self.warmed.append(consts["UNROLL"])
            self._compile(consts["UNROLL"])

    monkeypatch.setattr(nt, "interpreter_active", lambda: False)
    stepped, narrow = _tile(200, 64), tiles.row_tile(200, tiles.GATED_POLICY)
    k = FakeKernel()
    nt._launch(k, (1,), (), {"UNROLL": True}, stepped)  # compiles: warms the looped mode
    nt._launch(k, (1,), (), {"UNROLL": True}, stepped)  # cached
    nt._launch(k, (1,), (), {"UNROLL": False}, stepped)  # already warmed: cached
    assert k.launches == [True, True, False] and k.warmed == [False]
    k = FakeKernel()
    nt._launch(k, (1,), (), {"UNROLL": False}, narrow)  # not stepped: nothing to warm
    nt._launch(k, (1,), (), {"UNROLL": False}, _tile(217, 32))  # 7 steps: looped only
    assert k.warmed == []


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("three_d", [False, True])
def test_rmsnorm_stepped(case, in_place, three_d, seed):
    width, step = case
    tile, m = _tile(width, step), 3
    x, w = _rand(m, width), _rand(width)
    outs = []
    for unroll in _modes(tile):
        xb, xi = _framed(m, width, BF)
        xi.copy_(x)
        ob, oi = (xb, xi) if in_place else _framed(m, width, BF)
        if three_d:  # [1, m, H] with heads = m: the row base walks stride_h
            rms.launch_rmsnorm(xi[None], w, oi[None], 1e-6, 1.0, False, tile=tile, unroll=unroll)
        else:
            rms.launch_rmsnorm(xi, w, oi, 1e-6, 1.0, False, tile=tile, unroll=unroll)
        _assert_frames([ob])
        outs.append(ob)
    for other in outs[1:]:
        assert_bitwise_equal(other, outs[0], "unrolled vs looped")
    assert_close(outs[0][1:-1], ref.rmsnorm_reference(x, w, 1e-6, 1.0), "rsqrt_half", "stepped")


def test_rmsnorm_policy_steps_only_6145_to_8192_columns():
    policy = tiles.RMSNORM_POLICY
    assert not tiles.row_tile(6144, policy).stepped
    assert not tiles.row_tile(8193, policy).stepped
    for width in (6145, 7168, 8192):
        tile = tiles.row_tile(width, policy)
        assert tile.stepped and (tile.block, tile.num_chunks, tile.num_warps) == (4096, 2, 16)
        assert tile.num_chunks <= tiles.STEP_UNROLL_MAX_STEPS  # both modes exist


def test_rmsnorm_row_alone_equals_row_in_a_looped_batch(monkeypatch, seed):
    """moefuse.rmsnorm at a stepped width with the loop threshold lowered to 4 rows: a batch of 6
    runs looped, each row alone unrolled; the bits must not change."""
    monkeypatch.setattr(tiles, "RMSNORM_LOOP_MIN_ROWS", 4)
    width, m = 7000, 6  # two steps of 4096, the second masked
    assert tiles.row_tile(width, tiles.RMSNORM_POLICY).stepped
    x, w = _rand(m, width), _rand(width)
    out = moefuse.rmsnorm(x, w, impl="triton")
    for i in (0, m - 1):
        assert_bitwise_equal(
            moefuse.rmsnorm(x[i : i + 1], w, impl="triton"), out[i : i + 1], "rmsnorm row alone"
        )
    assert_close(out, ref.rmsnorm_reference(x, w), "rsqrt_half", "rmsnorm 7000")


def test_sigmoid_gate_refuses_a_stepped_tile():
    x, g = _rand(2, 4, 64), _rand(2, 4, 64)
    before = x.clone()
    with pytest.raises(ValueError, match="sigmoid gate"):
        rms.launch_rmsnorm(x, None, x, 1e-5, 0.0, False, gate=g, tile=_tile(64, 32))
    assert_bitwise_equal(x, before, "nothing written")


@pytest.mark.parametrize("case", CASES)
def test_fused_add_stepped(case, seed):
    width, step = case
    tile, m = _tile(width, step), 3
    x, r, w = _rand(m, width), _rand(m, width), _rand(width)
    outs = []
    for unroll in _modes(tile):
        xb, xi = _framed(m, width, BF)
        rb, ri = _framed(m, width, BF)
        xi.copy_(x)
        ri.copy_(r)
        rms.launch_fused_add_rmsnorm(xi, ri, w, 1e-6, 1.0, False, tile=tile, unroll=unroll)
        _assert_frames([xb, rb])
        outs.append((xb, rb))
    for other in outs[1:]:
        assert_bitwise_equal(other[0], outs[0][0], "normed: unrolled vs looped")
        assert_bitwise_equal(other[1], outs[0][1], "residual: unrolled vs looped")
    normed, r_out = ref.fused_add_rmsnorm_reference(x, r, w, 1e-6, 1.0)
    assert_bitwise_equal(outs[0][1][1:-1], r_out, "residual")
    assert_close(outs[0][0][1:-1], normed, "rsqrt_half", "normed")


def test_fused_add_policy_steps_4096_and_6554_to_8192_columns():
    policy = tiles.FUSED_ADD_POLICY
    for width in (2880, 4095, 4097, 5120, 6144, 6553, 8193):
        assert not tiles.row_tile(width, policy).stepped, width
    for width, steps in ((4096, 1), (6554, 2), (7168, 2), (8192, 2)):
        tile = tiles.row_tile(width, policy)
        assert tile.stepped and (tile.block, tile.num_chunks, tile.num_warps) == (4096, steps, 16)


def test_fused_add_row_alone_equals_row_in_a_looped_batch(monkeypatch, seed):
    monkeypatch.setattr(tiles, "FUSED_ADD_LOOP_MIN_ROWS", 4)
    width, m = 7000, 6  # two steps of 4096, the second masked
    assert tiles.row_tile(width, tiles.FUSED_ADD_POLICY).stepped
    x, r, w = _rand(m, width), _rand(m, width), _rand(width)
    xb, rb = x.clone(), r.clone()
    moefuse.fused_add_rmsnorm(xb, rb, w, impl="triton")
    for i in (0, m - 1):
        xi, ri = x[i : i + 1].clone(), r[i : i + 1].clone()
        moefuse.fused_add_rmsnorm(xi, ri, w, impl="triton")
        assert_bitwise_equal(xi, xb[i : i + 1], "normed row alone")
        assert_bitwise_equal(ri, rb[i : i + 1], "residual row alone")


# ----------------------------------------------------------------------------- stepped FP8 rows
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("fmt", [0, 1])
def test_fp8_quant_stepped(case, residual, fmt, seed):
    """rmsnorm_quant / fused_add_rmsnorm_quant (quant.fused) over stepped rows: the norm's stepped
    row with the FP8 output hooks. Unrolled == looped bitwise; codes within one step of the
    reference (the row sum order differs); the residual bitwise; nothing written outside."""
    from moefuse.quant import fused as qf
    from moefuse.quant import reference as qref

    width, step = case
    tile, m = _tile(width, step), 3
    x, w, res = _rand(m, width), _rand(width), _rand(m, width)
    scale = torch.tensor([0.02 if fmt == 0 else 1e-4])
    outs, residuals = [], []
    for unroll in _modes(tile):
        qb, qi = _framed(m, width, torch.uint8)
        qb.fill_(0xAA)
        rb, ri = _framed(m, width, BF)
        ri.copy_(res)
        x_in = x.clone()
        qf.launch_rmsnorm_fp8(
            x_in,
            ri if residual else None,
            w,
            scale,
            qi,
            fmt,
            1e-6,
            0.5,
            False,
            tile=tile,
            unroll=unroll,
        )
        assert (qb[0] == 0xAA).all() and (qb[-1] == 0xAA).all(), "wrote outside the rows"
        _assert_frames([rb])
        assert_bitwise_equal(x_in, x, "input untouched")
        outs.append(qb)
        residuals.append(rb)
    for q, r in zip(outs[1:], residuals[1:]):
        assert_bitwise_equal(q, outs[0], "FP8 codes, unrolled vs looped")
        assert_bitwise_equal(r, residuals[0], "residual, unrolled vs looped")
    qdtype = torch.float8_e4m3fn if fmt == 0 else torch.float8_e5m2
    if residual:
        exp, res_exp = qref.fused_add_rmsnorm_quant_reference(
            x, res.clone(), w, scale, 1e-6, quant_dtype=qdtype, gain_center=0.5
        )
        assert_bitwise_equal(residuals[0][1:-1], res_exp, "residual = cast(h)")
    else:
        exp = qref.rmsnorm_quant_reference(x, w, scale, 1e-6, quant_dtype=qdtype, gain_center=0.5)
        assert_bitwise_equal(residuals[0][1:-1], res, "residual untouched without residual")
    got = outs[0][1:-1].view(qdtype)
    d = F.fp8_code_distance(got, exp)
    assert int(d.max()) <= 1, f"FP8 codes {int(d.max())} steps apart"


def test_fp8_policy_and_row_alone_equals_row_in_a_looped_batch(monkeypatch, seed):
    """fused_add_rmsnorm_quant steps the widths fused_add_rmsnorm steps; at 7000 columns (masked
    last step) a batch of 6 with the loop threshold lowered to 4 rows runs looped, each row alone
    unrolled: the codes and the residual must not change. Rows of whole steps never loop."""
    from moefuse.quant import fused as qf

    for width in (4096, 7168, 8192, 2880, 5120):
        assert (
            qf.quant_row_tile(width, True).stepped
            == tiles.row_tile(width, tiles.FUSED_ADD_POLICY).stepped
        )
    assert not qf.quant_row_tile(4096).stepped  # rmsnorm_quant keeps its persistent tile
    assert qf.fp8_loop_min_rows(qf.quant_row_tile(8192, True), 8192) > 2**40
    monkeypatch.setattr(qf, "FP8_LOOP_MIN_ROWS", 4)
    width, m = 7000, 6
    tile = qf.quant_row_tile(width, True)
    assert tile.stepped and qf.fp8_loop_min_rows(tile, width) == 4
    x, w, res = _rand(m, width), _rand(width), _rand(m, width)
    scale = torch.tensor([0.02])
    r_all = res.clone()
    q_all = moefuse.fused_add_rmsnorm_quant(x, r_all, w, scale, impl="triton")
    for i in (0, m - 1):
        r_i = res[i : i + 1].clone()
        q_i = moefuse.fused_add_rmsnorm_quant(x[i : i + 1], r_i, w, scale, impl="triton")
        assert_bitwise_equal(q_i, q_all[i : i + 1], "FP8 row alone")
        assert_bitwise_equal(r_i, r_all[i : i + 1], "residual row alone")


def test_fp8_quant_stepped_3d_strided_rows(seed):
    """Stepped FP8 rows of a 3-D strided input (rows addressed token x head) give the bits of the
    same rows as a contiguous 2-D input; the residual view is written and nothing around it."""
    from moefuse.quant import fused as qf

    width, step = 200, 64
    tile = _tile(width, step)
    base, rbase = _rand(3, 5, 224), _rand(3, 5, 224)
    x, w, scale = base[:, 1:4, :width], _rand(width), torch.tensor([0.02])
    for unroll in _modes(tile):
        r3 = rbase.clone()
        q3 = torch.empty(3, 3, width, dtype=torch.uint8)
        qf.launch_rmsnorm_fp8(
            x,
            r3[:, 2:5, 8 : 8 + width],
            w,
            scale,
            q3,
            0,
            1e-6,
            0.0,
            False,
            tile=tile,
            unroll=unroll,
        )
        r2 = rbase[:, 2:5, 8 : 8 + width].reshape(9, width).clone()
        q2 = torch.empty(9, width, dtype=torch.uint8)
        qf.launch_rmsnorm_fp8(
            x.reshape(9, width), r2, w, scale, q2, 0, 1e-6, 0.0, False, tile=tile, unroll=unroll
        )
        assert_bitwise_equal(q3.reshape(9, width), q2, "3-D rows vs 2-D rows")
        assert_bitwise_equal(r3[:, 2:5, 8 : 8 + width].reshape(9, width), r2, "3-D residual")
        untouched = rbase.clone()
        untouched[:, 2:5, 8 : 8 + width] = r3[:, 2:5, 8 : 8 + width]
        assert_bitwise_equal(r3, untouched, "residual outside the view")
