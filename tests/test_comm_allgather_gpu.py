"""All-gather + norm fusions on 2 H200s (NCCL group, symmetric-memory peer buffers, no multicast;
spec): every op at H in {4096, 7168, 8192} x M in {1, 7, 64, 1000, 4096}, bitwise
equal to "the full rows, then the single-GPU op" for the one-shot and torch algorithms, with PDL
off, and for a token alone vs in a batch; identical on both ranks; within the single-GPU
tolerances of the references; CUDA-graph replays with fresh data each replay; a bounded wait
when one process skips a call.

Run (2 GPUs): ``python -m pytest -q tests/test_comm_allgather_gpu.py``.
"""

from __future__ import annotations

import time

import pytest
import torch

from comm_mp import run_group

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

P = 2
WIDTHS = (4096, 7168, 8192)
TOKENS = (1, 7, 64, 1000, 4096)
BF16 = torch.bfloat16
FP8_SCALE = 0.0125
NVFP4_GS = 448.0 * 6 / 5.0


def _need():
    if torch.cuda.device_count() < P:
        pytest.skip(f"needs {P} GPUs, found {torch.cuda.device_count()}")


def make_case(seed, m, h, dev, dtype=BF16):
    """The full rows and replicated tensors, identical on every rank (same seed, same device
    type); -0.0 in a few entries of row 0."""
    g = torch.Generator(device=dev).manual_seed(seed)
    full = torch.randn(m, h, generator=g, device=dev).to(dtype)
    if m:
        full[0, :3] = -0.0
    return dict(
        full=full,
        weight=(torch.rand(h, generator=g, device=dev) + 0.5).to(dtype),
        residual=torch.randn(m, h, generator=g, device=dev),
        alpha=torch.rand(h, generator=g, device=dev) + 0.5,
        beta=torch.randn(h, generator=g, device=dev),
        post_weight=(torch.rand(h, generator=g, device=dev) + 0.5).to(dtype),
        scale=torch.tensor([FP8_SCALE], device=dev),
        gs=torch.tensor([NVFP4_GS], device=dev),
    )


def shard_of(full, rank):
    s = full.shape[1] // P
    return full[:, rank * s : (rank + 1) * s].contiguous()


def same_bits(a, b, what):
    from moefuse.testing import assert_bitwise_equal

    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    if a.shape != b.shape or not torch.equal(a.contiguous().view(view), b.contiguous().view(view)):
        assert_bitwise_equal(a, b, what)


def checksum(*tensors):
    out = []
    for t in tensors:
        b = t.contiguous().view(-1)
        b = b.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[b.element_size()]).long()
        out.append((b * (torch.arange(b.numel(), device=b.device) % 1000003 + 1)).sum())
    return torch.stack(out)


def fused(moefuse, ws, c, rank, algo, *, pdl=None, variant=0):
    """Every op on this rank's shard. ``variant`` 0: linear NVFP4, tensor alpha, post weight,
    router output; 1: swizzled NVFP4, scalar alpha, no post weight, Gemma gain."""
    x = shard_of(c["full"], rank)
    kw = dict(workspace=ws, algorithm=algo, impl="triton", enable_pdl=pdl)
    m, h = c["full"].shape
    gc = float(variant)
    out = [
        moefuse.all_gather_rmsnorm(x, c["weight"], gain_center=gc, **kw),
        moefuse.all_gather_rmsnorm_fp8(x, c["weight"], c["scale"], **kw).view(torch.uint8),
    ]
    out += moefuse.all_gather_rmsnorm_fp4_quantize(
        x, c["weight"], c["gs"], layout=("linear", "swizzled_128x4")[variant], **kw
    )
    router = torch.full((m, h), float("nan"), device=x.device) if variant == 0 else None
    out += moefuse.all_gather_gated_residual_next_rmsnorm(
        x,
        c["residual"],
        c["alpha"] if variant == 0 else 0.75,
        c["beta"],
        c["weight"],
        post_eps=1e-5,
        next_eps=1e-6,
        post_weight=c["post_weight"] if variant == 0 else None,
        router_input=router,
        **kw,
    )
    if router is not None:
        out.append(router)
    return out


def single(moefuse, c, *, variant=0):
    """The same outputs from the full rows with the single-GPU ops (the definition)."""
    full = c["full"]
    m, h = full.shape
    out = [
        moefuse.rmsnorm(full, c["weight"], 1e-6)
        if variant == 0
        else moefuse.gemma_rmsnorm(full, c["weight"], 1e-6),
        moefuse.rmsnorm_quant(full, c["weight"], c["scale"]).view(torch.uint8),
    ]
    out += moefuse.rmsnorm_fp4_quantize(
        full, c["weight"], c["gs"], gain_center=0.0, layout=("linear", "swizzled_128x4")[variant]
    )
    router = torch.empty(m, h, device=full.device) if variant == 0 else None
    out += moefuse.gated_residual_next_rmsnorm(
        full,
        c["residual"],
        c["weight"],
        c["alpha"] if variant == 0 else 0.75,
        c["beta"],
        1e-5,
        1e-6,
        post_weight=c["post_weight"] if variant == 0 else None,
        router_input=router,
    )
    if router is not None:
        out.append(router)
    return out


def make_ws(moefuse, max_tokens, h, dev, **kw):
    return moefuse.AllReduceWorkspace(
        None,
        max_tokens,
        h,
        BF16,
        dev,
        oneshot_max_tokens=1,
        extra_regions=moefuse.allgather_regions(max_tokens, h),
        **kw,
    )


# ----------------------------------------------------------------------------- scenarios
def scenario_shapes(rank, _):
    import torch.distributed as dist

    import moefuse
    from moefuse.testing import assert_close

    dev = torch.device("cuda", rank)
    for h in WIDTHS:
        ws = make_ws(moefuse, max(TOKENS), h, dev)
        assert moefuse.supports_all_gather_rmsnorm(
            shard_of(torch.zeros(1, h, device=dev, dtype=BF16), rank),
            torch.ones(h, device=dev, dtype=BF16),
            workspace=ws,
        )
        for m in TOKENS:
            for variant in (0, 1):
                c = make_case(m * 31 + h + variant, m, h, dev)
                want = single(moefuse, c, variant=variant)
                what = f"H={h} M={m} variant={variant}"
                for algo in ("torch", "oneshot"):
                    got = fused(moefuse, ws, c, rank, algo, variant=variant)
                    for i, (a, b) in enumerate(zip(got, want)):
                        same_bits(a, b, f"{what} {algo} output {i}")
                sums = checksum(*got)  # the one-shot outputs
                if m in (7, 1000):
                    off = fused(moefuse, ws, c, rank, "oneshot", pdl=False, variant=variant)
                    for i, (a, b) in enumerate(zip(off, want)):
                        same_bits(a, b, f"{what} PDL off output {i}")
                    t = m // 2
                    one = dict(
                        c,
                        full=c["full"][t : t + 1].contiguous(),
                        residual=c["residual"][t : t + 1].contiguous(),
                    )
                    alone = fused(moefuse, ws, one, rank, "oneshot", variant=variant)
                    for i in (0, 1, 4, 5):  # row-wise outputs (scale layouts pad rows)
                        same_bits(alone[i], want[i][t : t + 1], f"{what} row alone output {i}")
                other = [torch.empty_like(sums) for _ in range(P)]
                dist.all_gather(other, sums)
                assert all(torch.equal(o, other[0]) for o in other), f"{what}: ranks differ"
                if m == 7 and variant == 0:  # the references: FP64 statistics, exact rsqrt
                    x = shard_of(c["full"], rank)
                    r = moefuse.all_gather_rmsnorm(x, c["weight"], workspace=ws, impl="reference")
                    assert_close(want[0], r, "rsqrt_half", f"{what} rmsnorm vs reference")
                    ro, ffn = moefuse.all_gather_gated_residual_next_rmsnorm(
                        x,
                        c["residual"],
                        c["alpha"],
                        c["beta"],
                        c["weight"],
                        post_eps=1e-5,
                        post_weight=c["post_weight"],
                        workspace=ws,
                        impl="reference",
                    )
                    assert_close(want[4], ro, "fp32_stream", f"{what} residual_out vs reference")
        ws.check()
        ws.close()
    return True


def scenario_graph_replays(rank, _, replays):
    """Each op captured once (one-shot, PDL on) and replayed with fresh shards each time (the
    generation wraps many times): every replay bitwise equal to the single-GPU ops on the new
    full rows."""
    import moefuse
    from moefuse.testing import capture_graph

    dev = torch.device("cuda", rank)
    h = 4096
    for m in (1, 64):
        ws = make_ws(moefuse, m, h, dev)
        c = make_case(0, m, h, dev)
        x = shard_of(c["full"], rank)
        res = c["residual"].clone()
        outs = [
            torch.empty(m, h, dtype=BF16, device=dev),
            torch.empty(m, h, dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(m, h // 2, dtype=torch.uint8, device=dev),
            torch.empty(128, h // 16, dtype=torch.uint8, device=dev),
            torch.empty(m, h, device=dev),
            torch.empty(m, h, dtype=BF16, device=dev),
        ]

        def run():
            kw = dict(workspace=ws, algorithm="oneshot", impl="triton", enable_pdl=True)
            moefuse.all_gather_rmsnorm(x, c["weight"], out=outs[0], **kw)
            moefuse.all_gather_rmsnorm_fp8(x, c["weight"], c["scale"], out=outs[1], **kw)
            moefuse.all_gather_rmsnorm_fp4_quantize(
                x,
                c["weight"],
                c["gs"],
                out=outs[2],
                scale_out=outs[3],
                layout="swizzled_128x4",
                **kw,
            )
            moefuse.all_gather_gated_residual_next_rmsnorm(
                x,
                res,
                c["alpha"],
                c["beta"],
                c["weight"],
                residual_out=outs[4],
                ffn_input=outs[5],
                **kw,
            )

        graph = capture_graph(run, ws)  # (the warm-up also allocates the gathered buffer)
        for i in range(replays):
            c_i = make_case(1000 + i, m, h, dev)
            x.copy_(shard_of(c_i["full"], rank))
            res.copy_(c_i["residual"])
            for o in outs:
                o.view(torch.uint8).fill_(0xFF)
            graph.replay()
            c_i.update(
                weight=c["weight"], alpha=c["alpha"], beta=c["beta"], scale=c["scale"], gs=c["gs"]
            )
            full = c_i["full"]
            want = [
                moefuse.rmsnorm(full, c["weight"]),
                moefuse.rmsnorm_quant(full, c["weight"], c["scale"]),
            ]
            want += moefuse.rmsnorm_fp4_quantize(
                full, c["weight"], c["gs"], layout="swizzled_128x4"
            )
            want += moefuse.gated_residual_next_rmsnorm(
                full, c_i["residual"], c["weight"], c["alpha"], c["beta"]
            )
            for j, (a, b) in enumerate(zip(outs, want)):
                same_bits(
                    a.view(torch.uint8) if j == 1 else a,
                    b.view(torch.uint8) if j == 1 else b,
                    f"M={m} replay {i} output {j}",
                )
        del graph
        ws.check()
        ws.close()
    return True


def scenario_bounded_wait(rank, _, m=4):
    """Rank 1 skips a call: rank 0's waits give up after the timeout and name rank 1; a new
    workspace works. ``m`` = 4: the decode kernel; 300: the persistent kernel."""
    import torch.distributed as dist

    import moefuse

    dev = torch.device("cuda", rank)
    h, timeout = 4096, 3.0
    c = make_case(5, m, h, dev)
    x = shard_of(c["full"], rank)
    ws = make_ws(moefuse, m, h, dev, timeout_s=timeout)
    call = lambda: moefuse.all_gather_rmsnorm(
        x,
        c["weight"],
        workspace=ws,  # noqa: E731
        algorithm="oneshot",
        impl="triton",
    )
    call()
    ws.check()
    elapsed = None
    if rank == 0:  # rank 1 skips this call
        t0 = time.monotonic()
        call()
        with pytest.raises(RuntimeError, match=r"rank\(s\) 1"):
            ws.check()
        elapsed = time.monotonic() - t0
    dist.barrier()
    ws.close()
    ws = make_ws(moefuse, m, h, dev, timeout_s=timeout)
    same_bits(call(), moefuse.rmsnorm(c["full"], c["weight"]), "after re-creation")
    ws.check()
    ws.close()
    return elapsed


def scenario_one_launch(rank, _):
    """EXPERIMENTAL one-launch decode all_gather_rmsnorm (MOEFUSE_ALLGATHER_ONE_LAUNCH=1):
    bitwise equal to moefuse.rmsnorm on the full rows, eager (PDL on / off) and in a replayed
    CUDA graph. Separate from the default path's tests: a failure here only says the variant
    must stay off."""
    return one_kernel_checks(rank, {"MOEFUSE_ALLGATHER_ONE_LAUNCH": "1"}, (1, 7, 64), "one launch")


def scenario_persistent(rank, _, env):
    """The persistent gather + rmsnorm kernel (comm/all_gather/persistent.py, the default above
    M = 64) under the knobs ``env``: bitwise equal to moefuse.rmsnorm eager (PDL on / off) and
    in replayed CUDA graphs, at token counts that are not multiples of anything."""
    return one_kernel_checks(
        rank, {"MOEFUSE_ALLGATHER_LARGE": "fused", **env}, (65, 1000, 4097), f"persistent {env}"
    )


def op_outputs(moefuse, op, x, c, ws, *, pdl=None, outs=None):
    """``op`` ("rmsnorm", "fp8", "fp4", "fp4_swz", "gated") on shard ``x`` (into ``outs`` when
    given): its outputs as a tuple (FP8 as bytes; gated: residual_out, ffn_input, router)."""
    kw = dict(workspace=ws, impl="triton", algorithm="oneshot", enable_pdl=pdl)
    if op == "gated":  # tensor alpha, post weight, FP32 router output
        m, h = c["residual"].shape
        outs = outs or (None, None, torch.empty(m, h, device=x.device))
        ro, ffn = moefuse.all_gather_gated_residual_next_rmsnorm(
            x,
            c["residual"],
            c["alpha"],
            c["beta"],
            c["weight"],
            post_weight=c["post_weight"],
            residual_out=outs[0],
            ffn_input=outs[1],
            router_input=outs[2],
            **kw,
        )
        return ro, ffn, outs[2]
    outs = outs or (None, None)
    if op == "rmsnorm":
        return (moefuse.all_gather_rmsnorm(x, c["weight"], out=outs[0], **kw),)
    if op == "fp8":
        out = outs[0].view(torch.float8_e4m3fn) if outs[0] is not None else None
        return (
            moefuse.all_gather_rmsnorm_fp8(x, c["weight"], c["scale"], out=out, **kw).view(
                torch.uint8
            ),
        )
    layout = "swizzled_128x4" if op == "fp4_swz" else "linear"
    return tuple(
        moefuse.all_gather_rmsnorm_fp4_quantize(
            x, c["weight"], c["gs"], layout=layout, out=outs[0], scale_out=outs[1], **kw
        )
    )


def op_reference(moefuse, op, full, c):
    """The single-GPU op of ``op`` on the full rows (the definition)."""
    if op == "gated":
        router = torch.empty(full.shape, device=full.device)
        ro, ffn = moefuse.gated_residual_next_rmsnorm(
            full,
            c["residual"],
            c["weight"],
            c["alpha"],
            c["beta"],
            post_weight=c["post_weight"],
            router_input=router,
        )
        return ro, ffn, router
    if op == "rmsnorm":
        return (moefuse.rmsnorm(full, c["weight"]),)
    if op == "fp8":
        return (moefuse.rmsnorm_quant(full, c["weight"], c["scale"]).view(torch.uint8),)
    layout = "swizzled_128x4" if op == "fp4_swz" else "linear"
    return tuple(moefuse.rmsnorm_fp4_quantize(full, c["weight"], c["gs"], layout=layout))


def one_kernel_checks(rank, env, tokens, label, op="rmsnorm"):
    """The all-gather op ``op`` (see :func:`op_outputs`) with the knobs ``env`` at every width
    and M in ``tokens`` against the single-GPU op on the full rows: eager with PDL on and off,
    then 5 replays of a captured call with fresh shards (outputs poisoned before each)."""
    import os

    import moefuse
    from moefuse import _fastpath

    dev = torch.device("cuda", rank)
    os.environ.update(env)
    _fastpath.clear()
    for h in WIDTHS:
        ws = make_ws(moefuse, max(tokens), h, dev)
        for m in tokens:
            c = make_case(m + h, m, h, dev)
            x = shard_of(c["full"], rank)
            want = op_reference(moefuse, op, c["full"], c)
            for pdl in (True, False):
                got = op_outputs(moefuse, op, x, c, ws, pdl=pdl)
                for j, (a, b) in enumerate(zip(got, want)):
                    same_bits(a, b, f"{label} {op} H={h} M={m} pdl={pdl} output {j}")
            outs = tuple(torch.empty_like(t) for t in want)
            run = lambda: op_outputs(moefuse, op, x, c, ws, outs=outs)  # noqa: E731
            run()
            with ws.capture():
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    run()
            for i in range(5):
                c_i = make_case(7000 + i, m, h, dev)
                x.copy_(shard_of(c_i["full"], rank))
                for t in outs:
                    t.view(torch.uint8).fill_(0xFF)  # (NaN patterns in every dtype)
                graph.replay()
                want_i = op_reference(moefuse, op, c_i["full"], c)
                for j, (a, b) in enumerate(zip(outs, want_i)):
                    same_bits(a, b, f"{label} {op} H={h} M={m} replay {i} output {j}")
            del graph
        ws.check()
        ws.close()
    return True


def scenario_quant_one_launch(rank, _, op):
    """all_gather_rmsnorm_fp8 / _fp4_quantize / gated_residual_next_rmsnorm on their one-launch
    kernels: the decode kernel at M in {1, 7, 64}, the persistent kernel at M in
    {300, 1000, 4096} (defaults: the gated op at 300 only) and at 65 / 4097 with many tiles per
    CTA; the launchers are counted
    (no two-launch fallback)."""
    from moefuse.comm.all_gather import decode as allgather_decode
    from moefuse.comm.all_gather import persistent as allgather_fused

    counts = {"decode": 0, "persistent": 0}
    for module, name, key in (
        (allgather_decode, "launch_ag_rmsnorm", "decode"),
        (allgather_fused, "launch_ag_rmsnorm_persistent", "persistent"),
    ):
        real = getattr(module, name)

        def counted(*args, _real=real, _key=key, **kwargs):
            counts[_key] += 1
            return _real(*args, **kwargs)

        setattr(module, name, counted)
    # (M = 300: the gated op's persistent range by default ends at 512 tokens)
    one_kernel_checks(rank, {}, (1, 7, 64, 300, 1000, 4096), "defaults", op)
    assert counts["decode"] > 0 and counts["persistent"] > 0, counts
    n = dict(counts)
    one_kernel_checks(
        rank,
        {
            "MOEFUSE_ALLGATHER_LARGE": "fused",
            "MOEFUSE_ALLGATHER_FUSED_GRID": "7",
            "MOEFUSE_ALLGATHER_ONE_LAUNCH": "0",
        },
        (65, 4097),
        "persistent grid 7",
        op,
    )
    assert counts["decode"] == n["decode"] and counts["persistent"] > n["persistent"], counts
    return True


# ----------------------------------------------------------------------------- tests
def test_every_op_every_shape_bitwise():
    _need()
    assert all(run_group(P, scenario_shapes, backend="nccl", timeout_s=540))


def test_graph_replays_fresh_data():
    _need()
    assert all(run_group(P, scenario_graph_replays, 50, backend="nccl", timeout_s=600))


@pytest.mark.parametrize("m", [4, 300])
def test_bounded_wait(m):
    _need()
    elapsed = run_group(P, scenario_bounded_wait, m, backend="nccl", timeout_s=300)
    assert elapsed[0] is not None and elapsed[0] >= 3.0


def test_one_launch_decode_variant_bitwise():
    _need()
    assert all(run_group(P, scenario_one_launch, backend="nccl", timeout_s=300))


@pytest.mark.parametrize("env", [
    {},  # the defaults
    {"MOEFUSE_ALLGATHER_LOOKAHEAD": "1", "MOEFUSE_ALLGATHER_FUSED_GRID": "7"},  # many tiles/CTA
    {"MOEFUSE_ALLGATHER_LOOKAHEAD": "4", "MOEFUSE_ALLGATHER_FUSED_CTAS_PER_SM": "8"},  # capped
])  # fmt: skip
def test_persistent_kernel_bitwise(env):
    _need()
    assert all(run_group(P, scenario_persistent, env, backend="nccl", timeout_s=400))


@pytest.mark.parametrize("op", ["fp8", "fp4", "fp4_swz", "gated"])
def test_quant_one_launch_kernels_bitwise(op):
    _need()
    assert all(run_group(P, scenario_quant_one_launch, op, backend="nccl", timeout_s=500))
