"""One fault scenario for every communication (family, algorithm, kernel variant), shared by the
CPU tests (threads and processes: tests/test_comm_fault_protocol.py) and the one-GPU loopback
test (tests/test_comm_faults_gpu.py).

A case is ``(name, env, make, call)``: ``env`` the MOEFUSE_* variables that pick the kernel
variant (set around the run), ``make(rank, p, device, timeout_s)`` a fresh workspace and
``call(ws, rank, p, device, bad=False)`` one call of the op, returning the output tensors it was
given, poisoned (NaN) before the call; ``bad=True`` makes the call fail its validation
(ValueError before anything is launched or written).

:func:`scenario_fault_protocol` is the protocol in one run, on every rank of a 2-rank group:

1. peer failing validation + lone rank: rank 0's call raises ValueError (workspace untouched:
   ``ws.failed()`` is None); rank 1's call waits alone and raises after ``timeout_s`` naming
   rank 0 ("never arrived");
2. late rank: rank 0 then makes a valid call, after rank 1 gave up: it raises at once naming
   rank 1 ("gave up"), writes no output (CPU: the outputs stay poisoned) and
   ``ws.failed()`` says so on both ranks; every later call raises at once;
3. recovery: close() + re-create, a call on both ranks works.

On CUDA a call returns before its kernel ran: the scenario synchronizes the stream after each
call and asks ``ws.raise_if_failed()`` (what a serving loop does once per step).
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

BF16 = torch.bfloat16
H, M = 48, 2


def _sync_raise(ws) -> None:
    if ws.device.type == "cuda":
        torch.cuda.current_stream(ws.device).synchronize()
    ws.raise_if_failed()


def _poisoned(*shape_like):
    from moefuse.testing import poison_

    return [poison_(torch.empty_like(t)) for t in shape_like]


# ----------------------------------------------------------------------------- families
def _ar_make(rank, p, device, timeout_s):
    import moefuse

    return moefuse.AllReduceWorkspace(None, 8, H, BF16, device, timeout_s=timeout_s)


def _ar_call(algo):
    def call(ws, rank, p, device, bad=False):
        import moefuse

        g = torch.Generator().manual_seed(7 + rank)
        x = torch.randn(M, H, generator=g).to(BF16).to(device)
        res = torch.randn(M, H, generator=g).to(BF16).to(device)
        w = torch.ones(H + bad, dtype=BF16, device=device)  # bad: a weight of the wrong width
        ro, no = _poisoned(x, x)
        moefuse.allreduce_residual_rmsnorm(
            x, res, w, workspace=ws, algorithm=algo, impl="triton", residual_out=ro, norm_out=no
        )
        return [ro, no]

    return call


def _ag_make(rank, p, device, timeout_s):
    import moefuse

    return moefuse.AllReduceWorkspace(
        None, 8, H, BF16, device, timeout_s=timeout_s, extra_regions=moefuse.allgather_regions(8, H)
    )


def _ag_call(ws, rank, p, device, bad=False):
    import moefuse

    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(M, H // p, generator=g).to(BF16).to(device)
    w = torch.ones(H + bad, dtype=BF16, device=device)  # bad: a weight of the wrong width
    (out,) = _poisoned(torch.empty(M, H, dtype=BF16, device=device))
    moefuse.all_gather_rmsnorm(x, w, workspace=ws, algorithm="oneshot", impl="triton", out=out)
    return [out]


def _moe_call(algo):
    def call(ws, rank, p, device, bad=False):
        import moefuse
        from test_comm_moe_reduction import finalize_case

        ins, perm, wts, shs, res, w, *_ = finalize_case(21, p, M, H, 2)
        to = lambda t: t.to(device) if t is not None else None  # noqa: E731
        w = w[:-1] if bad else w
        ro, no = _poisoned(res, res)
        moefuse.moe_finalize_allreduce_residual_rmsnorm(
            to(ins[rank]),
            to(res),
            to(w),
            to(perm),
            workspace=ws,
            expert_scale_factor=to(wts[rank]),
            shared_expert_output=to(shs[rank]),
            algorithm=algo,
            impl="triton",
            residual_out=to(ro),
            norm_out=to(no),
        )
        return [ro, no]

    return call


def _tp_make(rank, p, device, timeout_s):
    import moefuse

    return moefuse.ExpertNormWorkspace(None, H, 2, device, timeout_s=timeout_s)


def _tp_call(algo):
    def call(ws, rank, p, device, bad=False):
        import moefuse
        from test_comm_expert_norm import make_tp_case

        partials, weights, idx, nw = make_tp_case(31, p, M, H, 2)
        nw = nw[:-1] if bad else nw
        (out,) = _poisoned(torch.empty(M, H, dtype=BF16))
        out = out.to(device)
        moefuse.tp_moe_finalize_rmsnorm(
            partials[rank].to(device),
            weights.to(device),
            idx.to(device),
            nw.to(device),
            out,
            eps=1e-6,
            gain_center=0.0,
            weight_before_norm=False,
            workspace=ws,
            algorithm=algo,
            impl="triton",
        )
        return [out]

    return call


def _ep_call(algo):
    def call(ws, rank, p, device, bad=False):
        import moefuse
        from test_comm_expert_norm import make_ep_case

        rows, weights, idxs, nw = make_ep_case(41, p, M, H, 2)
        nw = nw[:-1] if bad else nw
        (out,) = _poisoned(torch.empty(M, H, dtype=BF16))
        out = out.to(device)
        moefuse.moe_finalize_rmsnorm_allreduce(
            rows[rank].to(device),
            weights.to(device),
            idxs[rank].to(device),
            nw.to(device),
            out,
            workspace=ws,
            eps=1e-6,
            algorithm=algo,
            impl="triton",
        )
        return [out]

    return call


_AG_DECODE = {"MOEFUSE_ALLGATHER_ONE_LAUNCH": "1"}
_AG_PERSISTENT = {"MOEFUSE_ALLGATHER_ONE_LAUNCH": "0", "MOEFUSE_ALLGATHER_LARGE": "fused",
                  "MOEFUSE_ALLGATHER_FUSED_GRID": "2"}  # fmt: skip
_AG_CHUNKED = {"MOEFUSE_ALLGATHER_ONE_LAUNCH": "0", "MOEFUSE_ALLGATHER_LARGE": "chunked"}

#: every (family, algorithm, kernel variant) whose kernels wait on peers
CASES = {
    "all_reduce/oneshot": ({}, _ar_make, _ar_call("oneshot")),
    "all_reduce/oneshot-prefetch": ({"MOEFUSE_COMM_ONESHOT_PREFETCH": "1"}, _ar_make,
                                    _ar_call("oneshot")),
    "all_reduce/twoshot": ({}, _ar_make, _ar_call("twoshot")),
    "all_gather/oneshot-decode": (_AG_DECODE, _ag_make, _ag_call),
    "all_gather/oneshot-persistent": (_AG_PERSISTENT, _ag_make, _ag_call),
    "all_gather/oneshot-chunked": (_AG_CHUNKED, _ag_make, _ag_call),
    "moe_reduction/oneshot-fused": ({"MOEFUSE_MOE_COMM_VARIANT": "fused"}, _ar_make,
                                    _moe_call("oneshot")),
    "moe_reduction/oneshot-split": ({"MOEFUSE_MOE_COMM_VARIANT": "split"}, _ar_make,
                                    _moe_call("oneshot")),
    "moe_reduction/twoshot": ({}, _ar_make, _moe_call("twoshot")),
    "expert_norm/tp-slot_oneshot": ({}, _tp_make, _tp_call("slot_oneshot")),
    "expert_norm/tp-expert_owner": ({}, _tp_make, _tp_call("expert_owner")),
    "expert_norm/tp-token_owner": ({}, _tp_make, _tp_call("token_owner")),
    "expert_norm/tp-staged": ({}, _tp_make, _tp_call("staged")),
    "expert_norm/ep-oneshot": ({}, _ar_make, _ep_call("oneshot")),
    "expert_norm/ep-twoshot": ({}, _ar_make, _ep_call("twoshot")),
}  # fmt: skip
#: outputs that a failing call may write on CPU: the two-launch all-gather runs the norm on its
#: local gathered buffer (stale, never the peer's abandoned rows) before the status is read
WRITES_ON_FAILURE = {"all_gather/oneshot-chunked"}


@contextlib.contextmanager
def case_env(name):
    """The case's MOEFUSE_* variables, set for the run (the same for every rank), launch plans
    dropped on entry and exit (they record the knobs)."""
    from moefuse import _fastpath

    env = CASES[name][0]
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _fastpath.clear()
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _fastpath.clear()


def _raises(fn, ws, match):
    """(seconds, message) of ``fn()`` + sync + ``ws.raise_if_failed()``, which must raise a
    RuntimeError whose message matches the regex ``match``."""
    import re

    t0 = time.monotonic()
    try:
        fn()
        _sync_raise(ws)
    except RuntimeError as exc:
        msg = str(exc)
        assert re.search(match, msg), f"expected /{match}/, got: {msg}"
        return time.monotonic() - t0, msg
    raise AssertionError(f"no RuntimeError (expected /{match}/)")


def _warm_then_fresh(rank, p, name, device, timeout_s):
    """One healthy call of case ``name`` on a workspace with a generous bound (the interpreter's,
    or Triton's, first run of a kernel must not count against the short one), closed; then a
    fresh workspace on ``timeout_s`` and a barrier. No call on the short bound before the fault:
    a healthy call of two interpreted ranks (threads sharing the GIL) can take longer than it on
    a loaded machine. Returns ``(device, workspace, call)``."""
    import torch.distributed as dist

    _, make, call = CASES[name]
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    warm = make(rank, p, device, 120.0)
    call(warm, rank, p, device)
    _sync_raise(warm)
    warm.close()
    ws = make(rank, p, device, timeout_s)
    dist.barrier()
    return device, ws, call


def scenario_fault_protocol(rank, p, name, device, timeout_s):
    """See the module docstring. Returns {"alone": s, "late": s}: seconds of rank 1's lone call
    and of rank 0's late call."""
    import torch.distributed as dist

    device, ws, call = _warm_then_fresh(rank, p, name, device, timeout_s)
    make = CASES[name][1]
    took = {}
    if rank == 0:
        # 1. this rank's input fails validation: nothing launched, the workspace untouched
        try:
            call(ws, rank, p, device, bad=True)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{name}: the bad call did not raise ValueError")
        assert ws.failed() is None, ws.failed()
        dist.barrier()  # rank 1 has given up
        # 2. late: raises at once naming the rank that gave up, reads and writes nothing
        outs = []
        took["late"], msg = _raises(
            lambda: outs.extend(call(ws, rank, p, device)),
            ws,
            r"rank\(s\) 1 \(global rank 1\) gave up",
        )
        assert took["late"] < timeout_s, f"{name}: the late rank waited {took['late']:.2f} s"
        assert "never arrived" not in msg, msg
        if device.type == "cpu" and name not in WRITES_ON_FAILURE:
            for t in outs:
                assert bool(t.isnan().all()), f"{name}: the late rank wrote an output"
    else:
        # 1. the peer never comes to this call: bounded, names it
        took["alone"], msg = _raises(
            lambda: call(ws, rank, p, device), ws, r"rank\(s\) 0 \(global rank 0\) never arrived"
        )
        assert took["alone"] >= timeout_s * 0.9, f"{name}: gave up after {took['alone']:.2f} s"
        dist.barrier()
    assert ws.failed() is not None, f"{name}: ws.failed() is None on rank {rank}"
    t0 = time.monotonic()
    _raises(lambda: call(ws, rank, p, device), ws, "never arrived|gave up")
    assert time.monotonic() - t0 < timeout_s, f"{name}: a failed workspace waited again"
    dist.barrier()
    ws.close()
    # 3. recovery in the same processes / threads
    ws = make(rank, p, device, 120.0)
    dist.barrier()
    call(ws, rank, p, device)
    _sync_raise(ws)
    dist.barrier()
    ws.close()
    return took


def scenario_idle_rank_learns_by_check(rank, p, name, device, timeout_s):
    """Rank 1 calls alone and gives up; rank 0 never calls: its ``ws.check()`` (a sync) reads the
    notice and raises naming rank 1, after which ``ws.failed()`` reports it without a sync."""
    import torch.distributed as dist

    device, ws, call = _warm_then_fresh(rank, p, name, device, timeout_s)
    if rank == 1:
        _raises(lambda: call(ws, rank, p, device), ws, r"rank\(s\) 0 .* never arrived")
        dist.barrier()
    else:
        assert ws.failed() is None
        dist.barrier()
        _raises(ws.check, ws, r"rank\(s\) 1 \(global rank 1\) gave up")
        assert "gave up" in (ws.failed() or ""), ws.failed()
    dist.barrier()
    ws.close()
    return True
