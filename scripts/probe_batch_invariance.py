"""Where does a row's output depend on more than the row? A GPU probe of the norm family's
batch invariance, written after tests/test_norm_gpu.py failed once (2026-12-02, gated_next FP16,
64 columns, tensor alpha, M = 16384: the row alone differed by one ulp from the same row in the
batch, in one element of ffn_input).

For each op and width, on fresh random rows (M rows), it counts rows whose bits change when
  roll   : the batch is rolled by one row (every row moves to another slot of its tile),
  alone  : the row is computed alone (M = 1), for ``--alone`` rows spread over the batch,
  router : (gated_next only) router_input is not requested (the kernel's other variant),
  rerun  : the same call is repeated (a race would show here).
Nothing is timed. First result (notes/norm.md, "ffn_input with / without router_input"): roll,
alone and rerun never
differed; gated_next's ffn_input differed with and without router_input on one-pass tiles
(<= 2048 columns) until the router kernel stored residual_out last; 0 rows since.
Run: PYTHONPATH=src python scripts/probe_batch_invariance.py [--widths 64,128] [--tokens 16384]
[--rounds 3] [--alone 64]; prints one line per case and a total (CPU: TRITON_INTERPRET=1, small
--tokens).
"""

from __future__ import annotations

import argparse

import torch

import moefuse

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: set TRITON_INTERPRET=1


def _rand(*shape, dtype):
    return torch.randn(*shape, device=DEV).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()])


def _rows_differ(a, b) -> int:
    """Rows of a and b ([M, ...] tensors or tuples of them) that differ in any bit."""
    a = a if isinstance(a, tuple) else (a,)
    b = b if isinstance(b, tuple) else (b,)
    bad = torch.zeros(a[0].shape[0], dtype=torch.bool, device=a[0].device)
    for x, y in zip(a, b):
        bad |= (_bits(x) != _bits(y)).reshape(x.shape[0], -1).any(dim=1)
    return int(bad.sum())


def _cases(width: int, dtype):
    """(name, make_inputs(M) -> inputs, run(inputs) -> outputs tuple, other run whose outputs
    must share the first ones' bits, or None); every run allocates."""
    w = _rand(width, dtype=dtype)

    def rms(x):
        return (moefuse.rmsnorm(x[0], w, impl="triton"),)

    def fused_add(x):
        a, r = x[0].clone(), x[1].clone()
        moefuse.fused_add_rmsnorm(a, r, w, impl="triton")
        return a, r

    a32, be = torch.rand(width, device=DEV), torch.rand(width, device=DEV)
    nw, pw = _rand(width, dtype=dtype), _rand(width, dtype=dtype)

    def gated(x):
        return (
            moefuse.gated_residual_rmsnorm(x[0], x[1], w, a32, be, gain_center=1.0, impl="triton"),
        )

    def gated_next(router):
        def run(x):
            rt = torch.empty_like(x[1]) if router else None
            ro, ffn = moefuse.gated_residual_next_rmsnorm(
                x[0],
                x[1],
                nw,
                a32,
                be,
                post_weight=pw,
                post_gain_center=1.0,
                router_input=rt,
                impl="triton",
            )
            return (ro, ffn) if rt is None else (ro, ffn, rt)

        return run

    scale = torch.tensor([0.05], device=DEV)

    def fp8(x):
        return (moefuse.rmsnorm_quant(x[0], w, scale, impl="triton").view(torch.int8),)

    def two(m):
        return (_rand(m, width, dtype=dtype), _rand(m, width, dtype=dtype))

    def gated_in(m):
        return (_rand(m, width, dtype=dtype), torch.randn(m, width, device=DEV))

    yield "rmsnorm", lambda m: (_rand(m, width, dtype=dtype),), rms, None
    yield "fused_add_rmsnorm", two, fused_add, None
    if dtype == torch.bfloat16:
        yield "gated_residual_rmsnorm", gated_in, gated, None
    yield "gated_next(router)", gated_in, gated_next(True), gated_next(False)
    yield "gated_next", gated_in, gated_next(False), None
    yield "rmsnorm_quant", lambda m: (_rand(m, width, dtype=dtype),), fp8, None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", default="64,96,128,256,1000,2048,2880,4096,7168")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--alone", type=int, default=64)
    args = p.parse_args()
    total = 0
    for dtype in (torch.bfloat16, torch.float16):
        for width in map(int, args.widths.split(",")):
            for name, make, run, other in _cases(width, dtype):
                counts = dict(roll=0, alone=0, router=0, rerun=0)
                for _ in range(args.rounds):
                    x = make(args.tokens)
                    out = run(x)
                    counts["rerun"] += _rows_differ(out, run(x))
                    rolled = run(tuple(t.roll(1, 0) for t in x))
                    counts["roll"] += _rows_differ(tuple(t.roll(1, 0) for t in out), rolled)
                    rows = torch.linspace(0, args.tokens - 1, args.alone).long().tolist()
                    for i in rows:
                        one = run(tuple(t[i : i + 1] for t in x))
                        counts["alone"] += _rows_differ(one, tuple(t[i : i + 1] for t in out))
                    if other is not None:
                        counts["router"] += _rows_differ(out[:2], other(x))
                total += sum(counts.values())
                flag = "  <-- DIFFERS" if sum(counts.values()) else ""
                print(
                    f"{str(dtype)[6:]:9s} H={width:5d} {name:24s} rows differing: "
                    + " ".join(f"{k}={v}" for k, v in counts.items())
                    + flag,
                    flush=True,
                )
    print(f"TOTAL rows differing: {total}")


if __name__ == "__main__":
    main()
