"""All-reduce fusions on 2 and 4 H200s (NCCL group, symmetric-memory peer buffers, no multicast):
full shapes x every pattern x one-shot / two-shot / torch.distributed, bitwise across algorithms,
ranks, PDL on/off and batch sizes; 1,000 CUDA-graph replays with fresh data (and -0.0) each time;
bounded waits when one process skips a call.

Run: ``python -m pytest -q tests/test_comm_gpu.py`` (each test spawns its own P processes; world
sizes beyond the GPU count are skipped; ``-k p2`` / ``-k p4`` / ``-k p8`` selects one).
"""

from __future__ import annotations

import time

import pytest
import torch

from comm_mp import assert_bounded_waits, run_group

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

WORLD_SIZES = [pytest.param(2, id="p2"), pytest.param(4, id="p4"), pytest.param(8, id="p8")]
TOKENS = (1, 5, 64, 128, 1000, 4096, 16384)
WIDTHS = (2880, 4096, 7168, 8192)
DTYPES = (torch.bfloat16, torch.float16)
ALGOS = ("oneshot", "twoshot", "torch")
QUANT_WIDTHS = (4096,)  # (7168 and friends share the epilogue code tested by pattern 1)
QUANT_TOKENS = (1, 128, 1000)
SMALL = (64, 4096)  # (M, H) of the graph-replay and bounded-wait scenarios
FP8_SCALE = 0.0125
NVFP4_GS = 448.0 * 6 / 5.0


def _dev(rank) -> torch.device:
    return torch.device("cuda", rank)


def _need(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")


# ----------------------------------------------------------------------------- helpers
def make_case(seed, world_size, m, h, dtype, device):
    """All ranks' partials, the replicated residual and weight, identical on every rank; every
    partial has -0.0 in column 0 (the sum there must be +0.0) and in a few single entries."""
    g = torch.Generator(device=device).manual_seed(seed)
    parts = []
    for r in range(world_size):
        p = (torch.randn(m, h, generator=g, device=device) * (0.5 + r)).to(dtype)
        if m:
            p[:, 0] = -0.0
            p[0, 1:4] = -0.0
        parts.append(p)
    res = torch.randn(m, h, generator=g, device=device).to(dtype)
    w = (torch.rand(h, generator=g, device=device) + 0.5).to(dtype)
    return parts, res, w


def checksum(*tensors) -> torch.Tensor:
    """Position-weighted integer checksum of the bits (compared across ranks)."""
    out = []
    for t in tensors:
        b = t.detach().contiguous().view(-1)
        b = b.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[b.element_size()]).long()
        pos = torch.arange(b.numel(), device=b.device) % 1000003 + 1
        out.append((b * pos).sum())
    return torch.stack(out) if out else torch.zeros(0)


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bitwise equality checked on the device (large outputs are not copied to the host unless
    they differ, then ``assert_bitwise_equal`` reports where)."""
    from moefuse.testing import assert_bitwise_equal

    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    if (
        a.shape != b.shape
        or a.dtype != b.dtype
        or not torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    ):
        assert_bitwise_equal(a, b, what)


def within_one_ulp(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """BF16/FP16 ``a`` within 1 ulp of ``b`` (the ``rsqrt_half`` row of moefuse.testing), on the
    device; NaN never passes."""
    from moefuse.testing import assert_close

    def ordered(t):
        i = t.contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i & 0x7FFF)

    ok = bool(torch.isfinite(a).all()) and int((ordered(a) - ordered(b)).abs().max()) <= 1
    if not ok:
        assert_close(a, b, "rsqrt_half", what)


def assert_ranks_agree(values: torch.Tensor, what: str) -> None:
    import torch.distributed as dist

    gathered = [torch.empty_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, values)
    for r, g in enumerate(gathered):
        assert torch.equal(g, gathered[0]), f"{what}: rank {r} differs bitwise from rank 0"


def call(moefuse, pattern, ws, x, res, w, algo, *, pdl=None, layout="swizzled_128x4", wb=0.0):
    kw = dict(workspace=ws, algorithm=algo, impl="triton", enable_pdl=pdl, weight_bias=wb)
    dev = x.device
    if pattern == "ar":
        kw.pop("weight_bias")
        return (moefuse.allreduce(x, **kw),)
    if pattern == "norm":
        return moefuse.allreduce_residual_rmsnorm(x, res, w, **kw)
    if pattern == "fp8":
        return moefuse.allreduce_residual_rmsnorm_fp8(
            x, res, w, torch.tensor([FP8_SCALE], device=dev), **kw
        )
    if pattern == "fp8_out":
        return moefuse.allreduce_residual_rmsnorm_out_fp8(
            x, res, w, torch.tensor([FP8_SCALE], device=dev), **kw
        )
    gs = torch.tensor([NVFP4_GS], device=dev)
    if pattern == "nvfp4":
        return moefuse.allreduce_residual_rmsnorm_nvfp4(x, res, w, gs, layout=layout, **kw)
    return moefuse.allreduce_residual_rmsnorm_out_nvfp4(x, res, w, gs, layout=layout, **kw)


# ----------------------------------------------------------------------------- scenarios
def scenario_full_shapes(rank, world_size):
    """Pattern 1 at every (dtype, H, M): oracle, bitwise across algorithms / ranks / PDL off /
    the row alone; allreduce-only at a few shapes."""
    import moefuse
    from moefuse.comm.all_reduce import reference as ref

    dev = _dev(rank)
    for dtype in DTYPES:
        for h in WIDTHS:
            ws = moefuse.AllReduceWorkspace(
                None, max(TOKENS), h, dtype, dev, oneshot_max_tokens=max(TOKENS)
            )
            for m in TOKENS:
                parts, res, w = make_case(m * 7 + h, world_size, m, h, dtype, dev)
                x = parts[rank]
                wb = float(m % 2)
                h_ref, n_ref = ref.allreduce_residual_rmsnorm_from_partials(parts, res, w, 1e-6, wb)
                first = None
                for algo in ALGOS:
                    what = f"{dtype} H={h} M={m} {algo}"
                    outs = call(moefuse, "norm", ws, x, res, w, algo, wb=wb)
                    same_bits(outs[0], h_ref, f"{what} residual_out")
                    if first is None:
                        within_one_ulp(outs[1], n_ref, f"{what} norm_out")
                    first = first or outs
                    for a, b in zip(outs, first):
                        same_bits(a, b, f"{what} vs {ALGOS[0]}")
                    if m in (5, 1000):
                        if dtype == torch.bfloat16:  # (each PDL-off variant is a compilation)
                            off = call(moefuse, "norm", ws, x, res, w, algo, pdl=False, wb=wb)
                            for a, b in zip(off, outs):
                                same_bits(a, b, f"{what} PDL off")
                        i = m // 2
                        alone = call(
                            moefuse, "norm", ws, x[i : i + 1], res[i : i + 1], w, algo, wb=wb
                        )
                        for a, b in zip(alone, outs):
                            same_bits(a, b[i : i + 1], f"{what} row alone")
                assert_ranks_agree(checksum(*first), f"{dtype} H={h} M={m}")
                if h == 4096 and m in (1, 128, 16384):
                    s_ref = ref.allreduce_from_partials(parts)
                    for algo in ALGOS:
                        s = call(moefuse, "ar", ws, x, res, w, algo)[0]
                        same_bits(s, s_ref, f"allreduce {dtype} M={m} {algo}")
            ws.check()
            ws.close()
    return True


def scenario_quant(rank, world_size):
    """FP8 / NVFP4 patterns: quantized outputs bitwise equal to the reference quantizer applied to
    the kernel's own norm output; bitwise across algorithms and ranks."""
    import moefuse
    from moefuse.quant import reference as quant_ref

    dev = _dev(rank)
    cases = [
        ("fp8", "swizzled_128x4"),
        ("fp8_out", "swizzled_128x4"),
        ("nvfp4", "swizzled_128x4"),
        ("nvfp4_out", "swizzled_8x4"),
        ("nvfp4_out", "linear"),
    ]
    for h in QUANT_WIDTHS:
        ws = moefuse.AllReduceWorkspace(
            None, max(QUANT_TOKENS), h, torch.bfloat16, dev, oneshot_max_tokens=max(QUANT_TOKENS)
        )
        for m in QUANT_TOKENS:
            parts, res, w = make_case(m + h, world_size, m, h, torch.bfloat16, dev)
            x = parts[rank]
            n_kernel = call(moefuse, "norm", ws, x, res, w, "oneshot")[1]
            for pattern, layout in cases:
                first = None
                for algo in ALGOS:
                    what = f"H={h} M={m} {pattern} {layout} {algo}"
                    outs = call(moefuse, pattern, ws, x, res, w, algo, layout=layout)
                    if pattern.endswith("_out"):
                        same_bits(outs[1], n_kernel, f"{what} norm_out")
                    if pattern.startswith("fp8"):
                        q = quant_ref.fp8_quantize_reference(
                            n_kernel, torch.tensor([FP8_SCALE], device=dev)
                        )
                        same_bits(outs[-1].view(torch.uint8), q.view(torch.uint8), what)
                    else:
                        pk, sf = quant_ref.fp4_quantize_reference(
                            n_kernel, torch.tensor([NVFP4_GS], device=dev), layout, recipe="ieee"
                        )
                        same_bits(outs[-2], pk, f"{what} codes")
                        same_bits(outs[-1], sf, f"{what} scales")
                    first = first or outs
                    for a, b in zip(outs, first):
                        same_bits(a, b, f"{what} vs {ALGOS[0]}")
                assert_ranks_agree(checksum(*first), f"H={h} M={m} {pattern}")
        ws.close()
    return True


def scenario_graph_replays(rank, world_size, replays):
    """One call captured in a CUDA graph per algorithm (PDL on), replayed ``replays`` times with
    fresh inputs (with -0.0) copied in before each replay: every replay bitwise against the oracle
    on residual_out and equal to an eager PDL-off call on norm_out."""
    import moefuse
    from moefuse.comm.all_reduce import reference as ref
    from moefuse.testing import assert_bitwise_equal, capture_graph

    dev = _dev(rank)
    m, h = SMALL
    ws = moefuse.AllReduceWorkspace(None, m, h, torch.bfloat16, dev, oneshot_max_tokens=m)
    _, _, w = make_case(0, world_size, m, h, torch.bfloat16, dev)
    x = torch.zeros(m, h, dtype=torch.bfloat16, device=dev)
    res = torch.zeros_like(x)
    for algo in ALGOS:
        ro, no = torch.empty_like(x), torch.empty_like(x)
        run = lambda: moefuse.allreduce_residual_rmsnorm(  # noqa: E731
            x, res, w, workspace=ws, algorithm=algo, impl="triton", residual_out=ro, norm_out=no
        )
        graph = capture_graph(run, ws)
        for i in range(replays):
            parts, r_i, _ = make_case(1000 + i, world_size, m, h, torch.bfloat16, dev)
            x.copy_(parts[rank])
            res.copy_(r_i)
            ro.fill_(float("nan"))
            graph.replay()
            h_ref = ref.allreduce_residual_rmsnorm_from_partials(parts, r_i, w)[0]
            assert_bitwise_equal(ro, h_ref, f"{algo} replay {i} residual_out")
            if i % 100 == 0:
                eager = moefuse.allreduce_residual_rmsnorm(
                    x, res, w, workspace=ws, algorithm=algo, impl="triton", enable_pdl=False
                )
                assert_bitwise_equal(no, eager[1], f"{algo} replay {i} norm_out vs eager")
        del graph
    ws.check()
    ws.close()
    return True


def scenario_bounded_wait(rank, world_size, algo):
    import torch.distributed as dist

    import moefuse

    dev = _dev(rank)
    (m, h), timeout = SMALL, 2.0
    skipper = world_size - 1
    parts, res, w = make_case(3, world_size, m, h, torch.bfloat16, dev)
    run = lambda ws: moefuse.allreduce_residual_rmsnorm(  # noqa: E731
        parts[rank], res, w, workspace=ws, algorithm=algo, impl="triton"
    )
    # compile with a generous timeout first: ranks finish JIT compilation at different times
    ws = moefuse.AllReduceWorkspace(None, m, h, torch.bfloat16, dev)
    run(ws)
    ws.check()
    ws.close()
    ws = moefuse.AllReduceWorkspace(None, m, h, torch.bfloat16, dev, timeout_s=timeout)
    run(ws)
    ws.check()
    span = None
    if rank != skipper:
        t0 = time.monotonic()
        run(ws)
        with pytest.raises(RuntimeError, match=rf"rank\(s\) {skipper} \("):
            ws.check()
        span = (t0, time.monotonic())
        with pytest.raises(RuntimeError, match="never arrived"):
            run(ws)
    dist.barrier()
    ws.close()
    ws = moefuse.AllReduceWorkspace(None, m, h, torch.bfloat16, dev, timeout_s=timeout)
    run(ws)
    ws.check()
    ws.close()
    return span


def scenario_transports(rank, world_size):
    """The CUDA IPC transport against symmetric memory: same bits for every algorithm and a few
    patterns; several calls in a row (Lamport generations cycle, two-shot epochs advance) and
    one CUDA graph replayed; both workspaces closed and a third created afterwards."""
    import moefuse

    dev = _dev(rank)
    h, cap = 4096, 1000
    spaces = {
        kind: moefuse.AllReduceWorkspace(
            None, cap, h, torch.bfloat16, dev, transport=kind, oneshot_max_tokens=cap
        )
        for kind in ("symm_mem", "cuda_ipc")
    }
    for kind, ws in spaces.items():
        assert ws.transport is not None and ws.transport.kind == kind, repr(ws)
    for m in (1, 64, 1000):
        parts, res, w = make_case(m * 13 + 1, world_size, m, h, torch.bfloat16, dev)
        x = parts[rank]
        for pattern in ("ar", "norm", "nvfp4"):
            for algo in ("oneshot", "twoshot"):
                want = call(moefuse, pattern, spaces["symm_mem"], x, res, w, algo)
                for rep in range(3):
                    got = call(moefuse, pattern, spaces["cuda_ipc"], x, res, w, algo)
                    for a, b in zip(got, want):
                        same_bits(a, b, f"cuda_ipc M={m} {pattern} {algo} call {rep}")
    ws = spaces["cuda_ipc"]
    parts, res, w = make_case(5, world_size, 64, h, torch.bfloat16, dev)
    x, res_out, norm_out = parts[rank], torch.empty_like(res), torch.empty_like(res)
    want = call(moefuse, "norm", spaces["symm_mem"], x, res, w, "auto")
    moefuse.allreduce_residual_rmsnorm(
        x, res, w, workspace=ws, residual_out=res_out, norm_out=norm_out, impl="triton"
    )  # warm-up (compiles)
    with ws.capture():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moefuse.allreduce_residual_rmsnorm(
                x, res, w, workspace=ws, residual_out=res_out, norm_out=norm_out, impl="triton"
            )
    for rep in range(5):
        res_out.fill_(float("nan"))
        graph.replay()
        same_bits(res_out, want[0], f"cuda_ipc graph replay {rep}")
    for ws in spaces.values():
        ws.check()
        ws.close()
    again = moefuse.AllReduceWorkspace(None, 8, h, torch.bfloat16, dev, transport="cuda_ipc")
    out = call(moefuse, "norm", again, x[:8], res[:8], w, "oneshot")
    same_bits(out[0], want[0][:8], "cuda_ipc after re-creation")
    again.close()
    return True


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_full_shapes_every_algorithm(world_size):
    _need(world_size)
    assert all(run_group(world_size, scenario_full_shapes, backend="nccl", timeout_s=600))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_quant_patterns(world_size):
    _need(world_size)
    assert all(run_group(world_size, scenario_quant, backend="nccl", timeout_s=600))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_graph_replays_fresh_data(world_size):
    _need(world_size)
    assert all(run_group(world_size, scenario_graph_replays, 1000, backend="nccl", timeout_s=600))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("algo", ["oneshot", "twoshot"])
def test_bounded_wait(world_size, algo):
    _need(world_size)
    spans = run_group(world_size, scenario_bounded_wait, algo, backend="nccl", timeout_s=300)
    assert spans[-1] is None and None not in spans[:-1]
    assert_bounded_waits(spans, timeout_s=2.0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_cuda_ipc_transport_matches_symmetric_memory(world_size):
    _need(world_size)
    assert all(run_group(world_size, scenario_transports, backend="nccl", timeout_s=300))
