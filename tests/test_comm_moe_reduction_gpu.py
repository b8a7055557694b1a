"""MoE-reduction fusions (spec: MoE reduction, MoE finalize) on 2 H200s (NCCL group,
symmetric-memory peer buffers, no multicast): full shapes, both accumulate modes, invalid indices
over NaN-poisoned rows, bitwise across one-shot / two-shot / torch.distributed / the reference path,
ranks, PDL on/off and a token alone vs inside the batch; FP8 / NVFP4 outputs; 1,000 CUDA-graph
replays with fresh data; the one-shot variant "split" (MOEFUSE_MOE_COMM_VARIANT) bitwise against
fused.

Run: ``python -m pytest -q tests/test_comm_moe_reduction_gpu.py`` (each test spawns its own P
processes; world sizes beyond the GPU count are skipped).
"""

from __future__ import annotations

import pytest
import torch

from comm_mp import run_group
from moefuse.testing import moe_finalize_case as finalize_case
from moefuse.testing import moe_reduction_case as reduction_case
from test_comm_gpu import assert_ranks_agree, checksum, same_bits, within_one_ulp

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

WORLD_SIZES = [pytest.param(2, id="p2")]
WIDTHS = (2880, 4096, 7168)
TOP_K = (2, 6, 8)
TOKENS = (1, 7, 64, 200, 4096)
ALGOS = ("oneshot", "twoshot", "torch")
FP8_SCALE = 0.0125
NVFP4_GS = 448.0 * 6 / 8.0
RSF = 2.5


def _dev(rank) -> torch.device:
    return torch.device("cuda", rank)


def _need(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")


# ----------------------------------------------------------------------------- inputs
def call_finalize(moefuse, ws, rank, case, algo, opts, rows=None, pdl=None, impl="triton"):
    ins, perm, wts, shs, res, w, bs, eids = case
    sl = slice(*rows) if rows is not None else slice(None)
    kw = dict(
        workspace=ws,
        algorithm=algo,
        impl=impl,
        enable_pdl=pdl,
        expert_scale_factor=wts[rank][sl],
        routed_scaling_factor=opts["rsf"],
        accumulate=opts["accumulate"],
        weight_bias=opts["weight_bias"],
        **opts.get("quant_kw", {}),
    )
    if shs[rank] is not None:
        kw["shared_expert_output"] = shs[rank][sl]
    if bs is not None:
        kw.update(bias=bs[rank], expert_ids=eids[sl])
    return moefuse.moe_finalize_allreduce_residual_rmsnorm(ins[rank], res[sl], w, perm[sl], **kw)


def call_reduction(moefuse, ws, rank, case, algo, opts, rows=None, pdl=None, impl="triton"):
    xs, scales, toks, res, w = case
    sl = slice(*rows) if rows is not None else slice(None)
    return moefuse.moe_allreduce_residual_rmsnorm(
        xs[rank][:, sl],
        scales[rank][:, sl],
        toks[rank][sl],
        res[sl],
        w,
        workspace=ws,
        algorithm=algo,
        impl=impl,
        enable_pdl=pdl,
        accumulate=opts["accumulate"],
        weight_bias=opts["weight_bias"],
        **opts.get("quant_kw", {}),
    )


def oracle(op, case, opts):
    from moefuse.comm.moe_reduction import reference as mref

    kw = dict(accumulate=opts["accumulate"], weight_bias=opts["weight_bias"])
    if op == "finalize":
        ins, perm, wts, shs, res, w, bs, eids = case
        return mref.moe_finalize_allreduce_from_ranks(
            ins,
            perm,
            res,
            w,
            expert_scale_factors=wts,
            routed_scaling_factor=opts["rsf"],
            shared_expert_outputs=shs if shs[0] is not None else None,
            biases=bs,
            expert_ids=eids,
            **kw,
        )
    xs, scales, toks, res, w = case
    return mref.moe_allreduce_from_ranks(xs, scales, toks, res, w, **kw)


# ----------------------------------------------------------------------------- scenarios
def scenario_full_shapes(rank, world_size):
    """Every (H, K, M, op): oracle (residual_out bitwise, norm_out <= 1 ulp), bitwise across
    algorithms, the reference path, ranks; PDL off and a token alone at M in {7, 4096}."""
    import moefuse
    from moefuse.comm.moe_reduction.ops import extra_regions

    dev = _dev(rank)
    for h in WIDTHS:
        ws = moefuse.AllReduceWorkspace(
            None,
            max(TOKENS),
            h,
            torch.bfloat16,
            dev,
            oneshot_max_tokens=max(TOKENS),
            extra_regions=extra_regions(max(TOKENS), h),
        )
        for k in TOP_K:
            for m in TOKENS:
                for op in ("finalize", "reduction"):
                    # options vary with (H, K) only: every combination is one compilation
                    hi, ki = WIDTHS.index(h), TOP_K.index(k)
                    opts = dict(
                        accumulate=("stepwise", "fp32")[(hi + ki) % 2],
                        weight_bias=float(ki % 2),
                        rsf=(RSF, 1.0)[ki % 2],
                    )
                    seed = h * 131 + k * 17 + m
                    if op == "finalize":
                        case = finalize_case(
                            seed,
                            world_size,
                            m,
                            h,
                            k,
                            dev,
                            weights_dtype=(torch.bfloat16, torch.float32)[hi % 2],
                            shared=k != 6,
                            bias=k == 6,
                        )
                        run = call_finalize
                    else:
                        case = reduction_case(seed, world_size, m, h, k, dev)
                        run = call_reduction
                    want = oracle(op, case, opts)
                    first = None
                    for algo in (*ALGOS, "reference"):
                        what = f"{op} H={h} K={k} M={m} {opts} {algo}"
                        impl = "reference" if algo == "reference" else "triton"
                        outs = run(
                            moefuse,
                            ws,
                            rank,
                            case,
                            "auto" if impl == "reference" else algo,
                            opts,
                            impl=impl,
                        )
                        same_bits(outs[0], want["residual_out"], f"{what} residual_out")
                        if first is None:
                            within_one_ulp(outs[1], want["norm_out"], f"{what} norm_out")
                            first = outs
                        elif impl == "triton":
                            for a, b in zip(outs, first):
                                same_bits(a, b, f"{what} vs {ALGOS[0]}")
                        if m in (7, 4096) and impl == "triton":
                            off = run(moefuse, ws, rank, case, algo, opts, pdl=False)
                            for a, b in zip(off, outs):
                                same_bits(a, b, f"{what} PDL off")
                            j = m // 2
                            alone = run(moefuse, ws, rank, case, algo, opts, rows=(j, j + 1))
                            for a, b in zip(alone, outs):
                                same_bits(a, b[j : j + 1], f"{what} token alone")
                    assert_ranks_agree(checksum(*first), f"{op} H={h} K={k} M={m}")
        ws.check()
        ws.close()
    return True


def scenario_quant(rank, world_size):
    """FP8 / NVFP4 (recipe "fast", every layout): bitwise equal to the reference quantizer (with
    the GPU's rcp.approx) applied to the kernel's own norm output; bitwise across algorithms."""
    import moefuse
    from moefuse.quant import reference as quant_ref
    from moefuse.quant.triton import rcp_approx

    dev = _dev(rank)
    h, k = 4096, 8
    ws = moefuse.AllReduceWorkspace(None, 200, h, torch.bfloat16, dev)
    for m in (1, 200):
        for quant, layout in (
            ("fp8", "swizzled_128x4"),
            ("nvfp4", "swizzled_128x4"),
            ("nvfp4", "swizzled_8x4"),
            ("nvfp4", "linear"),
        ):
            sf = torch.tensor([FP8_SCALE if quant == "fp8" else NVFP4_GS], device=dev)
            opts = dict(
                accumulate="stepwise",
                weight_bias=0.0,
                rsf=RSF,
                quant_kw=dict(quant=quant, scale_factor=sf, layout=layout),
            )
            for op, run in (("finalize", call_finalize), ("reduction", call_reduction)):
                case = (
                    finalize_case(m, world_size, m, h, k, dev)
                    if op == "finalize"
                    else reduction_case(m, world_size, m, h, k, dev)
                )
                first = None
                for algo in ALGOS:
                    what = f"{op} M={m} {quant} {layout} {algo}"
                    outs = run(moefuse, ws, rank, case, algo, opts)
                    if quant == "fp8":
                        q = quant_ref.fp8_quantize_reference(outs[1], sf)
                        same_bits(outs[2].view(torch.uint8), q.view(torch.uint8), what)
                    else:
                        pk, sc = quant_ref.fp4_quantize_reference(
                            outs[1], sf, layout, "fast", rcp=rcp_approx
                        )
                        same_bits(outs[2], pk, f"{what} codes")
                        same_bits(outs[3], sc.reshape(outs[3].shape), f"{what} scales")
                    first = first or outs
                    for a, b in zip(outs, first):
                        same_bits(a, b, f"{what} vs {ALGOS[0]}")
                assert_ranks_agree(checksum(*first), f"{op} M={m} {quant}")
    ws.close()
    return True


def scenario_graph_replays(rank, world_size, replays):
    """The finalize fusion captured in a CUDA graph per algorithm (PDL on), replayed with fresh
    inputs (new rows, weights, indices with invalid slots, NaN in unused rows) copied in before
    each replay: residual_out bitwise against the oracle every replay."""
    import moefuse
    from moefuse.comm.moe_reduction.ops import extra_regions
    from moefuse.testing import assert_bitwise_equal, capture_graph

    dev = _dev(rank)
    m, h, k = 64, 4096, 8
    ws = moefuse.AllReduceWorkspace(
        None, m, h, torch.bfloat16, dev, oneshot_max_tokens=m, extra_regions=extra_regions(m, h)
    )
    base = finalize_case(0, world_size, m, h, k, dev)[:6]
    buf = [t[rank].clone() if isinstance(t, list) else t.clone() for t in base]  # static inputs
    x, perm, wt, sh, res, w = buf
    for accumulate in ("stepwise", "fp32"):
        for algo in ALGOS:
            ro, no = torch.empty_like(res), torch.empty_like(res)
            run = lambda: moefuse.moe_finalize_allreduce_residual_rmsnorm(  # noqa: E731
                x,
                res,
                w,
                perm,
                workspace=ws,
                expert_scale_factor=wt,
                routed_scaling_factor=RSF,
                shared_expert_output=sh,
                accumulate=accumulate,
                algorithm=algo,
                impl="triton",
                residual_out=ro,
                norm_out=no,
            )
            graph = capture_graph(run, ws)
            for i in range(replays):
                case = finalize_case(1000 + i, world_size, m, h, k, dev)
                for dst, src in zip(buf, case[:6]):
                    dst.copy_(src[rank] if isinstance(src, list) else src)
                ro.fill_(float("nan"))
                graph.replay()
                want = oracle(
                    "finalize", case, dict(accumulate=accumulate, weight_bias=0.0, rsf=RSF)
                )
                assert_bitwise_equal(ro, want["residual_out"], f"{algo} {accumulate} replay {i}")
            del graph
    ws.check()
    ws.close()
    return True


def scenario_graph_replays_wide(rank, world_size, replays):
    """The MoE reduction at H = 7168, M = 2048 in a CUDA graph per algorithm ("auto" takes
    the two-shot at 2 CTAs per SM there; the one-shot for comparison), replayed with fresh inputs
    copied in before each replay: residual_out bitwise against the oracle, norm_out bitwise
    across the two algorithms, every replay."""
    import moefuse
    from moefuse.comm.moe_reduction.ops import resolve_algorithm
    from moefuse.testing import assert_bitwise_equal, capture_graph

    dev = _dev(rank)
    m, h, e = 2048, 7168, 8
    ws = moefuse.AllReduceWorkspace(None, m, h, torch.bfloat16, dev, oneshot_max_tokens=m)
    assert resolve_algorithm(ws, m, "auto", stepwise=True, dense=True) == "twoshot"
    base = reduction_case(0, world_size, m, h, e, dev)
    buf = [t[rank].clone() if isinstance(t, list) else t.clone() for t in base]
    x, sc, tok, res, w = buf
    outs, graphs = {}, {}
    for algo in ("auto", "oneshot"):
        outs[algo] = (torch.empty_like(res), torch.empty_like(res))
        run = lambda a=algo: moefuse.moe_allreduce_residual_rmsnorm(  # noqa: E731
            x,
            sc,
            tok,
            res,
            w,
            workspace=ws,
            algorithm=a,
            impl="triton",
            residual_out=outs[a][0],
            norm_out=outs[a][1],
        )
        graphs[algo] = capture_graph(run, ws)
    for i in range(replays):
        case = reduction_case(3000 + i, world_size, m, h, e, dev)
        for dst, src in zip(buf, case):
            dst.copy_(src[rank] if isinstance(src, list) else src)
        for algo, graph in graphs.items():
            outs[algo][0].fill_(float("nan"))
            outs[algo][1].fill_(float("nan"))
            graph.replay()
        want = oracle("reduction", case, dict(accumulate="stepwise", weight_bias=0.0))
        assert_bitwise_equal(outs["auto"][0], want["residual_out"], f"auto replay {i}")
        for a, b in zip(outs["auto"], outs["oneshot"]):
            assert_bitwise_equal(a, b, f"auto vs oneshot replay {i}")
    del graphs
    ws.check()
    ws.close()
    return True


def _with_variant(variant, fn):
    """``fn()`` with MOEFUSE_MOE_COMM_VARIANT=variant (launch plans dropped around it)."""
    import os

    from moefuse import _fastpath

    os.environ["MOEFUSE_MOE_COMM_VARIANT"] = variant
    _fastpath.clear()
    try:
        return fn()
    finally:
        os.environ.pop("MOEFUSE_MOE_COMM_VARIANT")
        _fastpath.clear()


VARIANT_TOKENS = (1, 7, 64, 200, 2048)
VARIANT_WIDTHS = (4096, 7168)


def scenario_oneshot_variants(rank, world_size):
    """The one-shot variant "split" (column-split producer; M <= 256) bitwise
    equal to the fused one-shot (all outputs, PDL on and off, a token alone) and residual_out to
    the oracle, at H in {4096, 7168}, K = 8, both ops, both accumulate modes (bias for fp32),
    FP8 at M = 64; then 200 CUDA-graph replays of each with fresh data (own-row and peer-slot
    re-arming across calls and generations)."""
    import moefuse
    from moefuse.comm.moe_reduction.ops import extra_regions
    from moefuse.testing import assert_bitwise_equal, capture_graph

    dev = _dev(rank)
    k = 8
    sf = torch.tensor([FP8_SCALE], device=dev)
    for h in VARIANT_WIDTHS:
        cap = max(VARIANT_TOKENS)
        ws = moefuse.AllReduceWorkspace(
            None,
            cap,
            h,
            torch.bfloat16,
            dev,
            oneshot_max_tokens=cap,
            extra_regions=extra_regions(cap, h),
        )
        for m in VARIANT_TOKENS:
            for op, acc in (
                ("finalize", "stepwise"),
                ("finalize", "fp32"),
                ("reduction", "stepwise"),
            ):
                opts = dict(accumulate=acc, weight_bias=0.0, rsf=RSF)
                if m == 64:
                    opts["quant_kw"] = dict(quant="fp8", scale_factor=sf)
                seed = h + 7 * m + len(acc)
                if op == "finalize":
                    case = finalize_case(seed, world_size, m, h, k, dev, bias=acc == "fp32")
                    run = call_finalize
                else:
                    case = reduction_case(seed, world_size, m, h, k, dev)
                    run = call_reduction
                base = _with_variant("fused", lambda: run(moefuse, ws, rank, case, "oneshot", opts))
                want = oracle(op, case, opts)
                same_bits(base[0], want["residual_out"], f"{op} H={h} M={m} {acc} fused")
                for variant in ("split",):
                    what = f"{op} H={h} M={m} {acc} {variant}"
                    for pdl in (None, False):
                        got = _with_variant(
                            variant, lambda: run(moefuse, ws, rank, case, "oneshot", opts, pdl=pdl)
                        )
                        for a, b in zip(got, base):
                            same_bits(a, b, f"{what} pdl={pdl} vs fused")
                    if m in (7, 200):
                        j = m // 2
                        alone = _with_variant(
                            variant,
                            lambda: run(moefuse, ws, rank, case, "oneshot", opts, rows=(j, j + 1)),
                        )
                        for a, b in zip(alone, base):
                            same_bits(a, b[j : j + 1], f"{what} token alone")
                assert_ranks_agree(checksum(*base), f"{op} H={h} M={m} {acc}")
        ws.check()
        ws.close()
    if dev.type != "cuda":  # (a CPU dry run of the scenario stops here)
        return True
    m, h = 8, 4096
    ws = moefuse.AllReduceWorkspace(None, m, h, torch.bfloat16, dev, oneshot_max_tokens=m)
    buf = [
        t[rank].clone() if isinstance(t, list) else t.clone()
        for t in finalize_case(0, world_size, m, h, k, dev)[:6]
    ]
    x, perm, wt, sh, res, w = buf
    for variant in ("split",):
        ro, no = torch.empty_like(res), torch.empty_like(res)

        def once():
            return moefuse.moe_finalize_allreduce_residual_rmsnorm(
                x,
                res,
                w,
                perm,
                workspace=ws,
                expert_scale_factor=wt,
                routed_scaling_factor=RSF,
                shared_expert_output=sh,
                algorithm="oneshot",
                impl="triton",
                residual_out=ro,
                norm_out=no,
            )

        graph = _with_variant(variant, lambda: capture_graph(once, ws))
        for i in range(200):
            case = finalize_case(2000 + i, world_size, m, h, k, dev)
            for dst, src in zip(buf, case[:6]):
                dst.copy_(src[rank] if isinstance(src, list) else src)
            ro.fill_(float("nan"))
            graph.replay()
            want = oracle("finalize", case, dict(accumulate="stepwise", weight_bias=0.0, rsf=RSF))
            assert_bitwise_equal(ro, want["residual_out"], f"{variant} replay {i}")
        del graph
    ws.check()
    ws.close()
    return True


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_oneshot_variants(world_size):
    _need(world_size)
    assert all(run_group(world_size, scenario_oneshot_variants, backend="nccl", timeout_s=900))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_full_shapes_every_algorithm(world_size):
    _need(world_size)
    assert all(run_group(world_size, scenario_full_shapes, backend="nccl", timeout_s=1200))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_quant_outputs(world_size):
    _need(world_size)
    assert all(run_group(world_size, scenario_quant, backend="nccl", timeout_s=600))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_graph_replays_fresh_data(world_size):
    _need(world_size)
    assert all(run_group(world_size, scenario_graph_replays, 1000, backend="nccl", timeout_s=1200))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_graph_replays_wide_reduction(world_size):
    _need(world_size)
    assert all(
        run_group(world_size, scenario_graph_replays_wide, 50, backend="nccl", timeout_s=900)
    )
