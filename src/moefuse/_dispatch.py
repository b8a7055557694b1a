"""Custom ops that cost nothing when nothing is tracing.

Every moefuse op is a ``torch.library`` custom op so that torch.compile, export, fake tensors and
dispatch modes see its true data flow (schema, ``mutates_args``, fake implementation). Going
through the dispatcher costs tens of microseconds per eager call, though, for nothing: eager code
only needs the Python function behind the op. :func:`custom_op` registers the op as usual and
returns it with one change: calling it runs the Python function directly unless something is
tracing (:func:`tracing_active`). Same function, same kernel, same bits either way.
"""

from __future__ import annotations

import threading

import torch
from torch._library.custom_ops import CustomOpDef

_is_compiling = torch.compiler.is_compiling
#: True only while dynamo traces (it folds the call to a constant); eager, a function returning
#: False: 0.1 µs cheaper a call than ``is_compiling`` (whose other case, non-strict export, runs
#: under a dispatch mode or on fake tensors, which the launch plans' guard refuses anyway)
_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_dispatch_depth = torch._C._len_torch_dispatch_stack


class _OwnModes(threading.local):
    """How many of this thread's active dispatch modes are moefuse's own and do not count as
    tracing (the fast path's launch recorder). Per thread, as torch's dispatch-mode stack is:
    a count shared by threads (ranks as threads of one process) loses updates and then
    misjudges every other thread."""

    depth = 0


_own_modes = _OwnModes()


def tracing_active() -> bool:
    """True under torch.compile / export tracing or while a foreign dispatch mode is active
    (FakeTensorMode, FlopCounterMode, ...): then calls must go through the dispatcher."""
    return _is_compiling() or _dispatch_depth() > _own_modes.depth


class DirectCustomOp(CustomOpDef):
    """A :class:`CustomOpDef` whose eager calls skip the dispatcher (see the module docstring).
    ``torch.library.opcheck`` and ``register_fake`` work on it as on any custom op."""

    def __call__(self, *args, **kwargs):
        if tracing_active():
            return self._opoverload(*args, **kwargs)
        return self._init_fn(*args, **kwargs)


def custom_op(name: str, *, mutates_args):
    """``torch.library.custom_op(name, mutates_args=...)`` returning a :class:`DirectCustomOp`."""

    def register(fn):
        op = torch.library.custom_op(name, mutates_args=mutates_args)(fn)
        op.__class__ = DirectCustomOp
        return op

    return register
