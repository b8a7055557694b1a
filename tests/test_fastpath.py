"""Launch plans (moefuse._fastpath) and direct custom-op calls, in Triton's interpreter: a replayed
call gives the custom-op path's bits, a second call with the same signature builds nothing, and
validation errors are unchanged."""

import pytest
import torch

import moefuse
from moefuse import _fastpath as fp
from moefuse.norm import rms as norm_rms

pytestmark = pytest.mark.interpreter
H = 40


def _rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def _slow(fn):
    fp.ENABLED[0] = False
    try:
        return fn()
    finally:
        fp.ENABLED[0] = True


CASES = {
    "rmsnorm": lambda x, r, w, f: moefuse.rmsnorm(x, w, impl="triton"),
    "rmsnorm_out_inplace": lambda x, r, w, f: moefuse.rmsnorm(x, w, out=x, impl="triton"),
    "fused_add_rmsnorm": lambda x, r, w, f: (moefuse.fused_add_rmsnorm(x, r, w, impl="triton"),
                                             x, r)[1:],
    "gated_residual_next_rmsnorm": lambda x, r, w, f: moefuse.gated_residual_next_rmsnorm(
        x, f, w, torch.ones(H), torch.full((H,), 0.5), impl="triton"),
    "rmsnorm_quant": lambda x, r, w, f: moefuse.rmsnorm_quant(
        x, w, torch.tensor([0.05]), impl="triton").view(torch.uint8),
    "fp8_quantize": lambda x, r, w, f: moefuse.fp8_quantize(
        x, torch.tensor([0.05]), impl="triton").view(torch.uint8),
}  # fmt: skip


def _flat(r):
    return [r] if isinstance(r, torch.Tensor) else [t for x in r for t in _flat(x)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_replayed_plan_gives_the_custom_op_bits(name, seed):
    fn = CASES[name]
    public = {"rmsnorm_out_inplace": moefuse.rmsnorm}.get(name) or getattr(moefuse, name)
    for m in (3, 3, 1):  # record, replay on fresh data, another signature
        x, r, w, f = _rand(m, H), _rand(m, H), _rand(H), torch.randn(m, H)
        want = _flat(_slow(lambda: fn(x.clone(), r.clone(), w, f.clone())))
        got = _flat(fn(x.clone(), r.clone(), w, f.clone()))
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b), name
    assert fp.plan_count(public) == 2, fp.refusals(public)


def test_second_call_builds_no_launch_configuration(monkeypatch):
    calls = []
    real = norm_rms.launch_fused_add_rmsnorm

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(norm_rms, "launch_fused_add_rmsnorm", counting)
    x, r, w = _rand(2, H), _rand(2, H), _rand(H)
    moefuse.fused_add_rmsnorm(x, r, w, impl="triton")
    assert len(calls) == 1
    for _ in range(3):
        moefuse.fused_add_rmsnorm(x, r, w, impl="triton")
    assert len(calls) == 1  # replays: no launcher, no tile policy, no constexpr dict


def test_validation_errors_survive_plans():
    x, r, w = _rand(2, H), _rand(2, H), _rand(H)
    for _ in range(2):
        moefuse.fused_add_rmsnorm(x, r, w, impl="triton")
    before = x.clone()
    with pytest.raises(ValueError, match="'residual' must not alias 'input'"):
        moefuse.fused_add_rmsnorm(x, x, w, impl="triton")
    assert torch.equal(x, before)
    with pytest.raises(ValueError, match="argument 'weight'"):
        moefuse.fused_add_rmsnorm(x, r, w.float()[:-1], impl="triton")
    with pytest.raises(ValueError, match="partially overlaps"):
        buf = _rand(3, H)
        moefuse.rmsnorm(buf[:2], w, out=buf[1:], impl="triton")


def test_exact_alias_pattern_is_part_of_the_plan(seed):
    """A plan recorded in place (out is input) must not write into input when out differs."""
    w = _rand(H)
    x = _rand(2, H)
    moefuse.rmsnorm(x, w, out=x, impl="triton")  # records: out and input alias
    x2, out = _rand(2, H), torch.zeros(2, H, dtype=torch.bfloat16)
    keep = x2.clone()
    moefuse.rmsnorm(x2, w, out=out, impl="triton")
    assert torch.equal(x2, keep)
    assert torch.equal(out, _slow(lambda: moefuse.rmsnorm(keep, w, impl="triton")))


def test_a_plan_checks_each_alias_pair_once(seed):
    """Validation checks residual against weight twice (as a write against a read and as the
    in-place pair); the plan tests the pair once per replay, and still misses when they overlap."""
    h = 48  # NVFP4: a multiple of 16
    x, r, w = _rand(1, h), _rand(1, h), _rand(h)
    gs = torch.tensor([100.0])
    op = moefuse.fused_add_rmsnorm_fp4_quantize
    op(x, r, w, gs, impl="triton")
    ((plan,),) = op._moefuse_plans.values()
    checks = [line for line in plan.source.splitlines() if " < " in line]
    assert checks and len(checks) == len(set(checks)), plan.source
    buf = _rand(2 * h)  # residual and weight in one buffer, overlapping, recorded layouts
    with pytest.raises(ValueError, match="'residual' must not alias 'weight'"):
        op(x, buf[:h].view(1, h), buf[h // 2 : h // 2 + h], gs, impl="triton")


def test_reference_and_tensor_subclasses_stay_on_the_slow_path():
    x, w = _rand(2, H), _rand(H)
    moefuse.rmsnorm(x, w, impl="reference")
    assert fp.plan_count(moefuse.rmsnorm) == 0
    assert any("ran aten" in why for why in fp.refusals(moefuse.rmsnorm))
    p = torch.nn.Parameter(w.float().bfloat16(), requires_grad=False)
    for _ in range(2):
        moefuse.rmsnorm(x, p, impl="triton")  # Parameters are plain tensors for plans
    assert fp.plan_count(moefuse.rmsnorm) == 1


def test_direct_custom_op_is_still_a_custom_op():
    from moefuse.norm import ops

    assert isinstance(ops.rmsnorm_op, torch._library.custom_ops.CustomOpDef)
    x, w = _rand(2, H), _rand(H)
    out = torch.empty_like(x)
    torch.library.opcheck(ops.rmsnorm_op, (x, w, out, 1e-6, 0.0, False))


@pytest.mark.parametrize("guard", ["dynamo", "python"])
def test_layout_guard_misses_on_any_layout_change(guard, monkeypatch):
    """The plan's first line (the tensors' layout check: dynamo's C++ guard, or the exact Python
    comparison where that class is missing) passes only the recorded dtype, shape, strides and
    type; another weight dtype, a strided view or a Parameter records a new plan with the
    custom-op bits."""
    if guard == "python":
        import torch._C._dynamo.guards as guards

        monkeypatch.delattr(guards, "TensorGuards")
    fp.clear()
    x, w = _rand(3, H), _rand(H)
    check = fp._layout_check([x, w])
    assert (type(getattr(check, "__self__", None)).__name__ == "TensorGuards") == (
        guard == "dynamo"
    )
    assert check(x, w) and check(_rand(3, H), _rand(H))
    assert not check(x, w.float()) and not check(_rand(4, H), w) and not check(x, _rand(H, 2)[:, 0])
    moefuse.rmsnorm(x, w, impl="triton")
    variants = [
        (x, w.float()),  # weight dtype
        (_rand(3, 2 * H)[:, :H], w),  # row stride 2H, same shape
        (x, torch.nn.Parameter(w.clone(), requires_grad=False)),  # another tensor type
    ]
    for n, (xi, wi) in enumerate(variants, start=2):
        want = _slow(lambda: moefuse.rmsnorm(xi, wi, impl="triton"))  # reads xi only
        got = moefuse.rmsnorm(xi, wi, impl="triton")
        assert torch.equal(got, want), (guard, n)
        assert fp.plan_count(moefuse.rmsnorm) == n, (guard, n, fp.refusals(moefuse.rmsnorm))
    # keys: the first argument's shape (3, H) in all, the tensors' types (the Parameter) apart
    assert len(moefuse.rmsnorm._moefuse_plans) == 2


def test_first_call_error_carries_no_plan_cache_context():
    """An error raised by a signature's first call is the op's own: no KeyError of the plan
    cache chained before it."""
    fp.clear()
    x, w = _rand(2, H), _rand(H + 1)
    with pytest.raises(ValueError) as info:
        moefuse.rmsnorm(x, w, impl="triton")
    assert info.value.__context__ is None and info.value.__cause__ is None


def test_refused_signature_is_not_recorded_again():
    fp.clear()
    x, w = _rand(2, H), _rand(H)
    for _ in range(4):
        moefuse.rmsnorm(x, w, impl="reference")
    assert len(fp.refusals(moefuse.rmsnorm)) == 1


def test_forget_drops_only_the_plans_holding_an_object():
    fp.clear()
    x, w = _rand(2, H), _rand(H)
    moefuse.rmsnorm(x, w, impl="triton")
    marker = object()
    fp.forget(marker)
    assert fp.plan_count(moefuse.rmsnorm) == 1
    fp.forget(torch.Tensor)  # the tensors' type is part of every key of this signature
    assert fp.plan_count(moefuse.rmsnorm) == 0


def test_another_threads_recording_is_not_a_foreign_launch_hook():
    """A recording adds its launch counter to Triton's process-wide hook chain while it runs; a
    plan built meanwhile on another thread (ranks as threads, an engine's thread per GPU) must not
    take that counter for a profiler's hook and refuse. A profiler's hook still refuses."""
    from triton import knobs

    chain = knobs.runtime.launch_enter_hook
    assert not fp._hooked(chain)
    with fp._Recorder():  # what a slow call on another thread holds while it runs
        assert len(chain.calls) == 1
        assert not fp._hooked(chain)

        def profiler_hook(*args):
            pass

        chain.add(profiler_hook)
        try:
            assert fp._hooked(chain)
        finally:
            chain.remove(profiler_hook)
    assert not chain.calls


def test_keyword_options_are_part_of_the_signature(seed):
    """The parameters with defaults share one key part per kind (every one at its default, or
    the tuple of their parts): a changed option still records a plan of its own."""
    fp.clear()
    op = moefuse.rmsnorm_group_quant
    for kwargs in ({}, {"scale_ue8m0": True}, {}, {"scale_ue8m0": True}, {"group_size": 64}):
        x, w = _rand(3, H), _rand(H)
        want = _slow(lambda: op(x, w, impl="triton", **kwargs))
        got = op(x, w, impl="triton", **kwargs)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), kwargs
    assert fp.plan_count(op) == 3, fp.refusals(op)


def test_forget_finds_an_object_among_the_keyword_options():
    @fp.fast_op
    def probe(x, scale=1.0, *, handle=None, flag=False):
        return x

    marker = object()
    x = torch.zeros(2)
    probe(x)
    probe(x, handle=marker)
    probe(x, 2.0, handle=marker, flag=True)
    assert len(probe._moefuse_plans) == 3
    fp.forget(marker)
    assert len(probe._moefuse_plans) == 1
