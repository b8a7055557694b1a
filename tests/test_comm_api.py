"""All-reduce fusions on CPU, API contract across real processes: argument validation (ValueError
naming the argument, outputs untouched), explicit requests that cannot run (RuntimeError), M = 0,
in-place outputs, impl selection, workspace lifecycle and votes, bounded waits (one process skips a
call), opcheck and torch.compile(fullgraph=True)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from comm_mp import assert_bounded_waits, assert_compiles_to_eager_bits, run_group
from moefuse.comm.all_reduce import reference as ref
from moefuse.testing import assert_bitwise_equal, bits, poison_
from test_comm import make_case

pytestmark = pytest.mark.interpreter
BF16 = torch.bfloat16


def _expect(exc, fn, match, *untouched):
    before = [bits(t).clone() for t in untouched]
    with pytest.raises(exc, match=match):
        fn()
    for t, b in zip(untouched, before):
        assert torch.equal(bits(t), b), f"an output was written before the {exc.__name__}"


# ----------------------------------------------------------------------------- scenarios
def scenario_validation(rank, world_size):
    import moefuse

    h = 48
    ws = moefuse.AllReduceWorkspace(None, 8, h, BF16, "cpu", timeout_s=60)
    ws80 = moefuse.AllReduceWorkspace(None, 8, 200, BF16, "cpu", timeout_s=60)
    partials, res, w = make_case(11, world_size, 3, h, BF16)
    x = partials[rank]
    ro, no = poison_(torch.empty_like(x)), poison_(torch.empty_like(x))
    ar = moefuse.allreduce_residual_rmsnorm

    def call(**kw):
        args = dict(input=x, residual=res, weight=w)
        args.update({k: kw.pop(k) for k in ("input", "residual", "weight") if k in kw})
        opts = dict(workspace=ws, residual_out=ro, norm_out=no, impl="triton")
        opts.update(kw)
        return lambda: ar(args["input"], args["residual"], args["weight"], **opts)

    _expect(ValueError, call(residual=res[:2]), "'residual'", ro, no)
    _expect(ValueError, call(weight=w[:5]), "'weight'", ro, no)
    _expect(ValueError, call(weight=w.to(torch.int32)), "'weight'", ro, no)
    _expect(ValueError, call(workspace=None), "'workspace'", ro, no)
    _expect(ValueError, call(input=x.half(), residual=res.half()), "'input'", ro, no)
    _expect(ValueError, call(workspace=ws80), "'input'", ro, no)
    _expect(ValueError, call(algorithm="nccl"), "'algorithm'", ro, no)
    _expect(ValueError, call(eps=-1.0), "'eps'", ro, no)
    _expect(ValueError, call(fp32_acc=1), "'fp32_acc'", ro, no)
    _expect(ValueError, call(weight_bias="1"), "'weight_bias'", ro, no)
    _expect(ValueError, call(norm_out=res), "'norm_out'", ro)
    big = poison_(torch.empty(4, h, dtype=BF16))
    _expect(ValueError, call(residual=big[:3], residual_out=big[1:]), "'residual_out'", ro, no)
    _expect(ValueError, call(impl="cuda"), "impl", ro, no)
    _expect(ValueError, call(residual_out=torch.empty(3, h)), "'residual_out'", ro, no)
    q = poison_(torch.empty(3, h, dtype=torch.uint8))
    _expect(
        ValueError,
        lambda: moefuse.allreduce_residual_rmsnorm_fp8(
            x, res, w, torch.ones(2), workspace=ws, impl="triton"
        ),
        "'scale'",
    )
    _expect(
        ValueError,
        lambda: moefuse.allreduce_residual_rmsnorm_nvfp4(
            x, res, w, torch.ones(1), workspace=ws, layout="swizzled", impl="triton"
        ),
        "'layout'",
    )
    x200 = torch.randn(3, 200).to(BF16)
    _expect(
        ValueError,
        lambda: moefuse.allreduce_residual_rmsnorm_nvfp4(
            x200, x200, torch.ones(200, dtype=BF16), torch.ones(1), workspace=ws80
        ),
        "divisible by 16",
    )
    _expect(ValueError, lambda: moefuse.allreduce(x, workspace=ws, out=q), "'out'", q)
    assert not moefuse.supports_allreduce_residual_rmsnorm(x, res[:2], w, workspace=ws)
    assert not moefuse.supports_allreduce_residual_rmsnorm_nvfp4(
        x200, x200, torch.ones(200, dtype=BF16), torch.ones(1), workspace=ws80
    )
    assert moefuse.supports_allreduce_residual_rmsnorm(x, res, w, workspace=ws)
    assert moefuse.supports_allreduce_residual_rmsnorm_fp8(x, res, w, torch.ones(1), workspace=ws)

    # explicit requests that cannot run raise (same decision on every rank: no desync)
    small = moefuse.AllReduceWorkspace(None, 2, h, BF16, "cpu", oneshot_max_tokens=1)
    _expect(RuntimeError, call(workspace=small), "cannot run", ro, no)  # 3 tokens > max_tokens
    _expect(
        RuntimeError,
        lambda: moefuse.allreduce(x[:2], workspace=small, algorithm="oneshot", impl="triton"),
        "one-shot holds",
    )
    small.close()
    ws80.close()

    # M = 0 is a no-op without communication: only rank 0 calls it, then a real call must work
    if rank == 0:
        r0, n0 = ar(x[:0], res[:0], w, workspace=ws, impl="triton")
        assert r0.shape == (0, h) and n0.shape == (0, h)
    h_ref, n_ref = ref.allreduce_residual_rmsnorm_from_partials(partials, res, w)
    for algo in ("oneshot", "twoshot", "torch"):
        # in place: residual_out is residual, norm_out is input
        xi, ri = x.clone(), res.clone()
        out = ar(
            xi, ri, w, workspace=ws, residual_out=ri, norm_out=xi, algorithm=algo, impl="triton"
        )
        assert out[0] is ri and out[1] is xi
        ro_k, no_k = ar(x, res, w, workspace=ws, algorithm=algo, impl="triton")
        assert_bitwise_equal(ri, h_ref, f"{algo} in-place residual_out")
        assert_bitwise_equal(xi, no_k, f"{algo} in-place norm_out")
    # impl="auto" on CPU tensors runs the reference; "reference" matches the oracle exactly
    for impl in ("auto", "reference"):
        r_a, n_a = ar(x, res, w, workspace=ws, impl=impl)
        assert_bitwise_equal(r_a, h_ref, f"impl={impl} residual_out")
        assert_bitwise_equal(n_a, n_ref, f"impl={impl} norm_out")
    ws.close()
    ws.close()  # idempotent
    assert ws.closed
    _expect(RuntimeError, lambda: ar(x, res, w, workspace=ws, impl="triton"), "closed")
    _expect(RuntimeError, lambda: ar(x, res, w, workspace=ws, impl="reference"), "closed")
    return True


def scenario_lifecycle(rank, world_size):
    """Votes, supports, capture(), the torch.distributed-only workspace, no files left behind."""
    import moefuse

    h = 64
    ws = moefuse.AllReduceWorkspace(None, 16, h, BF16, "cpu", timeout_s=60)
    assert ws.peer_access and ws.transport.kind == "shm"
    shm = (
        [f for f in os.listdir("/dev/shm") if f"moefuse-comm-{os.getpid()}-" in f]
        if os.path.isdir("/dev/shm")
        else []
    )
    assert shm == [], f"shared-memory names must be unlinked once mapped: {shm}"
    x = torch.randn(5, h).to(BF16)
    assert ws.supports(x) and not ws.supports(x[:, :32]) and not ws.supports(x.half())
    assert not ws.supports(torch.randn(17, h).to(BF16))  # more than max_tokens
    assert ws.vote(True) is True
    assert ws.vote(rank == 0) is False  # MIN over the group: one dissent decides for all
    assert ws.choose_algorithm(1) == "oneshot"
    assert ws.choose_algorithm(16, "twoshot") == "twoshot"
    extra = moefuse.AllReduceWorkspace(None, 4, h, BF16, "cpu", extra_regions={"mailbox": 1000})
    off, nbytes = extra.regions["mailbox"]
    assert nbytes == 1000 and off % 256 == 0 and off + nbytes <= extra.buffer_bytes
    assert extra.offset16("mailbox") * 16 == off
    assert int(extra.transport.local[off : off + nbytes].sum()) == 0  # zero-filled
    extra.close()
    nopeer = moefuse.AllReduceWorkspace(None, 16, h, BF16, "cpu", peer_access=False)
    assert not nopeer.peer_access and nopeer.choose_algorithm(5) == "torch"
    partials, res, w = make_case(5, world_size, 5, h, BF16)
    with ws.capture():
        expected = moefuse.allreduce_residual_rmsnorm(
            partials[rank], res, w, workspace=ws, impl="triton"
        )
    got = moefuse.allreduce_residual_rmsnorm(
        partials[rank], res, w, workspace=nopeer, impl="triton"
    )
    for a, b in zip(got, expected):
        assert_bitwise_equal(a, b, "torch.distributed-only workspace")
    with pytest.raises(RuntimeError, match="peer"):
        moefuse.allreduce(partials[rank], workspace=nopeer, algorithm="oneshot", impl="triton")
    # the generation counters cycle on the device (here: host) side only
    gen0 = int(ws.ctrl[0])
    for _ in range(4):
        moefuse.allreduce(partials[rank], workspace=ws, algorithm="oneshot", impl="triton")
    assert int(ws.ctrl[0]) == (gen0 + 4) % 3
    nopeer.close()
    ws.close()
    return True


def scenario_bounded_wait(rank, world_size, algo):
    """The last rank skips one call: the others' call ends after ~timeout_s with a RuntimeError
    naming it; later calls raise at once; close + re-create restores service."""
    import torch.distributed as dist

    import moefuse

    h, timeout = 48, 2.0
    skipper = world_size - 1
    partials, res, w = make_case(3, world_size, 3, h, BF16)
    x = partials[rank]
    ws = moefuse.AllReduceWorkspace(None, 8, h, BF16, "cpu", timeout_s=timeout)
    call = lambda ws: moefuse.allreduce_residual_rmsnorm(  # noqa: E731
        x, res, w, workspace=ws, algorithm=algo, impl="triton"
    )
    call(ws)
    span = None
    if rank != skipper:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=rf"rank\(s\) {skipper} \(global rank {skipper}\)"):
            call(ws)
        span = (t0, time.monotonic())
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="never arrived"):
            call(ws)
        assert time.monotonic() - t0 < timeout, "a failed workspace must not wait again"
        with pytest.raises(RuntimeError, match="never arrived"):
            ws.check()
    dist.barrier()
    ws.close()
    ws = moefuse.AllReduceWorkspace(None, 8, h, BF16, "cpu", timeout_s=timeout)
    h_ref, _ = ref.allreduce_residual_rmsnorm_from_partials(partials, res, w)
    assert_bitwise_equal(call(ws)[0], h_ref, "after re-creation")
    ws.check()
    ws.close()
    return span


def scenario_opcheck_compile(rank, world_size):
    import moefuse
    from moefuse.comm.all_reduce import ops

    h = 48
    ws = moefuse.AllReduceWorkspace(None, 8, h, BF16, "cpu", timeout_s=60)
    partials, res, w = make_case(9, world_size, 3, h, BF16)
    x = partials[rank]
    e = lambda dt=BF16, shape=(3, h): torch.empty(shape, dtype=dt)  # noqa: E731
    sc = torch.tensor([0.5])
    cases = [
        (ops.allreduce_op, (x, e(), ws.id, True, "oneshot", False, "triton")),
        (
            ops.allreduce_residual_rmsnorm_op,
            (x, res, w, e(), e(), ws.id, 1e-6, 0.0, True, "twoshot", False, "triton"),
        ),
        (
            ops.allreduce_residual_rmsnorm_fp8_op,
            (
                x,
                res,
                w,
                sc,
                e(),
                None,
                e(torch.uint8),
                ws.id,
                1e-6,
                1.0,
                True,
                "torch",
                False,
                "triton",
            ),
        ),
        (
            ops.allreduce_residual_rmsnorm_nvfp4_op,
            (
                x,
                res,
                w,
                sc,
                e(),
                e(),
                e(torch.uint8, (3, h // 2)),
                e(torch.uint8, (128, 4)),
                ws.id,
                1e-6,
                0.0,
                0,
                False,
                "oneshot",
                False,
                "triton",
            ),
        ),
    ]
    for i, (op, args) in enumerate(cases):
        utils = None if i == 1 else ("test_schema", "test_faketensor")
        torch.library.opcheck(op, args, test_utils=utils) if utils else torch.library.opcheck(
            op, args
        )

    def layer(x, res, w):
        s = moefuse.allreduce(x, workspace=ws, impl="triton", algorithm="twoshot")
        ro, no = moefuse.allreduce_residual_rmsnorm(s, res, w, workspace=ws, impl="triton")
        return s, ro, no

    assert_compiles_to_eager_bits(layer, (x, res, w), layer(x, res, w))
    ws.close()
    return True


# ----------------------------------------------------------------------------- tests
def test_validation_and_contract():
    assert all(run_group(2, scenario_validation))


def test_workspace_lifecycle_and_votes():
    """As processes: the shared-memory transport between real address spaces."""
    assert all(run_group(2, scenario_lifecycle, ranks="processes"))


@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_bounded_wait_names_the_missing_rank(algo):
    spans = run_group(3, scenario_bounded_wait, algo)
    assert spans[-1] is None and None not in spans[:-1]
    assert_bounded_waits(spans, timeout_s=2.0)


def test_opcheck_and_torch_compile():
    """As processes: tracing (opcheck, torch.compile) keeps process-wide state (torch.fx's
    patcher), so ranks cannot trace at the same time as threads of one process."""
    assert all(run_group(2, scenario_opcheck_compile, ranks="processes"))


def scenario_compat(rank, world_size):
    """FlashInfer's pattern-based call writes the same bits as the per-pattern functions."""
    import moefuse
    from moefuse.compat._comm import AllReduceFusionPattern as Pat
    from moefuse.compat._comm import trtllm_allreduce_fusion
    from moefuse.quant.formats import scale_layout_shape

    m, h = 3, 64
    ws = moefuse.AllReduceWorkspace(None, 8, h, BF16, "cpu", timeout_s=60)
    partials, res, w = make_case(21, world_size, m, h, BF16)
    x = partials[rank]
    sc = torch.tensor([0.5])
    e = lambda dt=BF16, shape=(m, h): poison_(torch.empty(shape, dtype=dt))  # noqa: E731
    kw = dict(workspace=ws, impl="triton", weight_bias=1.0)
    common = (world_size, rank, m, h, ws, False, True, True)
    for use_oneshot in (None, True, False):
        algo = {None: "auto", True: "oneshot", False: "twoshot"}[use_oneshot]
        out = e()
        trtllm_allreduce_fusion(
            x, *common, Pat.kAllReduce, use_oneshot, allreduce_out=out, impl="triton"
        )
        assert_bitwise_equal(out, moefuse.allreduce(x, workspace=ws, impl="triton"), "pattern 0")
        ro, no = e(), e()
        trtllm_allreduce_fusion(
            x,
            *common,
            Pat.kARResidualRMSNorm,
            use_oneshot,
            residual_in=res,
            residual_out=ro,
            norm_out=no,
            rms_gamma=w,
            rms_eps=1e-6,
            weight_bias=1.0,
            impl="triton",
        )
        exp = moefuse.allreduce_residual_rmsnorm(x, res, w, algorithm=algo, **kw)
        assert_bitwise_equal(ro, exp[0], "pattern 1 residual_out")
        assert_bitwise_equal(no, exp[1], "pattern 1 norm_out")
        ro, no, q = e(), e(), e(torch.uint8).view(torch.float8_e4m3fn)
        trtllm_allreduce_fusion(
            x,
            *common,
            Pat.kARResidualRMSNormOutFP8Quant,
            use_oneshot,
            residual_in=res,
            residual_out=ro,
            norm_out=no,
            quant_out=q,
            rms_gamma=w,
            rms_eps=1e-6,
            scale_factor=0.5,
            weight_bias=1.0,
            impl="triton",
        )
        exp = moefuse.allreduce_residual_rmsnorm_out_fp8(x, res, w, sc, **kw)
        for a, b in zip((ro, no, q), exp):
            assert_bitwise_equal(
                a.view(torch.uint8) if a.dtype == q.dtype else a,
                b.view(torch.uint8) if b.dtype == q.dtype else b,
                "pattern 4",
            )
        for code, layout in ((0, "swizzled_128x4"), (2, "linear")):
            ro, pk = e(), e(torch.uint8, (m, h // 2))
            sf = e(torch.uint8, scale_layout_shape(m, h // 16, layout))
            trtllm_allreduce_fusion(
                x,
                *common,
                Pat.kARResidualRMSNormFP4Quant,
                use_oneshot,
                residual_in=res,
                residual_out=ro,
                quant_out=pk,
                scale_out=sf.view(-1),
                rms_gamma=w,
                rms_eps=1e-6,
                scale_factor=sc,
                layout_code=code,
                weight_bias=1.0,
                impl="triton",
            )
            exp = moefuse.allreduce_residual_rmsnorm_nvfp4(x, res, w, sc, layout=layout, **kw)
            for a, b in zip((ro, pk, sf), exp):
                assert_bitwise_equal(a, b, f"pattern 3 {layout}")
    # pattern 7 is moefuse.compat._moe_reduction's (tests/test_comm_moe_reduction.py): its MoE
    # arguments are required keywords
    with pytest.raises(ValueError, match="expanded_idx_to_permuted_idx"):
        trtllm_allreduce_fusion(
            x,
            *common,
            Pat.kMoEFinalizeARResidualRMSNorm,
            None,
            residual_in=res,
            residual_out=e(),
            rms_gamma=w,
        )
    ws.close()
    return True


def test_flashinfer_compat_patterns():
    assert all(run_group(2, scenario_compat))
