"""GPU: launch plans (moefuse._fastpath) replay the same kernels with the same bits as the
custom-op path, for every single-GPU family, at odd widths and edge sizes, on fresh inputs."""

import pytest
import torch

import moefuse
from moefuse import _fastpath as fp

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _inputs(m, h, seed):
    g = torch.Generator(device=DEV).manual_seed(seed)
    bf = torch.bfloat16
    return dict(
        x=torch.randn(m, h, device=DEV, generator=g).to(bf),
        r=torch.randn(m, h, device=DEV, generator=g).to(bf),
        w=torch.randn(h, device=DEV, generator=g).to(bf),
        r32=torch.randn(m, h, device=DEV, generator=g),
        alpha=torch.rand(h, device=DEV, generator=g),
        beta=torch.rand(h, device=DEV, generator=g),
        scale=torch.tensor([0.04], device=DEV),
        gscale=torch.tensor([150.0], device=DEV),
    )


def _clone(d):
    return {k: v.clone() for k, v in d.items()}


CASES = {
    "rmsnorm": lambda d: moefuse.rmsnorm(d["x"], d["w"]),
    "rmsnorm_inplace": lambda d: moefuse.rmsnorm(d["x"], d["w"], out=d["x"]),
    "fused_add_rmsnorm": lambda d: (moefuse.fused_add_rmsnorm(d["x"], d["r"], d["w"]),
                                    d["x"], d["r"])[1:],
    "gemma_fused_add_rmsnorm": lambda d: (moefuse.gemma_fused_add_rmsnorm(d["x"], d["r"], d["w"]),
                                          d["x"], d["r"])[1:],
    "gated_residual_rmsnorm": lambda d: moefuse.gated_residual_rmsnorm(
        d["x"], d["r32"], d["w"], d["alpha"], d["beta"]),
    "gated_residual_next_rmsnorm": lambda d: moefuse.gated_residual_next_rmsnorm(
        d["x"], d["r32"], d["w"], d["alpha"], d["beta"]),
    "rmsnorm_quant": lambda d: moefuse.rmsnorm_quant(d["x"], d["w"], d["scale"]).view(torch.uint8),
    "fused_add_rmsnorm_quant": lambda d: (moefuse.fused_add_rmsnorm_quant(
        d["x"], d["r"], d["w"], d["scale"]).view(torch.uint8), d["r"]),
    "fp8_quantize": lambda d: moefuse.fp8_quantize(d["x"], d["scale"]).view(torch.uint8),
    "fp4_quantize": lambda d: moefuse.fp4_quantize(d["x"], d["gscale"]),
    "rmsnorm_fp4_quantize": lambda d: moefuse.rmsnorm_fp4_quantize(d["x"], d["w"], d["gscale"]),
}  # fmt: skip


def _flat(r):
    if isinstance(r, torch.Tensor):
        return [r]
    return [t for x in r for t in _flat(x)]


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("m,h", [(1, 4096), (7, 2880), (300, 7168), (5, 1040)])
def test_plans_replay_the_custom_op_bits(name, m, h):
    fn = CASES[name]
    fp.clear()
    for seed in range(3):  # record, then replay twice on fresh inputs
        d = _inputs(m, h, seed)
        fp.ENABLED[0] = False
        try:
            want = _flat(fn(_clone(d)))
        finally:
            fp.ENABLED[0] = True
        got = _flat(fn(_clone(d)))
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (name, m, h, seed)
    torch.cuda.synchronize()
    op = getattr(moefuse, name.removesuffix("_inplace"))
    assert fp.plan_count(op) >= 1, (name, fp.refusals(op))  # the replays above were plans


def test_second_call_replays_a_plan():
    fp.clear()
    d = _inputs(4, 4096, 0)
    moefuse.fused_add_rmsnorm(d["x"], d["r"], d["w"])
    assert fp.plan_count(moefuse.fused_add_rmsnorm) == 1
    moefuse.fused_add_rmsnorm(d["x"], d["r"], d["w"])
    assert fp.plan_count(moefuse.fused_add_rmsnorm) == 1


def test_misaligned_view_takes_the_slow_path_with_the_same_bits():
    fp.clear()
    big = torch.randn(3, 4097, device=DEV).bfloat16()
    w = torch.randn(4096, device=DEV).bfloat16()
    aligned = big[:, :4096].contiguous()
    want = moefuse.rmsnorm(aligned, w)
    for _ in range(3):
        got = moefuse.rmsnorm(big[:, 1:].contiguous(), w)  # fresh allocation: aligned
        view = moefuse.rmsnorm(big[:, 1:], w)  # row start 2 bytes off: not 16-byte aligned
        torch.cuda.synchronize()
    assert torch.equal(moefuse.rmsnorm(big[:, 1:].contiguous(), w), got)
    assert torch.equal(view, got)
    assert want.shape == got.shape


def test_aliasing_errors_survive_plans():
    fp.clear()
    d = _inputs(4, 4096, 0)
    moefuse.fused_add_rmsnorm(d["x"], d["r"], d["w"])
    moefuse.fused_add_rmsnorm(d["x"], d["r"], d["w"])
    with pytest.raises(ValueError, match="residual"):
        moefuse.fused_add_rmsnorm(d["x"], d["x"], d["w"])


def test_graph_capture_of_a_replayed_plan():
    fp.clear()
    d = _inputs(16, 4096, 0)
    out = torch.empty_like(d["x"])
    moefuse.rmsnorm(d["x"], d["w"], out=out)  # records
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moefuse.rmsnorm(d["x"], d["w"], out=out)  # replays on a side stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        moefuse.rmsnorm(d["x"], d["w"], out=out)
    for seed in range(1, 4):
        d2 = _inputs(16, 4096, seed)
        d["x"].copy_(d2["x"])
        g.replay()
        torch.cuda.synchronize()
        fp.ENABLED[0] = False
        try:
            want = moefuse.rmsnorm(d2["x"], d["w"])
        finally:
            fp.ENABLED[0] = True
        assert torch.equal(out, want)


def test_comm_ops_replay_plans_on_two_loopback_ranks():
    """The communication ops' plans on CUDA, whose kernels take tuples of pointers (handed to
    Triton's C launcher as tuples of addresses): two loopback ranks on this GPU, each op
    recorded, then replayed on fresh inputs with the custom-op path's bits, no refusal."""
    from moefuse.bench import op_calls
    from moefuse.testing_ranks import run_loopback_ranks
    from test_fastpath_plans import H, _comm_scenario

    fp.clear()
    results = run_loopback_ranks(_comm_scenario, 2, DEV, H, DEV, timeout_s=240)
    for rank, (errors, names) in enumerate(results):
        assert sorted(names) == sorted(op_calls.COMM_OPS)
        assert not [e for e in errors if e], f"rank {rank}: {errors}"
