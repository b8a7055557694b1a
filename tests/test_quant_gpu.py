"""FP8 / NVFP4 quantization on an SM90+ GPU at the issue's shapes (M in {1, 100, 128, 1000, 4096},
H in {64, 2880, 4096, 7168, 8192}).

* Encoders: the hardware FP8 conversion (PTX path) against the integer/add.rn software encoder
  over ALL 2^32 FP32 bit patterns; the GPU-compiled software E2M1 against an independent threshold
  encoder over all 2^32 patterns; both against the CPU reference on random patterns.
* Standalone ops bit-exact against the reference run on the GPU ("fast" NVFP4 recipe with the
  device's rcp.approx.ftz as the reference's reciprocal; against IEEE reciprocals <= 1e-3 of codes
  may differ, by one step; spec: Tests). Scale bytes and padding always bit-exact.
* Fused ops: residual bit-exact; FP8 codes within one step of the reference (rsqrt.approx);
  NVFP4 bytes bit-exact against the reference NVFP4 of the kernel's own rounded norm output, which
  is itself within 1 BF16 ulp of the reference norm.
* Eager PDL on / off and CUDA-graph replay bitwise equal; batch invariance; no recompilation across
  token counts; torch.compile (inductor) == eager.
"""

import pytest
import torch
import triton
import triton.language as tl

import moefuse
from moefuse._device import widen_bf16_pairs
from moefuse.norm import reference as norm_ref
from moefuse.quant import device as D
from moefuse.quant import formats as F
from moefuse.quant import reference as ref
from moefuse.quant.triton import rcp_approx
from moefuse.testing import assert_bitwise_equal, assert_close, poison_, run_eager_pdl_and_graph

pytestmark = pytest.mark.gpu

DEV = "cuda"
TOKENS = [1, 100, 128, 1000, 4096]
WIDTHS = [64, 2880, 4096, 7168, 8192]
LAYOUTS = list(F.LAYOUTS)
RECIPES = list(F.RECIPES)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _gs(x):
    return (448.0 * 6.0 / x.float().abs().amax().clamp_min(1e-12)).reshape(1)


def _with_specials(x):
    flat = x.view(-1)
    n = flat.numel()
    for i, s in enumerate([float("nan"), float("inf"), -float("inf"), -0.0, 1e30, 1e-30][:n]):
        flat[(i * 7919) % n] = s
    return x


# ----------------------------------------------------------------------------- encoders
@triton.jit
def _sweep_kernel(out_ptr, base, BLOCK: tl.constexpr):
    """Mismatch counts over FP32 bit patterns base + [pid * BLOCK, (pid + 1) * BLOCK)."""
    pid = tl.program_id(0)
    bits = (base + pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)).to(tl.uint32)
    x = bits.to(tl.float32, bitcast=True)
    sw4 = D.fp8_encode(x, 0, False)
    # both GPU E4M3 paths: four elements per inline-PTX instance, and Triton's conversion
    bad4 = (D.fp8_encode(x, 0, True) != sw4) | (D.fp8_encode(x, 0, True, False) != sw4)
    bad5 = D.fp8_encode(x, 1, True) != D.fp8_encode(x, 1, False)
    # independent E2M1 encoder: the spec's thresholds as float compares, NaN -> 7
    a = tl.abs(x)
    thr = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    thr = tl.where(x != x, 7, thr) | tl.where(x < 0, 8, 0)
    bad2 = D.e2m1_encode(x, True) != thr
    first = tl.full((BLOCK,), 0xFFFFFFFF, tl.uint32)
    tl.store(out_ptr + pid * 6 + 0, tl.sum(bad4.to(tl.int32)))
    tl.store(out_ptr + pid * 6 + 1, tl.sum(bad5.to(tl.int32)))
    tl.store(out_ptr + pid * 6 + 2, tl.sum(bad2.to(tl.int32)))
    tl.store(out_ptr + pid * 6 + 3, tl.min(tl.where(bad4, bits, first)).to(tl.int32, bitcast=True))
    tl.store(out_ptr + pid * 6 + 4, tl.min(tl.where(bad5, bits, first)).to(tl.int32, bitcast=True))
    tl.store(out_ptr + pid * 6 + 5, tl.min(tl.where(bad2, bits, first)).to(tl.int32, bitcast=True))


def test_encoders_exhaustive_over_all_fp32_patterns():
    block, chunk = 4096, 1 << 30
    names = ("e4m3 hw vs sw", "e5m2 hw vs sw", "e2m1 vs thresholds")
    for base in range(0, 1 << 32, chunk):
        n_prog = chunk // block
        out = torch.empty(n_prog, 6, dtype=torch.int32, device=DEV)
        _sweep_kernel[(n_prog,)](out, base, BLOCK=block, num_warps=8)
        counts = out[:, :3].sum(0).tolist()
        for i, name in enumerate(names):
            if counts[i]:
                first = out[:, 3 + i].view(torch.uint32).to(torch.int64).min().item()
                raise AssertionError(f"{name}: {counts[i]} mismatches, first pattern {first:#010x}")


@triton.jit
def _encode_kernel(x_ptr, e4_ptr, e5_ptr, e2_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(e4_ptr + offs, D.fp8_encode(x, 0, True), mask=mask)
    tl.store(e5_ptr + offs, D.fp8_encode(x, 1, True), mask=mask)
    tl.store(e2_ptr + offs, D.e2m1_encode(x, True).to(tl.uint8), mask=mask)


def test_gpu_encoders_match_cpu_reference():
    g = torch.Generator().manual_seed(7)
    bits = torch.randint(-(2**31), 2**31 - 1, (1 << 22,), generator=g, dtype=torch.int64)
    x = torch.cat([bits.to(torch.int32).view(torch.float32), torch.randn(1 << 20, generator=g) * 8])
    xd = x.to(DEV)
    n = x.numel()
    outs = [torch.empty(n, dtype=torch.uint8, device=DEV) for _ in range(3)]
    _encode_kernel[(triton.cdiv(n, 4096),)](xd, *outs, n, BLOCK=4096)
    assert_bitwise_equal(outs[0].cpu(), F.fp8_bits(x, E4M3), "e4m3 GPU vs CPU reference")
    assert_bitwise_equal(outs[1].cpu(), F.fp8_bits(x, E5M2), "e5m2 GPU vs CPU reference")
    assert_bitwise_equal(outs[2].cpu(), F.e2m1_nibbles(x), "e2m1 GPU vs CPU reference")


@triton.jit
def _widen_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, widen_bf16_pairs(tl.load(x_ptr + offs)))


def test_widen_bf16_pairs_all_patterns():
    """The one-instruction BF16 widening of the NVFP4 kernels equals torch's exact widening on
    all 2^16 BF16 bit patterns (both halves of a pair: even and odd positions)."""
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32, device=DEV).to(torch.int16)
    for shift in (0, 1):  # every pattern at an even and at an odd position
        x = torch.roll(bits, shift).view(torch.bfloat16)
        y = torch.empty(x.numel(), dtype=torch.float32, device=DEV)
        _widen_kernel[(x.numel() // 1024,)](x, y, BLOCK=1024)
        assert_bitwise_equal(y.view(torch.int32), x.float().view(torch.int32), "widen")


def test_rcp_fast_matches_spec_facts():
    six = rcp_approx(torch.tensor([6.0], device=DEV)).cpu()
    assert six.view(torch.int32).item() == 0x3E2AAAAB, "rcp_fast(6.0) == RNE(1/6) (spec: Notation)"
    x = torch.rand(1 << 20, device=DEV) * 100 + 1e-3
    d = (rcp_approx(x).view(torch.int32) - (1.0 / x).view(torch.int32)).abs()
    assert int(d.max()) <= 1, "rcp.approx.ftz.f32 is within 1 ulp of IEEE"


# ----------------------------------------------------------------------------- standalone
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_fp8_quantize_gpu(dtype):
    for m in TOKENS:
        for h in WIDTHS:
            x = _with_specials(_rand(m, h, scale=50.0))
            s = torch.tensor([0.05 if dtype == E4M3 else 1e-3], device=DEV)
            out = poison_(torch.empty(m, h, dtype=dtype, device=DEV))
            moefuse.fp8_quantize(x, s, dtype=dtype, out=out, impl="triton")
            exp = ref.fp8_quantize_reference(x, s, dtype)
            assert_bitwise_equal(out, exp, f"fp8_quantize {m}x{h} {dtype}")


def test_fp8_per_token_and_dequantize_gpu():
    for m in TOKENS:
        for h in WIDTHS:
            x = _rand(m, h, scale=3.0) * torch.rand(m, 1, device=DEV).to(torch.bfloat16)
            q = poison_(torch.empty(m, h, dtype=E4M3, device=DEV))
            s = poison_(torch.empty(m, 1, device=DEV))
            moefuse.fp8_quantize_per_token(x, out=q, scale_out=s, impl="triton")
            eq, es = ref.fp8_quantize_per_token_reference(x)
            assert_bitwise_equal(q, eq, f"per-token codes {m}x{h}")
            assert_bitwise_equal(s, es, f"per-token scales {m}x{h}")
            back = moefuse.fp8_dequantize(q, s, out_dtype=torch.float32, impl="triton")
            assert_bitwise_equal(
                back, ref.fp8_dequantize_reference(q, s, torch.float32), "dequantize"
            )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp4_quantize_gpu(layout):
    n_diff = n_total = 0  # "fast" vs IEEE reciprocals, over all shapes (spec: <= 1e-3)
    for m in TOKENS:
        for h in WIDTHS:
            x = _rand(m, h) * torch.logspace(-2, 2, m, device=DEV)[:, None].to(torch.bfloat16)
            gs = _gs(x)
            for recipe in RECIPES:
                out = poison_(torch.empty(m, h // 2, dtype=torch.uint8, device=DEV))
                sc = poison_(
                    torch.empty(moefuse.scale_shape(m, h, layout), dtype=torch.uint8, device=DEV)
                )
                moefuse.fp4_quantize(
                    x, gs, layout=layout, recipe=recipe, out=out, scale_out=sc, impl="triton"
                )
                ep, es = ref.fp4_quantize_reference(x, gs, layout, recipe, rcp=rcp_approx)
                what = f"fp4 {m}x{h} {layout} {recipe}"
                assert_bitwise_equal(sc, es, f"{what}: scales (padding included)")
                assert_bitwise_equal(out, ep, f"{what}: packed")
                if recipe == "fast":
                    ip, _ = ref.fp4_quantize_reference(x, gs, layout, recipe)  # IEEE reciprocal
                    d = F.e2m1_code_distance(out, ip)
                    assert int(d.max()) <= 1, f"{what}: codes more than one step apart"
                    n_diff, n_total = n_diff + int((d > 0).sum()), n_total + d.numel()
    assert n_diff <= 1e-3 * n_total, f"{n_diff} of {n_total} codes differ (fast vs IEEE rcp)"


def test_fp4_dequantize_round_trip_gpu():
    m, h = 4096, 7168
    x = torch.randn(m, h, device=DEV) * torch.logspace(-1, 1, m, device=DEV)[:, None]
    gs = _gs(x)
    for layout in LAYOUTS:
        p, s = moefuse.fp4_quantize(x, gs, layout=layout, recipe="ieee", impl="triton")
        back = moefuse.fp4_dequantize(p, s, gs, layout=layout, impl="triton")
        assert_bitwise_equal(back, ref.fp4_dequantize_reference(p, s, gs, layout), "dequant")
        sf = F.fp8_values(F.unswizzle_scales(s, m, h // 16, layout))
        unit = (sf / gs).repeat_interleave(16, dim=1)
        a = x.abs() / unit
        half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
        assert ((back - x).abs() <= half_step * unit * (1 + 1e-5)).all(), layout


# ----------------------------------------------------------------------------- fused
def _assert_fp8_close(got, exp, what, tally=None):
    """Codes at most one step apart (rsqrt.approx, row-sum order); the fraction one step off is
    checked over all shapes of a test (``tally``) or, without one, for this case."""
    d = F.fp8_code_distance(got, exp)
    assert int(d.max()) <= 1, f"{what}: FP8 codes {int(d.max())} steps apart"
    if tally is None:
        assert int((d > 0).sum()) <= max(1, 1e-3 * d.numel()), f"{what}: too many codes off"
    else:
        tally[0] += int((d > 0).sum())
        tally[1] += d.numel()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rmsnorm_quant_gpu(dtype):
    tally = [0, 0]
    widths = WIDTHS if dtype == torch.bfloat16 else [2880, 4096]  # bounds compile time
    for m in TOKENS:
        for h in widths:
            x, w, res = _rand(m, h, dtype=dtype), _rand(h, dtype=dtype), _rand(m, h, dtype=dtype)
            s = torch.tensor([0.02], device=DEV)
            gc = float(h % 2 == 0 and m % 2 == 0)
            out = poison_(torch.empty(m, h, dtype=E4M3, device=DEV))
            moefuse.rmsnorm_quant(x, w, s, out=out, gain_center=gc, impl="triton")
            _assert_fp8_close(
                out,
                ref.rmsnorm_quant_reference(x, w, s, 1e-6, E4M3, gc),
                f"rmsnorm_quant {m}x{h}",
                tally,
            )
            r_k = res.clone()
            out = moefuse.fused_add_rmsnorm_quant(x, r_k, w, s, impl="triton")
            eq, er = ref.fused_add_rmsnorm_quant_reference(x, res, w, s, 1e-6, E4M3)
            assert_bitwise_equal(r_k, er, f"fused add residual {m}x{h}")
            _assert_fp8_close(out, eq, f"fused_add_rmsnorm_quant {m}x{h}", tally)
    assert tally[0] <= 1e-3 * tally[1], f"{tally[0]} of {tally[1]} FP8 codes one step off"
    x, w = _rand(33, 4096, dtype=dtype), _rand(4096, dtype=dtype)
    s = torch.tensor([0.5], device=DEV)
    _assert_fp8_close(
        moefuse.rmsnorm_quant(x, w, s, dtype=E5M2, impl="triton"),
        ref.rmsnorm_quant_reference(x, w, s, 1e-6, E5M2),
        "E5M2",
    )


def _fp4_fused_case(m, h, layout, recipe, residual: bool):
    x, w = _rand(m, h, scale=2.0), _rand(h)
    res = _rand(m, h) if residual else None
    gs = torch.tensor([448.0 * 6.0 / 10.0], device=DEV)
    norm_out = poison_(torch.empty_like(x))
    out = poison_(torch.empty(m, h // 2, dtype=torch.uint8, device=DEV))
    sc = poison_(torch.empty(moefuse.scale_shape(m, h, layout), dtype=torch.uint8, device=DEV))
    kw = dict(layout=layout, recipe=recipe, out=out, scale_out=sc, norm_out=norm_out, impl="triton")
    what = f"{'fused_add_' if residual else ''}rmsnorm_fp4 {m}x{h} {layout} {recipe}"
    if residual:
        r_k = res.clone()
        moefuse.fused_add_rmsnorm_fp4_quantize(x, r_k, w, gs, **kw)
        y_ref, r_ref = norm_ref.fused_add_rmsnorm_reference(x, res, w)
        assert_bitwise_equal(r_k, r_ref, f"{what}: residual")
    else:
        moefuse.rmsnorm_fp4_quantize(x, w, gs, **kw)
        y_ref = norm_ref.rmsnorm_reference(x, w)
    assert_close(norm_out, y_ref, "rsqrt_half", f"{what}: norm_out")
    ep, es = ref.fp4_quantize_reference(norm_out, gs, layout, recipe, rcp=rcp_approx)
    assert_bitwise_equal(sc, es, f"{what}: scales == nvfp4(own norm_out)")
    assert_bitwise_equal(out, ep, f"{what}: packed == nvfp4(own norm_out)")


@pytest.mark.parametrize("residual", [False, True])
def test_rmsnorm_fp4_quantize_gpu(residual):
    for m in TOKENS:
        for i, h in enumerate(WIDTHS):
            _fp4_fused_case(m, h, LAYOUTS[i % 3], RECIPES[i % 2], residual)
    for layout in LAYOUTS:
        for recipe in RECIPES:
            _fp4_fused_case(1000, 4096, layout, recipe, residual)


def test_fused_fp4_without_norm_out_writes_same_bytes():
    m, h = 1000, 2880
    x, w, gs = _rand(m, h), _rand(h), torch.tensor([300.0], device=DEV)
    n = torch.empty_like(x)
    a = moefuse.rmsnorm_fp4_quantize(x, w, gs, norm_out=n, impl="triton")
    b = moefuse.rmsnorm_fp4_quantize(x, w, gs, impl="triton")
    assert_bitwise_equal(a[0], b[0], "packed")
    assert_bitwise_equal(a[1], b[1], "scales")


def test_wide_rows_chunked_path_gpu():
    for h in (20000, 20480):
        x, w, res = _rand(3, h), _rand(h), _rand(3, h)
        s = torch.tensor([0.02], device=DEV)
        _assert_fp8_close(
            moefuse.rmsnorm_quant(x, w, s, impl="triton"),
            ref.rmsnorm_quant_reference(x, w, s),
            f"wide fp8 {h}",
        )
        r_k = res.clone()
        q = moefuse.fused_add_rmsnorm_quant(x, r_k, w, s, impl="triton")
        eq, er = ref.fused_add_rmsnorm_quant_reference(x, res, w, s)
        assert_bitwise_equal(r_k, er, f"wide fused add residual {h}")
        _assert_fp8_close(q, eq, f"wide fused add fp8 {h}")
        if h % 16 == 0:
            _fp4_fused_case(3, h, "swizzled_128x4", "fast", True)


# ----------------------------------------------------------------------------- execution modes
@pytest.mark.parametrize("m", [1, 1000])
def test_eager_pdl_and_graph_replay_bitwise(m):
    h = 4096
    x, w, res0 = _rand(m, h), _rand(h), _rand(m, h)
    s, gs = torch.tensor([0.02], device=DEV), torch.tensor([300.0], device=DEV)

    def make():
        return (
            torch.empty(m, h, dtype=torch.uint8, device=DEV),
            torch.empty(m, h, dtype=torch.uint8, device=DEV),
            torch.empty(m, 1, device=DEV),
            torch.empty(m, h // 2, dtype=torch.uint8, device=DEV),
            torch.empty(moefuse.scale_shape(m, h), dtype=torch.uint8, device=DEV),
            torch.empty(m, h // 2, dtype=torch.uint8, device=DEV),
            torch.empty(moefuse.scale_shape(m, h, "linear"), dtype=torch.uint8, device=DEV),
            torch.empty(m, h // 2, dtype=torch.uint8, device=DEV),
            torch.empty(moefuse.scale_shape(m, h, "swizzled_8x4"), dtype=torch.uint8, device=DEV),
        )

    def run(o, pdl):
        r = res0.clone()  # the fused-add op updates the residual: every run starts from res0
        moefuse.rmsnorm_quant(x, w, s, out=o[0].view(E4M3), enable_pdl=pdl, impl="triton")
        moefuse.fp8_quantize_per_token(
            x, out=o[1].view(E4M3), scale_out=o[2], enable_pdl=pdl, impl="triton"
        )
        moefuse.fp4_quantize(x, gs, out=o[3], scale_out=o[4], enable_pdl=pdl, impl="triton")
        moefuse.rmsnorm_fp4_quantize(
            x,
            w,
            gs,
            layout="linear",
            recipe="ieee",
            out=o[5],
            scale_out=o[6],
            enable_pdl=pdl,
            impl="triton",
        )
        moefuse.fused_add_rmsnorm_fp4_quantize(
            x,
            r,
            w,
            gs,
            layout="swizzled_8x4",
            out=o[7],
            scale_out=o[8],
            enable_pdl=pdl,
            impl="triton",
        )

    results = run_eager_pdl_and_graph(run, make)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_bitwise_equal(a, b, f"PDL off / graph replay, M={m}")


def test_batch_invariance_gpu():
    m, h = 4096, 7168
    x, w, res = _rand(m, h), _rand(h), _rand(m, h)
    s, gs = torch.tensor([0.02], device=DEV), torch.tensor([300.0], device=DEV)
    q_all = moefuse.rmsnorm_quant(x, w, s, impl="triton")
    p_all, s_all = moefuse.fused_add_rmsnorm_fp4_quantize(
        x, res.clone(), w, gs, layout="linear", impl="triton"
    )
    # 7168 columns: stepped FP8 rows, looped at 4096 rows and unrolled for a row alone
    qa_all = moefuse.fused_add_rmsnorm_quant(x, res.clone(), w, s, impl="triton")
    for i in (0, 1, 777, 4095):
        sl = slice(i, i + 1)
        assert_bitwise_equal(
            moefuse.rmsnorm_quant(x[sl], w, s, impl="triton")[0], q_all[i], f"fp8 row {i}"
        )
        qa = moefuse.fused_add_rmsnorm_quant(x[sl], res[sl].clone(), w, s, impl="triton")
        assert_bitwise_equal(qa[0], qa_all[i], f"fused_add fp8 row {i}")
        p, sc = moefuse.fused_add_rmsnorm_fp4_quantize(
            x[sl], res[sl].clone(), w, gs, layout="linear", impl="triton"
        )
        assert_bitwise_equal(p[0], p_all[i], f"fp4 packed row {i}")
        assert_bitwise_equal(sc[0], s_all[i], f"fp4 scales row {i}")


def _variants(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_new_token_count_never_recompiles():
    from moefuse.quant import fused as qf
    from moefuse.quant import triton as qt

    h = 4096
    x, w, r = _rand(4096, h), _rand(h), _rand(4096, h)
    x7, w7, r7 = _rand(4096, 7168), _rand(7168), _rand(4096, 7168)
    s, gs = torch.tensor([0.02], device=DEV), torch.tensor([300.0], device=DEV)

    def call(m):
        moefuse.rmsnorm_quant(x[:m], w, s, impl="triton")
        moefuse.fused_add_rmsnorm_quant(x[:m], r[:m], w, s, impl="triton")  # stepped rows
        moefuse.fused_add_rmsnorm_quant(x7[:m], r7[:m], w7, s, impl="triton")  # + looped mode
        moefuse.rmsnorm_fp4_quantize(x[:m], w, gs, impl="triton")
        moefuse.fp4_quantize(x[:m], gs, impl="triton")
        moefuse.fp8_quantize(x[:m], s, impl="triton")

    call(1)
    kernels = (
        qf._rmsnorm_fp8_kernel,
        qf._rmsnorm_fp4_kernel,
        qt._fp4_quantize_kernel,
        qt._fp8_quantize_kernel,
    )
    before = [_variants(k) for k in kernels]
    for m in (2, 3, 16, 17, 100, 127, 128, 129, 1000, 4096):
        call(m)
    torch.cuda.synchronize()
    assert [_variants(k) for k in kernels] == before


def test_torch_compile_inductor_and_opcheck_gpu():
    from moefuse.quant import ops

    m, h = 33, 2880
    x, w, r = _rand(m, h), _rand(h), _rand(m, h)
    s, gs = torch.tensor([0.02], device=DEV), torch.tensor([300.0], device=DEV)
    u8 = lambda *shape: torch.empty(*shape, dtype=torch.uint8, device=DEV)  # noqa: E731
    torch.library.opcheck(ops.rmsnorm_quant_op, (x, w, s, u8(m, h), 0, 1e-6, 0.0, True))
    torch.library.opcheck(
        ops.fused_add_rmsnorm_fp4_quantize_op,
        (
            x,
            r.clone(),
            w,
            gs,
            u8(m, h // 2),
            u8(128, h // 16),
            None,
            1e-6,
            0.0,
            "swizzled_128x4",
            "fast",
            True,
        ),
    )

    def layer(x, r, w):
        q = moefuse.fused_add_rmsnorm_quant(x, r, w, s)
        p, sc = moefuse.rmsnorm_fp4_quantize(x, w, gs)
        return q.view(torch.uint8), p, sc

    r_e, r_c = r.clone(), r.clone()
    expected = layer(x, r_e, w)
    got = torch.compile(layer, fullgraph=True)(x, r_c, w)
    for g, e in zip(got, expected):
        assert_bitwise_equal(g, e, "inductor == eager")
    assert_bitwise_equal(r_c, r_e, "residual under compile")
