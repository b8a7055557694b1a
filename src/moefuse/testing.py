"""Tolerance table and comparison helpers shared by tests, the demo and the benchmarks (and the
random MoE-fusion inputs the GPU tests and moefuse.tools.loopback_gpu_check share).

Every comparison names a row of :data:`TOLERANCES`; each row says why it is what it is
(docs/spec.md, "Tests"). Comparisons are bitwise wherever the math is exact.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    kind: str  # "bitwise" | "ulp" | "close"
    max_ulp: int = 0
    rtol: float = 0.0
    atol: float = 0.0
    reason: str = ""


TOLERANCES: dict[str, Tolerance] = {
    "exact": Tolerance(
        "bitwise",
        reason="no approximate intrinsic on the path (residual copies, finalize with emulated "
        "fma.rn.ftz, scale layouts, packing): the kernel must reproduce the reference bits",
    ),
    "rsqrt_half": Tolerance(
        "ulp",
        max_ulp=1,
        reason="BF16/FP16 output after rsqrt.approx (<= 2 FP32 ulp) and an FP32 row sum in another "
        "order than the FP64 oracle: the FP32 value moves by ~1e-6 relative, which can cross one "
        "rounding boundary of the 8/11-bit output",
    ),
    "fp32_stream": Tolerance(
        "close",
        rtol=1e-5,
        atol=1e-5,
        reason="FP32 gated residual stream: rsqrt.approx (<= 2 ulp) and FMA contraction move the "
        "FP32 result by a few ulp (spec: Tests)",
    ),
    "fp8_code": Tolerance(
        "ulp",
        max_ulp=1,
        reason="FP8 codes of a normalized value: rsqrt.approx moves the FP32 value by ~1e-6 "
        "relative, which can cross one rounding boundary of the 3-bit (E4M3) mantissa",
    ),
    "sigmoid_fast": Tolerance(
        "ulp",
        max_ulp=1,
        reason="sigmoid through exp2.approx and rcp.approx adds ~2 FP32 ulp before the single BF16/"
        "FP16 rounding, which can still cross one rounding boundary",
    ),
    "bf16_model_logits": Tolerance(
        "close",
        rtol=0.0,
        atol=0.25,
        reason="logits (|logit| ~ 1) of a whole BF16 model patched with moefuse vs the same model "
        "unpatched: the fused ops round once where transformers rounds twice, ~1e-2 apart after "
        "a few layers, and a token whose top-k routing flips between two nearly tied experts "
        "moves by up to ~0.2; which of the two is closer to FP32 is tested separately",
    ),
}


def _ordered_int(t: torch.Tensor) -> torch.Tensor:
    """Map float bits to integers whose order matches the float order (+0 and -0 both map to 0)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        i = t.contiguous().view(torch.int8).to(torch.int64)
        mag = i & 0x7F
    elif t.dtype in (torch.bfloat16, torch.float16):
        i = t.contiguous().view(torch.int16).to(torch.int64)
        mag = i & 0x7FFF
    elif t.dtype == torch.float32:
        i = t.contiguous().view(torch.int32).to(torch.int64)
        mag = i & 0x7FFFFFFF
    else:
        raise TypeError(f"ulp distance is defined for fp8/bf16/fp16/fp32, got {t.dtype}")
    return torch.where(i < 0, -mag, mag)


def ulp_distance(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Elementwise distance in units in the last place of ``actual.dtype`` (int64 tensor)."""
    if actual.dtype != expected.dtype:
        raise TypeError(f"dtype mismatch: {actual.dtype} vs {expected.dtype}")
    return (_ordered_int(actual) - _ordered_int(expected.to(actual.device))).abs()


def _raw_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as an integer tensor on the CPU (for bitwise comparison)."""
    return _raw_bits(t).cpu()


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(
            f"{what}: shape/dtype {tuple(actual.shape)}/{actual.dtype} vs "
            f"{tuple(expected.shape)}/{expected.dtype}"
        )
    a, b = _raw_bits(actual), _raw_bits(expected.to(actual.device))
    if not torch.equal(a, b):
        bad = (a != b).nonzero()
        first = tuple(bad[0].tolist())
        raise AssertionError(
            f"{what}: {bad.shape[0]} of {a.numel()} elements differ bitwise; first at {first}: "
            f"{actual.detach().cpu()[first].item()!r} vs {expected.detach().cpu()[first].item()!r}"
        )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: str, what: str = "") -> None:
    """Compare under row ``tol`` of :data:`TOLERANCES`; NaN never passes unless bitwise."""
    row = TOLERANCES[tol]
    if row.kind == "bitwise":
        assert_bitwise_equal(actual, expected, what)
        return
    if actual.shape != expected.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if not torch.isfinite(actual.float()).all():
        raise AssertionError(f"{what}: output has NaN/Inf (unwritten or poisoned elements)")
    if row.kind == "ulp":
        d = ulp_distance(actual, expected.to(actual.dtype))
        worst = int(d.max()) if d.numel() else 0
        if worst > row.max_ulp:
            idx = tuple((d == worst).nonzero()[0].tolist())
            raise AssertionError(
                f"{what}: {worst} ulp > {row.max_ulp} at {idx}: "
                f"{actual[idx].item()!r} vs {expected[idx].item()!r} ({row.reason})"
            )
    else:
        torch.testing.assert_close(
            actual,
            expected.to(actual.dtype).to(actual.device),
            rtol=row.rtol,
            atol=row.atol,
            msg=lambda m: f"{what}: {m}",
        )


def expect_value_error(fn, argument: str, *untouched: torch.Tensor) -> None:
    """Assert that ``fn()`` raises ``ValueError`` naming ``'argument'`` and writes nothing into
    ``untouched`` (the API contract for bad input)."""
    before = [_raw_bits(t).clone() for t in untouched]
    try:
        fn()
    except ValueError as exc:
        if f"'{argument}'" not in str(exc):
            raise AssertionError(f"ValueError does not name '{argument}': {exc}") from exc
    else:
        raise AssertionError(f"no ValueError for a bad '{argument}'")
    for t, b in zip(untouched, before):
        assert_bitwise_equal(_raw_bits(t), b, f"{argument}: nothing written")


@contextlib.contextmanager
def graph_capture(graph: torch.cuda.CUDAGraph):
    """``torch.cuda.graph(graph)`` that, when the capture raises, undoes what it left behind
    (:func:`_release_failed_capture`) before the exception goes on, so the process can carry on
    and exit cleanly."""
    before = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph):
            yield graph
    except Exception:
        _release_failed_capture(graph, before)
        raise


def _release_failed_capture(graph, stream) -> None:
    """Undo what a capture that raised left behind, so the caller can go on: the caching
    allocator still counts the capture as underway when ``capture_end`` raised before telling it
    (it then asserts at process exit: SIGABRT after the results were written), and
    ``torch.cuda.graph`` skips restoring the current stream when ``capture_end`` raises. Each
    step is best effort (private allocator calls, skipped where absent). The pool is released
    only when ending its allocation succeeded here, i.e. capture_end had not: a capture that did
    end belongs to the graph, which releases its pool itself."""
    device = torch.cuda.current_device()
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    release = getattr(torch._C, "_cuda_releasePool", None)
    try:
        if end is not None and release is not None:
            end(device, graph.pool())
            release(device, graph.pool())
    except Exception:  # "not currently recording": capture_end got that far itself
        pass
    torch.cuda.set_stream(stream)


def capture_graph(fn, *workspaces) -> torch.cuda.CUDAGraph:
    """``fn()`` once on a side stream (it compiles, records its launch plan and allocates
    outside the capture), then captured into a CUDA graph inside every workspace's
    ``capture()`` context (the communication ops' capture bookkeeping). Returns the graph, not
    replayed yet."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with contextlib.ExitStack() as contexts:
        for ws in workspaces:
            contexts.enter_context(ws.capture())
        graph = torch.cuda.CUDAGraph()
        with graph_capture(graph):
            fn()
    return graph


def run_eager_pdl_and_graph(run, make_outputs, replays: int = 4) -> list:
    """Run ``run(outputs, pdl)`` three ways on the GPU and return the three output tuples: eagerly
    with PDL on, eagerly with PDL off, and as a CUDA-graph replay (captured after a warm-up on a
    side stream; outputs poisoned before each of ``replays`` replays, >= 4, spec: Tests).
    ``make_outputs()`` returns a fresh tuple of output tensors for each mode."""
    results = []
    for pdl in (True, False):
        outs = make_outputs()
        run(outs, pdl)
        results.append(outs)
    outs = make_outputs()
    graph = capture_graph(lambda: run(outs, True))
    for _ in range(replays):
        for o in outs:
            poison_(o)
        graph.replay()
    torch.cuda.synchronize()
    results.append(outs)
    return results


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.numel() == 0:
        return 0.0
    return float((actual.double().cpu() - expected.double().cpu()).abs().max())


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with a value no kernel writes (NaN for floats, 0xA5 bytes for integers)."""
    if t.dtype.is_floating_point:
        t.fill_(float("nan"))
    else:
        t.view(torch.uint8).fill_(0xA5)
    return t


def naming_launch(real, names: list):
    """A stand-in for a module's ``launch`` (``moefuse._fastpath.launch``) that appends each
    kernel's name to ``names`` and then launches it with ``real``."""

    def launch(kernel, grid, *args, **consts):
        names.append(kernel.fn.__name__)
        real(kernel, grid, *args, **consts)

    return launch


def poisoned_like(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return poison_(torch.empty_like(t, dtype=dtype))


def assert_fused_activation_quant(x, fp8_weights, idx, w, tiles, use_pdl: bool, what: str = ""):
    """The FP8 experts' gate|up kernel quantizing the activation itself (``fuse_act_quant``)
    writes per_token_group_quant_8bit's bytes for the valid slots' rows at each of ``tiles``, and
    the experts' output is bitwise the same with it on and off. ``fp8_weights`` = (gate|up codes,
    their scales, down codes, their scales)."""
    import moefuse
    from moefuse.moe.experts_fp8 import gate_up_activation_codes, launch_moe_experts_fp8

    gq, gs, dq, ds = fp8_weights
    for tile in tiles:
        act, codes, scales, valid = gate_up_activation_codes(x, gq, gs, idx, tile=tile)
        q, s = moefuse.per_token_group_quant_8bit(act, 128, impl="triton")
        assert torch.equal(codes[valid], q.view(torch.uint8)[valid]), (what, tile)
        assert_bitwise_equal(scales[valid], s[valid], f"{what} scales {tile}")
    outs = []
    for fuse in (False, True):
        out = poison_(torch.empty_like(x))
        launch_moe_experts_fp8(
            x,
            gq,
            gs,
            dq,
            ds,
            idx,
            w,
            out,
            None,
            None,
            1.0,
            False,
            use_pdl,
            tile={"fuse_act_quant": fuse},
        )
        outs.append(out)
    assert_bitwise_equal(outs[1], outs[0], f"{what} fused vs standalone activation quantization")


def moe_reduction_case(seed, p, m, h, e, dev):
    """Random inputs of ``moe_allreduce_residual_rmsnorm`` for ALL ``p`` ranks (the
    same on every rank, from ``seed``): ``(expert_rows, scales, token_inputs, residual,
    norm_weight)``; per-rank lists of BF16 [E, M, H] rows, FP32 [E, M] scales in [0.1, 1.1) and
    BF16 [M, H] token inputs, then the shared BF16 [M, H] residual and [H] weight in [0.5, 1.5)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    xs = [torch.randn(e, m, h, generator=g, device=dev).to(torch.bfloat16) for _ in range(p)]
    scales = [torch.rand(e, m, generator=g, device=dev) + 0.1 for _ in range(p)]
    toks = [torch.randn(m, h, generator=g, device=dev).to(torch.bfloat16) for _ in range(p)]
    res = torch.randn(m, h, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.rand(h, generator=g, device=dev) + 0.5).to(torch.bfloat16)
    return xs, scales, toks, res, w


def moe_finalize_case(
    seed, p, m, h, k, dev, *, weights_dtype=torch.bfloat16, shared=True, bias=False
):
    """Random inputs of ``moe_finalize_allreduce_residual_rmsnorm`` for ALL ``p`` ranks (the
    same on every rank, from ``seed``): ``(rows, idx, expert_scales, shared_outputs, residual,
    norm_weight, biases, expert_ids)``, per-rank lists where ranks differ. Permuted rows with 5
    padding rows, unused rows NaN, one invalid slot (-1, -9, R, R + 3) in two of every three
    tokens, -0.0 in column 0; with ``bias``, per-rank expert biases [16, H] and expert ids in
    [-1, 17)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    r_rows = m * k + 5
    perm = torch.randperm(r_rows, generator=g, device=dev)[: m * k].to(torch.int32).view(m, k)
    t = torch.arange(m, device=dev)
    bad = torch.tensor([-1, -9, r_rows, r_rows + 3], dtype=torch.int32, device=dev)[t % 4]
    sel = (t % 3) != 2
    perm[t[sel], ((t + 1) % k)[sel]] = bad[sel]
    valid = (perm >= 0) & (perm < r_rows)
    keep = torch.zeros(r_rows, dtype=torch.bool, device=dev)
    keep[perm[valid].long()] = True
    ins, ws, shs = [], [], []
    for _ in range(p):
        x = torch.randn(r_rows, h, generator=g, device=dev).to(torch.bfloat16)
        x[~keep] = float("nan")
        x[:, 0] = -0.0
        ins.append(x)
        ws.append((torch.rand(m, k, generator=g, device=dev) + 0.1).to(weights_dtype))
        shs.append(
            torch.randn(m, h, generator=g, device=dev).to(torch.bfloat16) if shared else None
        )
    res = torch.randn(m, h, generator=g, device=dev).to(torch.bfloat16)
    w = (torch.rand(h, generator=g, device=dev) + 0.5).to(torch.bfloat16)
    bs, eids = None, None
    if bias:
        bs = [torch.randn(16, h, generator=g, device=dev).to(torch.bfloat16) for _ in range(p)]
        eids = torch.randint(-1, 17, (m, k), generator=g, device=dev, dtype=torch.int32)
    return ins, perm, ws, shs, res, w, bs, eids
