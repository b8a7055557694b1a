"""``python -m moefuse bench all-gather --world-size P``: all-gather + norm fusions on P GPUs.

Spawns P processes (one GPU each, NCCL group; or runs in place under ``torchrun``). Each rank
holds ``shard`` [M, H/P] BF16. Per (op, H, M) it first checks that the fused op and both
baselines give the same bits (the baselines ARE the definition: gather, then the single-GPU op),
then times, side by side in one run:

* ``moefuse``: the fused op (algorithm="auto": Lamport all-gather over NVLink into a local
  buffer, then the single-GPU kernel, PDL between them; from 2048 tokens pipelined in chunks;
  every op: one kernel instead, the decode kernel at M <= 64 and one persistent gather + norm
  kernel above, comm/all_gather/decode.py / all_gather/persistent.py);
  ``moefuse_gather``: its all-gather launch alone (rmsnorm rows only: where the time goes);
  ``moefuse_chunked``: the op above the decode range on the two-launch path with its chunk
  pipeline (MOEFUSE_ALLGATHER_LARGE=chunked); ``moefuse_nochunk``: the same with the
  pipeline off (where it would be on);
  ``moefuse_2launch``: the two-launch path (gather, then the single-GPU op) where the default is
  the one-launch decode kernel (M <= 64; checked bitwise first, NaN if it fails);
  ``moefuse_late`` / ``_early`` / ``_slots``: the decode kernel in its modes other than the
  op's default (``MOEFUSE_ALLGATHER_DECODE``: parameters loaded after / before the wait for the
  peers; ``slots`` also reads the tile straight from the slots), checked bitwise first;
  ``moefuse_gathered`` / ``_slots`` above the decode range: the persistent kernel in its other
  mode (``MOEFUSE_ALLGATHER_PERSISTENT``), checked bitwise first;
* ``nccl+op``: NCCL ``all_gather_into_tensor`` into [P, M, H/P], re-layout to [M, H]
  (``permute`` + contiguous copy), then the moefuse single-GPU op;
* ``symm+op``: a PyTorch symmetric-memory all-gather (no multicast): every rank's shards live
  in one ``symm_mem`` allocation; per call a ``barrier()`` of the handle, then one SM copy
  kernel per rank reading that rank's shard through its peer mapping into ``[P, M, H/P]``; the
  same re-layout and op. (torch's ``_low_contention_all_gather``, the earlier baseline, cannot
  be graph-captured: it leaves side-stream work unjoined, and every failed capture ended the
  benchmark with SIGABRT at exit.) The inputs never change during a run, so the second
  barrier a reused buffer needs is not paid: that can only flatter this baseline.

Ops (``--ops``): ``rmsnorm`` (-> moefuse.rmsnorm), ``fp8`` (-> rmsnorm_quant), ``fp4``
(-> rmsnorm_fp4_quantize, linear scales), ``gated`` (-> gated_residual_next_rmsnorm, tensor
alpha). Each figure is the max over ranks of the median per-call time of CUDA-graph replays
(``harness.graph_time_us``; every variant's shards, the symmetric-memory ones included, rotate
over sets larger than L2).

NVLink bound: the bytes each rank must receive, ``(P-1)/P * M * H * 2``, over the peer-copy
bandwidth measured in the same run (``peer_copy_GBps``: every rank at once pushes a 256 MiB
buffer into its right neighbour's symmetric buffer with an SM copy kernel, and pulls one with a
copy-engine ``copy_``; the faster of the two, max over ranks of the time). The run ends with
the issue's bar (PASS / FAIL lines) and writes ``bench/results/allgather-<gpu>-p<P>.json/.png``
with ``--save`` (``--out`` another directory).
"""

from __future__ import annotations

import torch

from moefuse.bench import ranks

TOKENS = [1, 8, 64, 512, 4096, 16384]
WIDTHS = [4096, 8192]
OPS = ("rmsnorm", "fp8", "fp4", "gated")
NO_MULTICAST = ranks.NO_MULTICAST
BASELINES = ("nccl+op", "symm+op")
PEER_COPY_BYTES = 256 << 20
CHUNK_ENV = "MOEFUSE_ALLGATHER_CHUNK_ROWS"
LARGE_ENV = "MOEFUSE_ALLGATHER_LARGE"


# ----------------------------------------------------------------------------- peer bandwidth
def peer_copy_gbps(group, dev, harness) -> float:
    """Measured one-direction peer-copy bandwidth (GB/s) with every rank copying at once."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from moefuse.bench._copy import COPY_CONFIGS, sm_copy

    rank, p = dist.get_rank(group), dist.get_world_size(group)
    n = PEER_COPY_BYTES // 2
    buf = symm_mem.empty(n, dtype=torch.bfloat16, device=dev)
    hdl = symm_mem.rendezvous(buf, group.group_name)
    peer = hdl.get_remote_tensor((rank + 1) % p, buf.size(), buf.dtype)
    local = torch.empty(n, dtype=torch.bfloat16, device=dev).normal_()
    best = float("inf")
    copies = [
        lambda i, b=block, w=warps: sm_copy(local, peer, b, w)  # SM stores (as the kernel)
        for block, warps in COPY_CONFIGS
    ] + [lambda i: local.copy_(peer)]  # copy engine
    for fn in copies:
        dist.barrier(group=group)
        try:
            best = min(best, harness.graph_time_us(fn, calls=3, replays=5))
        except Exception as exc:  # report, keep the others
            print(f"rank {rank}: a peer-copy measurement failed: {exc}")
    t = torch.tensor([best], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    dist.barrier(group=group)
    return PEER_COPY_BYTES / (float(t.item()) * 1e-6) / 1e9


# ----------------------------------------------------------------------------- one case
def case_tensors(m: int, h: int, dev) -> dict:
    """The replicated inputs (same on every rank: a fixed seed) and preallocated outputs of one
    case of every op: ``w`` next-norm weight, ``res`` FP32 residual, ``alpha`` / ``beta`` the
    gated op's, ``scale`` (FP8) / ``gs`` (NVFP4 global scale), and the outputs ``out`` (BF16),
    ``ro`` (FP32), ``out8``, ``q4`` / ``sf4`` (linear NVFP4 codes and scales)."""
    bf = torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(4321)
    return dict(
        w=(torch.rand(h, generator=g, device=dev) + 0.5).to(bf),
        res=torch.randn(m, h, generator=g, device=dev),
        alpha=torch.rand(h, generator=g, device=dev) + 0.5,
        beta=torch.randn(h, generator=g, device=dev),
        scale=torch.tensor([0.0125], device=dev),
        gs=torch.tensor([448.0 * 6 / 5], device=dev),
        out=torch.empty(m, h, dtype=bf, device=dev),
        ro=torch.empty(m, h, device=dev),
        out8=torch.empty(m, h, dtype=torch.float8_e4m3fn, device=dev),
        q4=torch.empty(m, h // 2, dtype=torch.uint8, device=dev),
        sf4=torch.empty(m, h // 16, dtype=torch.uint8, device=dev),
    )


def single_op(moefuse, op, full, c):
    """The single-GPU op's Triton kernel on full rows (the definition of the fused op; on a CPU
    tensor the interpreter, not the reference), outputs as a tuple."""
    if op == "rmsnorm":
        return (moefuse.rmsnorm(full, c["w"], impl="triton"),)
    if op == "fp8":
        return (moefuse.rmsnorm_quant(full, c["w"], c["scale"], impl="triton").view(torch.uint8),)
    if op == "fp4":
        return moefuse.rmsnorm_fp4_quantize(full, c["w"], c["gs"], layout="linear", impl="triton")
    return moefuse.gated_residual_next_rmsnorm(
        full, c["res"], c["w"], c["alpha"], c["beta"], residual_out=c["ro"], impl="triton"
    )


def fused_op(moefuse, op, shard, c, ws, enable_pdl=None):
    """The fused op on this rank's ``shard`` (outputs into ``c``'s buffers), as a tuple."""
    kw = dict(workspace=ws, impl="triton", enable_pdl=enable_pdl)
    if op == "rmsnorm":
        return (moefuse.all_gather_rmsnorm(shard, c["w"], out=c["out"], **kw),)
    if op == "fp8":
        return (
            moefuse.all_gather_rmsnorm_fp8(shard, c["w"], c["scale"], out=c["out8"], **kw).view(
                torch.uint8
            ),
        )
    if op == "fp4":
        return moefuse.all_gather_rmsnorm_fp4_quantize(
            shard, c["w"], c["gs"], layout="linear", out=c["q4"], scale_out=c["sf4"], **kw
        )
    return moefuse.all_gather_gated_residual_next_rmsnorm(
        shard,
        c["res"],
        c["alpha"],
        c["beta"],
        c["w"],
        residual_out=c["ro"],
        ffn_input=c["out"],
        **kw,
    )


def _time_case(moefuse, harness, ws, group, op, h, m, replays):
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from moefuse.bench._copy import sm_copy
    from moefuse.comm.all_gather import ops as allgather_ops
    from moefuse.comm.all_gather.kernels import launch_allgather
    from moefuse.testing import assert_bitwise_equal

    dev, bf = ws.device, torch.bfloat16
    rank, p = dist.get_rank(group), dist.get_world_size(group)
    s = h // p
    n = harness.rotation_sets(4 * m * h * 2)
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    shards = [torch.randn(m, s, generator=g, device=dev).to(bf) for _ in range(n)]
    c = case_tensors(m, h, dev)
    stacked = torch.empty(p, m, s, dtype=bf, device=dev)
    # the symmetric-memory baseline's inputs: every rotation set already in one symmetric
    # allocation (as if the GEMM had written there), read by the peers through their mappings
    sym = symm_mem.empty((n, m, s), dtype=bf, device=dev)
    sym.copy_(torch.stack(shards))
    hdl = symm_mem.rendezvous(sym, group.group_name)
    views = [sym if q == rank else hdl.get_remote_tensor(q, sym.size(), bf) for q in range(p)]

    def nccl(i):
        dist.all_gather_into_tensor(stacked, shards[i % n], group=group)
        return single_op(moefuse, op, stacked.permute(1, 0, 2).reshape(m, h), c)

    def symm(i):
        hdl.barrier(channel=0)  # every rank's set is complete before anyone reads it
        for q in range(p):  # peer loads by an SM copy kernel, this rank's own set locally
            sm_copy(views[q][i % n], stacked[q])
        return single_op(moefuse, op, stacked.permute(1, 0, 2).reshape(m, h), c)

    def fused(i):
        return fused_op(moefuse, op, shards[i % n], c, ws)

    state = allgather_ops.allgather_state(ws)
    gathered = state.gathered(bf, m)

    def gather_only(i):
        launch_allgather(ws, state, shards[i % n], gathered, True)

    # correctness first: the fused op equals both baselines bit for bit
    want = [t.clone() for t in nccl(0)]
    torch.cuda.synchronize(dev)
    dist.barrier(group)  # every rank's symmetric input is written before anyone reads it
    variants = _checked_variants(
        {"moefuse": fused, "nccl+op": nccl, "symm+op": symm}, want, f"{op} H={h} M={m}", group, dev
    )
    if op == "rmsnorm":
        variants["moefuse_gather"] = gather_only
    env = _knob_variants(harness, op, h, m)
    variants.update({name: fused for name in env})

    def check(name, fn):
        def run():  # correctness first for the knob variants too
            for a, b in zip(fn(0), want):
                assert_bitwise_equal(a, b, f"{op} H={h} M={m}: {name} vs NCCL + op")

        return run if name in env else None

    times = {
        name: time_variant(
            harness,
            fn,
            env.get(name, {}),
            group,
            f"{name} at {op} H={h} M={m}",
            calls=max(20, n),
            replays=replays,
            check=check(name, fn),
        )
        for name, fn in variants.items()
    }
    ws.check()
    return times


def _checked_variants(variants: dict, want, where: str, group, dev) -> dict:
    """``variants`` less the baselines whose first call does not give ``want``'s bits on some
    rank (reported, and dropped on every rank alike); the fused op must give them (raises)."""
    import torch.distributed as dist

    from moefuse.testing import assert_bitwise_equal

    rank = dist.get_rank(group)
    out = dict(variants)
    for name in ("moefuse", "symm+op"):
        try:
            for a, b in zip(variants[name](0), want):
                assert_bitwise_equal(a, b, f"{where}: {name} vs NCCL + single-GPU op")
            ok = 1
        except Exception as exc:  # a broken baseline is reported and dropped, never ours
            if name == "moefuse":
                raise
            print(f"rank {rank}: {name} failed its check at {where}: {str(exc)[:160]}")
            ok = 0
        vote = torch.tensor([ok], device=dev)
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)  # drop it on every rank alike
        if not int(vote.item()):
            out.pop(name)
    return out


def _knob_variants(harness, op: str, h: int, m: int) -> dict:
    """``{variant: {knob: value}}``: the fused op's paths other than its default, each selected
    by knobs. Every op's default is one kernel (decode at M <= 64, persistent above); its
    two-launch paths and the kernel's other modes are timed as variants too."""
    from moefuse.comm.all_gather import ops as allgather_ops
    from moefuse.comm.all_gather.decode import (
        DECODE_ENV,
        DECODE_MODES,
        ONE_LAUNCH_ENV,
        ONE_LAUNCH_MAX_TOKENS,
        OP_CODES,
        decode_mode,
        one_launch_tile,
    )
    from moefuse.comm.all_gather.persistent import (
        PERSISTENT_ENV,
        PERSISTENT_MODES,
        fused_tile,
        persistent_mode,
    )

    env = {}
    if m > ONE_LAUNCH_MAX_TOKENS:  # the default is the persistent kernel: the old paths too
        env["moefuse_chunked"] = {LARGE_ENV: "chunked"}
        if allgather_ops.chunk_rows(m) < m:  # the chunk pipeline against one chunk
            env["moefuse_nochunk"] = {LARGE_ENV: "chunked", CHUNK_ENV: "0"}
        # the persistent kernel's other modes (rows gathered / parameters early / from slots)
        env.update(
            _other_modes(
                harness,
                PERSISTENT_ENV,
                PERSISTENT_MODES,
                persistent_mode,
                OP_CODES[op],
                fused_tile(h, m, OP_CODES[op]),
            )
        )
    else:  # the default is one launch here: time two as well, and its other decode modes
        env["moefuse_2launch"] = {ONE_LAUNCH_ENV: "0"}
        env.update(
            _other_modes(
                harness,
                DECODE_ENV,
                DECODE_MODES,
                decode_mode,
                OP_CODES[op],
                one_launch_tile(h, m, OP_CODES[op]),
            )
        )
    return env


def _other_modes(harness, name: str, modes: tuple, choose, op: int, tile) -> dict:
    """``{"moefuse_<mode>": {name: mode}}`` for every value of the knob ``name`` under which
    ``choose(op, tile)`` (the kernel's mode decision) differs from its default; none without a
    tile (the kernel does not run this case)."""
    if tile is None:
        return {}
    default = choose(op, tile)
    out = {}
    for mode in modes:
        with harness.knobs({name: mode}):
            if choose(op, tile) != default:
                out[f"moefuse_{mode}"] = {name: mode}
    return out


def time_variant(
    harness, fn, env: dict, group, label: str, *, calls: int, replays: int, check=None
) -> float:
    """Max over the ranks of the median µs per call of ``fn(i)`` in CUDA-graph replays, under the
    knobs ``env`` (read at capture, the same on every rank), ``check()`` first (a failure on any
    rank skips the timing on every rank); NaN (and a printed line naming ``label``) when either
    fails, so the other variants still run."""
    import torch.distributed as dist

    dev = torch.cuda.current_device()
    us = float("nan")
    dist.barrier(group=group)
    torch.cuda.synchronize()
    with harness.knobs(env):
        ok = check is None or _attempt(check, label, group)
        vote = torch.tensor([int(ok)], device=dev)
        dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=group)
        timed = []
        if int(vote.item()) and _attempt(
            lambda: timed.append(harness.graph_time_us(fn, calls=calls, replays=replays)),
            label,
            group,
        ):
            us = timed[0]
    t = torch.tensor([us], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _attempt(fn, label: str, group) -> bool:
    """Run ``fn()``; False (and a printed line naming ``label`` and this rank) when it raises."""
    import torch.distributed as dist

    try:
        fn()
        return True
    except Exception as exc:
        print(f"rank {dist.get_rank(group)}: {label} failed: {str(exc)[:300]}", flush=True)
        return False


# ----------------------------------------------------------------------------- worker
def _worker(rank: int, world_size: int, args, init_method: str | None) -> None:
    dev = ranks.init_rank(rank, world_size, init_method)
    import torch.distributed as dist

    import moefuse
    from moefuse.bench import harness

    group = dist.group.WORLD
    rank, world_size = dist.get_rank(), dist.get_world_size()
    tokens, widths = ranks.token_and_width_lists(args, TOKENS, WIDTHS, [1, 64, 4096])
    ops = [o for o in args.ops.split(",") if o] if args.ops else list(OPS)
    bad = [o for o in ops if o not in OPS]
    if bad:
        raise SystemExit(f"--ops: unknown {bad}; choose from {OPS}")
    replays = 8 if args.quick else 15
    bw = peer_copy_gbps(group, dev, harness)
    if rank == 0:
        print(f"peer-copy bandwidth (one direction, all ranks at once): {bw:.1f} GB/s", flush=True)
    rows = []
    for h in widths:
        ws = moefuse.AllReduceWorkspace(
            group,
            max(tokens),
            h,
            torch.bfloat16,
            dev,
            oneshot_max_tokens=1,
            extra_regions=moefuse.allgather_regions(max(tokens), h),
        )
        for op in ops:
            for m in tokens:
                times = _time_case(moefuse, harness, ws, group, op, h, m, replays)
                best = min(
                    (times[b] for b in BASELINES if times[b] == times[b]), default=float("nan")
                )
                received = (world_size - 1) * m * h * 2 // world_size
                bound_us = received / (bw * 1e9) * 1e6
                for name, us in times.items():
                    rows.append(
                        {
                            "op": f"all_gather_{op}",
                            "shape": f"P={world_size} H={h}",
                            "P": world_size,
                            "H": h,
                            "M": m,
                            "variant": name,
                            "us": us,
                            "received_bytes": received,
                            "nvlink_bound_us": bound_us,
                            "x_nvlink_bound": bound_us / us,
                            "x_best_unfused": best / us,
                            "x_nccl": times["nccl+op"] / us,
                        }
                    )
                if rank == 0:
                    print(
                        f"P={world_size} {op:7s} H={h:5d} M={m:6d} "
                        + "  ".join(f"{k}={v:8.2f}" for k, v in times.items())
                        + f" us  bound={bound_us:.2f}",
                        flush=True,
                    )
        ws.close()
    if rank == 0:
        bar = bar_checks(rows)
        cols = [
            "op",
            "shape",
            "M",
            "variant",
            "us",
            "nvlink_bound_us",
            "x_nvlink_bound",
            "x_best_unfused",
            "x_nccl",
        ]
        harness.print_table([r for r in rows if r["variant"] == "moefuse"], cols)
        for line in bar:
            print(line)
        meta = harness.run_metadata()
        meta.update(
            world_size=world_size,
            peer_copy_GBps=bw,
            bar=bar,
            note="symm+op = handle barrier + per-rank SM copies through the peer "
            "mappings (inputs preloaded); moefuse_gather = the fused op's "
            "all-gather launch alone",
        )
        if args.save:
            paths = harness.save_results(
                "all-gather", rows, meta, args.out, suffix=f"-p{world_size}"
            )
            print("wrote", *[str(p) for p in paths if p])
    dist.barrier()
    dist.destroy_process_group()


def bar_checks(rows: list[dict]) -> list[str]:
    """The issue's bar on this run: every M >= 1.0 x the best unfused path of the same run;
    M <= 64 >= 2 x; M = 1, H = 4096 <= 5 us; M >= 4096 >= 0.8 x the NVLink bound."""
    out = []

    def verdict(ok: bool, text: str) -> None:
        out.append(f"BAR {'PASS' if ok else 'FAIL'}: {text}")

    for r in rows:
        if r["variant"] != "moefuse":
            continue
        tag = f"{r['op']} P={r['P']} H={r['H']} M={r['M']}: {r['us']:.2f} us"
        best = r["us"] * r["x_best_unfused"]
        verdict(r["x_best_unfused"] >= 1.0, f"{tag} <= best unfused {best:.2f}")
        if r["M"] <= 64:
            verdict(r["x_best_unfused"] >= 2.0, f"{tag} <= best unfused {best:.2f} / 2")
        if r["M"] == 1 and r["H"] == 4096:
            verdict(r["us"] <= 5.0, f"{tag} <= 5.0")
        if r["M"] >= 4096:
            verdict(
                r["x_nvlink_bound"] >= 0.8,
                f"{tag}: NVLink bound {r['nvlink_bound_us']:.2f}"
                f" us / time = {r['x_nvlink_bound']:.2f} >= 0.8",
            )
    return out


def main(argv: list[str]) -> int:
    parser = ranks.rank_parser("moefuse bench all-gather", "M in {1, 64, 4096}, H = 4096")
    parser.add_argument("--ops", default="", help=f"comma-separated subset of {OPS}")
    args = parser.parse_args(argv)
    return ranks.run_ranks(_worker, args)
