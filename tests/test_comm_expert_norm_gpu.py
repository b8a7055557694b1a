"""Per-expert-norm MoE finalize fusions on 2 H200s (NCCL group, peer buffers, no multicast):
``tp_moe_finalize_rmsnorm`` and ``moe_finalize_rmsnorm_allreduce`` (spec: same headings) at
H in {2880, 4096, 7168}, K in {2, 6, 8}, M in {1, 7, 64, 200, 4096}: every algorithm against the
oracle (all ranks' inputs, computed on the GPU), bitwise across algorithms, PDL on/off, ranks,
and a token alone vs inside the batch of 4096; invalid / non-local indices with NaN-poisoned rows
and NaN weights; 1,000 CUDA-graph replays with fresh data per algorithm.

Run (2 GPUs): ``python -m pytest -q tests/test_comm_expert_norm_gpu.py`` (each test spawns its
own processes; skipped with fewer GPUs). Expect several minutes: each (H, K) compiles every
algorithm's kernel (norm order and weight dtype change per (H, K), not per M, to limit that).
"""

from __future__ import annotations

import pytest
import torch

from comm_mp import run_group
from test_comm_expert_norm import assert_ep_close, assert_tp_close

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

BF16 = torch.bfloat16
WIDTHS = (2880, 4096, 7168)
TOPKS = (2, 6, 8)
TOKENS = (1, 7, 64, 200, 4096)
TP_ALGOS = ("slot_oneshot", "expert_owner", "token_owner", "staged", "torch")
EP_ALGOS = ("oneshot", "twoshot", "torch")
REPLAY = (64, 4096, 8)  # (M, H, K) of the graph-replay scenario


def _need(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")


def _opts(i):
    return dict(eps=1e-6, gain_center=float(i % 2), weight_before_norm=i % 3 != 1)


# ----------------------------------------------------------------------------- inputs (device)
def tp_case(seed, world_size, m, h, k, dev, w_dtype=torch.float32):
    """As ``test_comm_expert_norm.make_tp_case``, vectorized on the device: ~10 % invalid slots
    (negative or >= R), token 1 fully masked, unreferenced rows and pad columns NaN, NaN weights
    at invalid slots, -0.0 in column 0, token 0 with two opposite 2^20-weighted copies of one
    row across the first group boundary (exposes the summation order)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    r = m * k + 3
    pad = 8 - h % 8 + 8
    perm = torch.randperm(r, generator=g, device=dev)[: m * k].view(m, k).to(torch.int32)
    cols = torch.arange(k, device=dev).expand(m, k)
    inv = torch.rand(m, k, generator=g, device=dev) < 0.1
    idx = torch.where(inv & (cols % 2 == 0), -1 - cols.int(), perm)
    idx = torch.where(inv & (cols % 2 == 1), r + cols.int(), idx).to(torch.int32)
    if m > 2:
        idx[1] = -3
    block = -(-k // world_size)
    if k > block:
        idx[0] = perm[0]
    valid = (idx >= 0) & (idx < r)
    used = idx[valid].long()
    partials = []
    for q in range(world_size):
        rows = torch.full((r, h + pad), float("nan"), dtype=BF16, device=dev)
        vals = torch.randn(used.numel(), h, generator=g, device=dev) * (0.5 + q)
        vals[:, 0] = -0.0
        rows[used, :h] = vals.to(BF16)
        if k > block:
            rows[perm[0, block].long()] = rows[perm[0, 0].long()]
        partials.append(rows)
    weights = torch.rand(m, k, generator=g, device=dev).to(w_dtype)
    weights[~valid] = float("nan")
    if k > block:
        weights[0, 0], weights[0, block] = 2.0**20, -(2.0**20)
    norm_weight = (torch.rand(h, generator=g, device=dev) + 0.5).to(BF16)
    return partials, weights, idx, norm_weight


def ep_case(seed, world_size, m, h, k, dev, w_dtype=torch.float32, r_cap=None):
    """Routes spread over the ranks; rank q's rows hold its routes (permuted) + NaN rows (2, or
    up to ``r_cap`` rows in all); the other ranks' routes are -1 or >= R_q in its map; token 1
    routed nowhere (M > 2)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    owner = torch.randint(0, world_size, (m, k), generator=g, device=dev)
    if m > 2:
        owner[1] = world_size
    odd = (torch.arange(m, device=dev)[:, None] + torch.arange(k, device=dev)) % 2 == 1
    rows, idxs = [], []
    for q in range(world_size):
        mine = owner == q
        n = int(mine.sum())
        rq = n + 2 if r_cap is None else r_cap
        pos = torch.randperm(rq, generator=g, device=dev)[:n]
        rows_q = torch.full((rq, h + 8), float("nan"), dtype=BF16, device=dev)
        rows_q[pos, :h] = torch.randn(n, h, generator=g, device=dev).to(BF16)
        idx_q = torch.full((m, k), -1, dtype=torch.int32, device=dev)
        idx_q[mine] = pos.to(torch.int32)
        idx_q[~mine & odd] = rq + 1
        rows.append(rows_q)
        idxs.append(idx_q)
    weights = torch.rand(m, k, generator=g, device=dev).to(w_dtype)
    norm_weight = (torch.rand(h, generator=g, device=dev) + 0.5).to(BF16)
    return rows, weights, idxs, norm_weight


def same_bits(a, b, what):
    from moefuse.testing import assert_bitwise_equal

    if a.shape != b.shape or not torch.equal(a.view(torch.int16), b.view(torch.int16)):
        assert_bitwise_equal(a, b, what)


def checksum(t) -> torch.Tensor:
    b = t.contiguous().view(-1).view(torch.int16).long()
    pos = torch.arange(b.numel(), device=b.device) % 1000003 + 1
    return (b * pos).sum().view(1)


def assert_ranks_agree(value, what):
    import torch.distributed as dist

    got = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(got, value)
    for r, v in enumerate(got):
        assert torch.equal(v, got[0]), f"{what}: rank {r} differs bitwise from rank 0"


# ----------------------------------------------------------------------------- scenarios
def scenario_tp_full(rank, world_size):
    import moefuse

    dev = torch.device("cuda", rank)
    i = 0
    for h in WIDTHS:
        for k in TOPKS:
            xws = moefuse.ExpertNormWorkspace(None, h, k, dev)
            i += 1  # options per (H, K), not per M: fewer kernel specializations to compile
            opts = _opts(i)
            for m in TOKENS:
                parts, w, idx, nw = tp_case(
                    1000 * h + 10 * k + m, world_size, m, h, k, dev, (torch.float32, BF16)[i % 2]
                )
                what = f"TP H={h} K={k} M={m} {opts}"
                first = None
                for j, algo in enumerate(TP_ALGOS):
                    out = moefuse.tp_moe_finalize_rmsnorm(
                        parts[rank],
                        w,
                        idx,
                        nw,
                        workspace=xws,
                        algorithm=algo,
                        impl="triton",
                        enable_pdl=j % 2 == 0,
                        **opts,
                    )
                    if first is None:
                        assert_tp_close(out, parts, w, idx, nw, opts, f"{what} {algo}")
                        first = out
                    same_bits(out, first, f"{what} {algo} vs {TP_ALGOS[0]}")
                auto = moefuse.tp_moe_finalize_rmsnorm(
                    parts[rank], w, idx, nw, workspace=xws, impl="triton", **opts
                )
                same_bits(auto, first, f"{what} auto")
                if m == max(TOKENS):
                    for t in (0, 1, m // 2, m - 1):
                        alone = moefuse.tp_moe_finalize_rmsnorm(
                            parts[rank],
                            w[t : t + 1],
                            idx[t : t + 1],
                            nw,
                            workspace=xws,
                            impl="triton",
                            **opts,
                        )
                        same_bits(alone, first[t : t + 1], f"{what} token {t} alone")
                assert_ranks_agree(checksum(first), what)
            xws.check()
            xws.close()
    return True


def scenario_ep_full(rank, world_size):
    import moefuse

    dev = torch.device("cuda", rank)
    i = 0
    for h in WIDTHS:
        ws = moefuse.AllReduceWorkspace(None, max(TOKENS), h, BF16, dev)
        for k in TOPKS:
            i += 1
            opts = _opts(i)
            for m in TOKENS:
                rows, w, idxs, nw = ep_case(
                    1000 * h + 10 * k + m, world_size, m, h, k, dev, (BF16, torch.float32)[i % 2]
                )
                what = f"EP H={h} K={k} M={m} {opts}"
                first = None
                for j, algo in enumerate(EP_ALGOS):
                    out = moefuse.moe_finalize_rmsnorm_allreduce(
                        rows[rank],
                        w,
                        idxs[rank],
                        nw,
                        workspace=ws,
                        algorithm=algo,
                        impl="triton",
                        enable_pdl=j % 2 == 0,
                        **opts,
                    )
                    if first is None:
                        assert_ep_close(out, rows, w, idxs, nw, opts, f"{what} {algo}")
                        first = out
                    same_bits(out, first, f"{what} {algo} vs {EP_ALGOS[0]}")
                if m == max(TOKENS):
                    t = m // 2
                    alone = moefuse.moe_finalize_rmsnorm_allreduce(
                        rows[rank],
                        w[t : t + 1],
                        idxs[rank][t : t + 1],
                        nw,
                        workspace=ws,
                        impl="triton",
                        **opts,
                    )
                    same_bits(alone, first[t : t + 1], f"{what} token {t} alone")
                assert_ranks_agree(checksum(first), what)
        ws.check()
        ws.close()
    return True


def scenario_graph_replays(rank, world_size, replays):
    """Per algorithm, one call captured in a CUDA graph (PDL on) and replayed ``replays`` times
    with fresh rows, weights and index maps copied in before each replay: every replay bitwise
    equal to an eager PDL-off call on the same inputs, and within tolerance of the oracle every
    100th replay."""
    import moefuse
    from moefuse.testing import capture_graph

    dev = torch.device("cuda", rank)
    m, h, k = REPLAY
    xws = moefuse.ExpertNormWorkspace(None, h, k, dev)
    ews = moefuse.AllReduceWorkspace(None, m, h, BF16, dev)
    opts = dict(eps=1e-6, gain_center=1.0, weight_before_norm=True)
    parts, w, idx, nw = tp_case(7, world_size, m, h, k, dev)
    rows, wb, ib = parts[rank].clone(), w.clone(), idx.clone()
    r_cap = m * k + 2  # fixed row count: any case's local routes fit
    er, ew, eidxs, _ = ep_case(8, world_size, m, h, k, dev, r_cap=r_cap)
    erows, ewb, eib = er[rank].clone(), ew.clone(), eidxs[rank].clone()
    runs = [
        (
            f"tp-{a}",
            lambda a=a, o=None, pdl=None: moefuse.tp_moe_finalize_rmsnorm(
                rows,
                wb,
                ib,
                nw,
                o,
                workspace=xws,
                algorithm=a,
                impl="triton",
                enable_pdl=pdl,
                **opts,
            ),
        )
        for a in TP_ALGOS
    ]
    runs += [
        (
            f"ep-{a}",
            lambda a=a, o=None, pdl=None: moefuse.moe_finalize_rmsnorm_allreduce(
                erows,
                ewb,
                eib,
                nw,
                o,
                workspace=ews,
                algorithm=a,
                impl="triton",
                enable_pdl=pdl,
                **opts,
            ),
        )
        for a in EP_ALGOS
    ]
    for name, run in runs:
        out = torch.empty(m, h, dtype=BF16, device=dev)
        graph = capture_graph(lambda: run(o=out), xws, ews)
        for i in range(replays):
            if name.startswith("tp"):
                parts, w, idx, _ = tp_case(100 + i, world_size, m, h, k, dev)
                rows.copy_(parts[rank])
                wb.copy_(w)
                ib.copy_(idx)
            else:
                er, ew, eidxs, _ = ep_case(100 + i, world_size, m, h, k, dev, r_cap=r_cap)
                erows.copy_(er[rank])
                ewb.copy_(ew)
                eib.copy_(eidxs[rank])
            out.fill_(float("nan"))
            graph.replay()
            same_bits(out, run(o=None, pdl=False), f"{name} replay {i} vs eager (PDL off)")
            if i % 100 == 0:
                if name.startswith("tp"):
                    assert_tp_close(out, parts, wb, ib, nw, opts, f"{name} replay {i}")
                else:
                    assert_ep_close(out, er, ewb, eidxs, nw, opts, f"{name} replay {i}")
                assert_ranks_agree(checksum(out), f"{name} replay {i}")
        del graph
    xws.check()
    xws.close()
    ews.close()
    return True


# ----------------------------------------------------------------------------- tests
def test_tp_full_shapes_every_algorithm():
    _need(2)
    assert all(run_group(2, scenario_tp_full, backend="nccl", timeout_s=2400))


def test_ep_full_shapes_every_algorithm():
    _need(2)
    assert all(run_group(2, scenario_ep_full, backend="nccl", timeout_s=1800))


def test_graph_replays_fresh_data():
    _need(2)
    assert all(run_group(2, scenario_graph_replays, 1000, backend="nccl", timeout_s=1800))
