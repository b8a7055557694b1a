"""Quantization formats and standalone quantizers on CPU (spec: Quantization).

The format primitives of ``moefuse.quant.formats`` (the reference) are checked against independent
brute-force oracles (nearest representable value, ties to the even code); the Triton device
functions and kernels run in the interpreter and must reproduce the reference bit for bit
(scale bytes, codes, packing, padding)."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import moefuse
from moefuse.quant import device as D
from moefuse.quant import formats as F
from moefuse.testing import assert_bitwise_equal, poison_

pytestmark = pytest.mark.interpreter

LAYOUTS = list(F.LAYOUTS)
RECIPES = list(F.RECIPES)
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _bits_to_f32(bits) -> torch.Tensor:
    return torch.tensor(np.asarray(bits, dtype=np.uint32).view(np.int32)).view(torch.float32)


def _probe_values(seed=0, n=200_000) -> torch.Tensor:
    """Random FP32 bit patterns, scaled normals, every FP8/E2M1 tie and its neighbours."""
    g = torch.Generator().manual_seed(seed)
    rand_bits = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)
    parts = [_bits_to_f32(rand_bits.numpy().astype(np.uint64))]
    for s in (1e-4, 1e-2, 1.0, 3.0, 100.0, 1e4):
        parts.append(torch.randn(n // 8, generator=g) * s)
    ties = []
    for dtype in FP8:
        v = F.fp8_values(torch.arange(256, dtype=torch.uint8), dtype)
        v = v[torch.isfinite(v)].double().sort().values
        ties.append(((v[1:] + v[:-1]) / 2).float())
    ties.append(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 448.0, 464.0]))
    t = torch.cat(ties)
    parts += [
        t,
        torch.nextafter(t, torch.full_like(t, np.inf)),
        torch.nextafter(t, torch.full_like(t, -np.inf)),
    ]
    special = torch.tensor([0.0, 1e-45, 1e-40, 2.0**-126, 3e38, np.inf, np.nan])
    parts.append(special)
    x = torch.cat(parts)
    return torch.cat([x, -x])


def _assert_equal_nan_aware(actual, expected, what):
    """Bitwise equal except that any NaN matches any NaN (payloads are not part of the contract)."""
    assert torch.equal(actual.isnan(), expected.isnan()), f"{what}: NaN positions differ"
    fill = torch.zeros((), dtype=actual.dtype)
    a = actual.where(~actual.isnan(), fill)
    assert_bitwise_equal(a, expected.where(~expected.isnan(), fill), what)


# ----------------------------------------------------------------------------- oracles
def _fp8_oracle(x: torch.Tensor, dtype) -> torch.Tensor:
    """Nearest finite FP8 value (distance in FP64), ties to the even byte; saturate; NaN -> 0x7F."""
    man, bias, max_byte = (3, 7, 0x7E) if dtype == torch.float8_e4m3fn else (2, 15, 0x7B)
    codes = torch.arange(max_byte + 1, dtype=torch.int64)
    e, m = codes >> man, codes & ((1 << man) - 1)
    vals = torch.where(
        e == 0,
        m.double() * 2.0 ** (1 - bias - man),
        (1 + m.double() / 2**man) * torch.pow(2.0, (e - bias).double()),
    )
    a = x.double().abs()
    out = torch.empty(x.shape, dtype=torch.int64)
    for chunk in torch.arange(x.numel()).split(20_000):
        d = (a[chunk, None] - vals[None, :]).abs()
        best = d.min(dim=1, keepdim=True).values
        cand = (d == best) & torch.isfinite(d)
        # among equidistant codes take the even one (ties to even); unique otherwise
        even = cand & (codes[None, :] % 2 == 0)
        pick = torch.where(even.any(1), even.int().argmax(1), cand.int().argmax(1))
        out[chunk] = pick
    out = torch.where(a >= vals[-1], torch.full_like(out, max_byte), out)
    out = out | (torch.signbit(x).long() << 7)
    return torch.where(torch.isnan(x), torch.full_like(out, 0x7F), out).to(torch.uint8)


def _e2m1_oracle(x: torch.Tensor) -> torch.Tensor:
    vals = torch.tensor(F.E2M1_VALUES, dtype=torch.float64)
    a = x.double().abs()
    d = (a[:, None] - vals[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = d == best
    even = cand & (torch.arange(8)[None, :] % 2 == 0)
    code = torch.where(even.any(1), even.int().argmax(1), cand.int().argmax(1))
    code = torch.where(a > 6, 7, code)
    code = torch.where(torch.isnan(x), 7, code)
    return (code | ((x < 0).long() << 3)).to(torch.uint8)


def _nvfp4_numpy_oracle(v: np.ndarray, gs: float, recipe: str):
    """Per-block recipe with numpy float32 scalars (each op one IEEE rounding)."""
    f = np.float32
    m, h = v.shape
    nib = np.zeros((m, h), dtype=np.uint8)
    sf = np.zeros((m, h // 16), dtype=np.uint8)
    gs32, r6 = f(gs), np.array([0x3E2AAAAB], dtype=np.uint32).view(np.float32)[0]
    with np.errstate(all="ignore"):
        for i in range(m):
            for k in range(h // 16):
                blk = v[i, 16 * k : 16 * k + 16].astype(np.float32)
                amax = f(np.nan) if np.isnan(blk).any() else f(np.abs(blk).max())
                sf_f32 = f(gs32 * f(amax * r6))
                byte = int(_fp8_oracle(torch.tensor([sf_f32]), torch.float8_e4m3fn)[0])
                s = F.fp8_values(torch.tensor([byte], dtype=torch.uint8)).item()
                s = f(s)
                if s == 0:
                    os_ = f(0)
                elif recipe == "fast":
                    os_ = f(f(1) / f(s * f(f(1) / gs32)))
                else:
                    os_ = f(gs32 / s)
                q = (np.abs(blk) * os_).astype(np.float32)
                codes = _e2m1_oracle(torch.from_numpy(q)).numpy() & 7
                nib[i, 16 * k : 16 * k + 16] = codes | np.where(blk < 0, 8, 0).astype(np.uint8)
                sf[i, k] = byte
    return nib, sf


# ----------------------------------------------------------------------------- formats vs oracles
@pytest.mark.parametrize("dtype", FP8)
def test_fp8_bits_match_nearest_value_oracle(dtype):
    x = _probe_values(n=40_000)
    assert_bitwise_equal(F.fp8_bits(x, dtype), _fp8_oracle(x, dtype), f"fp8 {dtype}")


def test_e2m1_nibbles_match_nearest_value_oracle():
    x = _probe_values(n=40_000)
    assert_bitwise_equal(F.e2m1_nibbles(x), _e2m1_oracle(x), "e2m1")
    # the spec's tie cases, spelled out: ties go to the even code
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 100.0, -0.0])
    expect = torch.tensor([0, 2, 2, 4, 4, 6, 6, 10, 7, 0], dtype=torch.uint8)
    assert_bitwise_equal(F.e2m1_nibbles(ties), expect, "e2m1 ties")


@pytest.mark.parametrize("recipe", RECIPES)
def test_nvfp4_reference_matches_numpy_oracle(recipe, seed):
    v = (torch.randn(6, 64) * torch.logspace(-3, 3, 6)[:, None]).bfloat16().float()
    v[0, :16] = 0.0  # zero block
    v[1, :16] = 1e-30  # amax > 0 but the scale byte underflows: zero block, not infinite scale
    v[2, 16:32] = torch.inf
    v[3, 32] = torch.nan
    v[4, 48:64] = -0.0
    gs = torch.tensor([448 * 6 / 50.0])
    nib, sf = F.nvfp4_block_quant(v, gs, recipe)
    onib, osf = _nvfp4_numpy_oracle(v.numpy(), gs.item(), recipe)
    assert_bitwise_equal(sf, torch.from_numpy(osf), "scale bytes")
    assert_bitwise_equal(nib, torch.from_numpy(onib), "codes")
    assert sf[0, 0] == 0 and sf[1, 0] == 0 and (nib[1, :16] == 0).all()
    assert sf[2, 1] == 0x7E and sf[3, 2] == 0x7F
    assert (nib[2, 16:32] == 7).all()


@pytest.mark.parametrize("layout", ["swizzled_128x4", "swizzled_8x4", "linear"])
@pytest.mark.parametrize("m,kb", [(1, 1), (3, 5), (130, 12), (257, 4)])
def test_scale_layout_permute_matches_offset_formula(layout, m, kb):
    sf = torch.randint(1, 256, (m, kb), dtype=torch.uint8)
    sw = F.swizzle_scales(sf, layout)
    assert tuple(sw.shape) == F.scale_layout_shape(m, kb, layout)
    flat = sw.reshape(-1)
    off = F.scale_offsets(m, kb, layout).reshape(-1)
    assert_bitwise_equal(flat[off], sf.reshape(-1), "offset formula == permute layout")
    pad = torch.ones(flat.numel(), dtype=torch.bool)
    pad[off] = False
    assert (flat[pad] == 0).all(), "padding bytes are 0"
    assert_bitwise_equal(F.unswizzle_scales(sw, m, kb, layout), sf, "unswizzle inverts swizzle")


# ----------------------------------------------------------------------------- device functions
@triton.jit
def _encode_kernel(x_ptr, e4_ptr, e5_ptr, e2_ptr, d4_ptr, d5_ptr, de_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(e4_ptr + offs, D.fp8_encode(x, 0, False), mask=mask)
    tl.store(e5_ptr + offs, D.fp8_encode(x, 1, False), mask=mask)
    tl.store(e2_ptr + offs, D.e2m1_encode(x, False).to(tl.uint8), mask=mask)
    byte = offs & 255
    tl.store(d4_ptr + offs, D.fp8_decode(byte, 0), mask=mask & (offs < 256))
    tl.store(d5_ptr + offs, D.fp8_decode(byte, 1), mask=mask & (offs < 256))
    tl.store(de_ptr + offs, D.e2m1_decode(byte & 15), mask=mask & (offs < 16))


def test_device_encoders_and_decoders_match_reference():
    x = _probe_values(seed=1)
    n = x.numel()
    outs = [torch.empty(n, dtype=torch.uint8) for _ in range(3)]
    decs = [torch.empty(256), torch.empty(256), torch.empty(16)]
    _encode_kernel[(triton.cdiv(n, 65536),)](x, *outs, *decs, n, BLOCK=65536)
    assert_bitwise_equal(outs[0], F.fp8_bits(x, torch.float8_e4m3fn), "device e4m3")
    assert_bitwise_equal(outs[1], F.fp8_bits(x, torch.float8_e5m2), "device e5m2")
    assert_bitwise_equal(outs[2], F.e2m1_nibbles(x), "device e2m1")
    codes = torch.arange(256, dtype=torch.uint8)
    for dec, dtype in zip(decs, FP8):
        exp = F.fp8_values(codes, dtype)
        same = (dec.view(torch.int32) == exp.view(torch.int32)) | (dec.isnan() & exp.isnan())
        assert same.all(), f"fp8_decode {dtype}"
    assert_bitwise_equal(decs[2], F.e2m1_values(codes[:16]), "e2m1_decode (incl. -0.0)")


@triton.jit
def _offset_kernel(m_ptr, k_ptr, out_ptr, n_kcols, N: tl.constexpr, LAYOUT: tl.constexpr):
    i = tl.arange(0, N)
    m = tl.load(m_ptr + i)
    k = tl.load(k_ptr + i)
    tl.store(out_ptr + i, D.scale_offset(m, k, n_kcols, LAYOUT))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_scale_offset_int64_rows(layout, seed):
    """``scale_offset`` (32-bit in-tile part, row-tile term in m's width) against the spec's formula
    in Python integers, with int64 rows whose offsets pass 2^31 and 2^32."""
    g = torch.Generator().manual_seed(seed)
    kp = 260  # H = 4160: KB = 260, a multiple of 4
    m = torch.cat(
        [
            torch.randint(0, 1 << 12, (256,), generator=g),
            torch.randint((1 << 31) // kp, (1 << 34) // kp, (256,), generator=g),
        ]
    )
    k = torch.randint(0, kp, (512,), generator=g)
    out = torch.empty(512, dtype=torch.int64)
    _offset_kernel[(1,)](m, k, out, kp, N=512, LAYOUT=F.LAYOUTS[layout])

    def spec(mm, kk):
        if layout == "linear":
            return mm * kp + kk
        if layout == "swizzled_128x4":
            return (
                (mm // 128) * kp * 128
                + (kk // 4) * 512
                + (mm % 32) * 16
                + ((mm % 128) // 32) * 4
                + kk % 4
            )
        return (mm // 8) * kp * 8 + (kk // 4) * 32 + (mm % 8) * 4 + kk % 4

    expect = torch.tensor([spec(a, b) for a, b in zip(m.tolist(), k.tolist())])
    assert_bitwise_equal(out, expect, f"scale_offset {layout}")


@triton.jit
def _e2m1_scaled_kernel(x_ptr, s_ptr, out_ptr, n, BLOCK: tl.constexpr, N_SCALES: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    for i in tl.static_range(N_SCALES):
        q = x * tl.load(s_ptr + i)
        tl.store(out_ptr + i * n + offs, D.e2m1_encode(q, False).to(tl.uint8), mask=mask)


def test_e2m1_encoder_exhaustive_over_bf16_times_scales():
    """Every BF16 pattern times scales that put each binade, tie and the saturation edge under the
    encoder (the software path of ``_e2m1_round``; the GPU suite sweeps all 2^32 FP32 patterns
    through the PTX path)."""
    x = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    scales = torch.tensor([1.0, 0.75, 1.0 / 3, 3.0, 2.0**-20, 2.0**20, 6.0 / 448, 1.0000001])
    out = torch.empty(len(scales), x.numel(), dtype=torch.uint8)
    _e2m1_scaled_kernel[(1,)](x, scales, out, x.numel(), BLOCK=2**16, N_SCALES=len(scales))
    for i, s in enumerate(scales):
        assert_bitwise_equal(out[i], F.e2m1_nibbles(x * s), f"e2m1(bf16 * {s.item()})")


@pytest.mark.parametrize("gs", [448 * 6 / 3e38, 1.0, 448 * 6 / 80.0, 3e4])
def test_nvfp4_blocks_exhaustive_over_bf16(gs, seed):
    """All 2^16 BF16 patterns (NaN, Inf, subnormals, -0.0 included), shuffled into 4096 blocks,
    through ``nvfp4_quantize_blocks`` in the interpreter vs the reference, both recipes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    x = x[torch.randperm(x.numel(), generator=g)].reshape(4096, 16)
    x[::3] = x[::3].nan_to_num(0.0, 0.0, 0.0)  # every third block finite
    gst = torch.tensor([gs])
    for recipe in RECIPES:
        packed, sf = torch.empty(4096, 8, dtype=torch.uint8), torch.empty(4096, dtype=torch.uint8)
        _blocks_kernel[(1,)](x, gst, packed, sf, B=4096, RECIPE=F.RECIPES[recipe])
        nib, esf = F.nvfp4_block_quant(x.reshape(1, -1), gst, recipe)
        assert_bitwise_equal(sf, esf.reshape(4096), f"scale bytes gs={gs} {recipe}")
        assert_bitwise_equal(
            packed, F.pack_nibbles(nib).reshape(4096, 8), f"packed gs={gs} {recipe}"
        )


@triton.jit
def _blocks_kernel(v_ptr, gs_ptr, p_ptr, s_ptr, B: tl.constexpr, RECIPE: tl.constexpr):
    b = tl.arange(0, B)
    v = tl.load(v_ptr + b[:, None] * 16 + tl.arange(0, 16)[None, :])
    gs = tl.load(gs_ptr)
    packed, sf = D.nvfp4_quantize_blocks(v, gs, 1.0 / gs, RECIPE, False)
    tl.store(p_ptr + b[:, None] * 8 + tl.arange(0, 8)[None, :], packed)
    tl.store(s_ptr + b, sf)


@pytest.mark.parametrize("recipe", RECIPES)
def test_device_nvfp4_blocks_entry_point(recipe, seed):
    v = (torch.randn(32, 16) * torch.logspace(-2, 2, 32)[:, None]).bfloat16().float()
    v[3] = 0.0
    v[5, 7] = torch.nan
    gs = torch.tensor([448 * 6 / 80.0])
    packed, sf = torch.empty(32, 8, dtype=torch.uint8), torch.empty(32, dtype=torch.uint8)
    _blocks_kernel[(1,)](v, gs, packed, sf, B=32, RECIPE=F.RECIPES[recipe])
    nib, esf = F.nvfp4_block_quant(v.reshape(1, 512), gs, recipe)
    assert_bitwise_equal(sf, esf.reshape(32), "blocks: scale bytes")
    assert_bitwise_equal(packed, F.pack_nibbles(nib).reshape(32, 8), "blocks: packed")


# ----------------------------------------------------------------------------- FP8 kernels
def _with_specials(x: torch.Tensor) -> torch.Tensor:
    flat = x.view(-1)
    specials = [float("nan"), float("inf"), -float("inf"), -0.0, 1e30, -1e30, 1e-30, 0.0]
    for i, s in enumerate(specials[: flat.numel()]):
        flat[(i * 7) % flat.numel()] = s
    return x


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_quantize_kernel(dtype, in_dtype, seed):
    for shape in [(1, 7), (3, 48), (17, 200), (2, 3, 24), (33,)]:
        for scale in (0.01, 1.0, 10.0):
            x = _with_specials((torch.randn(*shape) * 300).to(in_dtype))
            s = torch.tensor([scale])
            out = poison_(torch.empty(shape, dtype=dtype))
            assert moefuse.fp8_quantize(x, s, dtype=dtype, out=out, impl="triton") is out
            exp = moefuse.fp8_quantize(x, s, dtype=dtype, impl="reference")
            assert_bitwise_equal(out, exp, f"fp8 {shape} scale={scale}")


def test_fp8_quantize_strided_rows(seed):
    base = torch.randn(5, 4, 64).bfloat16()
    x = base[:, 1:3, 8:40]  # 3-D view with padded rows
    s = torch.tensor([0.05])
    got = moefuse.fp8_quantize(x, s, impl="triton")
    assert_bitwise_equal(got, moefuse.fp8_quantize(x.contiguous(), s, impl="reference"), "strided")


def test_fp8_per_token_kernel(seed):
    for shape in [(1, 7), (5, 48), (17, 200), (2, 3, 40), (2, 20000)]:
        x = (torch.randn(*shape) * torch.rand(*shape[:-1], 1) * 50).bfloat16()
        x.view(-1, shape[-1])[0] = 0.0  # zero row: scale floor 2^-9/448
        if x.view(-1, shape[-1]).shape[0] > 2:
            x.view(-1, shape[-1])[1, 3] = torch.nan
            x.view(-1, shape[-1])[2, 0] = torch.inf
        q, s = (
            poison_(torch.empty(shape, dtype=torch.float8_e4m3fn)),
            poison_(torch.empty(*shape[:-1], 1)),
        )
        moefuse.fp8_quantize_per_token(x, out=q, scale_out=s, impl="triton")
        eq, es = moefuse.fp8_quantize_per_token(x, impl="reference")
        assert_bitwise_equal(q, eq, f"per-token codes {shape}")
        _assert_equal_nan_aware(s, es, f"per-token scales {shape}")
    floor = torch.tensor(2.0**-9) / torch.tensor(448.0)
    assert s.view(-1)[0] == floor


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_dequantize_kernel(out_dtype, seed):
    for dtype in FP8:
        q = torch.randint(0, 256, (9, 40), dtype=torch.uint8).view(dtype)
        for scale in (torch.tensor([0.37]), torch.rand(9, 1) + 0.1):
            got = moefuse.fp8_dequantize(q, scale, out_dtype=out_dtype, impl="triton")
            exp = moefuse.fp8_dequantize(q, scale, out_dtype=out_dtype, impl="reference")
            _assert_equal_nan_aware(got, exp, f"dequant {dtype}")


def test_fp8_round_trip_within_half_step(seed):
    x = torch.randn(64, 96) * 20
    scale = torch.tensor([x.abs().max().item() / 448.0])
    q = moefuse.fp8_quantize(x, scale, impl="triton")
    back = moefuse.fp8_dequantize(q, scale, out_dtype=torch.float32, impl="triton")
    # E4M3: 3 mantissa bits -> half step 2^-4 relative; subnormal step 2^-9 * scale
    bound = torch.maximum(x.abs() * 2.0**-4, torch.full_like(x, 2.0**-10 * scale.item()))
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()


# ----------------------------------------------------------------------------- NVFP4 kernels
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp4_quantize_kernel(layout, recipe, seed):
    for m, h in [(1, 16), (3, 48), (17, 208), (130, 32), (40, 528)]:  # 528: 3 column tiles
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = (torch.randn(m, h) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
            gs = torch.tensor([448 * 6 / x.float().abs().max().item()])
            out = poison_(torch.empty(m, h // 2, dtype=torch.uint8))
            sc = poison_(torch.empty(moefuse.scale_shape(m, h, layout), dtype=torch.uint8))
            moefuse.fp4_quantize(
                x, gs, layout=layout, recipe=recipe, out=out, scale_out=sc, impl="triton"
            )
            ep, es = moefuse.fp4_quantize(x, gs, layout=layout, recipe=recipe, impl="reference")
            assert_bitwise_equal(out, ep, f"packed {m}x{h} {dtype}")
            assert_bitwise_equal(sc, es, f"scales {m}x{h} {dtype} (padding included)")


def test_fp4_padding_is_written_by_the_kernel():
    m, h = 3, 32  # 128x4: 125 padding rows and 2 padding block columns
    x = torch.randn(m, h).bfloat16()
    sc = torch.full(moefuse.scale_shape(m, h, "swizzled_128x4"), 0xA5, dtype=torch.uint8)
    moefuse.fp4_quantize(x, torch.tensor([100.0]), scale_out=sc, impl="triton")
    off = F.scale_offsets(m, h // 16, "swizzled_128x4").reshape(-1)
    pad = torch.ones(sc.numel(), dtype=torch.bool)
    pad[off] = False
    assert (sc.reshape(-1)[pad] == 0).all()
    assert (sc.reshape(-1)[off] != 0).all()


def test_fp4_special_blocks_kernel():
    x = torch.randn(4, 64) * 4
    x[0, :16] = 0.0
    x[1, :16] = 1e-30  # scale byte underflows -> zero block (FlashInfer would saturate here)
    x[2, 16:32] = torch.tensor([torch.inf] + [1.0] * 15)
    x[3, 33] = torch.nan
    x[3, :16] = torch.tensor([6.0, -6.0, 100.0, -100.0] * 4)  # saturation within one block
    gs = torch.tensor([1.0])
    for recipe in RECIPES:
        p, s = moefuse.fp4_quantize(x, gs, layout="linear", recipe=recipe, impl="triton")
        ep, es = moefuse.fp4_quantize(x, gs, layout="linear", recipe=recipe, impl="reference")
        assert_bitwise_equal(p, ep, "special packed")
        assert_bitwise_equal(s, es, "special scales")
        assert s[0, 0] == 0 and s[1, 0] == 0 and (p[:2, :8] == 0).all()
        assert s[2, 1] == 0x7E and s[3, 2] == 0x7F
        nib = F.unpack_nibbles(p)
        assert nib[2, 16] == 7 and (nib[3, 32:48] & 7 == 7).all()
    back = moefuse.fp4_dequantize(p, s, gs, layout="linear", impl="triton")
    assert back[3, 32:48].isnan().all(), "a NaN block dequantizes to NaN"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fp4_dequantize_and_round_trip_bound(layout, seed):
    m, h = 19, 96
    x = torch.randn(m, h) * torch.logspace(-1, 1, m)[:, None]
    gs = torch.tensor([448 * 6 / x.abs().max().item()])
    p, s = moefuse.fp4_quantize(x, gs, layout=layout, recipe="ieee", impl="triton")
    back = moefuse.fp4_dequantize(p, s, gs, layout=layout, impl="triton")
    exp = moefuse.fp4_dequantize(p, s, gs, layout=layout, impl="reference")
    assert_bitwise_equal(back, exp, "dequant")
    sf = F.fp8_values(F.unswizzle_scales(s, m, h // 16, layout))
    unit = (sf / gs).repeat_interleave(16, dim=1)  # dequantization step of each element's block
    a = x.abs() / unit
    half_step = torch.where(a < 2, 0.25, torch.where(a < 4, 0.5, 1.0))
    assert ((back - x).abs() <= half_step * unit * (1 + 1e-5)).all()


# ----------------------------------------------------------------------------- contracts
def test_batch_invariance_bitwise(seed):
    x = torch.randn(17, 48).bfloat16()
    gs = torch.tensor([30.0])
    p_all, _ = moefuse.fp4_quantize(x, gs, layout="linear", impl="triton")
    q_all, s_all = moefuse.fp8_quantize_per_token(x, impl="triton")
    for i in (0, 5, 16):
        p1, _ = moefuse.fp4_quantize(x[i : i + 1], gs, layout="linear", impl="triton")
        q1, s1 = moefuse.fp8_quantize_per_token(x[i : i + 1], impl="triton")
        assert_bitwise_equal(p1[0], p_all[i], "fp4 row alone == in batch")
        assert_bitwise_equal(q1[0], q_all[i], "per-token row alone == in batch")
        assert_bitwise_equal(s1[0], s_all[i], "per-token scale alone == in batch")


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_zero_tokens_is_a_no_op(impl):
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    one = torch.tensor([1.0])
    assert moefuse.fp8_quantize(x, one, impl=impl).shape == (0, 64)
    q, s = moefuse.fp8_quantize_per_token(x, impl=impl)
    assert q.shape == (0, 64) and s.shape == (0, 1)
    for layout in LAYOUTS:
        p, sc = moefuse.fp4_quantize(x, one, layout=layout, impl=impl)
        assert p.shape == (0, 32) and sc.numel() == 0
        assert moefuse.fp4_dequantize(p, sc, one, layout=layout, impl=impl).shape == (0, 64)
