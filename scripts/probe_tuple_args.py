"""What Triton takes as tuple kernel arguments, and what binding them costs on the host
(notes/kernel-arguments.md).

``TRITON_INTERPRET=1 python scripts/probe_tuple_args.py``: a toy kernel with a tuple of
tensors, of ints, of floats and a constexpr tuple, and a tuple handed to a device function, run
in the interpreter and compared with torch. ``python scripts/probe_tuple_args.py`` (no
interpreter, no GPU needed): the same kernel bound by Triton's binder for an sm_90 backend (the
specialisation of each tuple element), compiled for sm_90a (its PTX parameters), and the
binder's time per call with 13 flat arguments against 3 + two 5-tuples.
"""

import argparse
import os
import timeit

import torch
import triton
import triton.language as tl


@triton.jit
def _k(ptrs, dims, scal, FLAGS: tl.constexpr, BLOCK: tl.constexpr):
    x_ptr, y_ptr = ptrs
    n, st = dims
    a, b = scal
    cols = tl.arange(0, BLOCK)
    m = cols < n
    x = tl.load(x_ptr + cols * st, mask=m, other=0.0)
    if FLAGS[0]:
        x = x * a
    if FLAGS[1] == 2:
        x = x + b
    tl.store(y_ptr + cols, x, mask=m)


@triton.jit
def _k_dev(dims):
    return dims[0] * dims[1]


@triton.jit
def _k2(y_ptr, dims, BLOCK: tl.constexpr):
    v = _k_dev(dims) + len(dims)  # a tuple handed whole to a device function, and its length
    tl.store(y_ptr + tl.arange(0, BLOCK), tl.full([BLOCK], v, tl.int32))


@triton.jit
def _flat(p0, p1, p2, a, b, c, d, e, f0, f1, f2, f3, f4, BLOCK: tl.constexpr):
    pass


@triton.jit
def _grouped(p0, p1, p2, ints, floats, BLOCK: tl.constexpr):
    pass


def interpreted():
    x = torch.arange(8, dtype=torch.float32)
    y = torch.zeros(8)
    _k[(1,)]((x, y), (8, 1), (2.0, 0.5), (True, 2), BLOCK=8)
    print("tuples of tensors / ints / floats, constexpr tuple:", torch.equal(y, x * 2 + 0.5))
    y = torch.zeros(4)
    _k[(1,)]((x, y), (4, 2), (3.0, 0.0), (False, 0), BLOCK=4)
    print("other constexpr tuple:", torch.equal(y, x[::2][:4]))
    z = torch.zeros(4, dtype=torch.int32)
    _k2[(1,)](z, (3, 5, 7), BLOCK=4)
    print("tuple to a device function (3 * 5 + 3 = 18):", z.tolist())


def compiled():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    x = torch.empty(64, dtype=torch.bfloat16)
    binder = create_function_from_signature(_k.signature, _k.params, backend)
    bound, spec, kw = binder((x, x), (4096, 16), (2.0, 0.5), (True, 2), BLOCK=64)
    print("specialisation:", spec)
    _, sig, consts, attrs = _k._pack_args(backend, kw, bound, spec, kw)
    print("signature:", sig, "\nconstexprs:", consts, "\nattributes:", attrs)
    ck = triton.compile(ASTSource(_k, sig, consts, attrs), target=target, options={"num_warps": 4})
    print(
        "PTX parameters:",
        [ln.strip() for ln in ck.asm["ptx"].splitlines() if ln.strip().startswith(".param")],
    )
    bf = create_function_from_signature(_flat.signature, _flat.params, backend)
    bg = create_function_from_signature(_grouped.signature, _grouped.params, backend)
    ints, floats, n = (4096,) * 5, (1.0, 1e-6, 1e-6, 0.0, 0.0), 20000
    for _ in range(3):
        tf = (
            min(timeit.repeat(lambda: bf(x, x, x, *ints, *floats, BLOCK=64), number=n, repeat=5))
            / n
        )
        tg = min(timeit.repeat(lambda: bg(x, x, x, ints, floats, BLOCK=64), number=n, repeat=5)) / n
        print(f"binder per call: flat {tf * 1e6:.2f} us, grouped {tg * 1e6:.2f} us")


if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="TRITON_INTERPRET=1: run the toy kernels in the interpreter; "
        "else compile them offline for sm_90a.",
    ).parse_args()
    interpreted() if os.environ.get("TRITON_INTERPRET") == "1" else compiled()
