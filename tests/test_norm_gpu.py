"""RMSNorm family on an SM90+ GPU at full shapes: every op x dtype x width x token count against
the reference, outputs poisoned, eager / PDL off / CUDA-graph replay bitwise equal, batch
invariance bitwise, and no recompilation across token counts."""

import pytest
import torch

import moefuse
from moefuse.norm import reference as ref
from moefuse.testing import assert_bitwise_equal, assert_close, poison_, run_eager_pdl_and_graph

pytestmark = pytest.mark.gpu

WIDTHS = [64, 128, 2880, 4096, 5120, 7168, 8192]
TOKENS = [1, 7, 128, 1000, 16384]
DTYPES = [torch.bfloat16, torch.float16]
DEV = "cuda"


def _rand(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _both_stepped_modes(width):
    """True when the gated ops' rows of this width are stepped and short enough to run both the
    unrolled and the looped mode (moefuse.norm.gated), which must give the same bits."""
    from moefuse.norm import tiles

    tile = tiles.row_tile(width, tiles.GATED_POLICY)
    return tile.stepped and tile.num_chunks <= tiles.STEP_UNROLL_MAX_STEPS


def _assert_same(results, what):
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert_bitwise_equal(a, b, what)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm_gpu(dtype, width, gemma):
    fn = moefuse.gemma_rmsnorm if gemma else moefuse.rmsnorm
    for m in TOKENS:
        x, w = _rand(m, width, dtype=dtype), _rand(width, dtype=dtype)
        res = run_eager_pdl_and_graph(
            lambda outs, pdl: fn(x, w, out=outs[0], enable_pdl=pdl, impl="triton"),
            lambda: [poison_(torch.empty_like(x))],
        )
        _assert_same(res, f"rmsnorm {m}x{width} modes")
        assert_close(res[0][0], ref.rmsnorm_reference(x, w, 1e-6, float(gemma)), "rsqrt_half")
        for i in {0, m // 2, m - 1}:  # batch invariance: the row alone gives the same bits
            assert_bitwise_equal(fn(x[i : i + 1], w, impl="triton"), res[0][0][i : i + 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_fused_add_rmsnorm_gpu(dtype, width):
    for m in TOKENS:
        x, r, w = _rand(m, width, dtype=dtype), _rand(m, width, dtype=dtype), _rand(width)

        def run(outs, pdl):
            outs[0].copy_(x)
            outs[1].copy_(r)
            moefuse.fused_add_rmsnorm(outs[0], outs[1], w, enable_pdl=pdl, impl="triton")

        res = run_eager_pdl_and_graph(run, lambda: [torch.empty_like(x), torch.empty_like(r)])
        _assert_same(res, f"fused_add {m}x{width} modes")
        normed, r_out = ref.fused_add_rmsnorm_reference(x, r, w)
        assert_bitwise_equal(res[0][1], r_out, "residual")
        assert_close(res[0][0], normed, "rsqrt_half", "normed")
        i = m - 1
        xi, ri = x[i : i + 1].clone(), r[i : i + 1].clone()
        moefuse.fused_add_rmsnorm(xi, ri, w, impl="triton")
        assert_bitwise_equal(xi, res[0][0][i : i + 1], "batch invariance")


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("with_weight", [False, True])
def test_gated_residual_rmsnorm_gpu(width, with_weight):
    for m in TOKENS:
        b, r = _rand(m, width), torch.randn(m, width, device=DEV)
        w = _rand(width) if with_weight else None
        a, be = torch.rand(width, device=DEV), torch.rand(width, device=DEV)
        res = run_eager_pdl_and_graph(
            lambda outs, pdl: moefuse.gated_residual_rmsnorm(
                b, r, w, a, be, gain_center=1.0, out=outs[0], enable_pdl=pdl, impl="triton"
            ),
            lambda: [poison_(torch.empty_like(r))],
        )
        _assert_same(res, "gated modes")
        if _both_stepped_modes(width):  # unrolled and looped rows: the same bits at every M
            from moefuse.norm import gated_residual

            for unroll in (False, True):
                other = poison_(torch.empty_like(r))
                gated_residual.launch_gated_residual_rmsnorm(
                    b, r, w, a, be, other, 1e-6, 1.0, False, unroll=unroll
                )
                assert_bitwise_equal(other, res[0][0], f"unroll={unroll} {m}x{width}")
        i = m - 1  # batch invariance: the row alone (another launch mode at large M)
        alone = moefuse.gated_residual_rmsnorm(
            b[i : i + 1], r[i : i + 1], w, a, be, gain_center=1.0, impl="triton"
        )
        assert_bitwise_equal(alone, res[0][0][i : i + 1], f"gated row alone {m}x{width}")
        expected = ref.gated_residual_rmsnorm_reference(b, r, w, a, be, 1e-6, 1.0)
        assert_close(res[0][0], expected, "fp32_stream", f"gated {m}x{width}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("alpha_kind", ["one", "tensor"])
def test_gated_residual_next_rmsnorm_gpu(dtype, width, alpha_kind):
    for m in TOKENS:
        b, r = _rand(m, width, dtype=dtype), torch.randn(m, width, device=DEV)
        nw, pw = _rand(width, dtype=dtype), _rand(width, dtype=dtype)
        be = torch.rand(width, device=DEV)
        alpha = 1.0 if alpha_kind == "one" else torch.rand(width, device=DEV)
        kw = dict(post_weight=pw, post_gain_center=1.0, next_gain_center=0.0)

        def run(outs, pdl):
            moefuse.gated_residual_next_rmsnorm(
                b,
                r,
                nw,
                alpha,
                be,
                residual_out=outs[0],
                ffn_input=outs[1],
                router_input=outs[2],
                enable_pdl=pdl,
                impl="triton",
                **kw,
            )

        res = run_eager_pdl_and_graph(
            run,
            lambda: [
                poison_(torch.empty_like(r)),
                poison_(torch.empty_like(b)),
                poison_(torch.empty_like(r)),
            ],
        )
        _assert_same(res, "gated_next modes")
        ro, ffn, router = res[0]
        if _both_stepped_modes(width):  # unrolled and looped rows: the same bits at every M
            from moefuse.norm import gated

            for unroll in (False, True):
                other = [poison_(torch.empty_like(t)) for t in (r, b, r)]
                gated.launch_gated_residual_next_rmsnorm(
                    b,
                    r,
                    nw,
                    alpha if alpha_kind == "tensor" else None,
                    1.0,
                    be,
                    pw,
                    *other,
                    1e-6,
                    1e-6,
                    0.0,
                    1.0,
                    False,
                    unroll=unroll,
                )
                for got, exp in zip(other, res[0]):
                    assert_bitwise_equal(got, exp, f"unroll={unroll} {m}x{width}")
        i = m - 1  # batch invariance: the row alone (another launch mode at large M), with and
        # without router_input, against the batch with it and without it
        rt_alone = poison_(torch.empty_like(r[i : i + 1]))
        alone = moefuse.gated_residual_next_rmsnorm(
            b[i : i + 1], r[i : i + 1], nw, alpha, be, router_input=rt_alone, impl="triton", **kw
        )
        for got, exp in zip((*alone, rt_alone), (ro, ffn, router)):
            assert_bitwise_equal(got, exp[i : i + 1], f"gated_next row alone {m}x{width}")
        plain = moefuse.gated_residual_next_rmsnorm(b, r, nw, alpha, be, impl="triton", **kw)
        plain_alone = moefuse.gated_residual_next_rmsnorm(
            b[i : i + 1], r[i : i + 1], nw, alpha, be, impl="triton", **kw
        )
        for got, exp in zip(plain_alone, plain):
            assert_bitwise_equal(got, exp[i : i + 1], f"gated_next (no router) alone {m}x{width}")
        assert_bitwise_equal(plain[0], ro, "residual_out with / without router_input")
        assert_bitwise_equal(plain[1], ffn, "ffn_input with / without router_input")
        exp_ro, _, _ = ref.gated_residual_next_rmsnorm_reference(
            b, r, nw, alpha, be, 1e-6, 1e-6, 0.0, pw, 1.0
        )
        assert_close(ro, exp_ro, "fp32_stream", f"residual_out {m}x{width}")
        own = (ro * ref.inv_rms(ro, 1e-6)) * ref.gain(nw, 0.0)
        assert_close(ffn, own.to(dtype), "rsqrt_half", f"ffn_input {m}x{width}")
        assert_bitwise_equal(router.to(dtype), ffn, "ffn = cast(router)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 96, 256])
def test_rmsnorm_sigmoid_gate_gpu(dtype, head_dim):
    for tokens in TOKENS:
        x, g = _rand(tokens, 32, head_dim, dtype=dtype), _rand(tokens, 32, head_dim, dtype=dtype)

        def run(outs, pdl):
            outs[0].copy_(x)
            moefuse.rmsnorm_sigmoid_gate(outs[0], g, enable_pdl=pdl, impl="triton")

        res = run_eager_pdl_and_graph(run, lambda: [torch.empty_like(x)])
        _assert_same(res, "sigmoid gate modes")
        assert_close(res[0][0], ref.rmsnorm_sigmoid_gate_reference(x, g), "sigmoid_fast")


def test_wide_and_odd_rows_gpu():
    """Chunked / looped stepped rows (wider than one block), width 1 and odd widths."""
    for width in (1, 3, 1000, 16385, 65536):
        for m in (1, 7, 300):
            x, r, w = _rand(m, width), _rand(m, width), _rand(width)
            out = poison_(torch.empty_like(x))
            moefuse.rmsnorm(x, w, out=out, impl="triton")
            assert_close(out, ref.rmsnorm_reference(x, w), "rsqrt_half", f"rms {m}x{width}")
            xk, rk = x.clone(), r.clone()
            moefuse.fused_add_rmsnorm(xk, rk, w, impl="triton")
            normed, r_out = ref.fused_add_rmsnorm_reference(x, r, w)
            assert_bitwise_equal(rk, r_out)
            assert_close(xk, normed, "rsqrt_half", f"fused {m}x{width}")
            b, r32 = _rand(m, width), torch.randn(m, width, device=DEV)
            a = torch.rand(width, device=DEV)
            ro, ffn = moefuse.gated_residual_next_rmsnorm(b, r32, w, a, a, impl="triton")
            exp_ro, _, _ = ref.gated_residual_next_rmsnorm_reference(b, r32, w, a, a)
            assert_close(ro, exp_ro, "fp32_stream", f"next {m}x{width}")
            own = (ro * ref.inv_rms(ro, 1e-6)) * w.float()
            assert_close(ffn, own.to(ffn.dtype), "rsqrt_half", f"next ffn {m}x{width}")


def _compiled_variants(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_new_token_count_never_recompiles():
    from moefuse.norm import rms as tk

    width = 4096
    w = _rand(width)
    x = _rand(4096, width)
    r = _rand(4096, width)
    moefuse.rmsnorm(x[:1], w, impl="triton")
    moefuse.fused_add_rmsnorm(x[:1].clone(), r[:1].clone(), w, impl="triton")
    kernels = (tk._rmsnorm_kernel, tk._fused_add_rmsnorm_kernel)
    before = [_compiled_variants(k) for k in kernels]
    for m in range(1, 4097):
        moefuse.rmsnorm(x[:m], w, impl="triton")
    for m in (2, 3, 16, 17, 1000, 4096):
        moefuse.fused_add_rmsnorm(x[:m].clone(), r[:m].clone(), w, impl="triton")
    torch.cuda.synchronize()
    after = [_compiled_variants(k) for k in kernels]
    assert after == before, f"compiled variants {before} -> {after} across M = 1..4096"


def test_stepped_rows_never_recompile_across_token_counts():
    """rmsnorm (6145-8192 columns) and fused_add_rmsnorm (4096, 6554-8192) rows are stepped:
    unrolled below the op's loop threshold (tiles.RMSNORM_LOOP_MIN_ROWS /
    FUSED_ADD_LOOP_MIN_ROWS), looped from there; the first launch compiles both modes."""
    from moefuse.norm import rms as tk
    from moefuse.norm import tiles

    cases = (
        (
            tk._rmsnorm_kernel,
            tiles.RMSNORM_POLICY,
            tiles.RMSNORM_LOOP_MIN_ROWS,
            (7168, 8192),
            lambda x, r, w: moefuse.rmsnorm(x, w, impl="triton"),
        ),
        (
            tk._fused_add_rmsnorm_kernel,
            tiles.FUSED_ADD_POLICY,
            tiles.FUSED_ADD_LOOP_MIN_ROWS,
            (4096, 8192),
            lambda x, r, w: moefuse.fused_add_rmsnorm(x, r, w, impl="triton"),
        ),
    )
    for kernel, policy, threshold, widths, run in cases:
        n = threshold + 64
        tokens = sorted({*range(1, n + 1, 61), threshold - 1, threshold, n})
        for width in widths:
            assert tiles.row_tile(width, policy).stepped
            w, x, r = _rand(width), _rand(n, width), _rand(n, width)
            run(x[:1], r[:1], w)
            torch.cuda.synchronize()
            before = _compiled_variants(kernel)
            for m in tokens:
                run(x[:m], r[:m], w)
            torch.cuda.synchronize()
            after = _compiled_variants(kernel)
            assert after == before, f"H = {width}: compiled variants {before} -> {after}"


def test_gated_ops_never_recompile_across_token_counts():
    """Stepped rows pick the unrolled or the looped kernel by M; the first launch compiles both,
    so no later token count (crossing tiles.STEP_LOOP_MIN_ROWS included) compiles anything."""
    from moefuse.norm import gated, gated_residual, tiles

    assert tiles.STEP_LOOP_MIN_ROWS < 4096
    kernels = (gated_residual._gated_residual_kernel, gated._gated_residual_next_kernel)
    tokens = sorted(
        {*range(1, 4097, 97), tiles.STEP_LOOP_MIN_ROWS - 1, tiles.STEP_LOOP_MIN_ROWS, 4096}
    )
    for width in (2048, 4096, 8192):  # narrow tile, 2 and 4 steps
        b, r = _rand(4096, width), torch.randn(4096, width, device=DEV)
        nw, a, be = _rand(width), torch.rand(width, device=DEV), torch.rand(width, device=DEV)
        moefuse.gated_residual_rmsnorm(b[:1], r[:1], None, a, be, impl="triton")
        moefuse.gated_residual_next_rmsnorm(b[:1], r[:1], nw, a, be, impl="triton")
        torch.cuda.synchronize()
        before = [_compiled_variants(k) for k in kernels]
        for m in tokens:
            moefuse.gated_residual_rmsnorm(b[:m], r[:m], None, a, be, impl="triton")
            moefuse.gated_residual_next_rmsnorm(b[:m], r[:m], nw, a, be, impl="triton")
        torch.cuda.synchronize()
        after = [_compiled_variants(k) for k in kernels]
        assert after == before, f"H = {width}: compiled variants {before} -> {after}"


def test_torch_compile_inductor_and_opcheck_gpu():
    from moefuse.norm import ops

    width = 2880
    x, r, w = _rand(33, width), _rand(33, width), _rand(width)
    torch.library.opcheck(ops.rmsnorm_op, (x, w, torch.empty_like(x), 1e-6, 0.0, True))
    torch.library.opcheck(ops.fused_add_rmsnorm_op, (x.clone(), r.clone(), w, 1e-6, 0.0, True))

    def layer(x, r, w):
        moefuse.fused_add_rmsnorm(x, r, w)
        return moefuse.rmsnorm(x, w) * 2

    expected_x, expected_r = x.clone(), r.clone()
    expected = layer(expected_x, expected_r, w)
    compiled = torch.compile(layer, fullgraph=True)
    got_x, got_r = x.clone(), r.clone()
    got = compiled(got_x, got_r, w)
    assert_bitwise_equal(got, expected, "inductor == eager")
    assert_bitwise_equal(got_r, expected_r, "mutated residual under compile")
