"""Per-expert-norm MoE finalize fusions on CPU: the references against
formulas written here, then the real Triton kernels in the interpreter across 2-4 real processes
(gloo group, shared-memory peer buffers): every algorithm against the oracle, bitwise across
algorithms, ranks and batch positions (a token alone vs inside its batch), invalid / non-local
indices with NaN-poisoned rows and NaN weights, chunked launches, validation, opcheck and
torch.compile, bounded waits."""

from __future__ import annotations

import zlib

import pytest
import torch

from comm_mp import assert_compiles_to_eager_bits, run_group
from moefuse.comm.expert_norm import reference as ref
from moefuse.testing import assert_bitwise_equal, bits, poison_

pytestmark = pytest.mark.interpreter
BF16 = torch.bfloat16
TP_ALGOS = ("slot_oneshot", "expert_owner", "token_owner", "staged", "torch")
EP_ALGOS = ("oneshot", "twoshot", "torch")


def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


# ----------------------------------------------------------------------------- inputs
def make_tp_case(seed, world_size, m, h, k, w_dtype=torch.float32):
    """Every rank's partial rows [R, H + pad] (pad columns and unreferenced rows NaN), the index
    map with invalid slots (negative, >= R; token 1 fully masked when M > 2), weights (NaN at
    invalid slots: they must never be read) and the norm weight. Some partial values are -0.0."""
    gen = torch.Generator().manual_seed(seed)
    r = m * k + 3
    pad = 8 - h % 8 + 8
    perm = torch.randperm(r, generator=gen)[: m * k].reshape(m, k).to(torch.int32)
    idx = perm.clone()
    for t in range(m):
        if (t + k) % 2 == 0:
            idx[t, t % k] = -1 - t
        if (t + 1) % 3 == 0:
            idx[t, (t + 1) % k] = r + t
    if m > 2:
        idx[1, :] = torch.tensor([(-7, r)[j % 2] for j in range(k)], dtype=torch.int32)
    block = ref.group_size(k, world_size)
    if k > block:
        idx[0] = perm[0]  # fully valid (see below)
    valid = (idx >= 0) & (idx < r)
    used = idx[valid].long()
    partials = []
    for q in range(world_size):
        rows = torch.full((r, h + pad), float("nan"), dtype=BF16)
        vals = torch.randn(used.numel(), h, generator=gen) * (0.5 + q)
        vals[:, 0] = -0.0  # sum of -0.0 partials: +0.0, then norm and weights of exact zeros
        rows[used, :h] = vals.to(BF16)
        partials.append(rows)
    weights = torch.rand(m, k, generator=gen).to(w_dtype)
    weights[~valid] = float("nan")
    if k > block:
        # token 0 exposes the association: slot B (first of group 1) repeats slot 0's rows with
        # the opposite, huge weight. Grouped order rounds (a + b...) and (-a + ...) separately,
        # plain order cancels a after rounding at ulp(2^20): visibly different BF16 results.
        for rows in partials:
            rows[perm[0, block]] = rows[perm[0, 0]]
        weights[0] = torch.rand(k, generator=gen).to(w_dtype)
        weights[0, 0], weights[0, block] = 2.0**20, -(2.0**20)
    norm_weight = (torch.rand(h, generator=gen) + 0.5).to(BF16)
    return partials, weights, idx, norm_weight


def make_ep_case(seed, world_size, m, h, k, w_dtype=torch.float32):
    """Each (token, slot) is routed to one rank; rank r's rows hold its routes (permuted) plus NaN
    rows; its index map marks the other ranks' routes invalid (negative or >= R_r)."""
    gen = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, world_size, (m, k), generator=gen)
    if m > 2:
        owner[1, :] = world_size  # a token routed nowhere: every rank skips it, output +0.0
    rows, idxs = [], []
    for q in range(world_size):
        mine = (owner == q).nonzero().tolist()
        n = len(mine)
        rq = n + 2
        perm = torch.randperm(rq, generator=gen)[:n]
        rows_q = torch.full((rq, h + 8), float("nan"), dtype=BF16)
        idx_q = torch.full((m, k), -1, dtype=torch.int32)
        for j, (t, s) in enumerate(mine):
            rows_q[perm[j], :h] = (torch.randn(h, generator=gen) * (1 + s)).to(BF16)
            idx_q[t, s] = int(perm[j])
        for t in range(m):
            for s in range(k):
                if owner[t, s] != q and (t + s) % 2:
                    idx_q[t, s] = rq + s  # out of range, not just negative
        rows.append(rows_q)
        idxs.append(idx_q)
    weights = torch.rand(m, k, generator=gen).to(w_dtype)
    norm_weight = (torch.rand(h, generator=gen) + 0.5).to(BF16)
    return rows, weights, idxs, norm_weight


# ----------------------------------------------------------------------------- tolerances
def _bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """One BF16 ulp at |x| (2^-133 at zero)."""
    e = torch.floor(torch.log2(x.abs().float().clamp_min(2.0**-126)))
    return torch.pow(2.0, e - 7).clamp_min(2.0**-133)


def _weighted_magnitude(rows, weights, idx, norm_weight, opts):
    """``sum_k |y_k w_k|`` per token and column over the valid slots of one rank's rows."""
    h = norm_weight.shape[0]
    valid, x = ref._slot_rows(rows, idx, h)
    y = torch.zeros_like(x)
    if valid.any():
        y[valid] = ref.expert_norm(
            x[valid], norm_weight, opts["eps"], opts["gain_center"], opts["weight_before_norm"]
        ).abs()
    w = torch.where(valid, weights.float(), 0.0).abs()
    return (y * w[..., None]).sum(1)


def assert_tp_close(out, partials, weights, idx, norm_weight, opts, what):
    """The kernel's rsqrt (and the FP32 vs FP64 statistic) may move each normalized row by a
    few FP32 ulp: allow one BF16 ulp of the result plus 2^-20 of the sum of |y_k w_k| (a bound on
    what the FP32 error of the terms can do under cancellation). NaN never passes."""
    exp = ref.tp_moe_finalize_rmsnorm_from_ranks(partials, weights, idx, norm_weight, **opts)
    mag = _weighted_magnitude(partials, weights, idx, norm_weight, opts)
    diff = (out.float() - exp.float()).abs()
    assert not out.isnan().any(), f"{what}: NaN in the output (an invalid row or weight was read)"
    bad = diff > _bf16_ulp(exp) + mag * 2.0**-20
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max diff {diff.max()}"
    return exp


def assert_ep_close(out, rows, weights, idxs, norm_weight, opts, what):
    """Per rank the partial is rounded to BF16 after the rsqrt. With P'_r the kernel's FP32
    partial, |P'_r - P_r| <= eps_r = 2^-20 sum_k |y_k w_k| (as for TP: the kernel's rsqrt moves
    each normalized row by a few FP32 ulp, and cancellation between a rank's slots keeps the
    absolute error), so its BF16 partial is off by at most 2 ulp(p_r) + eps_r (two: the
    rounding may cross into the next binade), and the rounded rank sum by that total plus one
    ulp of the larger of the result and the expected value (round-to-nearest on both sides).
    A skipped or doubled slot is off by far more."""
    exp = ref.moe_finalize_rmsnorm_allreduce_from_ranks(
        rows, [weights] * len(rows), idxs, norm_weight, **opts
    )
    parts = [ref.ep_local_partial(r, weights, i, norm_weight, **opts) for r, i in zip(rows, idxs)]
    assert not out.isnan().any(), f"{what}: NaN in the output (a non-local row was read)"
    larger = torch.maximum(out.float().abs(), exp.float().abs())
    allow = _bf16_ulp(larger) + sum(2 * _bf16_ulp(p) for p in parts)
    allow = allow + sum(
        _weighted_magnitude([r], weights, i, norm_weight, opts) * 2.0**-20
        for r, i in zip(rows, idxs)
    )
    diff = (out.float() - exp.float()).abs()
    bad = diff > allow
    if bad.any():
        where = bad.nonzero()[:4].tolist()
        detail = [
            (
                t,
                c,
                float(out[t, c]),
                float(exp[t, c]),
                [float(p[t, c]) for p in parts],
                float(allow[t, c]),
            )
            for t, c in where
        ]
        raise AssertionError(
            f"{what}: {int(bad.sum())} elements off, max diff {diff.max()}; "
            f"(token, column, out, expected, rank partials, allowed): {detail}"
        )


# ----------------------------------------------------------------------------- references
def test_tp_reference_matches_formulas():
    """tp_moe_finalize_rmsnorm reference against a per-token loop written here (FP64 statistic,
    grouped order)."""
    partials, weights, idx, nw = make_tp_case(5, 3, 4, 40, 5)
    for wbn, gc in ((True, 0.0), (False, 1.0)):
        got = ref.tp_moe_finalize_rmsnorm_from_ranks(
            partials, weights, idx, nw, eps=1e-6, gain_center=gc, weight_before_norm=wbn
        )
        g = nw.double() + gc
        for t in range(4):
            out = torch.zeros(40, dtype=torch.float64)
            mag = torch.zeros(40, dtype=torch.float64)  # token 0 cancels two 2^20-weighted terms
            for k in range(5):
                p = int(idx[t, k])
                if not 0 <= p < partials[0].shape[0]:
                    continue
                x = sum(q[p, :40].double() for q in partials).to(BF16).double()
                z = x * g if wbn else x
                y = z / torch.sqrt(z.square().mean() + 1e-6)
                out += (y if wbn else y * g) * float(weights[t, k])
                mag += ((y if wbn else y * g) * float(weights[t, k])).abs()
            allow = _bf16_ulp(out.to(BF16)).double() + mag * 2.0**-20
            close = (got[t].double() - out).abs() <= allow
            assert close.all(), (t, wbn)
        assert bits(got[1]).eq(0).all(), "fully masked token: +0.0"
        assert not got.isnan().any()
    # the grouping: B = ceil(K / P); B = K is plain ascending order (may differ in the last bit)
    assert ref.group_size(5, 3) == 2 and ref.group_size(8, 2) == 4 and ref.group_size(2, 4) == 1


def test_ep_reference_skips_nonlocal_routes():
    rows, weights, idxs, nw = make_ep_case(6, 2, 5, 40, 3)
    out = ref.moe_finalize_rmsnorm_allreduce_from_ranks(rows, [weights] * 2, idxs, nw, eps=1e-6)
    assert not out.isnan().any()
    assert bits(out[1]).eq(0).all()
    parts = [
        ref.ep_local_partial(r, weights, i, nw, eps=1e-6, gain_center=0.0, weight_before_norm=True)
        for r, i in zip(rows, idxs)
    ]
    assert_bitwise_equal(out, (parts[0].float() + parts[1].float()).to(BF16), "rank-order sum")


# ----------------------------------------------------------------------------- TP scenarios
def _tp_opts(i):
    return dict(eps=1e-6, gain_center=float(i % 2), weight_before_norm=i % 3 != 1)


def _generation(ws) -> int:
    """The workspace's Lamport generation word (0, 1, 2, 0, ...: one step per one-shot launch,
    advanced by the launch's last CTA; a launch that skipped it would reuse the slot region of
    the previous call, which only a race between ranks would reveal)."""
    from moefuse.comm.workspace import CTRL_GEN

    return int(ws.ctrl[CTRL_GEN])


def scenario_tp(rank, world_size, cases, capacity):
    """Each (H, K, M): every algorithm against the oracle, bitwise equal to each other; the
    reference path; the middle token alone equals itself inside the batch (auto picks the other
    decomposition for one token). Returns a digest per case (the caller compares ranks)."""
    import hashlib

    import moefuse

    digests = []
    spaces = {}
    for i, (h, k, m) in enumerate(cases):
        if (h, k) not in spaces:
            spaces[(h, k)] = moefuse.ExpertNormWorkspace(
                None, h, k, "cpu", timeout_s=120, max_tokens=capacity
            )
        xws = spaces[(h, k)]
        partials, weights, idx, nw = make_tp_case(
            seed_of("tp", h, k, m), world_size, m, h, k, (torch.float32, BF16)[i % 2]
        )
        opts = _tp_opts(i)
        rows = partials[rank]
        what = f"rank {rank} P={world_size} H={h} K={k} M={m} {opts}"
        first = None
        for algo in TP_ALGOS:
            out = poison_(torch.empty(m, h, dtype=BF16))
            gen = _generation(xws.ar)
            got = moefuse.tp_moe_finalize_rmsnorm(
                rows, weights, idx, nw, out, workspace=xws, algorithm=algo, impl="triton", **opts
            )
            assert got is out
            if algo == "slot_oneshot":  # one generation per launch (chunks of slot_capacity)
                launches = -(-m // xws.slot_capacity)
                assert _generation(xws.ar) == (gen + launches) % 3, (what, gen, launches)
            assert_tp_close(out, partials, weights, idx, nw, opts, f"{what} {algo}")
            first = out if first is None else first
            assert_bitwise_equal(out, first, f"{what} {algo} vs {TP_ALGOS[0]}")
        ref_out = moefuse.tp_moe_finalize_rmsnorm(
            rows, weights, idx, nw, workspace=xws, impl="reference", **opts
        )
        exp = ref.tp_moe_finalize_rmsnorm_from_ranks(partials, weights, idx, nw, **opts)
        assert_bitwise_equal(ref_out, exp, f"{what} impl=reference")
        # auto runs one token (and these small batches) with "slot_oneshot"; the batch matched
        # every other decomposition bitwise above
        assert xws.choose_algorithm(1) == "slot_oneshot", xws.choose_algorithm(1)
        if m > 1:
            t = m // 2 + 1
            alone = moefuse.tp_moe_finalize_rmsnorm(
                rows, weights[t : t + 1], idx[t : t + 1], nw, workspace=xws, impl="triton", **opts
            )
            assert_bitwise_equal(alone, first[t : t + 1], f"{what} token {t} alone")
        digests.append(hashlib.sha1(bits(first).numpy().tobytes()).hexdigest())
    for xws in spaces.values():
        xws.check()
        xws.close()
    return digests


def _assert_ranks_agree(results):
    for r, d in enumerate(results[1:], start=1):
        assert d == results[0], f"rank {r} outputs differ bitwise from rank 0"


def scenario_tp_ep(rank, world_size, tp_cases, capacity, ep_cases):
    """One process group for both ops (process start-up dominates the CPU run time)."""
    return scenario_tp(rank, world_size, tp_cases, capacity) + scenario_ep(
        rank, world_size, ep_cases
    )


def test_two_ranks():
    """P = 2: odd H (40, 72), K in {2, 3, 5}, M in {1, 5}. TP with a capacity of 2 tokens, so
    M = 5 runs as three launches per call (the Lamport generations cycle many times); EP with
    every all-reduce algorithm."""
    tp = [(40, 2, 1), (40, 3, 5), (72, 5, 5)]
    ep = [(40, 3, 5), (72, 2, 1)]
    _assert_ranks_agree(run_group(2, scenario_tp_ep, tp, 2, ep))


def test_three_ranks():
    """P = 3: K = 5 (groups of 2: 2 + 2 + 1), K = 2 < P (rank 2 owns no group); EP at M = 1.
    (More ranks than the CI machine's 2 cores: waiting ranks spin, so the cases stay small.)"""
    _assert_ranks_agree(run_group(3, scenario_tp_ep, [(40, 5, 3), (40, 2, 1)], None, [(40, 3, 1)]))


def test_four_ranks_smallest():
    """P = 4, K = 3: groups of one slot, rank 3 owns none."""
    _assert_ranks_agree(run_group(4, scenario_tp_ep, [(40, 3, 1)], None, []))


# ----------------------------------------------------------------------------- EP scenario
def scenario_ep(rank, world_size, cases):
    import hashlib
    import itertools
    import os

    import moefuse
    from moefuse import _fastpath as fastpath

    digests = []
    for i, (h, k, m) in enumerate(cases):
        ws = moefuse.AllReduceWorkspace(None, max(8, m), h, BF16, "cpu", timeout_s=120)
        rows, weights, idxs, nw = make_ep_case(
            seed_of("ep", h, k, m), world_size, m, h, k, (BF16, torch.float32)[i % 2]
        )
        opts = _tp_opts(i)
        what = f"rank {rank} P={world_size} H={h} K={k} M={m} {opts}"
        first = None
        # every algorithm with the K rows requested slot by slot and all first (PREFETCH)
        for algo, prefetch in itertools.product(EP_ALGOS, ("0", "1")):
            os.environ["MOEFUSE_EP_PREFETCH_ROWS"] = prefetch
            fastpath.clear()  # recorded launch plans do not read the environment
            out = poison_(torch.empty(m, h, dtype=BF16))
            moefuse.moe_finalize_rmsnorm_allreduce(
                rows[rank],
                weights,
                idxs[rank],
                nw,
                out,
                workspace=ws,
                algorithm=algo,
                impl="triton",
                **opts,
            )
            assert_ep_close(out, rows, weights, idxs, nw, opts, f"{what} {algo} pf={prefetch}")
            first = out if first is None else first
            assert_bitwise_equal(out, first, f"{what} {algo} pf={prefetch} vs {EP_ALGOS[0]}")
        os.environ.pop("MOEFUSE_EP_PREFETCH_ROWS")
        fastpath.clear()
        ref_out = moefuse.moe_finalize_rmsnorm_allreduce(
            rows[rank], weights, idxs[rank], nw, workspace=ws, impl="reference", **opts
        )
        exp = ref.moe_finalize_rmsnorm_allreduce_from_ranks(
            rows, [weights] * world_size, idxs, nw, **opts
        )
        assert_bitwise_equal(ref_out, exp, f"{what} impl=reference")
        if m > 1:
            t = m - 1
            alone = moefuse.moe_finalize_rmsnorm_allreduce(
                rows[rank], weights[t:], idxs[rank][t:], nw, workspace=ws, impl="triton", **opts
            )
            assert_bitwise_equal(alone, first[t:], f"{what} token alone")
        digests.append(hashlib.sha1(bits(first).numpy().tobytes()).hexdigest())
        ws.close()
    return digests


# ----------------------------------------------------------------------------- API contract
def scenario_api(rank, world_size):
    """Validation (ValueError naming the argument, output untouched), the process-wide init
    (vote, re-init, other group), supports_*, opcheck, torch.compile, M = 0, compat styles."""
    import torch.distributed as dist

    import moefuse
    from moefuse.comm.expert_norm import ops as xops
    from moefuse.compat import flashinfer as fi

    h, k, m = 40, 3, 3
    partials, weights, idx, nw = make_tp_case(11, world_size, m, h, k)
    rows = partials[rank]
    opts = dict(eps=1e-6, gain_center=0.0, weight_before_norm=True)
    out = poison_(torch.empty(m, h, dtype=BF16))

    def expect(match, **change):
        args = dict(
            gemm2_permuted=rows,
            expert_weights=weights,
            expanded_idx_to_permuted_idx=idx,
            norm_weight=nw,
            output=out,
            **opts,
        )
        args.update(change)
        with pytest.raises(ValueError, match=match):
            moefuse.tp_moe_finalize_rmsnorm(**args)
        assert bits(out).eq(bits(poison_(torch.empty_like(out)))).all(), "output was written"

    expect("'gemm2_permuted'", gemm2_permuted=rows.float())
    expect("'gemm2_permuted'", gemm2_permuted=rows[:, : h - 1])
    expect("'expanded_idx_to_permuted_idx'", expanded_idx_to_permuted_idx=idx.long())
    expect("'expert_weights'", expert_weights=weights[:, :2])
    expect("'norm_weight'", norm_weight=nw.float())
    expect("'output'", output=torch.empty(m, h + 1, dtype=BF16))
    expect("'output'", output=rows[:m, :h])
    expect("'eps'", eps=-1.0)
    expect("'weight_before_norm'", weight_before_norm=1)
    expect("'algorithm'", algorithm="ring")
    with pytest.raises(TypeError):  # keyword-only, no defaults (FlashInfer's contract)
        moefuse.tp_moe_finalize_rmsnorm(rows, weights, idx, nw, out, eps=1e-6)

    # process-wide workspace
    with pytest.raises(RuntimeError, match="init_tp_moe_finalize_rmsnorm"):
        moefuse.tp_moe_finalize_rmsnorm(rows, weights, idx, nw, **opts)
    assert not moefuse.supports_tp_moe_finalize_rmsnorm(rows, weights, idx, nw, out)
    assert moefuse.init_tp_moe_finalize_rmsnorm(None, device="cpu", timeout_s=120)
    assert moefuse.init_tp_moe_finalize_rmsnorm(None)  # same group: same verdict
    other = dist.new_group(list(range(world_size)))
    with pytest.raises(ValueError, match="another group"):
        moefuse.init_tp_moe_finalize_rmsnorm(other)
    assert moefuse.supports_tp_moe_finalize_rmsnorm(rows, weights, idx, nw, out)
    assert not moefuse.supports_tp_moe_finalize_rmsnorm(rows.float(), weights, idx, nw, out)
    got = fi.tp_moe_finalize_rmsnorm(rows, weights, idx, nw, out, **opts)  # FlashInfer style
    assert_tp_close(got, partials, weights, idx, nw, opts, "process-wide workspace")
    exp = got.clone()
    empty = moefuse.tp_moe_finalize_rmsnorm(rows, weights[:0], idx[:0], nw, **opts)
    assert empty.shape == (0, h)
    for algo in ("expert_owner", "staged"):  # R = 0: every slot invalid, nothing read: +0.0
        zero = moefuse.tp_moe_finalize_rmsnorm(
            rows[:0], weights, idx, nw, algorithm=algo, impl="triton", **opts
        )
        assert bits(zero).eq(0).all(), algo
    moefuse.shutdown_tp_moe_finalize_rmsnorm()

    # custom ops: opcheck and torch.compile
    xws = moefuse.ExpertNormWorkspace(None, h, k, "cpu", timeout_s=120)
    e = torch.empty(m, h, dtype=BF16)
    torch.library.opcheck(
        xops.tp_moe_finalize_rmsnorm_op,
        (rows, weights, idx, nw, e, xws.id, 1e-6, 0.0, True, "token_owner", False, "triton"),
        test_utils=("test_schema", "test_faketensor"),
    )

    def layer(rows, weights, idx, nw):
        return moefuse.tp_moe_finalize_rmsnorm(
            rows, weights, idx, nw, workspace=xws, impl="triton", **opts
        )

    eager = layer(rows, weights, idx, nw)
    assert_compiles_to_eager_bits(layer, (rows, weights, idx, nw), eager)
    assert_bitwise_equal(eager, exp, "explicit workspace == process-wide one")
    xws.close()

    # EP: compat workspace class (FlashInfer's lifecycle) and call style
    rws, ew, eidx, enw = make_ep_case(12, world_size, m, 48, k)
    cws = fi.MNNVLCuteDSLMoEFinalizeAllReduceWorkspace(
        world_size, rank, 8, 48, k, group=None, device="cpu"
    )
    cws.compile(rws[rank].stride(0), ew.dtype, 1e-6)
    eout = torch.empty(m, 48, dtype=BF16)
    assert cws.check_support(
        fi.supports_moe_finalize_rmsnorm_allreduce(cws, rws[rank], ew, eidx[rank], enw, eout)
    )
    fi.moe_finalize_rmsnorm_allreduce(rws[rank], ew, eidx[rank], enw, eout, cws, eps=1e-6)
    assert_ep_close(
        eout,
        rws,
        ew,
        eidx,
        enw,
        dict(eps=1e-6, gain_center=0.0, weight_before_norm=True),
        "compat EP",
    )
    torch.library.opcheck(
        xops.moe_finalize_rmsnorm_allreduce_op,
        (
            rws[rank],
            ew,
            eidx[rank],
            enw,
            torch.empty(m, 48, dtype=BF16),
            cws.workspace.id,
            1e-6,
            0.0,
            True,
            "oneshot",
            False,
            "triton",
        ),
        test_utils=("test_schema", "test_faketensor"),
    )
    with pytest.raises(ValueError, match="'workspace'"):
        moefuse.moe_finalize_rmsnorm_allreduce(
            rws[rank], ew, eidx[rank], enw, workspace=None, eps=1e-6
        )
    none = moefuse.moe_finalize_rmsnorm_allreduce(
        rws[rank], ew[:0], eidx[rank][:0], enw, workspace=cws.workspace, eps=1e-6
    )
    assert none.shape == (0, 48)  # M = 0: no communication
    cws.destroy()
    return scenario_bounded_wait(rank, world_size)


def test_api_contract_compat_opcheck_compile_bounded_wait():
    # processes: ranks that trace (opcheck, torch.compile) cannot be threads of one process
    assert all(run_group(2, scenario_api, ranks="processes"))


def scenario_bounded_wait(rank, world_size):
    """The last rank skips a call: the others raise after ~timeout_s naming it (the expert owner
    and the decode path "slot_oneshot", each on a fresh workspace)."""
    import torch.distributed as dist

    import moefuse

    h, k, m = 40, 2, 2
    partials, weights, idx, nw = make_tp_case(13, world_size, m, h, k)
    opts = dict(eps=1e-6, gain_center=0.0, weight_before_norm=False)
    for algo in ("expert_owner", "slot_oneshot"):
        xws = moefuse.ExpertNormWorkspace(None, h, k, "cpu", timeout_s=2.0)
        if rank != world_size - 1:
            with pytest.raises(RuntimeError, match=rf"rank\(s\) {world_size - 1} "):
                moefuse.tp_moe_finalize_rmsnorm(
                    partials[rank],
                    weights,
                    idx,
                    nw,
                    workspace=xws,
                    algorithm=algo,
                    impl="triton",
                    **opts,
                )
        dist.barrier()
        xws.close()
    return True


def test_split_fold_choice(monkeypatch):
    """slot_oneshot's split fold: only when every CTA has one row, never in the interpreter (a
    CTA there cannot wait for a later one); the knob turns it off, and a bad value names it."""
    from moefuse.comm.expert_norm import tp_kernels as xt

    monkeypatch.setattr(xt, "interpreter_active", lambda: False)
    assert xt.split_fold(8, 8) and xt.split_fold(64, 132)
    assert not xt.split_fold(200, 132)  # some CTA has two rows: one CTA folds each token
    monkeypatch.setenv("MOEFUSE_TP_SPLIT_FOLD", "0")
    assert not xt.split_fold(8, 8)
    monkeypatch.setenv("MOEFUSE_TP_SPLIT_FOLD", "yes")
    with pytest.raises(ValueError, match="MOEFUSE_TP_SPLIT_FOLD must be 0 or 1"):
        xt.split_fold(8, 8)
    monkeypatch.setenv("MOEFUSE_TP_SPLIT_FOLD", "1")
    monkeypatch.setattr(xt, "interpreter_active", lambda: True)
    assert not xt.split_fold(8, 8)


def test_ep_prefetch_choice(monkeypatch):
    """The EP kernels request a token's K rows first when every CTA has one token; the knob
    forces it either way, and a bad value names it."""
    from moefuse.comm.expert_norm import ep_kernels as xe

    assert xe.prefetch_rows(8, 8) and not xe.prefetch_rows(200, 132)
    monkeypatch.setenv("MOEFUSE_EP_PREFETCH_ROWS", "0")
    assert not xe.prefetch_rows(1, 132)
    monkeypatch.setenv("MOEFUSE_EP_PREFETCH_ROWS", "1")
    assert xe.prefetch_rows(200, 132)
    monkeypatch.setenv("MOEFUSE_EP_PREFETCH_ROWS", "on")
    with pytest.raises(ValueError, match="MOEFUSE_EP_PREFETCH_ROWS must be 0 or 1"):
        xe.prefetch_rows(1, 1)
