"""Backend selection shared by every op: which implementation runs, whether PDL is on.

Contract (DESIGN.md):
* ``impl="reference"`` always runs the PyTorch reference.
* ``impl="triton"`` runs the Triton kernel or raises ``RuntimeError`` saying why; it never falls
  back. On CPU tensors it needs ``TRITON_INTERPRET=1`` (set before triton is imported) and then runs
  the real kernel in Triton's interpreter.
* ``impl="auto"`` runs the kernel on CUDA devices where ``supports_*`` is True, and otherwise the
  reference, logging the reason once per (op, reason).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

logger = logging.getLogger("moefuse")

IMPLS = ("auto", "triton", "reference")
_logged: set[tuple[str, str]] = set()


def interpreter_active() -> bool:
    """True when Triton kernels run in the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached per device); 1 off CUDA, so that the
    interpreter (CI) runs the persistent row loops with several tiles per program."""
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


def constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing torch._dynamo (and, with
    it, Triton) at ``import moefuse``: the mark it sets is this attribute, read by dynamo when it
    traces a call (tests/test_import.py checks that dynamo still sees it)."""
    fn._dynamo_marked_constant = True
    return fn


@constant_result
def kernel_device_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on ``device`` (None when they can)."""
    if not triton_importable():
        return "triton is not installed"
    if device.type == "cuda":
        if interpreter_active():
            return "TRITON_INTERPRET=1 is set, which runs kernels on CPU tensors only"
        cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
        if cap < (9, 0):
            return f"device capability {cap} is below SM90"
        return None
    if device.type == "cpu":
        if interpreter_active():
            return None
        return "CPU tensors need TRITON_INTERPRET=1 (set before triton is imported)"
    return f"device type {device.type!r} is not supported"


def pdl_available(device: torch.device) -> bool:
    """Programmatic dependent launch needs a real SM90+ GPU (the interpreter has no PDL)."""
    return kernel_device_reason(device) is None and device.type == "cuda"


def resolve_pdl(enable_pdl: bool | None, device: torch.device, default: bool = True) -> bool:
    """``None`` means the op's measured ``default`` (the tables beside the tile policies, e.g.
    ``moefuse.moe.tiles.pdl_default``) where the device supports PDL; ``True`` forces it on where
    supported (off elsewhere), ``False`` off."""
    if enable_pdl is None:
        return default and pdl_available(device)
    if enable_pdl:
        return pdl_available(device)
    return False


def pdl_launch_kwargs(use_pdl: bool) -> dict:
    """Launch options of a kernel launched with programmatic dependent launch when ``use_pdl``
    (nothing otherwise: the option is passed only when it is on)."""
    return {"launch_pdl": True} if use_pdl else {}


def log_once(op: str, message: str) -> None:
    key = (op, message)
    if key not in _logged:
        _logged.add(key)
        logger.info("moefuse.%s: %s", op, message)


def choose_impl(op: str, impl: str, device: torch.device, unsupported_reason: str | None) -> str:
    """Return ``"triton"`` or ``"reference"`` per the contract in the module docstring.

    ``unsupported_reason`` is None when the kernel can run these tensors on this device.
    """
    if impl not in IMPLS:
        raise ValueError(f"moefuse.{op}: argument 'impl' must be one of {IMPLS}, got {impl!r}")
    if impl == "reference":
        return "reference"
    if impl == "triton":
        if unsupported_reason is not None:
            raise RuntimeError(f"moefuse.{op}: impl='triton' cannot run: {unsupported_reason}")
        return "triton"
    if device.type != "cuda":
        return "reference"
    if unsupported_reason is not None:
        log_once(op, f"falling back to the PyTorch reference: {unsupported_reason}")
        return "reference"
    return "triton"
