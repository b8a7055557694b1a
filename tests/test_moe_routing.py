"""Routing helpers, permute, the scatter-add finalize and the MoE layer pipeline on CPU, against
straightforward PyTorch written with Python loops (kernels in the interpreter)."""

import pytest
import torch

import moefuse
from moefuse.moe import layer as moe_layer_mod
from moefuse.moe import reference as ref
from moefuse.moe.routing import route_topk, sort_by_expert
from moefuse.testing import assert_bitwise_equal, bits, poison_

pytestmark = pytest.mark.interpreter


# ----------------------------------------------------------------------------- route_topk
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_topk_matches_loops(scoring, renormalize):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 12, generator=g).bfloat16()
    logits[3, 5] = logits[3, 7] = logits[3].float().max() + 1  # a tie for the top score
    w, ids = route_topk(logits, 4, scoring=scoring, renormalize=renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    for t in range(9):
        row = [float(v) for v in logits[t].float()]
        if scoring == "softmax":
            z = sum(torch.tensor(row).sub(max(row)).exp().tolist())
            scores = [float(torch.tensor(v - max(row)).exp()) / z for v in row]
        else:
            scores = [1 / (1 + float(torch.tensor(-v).exp())) for v in row]
        chosen = sorted(range(12), key=lambda e: (-scores[e], e))[:4]  # ties: lower id first
        assert ids[t].tolist() == chosen
        want = [scores[e] for e in chosen]
        if renormalize:
            want = [s / sum(want) for s in want]
        torch.testing.assert_close(w[t], torch.tensor(want), rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, 13)


# ----------------------------------------------------------------------------- sort_by_expert
def _plan_by_loops(ids, n_experts, pad_to):
    """Per expert, the expanded indices routed to it in ascending order, laid out one expert
    after another, each expert's block padded to a multiple of pad_to."""
    m, k = ids.shape
    per_expert = [[] for _ in range(n_experts)]
    for e_idx in range(m * k):
        e = int(ids.view(-1)[e_idx])
        if 0 <= e < n_experts:
            per_expert[e].append(e_idx)
    offsets, rows, exp_to_perm = [0], [], [-1] * (m * k)
    for e in range(n_experts):
        for j, e_idx in enumerate(per_expert[e]):
            exp_to_perm[e_idx] = offsets[-1] + j
        n = len(per_expert[e])
        padded = -(-n // pad_to) * pad_to
        rows += per_expert[e] + [-1] * (padded - n)
        offsets.append(offsets[-1] + padded)
    return exp_to_perm, rows, offsets


@pytest.mark.parametrize("pad_to", [1, 4])
def test_sort_by_expert_matches_loops(pad_to):
    g = torch.Generator().manual_seed(1)
    m, k, n_experts = 13, 3, 6
    ids = torch.randint(0, n_experts, (m, k), generator=g, dtype=torch.int32)
    ids[2, 1] = -1  # not routed here (expert parallelism)
    ids[5, 0] = n_experts + 2
    plan = sort_by_expert(ids, n_experts, pad_to=pad_to)
    exp_to_perm, rows, offsets = _plan_by_loops(ids, n_experts, pad_to)
    assert plan.expanded_idx_to_permuted_idx.dtype == torch.int32
    assert plan.expanded_idx_to_permuted_idx.view(-1).tolist() == exp_to_perm
    assert plan.expert_offsets.tolist() == offsets
    assert plan.num_rows == (m * k if pad_to == 1 else m * k + n_experts * (pad_to - 1))
    got_rows = plan.permuted_idx_to_expanded_idx.tolist()
    assert got_rows[: len(rows)] == rows and set(got_rows[len(rows) :]) <= {-1}


def test_sort_by_expert_rejects_bad_arguments():
    ids = torch.zeros(2, 2, dtype=torch.int32)
    for kwargs, name in (({"pad_to": 0}, "pad_to"), ({"pad_to": 2.0}, "pad_to")):
        with pytest.raises(ValueError, match=name):
            sort_by_expert(ids, 4, **kwargs)
    with pytest.raises(ValueError, match="num_experts"):
        sort_by_expert(ids, 0)
    with pytest.raises(ValueError, match="topk_ids"):
        sort_by_expert(ids.float(), 4)


# ----------------------------------------------------------------------------- permute
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("width", [7, 48])
def test_permute_kernel_matches_loops(dtype, width):
    g = torch.Generator().manual_seed(2)
    m, k = 5, 2
    x = torch.randn(m, width, generator=g).to(dtype)
    ids = torch.randint(0, 3, (m, k), generator=g, dtype=torch.int32)
    ids[1, 1] = -1
    plan = sort_by_expert(ids, 3, pad_to=4)
    out = poison_(torch.empty(plan.num_rows, width, dtype=dtype))
    assert (
        moefuse.moe_permute(x, plan.permuted_idx_to_expanded_idx, k, out=out, impl="triton") is out
    )
    for p, e in enumerate(plan.permuted_idx_to_expanded_idx.tolist()):
        want = x[e // k] if e >= 0 else torch.zeros(width, dtype=dtype)
        assert torch.equal(bits(out[p]), bits(want)), f"row {p}"
    assert_bitwise_equal(out, ref.moe_permute_reference(x, plan.permuted_idx_to_expanded_idx, k))
    with pytest.raises(ValueError, match="top_k"):
        moefuse.moe_permute(x, plan.permuted_idx_to_expanded_idx, 0)


# ----------------------------------------------------------------------------- chains
def test_permute_then_finalize_is_a_weighted_sum_of_token_rows():
    """With identity experts, finalize(permute(x)) = bf16(sum_k w_k * x_t) in ascending k."""
    g = torch.Generator().manual_seed(3)
    m, k, h, n_experts = 6, 3, 40, 4
    x = torch.randn(m, h, generator=g).bfloat16()
    w, ids = route_topk(torch.randn(m, n_experts, generator=g), k)
    plan = sort_by_expert(ids, n_experts, pad_to=2)
    xp = moefuse.moe_permute(x, plan.permuted_idx_to_expanded_idx, k, impl="triton")
    got = moefuse.moe_finalize(xp, plan.expanded_idx_to_permuted_idx, w, impl="triton")
    want = torch.empty(m, h)
    for t in range(m):
        acc = torch.zeros(h)
        for s in range(k):
            acc = ref.fma_ftz_f32(x[t].float(), w[t, s], acc)
        want[t] = acc
    assert_bitwise_equal(got, want.bfloat16(), "identity experts")


def _scatter_close(got, plan, y, w, rsf=1.0):
    """Scatter-add output vs an FP64 sum of the FP32 products: within one output ulp plus the
    FP32 reassociation error bound (K * 2^-23 * sum of |terms|)."""
    m, k = w.shape
    exact = torch.zeros(m, y.shape[1], dtype=torch.float64)
    mags = torch.zeros_like(exact)
    for p, e in enumerate(plan.permuted_idx_to_expanded_idx.tolist()):
        if e >= 0:
            term = (y[p].float() * w[e // k, e % k]).double()
            exact[e // k] += term
            mags[e // k] += term.abs()
    exact, mags = exact * rsf, mags * abs(rsf)
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(2.0**-126))) - 7)
    err = (got.double() - exact).abs()
    assert bool((err <= ulp + k * 2.0**-23 * mags + 2.0**-133).all()), float(err.max())


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_scatter_add_finalize(impl):
    g = torch.Generator().manual_seed(4)
    m, k, h, n_experts = 7, 4, 48, 5
    w, ids = route_topk(torch.randn(m, n_experts, generator=g), k)
    plan = sort_by_expert(ids, n_experts, pad_to=4)
    y = torch.randn(plan.num_rows, h, generator=g).bfloat16()
    y[plan.permuted_idx_to_expanded_idx < 0] = float("nan")  # padding rows are never read
    out = poison_(torch.empty(m, h, dtype=torch.bfloat16))
    moefuse.moe_finalize_scatter_add(
        y, plan.permuted_idx_to_expanded_idx, w, out=out, routed_scaling_factor=0.5, impl=impl
    )
    _scatter_close(out, plan, y, w, rsf=0.5)
    with pytest.raises(ValueError, match="permuted_idx_to_expanded_idx"):
        moefuse.moe_finalize_scatter_add(y, plan.permuted_idx_to_expanded_idx[:-1], w)


# ----------------------------------------------------------------------------- layer
def _dense_moe(x, weights, top_k):
    """Token by token: route, run each chosen expert as plain matmuls, weighted sum in FP64."""
    out = torch.empty(x.shape, dtype=torch.float64)
    w, ids = route_topk(torch.nn.functional.linear(x, weights.router), top_k)
    inter = weights.w13.shape[1] // 2
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for s in range(top_k):
            e = int(ids[t, s])
            h = weights.w13[e].double() @ x[t].double()
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            acc += float(w[t, s]) * (weights.w2[e].double() @ a)
        out[t] = acc
    return out


@pytest.mark.parametrize("use_fused_finalize", [False, True])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_moe_layer_is_correct_in_both_finalize_modes(use_fused_finalize, impl):
    g = torch.Generator().manual_seed(5)
    m, h, inter, n_experts, k = 9, 32, 16, 6, 2
    weights = moefuse.MoEWeights.random(n_experts, h, inter, generator=g)
    x = torch.randn(m, h, generator=g).bfloat16()
    got = moefuse.moe_layer(
        x, weights, k, use_fused_finalize=use_fused_finalize, pad_to=4, impl=impl
    )
    want = _dense_moe(x, weights, k)
    # BF16 GEMM inputs/outputs round at every stage: compare at BF16-level accuracy
    torch.testing.assert_close(got.double(), want, rtol=5e-2, atol=5e-2)


def test_moe_layer_flag_reaches_the_finalize(monkeypatch):
    """use_fused_finalize is not silently ignored: each value calls its own finalize op."""
    calls = []
    real_det, real_sc = moe_layer_mod.moe_finalize, moe_layer_mod.moe_finalize_scatter_add

    def spy(name, fn):
        def wrapper(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(moe_layer_mod, "moe_finalize", spy("deterministic", real_det))
    monkeypatch.setattr(moe_layer_mod, "moe_finalize_scatter_add", spy("scatter_add", real_sc))
    g = torch.Generator().manual_seed(6)
    weights = moefuse.MoEWeights.random(4, 16, 8, generator=g)
    x = torch.randn(3, 16, generator=g).bfloat16()
    moefuse.moe_layer(x, weights, 2, use_fused_finalize=False)
    moefuse.moe_layer(x, weights, 2, use_fused_finalize=True)
    assert calls == ["deterministic", "scatter_add"]
    with pytest.raises(ValueError, match="use_fused_finalize"):
        moefuse.moe_layer(x, weights, 2, use_fused_finalize="yes")


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_finalize_modes_differ_where_ftz_applies(impl):
    """A product in the FP32 subnormal range is flushed by the deterministic finalize (FTZ) but
    kept by the scatter-add: the two modes are observably different code paths."""
    inter = moefuse.moe.layer.MoEIntermediates
    plan = sort_by_expert(torch.tensor([[0]], dtype=torch.int32), 1)
    y = torch.tensor([[2.0**-100, 1.0]], dtype=torch.bfloat16)
    w = torch.tensor([[2.0**-30]])
    state = inter(w, torch.tensor([[0]], dtype=torch.int32), plan, y, y)
    det = moe_layer_mod.finalize(state, use_fused_finalize=False, impl=impl)
    sc = moe_layer_mod.finalize(state, use_fused_finalize=True, impl=impl)
    assert float(det[0, 0]) == 0.0 and float(sc[0, 0]) == 2.0**-130
    assert float(det[0, 1]) == float(sc[0, 1]) == 2.0**-30


def test_grouped_mm_matches_per_expert():
    g = torch.Generator().manual_seed(7)
    a = torch.randn(20, 16, generator=g).bfloat16()
    w = torch.randn(3, 8, 16, generator=g).bfloat16()
    offsets = torch.tensor([0, 6, 6, 17], dtype=torch.int32)
    got = moe_layer_mod.grouped_mm(a, w, offsets)
    want = moe_layer_mod._grouped_mm_per_expert(a, w, offsets)
    torch.testing.assert_close(got[:17].float(), want[:17].float(), rtol=1e-2, atol=1e-2)


# ----------------------------------------------------------------------------- benchmark
def test_benchmark_runs_end_to_end_on_cpu(tmp_path, monkeypatch):
    """The benchmark's code paths (correctness check, every variant, bars, JSON + PNG) on tiny
    CPU shapes with a stand-in timer: the GPU run cannot fail on a typo."""
    import json

    from moefuse.bench import harness
    from moefuse.bench import moe as bench

    def fake_time(fn, calls=20, replays=15, warmup=3):
        for i in range(2):
            fn(i)
        return 10.0 + calls

    monkeypatch.setattr(harness, "graph_time_us", fake_time)
    monkeypatch.setattr(harness, "copy_ceiling_tbs", lambda *a, **k: 4.0)
    monkeypatch.setattr(bench, "NUM_EXPERTS", 4)
    args = bench.parse_args(
        [
            "--save",
            "--out",
            str(tmp_path),
            "--tokens",
            "1",
            "3",
            "--hidden",
            "48",
            "--top-k",
            "2",
            "--no-compile",
            "--tune",
            "--layer-intermediate",
            "16",
        ]
    )
    assert bench.run(args, torch.device("cpu")) == 0
    (json_path,) = tmp_path.glob("moe-*.json")
    data = json.loads(json_path.read_text())
    variants = {(r["op"], r["variant"]) for r in data["rows"]}
    assert {
        ("finalize", "moefuse"),
        ("finalize", "scatter-add"),
        ("finalize", "torch eager"),
        ("permute->finalize", "PDL on"),
        ("layer", "scatter-add finalize"),
        ("finalize tile", "256x1w"),
    } <= variants
    assert all(r["us"] is not None for r in data["rows"]), "a variant failed to run"
    assert data["meta"]["correctness"] == "ok" and data["meta"]["bars"]
    assert list(tmp_path.glob("moe-*.png"))
