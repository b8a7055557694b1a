"""Per-token-group 8-bit quantization on CPU: the reference against an FP64 oracle, the Triton
kernels in the interpreter against the reference (bitwise), the fused norm ops against the
unfused chain (bitwise), bad inputs, the FlashInfer-style entry point."""

import math

import numpy as np
import pytest
import torch

import moefuse
from moefuse.compat import flashinfer as fi
from moefuse.quant import formats as F
from moefuse.quant import reference as ref
from moefuse.quant.group_api import alloc_group_scales
from moefuse.testing import assert_bitwise_equal, expect_value_error, poison_

pytestmark = pytest.mark.interpreter
E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype)


def _specials(x):
    """NaN, +-Inf and a zero group in rows 0-2 of a [M >= 3, H] tensor."""
    x[0, x.shape[1] // 2] = float("nan")
    x[1, 0] = float("inf")
    x[2, : min(32, x.shape[1])] = 0.0
    return x


# ----------------------------------------------------------------------------- reference
def _oracle_group(seg: np.ndarray, eps: float, qmax: float, ue8m0: bool):
    """(FP32 quotients, FP32 scale) of one group in FP64 (NaN groups: NaN scale)."""
    if np.isnan(seg).any():
        return np.full(seg.shape, np.nan), np.float32(np.nan)
    sc = np.float32(max(np.abs(seg).max(), np.float32(eps)) / qmax)
    if ue8m0 and np.isfinite(sc) and sc > 0:
        mant, e = math.frexp(float(sc))
        sc = np.float32(sc if mant == 0.5 else math.ldexp(1.0, e))
    with np.errstate(divide="ignore", invalid="ignore"):
        return (seg / np.float64(sc)).astype(np.float32), sc


def _oracle(x: torch.Tensor, gs: int, eps: float, int8: bool, ue8m0: bool):
    """FP64 oracle of the spec: FP32 operands divided in FP64 and rounded once to FP32 (exact
    for a quotient of two FP32 values), 2^ceil(log2 s) from frexp, INT8 by rint."""
    v = x.float().numpy().astype(np.float64)
    m, h = v.shape
    q, s = np.zeros((m, h)), np.zeros((m, -(-h // gs)), dtype=np.float32)
    for i in range(m):
        for g in range(s.shape[1]):
            cols = slice(g * gs, (g + 1) * gs)
            q[i, cols], s[i, g] = _oracle_group(v[i, cols], eps, 127.0 if int8 else 448.0, ue8m0)
    if int8:
        codes = torch.from_numpy(np.clip(np.rint(np.nan_to_num(q, nan=0.0)), -127, 127))
        return codes.to(torch.int8), torch.from_numpy(s)
    return F.fp8_bits(torch.from_numpy(q).float()).view(E4M3), torch.from_numpy(s)


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_reference_matches_fp64_oracle(int8, ue8m0, seed):
    x = _specials(_rand(6, 200, dtype=torch.float32, scale=5.0))
    x[3, 64:128] *= 1e-40  # a subnormal scale
    eq, es = _oracle(x, 64, 1e-42, int8, ue8m0)
    q, s = ref.per_token_group_quant_8bit_reference(
        x, 64, 1e-42, torch.int8 if int8 else E4M3, ue8m0
    )
    assert_bitwise_equal(q, eq, "codes")
    assert_bitwise_equal(s, es, "scales")
    kq, ks = moefuse.per_token_group_quant_8bit(
        x, 64, 1e-42, torch.int8 if int8 else E4M3, scale_ue8m0=ue8m0, impl="triton"
    )
    assert_bitwise_equal(kq, eq, "kernel codes")
    assert_bitwise_equal(ks, es, "kernel scales (a subnormal one included)")


# ----------------------------------------------------------------------------- kernel
def test_reciprocal_quotient_is_the_ieee_division():
    """The quantizer's quotient (one reciprocal per group, an FMA-corrected product per element)
    has the IEEE division's bits on adversarial cases (midpoints of E4M3 and INT8 rounding and
    the ulps beside them, signed zeros, subnormal dividends, infinite and NaN scales); the
    check itself fails on the uncorrected product ``x * (1 / s)``."""
    from moefuse.tools import quotient_check

    assert quotient_check.check(20000, seed=1) == 40012
    x, s = quotient_check.cases(20000, "cpu", torch.Generator().manual_seed(1))
    assert (F.fp8_bits(x * (1 / s)) != F.fp8_bits(x / s)).any()


@pytest.mark.parametrize("qmax", [448.0, 127.0])
def test_scale_quotient_is_the_ieee_division(qmax):
    """The division-free scale ``m / QMAX`` (constant reciprocal, one FMA correction) equals the
    IEEE division on every FP32 m of bit ranges at the eps floor 2^-60, around 1, at the top of
    the range with Inf and the NaNs, and on 8192 values spaced through the range (the GPU test
    checks every m)."""
    from moefuse.tools import quotient_check as qc

    for first in (qc.RCP_MIN_EPS_BITS, 0x3F800000 - 1024, 0x43E00000 - 1024, 0x7F800000 - 1024):
        assert qc.check_scales(first, 2048, qmax) == 2048
    step = (0x7F800000 - qc.RCP_MIN_EPS_BITS) // 8192
    assert qc.check_scales(qc.RCP_MIN_EPS_BITS + 12345, 8192, qmax, step=step) == 8192


CASES = [  # (H, group, dtype, dst, ue8m0, layout, scale dtype)
    (200, 64, torch.bfloat16, E4M3, False, "row", torch.float32),
    (7, 32, torch.float16, torch.int8, True, "column", torch.float32),
    (300, 128, torch.float32, E4M3, True, "tma", E8M0),
    (1100, 256, torch.bfloat16, torch.int8, False, "tma", torch.float32),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"H{c[0]}-g{c[1]}-{c[4]}-{c[5]}")
def test_group_quant_kernel(case, seed):
    h, gs, dtype, dst, ue8m0, layout, sdtype = case
    for m in (1, 5):
        base = _specials(_rand(m + 2, h + 16, dtype=dtype, scale=3.0))
        x = base[1:, 8 : 8 + h]  # strided rows
        out = poison_(torch.empty(x.shape, dtype=dst))
        sc = alloc_group_scales(x.shape, gs, layout != "row", layout == "tma", sdtype, "cpu")
        poison_(sc)
        kw = dict(dst_dtype=dst, scale_ue8m0=ue8m0, out=out, scale_out=sc)
        moefuse.per_token_group_quant_8bit(x, gs, impl="triton", **kw)
        eq, es = ref.per_token_group_quant_8bit_reference(x, gs, 1e-10, dst, ue8m0)
        assert_bitwise_equal(out, eq, f"codes {m}x{h}")
        assert_bitwise_equal(sc, es.to(sdtype), f"scales {m}x{h}")


def test_group_quant_kernel_3d_and_1d(seed):
    x = _rand(2, 3, 96, scale=2.0)
    for cm in (False, True):
        q, s = moefuse.per_token_group_quant_8bit(x, 64, column_major_scales=cm, impl="triton")
        eq, es = ref.per_token_group_quant_8bit_reference(x, 64)
        assert_bitwise_equal(q, eq, "3-D codes")
        assert_bitwise_equal(s, es, "3-D scales")
    q, s = moefuse.per_token_group_quant_8bit(x[0, 0], 32, impl="triton")
    assert s.shape == (3,)
    assert_bitwise_equal(q, ref.per_token_group_quant_8bit_reference(x[0, 0], 32)[0], "1-D")


def test_layouts_are_flashinfers():
    """Column-major: token dim contiguous; TMA-aligned: that dim padded to 4 tokens."""
    x = torch.zeros(5, 256, dtype=torch.bfloat16)
    _, s = moefuse.per_token_group_quant_8bit(x, 128, impl="reference")
    assert s.shape == (5, 2) and s.stride() == (2, 1)
    _, s = moefuse.per_token_group_quant_8bit(x, 128, column_major_scales=True, impl="reference")
    assert s.shape == (5, 2) and s.stride() == (1, 5)
    _, s = fi.per_token_group_quant_8bit(x, 128, 1e-10, None, True, True)
    assert s.shape == (5, 2) and s.stride() == (1, 8)


# ----------------------------------------------------------------------------- fused
@pytest.mark.parametrize(
    "h, m", [(200, 5), (7168, 2), (20000, 1)], ids=["one-pass", "stepped", "two-pass"]
)
def test_fused_equals_unfused_chain(h, m, seed):
    x, w, r = _specials(_rand(m + 2, h, scale=2.0))[2:], _rand(h), _rand(m, h)
    for i, gs in enumerate((64, 128)):
        dst, ue8m0, gc = (E4M3, torch.int8)[i], i == 1, float(i)
        kw = dict(group_size=gs, dst_dtype=dst, scale_ue8m0=ue8m0, gain_center=gc, impl="triton")
        qkw = dict(dst_dtype=dst, scale_ue8m0=ue8m0, impl="triton")
        norm, add = (
            (moefuse.gemma_rmsnorm, moefuse.gemma_fused_add_rmsnorm)
            if gc
            else (moefuse.rmsnorm, moefuse.fused_add_rmsnorm)
        )
        q, s = moefuse.rmsnorm_group_quant(x, w, **kw)
        uq, us = moefuse.per_token_group_quant_8bit(norm(x, w, impl="triton"), gs, **qkw)
        assert_bitwise_equal(q, uq, f"rmsnorm_group_quant codes H={h}")
        assert_bitwise_equal(s, us, f"rmsnorm_group_quant scales H={h}")
        xk, rk, xu, ru = x.clone(), r.clone(), x.clone(), r.clone()
        q, s = moefuse.fused_add_rmsnorm_group_quant(xk, rk, w, **kw)
        add(xu, ru, w, impl="triton")
        uq, us = moefuse.per_token_group_quant_8bit(xu, gs, **qkw)
        assert_bitwise_equal(xk, x, "input untouched")
        assert_bitwise_equal(rk, ru, "residual = fused_add_rmsnorm's")
        assert_bitwise_equal(q, uq, f"fused_add codes H={h}")
        assert_bitwise_equal(s, us, f"fused_add scales H={h}")


@pytest.mark.parametrize("h, m", [(200, 40), (2880, 5)], ids=["multi-row", "one-row"])
def test_launch_modes_change_no_bit(h, m, seed):
    """The persistent row loop with prefetch (the interpreter counts one SM, so each program
    walks several row tiles) and other standalone tiles give the default launch's bits."""
    from moefuse.quant.group_fused import launch_norm_group_quant
    from moefuse.quant.group_triton import launch_group_quant

    x, w, r = _specials(_rand(m + 2, h, scale=2.0))[2:], _rand(h), _rand(m, h)
    g = -(-h // 128)
    for res in (None, r):
        outs = []
        for per_sm in (0, 2, 4):
            q, s = torch.empty(m, h, dtype=torch.uint8), poison_(torch.empty(m, g))
            rr = res.clone() if res is not None else None
            launch_norm_group_quant(
                x, rr, w, q, s, 128, 1e-6, 0.0, 1e-10, False, False, False, per_sm=per_sm
            )
            outs.append((q, s) if rr is None else (q, s, rr))
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                assert_bitwise_equal(a, b, f"persistent loop == one tile per program H={h}")
    outs = []
    for tile in (None, (8, 1024, 8), (1, 2048, 8), (8, 512, 4)):
        q, s = torch.empty(m, h, dtype=torch.uint8), poison_(torch.empty(m, g))
        launch_group_quant(x, q, s, 128, 1e-10, False, False, False, tile=tile)
        outs.append((q, s))
    for q, s in outs[1:]:
        assert_bitwise_equal(q, outs[0][0], f"standalone codes, other tile, H={h}")
        assert_bitwise_equal(s, outs[0][1], f"standalone scales, other tile, H={h}")


@pytest.mark.parametrize("h, m", [(2880, 3), (7168, 2)], ids=["one-pass", "stepped"])
def test_reloaded_store_changes_no_bit(h, m, seed):
    """rmsnorm_group_quant's store re-reading the row in chunks after the row sum (``reload``:
    every chunk width the tile takes, one tile per program and the persistent loop) gives the
    default launch's bits, Gemma gains and special values included; rows with a residual and
    chunks the tile cannot take are refused."""
    from moefuse.quant.group_fused import launch_norm_group_quant

    x, w = _specials(_rand(m + 2, h, scale=2.0))[2:], _rand(h)
    g = -(-h // 128)

    def run(reload, per_sm=0, gc=1.0, res=None):
        q, s = torch.empty(m, h, dtype=torch.uint8), poison_(torch.empty(m, g))
        launch_norm_group_quant(
            x, res, w, q, s, 128, 1e-6, gc, 1e-10, False, False, False, per_sm=per_sm,
            reload=reload,
        )  # fmt: skip
        return q, s

    base = run(0)
    variants = [(1024, 0), (2048, 0), (4096, 0), (1024, 2)] if h == 2880 else [(4096, 0)]
    for reload, per_sm in variants:
        q, s = run(reload, per_sm)
        assert_bitwise_equal(q, base[0], f"codes, reload={reload} per_sm={per_sm} H={h}")
        assert_bitwise_equal(s, base[1], f"scales, reload={reload} per_sm={per_sm} H={h}")
    with pytest.raises(ValueError, match="reload"):
        run(1024, res=_rand(m, h))
    with pytest.raises(ValueError, match="reload"):
        run(64 if h == 2880 else 2048)


def test_store_plan_follows_rows():
    """The stepped rows' re-reading store (capped) serves from RELOAD_STEPPED_MIN_ROWS rows;
    fewer rows keep the store on the tile, uncapped (same bits: the test above)."""
    from moefuse.quant import group_fused as gf

    tile = gf.norm_group_tile(7168, False)
    assert tile.stepped
    few, many = gf.RELOAD_STEPPED_MIN_ROWS - 1, gf.RELOAD_STEPPED_MIN_ROWS
    assert gf.store_plan(tile, False, 128, True, True, few) == (0, None)
    assert gf.store_plan(tile, False, 128, True, True, many) == (
        tile.block,
        gf.RELOAD_STEPPED_MAXNREG,
    )
    assert gf.store_plan(tile, False, 128, True, False, many) == (0, None)  # looped rows
    assert gf.store_plan(tile, True, 128, True, True, many) == (0, None)  # with a residual


def test_fused_references_are_the_chain(seed):
    x, w, r = _rand(4, 96), _rand(96), _rand(4, 96)
    q, s = moefuse.rmsnorm_group_quant(x, w, group_size=32, impl="reference")
    eq, es = moefuse.per_token_group_quant_8bit(
        moefuse.rmsnorm(x, w, impl="reference"), 32, impl="reference"
    )
    assert_bitwise_equal(q, eq, "codes")
    assert_bitwise_equal(s, es, "scales")
    rr, ru = r.clone(), r.clone()
    q, s = moefuse.fused_add_rmsnorm_group_quant(x, rr, w, group_size=32, impl="reference")
    xu = x.clone()
    moefuse.fused_add_rmsnorm(xu, ru, w, impl="reference")
    assert_bitwise_equal(rr, ru, "residual")
    assert_bitwise_equal(q, moefuse.per_token_group_quant_8bit(xu, 32, impl="reference")[0], "q")


# ----------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_bad_inputs(impl):
    x, w, r = _rand(4, 96), _rand(96), _rand(4, 96)
    out = poison_(torch.empty(4, 96, dtype=E4M3))
    sc = poison_(torch.empty(4, 3))
    q = moefuse.per_token_group_quant_8bit
    expect_value_error(lambda: q(x, 48, impl=impl), "group_size")
    expect_value_error(lambda: q(x, 512, impl=impl), "group_size")
    expect_value_error(lambda: q(x, 32, dst_dtype=torch.float8_e5m2, impl=impl), "dst_dtype")
    expect_value_error(lambda: q(x, 32, scale_tma_aligned=True, impl=impl), "scale_tma_aligned")
    expect_value_error(lambda: q(x, 32, eps=-1.0, impl=impl), "eps")
    expect_value_error(lambda: q(x, 32, out=out, scale_out=sc[:, :2], impl=impl), "scale_out", out)
    e8 = torch.empty(4, 3, dtype=E8M0)
    expect_value_error(lambda: q(x, 32, out=out, scale_out=e8, impl=impl), "scale_out", out)
    overlapping = torch.zeros(4, 1).expand(4, 3)
    expect_value_error(lambda: q(x, 32, scale_out=overlapping, impl=impl), "scale_out")
    expect_value_error(lambda: q(x, 32, out=x.view(torch.uint8)[:, :96].view(E4M3)), "out", x)
    expect_value_error(lambda: q(x.to(torch.int32), 32, impl=impl), "x")
    expect_value_error(
        lambda: q(x, 32, out=torch.empty(96, 4, dtype=E4M3).t(), impl=impl), "out", x
    )
    rq = moefuse.rmsnorm_group_quant
    expect_value_error(lambda: rq(x.float(), w, impl=impl), "input")
    expect_value_error(lambda: rq(x, w, group_size=33, impl=impl), "group_size")
    expect_value_error(lambda: rq(x, w, quant_eps=float("nan"), impl=impl), "quant_eps")
    expect_value_error(lambda: rq(x, w, out=out, scale_out=x.float()[:, :3]), "scale_out", out)
    fq = moefuse.fused_add_rmsnorm_group_quant
    expect_value_error(lambda: fq(x, x, w, impl=impl), "residual", x)
    expect_value_error(
        lambda: fq(x, r, w, out=r.view(torch.uint8)[:, :96].view(E4M3), impl=impl), "out", r
    )


def test_supports_and_compat(seed):
    x, w, r = _rand(3, 256), _rand(256), _rand(3, 256)
    # the interpreter runs the kernels on CPU tensors: only the arguments decide here
    assert moefuse.supports_per_token_group_quant_8bit(x, 128)
    assert not moefuse.supports_per_token_group_quant_8bit(x, 100)
    assert not moefuse.supports_per_token_group_quant_8bit(x, 128, torch.float8_e5m2)
    assert moefuse.supports_rmsnorm_group_quant(x, w)
    assert not moefuse.supports_rmsnorm_group_quant(x.float(), w)
    assert moefuse.supports_fused_add_rmsnorm_group_quant(x, r, w)
    assert not moefuse.supports_fused_add_rmsnorm_group_quant(x, x, w)
    q, s = fi.per_token_group_quant_8bit(x, 128, 1e-10, torch.int8)
    eq, es = ref.per_token_group_quant_8bit_reference(x, 128, 1e-10, torch.int8)
    assert_bitwise_equal(q, eq, "compat codes")
    assert_bitwise_equal(s, es, "compat scales")
