"""Argument checks shared by the public ops. Every failure is a ``ValueError`` naming the op and
the argument, raised before anything is written, whatever the ``impl``.

The ops are for inference: nothing records autograd history, so a tensor the op would write (an
output or an argument updated in place) that requires grad is rejected while autograd records
(:func:`check_writable`). :func:`checked` applies the checks every op shares (``enable_pdl``,
``impl``, float scalars, written tensors) before the op's own validation runs.

Checks that need real memory addresses (aliasing) are skipped while torch.compile traces with fake
tensors; they run again in eager mode.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterable, Sequence

import torch

from moefuse._fastpath import note_alias_check, note_impure
from moefuse._runtime import IMPLS

FLOAT16S = (torch.bfloat16, torch.float16)


def _dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def tracing() -> bool:
    """True while torch.compile / fake-tensor tracing runs (no real data pointers)."""
    try:
        return bool(torch.compiler.is_compiling())
    except AttributeError:  # pragma: no cover - old torch
        return False


def check_tensor(
    op: str,
    name: str,
    t,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndims: Sequence[int] | None = None,
    shape: Sequence[int] | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
) -> None:
    """Validate one tensor argument; ``shape`` entries of -1 match anything."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"moefuse.{op}: argument '{name}' must be a torch.Tensor, got {type(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(
            f"moefuse.{op}: argument '{name}' must have dtype {_dtype_names(dtypes)}, got {t.dtype}"
        )
    if ndims is not None and t.dim() not in ndims:
        raise ValueError(
            f"moefuse.{op}: argument '{name}' must have {' or '.join(map(str, ndims))} "
            f"dimensions, got shape {tuple(t.shape)}"
        )
    if shape is not None:
        ok = len(shape) == t.dim() and all(s in (-1, d) for s, d in zip(shape, t.shape))
        if not ok:
            want = tuple("*" if s == -1 else s for s in shape)
            raise ValueError(
                f"moefuse.{op}: argument '{name}' must have shape {want}, got {tuple(t.shape)}"
            )
    if device is not None and t.device != device:
        raise ValueError(
            f"moefuse.{op}: argument '{name}' is on {t.device}, expected {device} "
            "(all tensors of one call must share a device)"
        )
    if last_dim_contiguous and t.dim() >= 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"moefuse.{op}: argument '{name}' must have a contiguous last dimension "
            f"(stride(-1) == 1), got strides {tuple(t.stride())}"
        )


def check_rows_addressable(op: str, name: str, t: torch.Tensor) -> None:
    """A [..., H] tensor whose leading dims flatten to rows with one row stride."""
    if t.dim() == 3 and t.shape[0] > 1 and t.shape[1] > 1:
        if t.stride(0) != t.shape[1] * t.stride(1):
            raise ValueError(
                f"moefuse.{op}: argument '{name}' of shape {tuple(t.shape)} must have uniformly "
                f"strided rows (stride(0) == shape[1] * stride(1)), got strides {tuple(t.stride())}"
            )


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    # meta tensors have no memory (data_ptr() is 0 for all of them): their place in the storage
    start = t.storage_offset() * t.element_size() if t.is_meta else t.data_ptr()
    extent = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return start, start + extent * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when the memory spans of ``a`` and ``b`` intersect (conservative for strided views)."""
    if tracing():
        return False
    if (a.is_meta or b.is_meta) and not _same_storage(a, b):
        return False
    a0, a1 = _byte_span(a)
    b0, b1 = _byte_span(b)
    return a0 < b1 and b0 < a1 and a1 > a0 and b1 > b0


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` are the same elements (same pointer, shape and strides)."""
    if tracing():
        return a is b
    if (a.is_meta or b.is_meta) and not _same_storage(a, b):
        return False
    return (
        _byte_span(a)[0] == _byte_span(b)[0]
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def check_no_overlap(op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor) -> None:
    note_alias_check("disjoint", a, b)
    if overlaps(a, b):
        raise ValueError(f"moefuse.{op}: argument '{name_a}' must not alias '{name_b}'")


def check_alias_exact_or_disjoint(
    op: str, name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor
) -> None:
    """``a`` may be exactly ``b`` (in-place) or disjoint from it, but not partially overlapping."""
    note_alias_check("exact_or_disjoint", a, b)
    if overlaps(a, b) and not same_memory(a, b):
        raise ValueError(
            f"moefuse.{op}: argument '{name_a}' partially overlaps '{name_b}'; it must be the same "
            "tensor (in-place update) or not alias it at all"
        )


def check_outputs(op: str, outs, inputs, in_place) -> None:
    """``outs``/``inputs``: (name, tensor or None). ``in_place``: (out name, input name) pairs that
    may be the very same memory. Every pair of outputs must be disjoint; an output and an input
    must be disjoint unless listed (then exactly the same memory or disjoint)."""
    outs = [(n, t) for n, t in outs if t is not None]
    for i, (name_a, a) in enumerate(outs):
        for name_b, b in outs[i + 1 :]:
            check_no_overlap(op, name_a, a, name_b, b)
        for name_i, t in inputs:
            if t is None:
                continue
            if (name_a, name_i) in in_place:
                check_alias_exact_or_disjoint(op, name_a, a, name_i, t)
            else:
                check_no_overlap(op, name_a, a, name_i, t)


def check_real(op: str, name: str, value) -> None:
    """A finite Python int or float (bools and strings are not numbers here). Finite is tested
    by comparisons (NaN != NaN; the two infinities), not ``math.isfinite``: under
    ``torch.compile(dynamic=True)`` dynamo traces a float argument as a symbolic float, which
    comparisons accept and ``math.isfinite`` does not."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value != value
        or value in (math.inf, -math.inf)
    ):
        raise ValueError(f"moefuse.{op}: argument '{name}' must be a finite float, got {value!r}")


def check_pdl(op: str, enable_pdl) -> None:
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise ValueError(
            f"moefuse.{op}: argument 'enable_pdl' must be None, True or False, got {enable_pdl!r}"
        )


def check_impl(op: str, impl) -> None:
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"moefuse.{op}: argument 'impl' must be one of {IMPLS}, got {impl!r}")


def check_writable(op: str, name: str, t) -> None:
    """``t`` (written by the op) must not require grad while autograd records: the ops are for
    inference and an in-place write into a tensor autograd tracks would corrupt its graph."""
    if isinstance(t, torch.Tensor) and t.requires_grad:
        # grad mode is no part of a launch plan's guards: such a call is never replayed
        note_impure("a written tensor requires grad")
        if torch.is_grad_enabled():
            raise ValueError(
                f"moefuse.{op}: argument '{name}' requires grad, but moefuse ops are for "
                "inference (no autograd) and write it; pass a tensor that does not require grad "
                "or call under torch.no_grad() / torch.inference_mode()"
            )


def checked(*, writes: Sequence[str] = (), reals: Sequence[str] = ()):
    """Decorate a public op with the checks all ops share, run before its own validation:
    ``enable_pdl`` (None or a bool) and ``impl`` when the op has them, every parameter in
    ``reals`` (:func:`check_real`) and every tensor passed in ``writes`` (the outputs and the
    arguments updated in place, :func:`check_writable`). Applied under :func:`fast_op`, so a
    replayed launch plan (whose signature passed these checks) does not pay for them."""

    def wrap(fn):
        sig = inspect.signature(fn)
        names = list(sig.parameters)
        op = fn.__name__

        def slot(name: str):
            p = sig.parameters[name]
            pos = names.index(name) if p.kind is p.POSITIONAL_OR_KEYWORD else None
            return name, pos, p.default

        flags = [slot(n) for n in ("enable_pdl", "impl") if n in names]
        real_slots = [slot(n) for n in reals]
        write_slots = [slot(n) for n in writes]

        @functools.wraps(fn)
        def checked_op(*args, **kwargs):
            def get(name, pos, default):
                if pos is not None and pos < len(args):
                    return args[pos]
                return kwargs.get(name, default)

            for name, pos, default in flags:
                value = get(name, pos, default)
                (check_pdl if name == "enable_pdl" else check_impl)(op, value)
            for name, pos, default in real_slots:
                check_real(op, name, get(name, pos, default))
            for name, pos, default in write_slots:
                check_writable(op, name, get(name, pos, default))
            return fn(*args, **kwargs)

        return checked_op

    return wrap


def check_eps(op: str, name: str, eps) -> None:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0 or eps != eps:
        raise ValueError(
            f"moefuse.{op}: argument '{name}' must be a non-negative float, got {eps!r}"
        )


def accepts(check: Callable[..., None], *args) -> bool:
    """True when ``check(*args)`` raises no ValueError: the argument half of every ``supports_*``
    helper (the other half asks whether a kernel can run on the device)."""
    try:
        check(*args)
    except ValueError:
        return False
    return True
