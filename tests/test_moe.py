"""MoE finalize on CPU (spec: MoE): the reference against an exact rational oracle, and the real
Triton kernels in the interpreter against the reference, bit for bit."""

import math
from fractions import Fraction

import pytest
import torch
import triton
import triton.language as tl

import moefuse
from moefuse._device import fma_ftz
from moefuse.moe import reference as ref
from moefuse.testing import assert_bitwise_equal, bits, poison_

DTYPES = [torch.bfloat16, torch.float16]
SCALE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WIDTHS = [1, 7, 48, 200]
TOKENS = [1, 3, 17]
pytestmark = pytest.mark.interpreter


# ----------------------------------------------------------------------------- exact oracle
def _flush(x: float) -> float:
    return math.copysign(0.0, x) if abs(x) < 2.0**-126 else x


def _round_f32(x: Fraction) -> float:
    """Correct RNE rounding of an exact rational to FP32 (subnormal grid included)."""
    if x == 0:
        return 0.0
    mag = abs(x)
    e = mag.numerator.bit_length() - mag.denominator.bit_length()
    while Fraction(2) ** e > mag:
        e -= 1
    while Fraction(2) ** (e + 1) <= mag:
        e += 1
    ulp = Fraction(2) ** (max(e, -126) - 23)
    r = round(mag / ulp) * ulp  # Fraction.__round__ is round-half-even
    val = math.inf if r >= Fraction(2) ** 128 else float(r)
    return val if x > 0 else -val


def fma_ftz_oracle(a: float, b: float, c: float) -> float:
    """fma.rn.ftz.f32 from its definition: flush, exact a*b+c, one rounding, flush."""
    a, b, c = _flush(a), _flush(b), _flush(c)
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    if exact == 0:  # IEEE sign of an exact zero sum in round-to-nearest
        return _flush(a * b + c)
    return _flush(_round_f32(exact))


def finalize_oracle(
    inp, idx_map, scales, *, bias=None, expert_ids=None, rsf=1.0, shared=None, expanded=False
):
    """spec: moe_finalize written out element by element with the rational FMA oracle."""
    m, k_slots = idx_map.shape
    n_rows, h = inp.shape
    out = torch.empty(m, h, dtype=torch.float32)
    for t in range(m):
        for j in range(h):
            acc = 0.0
            for k in range(k_slots):
                i = int(idx_map[t, k])
                if expanded:
                    if i < 0:
                        continue
                    i = t * k_slots + k
                elif i < 0 or i >= n_rows:
                    continue
                x = float(inp[i, j].float())
                if bias is not None and 0 <= int(expert_ids[t, k]) < bias.shape[0]:
                    x = float(torch.tensor(x) + bias[int(expert_ids[t, k]), j].float())
                acc = fma_ftz_oracle(x, float(scales[t, k].float()), acc)
            a = torch.tensor(acc, dtype=torch.float32)
            if rsf != 1.0:
                a = a * torch.tensor(rsf, dtype=torch.float32)
            if shared is not None:
                a = a + shared[t, j].float()
            out[t, j] = a
    return out.to(inp.dtype)


def _fp32_from_parts(mant, exp):
    return (mant.double() * torch.exp2(exp.double())).float()


def crafted_fma_operands(n: int, seed: int = 0):
    """FP32 triples that exercise every rounding case: exact midpoints of the FP32 grid, values
    next to them, cancellation to zero and to tiny results, subnormal inputs and results."""
    g = torch.Generator().manual_seed(seed)

    def rnd(count, lo, hi):
        mant = (torch.rand(count, generator=g, dtype=torch.float64) + 0.5) * torch.where(
            torch.rand(count, generator=g) < 0.5, -1.0, 1.0
        ).double()
        return _fp32_from_parts(mant, torch.randint(lo, hi, (count,), generator=g))

    a, b, c = rnd(n, -60, 60), rnd(n, -60, 60), rnd(n, -130, 100)
    q = n // 4
    # a*b = half an ulp of c (times 1 + j*2^-23): lands on / next to FP32 rounding midpoints
    ulp = torch.exp2(torch.floor(torch.log2(c[:q].abs().double())) - 23)
    a[:q] = (ulp / 2).float()
    b[:q] = (1 + torch.randint(-3, 4, (q,), generator=g).double() * 2.0**-23).float()
    # c = -(a*b) rounded: the exact result is the tiny product error (or exactly zero)
    c[q : 2 * q] = -(a[q : 2 * q].double() * b[q : 2 * q].double()).float()
    # subnormal inputs, and products that underflow into the subnormal range
    a[2 * q : 2 * q + q // 4] = rnd(q // 4, -150, -126)
    a[3 * q : 3 * q + q // 4] = rnd(q // 4, -75, -64)
    b[3 * q : 3 * q + q // 4] = rnd(q // 4, -75, -64)
    c[3 * q : 3 * q + q // 8] = rnd(q // 8, -150, -120)
    a[-4:] = torch.tensor([-0.0, 0.0, -1.0, 1.5])
    b[-4:] = torch.tensor([1.0, -0.0, 0.0, 2.0**-140])
    c[-4:] = torch.tensor([-0.0, -0.0, 0.0, -0.0])
    return a, b, c


def test_fma_ftz_reference_matches_exact_oracle():
    a, b, c = crafted_fma_operands(4000)
    got = ref.fma_ftz_f32(a, b, c)
    want = torch.tensor(
        [fma_ftz_oracle(float(x), float(y), float(z)) for x, y, z in zip(a, b, c)],
        dtype=torch.float32,
    )
    assert_bitwise_equal(got, want, "fma_ftz_f32 vs rational oracle")
    # the crafted set must contain cases where a plain FP64 evaluation double-rounds or keeps a
    # subnormal: otherwise this test could not tell a correct emulation from a naive one
    naive = (a.double() * b.double() + c.double()).float()
    assert int((bits(naive) != bits(want)).sum()) > 10


@triton.jit
def _fma_kernel(a_ptr, b_ptr, c_ptr, o_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(a_ptr + offs, mask=m)
    b = tl.load(b_ptr + offs, mask=m)
    c = tl.load(c_ptr + offs, mask=m)
    tl.store(o_ptr + offs, fma_ftz(a, b, c, False), mask=m)


def test_fma_ftz_device_helper_matches_reference():
    """moefuse._device.fma_ftz (interpreter path) gives the reference's bits."""
    a, b, c = crafted_fma_operands(4000, seed=1)
    out = poison_(torch.empty_like(a))
    _fma_kernel[(triton.cdiv(a.numel(), 1024),)](a, b, c, out, a.numel(), BLOCK=1024)
    assert_bitwise_equal(out, ref.fma_ftz_f32(a, b, c), "device fma_ftz vs reference")


# ----------------------------------------------------------------------------- inputs
def make_case(
    m,
    k,
    h,
    *,
    dtype=torch.bfloat16,
    scale_dtype=torch.float32,
    n_rows=None,
    expanded=False,
    ext=False,
    seed=0,
    special=True,
):
    """Random finalize inputs with invalid slots, NaN rows behind them, an all-masked token,
    BF16/FP16 subnormals and -0.0 in the expert rows."""
    g = torch.Generator().manual_seed(seed)
    n_rows = max(n_rows or m * k + 3, m * k if expanded else 1)
    inp = torch.randn(n_rows, h, generator=g).to(dtype)
    if special:
        flat = inp.view(-1)
        tiny = 2.0**-130 if dtype == torch.bfloat16 else 2.0**-20
        flat[::7] = (torch.randn(flat[::7].numel(), generator=g) * tiny).to(dtype)
        flat[3::11] = -0.0
    # each row used at most once, as in a real permutation; ~20 % invalid (negative or >= R)
    idx_map = torch.randperm(n_rows, generator=g)[: m * k].view(m, k).to(torch.int32)
    bad = torch.rand(m, k, generator=g) < 0.2
    junk = torch.randint(0, 2, (m, k), generator=g, dtype=torch.int32)
    idx_map = torch.where(bad, torch.where(junk == 0, -1, n_rows + junk), idx_map)
    if m > 1:
        idx_map[m // 2] = -1  # an all-masked token
    used = torch.zeros(n_rows, dtype=torch.bool)
    if expanded:
        used[: m * k] = (idx_map >= 0).view(-1)
    else:
        used[idx_map[(idx_map >= 0) & (idx_map < n_rows)].long()] = True
    inp[~used] = float("nan")  # a row that is read by mistake poisons the output
    scales = torch.rand(m, k, generator=g).to(scale_dtype)
    kw = {}
    if ext:
        e = 5
        kw = dict(
            bias=torch.randn(e, h, generator=g).to(dtype),
            expert_ids=torch.randint(-1, e + 1, (m, k), generator=g, dtype=torch.int32),
            routed_scaling_factor=2.5,
            shared_expert_output=torch.randn(m, h, generator=g).to(dtype),
        )
    return inp, idx_map, scales, kw


# ----------------------------------------------------------------------------- reference
@pytest.mark.parametrize("expanded", [False, True])
@pytest.mark.parametrize("ext", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_oracle(expanded, ext, dtype):
    inp, idx_map, scales, kw = make_case(4, 3, 9, dtype=dtype, expanded=expanded, ext=ext, seed=3)
    got = ref.moe_finalize_reference(inp, idx_map, scales, input_is_expanded=expanded, **kw)
    want = finalize_oracle(
        inp,
        idx_map,
        scales,
        bias=kw.get("bias"),
        expert_ids=kw.get("expert_ids"),
        rsf=kw.get("routed_scaling_factor", 1.0),
        shared=kw.get("shared_expert_output"),
        expanded=expanded,
    )
    assert_bitwise_equal(got, want, "reference vs oracle")
    if not ext:  # spec: moe_finalize: a fully masked token writes exactly +0.0
        assert int(bits(got[2]).abs().sum()) == 0


def test_reference_flushes_subnormal_products():
    """A product below 2^-126 contributes +-0 (FTZ), although BF16 could represent it."""
    inp = torch.tensor([[2.0**-100]], dtype=torch.bfloat16)
    got = ref.moe_finalize_reference(
        inp, torch.tensor([[0]], dtype=torch.int32), torch.tensor([[2.0**-30]])
    )
    assert int(bits(got)) == 0


# ----------------------------------------------------------------------------- kernel
def _run_both(inp, idx_map, scales, kw, expanded=False):
    m, h = idx_map.shape[0], inp.shape[1]
    out = poison_(torch.empty(m, h, dtype=inp.dtype))
    got = moefuse.moe_finalize(
        inp, idx_map, scales, out=out, input_is_expanded=expanded, impl="triton", **kw
    )
    assert got is out
    want = moefuse.moe_finalize(
        inp, idx_map, scales, input_is_expanded=expanded, impl="reference", **kw
    )
    return got, want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("ext", [False, True])
def test_kernel_bitwise_equals_reference(dtype, width, ext):
    for i, m in enumerate(TOKENS):
        k = (1, 4, 8)[i]
        sdt = SCALE_DTYPES[(i + width) % 3]
        inp, idx_map, scales, kw = make_case(
            m, k, width, dtype=dtype, scale_dtype=sdt, ext=ext, seed=width + i
        )
        got, want = _run_both(inp, idx_map, scales, kw)
        assert_bitwise_equal(got, want, f"M={m} K={k} H={width} scales={sdt} ext={ext}")


@pytest.mark.parametrize("ext", [False, True])
def test_kernel_expanded_input(ext):
    inp, idx_map, scales, kw = make_case(5, 4, 48, expanded=True, ext=ext, seed=11)
    got, want = _run_both(inp, idx_map, scales, kw, expanded=True)
    assert_bitwise_equal(got, want, "input_is_expanded")


def test_kernel_large_k_runtime_loop():
    """K > 16 takes the run-time loop instead of the unrolled one: same order, same bits."""
    inp, idx_map, scales, kw = make_case(3, 20, 40, ext=True, seed=5)
    got, want = _run_both(inp, idx_map, scales, kw)
    assert_bitwise_equal(got, want, "K=20")


def test_kernel_wide_row_several_tiles():
    """H = 2056: three 1024-column tiles, the last one partial."""
    inp, idx_map, scales, kw = make_case(2, 3, 2056, seed=6)
    got, want = _run_both(inp, idx_map, scales, kw)
    assert_bitwise_equal(got, want, "H=2056")


def test_kernel_all_invalid_writes_positive_zero_and_reads_nothing():
    inp = torch.full((4, 48), float("nan"), dtype=torch.bfloat16)
    idx_map = torch.tensor([[-1, 4, 7], [-5, -1, 2**31 - 1]], dtype=torch.int32)
    out = poison_(torch.empty(2, 48, dtype=torch.bfloat16))
    moefuse.moe_finalize(inp, idx_map, torch.rand(2, 3), out=out, impl="triton")
    assert int(bits(out).abs().sum()) == 0  # +0.0 everywhere (no NaN, no -0.0)
    # empty row buffer: every slot is invalid
    empty = torch.empty(0, 48, dtype=torch.bfloat16)
    out2 = moefuse.moe_finalize(empty, idx_map, torch.rand(2, 3), impl="triton")
    assert int(bits(out2).abs().sum()) == 0


def test_kernel_signed_zero_and_subnormals():
    """-0.0 products keep the +0.0 start of the accumulator; subnormal rows, subnormal scales and
    underflowing products flush to a zero of the product's sign (spec), in the kernel as in
    the reference."""
    dt = torch.bfloat16
    inp = torch.tensor([[-0.0, 2.0**-130, -(2.0**-100), 1.0]], dtype=dt).repeat(4, 1)
    idx_map = torch.tensor([[0], [1], [2], [3]], dtype=torch.int32)
    scales = torch.tensor([[1.0], [1.0], [2.0**-30], [-(2.0**-140)]])
    got, want = _run_both(inp, idx_map, scales, {})
    assert_bitwise_equal(got, want, "signed zeros")
    b = bits(got)
    neg_zero = int(bits(torch.tensor([-0.0], dtype=dt)))
    assert b[0, 0] == 0 and b[0, 1] == 0  # -0 * 1 + 0 = +0; subnormal row flushed
    assert b[2, 2] == neg_zero  # -2^-130 is flushed to -0, and -0 stays in acc
    assert b[2, 3] == int(bits(torch.tensor([2.0**-30], dtype=dt)))
    assert int(b[3].abs().sum()) == 0  # subnormal scale flushed: every product is a zero


def test_kernel_strided_inputs_and_output():
    inp_base, idx_base, sc_base, _ = make_case(6, 4, 56, n_rows=40, seed=8)
    wide = torch.full((40, 72), float("nan"), dtype=torch.bfloat16)
    wide[:, 8:64] = inp_base
    inp = wide[:, 8:64]  # row stride 72, 16-byte aligned
    idx_map = torch.cat([idx_base, torch.zeros(6, 3, dtype=torch.int32)], 1)[:, :4]
    scales = torch.cat([sc_base, torch.zeros(6, 2)], 1)[:, :4]
    out_base = poison_(torch.empty(6, 60, dtype=torch.bfloat16))
    out = out_base[:, :56]
    moefuse.moe_finalize(inp, idx_map, scales, out=out, impl="triton")
    want = ref.moe_finalize_reference(inp_base, idx_base, sc_base)
    assert_bitwise_equal(out, want, "strided")
    assert torch.isnan(out_base[:, 56:].float()).all()  # untouched


def test_kernel_odd_row_stride_scalar_path():
    """A row stride that is not a multiple of 8 disables 16-byte vectors: same bits."""
    inp_base, idx_map, scales, _ = make_case(3, 2, 48, n_rows=10, seed=9)
    wide = torch.zeros(10, 51, dtype=torch.bfloat16)
    wide[:, :48] = inp_base
    got = moefuse.moe_finalize(wide[:, :48], idx_map, scales, impl="triton")
    assert_bitwise_equal(got, ref.moe_finalize_reference(inp_base, idx_map, scales), "stride 51")


def test_zero_tokens_is_a_no_op():
    inp = torch.randn(5, 48).bfloat16()
    idx = torch.empty(0, 4, dtype=torch.int32)
    out = moefuse.moe_finalize(inp, idx, torch.empty(0, 4), impl="triton")
    assert out.shape == (0, 48)


# ----------------------------------------------------------------------------- determinism
def test_batch_invariance_and_launch_geometry_bitwise():
    from moefuse.moe.triton import launch_moe_finalize

    inp, idx_map, scales, kw = make_case(17, 4, 200, ext=True, seed=12)
    batch = moefuse.moe_finalize(inp, idx_map, scales, impl="triton", **kw)

    def sub(rows):
        kws = dict(
            kw,
            expert_ids=kw["expert_ids"][rows],
            shared_expert_output=kw["shared_expert_output"][rows],
        )
        return moefuse.moe_finalize(inp, idx_map[rows], scales[rows], impl="triton", **kws)

    for i in (0, 8, 16):
        assert_bitwise_equal(sub(torch.tensor([i])), batch[i : i + 1], f"token {i} alone")
    perm = torch.randperm(17, generator=torch.Generator().manual_seed(0))[:9]
    assert_bitwise_equal(sub(perm), batch[perm], "another batch composition")
    for block, warps in ((32, 1), (64, 2), (256, 4)):
        out = poison_(torch.empty_like(batch))
        launch_moe_finalize(
            inp,
            idx_map,
            scales,
            out,
            kw["bias"],
            kw["expert_ids"],
            kw["routed_scaling_factor"],
            kw["shared_expert_output"],
            False,
            False,
            block=block,
            num_warps=warps,
        )
        assert_bitwise_equal(out, batch, f"tile {block}x{warps} warps")


# ----------------------------------------------------------------------------- API contract
def test_auto_on_cpu_uses_the_reference():
    inp, idx_map, scales, kw = make_case(3, 2, 16, seed=13)
    assert_bitwise_equal(
        moefuse.moe_finalize(inp, idx_map, scales, **kw),
        ref.moe_finalize_reference(inp, idx_map, scales, **kw),
    )


def test_triton_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    inp, idx_map, scales, _ = make_case(3, 2, 16, seed=14)
    assert not moefuse.supports_moe_finalize(inp, idx_map, scales)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        moefuse.moe_finalize(inp, idx_map, scales, impl="triton")


def test_supports_moe_finalize():
    inp, idx_map, scales, kw = make_case(3, 2, 16, ext=True, seed=15)
    assert moefuse.supports_moe_finalize(inp, idx_map, scales, **kw)
    assert not moefuse.supports_moe_finalize(inp.float(), idx_map, scales)
    assert not moefuse.supports_moe_finalize(inp, idx_map.long(), scales)
    assert not moefuse.supports_moe_finalize(inp, idx_map, scales, out=inp[:3])  # aliasing
    assert not moefuse.supports_moe_finalize(inp, idx_map, scales, bias=kw["bias"])


def _bad_calls(inp, idx_map, scales, kw):
    m, h = idx_map.shape[0], inp.shape[1]
    bf = torch.bfloat16
    return [
        ("permuted_input", dict(permuted_input=inp.float())),
        ("permuted_input", dict(permuted_input=inp[0])),
        ("expanded_idx_to_permuted_idx", dict(expanded_idx_to_permuted_idx=idx_map.long())),
        ("topk_scales", dict(topk_scales=scales[:, :1])),
        ("topk_scales", dict(topk_scales=scales.double())),
        ("out", dict(out=torch.empty(m, h + 1, dtype=bf))),
        ("out", dict(out=torch.empty(m, h, dtype=torch.float16))),
        ("out", dict(out=inp[:m])),
        ("expert_ids", dict(bias=kw["bias"])),
        ("bias", dict(expert_ids=kw["expert_ids"])),
        ("bias", dict(bias=kw["bias"][:, :-1], expert_ids=kw["expert_ids"])),
        ("expert_ids", dict(bias=kw["bias"], expert_ids=kw["expert_ids"].float())),
        ("routed_scaling_factor", dict(routed_scaling_factor=float("nan"))),
        ("routed_scaling_factor", dict(routed_scaling_factor=True)),
        ("shared_expert_output", dict(shared_expert_output=torch.empty(m + 1, h, dtype=bf))),
        ("input_is_expanded", dict(input_is_expanded=1)),
        ("permuted_input", dict(permuted_input=inp[:2], input_is_expanded=True)),
    ]


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_bad_inputs_raise_value_error_naming_the_argument(impl):
    inp, idx_map, scales, kw = make_case(3, 2, 16, ext=True, seed=16)
    for name, change in _bad_calls(inp, idx_map, scales, kw):
        args = dict(
            permuted_input=inp,
            expanded_idx_to_permuted_idx=idx_map,
            topk_scales=scales,
            out=poison_(torch.empty(3, 16, dtype=torch.bfloat16)),
        )
        args.update(change)
        before = bits(args["out"]).clone()
        pos = [
            args.pop(n) for n in ("permuted_input", "expanded_idx_to_permuted_idx", "topk_scales")
        ]
        with pytest.raises(ValueError, match=name):
            moefuse.moe_finalize(*pos, impl=impl, **args)
        assert torch.equal(bits(args["out"]), before), f"{name}: output written"
    with pytest.raises(ValueError, match="impl"):
        moefuse.moe_finalize(inp, idx_map, scales, impl="cuda")


# ----------------------------------------------------------------------------- custom ops
def test_opcheck_custom_ops():
    from moefuse.moe import ops

    inp, idx_map, scales, kw = make_case(3, 4, 24, ext=True, seed=17)
    out = torch.empty(3, 24, dtype=torch.bfloat16)
    torch.library.opcheck(
        ops.moe_finalize_op,
        (
            inp,
            idx_map,
            scales,
            out,
            kw["bias"],
            kw["expert_ids"],
            2.5,
            kw["shared_expert_output"],
            False,
            False,
        ),
    )
    torch.library.opcheck(
        ops.moe_finalize_op, (inp, idx_map, scales, out, None, None, 1.0, None, False, False)
    )
    inv = torch.full((inp.shape[0],), -1, dtype=torch.int32)
    inv[:6] = torch.arange(6, dtype=torch.int32)
    torch.library.opcheck(ops.moe_finalize_scatter_add_op, (inp, inv, scales, out, 1.0, False))
    torch.library.opcheck(ops.moe_permute_op, (out, inv, 4, torch.empty_like(inp), False))


def test_compiles_fullgraph():
    inp, idx_map, scales, kw = make_case(3, 4, 24, ext=True, seed=18)

    def f(a, b, c, bias, eids, shared):
        out = moefuse.moe_finalize(
            a,
            b,
            c,
            bias=bias,
            expert_ids=eids,
            shared_expert_output=shared,
            routed_scaling_factor=2.5,
            impl="triton",
        )
        return out * 1

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    args = (inp, idx_map, scales, kw["bias"], kw["expert_ids"], kw["shared_expert_output"])
    assert_bitwise_equal(compiled(*args), f(*args), "torch.compile(fullgraph=True)")


# ----------------------------------------------------------------------------- compat
def test_flashinfer_moe_unpermute_signature():
    from moefuse.compat._moe import moe_unpermute

    inp, idx_map, scales, _ = make_case(5, 4, 48, seed=19)
    output = poison_(torch.empty(7, 48, dtype=torch.bfloat16))  # more rows than num_tokens
    pad_map = torch.cat([idx_map, torch.zeros(2, 4, dtype=torch.int32)])
    pad_sc = torch.cat([scales, torch.ones(2, 4)])
    assert moe_unpermute(inp, output, pad_map, pad_sc, 5, 4) is None
    assert_bitwise_equal(output[:5], ref.moe_finalize_reference(inp, idx_map, scales), "compat")
    assert torch.isnan(output[5:].float()).all()  # rows >= num_tokens are not written
    with pytest.raises(ValueError, match="top_k"):
        moe_unpermute(inp, output, pad_map, pad_sc, 5, 3)
    with pytest.raises(ValueError, match="num_tokens"):
        moe_unpermute(inp, output, pad_map, pad_sc, 8, 4)


# ----------------------------------------------------------------------------- the GPU build
_SM90_SCRIPT = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import moefuse.moe.triton as mt

def ptx(kernel, sig, const, warps=4, pdl=False):
    names = list(sig) + list(const)
    sig = dict(sig, **{k: "constexpr" for k in const})
    src = ASTSource(fn=kernel, signature=sig,
                    constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    opts = {"num_warps": warps, "enable_fp_fusion": False, "launch_pdl": pdl}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts).asm["ptx"]

def fin_sig(dt, sdt):
    s = {"in_ptr": "*" + dt, "map_ptr": "*i32", "scale_ptr": "*" + sdt, "bias_ptr": "*" + dt,
         "eid_ptr": "*i32", "shared_ptr": "*" + dt, "out_ptr": "*" + dt}
    for n in ("n_rows n_experts top_k n_tiles H_V in_st_v map_st scale_st bias_st_v eid_st "
              "shared_st_v out_st_v").split():
        s[n] = "i32"
    s["rsf"] = "fp32"
    return s

base = dict(VEC=8, BLOCK=1024, UNROLL=8, EVEN=True, EXPANDED=False, HAS_BIAS=False,
            HAS_RSF=True, HAS_SHARED=True, PTX=True, USE_PDL=True)
p = ptx(mt._moe_finalize_kernel, fin_sig("bf16", "fp32"), base, pdl=True)
assert "fma.rn.ftz.f32" in p, "inline fma.rn.ftz missing"
assert "fma.rn.f32" not in p, "rsf multiply and shared add were contracted into an FMA"
assert "mul.rn.f32" in p and "add.rn.f32" in p
assert re.search(r"ld\.global\S*\.v4\.b32", p), "no 16-byte vector loads"
assert "cvt.rn.bf16x2.f32" in p or "cvt.rn.bf16.f32" in p
assert p.index("griddepcontrol.wait") < p.index("L1::evict_first"), "row load before the wait"
assert "griddepcontrol.launch_dependents" in p
loop = dict(base, VEC=1, UNROLL=0, EVEN=False, EXPANDED=True, HAS_BIAS=True, USE_PDL=False)
p = ptx(mt._moe_finalize_kernel, fin_sig("fp16", "bf16"), loop, warps=2)
assert "fma.rn.ftz.f32" in p and "griddepcontrol" not in p and "cvt.rn.f16.f32" in p
sc = {"in_ptr": "*bf16", "inv_ptr": "*i32", "scale_ptr": "*fp32", "buf_ptr": "*fp32",
      "n_expanded": "i32", "top_k": "i32", "n_tiles": "i32", "H": "i32", "in_st": "i32",
      "scale_st": "i32"}
p = ptx(mt._moe_scatter_add_kernel, sc, dict(BLOCK=1024, PTX=True, USE_PDL=True), pdl=True)
assert "atom.global" in p or "red.global" in p
pm = {"x_ptr": "*bf16", "inv_ptr": "*i32", "out_ptr": "*bf16", "n_expanded": "i32",
      "top_k": "i32", "n_tiles": "i32", "H_V": "i32", "x_st_v": "i32", "out_st_v": "i32"}
p = ptx(mt._moe_permute_kernel, pm, dict(VEC=8, BLOCK=1024, USE_PDL=True), pdl=True)
assert "griddepcontrol.wait" in p
print("SM90-OK")
"""


def test_kernels_compile_for_sm90_with_the_intended_instructions():
    """The PTX path (never run by the interpreter) compiles for SM90 and contains what the
    design relies on: inline fma.rn.ftz, no contraction of the epilogue, 16-byte loads, PDL."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="0")
    res = subprocess.run(
        [sys.executable, "-c", _SM90_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert "SM90-OK" in res.stdout, res.stderr[-3000:]
