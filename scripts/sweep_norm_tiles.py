"""Time the norm kernels under several tile choices on the GPU and print register use.

Used to pick the constants of moefuse/norm/tiles.py and moefuse/norm/triton.py (the choice must
stay a function of the width only). Run: PYTHONPATH=src python3 scripts/sweep_norm_tiles.py
"""

import torch

import moefuse
from moefuse.bench import harness
from moefuse.norm import gated, tiles
from moefuse.norm import triton as nt

BF = torch.bfloat16


def _sets(m, h):
    out = []
    for _ in range(harness.rotation_sets(12 * m * h)):
        out.append((torch.randn(m, h, device="cuda").to(BF),
                    torch.randn(m, h, device="cuda").to(BF),
                    torch.randn(m, h, device="cuda"), torch.empty(m, h, device="cuda"),
                    torch.empty(m, h, device="cuda", dtype=BF)))  # fmt: skip
    return out


def _time(op, sets, w, a):
    n = len(sets)
    if op == "add":
        fn = lambda i: moefuse.fused_add_rmsnorm(sets[i % n][0], sets[i % n][1], w, impl="triton")
    elif op == "gated":
        fn = lambda i: moefuse.gated_residual_rmsnorm(
            sets[i % n][0], sets[i % n][2], None, a, a, out=sets[i % n][3], impl="triton")
    else:
        fn = lambda i: moefuse.gated_residual_next_rmsnorm(
            sets[i % n][0], sets[i % n][2], w, a, a, residual_out=sets[i % n][3],
            ffn_input=sets[i % n][4], impl="triton")  # fmt: skip
    return harness.graph_time_us(fn, calls=max(20, n))


def main() -> None:
    print(f"ceiling {harness.copy_ceiling_tbs():.2f} TB/s", flush=True)
    bytes_per = {"add": 8, "gated": 10, "next": 12}
    plan = [(4096, 2048, "add"), (4096, 16384, "add"), (8192, 16384, "gated"),
            (8192, 16384, "next"), (8192, 2048, "next"), (4096, 1024, "next")]  # fmt: skip
    for h, m, op in plan:
        sets = _sets(m, h)
        w, a = torch.randn(h, device="cuda").to(BF), torch.rand(h, device="cuda")
        line = f"{op:5s} H={h} M={m:6d}"
        for warps in (4, 8, 16):
            for single in (16384, 4096):
                for evict in (True, False):
                    if single == 4096 and (h == 4096 or not evict):
                        continue
                    tiles.MAX_WARPS = warps
                    tiles.ELEMS_PER_THREAD = 1
                    tiles.MAX_SINGLE_BLOCK = single
                    tiles.CHUNK_BLOCK = min(8192, single)
                    nt.STREAM_EVICT_FIRST = evict
                    us = _time(op, sets, w, a)
                    tag = f"w{warps}{'c' if single < h else ''}{'E' if evict else ''}"
                    line += f" | {tag} {us:7.2f}us {bytes_per[op] * m * h / us / 1e6:.2f}"
        print(line, flush=True)
    for kernel in (nt._fused_add_rmsnorm_kernel, gated._gated_residual_kernel,
                   gated._gated_residual_next_kernel):  # fmt: skip
        for cache in kernel.device_caches.values():
            for ck in cache[0].values():
                md = ck.metadata
                print(kernel.fn.__name__, "warps", md.num_warps, "regs", ck.n_regs,
                      "spills", ck.n_spills)


if __name__ == "__main__":
    main()
