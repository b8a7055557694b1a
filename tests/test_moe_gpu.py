"""MoE finalize on an SM90+ GPU: the Triton kernels against the CPU reference, bit for bit, at the
issue's shapes (K in {1,2,4,6,8,10}, H in {128,2880,4096,7168}, M in {1,7,128,4096}, BF16/FP16,
with and without the extensions), eager and CUDA-graph replay, PDL on and off; determinism across
runs, launch geometries and batch compositions; the scatter-add baseline, the permute -> finalize
PDL chain and the layer pipeline.

Inputs are generated on the GPU; the reference runs once per case on the CPU (whole-tensor torch
math) and every GPU variant is compared with it on the CPU.
"""

import pytest
import torch

import moefuse
from moefuse.moe import reference as ref
from moefuse.moe.routing import route_topk, sort_by_expert
from moefuse.testing import assert_bitwise_equal, bits, poison_

pytestmark = pytest.mark.gpu

KS = [1, 2, 4, 6, 8, 10]
HS = [128, 2880, 4096, 7168]
MS = [1, 7, 128, 4096]
DTYPES = [torch.bfloat16, torch.float16]
SCALE_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEV = "cuda"


def gpu_case(m, k, h, *, dtype, scale_dtype=torch.float32, ext=False, expanded=False, seed=0):
    """Like tests/test_moe.py's cases, built on the GPU: ~20 % invalid slots (negative or >= R),
    an all-masked token, NaN in every row no valid slot points to, subnormals and -0.0."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    n_rows = m * k + (0 if expanded else 8)
    inp = torch.randn(n_rows, h, device=DEV, generator=g).to(dtype)
    flat = inp.view(-1)
    tiny = 2.0**-130 if dtype == torch.bfloat16 else 2.0**-20
    flat[::7] = (flat[::7].float() * tiny).to(dtype)
    flat[3::11] = -0.0
    idx = torch.randperm(n_rows, device=DEV, generator=g)[: m * k].view(m, k).to(torch.int32)
    bad = torch.rand(m, k, device=DEV, generator=g) < 0.2
    junk = torch.randint(0, 2, (m, k), device=DEV, generator=g, dtype=torch.int32)
    idx = torch.where(bad, torch.where(junk == 0, -1, n_rows + junk), idx)
    if m > 1:
        idx[m // 2] = -1
    used = torch.zeros(n_rows, dtype=torch.bool, device=DEV)
    if expanded:
        used[: m * k] = (idx >= 0).view(-1)
    else:
        used[idx[(idx >= 0) & (idx < n_rows)].long()] = True
    inp[~used] = float("nan")
    scales = torch.rand(m, k, device=DEV, generator=g).to(scale_dtype)
    kw = {}
    if ext:
        e = 8
        kw = dict(
            bias=torch.randn(e, h, device=DEV, generator=g).to(dtype),
            expert_ids=torch.randint(-1, e + 1, (m, k), device=DEV, generator=g, dtype=torch.int32),
            routed_scaling_factor=0.75,
            shared_expert_output=torch.randn(m, h, device=DEV, generator=g).to(dtype),
        )
    return inp, idx, scales, kw


def cpu_reference(inp, idx, scales, kw, expanded=False):
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    return ref.moe_finalize_reference(
        inp.cpu(), idx.cpu(), scales.cpu(), input_is_expanded=expanded, **cpu
    )


def run_variants(inp, idx, scales, kw, expanded=False, *, graph=True):
    """{variant: output} for eager PDL off / on and a graph replay with PDL on."""
    outs = {}
    for pdl in (False, True):
        out = poison_(torch.empty(idx.shape[0], inp.shape[1], dtype=inp.dtype, device=DEV))
        moefuse.moe_finalize(
            inp,
            idx,
            scales,
            out=out,
            input_is_expanded=expanded,
            enable_pdl=pdl,
            impl="triton",
            **kw,
        )
        outs[f"eager pdl={pdl}"] = out
    if graph:
        out = poison_(torch.empty(idx.shape[0], inp.shape[1], dtype=inp.dtype, device=DEV))
        graph_ = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph_):
            moefuse.moe_finalize(
                inp,
                idx,
                scales,
                out=out,
                input_is_expanded=expanded,
                enable_pdl=True,
                impl="triton",
                **kw,
            )
        poison_(out)
        graph_.replay()
        outs["graph pdl=True"] = out
    torch.cuda.synchronize()
    return outs


def _selected(m, ki, hi, di):
    """The largest M runs for half of the (K, H, dtype) combinations (CPU reference time)."""
    return m < 4096 or (ki + hi + di) % 2 == 0


@pytest.mark.parametrize("di", range(len(DTYPES)), ids=["bf16", "fp16"])
@pytest.mark.parametrize("hi", range(len(HS)), ids=[f"H{h}" for h in HS])
def test_finalize_matches_cpu_reference_bitwise(hi, di):
    h, dtype = HS[hi], DTYPES[di]
    for ki, k in enumerate(KS):
        for m in MS:
            if not _selected(m, ki, hi, di):
                continue
            for ext in (False, True) if m < 4096 else (ki % 2 == 1,):
                sdt = SCALE_DTYPES[(ki + hi) % 3]
                inp, idx, scales, kw = gpu_case(
                    m, k, h, dtype=dtype, scale_dtype=sdt, ext=ext, seed=1000 * ki + m + hi
                )
                want = cpu_reference(inp, idx, scales, kw)
                for name, out in run_variants(inp, idx, scales, kw, graph=m <= 128).items():
                    assert_bitwise_equal(
                        out, want, f"M={m} K={k} H={h} {dtype} scales={sdt} ext={ext} {name}"
                    )


@pytest.mark.parametrize("h", [128, 2880, 7168])
def test_expanded_input_bitwise(h):
    for k, ext in ((1, False), (8, True), (10, False)):
        inp, idx, scales, kw = gpu_case(
            128, k, h, dtype=torch.bfloat16, ext=ext, expanded=True, seed=k
        )
        want = cpu_reference(inp, idx, scales, kw, expanded=True)
        for name, out in run_variants(inp, idx, scales, kw, expanded=True).items():
            assert_bitwise_equal(out, want, f"expanded K={k} H={h} {name}")


def test_large_k_loop_and_odd_widths_bitwise():
    for m, k, h in ((7, 20, 4096), (128, 3, 7), (33, 5, 1000), (4, 8, 2056)):
        inp, idx, scales, kw = gpu_case(m, k, h, dtype=torch.bfloat16, ext=True, seed=h)
        want = cpu_reference(inp, idx, scales, kw)
        for name, out in run_variants(inp, idx, scales, kw).items():
            assert_bitwise_equal(out, want, f"M={m} K={k} H={h} {name}")


def test_determinism_runs_geometries_and_batches():
    from moefuse.moe.triton import launch_moe_finalize

    inp, idx, scales, kw = gpu_case(4096, 8, 4096, dtype=torch.bfloat16, ext=True, seed=7)
    full = moefuse.moe_finalize(inp, idx, scales, impl="triton", **kw)
    for run in range(3):
        again = moefuse.moe_finalize(inp, idx, scales, impl="triton", **kw)
        assert_bitwise_equal(again, full, f"run {run}")
    for block, warps in ((256, 1), (512, 2), (2048, 8), (4096, 8)):
        out = poison_(torch.empty_like(full))
        launch_moe_finalize(
            inp,
            idx,
            scales,
            out,
            kw["bias"],
            kw["expert_ids"],
            kw["routed_scaling_factor"],
            kw["shared_expert_output"],
            False,
            True,
            block=block,
            num_warps=warps,
        )
        assert_bitwise_equal(out, full, f"tile {block} x {warps} warps")

    def sub(rows):
        kws = dict(
            kw,
            expert_ids=kw["expert_ids"][rows],
            shared_expert_output=kw["shared_expert_output"][rows],
        )
        return moefuse.moe_finalize(inp, idx[rows], scales[rows], impl="triton", **kws)

    for t in (0, 2048, 4095):
        rows = torch.tensor([t], device=DEV)
        assert_bitwise_equal(sub(rows), full[rows], f"token {t} alone (M=1)")
    perm = torch.randperm(4096, device=DEV, generator=torch.Generator(DEV).manual_seed(1))
    for n in (7, 128, 4096):
        assert_bitwise_equal(sub(perm[:n]), full[perm[:n]], f"shuffled batch of {n}")


def test_graph_replays_with_new_inputs_and_a_pdl_producer():
    """permute (moefuse kernel, PDL) -> finalize (PDL) captured once, replayed 4 times with new
    token data: each replay equals the CPU chain, so the finalize waited for its producer."""
    m, k, h, n_experts = 128, 8, 4096, 16
    g = torch.Generator(DEV).manual_seed(3)
    w, ids = route_topk(torch.randn(m, n_experts, device=DEV, generator=g), k)
    plan = sort_by_expert(ids, n_experts, pad_to=8)
    x = torch.empty(m, h, dtype=torch.bfloat16, device=DEV)
    xp = torch.empty(plan.num_rows, h, dtype=torch.bfloat16, device=DEV)
    out = torch.empty(m, h, dtype=torch.bfloat16, device=DEV)

    def chain():
        moefuse.moe_permute(
            x, plan.permuted_idx_to_expanded_idx, k, out=xp, enable_pdl=True, impl="triton"
        )
        moefuse.moe_finalize(
            xp, plan.expanded_idx_to_permuted_idx, w, out=out, enable_pdl=True, impl="triton"
        )

    x.normal_(generator=g)
    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    cpu_plan = [
        t.cpu() for t in (plan.permuted_idx_to_expanded_idx, plan.expanded_idx_to_permuted_idx)
    ]
    for replay in range(4):
        x.normal_(generator=g)
        poison_(xp)
        poison_(out)
        graph.replay()
        torch.cuda.synchronize()
        xp_ref = ref.moe_permute_reference(x.cpu(), cpu_plan[0], k)
        assert_bitwise_equal(xp, xp_ref, f"permute replay {replay}")
        want = ref.moe_finalize_reference(xp_ref, cpu_plan[1], w.cpu())
        assert_bitwise_equal(out, want, f"finalize replay {replay}")


def test_scatter_add_close_to_exact_and_deterministic_finalize_close_to_it():
    m, k, h, n_experts = 2048, 8, 4096, 64
    g = torch.Generator(DEV).manual_seed(4)
    w, ids = route_topk(torch.randn(m, n_experts, device=DEV, generator=g), k)
    plan = sort_by_expert(ids, n_experts, pad_to=16)
    y = torch.randn(plan.num_rows, h, device=DEV, generator=g).bfloat16()
    y[plan.permuted_idx_to_expanded_idx < 0] = float("nan")
    sc = moefuse.moe_finalize_scatter_add(y, plan.permuted_idx_to_expanded_idx, w, impl="triton")
    det = moefuse.moe_finalize(y, plan.expanded_idx_to_permuted_idx, w, impl="triton")
    assert torch.isfinite(sc.float()).all()
    # both round one FP32 sum of the same K products (different order, FTZ or not) to BF16
    diff = (sc.float() - det.float()).abs()
    ulp = 2.0 ** (torch.floor(torch.log2(det.float().abs().clamp_min(2.0**-126))) - 7)
    mags = torch.zeros(m, h, device=DEV)
    for s in range(k):
        mags += (y[plan.expanded_idx_to_permuted_idx[:, s].long()].float() * w[:, s : s + 1]).abs()
    assert bool((diff <= 2 * ulp + k * 2.0**-22 * mags).all()), float(diff.max())


@pytest.mark.parametrize("use_fused_finalize", [False, True])
def test_moe_layer_on_gpu(use_fused_finalize, monkeypatch):
    """The pipeline on the GPU (torch._grouped_mm where it works): the flag picks the finalize,
    the expert rows handed to it are right, and the finalize output is right for those rows."""
    from moefuse.moe import layer as moe_layer_mod

    calls = []

    def spy(name, real):
        def wrapper(*args, **kwargs):
            calls.append((name, args))
            return real(*args, **kwargs)

        return wrapper

    for name in ("moe_finalize", "moe_finalize_scatter_add"):
        monkeypatch.setattr(moe_layer_mod, name, spy(name, getattr(moe_layer_mod, name)))
    g = torch.Generator().manual_seed(5)
    m, h, inter, n_experts, k = 64, 512, 256, 16, 4
    weights = moefuse.MoEWeights.random(n_experts, h, inter, device=DEV, generator=g)
    x = torch.randn(m, h, generator=g).bfloat16().to(DEV)
    got = moefuse.moe_layer(x, weights, k, use_fused_finalize=use_fused_finalize, pad_to=16)
    assert [c[0] for c in calls] == (
        ["moe_finalize_scatter_add"] if use_fused_finalize else ["moe_finalize"]
    )
    y, index, w = (t.cpu() for t in calls[0][1][:3])
    # the GEMM rows: expert e of slot (t, s) applied to token t, computed in FP64 on the CPU
    _, ids = route_topk(torch.nn.functional.linear(x, weights.router), k)
    plan = sort_by_expert(ids, n_experts, pad_to=16)
    rows = plan.expanded_idx_to_permuted_idx.cpu()
    w13, w2, xc = weights.w13.cpu().double(), weights.w2.cpu().double(), x.cpu().double()
    for t in range(0, m, 7):
        for s in range(k):
            e = int(ids[t, s])
            hh = w13[e] @ xc[t]
            want_row = w2[e] @ (torch.nn.functional.silu(hh[:inter]) * hh[inter:])
            torch.testing.assert_close(y[int(rows[t, s])].double(), want_row, rtol=5e-2, atol=3e-2)
    if use_fused_finalize:
        exact = ref.moe_finalize_scatter_add_reference(y, index, w)
        torch.testing.assert_close(got.cpu().float(), exact.float(), rtol=1.6e-2, atol=1e-5)
    else:
        assert_bitwise_equal(got, ref.moe_finalize_reference(y, index, w), "layer finalize")
        again = moefuse.moe_layer(x, weights, k, use_fused_finalize=False, pad_to=16)
        assert_bitwise_equal(again, got, "layer rerun")


def test_torch_compile_fullgraph_and_compat_on_gpu():
    from moefuse.compat._moe import moe_unpermute

    inp, idx, scales, kw = gpu_case(128, 8, 4096, dtype=torch.bfloat16, ext=True, seed=9)
    want = cpu_reference(inp, idx, scales, kw)

    def f(a, b, c, bias, eids, shared):
        return moefuse.moe_finalize(
            a,
            b,
            c,
            bias=bias,
            expert_ids=eids,
            shared_expert_output=shared,
            routed_scaling_factor=0.75,
        )

    compiled = torch.compile(f, fullgraph=True)
    got = compiled(inp, idx, scales, kw["bias"], kw["expert_ids"], kw["shared_expert_output"])
    assert_bitwise_equal(got, want, "torch.compile(fullgraph=True)")
    inp, idx, scales, _ = gpu_case(128, 8, 4096, dtype=torch.bfloat16, seed=10)
    output = poison_(torch.empty(130, 4096, dtype=torch.bfloat16, device=DEV))
    moe_unpermute(inp, output, idx, scales, 128, 8, enable_pdl=True)
    assert_bitwise_equal(output[:128], cpu_reference(inp, idx, scales, {}), "moe_unpermute")
    assert torch.isnan(output[128:].float()).all()
    assert int(bits(output[64]).abs().sum()) == 0  # the all-masked token is +0.0
