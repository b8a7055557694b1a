"""Multi-rank communication ops on ONE CUDA GPU: P = 2 loopback ranks (threads of this process,
one CUDA stream each, ``transport="loopback"``; see ``moefuse.testing_ranks``).

1. Correctness on random data, M in {1, 7, 64, 300} x H in {4096, 7168} (BF16), every rank
   against the reference of ALL ranks' inputs, computed on the GPU:
   * ``allreduce_residual_rmsnorm`` one-shot / two-shot: residual_out bitwise, norm_out <= 1 ulp
     (rsqrt.approx, the ``rsqrt_half`` row of moefuse.testing), bitwise across algorithms;
   * ``moe_finalize_allreduce_residual_rmsnorm`` (K = 8) and ``moe_allreduce_residual_rmsnorm``
     (E_loc = 8 dense rows) one-shot / two-shot: the same checks;
   * ``all_gather_rmsnorm``, ``_fp8``, ``_fp4_quantize`` (linear scales) and
     ``all_gather_gated_residual_next_rmsnorm`` one-shot: bitwise equal to the single-GPU op
     (``rmsnorm``, ``rmsnorm_quant``, ``rmsnorm_fp4_quantize``, ``gated_residual_next_rmsnorm``)
     on the full rows;
   * ``tp_moe_finalize_rmsnorm`` (K = 8) every peer algorithm: within the spec's bound
     (1 BF16 ulp + 2^-20 sum_k |y_k w_k|) of the reference, bitwise across algorithms;
   * ``moe_finalize_rmsnorm_allreduce`` (EP, K = 8, slot k local on rank k mod P) one-shot /
     two-shot: within the EP bound of tests/test_comm_expert_norm.py, bitwise across algorithms;
   and for every case the outputs' checksums are compared across the two ranks.
2. Optionally (default on) CUDA-graph timings: each rank captures its own graph of ``--inner``
   calls (captures serialized by a lock), both ranks replay concurrently on their own streams;
   median microseconds per call, per rank and the max over ranks. ``--variants
   'NAME:KEY=VAL,...;...'`` times each case again under those environment knobs (same on both
   ranks) and ``--rounds N`` repeats the whole set N times, alternating, for A/B of kernel
   variants (e.g. ``--variants "late:MOEFUSE_ALLGATHER_DECODE=late" --rounds 3``).

Both ranks share the GPU: every rank's workspace uses half of the SMs less one (slack: at exactly
half, 2-CTA-per-SM grids could time out), so the timings are rough (A/B between variants on the
same machine, not absolute NVLink numbers). A bounded-wait timeout
in loopback can also mean that the two ranks' grids did not fit on the GPU together. For that
reason PDL is off by default (``--pdl`` turns it on; one H200 run with it saw no stall): the
one-shot kernels let the next kernel of their stream launch before they wait for the peers,
and that early kernel's CTAs could take the SMs the other rank's kernel needs to arrive (on
separate GPUs it cannot). ``CUDA_MODULE_LOADING`` defaults to EAGER here: a kernel loaded
lazily at its first use waits for the device, i.e. for a peer's kernel that waits for us
(see ``moefuse.testing_ranks``).

Run (one GPU; about 1 minute on an H200 with an empty Triton cache)::

    PYTHONPATH=src python -m moefuse.tools.loopback_gpu_check --out $OUT
    PYTHONPATH=src python -m moefuse.tools.loopback_gpu_check --out $OUT --quick --no-timing
    PYTHONPATH=src python -m moefuse.tools.loopback_gpu_check --out $OUT --families ar_norm \
        --verbose

Writes ``$OUT/loopback_gpu_check.json`` (rewritten after every family) and prints one PASS /
FAIL / SKIP line per case. Exit status: 0 if every case that ran passed, 1 otherwise, 2 when no
CUDA device is usable, 3 when a family hung past its bound (the process then exits at once).
``--device cpu`` runs the same code in the Triton interpreter (a dry run of the script itself,
e.g. ``--hidden 64 --tokens 1,5``; no timings). ``--verbose`` traces every call of every rank
and prints the ranks' stacks when a call takes over 3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
import traceback

from moefuse import knobs as _knobs
from moefuse.tools import loopback_families as fams

P = 2
FAMILY_NAMES = tuple(fams.FAMILIES)
CAPTURE_LOCK = threading.Lock()
T0 = time.monotonic()
VERBOSE = [False]


IN_CALL: dict[int, tuple[float, str]] = {}


def trace(rank, msg, in_call=False) -> None:
    """``--verbose``: one line per step and rank, with the time since start; a rank that stays
    inside a call for 3 s gets every rank thread's stack printed (where it waits)."""
    if VERBOSE[0]:
        print(f"  [{time.monotonic() - T0:7.2f} s] rank {rank}: {msg}", flush=True)
        if in_call:
            IN_CALL[rank] = (time.monotonic(), msg)
        else:
            IN_CALL.pop(rank, None)


def _watchdog() -> None:
    dumped = set()
    while True:
        time.sleep(1.0)
        for rank, (since, msg) in list(IN_CALL.items()):
            if time.monotonic() - since > 3.0 and (rank, since) not in dumped:
                dumped.add((rank, since))
                frames = sys._current_frames()
                lines = [f"  [watchdog] rank {rank} in '{msg}' for 3 s; rank threads:"]
                for t in threading.enumerate():
                    if t.name.startswith("moefuse-rank") and t.ident in frames:
                        stack = "".join(traceback.format_stack(frames[t.ident])[-12:])
                        lines.append(f"  --- {t.name} ---\n{stack}")
                print("\n".join(lines), flush=True)


# ----------------------------------------------------------------------------- scenarios (ranks)
def scenario_check(rank, world_size, fam_name, widths, tokens, deadline, timeout_s, pdl):
    """One family on this rank: per H a workspace, per M every algorithm, checked. The ranks agree
    (votes) on skipping when time is out and on stopping after a rank raised."""
    import torch.distributed as dist

    import moefuse

    fam = fams.FAMILIES[fam_name]
    dev = _current_device()
    records = []
    for h in widths:
        try:
            ws = fam.workspace(moefuse, max(tokens), h, dev, timeout_s)
        except Exception as exc:
            records.append(
                fams.record(
                    fam.name,
                    fam.op,
                    "*",
                    0,
                    h,
                    False,
                    f"workspace creation: {type(exc).__name__}: {exc}",
                )
            )
            continue
        for m in tokens:
            if not ws.vote(time.monotonic() < deadline):
                records += [
                    fams.record(
                        fam.name, fam.op, a, m, h, False, "time budget spent", status="SKIP"
                    )
                    for a in fam.algos
                ]
                continue
            crashed, algo = None, "inputs"
            try:
                case = fam.inputs(1000 * h + m, m, h, dev)
                first = None
                for algo in fam.algos:
                    # no rank may still run host work (the previous checks allocate) while a
                    # peer's kernel already waits for it: see moefuse.testing_ranks
                    dist.barrier()
                    trace(rank, f"{fam.op} {algo} M={m} H={h}: call", in_call=True)
                    outs = fam.call(moefuse, ws, rank, case, algo, pdl)
                    trace(rank, f"{fam.op} {algo} M={m} H={h}: launched")
                    # settle the call before any host work: the kernel has finished (so this
                    # rank's checks cannot stall a peer's kernel, see moefuse.testing_ranks)
                    # and a timed-out wait is reported as the fault it is, not as wrong bits
                    ws.check()
                    ok, detail = fam.check(case, outs)
                    trace(rank, f"{fam.op} {algo} M={m} H={h}: checked, ok={ok}")
                    if first is None:
                        first = outs
                    elif not all(fams.same_bits(a, b) for a, b in zip(outs, first)):
                        ok, detail = False, f"{detail}; differs bitwise from {fam.algos[0]}"
                    records.append(
                        fams.record(fam.name, fam.op, algo, m, h, ok, detail, fams.checksum(*outs))
                    )
            except Exception as exc:
                crashed = f"{type(exc).__name__}: {exc}"
                records.append(
                    fams.record(
                        fam.name,
                        fam.op,
                        algo,
                        m,
                        h,
                        False,
                        crashed + "\n" + traceback.format_exc(limit=6),
                    )
                )
            if not ws.vote(crashed is None):
                records.append(
                    fams.record(
                        fam.name,
                        fam.op,
                        "*",
                        m,
                        h,
                        False,
                        "a rank raised: the rest of this H is not run",
                    )
                )
                break
        try:
            ws.check()
        except Exception as exc:
            records.append(fams.record(fam.name, fam.op, "*", 0, h, False, f"ws.check(): {exc}"))
        ws.close()
    return records


def scenario_stress(rank, world_size, fam_name, rounds, widths, tokens, timeout_s, pdl):
    """``rounds`` times: a fresh workspace, its first call (algorithms, M and H in turn), the
    fault check, the bitwise / bound check, close. Returns per outcome the count and the first
    details: a call must never return wrong outputs without a fault, nor time out."""
    import torch.distributed as dist

    import moefuse

    fam = fams.FAMILIES[fam_name]
    dev = _current_device()
    counts = {"pass": 0, "wrong": 0, "fault": 0}
    details: list[str] = []
    for i in range(rounds):
        algo, m, h = (
            fam.algos[i % len(fam.algos)],
            tokens[i % len(tokens)],
            widths[(i // len(tokens)) % len(widths)],
        )
        ws = fam.workspace(moefuse, m, h, dev, timeout_s)
        try:
            case = fam.inputs(7919 * i + m, m, h, dev)
            dist.barrier()
            outs = fam.call(moefuse, ws, rank, case, algo, pdl)
            try:
                ws.check()
            except RuntimeError as exc:
                counts["fault"] += 1
                details.append(f"round {i} {algo} M={m} H={h}: fault: {exc}")
                continue
            ok, detail = fam.check(case, outs)
            counts["pass" if ok else "wrong"] += 1
            if not ok:
                details.append(f"round {i} {algo} M={m} H={h}: {detail}")
        finally:
            ws.close()
    return dict(family=fam.name, op=fam.op, rounds=rounds, **counts, details=details[:5])


def scenario_time(
    rank, world_size, fam_name, h, tokens, algos, deadline, timeout_s, pdl, inner, replays
):
    """CUDA-graph replays of ``inner`` calls: median microseconds per call on this rank."""
    import torch
    import torch.distributed as dist

    import moefuse

    fam = fams.FAMILIES[fam_name]
    dev = _current_device()
    ws = fam.workspace(moefuse, max(tokens), h, dev, timeout_s)
    stream = torch.cuda.current_stream()
    out, graphs = [], []  # graphs live until the workspace is closed (freeing them syncs)
    for m in tokens:
        case = fam.inputs(7 * h + m, m, h, dev)
        for algo in algos:
            if not ws.vote(time.monotonic() < deadline):
                out.append(dict(family=fam.name, algo=algo, M=m, H=h, status="SKIP"))
                continue
            err = None
            try:
                for _ in range(3):  # compile, record the launch plan, allocate
                    dist.barrier()
                    fam.call(moefuse, ws, rank, case, algo, pdl)
                stream.synchronize()
            except Exception as exc:
                err = f"warm-up: {type(exc).__name__}: {exc}"
            if ws.vote(err is None):
                dist.barrier()
                try:
                    # one capture at a time, the other ranks idle; capture_begin, not
                    # torch.cuda.graph, whose empty_cache() would free the ranks' reserves
                    with CAPTURE_LOCK, ws.capture():
                        graph = torch.cuda.CUDAGraph()
                        graphs.append(graph)
                        side = torch.cuda.Stream()
                        side.wait_stream(stream)
                        with torch.cuda.stream(side):
                            graph.capture_begin(capture_error_mode="thread_local")
                            try:
                                for _ in range(inner):
                                    fam.call(moefuse, ws, rank, case, algo, pdl)
                            finally:
                                graph.capture_end()
                        stream.wait_stream(side)
                except Exception as exc:
                    err = f"capture: {type(exc).__name__}: {exc}"
            if not ws.vote(err is None):
                out.append(
                    dict(
                        family=fam.name,
                        algo=algo,
                        M=m,
                        H=h,
                        status="FAIL",
                        detail=err or "failed on the other rank",
                    )
                )
                continue
            dist.barrier()
            for _ in range(5):
                graph.replay()
            stream.synchronize()
            dist.barrier()  # both ranks start the timed replays together
            ev = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(replays)
            ]
            for a, b in ev:
                a.record()
                graph.replay()
                b.record()
            stream.synchronize()
            us = sorted(a.elapsed_time(b) * 1e3 / inner for a, b in ev)
            try:
                ws.check()
                status, detail = "OK", ""
            except Exception as exc:
                status, detail = "FAIL", f"fault during replays: {exc}"
            out.append(
                dict(
                    family=fam.name,
                    algo=algo,
                    M=m,
                    H=h,
                    status=status,
                    detail=detail,
                    median_us=us[len(us) // 2],
                    min_us=us[0],
                )
            )
    ws.close()
    dist.barrier()
    graphs.clear()
    return out


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's records, failed where another rank failed the same case or produced other
    bits (the outputs are replicated); records only another rank has are appended."""
    rows = [dict(r) for r in per_rank[0]]
    key = lambda r: (r["algo"], r["M"], r["H"])  # noqa: E731
    index = {key(r): r for r in rows}
    for rank, other in enumerate(per_rank[1:], start=1):
        for b in other:
            a = index.get(key(b))
            if a is None:
                rows.append(dict(b, detail=f"rank {rank}: {b['detail']}"))
            elif b["status"] == "FAIL":
                if a["status"] != "FAIL":
                    a["status"], a["detail"] = "FAIL", f"rank {rank}: {b['detail']}"
                elif b["detail"] != a["detail"]:
                    a["detail"] += f"\n[rank {rank}] {b['detail']}"
            elif a["status"] == "PASS" and b["checksum"] != a["checksum"]:
                a["status"] = "FAIL"
                a["detail"] += f"; rank {rank}'s output differs bitwise from rank 0's"
    return rows


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """``--variants``: [('default', {}), (NAME, {KEY: VAL}), ...]; ValueError when malformed."""
    out = [("default", {})]
    for item in filter(None, (t.strip() for t in text.split(";"))):
        name, _, pairs = item.partition(":")
        knobs = {}
        for pair in filter(None, pairs.split(",")):
            key, eq, value = pair.partition("=")
            if not eq or not key:
                raise ValueError(f"--variants: {pair!r} in {item!r} is not KEY=VAL")
            knobs[key.strip()] = value.strip()
            try:  # a knob moefuse declares, with a value it accepts
                _knobs.parse(key.strip(), value.strip())
            except KeyError:
                raise ValueError(f"--variants: {key.strip()} is not a moefuse knob") from None
            except ValueError as exc:
                raise ValueError(f"--variants: {exc}") from None
        if not name or not knobs:
            raise ValueError(f"--variants: {item!r} needs NAME:KEY=VAL[,KEY=VAL]")
        out.append((name.strip(), knobs))
    return out


def _current_device():
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ----------------------------------------------------------------------------- driver
def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for loopback_gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="H = 4096, M in {1, 64} only")
    parser.add_argument("--no-timing", action="store_true", help="correctness only")
    parser.add_argument(
        "--families",
        default=",".join(FAMILY_NAMES),
        help=f"comma-separated subset of {','.join(FAMILY_NAMES)}",
    )
    parser.add_argument("--tokens", default="", help="comma-separated M (default 1,7,64,300)")
    parser.add_argument("--hidden", default="", help="comma-separated H (default 4096,7168)")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=200.0,
        help="wall-clock budget; cases past it are skipped (SKIP)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=30.0, help="bounded-wait timeout of the workspaces"
    )
    parser.add_argument(
        "--pdl", action="store_true", help="launch with PDL (default off: see the module docstring)"
    )
    parser.add_argument(
        "--tp-algos",
        default="auto",
        help="comma-separated tp_moe_finalize_rmsnorm algorithms to time",
    )
    parser.add_argument(
        "--moe-tokens",
        default="",
        help="comma-separated M of the MoE fusions' timings (default: those of "
        "--tokens in {1, 8, 64})",
    )
    parser.add_argument(
        "--moe-hidden",
        default="",
        help="comma-separated H of the MoE fusions' timings (default: the largest of --hidden)",
    )
    parser.add_argument(
        "--moe-algos",
        default="",
        help="comma-separated algorithms of the MoE fusions' timings: oneshot, "
        "twoshot, auto, ALGO_fp32 (accumulate='fp32') and 'chain' (the "
        "unfused moe_finalize + allreduce_residual_rmsnorm); default "
        "oneshot,twoshot",
    )
    parser.add_argument(
        "--variants",
        default="",
        help="timing variants 'NAME:KEY=VAL,KEY=VAL;NAME2:...' (environment "
        "knobs set around each timing, same on both ranks; the default "
        "variant 'default' is always timed first)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="timing rounds; each round times every variant once, in order, so "
        "variants alternate (A B A B) and drift shows",
    )
    parser.add_argument("--inner", type=int, default=10, help="calls per captured graph")
    parser.add_argument("--replays", type=int, default=50, help="timed replays per case")
    parser.add_argument(
        "--reserve-mib",
        type=int,
        default=1024,
        help="caching-allocator reserve per rank (run_loopback_ranks)",
    )
    parser.add_argument("--verbose", action="store_true", help="trace every call of every rank")
    parser.add_argument(
        "--stress",
        type=int,
        default=0,
        help="per family, this many rounds of: fresh workspace, first call, "
        "fault check, bitwise check, close (instead of the correctness sweep)",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: dry run of this script in the Triton interpreter",
    )
    return parser


def _stress_phase(
    *, args, result, save, run, families, widths, tokens, deadline, timing_deadline, path
) -> None:
    """Per family, ``--stress`` rounds of the first-call check (both ranks)."""
    # ------------------------------------------------------------------ stress
    result["stress"] = []
    for name in families if args.stress else ():
        t0 = time.monotonic()
        per_rank = run(
            scenario_stress,
            name,
            args.stress,
            widths,
            tokens,
            args.timeout_s,
            args.pdl,
            bound_s=args.stress * (4 * args.timeout_s + 10) + 60,
        )
        if per_rank is None:
            save()
            continue
        row = dict(per_rank[0], seconds=round(time.monotonic() - t0, 1))
        for rank, other in enumerate(per_rank[1:], start=1):
            for k in ("wrong", "fault"):
                row[k] = max(row[k], other[k])
            row["details"] += [f"rank {rank}: {d}" for d in other["details"]]
        result["stress"].append(row)
        status = "PASS" if row["wrong"] == 0 and row["fault"] == 0 else "FAIL"
        result["cases"].append(
            fams.record(
                name, row["op"], "stress", 0, 0, status == "PASS", "; ".join(row["details"][:3])
            )
        )
        print(
            f"STRESS {status} {row['op']:40s} {row['rounds']} rounds: {row['pass']} pass, "
            f"{row['wrong']} wrong, {row['fault']} faults ({row['seconds']} s)",
            flush=True,
        )
        save()


def _correctness_phase(
    *, args, result, save, run, families, widths, tokens, deadline, timing_deadline, path
) -> None:
    """The correctness sweep of every family, ranks merged per case."""
    # ------------------------------------------------------------------ correctness
    for name in families if not args.stress else ():
        t0 = time.monotonic()
        per_rank = run(
            scenario_check,
            name,
            widths,
            tokens,
            deadline,
            args.timeout_s,
            args.pdl,
            bound_s=max(60.0, deadline - time.monotonic() + 4 * args.timeout_s),
        )
        if per_rank is None:
            save()
            continue
        rows = merge_ranks(per_rank)
        for row in rows:
            print(
                f"{row['status']:4s} {row['op']:40s} {row['algo']:18s} M={row['M']:<4d} "
                f"H={row['H']:<5d} {row['detail'].splitlines()[0] if row['detail'] else ''}",
                flush=True,
            )
            if row["status"] == "FAIL" and "\n" in row["detail"]:
                print("     " + row["detail"].replace("\n", "\n     "), flush=True)
            if row["status"] == "FAIL" and (
                "never arrived" in row["detail"] or "gave up" in row["detail"]
            ):
                print(
                    "     (a bounded wait ran out: a kernel bug, or in loopback the two ranks' "
                    "grids did not fit on the GPU at once)",
                    flush=True,
                )
        result["cases"] += rows
        print(f"  [{name}: {time.monotonic() - t0:.1f} s]", flush=True)
        save()


def _timing_phase(
    *, args, result, save, run, families, widths, tokens, deadline, timing_deadline, path
) -> None:
    """CUDA-graph timing of every family and variant (GPU only)."""
    from moefuse.bench import harness

    # ------------------------------------------------------------------ timing
    if args.device == "cuda" and not args.no_timing:
        h_big = max(widths)
        plan = [
            (
                "ar_norm",
                h,
                [m for m in tokens if m in (1, 64, 300)] or tokens[:1],
                fams.AllReduceNorm.algos,
            )
            for h in widths
        ]
        small = [m for m in tokens if m in (1, 8, 64)] or tokens[:1]
        moe_ms = [int(t) for t in args.moe_tokens.split(",")] if args.moe_tokens else small
        moe_hs = [int(v) for v in args.moe_hidden.split(",")] if args.moe_hidden else [h_big]
        plan += [
            (
                name,
                h,
                moe_ms,
                tuple(args.moe_algos.split(",")) if args.moe_algos else fams.FAMILIES[name].algos,
            )
            for name in ("moe_finalize", "moe_reduce")
            for h in moe_hs
        ]
        plan += [
            (name, h, tokens, ("oneshot",))
            for name in fams.FAMILIES
            if name.startswith("allgather")
            for h in widths
        ]
        plan += [("tp_finalize", h_big, small, tuple(args.tp_algos.split(",")))]
        plan += [("ep_finalize", h_big, small, ("oneshot",))]
        variants = parse_variants(args.variants)
        plan = [(r, v, entry) for entry in plan for r in range(args.rounds) for v in variants]
        for rnd, (variant, knobs), (name, h, ms, algos) in plan:
            if name not in families:
                continue
            if time.monotonic() > timing_deadline:
                result["timing"].append(dict(family=name, H=h, variant=variant, status="SKIP"))
                continue
            with harness.knobs(knobs):
                per_rank = run(
                    scenario_time,
                    name,
                    h,
                    ms,
                    algos,
                    timing_deadline,
                    args.timeout_s,
                    args.pdl,
                    args.inner,
                    args.replays,
                    bound_s=max(60.0, timing_deadline - time.monotonic() + 4 * args.timeout_s),
                )
                if per_rank is None:
                    save()
                    continue
                for i, row in enumerate(per_rank[0]):
                    ranks = [p[i] for p in per_rank]
                    if all("median_us" in r for r in ranks):
                        row["median_us_per_rank"] = [round(r["median_us"], 2) for r in ranks]
                        row["median_us"] = round(max(r["median_us"] for r in ranks), 2)
                        row["min_us"] = round(max(r["min_us"] for r in ranks), 2)
                    if any(r["status"] == "FAIL" for r in ranks):
                        row["status"] = "FAIL"
                        row["detail"] = "; ".join(r.get("detail", "") for r in ranks)
                    row.update(variant=variant, round=rnd)
                    result["timing"].append(row)
                    us = (
                        f"{row['median_us']:9.2f} us (max over ranks; per rank "
                        f"{row['median_us_per_rank']})"
                        if "median_us" in row
                        else row.get("detail", "")
                    )
                    print(
                        f"TIME {row['status']:4s} {name:16s} {variant:12s} {row['algo']:18s} "
                        f"M={row['M']:<4d} "
                        f"H={row['H']:<5d} {us}",
                        flush=True,
                    )
            save()


def _summary(result, save, start, path) -> int:
    """Counts, the JSON written, the exit status."""
    n = {s: sum(c["status"] == s for c in result["cases"]) for s in ("PASS", "FAIL", "SKIP")}
    bad_timing = sum(t.get("status") == "FAIL" for t in result["timing"])
    result["summary"] = dict(n, timing_fail=bad_timing, errors=len(result["errors"]))
    save()
    print(
        f"summary: {n['PASS']} PASS, {n['FAIL']} FAIL, {n['SKIP']} SKIP; timing failures "
        f"{bad_timing}; errors {len(result['errors'])}; {time.monotonic() - start:.0f} s; "
        f"{path}",
        flush=True,
    )
    return 0 if n["FAIL"] == 0 and not result["errors"] and bad_timing == 0 else 1


def _record_env(args, result: dict, save) -> bool:
    """Versions (python, torch, triton) and the GPU into ``result["env"]``, printed; False, with
    the error recorded and saved, when ``--device cuda`` finds no CUDA device."""
    import torch

    fams.BF16 = torch.bfloat16
    env = result["env"]
    env.update(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda_available=torch.cuda.is_available(),
        device=args.device,
        cuda_module_loading=os.environ.get("CUDA_MODULE_LOADING"),
    )
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:
        env["triton"] = f"unavailable: {exc}"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            result["errors"].append("no CUDA device")
            save()
            print("FAIL: torch.cuda.is_available() is False", flush=True)
            return False
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            capability=list(torch.cuda.get_device_capability(0)),
            gpus=torch.cuda.device_count(),
            cuda=torch.version.cuda,
        )
        torch.cuda.set_device(0)
    print(f"env: {json.dumps(env)}", flush=True)
    return True


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    start = time.monotonic()
    VERBOSE[0] = args.verbose
    if args.verbose:
        threading.Thread(target=_watchdog, daemon=True).start()
    for key, value in (
        ("NCCL_NVLS_ENABLE", "0"),
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        os.environ.setdefault(key, value)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    elif os.environ.get("TRITON_INTERPRET") == "1":
        print("TRITON_INTERPRET=1 is set: unset it for the GPU run", flush=True)
        return 2
    else:  # lazy loading of a kernel at its first use waits for the device: see testing_ranks
        os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "loopback_gpu_check.json")
    result = dict(argv=sys.argv, env={}, cases=[], timing=[], errors=[])

    def save():
        result["elapsed_s"] = round(time.monotonic() - start, 1)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)

    if not _record_env(args, result, save):
        return 2
    import moefuse  # noqa: F401  (import errors show here, before any thread starts)
    from moefuse.testing_ranks import run_loopback_ranks

    dev = "cuda:0" if args.device == "cuda" else "cpu"
    tokens = (
        [int(t) for t in args.tokens.split(",")]
        if args.tokens
        else ([1, 64] if args.quick else [1, 7, 64, 300])
    )
    widths = (
        [int(v) for v in args.hidden.split(",")]
        if args.hidden
        else ([4096] if args.quick else [4096, 7168])
    )
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILY_NAMES]
    if unknown:
        parser.error(f"unknown families {unknown}")
    deadline = start + args.budget_s
    timing_deadline = start + args.budget_s + 30  # timing gets what is left, plus 30 s

    def run(fn, *fn_args, bound_s):
        """run_loopback_ranks with a bound; a hang ends the process (threads stay stuck)."""
        try:
            return run_loopback_ranks(
                fn, P, dev, *fn_args, timeout_s=bound_s, reserve_bytes=args.reserve_mib << 20
            )
        except TimeoutError as exc:
            result["errors"].append(f"{fn.__name__}{fn_args[:1]}: {exc}")
            save()
            print(f"HANG: {exc}; results so far in {path}", flush=True)
            sys.stdout.flush()
            os._exit(3)
        except Exception as exc:  # a rank raised outside the per-case handling
            result["errors"].append(f"{fn.__name__}{fn_args[:1]}: {exc}")
            print(f"ERROR in {fn.__name__}{fn_args[:1]}:\n{exc}", flush=True)
            return None

    ctx = dict(
        args=args,
        result=result,
        save=save,
        run=run,
        families=families,
        widths=widths,
        tokens=tokens,
        deadline=deadline,
        timing_deadline=timing_deadline,
        path=path,
    )
    _stress_phase(**ctx)
    _correctness_phase(**ctx)
    _timing_phase(**ctx)
    return _summary(result, save, start, path)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    # a thread stuck in a kernel wait would block interpreter shutdown: leave at once
    os._exit(code)
