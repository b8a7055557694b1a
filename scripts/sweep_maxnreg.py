"""H200 experiment (2026-11-30): more programs per SM for the one-pass norm tiles by capping
registers (ptxas maxnreg). A cap changes no arithmetic (same tile, warps and tree), so the bits
must stay; it only lets more row tiles be resident per SM, i.e. more loads in flight, which is
where torch.compile's looped kernel (32 registers, 4 x 16 warps per SM) beats the one-pass tile
at M = 16384 (notes/norm.md). sm_90a registers of the one-pass tiles (scripts/
compile_check.py): fused_add 4096 64 (4 programs of 8 warps per SM), 8192 125 (2); rmsnorm /
sigmoid gate 4096 54-55 (4); sigmoid 32 x 128 rows share tiles of 2048 elements.

Per (op, width, cap): bitwise check against the uncapped launch at M = 1 / 7 / 300, then
CUDA-graph replay times at M = 1 / 128 / 1024 / 2048 / 16384 (inputs rotated over sets > L2).

Run: PYTHONPATH=src python3 scripts/sweep_maxnreg.py
"""

import torch

import moefuse
from moefuse.bench import harness
from moefuse.norm import triton as nt

DEV, BF = "cuda", torch.bfloat16
CAP = {"value": None}
_orig_launch_kwargs = nt._launch_kwargs


def _capped_launch_kwargs(tile, use_pdl):
    out = _orig_launch_kwargs(tile, use_pdl)
    if CAP["value"] is not None:
        out = {**out, "maxnreg": CAP["value"]}
    return out


nt._launch_kwargs = _capped_launch_kwargs

#: (op, shape of one row, caps to try)
CASES = (
    ("sigmoid", (32, 64), (None, 48, 40, 32)),
    ("sigmoid", (32, 128), (None, 48, 40, 32)),
    ("sigmoid", (16, 256), (None, 40, 32)),
    ("fused_add", (4096,), (None, 56, 48, 40)),
    ("fused_add", (8192,), (None, 96, 80, 64)),
)


def _run(op, s, w):
    if op == "fused_add":
        moefuse.fused_add_rmsnorm(s[0], s[1], w, enable_pdl=True)
    else:
        moefuse.rmsnorm_sigmoid_gate(s[0], s[1], enable_pdl=True)


def _sets(op, m, shape, k):
    return [(torch.randn(m, *shape, device=DEV).to(BF), torch.randn(m, *shape, device=DEV).to(BF))
            for _ in range(k)]  # fmt: skip


def main() -> None:
    print(torch.cuda.get_device_name(0), flush=True)
    bad = 0
    for op, shape, caps in CASES:
        width = shape[0] * (shape[1] if len(shape) > 1 else 1)
        w = torch.randn(shape[-1], device=DEV).to(BF)
        for cap in caps[1:]:
            for m in (1, 7, 300):
                base = _sets(op, m, shape, 1)[0]
                outs = []
                for c in (None, cap):
                    CAP["value"] = c
                    s = tuple(t.clone() for t in base)
                    _run(op, s, w)
                    outs.append(s)
                CAP["value"] = None
                same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                           for a, b in zip(*outs))  # fmt: skip
                bad += not same
                if not same:
                    print(f"MISMATCH {op} {shape} cap={cap} M={m}", flush=True)
        for m in (1, 128, 1024, 2048, 16384):
            per = 8 if op == "fused_add" else 6
            k = harness.rotation_sets(per * m * width)
            sets = _sets(op, m, shape, k)
            t = {}
            for cap in caps:
                CAP["value"] = cap
                t[f"cap{cap or '-'}"] = harness.graph_time_us(
                    lambda i: _run(op, sets[i % k], w), calls=max(20, k), replays=20)
            CAP["value"] = None
            print(f"{op:9s} {'x'.join(map(str, shape)):7s} M={m:6d} " +
                  " ".join(f"{n}={v:7.2f}" for n, v in t.items()), flush=True)  # fmt: skip
    print("bitwise mismatches:", bad)


if __name__ == "__main__":
    main()
