"""Every public op with launch plans records one in Triton's interpreter, and a replay on fresh
data gives the custom-op path's bits: the single-GPU ops in this process, the communication ops
on two loopback ranks (threads, CPU workspaces). The calls are moefuse.bench.op_calls', the
same set ``moefuse bench overhead`` times, so an op added without a call there fails here."""

import sys

import pytest
import torch
import torch.distributed as dist
import triton
import triton.language as tl

import moefuse
from moefuse import _fastpath as fp
from moefuse.bench import op_calls
from moefuse.testing_ranks import run_loopback_ranks

pytestmark = pytest.mark.interpreter
H = 64
RECORD_SEED, SEEDS = 11, (12,)  # the plan is recorded on other data than it replays
#: ops that stay on the slow path, and why (a plan replays pure launch work only)
NO_PLAN = {
    "moe_finalize_scatter_add": "ran aten.zeros.default",  # zero-fills its output, then adds
}


def _flat(r):
    if r is None:
        return []
    return [r] if isinstance(r, torch.Tensor) else [t for x in r for t in _flat(x)]


def _bits(r) -> list[torch.Tensor]:
    return [
        t.detach().clone().view(torch.uint8) if t.dtype.itemsize == 1 else t.detach().clone()
        for t in _flat(r)
    ]


def _slow(fn):
    fp.ENABLED[0] = False
    try:
        return _bits(fn())
    finally:
        fp.ENABLED[0] = True


def _replayed(public, fn):
    """``fn()``'s bits, and whether the call stayed out of the op's own Python function (so it
    replayed a plan)."""
    body = public.__wrapped__.__code__
    entered = []

    def watch(frame, event, arg):
        if event == "call" and frame.f_code is body:
            entered.append(1)

    sys.setprofile(watch)
    try:
        out = _bits(fn())
    finally:
        sys.setprofile(None)
    return out, not entered


def _check_op(name, fn, refresh, settle=lambda: None) -> str | None:
    """Record a plan, then for each seed: the custom-op path's bits vs a replay's on the same
    fresh inputs. None, or what went wrong. ``settle()`` runs before every call: a barrier of the
    ranks, so that no rank still does host work while a peer's kernel already waits for it."""
    public = getattr(moefuse, name)
    refresh(RECORD_SEED)
    settle()
    fn()  # records
    if name in NO_PLAN:
        refused = fp.refusals(public)
        return (
            None
            if refused and all(NO_PLAN[name] in r for r in refused)
            else f"{name}: expected the refusal {NO_PLAN[name]!r}, got {refused}"
        )
    if fp.refusals(public):
        return f"{name}: refused: {fp.refusals(public)}"
    for seed in SEEDS:
        refresh(seed)
        settle()
        want = _slow(fn)
        refresh(seed)
        settle()
        got, replayed = _replayed(public, fn)
        if not replayed:
            return f"{name}: the call after recording ran the op's Python function (no replay)"
        if len(got) != len(want) or not all(torch.equal(a, b) for a, b in zip(got, want)):
            return f"{name}: replayed bits differ from the custom-op path's (seed {seed})"
    return None


def test_every_public_op_with_plans_has_a_call():
    planned = {n for n in moefuse.__all__ if hasattr(getattr(moefuse, n), "_moefuse_plans")}
    single, _ = op_calls.single_gpu_calls(torch.device("cpu"), h=H, impl="triton")
    comm = set(op_calls.COMM_OPS)
    missing = planned - {name for name, _, _ in single} - comm
    assert not missing, f"no call in moefuse.bench.op_calls for {sorted(missing)}"


def test_single_gpu_ops_replay_plans_with_custom_op_bits():
    fp.clear()
    calls, refresh = op_calls.single_gpu_calls(torch.device("cpu"), m=3, h=H, impl="triton")
    done = set()
    errors = []
    for name, _label, fn in calls:
        if name in done:  # (the variants of an op share its plan cache: the first one checks)
            continue
        done.add(name)
        errors.append(_check_op(name, fn, refresh))
    assert not [e for e in errors if e], errors


def _comm_scenario(rank, world_size, h, dev="cpu"):
    """Every communication op on this rank: recorded, then replayed (:func:`_check_op`); also
    run on CUDA by tests/test_fastpath_gpu.py."""
    calls, refresh, close = op_calls.comm_calls(
        torch.device(dev), None, m=2, h=h, impl="triton", timeout_s=30
    )
    try:
        checks = [_check_op(name, fn, refresh, settle=dist.barrier) for name, fn in calls]
        return checks, [n for n, _ in calls]
    finally:
        close()


def test_comm_ops_replay_plans_with_custom_op_bits():
    fp.clear()
    results = run_loopback_ranks(_comm_scenario, 2, "cpu", H, timeout_s=240)
    for rank, (errors, names) in enumerate(results):
        assert sorted(names) == sorted(op_calls.COMM_OPS)
        assert not [e for e in errors if e], f"rank {rank}: {errors}"


# ----------------------------------------------------------------------------- tuple arguments
@triton.jit
def _tuple_args_kernel(ptrs, dims, scal, BLOCK: tl.constexpr):
    """out[i] = alpha * x[i] + y[i] (+ shift) for i < n, pointers and sizes given as tuples."""
    x_ptr, y_ptr, out_ptr = ptrs
    n, unused = dims
    alpha, shift = scal
    i = tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(x_ptr + i, mask=mask)
    y = tl.load(y_ptr + i, mask=mask)
    tl.store(out_ptr + i, alpha * x + y + shift, mask=mask)


@fp.fast_op
def _tuple_op(x: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """``2 * x + pair[1]`` by a kernel taking its three pointers as one tuple; ``pair[1]`` is a
    view at an offset inside an argument (the plan keeps it as source + byte offset)."""
    out = torch.empty_like(x)
    fp.launch(_tuple_args_kernel, (1,), (x, pair[1], out), (x.numel(), 7), (2.0, 0.5), BLOCK=64)
    return out


def test_tuple_of_tensors_replays_on_fresh_tensors():
    """A kernel whose tensors come in a tuple argument records a plan, and the replay reads and
    writes the fresh call's tensors (not the recorded ones)."""
    fp.clear()
    gen = torch.Generator().manual_seed(5)
    x0, p0 = torch.randn(48, generator=gen), torch.randn(2, 48, generator=gen)
    _tuple_op(x0, p0)  # records
    assert fp.refusals(_tuple_op) == [] and fp.plan_count(_tuple_op) == 1
    x1, p1 = torch.randn(48, generator=gen), torch.randn(2, 48, generator=gen)
    x0_bits, p0_bits = x0.clone(), p0.clone()
    body = _tuple_op.__wrapped__.__code__
    entered = []
    sys.setprofile(
        lambda frame, event, arg: (
            entered.append(1) if event == "call" and frame.f_code is body else None
        )
    )
    try:
        got = _tuple_op(x1, p1)
    finally:
        sys.setprofile(None)
    assert not entered, "the second call ran the op's Python function (no replay)"
    assert torch.equal(got, 2.0 * x1 + p1[1] + 0.5)
    assert torch.equal(x0, x0_bits) and torch.equal(p0, p0_bits)  # the recorded ones untouched
