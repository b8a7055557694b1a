"""Plumbing of the multi-GPU benchmarks: one process per GPU, spawned here or started by torchrun.

``python -m moefuse bench all-reduce|allgather|moe-reduction|expert-norm --world-size P``
share it: :func:`run_ranks` runs ``worker(rank, P, args,
init_method)`` in P spawned processes (a TCP rendezvous on a free local port) or, under torchrun,
in place; the worker calls :func:`init_rank` first. NVLink multicast stays off everywhere.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch

NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def no_multicast() -> None:
    for key, value in NO_MULTICAST.items():
        os.environ.setdefault(key, value)


def rank_parser(prog: str, quick_help: str, *, save: bool = True) -> argparse.ArgumentParser:
    """The arguments every multi-GPU benchmark takes (``--world-size``, ``--save``, ``--out``,
    ``--quick``, ``--tokens``, ``--hidden``, read by :func:`run_ranks` and
    :func:`token_and_width_lists`); a benchmark adds its own after these."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--world-size", type=int, default=2, help="GPUs / processes (spawned)")
    if save:
        parser.add_argument("--save", action="store_true", help="write JSON + PNG under --out")
    parser.add_argument("--out", default="bench/results", help="results directory")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--tokens", default="", help="comma-separated M values")
    parser.add_argument("--hidden", default="", help="comma-separated H values")
    return parser


def token_and_width_lists(args, tokens, widths, quick_tokens) -> tuple[list[int], list[int]]:
    """M and H values of a run: ``--tokens`` / ``--hidden``, else the quick or full defaults."""
    m = (
        [int(t) for t in args.tokens.split(",")]
        if args.tokens
        else (list(quick_tokens) if args.quick else list(tokens))
    )
    h = (
        [int(v) for v in args.hidden.split(",")]
        if args.hidden
        else ([4096] if args.quick else list(widths))
    )
    return m, h


def init_rank(rank: int, world_size: int, init_method: str | None) -> torch.device:
    """Select this rank's GPU and join the NCCL group (env rendezvous under torchrun)."""
    no_multicast()
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", rank))
    torch.cuda.set_device(local)
    if init_method is None:
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world_size)
    return torch.device("cuda", local)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(worker, args) -> int:
    """``worker(rank, world_size, args, init_method)`` on ``args.world_size`` GPUs; 2 when the
    machine has fewer GPUs. ``worker`` must be a module-level function (it is pickled)."""
    no_multicast()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return 0
    if torch.cuda.device_count() < args.world_size:
        print(f"needs {args.world_size} GPUs, found {torch.cuda.device_count()}")
        return 2
    import torch.multiprocessing as mp

    init = f"tcp://127.0.0.1:{free_port()}"
    mp.start_processes(
        worker, args=(args.world_size, args, init), nprocs=args.world_size, start_method="spawn"
    )
    return 0
