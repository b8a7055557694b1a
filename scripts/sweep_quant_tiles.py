"""H200 sweep: tiles of the standalone quantizers (quant/triton.py), against the library's tile.

* fp4_quantize: ``[BLOCK_M rows, BLOCK_K blocks, 16]`` tiles (the library: 32 x 8 blocks, 4 warps,
  i.e. 256-byte pieces of 32 rows) against whole-row tiles (1-2 rows of 256 blocks) and others.
  Quantization is per 16-element block, so every tile gives the same bytes; checked bitwise.
* fp8_quantize: ``[BLOCK_M, BLOCK_N]`` elementwise tiles (the library: 4096 elements, 4 warps).

CUDA-graph replays over rotated input sets larger than L2, PDL on, one output set per input set;
an SM copy of fp4_quantize's bytes beside each case.

Run: PYTHONPATH=src python3 scripts/sweep_quant_tiles.py [4096,7168]
"""

import sys

import torch

from moefuse.bench import harness
from moefuse.quant import triton as qt

DEV = "cuda"
FP4_TILES = ((32, 8, 4), (1, 256, 4), (1, 256, 8), (2, 256, 8), (2, 128, 4), (4, 64, 4),
             (8, 32, 4), (16, 16, 4), (32, 8, 8), (1, 512, 8))  # fmt: skip
FP8_TILES = ((4, 1024, 4), (8, 1024, 8), (4, 1024, 8), (16, 1024, 8), (1, 4096, 8), (2, 4096, 16))


def time_sets(fn, sets):
    n = len(sets)
    return harness.graph_time_us(lambda i: fn(sets[i % n]), calls=max(20, n), replays=20)


def _fp4(s, gs, tile):
    qt.launch_fp4_quantize(s[0], gs, s[1], s[2], "swizzled_128x4", "fast", True, tile=tile)


def sweep(widths) -> int:
    bad = 0
    gs = torch.tensor([300.0], device=DEV)
    scale = torch.tensor([0.02], device=DEV)
    for h in widths:
        for m in (1, 128, 2048, 16384):
            nbytes = int(2.5625 * m * h)
            sets = []
            for _ in range(harness.rotation_sets(nbytes)):
                x = torch.randn(m, h, device=DEV).to(torch.bfloat16)
                sc = torch.empty(qt.scale_layout_shape(m, h // 16, "swizzled_128x4"),
                                 dtype=torch.uint8, device=DEV)  # fmt: skip
                sets.append((x, torch.empty(m, h // 2, dtype=torch.uint8, device=DEV), sc,
                             torch.empty(m, h, dtype=torch.uint8, device=DEV)))  # fmt: skip
            ref, t = None, {}
            for tile in FP4_TILES:
                s0 = sets[0]
                s0[1].fill_(0xAA)
                s0[2].fill_(0xAA)
                _fp4(s0, gs, tile)
                got = (s0[1].clone(), s0[2].clone())
                if ref is None:
                    ref = got
                elif not (torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])):
                    bad += 1
                    print(f"MISMATCH fp4 tile {tile} H={h} M={m}", flush=True)
                name = "fp4_{}x{}w{}".format(*tile)
                t[name] = time_sets(lambda s, tl_=tile: _fp4(s, gs, tl_), sets)
            t["copy"] = harness.copy_time_us(nbytes)
            for tile in FP8_TILES:
                t["fp8_{}x{}w{}".format(*tile)] = time_sets(
                    lambda s, tl_=tile: qt.launch_fp8_quantize(s[0], scale, s[3], 0, True,
                                                               tile=tl_), sets)  # fmt: skip
            print(f"H={h:5d} M={m:6d} " + " ".join(f"{n}={v:7.2f}" for n, v in t.items()),
                  flush=True)  # fmt: skip
    return bad


if __name__ == "__main__":
    print(torch.cuda.get_device_name(0), flush=True)
    widths = [int(v) for v in sys.argv[1].split(",")] if len(sys.argv) > 1 else [4096, 7168]
    print("mismatches:", sweep(widths))
