"""All-gather + norm fusions on CPU: the real Triton kernels in the interpreter
across 2-4 real processes (gloo group, shared-memory peer buffers). Every op, one-shot and
torch algorithms, bitwise against "gather the shards, then the single-GPU op" (same Triton
kernel, so the claim is exact equality), the references against that within the single-GPU
ops' tolerances, -0.0 and 0xFFFF payloads, a token alone vs in a batch, generation wrap,
validation, bounded waits, opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch

from comm_mp import assert_bounded_waits, assert_compiles_to_eager_bits, count_calls, run_group
from moefuse import knobs
from moefuse.testing import assert_bitwise_equal, poison_

pytestmark = pytest.mark.interpreter

BF16 = torch.bfloat16
FP8_SCALE = 0.0125
NVFP4_GS = 448.0 * 6 / 5.0


def make_case(seed, p, m, h, dtype=BF16):
    """Full rows (every rank builds the same ones from ``seed``) and the replicated tensors."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(m, h, generator=g).to(dtype)
    if m > 0:
        full[0, : min(h, 3)] = -0.0  # -0.0 must travel unchanged (the Lamport encoding keeps it)
    c = dict(
        full=full,
        weight=(torch.rand(h, generator=g) + 0.5).to(dtype),
        residual=torch.randn(m, h, generator=g),
        alpha=torch.rand(h, generator=g) + 0.5,
        beta=torch.randn(h, generator=g),
        post_weight=(torch.rand(h, generator=g) + 0.5).to(dtype),
        scale=torch.tensor([FP8_SCALE]),
        gs=torch.tensor([NVFP4_GS]),
    )
    return c


def shard_of(full, rank, p):
    s = full.shape[1] // p
    return full[:, rank * s : (rank + 1) * s].clone()


ALL_OPS = ("rms", "gemma", "fp8", "fp4", "gated")


def run_all(
    moefuse, ws, c, rank, p, algo, impl="triton", alpha_mode="tensor", layout="linear", ops=ALL_OPS
):
    """The ops ``ops`` on this rank's shard; returns a dict of outputs (bytes views for FP8)."""
    x = shard_of(c["full"], rank, p)
    m, h = c["full"].shape
    kw = dict(workspace=ws, algorithm=algo, impl=impl)
    out = {}
    out["rms"] = moefuse.all_gather_rmsnorm(
        x, c["weight"], eps=1e-6, out=poison_(torch.empty(m, h, dtype=x.dtype)), **kw
    )
    if "gemma" in ops:
        out["gemma"] = moefuse.all_gather_rmsnorm(x, c["weight"], gain_center=1.0, **kw)
    if "fp8" in ops:
        out["fp8"] = moefuse.all_gather_rmsnorm_fp8(x, c["weight"], c["scale"], **kw).view(
            torch.uint8
        )
    if h % 16 == 0 and "fp4" in ops:
        out["fp4"] = moefuse.all_gather_rmsnorm_fp4_quantize(
            x, c["weight"], c["gs"], layout=layout, **kw
        )
    alpha = {"tensor": c["alpha"], "one": 1.0, "scalar": 0.75}[alpha_mode]
    router = poison_(torch.empty(m, h))
    ro, ffn = moefuse.all_gather_gated_residual_next_rmsnorm(
        x,
        c["residual"],
        alpha,
        c["beta"],
        c["weight"],
        post_eps=1e-5,
        next_eps=1e-6,
        post_weight=c["post_weight"],
        router_input=router,
        **kw,
    )
    out["gated"] = (ro, ffn, router)
    return out


def run_single(moefuse, c, layout="linear", alpha_mode="tensor", impl="triton", ops=ALL_OPS):
    """The same outputs from the full rows with the single-GPU ops (the definition)."""
    full = c["full"]
    m, h = full.shape
    out = {}
    out["rms"] = moefuse.rmsnorm(full, c["weight"], 1e-6, impl=impl)
    if "gemma" in ops:
        out["gemma"] = moefuse.gemma_rmsnorm(full, c["weight"], impl=impl)
    if "fp8" in ops:
        out["fp8"] = moefuse.rmsnorm_quant(full, c["weight"], c["scale"], impl=impl).view(
            torch.uint8
        )
    if h % 16 == 0 and "fp4" in ops:
        out["fp4"] = moefuse.rmsnorm_fp4_quantize(
            full, c["weight"], c["gs"], layout=layout, impl=impl
        )
    alpha = {"tensor": c["alpha"], "one": 1.0, "scalar": 0.75}[alpha_mode]
    router = torch.empty(m, h)
    ro, ffn = moefuse.gated_residual_next_rmsnorm(
        full,
        c["residual"],
        c["weight"],
        alpha,
        c["beta"],
        1e-5,
        1e-6,
        post_weight=c["post_weight"],
        router_input=router,
        impl=impl,
    )
    out["gated"] = (ro, ffn, router)
    return out


def assert_same(got, want, what):
    for key in want:
        a, b = got[key], want[key]
        a = a if isinstance(a, tuple) else (a,)
        b = b if isinstance(b, tuple) else (b,)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{what}: {key}[{i}]")


# ----------------------------------------------------------------------------- scenarios
def digest(out) -> str:
    import hashlib

    from moefuse.testing import bits

    sha = hashlib.sha1()
    for key in sorted(out):
        for t in out[key] if isinstance(out[key], tuple) else (out[key],):
            sha.update(bits(t).numpy().tobytes())
    return sha.hexdigest()


def agree_with_rank0(rank, p, got, want, what) -> None:
    """``got`` (a tuple of tensors) bitwise equal to ``want`` on rank 0, where ``want`` (the
    single-GPU op on the full rows, the same on every rank) is computed (other ranks: not used),
    and on the other ranks equal to rank 0's by digest."""
    import torch.distributed as dist

    if rank == 0:
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_bitwise_equal(a, b, f"{what} [{i}]")
    digests = [None] * p
    dist.all_gather_object(digests, digest({"got": got}))
    assert len(set(digests)) == 1, f"{what}: ranks differ"


def scenario_bitwise(rank, p, h, ms, layout, alpha_mode, full, chunk):
    """Fused one-shot (and, when ``full``, the torch algorithm and a token alone vs in a batch)
    bitwise equal to the single-GPU kernels on the gathered rows. ``full`` runs every op and
    checks on every rank; otherwise rmsnorm + the gated op, checked against the single-GPU ops
    on rank 0 and by digest across ranks (the interpreter is slow). ``chunk``: pipeline chunks
    of that many rows (MOEFUSE_ALLGATHER_CHUNK_ROWS, same on every rank), 0 = the default."""
    import os

    import torch.distributed as dist

    import moefuse

    if chunk:  # the chunk pipeline of the two-launch path (rmsnorm: not the persistent kernel)
        os.environ["MOEFUSE_ALLGATHER_CHUNK_ROWS"] = str(chunk)
        os.environ["MOEFUSE_ALLGATHER_LARGE"] = "chunked"
    ops = ALL_OPS if full else ("rms", "gated")
    ws = moefuse.AllReduceWorkspace(
        None, 8, h, BF16, "cpu", timeout_s=60, extra_regions=moefuse.allgather_regions(8, h)
    )
    try:
        for i, m in enumerate(ms):
            c = make_case(100 + i, p, m, h)
            want = (
                run_single(moefuse, c, layout, alpha_mode, ops=ops) if full or rank == 0 else None
            )
            for algo in ("oneshot", "torch") if full else ("oneshot",):
                got = run_all(
                    moefuse, ws, c, rank, p, algo, layout=layout, alpha_mode=alpha_mode, ops=ops
                )
                if want is not None:
                    assert_same(got, want, f"P={p} H={h} M={m} {algo}")
                digests = [None] * p
                dist.all_gather_object(digests, digest(got))
                assert len(set(digests)) == 1, f"P={p} H={h} M={m} {algo}: ranks differ"
        if full:  # a token alone equals the same token inside a batch (row 3 of the last case)
            c = make_case(100 + len(ms) - 1, p, ms[-1], h)
            batch = run_all(
                moefuse, ws, c, rank, p, "oneshot", layout=layout, alpha_mode=alpha_mode
            )
            one = dict(c, full=c["full"][3:4].clone(), residual=c["residual"][3:4].clone())
            alone = run_all(
                moefuse, ws, one, rank, p, "oneshot", layout=layout, alpha_mode=alpha_mode
            )
            for key in ("rms", "fp8"):
                assert_bitwise_equal(alone[key], batch[key][3:4], f"row alone: {key}")
            for i in range(3):
                assert_bitwise_equal(
                    alone["gated"][i], batch["gated"][i][3:4], f"row alone: gated[{i}]"
                )
        return int(moefuse.comm.all_gather.ops.allgather_state(ws).agctrl[0])
    finally:
        ws.close()


@pytest.mark.parametrize("p,h,ms,layout,alpha_mode,full,chunk", [
    (2, 96, (5,), "swizzled_128x4", "tensor", True, 0),  # (+ M = 1: the row alone)
    (3, 48, (5,), "linear", "scalar", False, 2),  # 3 pipeline chunks (2 + 2 + 1 rows)
    (4, 64, (1,), "swizzled_128x4", "one", False, 0),
])  # fmt: skip
def test_fused_equals_gather_then_single_gpu_op(p, h, ms, layout, alpha_mode, full, chunk):
    gens = run_group(p, scenario_bitwise, h, ms, layout, alpha_mode, full, chunk)
    assert len(set(gens)) == 1  # every rank advanced its generation alike


def scenario_contract(rank, p):
    """Validation, the references, workspaces without the region or without peers, generation
    wrap, opcheck and torch.compile."""
    import moefuse
    from moefuse.comm.all_gather import ops
    from moefuse.testing import assert_close, expect_value_error

    h, m = 64, 3
    ws = moefuse.AllReduceWorkspace(
        None, 8, h, BF16, "cpu", timeout_s=60, extra_regions=moefuse.allgather_regions(8, h)
    )
    c = make_case(7, p, m, h)
    x = shard_of(c["full"], rank, p)
    w, res = c["weight"], c["residual"]
    out = poison_(torch.empty(m, h, dtype=BF16))
    kw = dict(workspace=ws, impl="triton")
    # --- bad input: ValueError naming the argument, nothing written (no collective is entered)
    ag = moefuse.all_gather_rmsnorm
    expect_value_error(lambda: ag(x[:, :-1], w, out=out, **kw), "shard", out)
    expect_value_error(lambda: ag(x.float(), w, out=out, **kw), "shard", out)
    expect_value_error(lambda: ag(x, w[:-1], out=out, **kw), "weight", out)
    expect_value_error(lambda: ag(x, w, out=out[:, :-1], **kw), "out", out)
    expect_value_error(lambda: ag(x, w, out=out, eps=-1.0, **kw), "eps", out)
    expect_value_error(lambda: ag(x, w, out=out, algorithm="twoshot", **kw), "algorithm", out)
    expect_value_error(lambda: ag(x, w, out=out, workspace=None), "workspace", out)
    expect_value_error(lambda: moefuse.all_gather_rmsnorm_fp8(x, w, c["scale"][:0], **kw), "scale")
    expect_value_error(
        lambda: moefuse.all_gather_rmsnorm_fp4_quantize(x, w, c["gs"], layout="tiled", **kw),
        "layout",
    )
    ro = poison_(torch.empty(m, h))
    gated = moefuse.all_gather_gated_residual_next_rmsnorm
    expect_value_error(
        lambda: gated(x, res.to(BF16), c["alpha"], c["beta"], w, residual_out=ro, **kw),
        "residual",
        ro,
    )
    expect_value_error(
        lambda: gated(x, res, True, c["beta"], w, residual_out=ro, **kw), "alpha", ro
    )
    expect_value_error(
        lambda: gated(x, res, c["alpha"], c["beta"], w, residual_out=res[:, 1:], **kw),
        "residual_out",
        res,
    )
    ws40 = moefuse.AllReduceWorkspace(None, 4, 40, BF16, "cpu", peer_access=False)
    x40 = torch.randn(2, 40 // p).to(BF16)
    expect_value_error(
        lambda: moefuse.all_gather_rmsnorm_fp4_quantize(
            x40, torch.ones(40, dtype=BF16), c["gs"], workspace=ws40
        ),
        "shard",
    )
    ws40.close()
    # --- the references (FP64 statistics, exact rsqrt) within the single-GPU tolerances
    fused = run_all(moefuse, ws, c, rank, p, "auto")
    refs = run_all(moefuse, ws, c, rank, p, "auto", impl="reference")
    assert_close(fused["rms"], refs["rms"], "rsqrt_half", "rmsnorm vs reference")
    assert_close(
        fused["fp8"].view(torch.float8_e4m3fn),
        refs["fp8"].view(torch.float8_e4m3fn),
        "fp8_code",
        "fp8 vs reference",
    )
    assert_close(fused["gated"][0], refs["gated"][0], "fp32_stream", "residual_out vs reference")
    assert_close(fused["gated"][1], refs["gated"][1], "rsqrt_half", "ffn_input vs reference")
    # --- in place (residual_out is residual), pipelined in 2-row chunks (env: same on all ranks)
    import os

    want_ro, want_ffn = moefuse.gated_residual_next_rmsnorm(
        c["full"], res, w, c["alpha"], c["beta"], impl="triton"
    )
    stream = res.clone()
    os.environ["MOEFUSE_ALLGATHER_CHUNK_ROWS"] = "2"
    try:
        ro_i, ffn_i = gated(x, stream, c["alpha"], c["beta"], w, residual_out=stream, **kw)
    finally:
        del os.environ["MOEFUSE_ALLGATHER_CHUNK_ROWS"]
    assert ro_i is stream
    assert_bitwise_equal(stream, want_ro, "in place, chunked: residual_out")
    assert_bitwise_equal(ffn_i, want_ffn, "in place, chunked: ffn_input")
    # --- the experimental one-launch decode rmsnorm (opt-in; same bits as the single-GPU op)
    os.environ["MOEFUSE_ALLGATHER_ONE_LAUNCH"] = "1"
    try:
        one = ag(x, w, **kw)
    finally:
        del os.environ["MOEFUSE_ALLGATHER_ONE_LAUNCH"]
    assert_bitwise_equal(one, fused["rms"], "one-launch all_gather_rmsnorm")
    # --- FP16 shards (the gathered buffer is per dtype)
    xh = shard_of(c["full"].half(), rank, p)
    assert_bitwise_equal(
        ag(xh, w.half(), **kw),
        moefuse.rmsnorm(c["full"].half(), w.half(), impl="triton"),
        "FP16 shards",
    )
    # --- supports_*, and workspaces that cannot run the one-shot path: same bits via torch
    assert moefuse.supports_all_gather_rmsnorm(x, w, workspace=ws)
    assert not moefuse.supports_all_gather_rmsnorm(x[:, :-1], w, workspace=ws)
    plain = moefuse.AllReduceWorkspace(None, 8, h, BF16, "cpu")  # no "allgather" region
    nopeer = moefuse.AllReduceWorkspace(
        None, 8, h, BF16, "cpu", peer_access=False, extra_regions=moefuse.allgather_regions(8, h)
    )
    for other in (plain, nopeer):
        assert not moefuse.supports_all_gather_rmsnorm(x, w, workspace=other)
        got = ag(x, w, workspace=other, impl="triton")
        assert_bitwise_equal(got, fused["rms"], "auto on a workspace without the one-shot path")
        with pytest.raises(RuntimeError, match="oneshot"):
            ag(x, w, workspace=other, algorithm="oneshot", impl="triton")
    plain.close()
    nopeer.close()
    # --- the device-resident generation cycles 0, 1, 2, 0, ...
    state = ops.allgather_state(ws)
    gen0 = int(state.agctrl[0])
    for _ in range(4):
        ag(x, w, algorithm="oneshot", **kw)
    assert int(state.agctrl[0]) == (gen0 + 4) % 3 and int(state.agctrl[1]) == 0
    # --- custom ops: opcheck, torch.compile(fullgraph)
    e = lambda dt=BF16, shape=(m, h): torch.empty(shape, dtype=dt)  # noqa: E731
    cases = [
        (ops.all_gather_rmsnorm_op, (x, w, e(), ws.id, 1e-6, 0.0, "oneshot", False, "triton")),
        (
            ops.all_gather_rmsnorm_fp8_op,
            (x, w, c["scale"], e(torch.uint8), 0, ws.id, 1e-6, 0.0, "torch", False, "triton"),
        ),
        (
            ops.all_gather_rmsnorm_fp4_quantize_op,
            (
                x,
                w,
                c["gs"],
                e(torch.uint8, (m, h // 2)),
                e(torch.uint8, (m, h // 16)),
                ws.id,
                1e-6,
                0.0,
                "linear",
                "fast",
                "oneshot",
                False,
                "triton",
            ),
        ),
        (
            ops.all_gather_gated_residual_next_rmsnorm_op,
            (
                x,
                res,
                w,
                c["alpha"],
                1.0,
                c["beta"],
                None,
                e(torch.float32),
                e(),
                None,
                ws.id,
                1e-6,
                1e-6,
                0.0,
                0.0,
                "oneshot",
                False,
                "triton",
            ),
        ),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))

    def layer(x, res):
        ro, ffn = gated(x, res, c["alpha"], c["beta"], w, workspace=ws, impl="triton")
        n = ag(x, w, workspace=ws, impl="triton")
        return ro, ffn, n

    expected = layer(x, res)
    assert_compiles_to_eager_bits(layer, (x, res), expected)
    ws.close()
    # --- FlashInfer call styles (moefuse.compat.flashinfer)
    from moefuse.compat import flashinfer as fi

    dual = fi.MNNVLCuteDSLAllGatherDualNormWorkspace(p, rank, 8, h, device="cpu")
    dual.compile(post_eps=1e-6, next_eps=1e-6)
    assert dual.check_support() and dual.fits(x) and not dual.fits(x[:, :-1])
    assert fi.supports_all_gather_gated_residual_next_rmsnorm(
        dual, x, res, c["alpha"], c["beta"], w
    )
    ro_fi, ffn_fi = fi.all_gather_gated_residual_next_rmsnorm(
        x, res, c["alpha"], c["beta"], w, dual, post_eps=1e-6, next_eps=1e-6, impl="triton"
    )
    for a, b in zip((ro_fi, ffn_fi), expected[:2]):
        assert_bitwise_equal(a, b, "FlashInfer call style == moefuse")
    with pytest.raises(ValueError, match="'next_eps'"):
        fi.all_gather_gated_residual_next_rmsnorm(
            x, res, c["alpha"], c["beta"], w, dual, post_eps=1e-6, next_eps=1e-5
        )
    dual.destroy()
    nq = fi.MNNVLCuteDSLAllGatherNormQuantWorkspace(p, rank, 8, h, device="cpu")
    nq.compile(eps=1e-6)
    q_fi, sf_fi = fi.all_gather_rmsnorm_fp4_quantize(x, w, c["gs"], nq, eps=1e-6, impl="triton")
    q, sf = moefuse.rmsnorm_fp4_quantize(c["full"], w, c["gs"], layout="linear", impl="triton")
    assert_bitwise_equal(q_fi, q, "FlashInfer NVFP4 packed")
    assert_bitwise_equal(sf_fi, sf, "FlashInfer NVFP4 linear scales")
    nq.destroy()
    return True


def scenario_bounded_wait(rank, p):
    """The last rank skips one call: the others' call ends after ~timeout_s with a RuntimeError
    naming it; later calls raise at once; a new workspace works again."""
    import time

    import torch.distributed as dist

    import moefuse

    h, timeout = 48, 2.0
    c = make_case(3, p, 2, h)
    x = shard_of(c["full"], rank, p)
    make = lambda t=timeout: moefuse.AllReduceWorkspace(  # noqa: E731
        None, 4, h, BF16, "cpu", timeout_s=t, extra_regions=moefuse.allgather_regions(4, h)
    )
    call = lambda ws: moefuse.all_gather_rmsnorm(
        x,
        c["weight"],
        workspace=ws,  # noqa: E731
        algorithm="oneshot",
        impl="triton",
    )
    # a first call on a generous workspace: each process's first interpretation of the kernels
    # can take longer than the 2 s bound on a loaded 2-core machine
    ws = make(120.0)
    call(ws)
    ws.close()
    ws = make()
    dist.barrier()
    call(ws)
    span = None
    if rank != p - 1:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank\(s\) {p - 1} \(global rank {p - 1}\)"):
            call(ws)
        span = (t0, time.monotonic())
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="never arrived"):
            call(ws)
        assert time.monotonic() - t0 < timeout, "a failed workspace must not wait again"
    dist.barrier()
    ws.close()
    ws = make()
    want = moefuse.rmsnorm(c["full"], c["weight"], impl="triton")
    assert_bitwise_equal(call(ws), want, "after re-creation")
    ws.close()
    return span


def test_contract_references_fallbacks_and_custom_ops():
    # processes: ranks that trace (opcheck, torch.compile) cannot be threads of one process
    assert all(run_group(2, scenario_contract, ranks="processes"))


@pytest.mark.parametrize("p", [2, 3])
def test_bounded_wait_names_the_missing_rank(p):
    # (the decode kernel's default "slots" mode: the late rank is named from the owners of the
    # words still empty; at P = 3 the rank that did arrive must not be named)
    spans = run_group(p, scenario_bounded_wait)
    assert spans[-1] is None and None not in spans[:-1]
    assert_bounded_waits(spans, timeout_s=2.0)


def test_bench_bar_lines():
    """The benchmark's bar logic on synthetic rows (no GPU): PASS / FAIL where the issue says."""
    from moefuse.bench.all_gather import bar_checks

    def row(m, us, best, bound):
        return {
            "variant": "moefuse",
            "op": "all_gather_rmsnorm",
            "P": 2,
            "H": 4096,
            "M": m,
            "us": us,
            "x_best_unfused": best / us,
            "x_nvlink_bound": bound / us,
            "nvlink_bound_us": bound,
        }

    lines = bar_checks(
        [row(1, 4.5, 10.0, 0.01), row(64, 8.0, 14.0, 0.6), row(4096, 120.0, 147.0, 100.0)]
    )
    fails = [x for x in lines if x.startswith("BAR FAIL")]
    assert len(lines) == 7 and len(fails) == 1 and "M=64" in fails[0] and "/ 2" in fails[0]
    lines = bar_checks([row(1, 5.5, 12.0, 0.01), row(16384, 700.0, 515.0, 300.0)])
    fails = " ".join(x for x in lines if x.startswith("BAR FAIL"))
    assert "<= 5.0" in fails and "NVLink" in fails and "best unfused 515.00" in fails


def scenario_one_launch_stepped(rank, p):
    """The one-launch decode kernel on stepped rows (H = 8192: rmsnorm's tile steps the row),
    M = 2, in every decode mode (late, early, slots), against moefuse.rmsnorm and the default
    two-launch path."""
    import os

    import moefuse

    h = 8192
    ws = moefuse.AllReduceWorkspace(
        None, 2, h, BF16, "cpu", oneshot_max_tokens=1, extra_regions=moefuse.allgather_regions(2, h)
    )
    c = make_case(11, p, 2, h)
    x, w = shard_of(c["full"], rank, p), c["weight"]
    want = moefuse.rmsnorm(c["full"], w, impl="triton")
    os.environ["MOEFUSE_ALLGATHER_ONE_LAUNCH"] = "1"
    try:
        for mode in ("late", "early", "slots"):
            os.environ["MOEFUSE_ALLGATHER_DECODE"] = mode
            one = moefuse.all_gather_rmsnorm(x, w, workspace=ws, impl="triton")
            assert_bitwise_equal(one, want, f"one launch, stepped rows, {mode}")
    finally:
        del os.environ["MOEFUSE_ALLGATHER_ONE_LAUNCH"], os.environ["MOEFUSE_ALLGATHER_DECODE"]
    assert_bitwise_equal(
        moefuse.all_gather_rmsnorm(x, w, workspace=ws, impl="triton"),
        want,
        "two launches, stepped rows",
    )
    ws.close()
    return True


def test_one_launch_decode_stepped_rows():
    assert all(run_group(2, scenario_one_launch_stepped))


# ----------------------------------------------------------------------------- persistent kernel
def scenario_fused_large(rank, p, h, ms, grid, lookahead, loop_min_rows, mode=""):
    """The persistent gather + rmsnorm kernel (comm/all_gather/persistent.py) forced at small M:
    decode kernel off, ``grid`` CTAs (several tiles each), ``lookahead`` tiles pushed ahead;
    rmsnorm and gemma_rmsnorm bitwise against moefuse.rmsnorm of the full rows (on rank 0; the
    other ranks against rank 0 by digest) and against the torch algorithm, over enough calls to
    wrap the generations. ``loop_min_rows`` (stepped widths):
    the row count from which both the single-GPU op and the fused kernel loop over the steps.
    ``mode``: MOEFUSE_ALLGATHER_PERSISTENT ("" = the default: one-pass rmsnorm tiles are read
    from the slots)."""
    import os

    import moefuse
    from moefuse.comm.all_gather import persistent as allgather_fused
    from moefuse.norm import tiles

    counts = {"persistent": 0}
    count_calls(allgather_fused, "launch_ag_rmsnorm_persistent", counts, "persistent")
    if loop_min_rows:
        tiles.RMSNORM_LOOP_MIN_ROWS = loop_min_rows
    os.environ.update(
        {
            "MOEFUSE_ALLGATHER_ONE_LAUNCH": "0",
            "MOEFUSE_ALLGATHER_LARGE": "fused",
            "MOEFUSE_ALLGATHER_FUSED_GRID": str(grid),
            "MOEFUSE_ALLGATHER_LOOKAHEAD": str(lookahead),
            "MOEFUSE_ALLGATHER_PERSISTENT": mode,
        }
    )
    cap = max(ms)
    ws = moefuse.AllReduceWorkspace(
        None, cap, h, BF16, "cpu", timeout_s=60, extra_regions=moefuse.allgather_regions(cap, h)
    )
    try:
        for i, m in enumerate(ms):
            c = make_case(200 + i, p, m, h)
            x, w = shard_of(c["full"], rank, p), c["weight"]
            for center in (0.0, 1.0):
                single = moefuse.gemma_rmsnorm if center else moefuse.rmsnorm
                want = single(c["full"], w, 1e-6, impl="triton") if rank == 0 else None
                for algo in ("oneshot", "torch"):
                    out = poison_(torch.empty(m, h, dtype=BF16))
                    got = moefuse.all_gather_rmsnorm(
                        x,
                        w,
                        workspace=ws,
                        gain_center=center,
                        algorithm=algo,
                        impl="triton",
                        out=out,
                    )
                    what = f"P={p} H={h} M={m} c={center} {algo}"
                    agree_with_rank0(rank, p, (got,), (want,), what)
        ws.check()
        assert counts["persistent"] == 2 * len(ms), counts  # the one-shot calls ran the new kernel
        os.environ["MOEFUSE_ALLGATHER_LARGE"] = "chunked"  # the old two-launch path, same bits
        got = moefuse.all_gather_rmsnorm(x, w, workspace=ws, impl="triton", algorithm="oneshot")
        want = moefuse.rmsnorm(c["full"], w, 1e-6, impl="triton") if rank == 0 else None
        agree_with_rank0(rank, p, (got,), (want,), "chunked")
        assert counts["persistent"] == 2 * len(ms), counts
        return int(moefuse.comm.all_gather.ops.allgather_state(ws).agctrl[0])
    finally:
        ws.close()


@pytest.mark.parametrize("p,h,ms,grid,lookahead,loop_min_rows,mode", [
    (2, 96, (77, 5, 33), 2, 1, 0, ""),  # 16-row masked tiles: 5 tiles over 2 CTAs, then 1, 3
    (3, 48, (70, 3), 2, 3, 0, "gathered"),  # 32-row tiles; lookahead beyond a CTA's last tile
    (2, 2400, (7,), 3, 2, 0, ""),  # one masked row per tile, 3 CTAs
    (3, 7680, (5,), 2, 1, 0, ""),  # stepped rows (2 x 4096, masked), unrolled
    (2, 7680, (5,), 2, 2, 4, ""),  # stepped rows, looped (the single-GPU mode from 4 rows here)
    # stepped rows unrolled in the kernel against the single-GPU op's looped ones: parameters
    # before the poll, rows gathered ("early") or read from the slots
    (2, 7680, (5,), 2, 1, 4, "early"),
    (3, 7680, (4,), 2, 2, 4, "slots"),
])  # fmt: skip
def test_fused_persistent_kernel_bitwise(p, h, ms, grid, lookahead, loop_min_rows, mode):
    gens = run_group(p, scenario_fused_large, h, ms, grid, lookahead, loop_min_rows, mode)
    assert len(set(gens)) == 1


def test_fused_knobs_raise_clear_errors(monkeypatch):
    from moefuse.comm.all_gather import decode as dec
    from moefuse.comm.all_gather import persistent as fused

    monkeypatch.setenv("MOEFUSE_ALLGATHER_LARGE", "persistent")
    with pytest.raises(ValueError, match="MOEFUSE_ALLGATHER_LARGE must be one of"):
        fused.large_mode()
    monkeypatch.setenv("MOEFUSE_ALLGATHER_LARGE", "chunked")
    assert fused.fused_tile(4096, 4096) is None
    monkeypatch.delenv("MOEFUSE_ALLGATHER_LARGE")
    assert fused.fused_tile(4096, 64) is None  # decode range: two launches unless set explicitly
    assert fused.fused_tile(4096, 65).rows == 1 and fused.fused_tile(8192, 65).stepped
    assert fused.fused_tile(20000, 4096) is None  # chunked rmsnorm tile: the two-launch path
    # the gated op: persistent at every M on stepped rows, the chunk pipeline above 512 tokens
    # on its one-pass tiles (<= 2048 columns)
    assert fused.fused_tile(4096, 16384, dec.GATED).stepped
    assert fused.fused_tile(2048, 512, dec.GATED) is not None
    assert fused.fused_tile(2048, 513, dec.GATED) is None
    monkeypatch.setenv("MOEFUSE_ALLGATHER_FUSED_UNROLL", "yes")
    with pytest.raises(ValueError, match="MOEFUSE_ALLGATHER_FUSED_UNROLL must be 0 or 1"):
        fused.persistent_unroll(dec.GATED, dec.op_tile(dec.GATED, 4096), True)
    monkeypatch.setenv("MOEFUSE_ALLGATHER_FUSED_UNROLL", "1")
    assert fused.persistent_unroll(dec.GATED, dec.op_tile(dec.GATED, 4096), False)
    assert not fused.persistent_unroll(dec.GATED, dec.op_tile(dec.GATED, 16384), False)  # 8 steps
    monkeypatch.delenv("MOEFUSE_ALLGATHER_FUSED_UNROLL")
    assert not fused.persistent_unroll(dec.GATED, dec.op_tile(dec.GATED, 4096), True)  # looped
    assert fused.persistent_unroll(dec.RMSNORM, dec.op_tile(dec.RMSNORM, 8192), True)
    for value in ("0", "two"):
        monkeypatch.setenv("MOEFUSE_ALLGATHER_LOOKAHEAD", value)
        with pytest.raises(ValueError, match="MOEFUSE_ALLGATHER_LOOKAHEAD must be an integer >= 1"):
            knobs.get(fused.LOOKAHEAD_ENV)


def test_decode_and_persistent_modes(monkeypatch):
    """The modes of the one-launch kernels: defaults per op and width, knob overrides where the
    tile is eligible, clear errors naming the variable."""
    from moefuse.comm.all_gather import decode as dec
    from moefuse.comm.all_gather import persistent as fused

    for op, want in (
        (dec.RMSNORM, (True, True)),
        (dec.FP8, (True, True)),
        (dec.FP4, (False, False)),
        (dec.GATED, (False, False)),
    ):
        assert dec.decode_mode(op, dec.op_tile(op, 4096)) == want, op
    assert dec.decode_mode(dec.RMSNORM, dec.op_tile(dec.RMSNORM, 8192)) == (False, False)
    assert fused.persistent_mode(dec.RMSNORM, dec.op_tile(dec.RMSNORM, 4096)) == (False, True)
    assert fused.persistent_mode(dec.FP8, dec.op_tile(dec.FP8, 4096)) == (False, True)
    assert fused.persistent_mode(dec.FP8, dec.op_tile(dec.FP8, 8192)) == (False, False)
    assert fused.persistent_mode(dec.FP4, dec.op_tile(dec.FP4, 4096)) == (False, False)
    for op, h in ((dec.RMSNORM, 8192), (dec.GATED, 4096)):  # stepped rows: the table's mode
        mode = fused.PERSISTENT_DEFAULT[op]
        assert fused.persistent_mode(op, dec.op_tile(op, h)) == (
            mode != "gathered",
            mode == "slots",
        ), op
    monkeypatch.setenv("MOEFUSE_ALLGATHER_DECODE", "early")
    assert dec.decode_mode(dec.GATED, dec.op_tile(dec.GATED, 4096)) == (True, False)
    assert dec.decode_mode(dec.RMSNORM, dec.op_tile(dec.RMSNORM, 8192)) == (True, False)
    chunked = dec.op_tile(dec.RMSNORM, 20000)  # two-pass rows: never a one-launch mode
    assert dec.decode_mode(dec.RMSNORM, chunked) == (False, False)
    assert fused.persistent_mode(dec.RMSNORM, chunked) == (False, False)
    monkeypatch.setenv("MOEFUSE_ALLGATHER_PERSISTENT", "slots")
    assert fused.persistent_mode(dec.FP4, dec.op_tile(dec.FP4, 4096)) == (False, True)
    assert fused.persistent_mode(dec.GATED, dec.op_tile(dec.GATED, 4096)) == (True, True)
    assert fused.persistent_mode(dec.GATED, dec.op_tile(dec.GATED, 2048)) == (False, False)
    assert fused.persistent_mode(dec.GATED, dec.op_tile(dec.GATED, 16384)) == (False, False)
    monkeypatch.setenv("MOEFUSE_ALLGATHER_PERSISTENT", "early")
    assert fused.persistent_mode(dec.RMSNORM, dec.op_tile(dec.RMSNORM, 8192)) == (True, False)
    assert fused.persistent_mode(dec.FP8, dec.op_tile(dec.FP8, 4096)) == (True, False)
    monkeypatch.setenv("MOEFUSE_ALLGATHER_DECODE", "fast")
    with pytest.raises(ValueError, match="MOEFUSE_ALLGATHER_DECODE must be one of"):
        dec.decode_mode(dec.FP8, dec.op_tile(dec.FP8, 4096))
    monkeypatch.setenv("MOEFUSE_ALLGATHER_PERSISTENT", "fast")
    with pytest.raises(ValueError, match="MOEFUSE_ALLGATHER_PERSISTENT must be one of"):
        fused.persistent_mode(dec.FP8, dec.op_tile(dec.FP8, 4096))


# --------------------------------------------------------------------- FP8 / NVFP4 one launch
def scenario_fused_ops(
    rank, p, h, ms, grid, lookahead, decode, cases, loop_min_rows=0, decode_mode=""
):
    """all_gather_rmsnorm_fp8 / _fp4_quantize / gated_residual_next_rmsnorm on the one-launch
    kernels: the decode kernel at M <= 64 when ``decode``, else the persistent
    kernel forced (grid cap ``grid``: several tiles per CTA, ``lookahead`` tiles ahead); outputs
    poisoned first, bitwise against the single-GPU op on the full rows (run on rank 0; the other
    ranks equal rank 0 by digest: :func:`agree_with_rank0`), and the fused launcher counted (not
    the two-launch fallback). ``cases``: ("fp8", dtype code 0 / 1), ("fp4", layout), ("gated",
    "tensor" | "scalar"). ``loop_min_rows``: the gated op's stepped rows
    loop from this many rows (single-GPU op and fused kernel alike). ``decode_mode``: the
    decode kernel's mode for every op (``allgather_decode.decode_mode``; "" = each op's
    default); "slots" / "late" also put the persistent kernel in its slots / gathered mode."""
    import os

    import moefuse
    from moefuse.comm.all_gather import decode as allgather_decode
    from moefuse.comm.all_gather import persistent as allgather_fused
    from moefuse.norm import tiles

    if loop_min_rows:
        tiles.STEP_LOOP_MIN_ROWS = loop_min_rows

    counts = {"decode": 0, "persistent": 0}
    count_calls(allgather_decode, "launch_ag_rmsnorm", counts, "decode")
    count_calls(allgather_fused, "launch_ag_rmsnorm_persistent", counts, "persistent")
    os.environ.update(
        {
            "MOEFUSE_ALLGATHER_ONE_LAUNCH": "1" if decode else "0",
            "MOEFUSE_ALLGATHER_DECODE": decode_mode,
            "MOEFUSE_ALLGATHER_PERSISTENT": {
                "slots": "slots",
                "late": "gathered",
                "early": "early",
            }.get(decode_mode, ""),
            "MOEFUSE_ALLGATHER_LARGE": "fused",
            "MOEFUSE_ALLGATHER_FUSED_GRID": str(grid),
            "MOEFUSE_ALLGATHER_LOOKAHEAD": str(lookahead),
        }
    )
    cap = max(ms)
    ws = moefuse.AllReduceWorkspace(
        None, cap, h, BF16, "cpu", timeout_s=60, extra_regions=moefuse.allgather_regions(cap, h)
    )
    fp8_dtypes = (torch.float8_e4m3fn, torch.float8_e5m2)
    want_counts = {"decode": 0, "persistent": 0}
    try:
        for i, m in enumerate(ms):
            c = make_case(300 + i, p, m, h)
            x, w = shard_of(c["full"], rank, p), c["weight"]
            what = f"P={p} H={h} M={m}"
            for kind, arg in cases:
                want_counts["decode" if decode and m <= 64 else "persistent"] += 1
                # the single-GPU op on the full rows: the same on every rank, run on rank 0
                ref = rank == 0
                if kind == "fp8":
                    dt = fp8_dtypes[arg]
                    want = (
                        moefuse.rmsnorm_quant(c["full"], w, c["scale"], dtype=dt, impl="triton")
                        if ref
                        else None
                    )
                    out = poison_(torch.empty(m, h, dtype=torch.uint8)).view(dt)
                    got = moefuse.all_gather_rmsnorm_fp8(
                        x, w, c["scale"], workspace=ws, out=out, algorithm="oneshot", impl="triton"
                    )
                    assert got is out
                    got, want = (got.view(torch.uint8),), ref and (want.view(torch.uint8),)
                    agree_with_rank0(rank, p, got, want, f"{what} fp8 {dt}")
                elif kind == "gated":  # "tensor": alpha tensor, post weight, router output;
                    # "scalar": scalar alpha, Gemma next gain, in place (residual_out = residual)
                    tensor = arg == "tensor"
                    kw = dict(
                        post_weight=c["post_weight"] if tensor else None,
                        next_gain_center=0.0 if tensor else 1.0,
                    )
                    alpha = c["alpha"] if tensor else 0.75
                    router_want = torch.empty(m, h) if tensor else None
                    want = None
                    if ref:
                        want = moefuse.gated_residual_next_rmsnorm(
                            c["full"],
                            c["residual"],
                            w,
                            alpha,
                            c["beta"],
                            1e-5,
                            1e-6,
                            router_input=router_want,
                            impl="triton",
                            **kw,
                        )
                        want = (*want[:2], router_want) if tensor else want[:2]
                    stream = c["residual"].clone()
                    ro = stream if not tensor else poison_(torch.empty(m, h))
                    router = poison_(torch.empty(m, h)) if tensor else None
                    ffn = poison_(torch.empty(m, h, dtype=BF16))
                    got = moefuse.all_gather_gated_residual_next_rmsnorm(
                        x,
                        stream,
                        alpha,
                        c["beta"],
                        w,
                        workspace=ws,
                        post_eps=1e-5,
                        next_eps=1e-6,
                        residual_out=ro,
                        ffn_input=ffn,
                        router_input=router,
                        algorithm="oneshot",
                        impl="triton",
                        **kw,
                    )
                    assert got[0] is ro and got[1] is ffn
                    got = (ro, ffn, router) if tensor else (ro, ffn)
                    # residual_out, ffn_input (and the router input)
                    agree_with_rank0(rank, p, got, want, f"{what} gated {arg}")
                else:
                    want = None
                    if ref:
                        want = moefuse.rmsnorm_fp4_quantize(
                            c["full"], w, c["gs"], layout=arg, impl="triton"
                        )
                    q = poison_(torch.empty(m, h // 2, dtype=torch.uint8))
                    sf = poison_(torch.empty(moefuse.scale_shape(m, h, arg), dtype=torch.uint8))
                    got = moefuse.all_gather_rmsnorm_fp4_quantize(
                        x,
                        w,
                        c["gs"],
                        workspace=ws,
                        layout=arg,
                        out=q,
                        scale_out=sf,
                        algorithm="oneshot",
                        impl="triton",
                    )
                    assert got[0] is q and got[1] is sf
                    # packed codes, scales
                    agree_with_rank0(rank, p, tuple(got), want, f"{what} fp4 {arg}")
        ws.check()
        assert counts == want_counts, (counts, want_counts)  # the one-launch kernels ran
        return int(moefuse.comm.all_gather.ops.allgather_state(ws).agctrl[0])
    finally:
        ws.close()


@pytest.mark.parametrize("p,h,ms,grid,lookahead,decode,cases,loop_min_rows,decode_mode", [
    # persistent: 16-row masked tiles (H = 96), 5 tiles over 2 CTAs; swizzled scales pad to 128
    # rows = 8 tiles, of which 3 only write zero scale bytes
    (2, 96, (70,), 2, 1, False, (("fp8", 0), ("fp4", "swizzled_128x4"), ("gated", "tensor")), 0,
     ""),
    (3, 48, (33,), 2, 2, False, (("fp8", 1), ("fp4", "linear"), ("gated", "scalar")), 0,
     "late"),
    # one masked row per tile; the gated op's rows are stepped (2 x 2048), looped from 4 rows
    (2, 2400, (5,), 3, 2, False, (("fp8", 0), ("fp4", "swizzled_8x4"), ("gated", "tensor")), 4,
     ""),
    # the persistent kernel reading its one-pass tiles straight from the slots
    (3, 96, (70,), 2, 1, False, (("fp8", 1), ("fp4", "swizzled_128x4"), ("gated", "tensor")), 0,
     "slots"),
    # ... and the gated op's stepped rows (unrolled, against the single-GPU op's looped rows)
    # with the residual and parameters before the poll, rows gathered / from the slots
    (2, 2400, (5,), 3, 2, False, (("gated", "tensor"), ("fp8", 0)), 4, "early"),
    (3, 2400, (5,), 2, 1, False, (("gated", "scalar"),), 4, "slots"),
    # the one-launch decode kernel (one program per tile; padding tiles of the scale layout too;
    # the gated op's stepped rows unrolled at H = 2400), each op's default mode, then every op
    # in the modes "early" (parameters before the wait) and "slots" (tile read from the slots)
    (2, 96, (1, 33), 0, 1, True, (("fp8", 0), ("fp4", "swizzled_128x4"), ("gated", "scalar")), 0,
     ""),
    (3, 2400, (5,), 0, 1, True, (("fp8", 1), ("fp4", "linear"), ("gated", "tensor")), 0, ""),
    (2, 96, (1, 33), 0, 1, True, (("fp8", 0), ("fp4", "swizzled_128x4"), ("gated", "tensor")), 0,
     "early"),
    (3, 2400, (5,), 0, 1, True, (("fp8", 0), ("fp4", "swizzled_128x4"), ("gated", "scalar")), 0,
     "slots"),
])  # fmt: skip
def test_fused_ops_one_launch_kernels_bitwise(
    p, h, ms, grid, lookahead, decode, cases, loop_min_rows, decode_mode
):
    gens = run_group(
        p, scenario_fused_ops, h, ms, grid, lookahead, decode, cases, loop_min_rows, decode_mode
    )
    assert len(set(gens)) == 1
