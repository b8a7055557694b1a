"""Per-token-group 8-bit ops on an SM90+ GPU: bitwise against the references run on the GPU.

* ``per_token_group_quant_8bit``: every dtype, E4M3 and INT8, FP32 / UE8M0 / E8M0 scales, the
  three scale layouts, strided rows, NaN / Inf / zero groups, partial last groups, H up to 65536.
* ``rmsnorm_group_quant`` / ``fused_add_rmsnorm_group_quant``: fused == the unfused chain
  (moefuse's norm kernel, then the standalone quantizer) bitwise at every row mode (one-pass,
  stepped unrolled and looped, two-pass chunks), == the reference quantization of that norm
  output, residual == ``fused_add_rmsnorm``'s; the norm itself is within the rsqrt tolerance of
  the FP64 reference (as every norm op).
* Eager PDL on / off and CUDA-graph replays bitwise equal; a row alone == in a batch; no
  recompilation across token counts; torch.compile (inductor) == eager; opcheck.
"""

import pytest
import torch

import moefuse
from moefuse.norm import reference as norm_ref
from moefuse.quant import reference as ref
from moefuse.testing import assert_bitwise_equal, assert_close, poison_, run_eager_pdl_and_graph

pytestmark = pytest.mark.gpu

DEV = "cuda"
E4M3, E8M0 = torch.float8_e4m3fn, torch.float8_e8m0fnu


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _specials(x):
    """NaN (and a negative NaN with a payload: its code must still be 0x7F), +-Inf, a zero group
    and a huge value in the first rows (where they exist)."""
    h = x.shape[-1]
    f = x.view(-1, h)
    if f.shape[0] >= 4:
        f[0, h // 3] = float("nan")
        neg_nan = {torch.float32: (torch.int32, -4194303)}.get(x.dtype, (torch.int16, -63))
        f.view(neg_nan[0])[0, (2 * h) // 3] = neg_nan[1]  # 0xFFC00001 / 0xFFC1
        f[1, min(5, h - 1)] = float("inf")
        f[2, h - 1] = -float("inf")
        f[3, : min(128, h)] = 0.0
        f[-1, 0] = 1e30 if x.dtype != torch.float16 else 6e4
    return x


def _poisoned_outs(shape, gs, dst, cm, tma, sdtype=torch.float32):
    from moefuse.quant.group_api import alloc_group_scales

    out = poison_(torch.empty(shape, dtype=dst, device=DEV))
    sc = alloc_group_scales(shape, gs, cm, tma, sdtype, DEV)
    if sc.numel():
        poison_(sc)
    return out, sc


def _check_quant(x, gs, dst, ue8m0, cm=False, tma=False, sdtype=torch.float32, what=""):
    out, sc = _poisoned_outs(x.shape, gs, dst, cm, tma, sdtype)
    moefuse.per_token_group_quant_8bit(
        x, gs, dst_dtype=dst, column_major_scales=cm, scale_tma_aligned=tma,
        scale_ue8m0=ue8m0, out=out, scale_out=sc, impl="triton",
    )  # fmt: skip
    eq, es = ref.per_token_group_quant_8bit_reference(x, gs, 1e-10, dst, ue8m0)
    assert_bitwise_equal(out, eq, f"codes {what}")
    assert_bitwise_equal(sc, es.to(sdtype), f"scales {what}")


# ----------------------------------------------------------------------------- standalone
@pytest.mark.parametrize("h", [64, 2048, 2880, 4096, 7168, 16384, 65536])
def test_per_token_group_quant_gpu(h):
    """E4M3, groups of 128, FP32 row-major scales (the benchmark's configuration) on strided rows
    with NaN / Inf / zero groups, and column-major TMA-aligned scales."""
    for m in (1, 100, 2048) if h <= 16384 else (1, 17):
        x = _specials(_rand(m, h + 64, scale=4.0)[:, 32 : 32 + h])  # strided rows
        _check_quant(x, 128, E4M3, False, what=f"{m}x{h}")
    _check_quant(x, 128, E4M3, False, cm=True, tma=True, what=f"{m}x{h} column-major")


def test_per_token_group_quant_options_gpu():
    """Every dtype, group size, INT8, UE8M0 (FP32 values and E8M0 bytes), every layout, 3-D."""
    i = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for gs in (32, 64, 256):
            x = _specials(_rand(40, 1000, dtype=dtype, scale=3.0))
            dst = (E4M3, torch.int8)[i % 2]
            cm, tma = i % 3 > 0, i % 3 == 2
            _check_quant(x, gs, dst, i % 2 == 0, cm, tma, what=f"{dtype} gs={gs} {dst}")
            i += 1
    x = _specials(_rand(2, 50, 2880, scale=3.0))
    _check_quant(x, 128, E4M3, True, sdtype=E8M0, what="3-D e8m0")
    _check_quant(x, 128, torch.int8, True, cm=True, tma=True, sdtype=E8M0, what="3-D column e8m0")


def test_group_quant_extreme_scales_gpu():
    """eps = 0 with groups whose scale underflows to 0 or to a subnormal, and huge groups; UE8M0
    on and off, E4M3 and INT8."""
    mags = torch.tensor([1e-45, 3e-42, 3e-39, 1e-38, 0.0, 7.0, 1e30, 3e38], device=DEV)
    idx = (torch.arange(8, device=DEV)[:, None] + torch.arange(8, device=DEV)[None, :]) % 8
    x = (torch.randn(8, 8, 32, device=DEV).clamp(-1, 1) * mags[idx][..., None]).reshape(8, 256)
    for ue8m0 in (False, True):
        for dst in (E4M3, torch.int8):
            q, s = moefuse.per_token_group_quant_8bit(
                x, 32, eps=0.0, dst_dtype=dst, scale_ue8m0=ue8m0, impl="triton"
            )
            eq, es = ref.per_token_group_quant_8bit_reference(x, 32, 0.0, dst, ue8m0)
            assert_bitwise_equal(q, eq, f"codes ue8m0={ue8m0} {dst}")
            assert_bitwise_equal(s, es, f"scales ue8m0={ue8m0} {dst}")


def test_reciprocal_quotient_is_the_ieee_division_gpu():
    """The quantizer's reciprocal-and-FMA quotient against the GPU's ``div.rn.f32``:
    2^22 adversarial and random pairs for each of 4 seeds (moefuse.tools.quotient_check)."""
    from moefuse.tools import quotient_check

    for seed in range(4):
        assert quotient_check.check(1 << 21, DEV, seed) > 4 << 20


def test_scale_quotient_is_the_ieee_division_gpu():
    """The division-free group scale ``m / QMAX`` at every FP32 m from 2^-60 through Inf and the
    positive NaNs, E4M3's 448 and INT8's 127 (moefuse.tools.quotient_check.check_all_scales)."""
    from moefuse.tools import quotient_check

    for qmax in (448.0, 127.0):
        assert (
            quotient_check.check_all_scales(qmax, DEV)
            == 0x80000000 - quotient_check.RCP_MIN_EPS_BITS
        )


# ----------------------------------------------------------------------------- fused
def _fused_case(m, h, residual, dtype=torch.bfloat16, gs=128, dst=E4M3, ue8m0=False, gc=0.0):
    x, w = _specials(_rand(m, h, dtype=dtype, scale=2.0)), _rand(h, dtype=dtype)
    kw = dict(group_size=gs, dst_dtype=dst, scale_ue8m0=ue8m0, gain_center=gc, impl="triton")
    out, sc = _poisoned_outs((m, h), gs, dst, m % 2 == 1, m % 2 == 1)
    if residual:
        r = _rand(m, h, dtype=dtype)
        rk, ru = r.clone(), r.clone()
        xk = x.clone()
        moefuse.fused_add_rmsnorm_group_quant(xk, rk, w, out=out, scale_out=sc, **kw)
        assert_bitwise_equal(xk, x, "input untouched")
        y = x.clone()
        add = moefuse.gemma_fused_add_rmsnorm if gc else moefuse.fused_add_rmsnorm
        add(y, ru, w, impl="triton")
        assert_bitwise_equal(rk, ru, f"residual {m}x{h}")
        y_ref, _ = norm_ref.fused_add_rmsnorm_reference(x, r, w, 1e-6, gc)
    else:
        moefuse.rmsnorm_group_quant(x, w, out=out, scale_out=sc, **kw)
        y = (moefuse.gemma_rmsnorm if gc else moefuse.rmsnorm)(x, w, impl="triton")
        y_ref = norm_ref.rmsnorm_reference(x, w, 1e-6, gc)
    what = f"{'add ' if residual else ''}{m}x{h} {dtype} gs={gs} {dst} ue8m0={ue8m0}"
    uq, us = moefuse.per_token_group_quant_8bit(
        y, gs, dst_dtype=dst, scale_ue8m0=ue8m0, impl="triton"
    )
    assert_bitwise_equal(out, uq, f"fused == unfused codes, {what}")
    assert_bitwise_equal(sc, us, f"fused == unfused scales, {what}")
    eq, es = ref.per_token_group_quant_8bit_reference(y, gs, 1e-10, dst, ue8m0)
    assert_bitwise_equal(out, eq, f"reference quantization of the norm, {what}")
    assert_bitwise_equal(sc, es, f"reference scales, {what}")
    h32 = x.float() + (r.float() if residual else 0.0)
    fin = torch.isfinite(h32.square().sum(-1))  # rows whose FP32 sum of squares is finite
    assert_close(y[fin], y_ref[fin], "rsqrt_half", f"norm {what}")


@pytest.mark.parametrize("h", [64, 2048, 2880, 4096, 7168, 8192, 16384, 65536])
@pytest.mark.parametrize("residual", [False, True])
def test_fused_group_quant_gpu(h, residual):
    """The benchmark's configuration (BF16, E4M3, groups of 128) at every row mode: M = 4096
    runs the stepped rows looped, fewer rows unrolled."""
    for m in (1, 100, 4096) if h <= 8192 else (1, 33):
        _fused_case(m, h, residual)


@pytest.mark.parametrize("residual", [False, True])
def test_fused_group_quant_options_gpu(residual):
    """FP16, other group sizes, INT8, UE8M0 scales, Gemma gains, column-major scales."""
    for i, (h, gs) in enumerate(((2880, 64), (7168, 256), (200, 32))):
        _fused_case(
            (3, 64, 5)[i], h, residual, dtype=torch.float16, gs=gs,
            dst=(torch.int8, E4M3)[i % 2], ue8m0=i < 2, gc=float(i % 2),
        )  # fmt: skip


def test_stepped_modes_bitwise_gpu():
    """Stepped rows (rmsnorm 7168, fused_add 4096): unrolled == looped, bitwise."""
    from moefuse.quant.group_fused import launch_norm_group_quant

    for h, res in ((7168, False), (4096, True), (7168, True)):
        x, w, r = _rand(64, h), _rand(h), _rand(64, h)
        outs = []
        for unroll in (True, False):
            q = torch.empty(64, h, dtype=torch.uint8, device=DEV)
            s = poison_(torch.empty(64, h // 128, device=DEV))
            launch_norm_group_quant(
                x, r.clone() if res else None, w, q, s, 128, 1e-6, 0.0, 1e-10, False, False,
                True, unroll=unroll,
            )  # fmt: skip
            outs.append((q, s))
        assert_bitwise_equal(outs[0][0], outs[1][0], f"codes unrolled == looped H={h}")
        assert_bitwise_equal(outs[0][1], outs[1][1], f"scales unrolled == looped H={h}")


def test_reloaded_store_bitwise_gpu():
    """rmsnorm_group_quant's store re-reading the row after the row sum (``reload``, with and
    without the persistent loop and a register cap) == the store on the norm's tile, bitwise."""
    from moefuse.quant.group_fused import launch_norm_group_quant

    cases = ((2880, (1024, 2048, 4096)), (4096, (1024, 2048, 4096)), (7168, (4096,)))
    for h, subs in cases:
        for m in (1, 100, 4096):
            x, w = _specials(_rand(m, h, scale=2.0)), _rand(h)
            outs = []
            for sub, per_sm, maxnreg in (
                [(0, 0, None)]
                + [(s, 0, None) for s in subs]
                + [(subs[0], 4 if h < 7168 else 0, None if h < 7168 else 32)]
            ):
                q = torch.empty(m, h, dtype=torch.uint8, device=DEV)
                sc = poison_(torch.empty(m, -(-h // 128), device=DEV))
                launch_norm_group_quant(
                    x, None, w, q, sc, 128, 1e-6, 0.0, 1e-10, False, False, True,
                    per_sm=per_sm, maxnreg=maxnreg, reload=sub,
                )  # fmt: skip
                outs.append((sub, q, sc))
            for sub, q, sc in outs[1:]:
                assert_bitwise_equal(q, outs[0][1], f"codes reload={sub} {m}x{h}")
                assert_bitwise_equal(sc, outs[0][2], f"scales reload={sub} {m}x{h}")


# ----------------------------------------------------------------------------- execution modes
@pytest.mark.parametrize("m", [1, 1000])
def test_group_eager_pdl_and_graph_replay_bitwise(m):
    h = 7168
    x, w, res0 = _rand(m, h), _rand(h), _rand(m, h)

    def make():
        return tuple(
            t
            for _ in range(3)
            for t in (
                torch.empty(m, h, dtype=torch.uint8, device=DEV),
                torch.empty(m, h // 128, device=DEV),
            )
        )

    def run(o, pdl):
        kw = dict(enable_pdl=pdl, impl="triton")
        moefuse.per_token_group_quant_8bit(x, 128, out=o[0].view(E4M3), scale_out=o[1], **kw)
        moefuse.rmsnorm_group_quant(x, w, out=o[2].view(E4M3), scale_out=o[3], **kw)
        moefuse.fused_add_rmsnorm_group_quant(
            x, res0.clone(), w, out=o[4].view(E4M3), scale_out=o[5], **kw
        )

    results = run_eager_pdl_and_graph(run, make)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_bitwise_equal(a, b, f"PDL off / graph replay, M={m}")


def test_group_batch_invariance_and_no_recompile_gpu():
    from moefuse.quant import group_fused, group_triton

    m = 4096
    for h in (2880, 7168):
        x, w, res = _rand(m, h), _rand(h), _rand(m, h)
        alls = (
            moefuse.per_token_group_quant_8bit(x, 128, impl="triton"),
            moefuse.rmsnorm_group_quant(x, w, impl="triton"),
            moefuse.fused_add_rmsnorm_group_quant(x, res.clone(), w, impl="triton"),
        )
        kernels = (group_triton._group_quant_kernel, group_fused._norm_group_quant_kernel)
        before = [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]
        for i in (0, 1, 777, 4095):
            sl = slice(i, i + 1)
            ones = (
                moefuse.per_token_group_quant_8bit(x[sl], 128, impl="triton"),
                moefuse.rmsnorm_group_quant(x[sl], w, impl="triton"),
                moefuse.fused_add_rmsnorm_group_quant(x[sl], res[sl].clone(), w, impl="triton"),
            )
            for (q1, s1), (qa, sa) in zip(ones, alls):
                assert_bitwise_equal(q1[0], qa[i], f"row {i} alone == in batch, H={h}")
                assert_bitwise_equal(s1[0], sa[i], f"row {i} scales, H={h}")
        for mm in (2, 17, 128, 1000):
            moefuse.rmsnorm_group_quant(x[:mm], w, impl="triton")
            moefuse.fused_add_rmsnorm_group_quant(x[:mm], res[:mm].clone(), w, impl="triton")
            moefuse.per_token_group_quant_8bit(x[:mm], 128, impl="triton")
        after = [sum(len(c[0]) for c in k.device_caches.values()) for k in kernels]
        assert after == before, f"a new token count recompiled (H={h})"


def test_group_torch_compile_and_opcheck_gpu():
    from moefuse.quant import ops

    m, h = 33, 2880
    x, w, r = _rand(m, h), _rand(h), _rand(m, h)
    u8 = torch.empty(m, h, dtype=torch.uint8, device=DEV)
    s = torch.empty(m, h // 128 + 1, device=DEV)
    torch.library.opcheck(ops.per_token_group_quant_8bit_op, (x, u8, s, 128, 1e-10, False, True))
    torch.library.opcheck(
        ops.fused_add_rmsnorm_group_quant_op,
        (x, r.clone(), w, u8, s, 128, 1e-6, 0.0, 1e-10, True, True),
    )

    def f(x, r, w):
        a = moefuse.per_token_group_quant_8bit(x, 128, column_major_scales=True, impl="triton")
        b = moefuse.rmsnorm_group_quant(x, w, scale_ue8m0=True, impl="triton")
        c = moefuse.fused_add_rmsnorm_group_quant(x, r, w, dst_dtype=torch.int8, impl="triton")
        return (*a, *b, *c)

    eager = f(x, r.clone(), w)
    compiled = torch.compile(f, fullgraph=True)(x, r.clone(), w)
    for a, b in zip(eager, compiled):
        assert_bitwise_equal(a, b, "compiled == eager")
