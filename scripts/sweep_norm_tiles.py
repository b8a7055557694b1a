"""Time the norm kernels under several tile choices (warps per row) on the GPU.

Used to pick the constants of moefuse/norm/tiles.py; the choice must stay a function of the width
only. Run: PYTHONPATH=src python3 scripts/sweep_norm_tiles.py
"""

import torch

import moefuse
from moefuse.bench import harness
from moefuse.norm import tiles


def main() -> None:
    print(f"ceiling {harness.copy_ceiling_tbs():.2f} TB/s")
    bf = torch.bfloat16
    for h in (4096, 8192):
        for m in (1, 128, 2048, 16384):
            sets = []
            for _ in range(harness.rotation_sets(12 * m * h)):
                sets.append((torch.randn(m, h, device="cuda").to(bf),
                             torch.randn(m, h, device="cuda").to(bf),
                             torch.randn(m, h, device="cuda"),
                             torch.empty(m, h, device="cuda"),
                             torch.empty(m, h, device="cuda", dtype=bf)))  # fmt: skip
            w, a = torch.randn(h, device="cuda").to(bf), torch.rand(h, device="cuda")
            n = len(sets)
            line = f"H={h} M={m:6d}"
            for ept in (4, 8, 16, 32):
                tiles.ELEMS_PER_THREAD = ept
                t_add = harness.graph_time_us(
                    lambda i, n=n, sets=sets: moefuse.fused_add_rmsnorm(
                        sets[i % n][0], sets[i % n][1], w, impl="triton"), calls=max(20, n))
                t_next = harness.graph_time_us(
                    lambda i, n=n, sets=sets: moefuse.gated_residual_next_rmsnorm(
                        sets[i % n][0], sets[i % n][2], w, a, a, residual_out=sets[i % n][3],
                        ffn_input=sets[i % n][4], impl="triton"), calls=max(20, n))
                warps = tiles.row_tile(h).num_warps
                line += (f" | ept={ept} w={warps}: add {t_add:7.2f}us "
                         f"({8 * m * h / t_add / 1e6:.2f} TB/s) next {t_next:7.2f}us "
                         f"({12 * m * h / t_next / 1e6:.2f})")
            print(line, flush=True)
    tiles.ELEMS_PER_THREAD = 8
    for d in (64, 128):
        for m in (2048, 16384):
            x = torch.randn(m, 32, d, device="cuda").to(bf)
            g = torch.randn(m, 32, d, device="cuda").to(bf)
            line = f"gate D={d} M={m}"
            for target in (1024, 2048, 4096, 8192):
                tiles.TILE_ELEMENTS = target
                t = harness.graph_time_us(
                    lambda i: moefuse.rmsnorm_sigmoid_gate(x, g, impl="triton"), calls=20)
                line += f" | tile={target}: {t:7.2f}us ({6 * x.numel() / t / 1e6:.2f} TB/s)"
            print(line, flush=True)


if __name__ == "__main__":
    main()
