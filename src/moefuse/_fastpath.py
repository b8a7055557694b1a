"""Launch plans: an eager call whose signature was seen before replays its kernel launches.

The host side of an op (validate, allocate, choose the implementation and tile, build constexpr
dicts, look up Triton's compiled kernel, bind arguments) depends only on the call's *signature*:
shapes, strides, dtypes and devices of its tensors and the values of its other arguments. So the
first call with a signature runs the op normally (the "slow path") while a recorder watches, and
turns what it saw into a plan; later calls with the same signature run the plan, which does only
what changes per call: read the tensors' addresses, allocate fresh outputs, check aliasing and
alignment, and hand the recorded launches to Triton's C launcher with the new addresses. Same
compiled kernels, same arguments, same bits.

Lookup, cheapest first: the dict key holds the first argument's shape (the token count), the
tensors' Python types and the other arguments' values, the parameters with defaults as one part
per kind (positional, keyword-only): a marker when every one was left at its default object (a
chain of identity tests), else the tuple of their parts. The plan's first line then checks
every tensor's dtype, device, shape, strides, ``requires_grad`` and dispatch keys in one C++
call (dynamo's tensor guard, ~0.35 µs for any number of tensors, where a Python tuple per tensor
cost ~0.4 µs each).

A plan is only built when the slow path was pure launch work, as in a CUDA-graph capture:
* every torch op it ran was an allocation (``empty*``) or a view (a dispatch mode watches);
* every tensor a kernel got, at the top level, inside a tuple argument or under a host-side
  TMA descriptor (``TensorDescriptor``), lies inside one of the call's tensor arguments or
  allocations (found by address, kept as that source plus a byte offset; a tuple is replayed as
  a tuple of the same structure, a descriptor as its fields over the new address);
* what it returned is None, an argument, an allocation, or a tuple of these;
* the aliasing checks of the validation can be re-run from addresses (``_validate`` reports them).
Anything else (the PyTorch reference, a torch.distributed call, a scratch tensor of unknown
origin, host-side reads) leaves the signature on the slow path for good: still correct, only not
faster. A plan replays only when its guards hold: 16-byte aligned addresses (Triton specialised
the kernels on that), the aliasing checks, the same exact-alias pattern as recorded, the same
current CUDA device, and ``guards`` of the op (a communication workspace that is still healthy).
Otherwise the call takes the slow path, which raises the usual error or records another plan
(up to ``MAX_PLANS_PER_KEY`` per signature).

Plans are skipped while anything traces: dynamo (``torch.compiler.is_dynamo_compiling``, which
it folds to True), any dispatch mode that is not the recorder (AOT tracing, export, fake tensor
modes), and tensor subclasses such as fake tensors (no key admits them); then the custom op runs
as before. On CUDA a plan calls the compiled kernels' launcher directly with integer addresses;
under ``TRITON_INTERPRET=1`` the same plan relaunches through Triton's interpreter (how CI tests
the plans).

``clear()`` drops every plan (needed after changing module-level tile policies or thresholds at
run time); ``MOEFUSE_FASTPATH=0`` turns plans off (read at the first call of an op).
"""

from __future__ import annotations

import inspect
import logging
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from moefuse import _dispatch, knobs

logger = logging.getLogger("moefuse")
MISS = object()
MAX_PLANS_PER_KEY = 8
MAX_KEYS_PER_OP = 4096
#: plans on; the first recording of any op sets it from MOEFUSE_FASTPATH (moefuse.knobs), so the
#: variable is read at the first call, not at import
ENABLED = [True]

_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
_SCALAR_TYPES = frozenset({int, float, bool, str, type(None), torch.dtype})
_PLAIN_TYPES = frozenset({str, type(None), torch.dtype})
_aten = torch.ops.aten
_ALLOC_OPS = frozenset(
    {
        _aten.empty.memory_format,
        _aten.empty_like.default,
        _aten.empty_strided.default,
        _aten.new_empty.default,
        _aten.new_empty_strided.default,
    }
)
_caches: list[dict] = []
_DEFAULT = type("_Default", (), {"__repr__": lambda self: "<default>"})()  # key of a default


class _Local(threading.local):
    rec = None  # the recording of the slow call running on this thread, if any


_local = _Local()


def clear() -> None:
    """Forget every plan (the next call of each signature records again)."""
    for cache in _caches:
        cache.clear()


def forget(obj) -> None:
    """Drop the plans whose signature holds ``obj`` (a workspace being closed: its plans hold
    its tensors); the other plans stay."""

    def holds(part) -> bool:  # key parts nest tuples: (type, value), folded keyword parts
        return part is obj or (part.__class__ is tuple and any(holds(p) for p in part))

    for cache in _caches:
        for key in [k for k in cache if any(holds(part) for part in k)]:
            cache.pop(key, None)


def refusals(op_fn) -> list[str]:
    """Why signatures of a decorated op were left on the slow path (diagnostics, tests)."""
    return [p.why for plans in op_fn._moefuse_plans.values() for p in plans if isinstance(p, _Slow)]


def plan_count(op_fn) -> int:
    """Plans recorded so far for a public op decorated with :func:`fast_op` (tests)."""
    return sum(
        sum(not isinstance(p, _Slow) for p in plans) for plans in op_fn._moefuse_plans.values()
    )


# ----------------------------------------------------------------------------- recording
def launch(kernel, grid, *args, **consts) -> None:
    """``kernel[grid](*args, **consts)``; recorded when a slow call is being watched."""
    rec = _local.rec
    if rec is None:
        kernel[grid](*args, **consts)
        return
    with _disable_current_modes():  # Triton's own torch calls (interpreter copies) are not ours
        compiled = kernel[grid](*args, **consts)
    if _stream_of(args) != rec.stream:
        rec.side_stream = True  # ordering across streams (events) is host work a plan cannot see
    rec.launches.append((kernel, compiled, grid, args, consts))


def _stream_of(args):
    """The current stream of the first CUDA tensor argument's device (None off CUDA)."""
    for a in _tensors(args):
        return torch.cuda.current_stream(a.device).cuda_stream if a.is_cuda else None
    return None


def _tensors(args):
    """The tensors among ``args``, walking into tuples (a kernel may take a tuple of pointers),
    depth first, in order."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, tuple):
            yield from _tensors(a)


def note_impure(why: str) -> None:
    """The call being recorded does work a plan cannot repeat, which the dispatch mode may not
    see (a torch.distributed collective: a threaded group runs it on another rank's thread)."""
    rec = _local.rec
    if rec is not None and rec.impure is None:
        rec.impure = why


def note_alias_check(kind: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """``_validate`` reports each aliasing check: "disjoint" or "exact_or_disjoint"."""
    rec = _local.rec
    if rec is not None:
        rec.alias_checks.append((kind, a, b))


class _Recorder(TorchDispatchMode):
    """Watches the torch ops of one slow call: allocations are kept, views allowed, anything else
    makes the call impure (not replayable)."""

    def __init__(self):
        super().__init__()
        self.launches: list = []
        self.allocs: list[torch.Tensor] = []
        self.alias_checks: list = []
        self.impure: str | None = None
        self.side_stream = False
        self.stream = (
            torch.cuda.current_stream().cuda_stream
            if torch.cuda.is_available() and torch.cuda.is_initialized()
            else None
        )

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOC_OPS:
            self.allocs.append(out)
        elif not func.is_view and self.impure is None:
            self.impure = str(func)
        return out

    def _count_launch(self, *args):
        # Triton's hook is process-wide: count only this thread's launches (ranks running as
        # threads of one process launch concurrently, and their kernels are not this call's)
        if threading.get_ident() == self._thread:
            self.triton_launches += 1

    def __enter__(self):
        _local.rec = self
        _dispatch._own_modes.depth += 1
        # Triton's launch hook counts every launch on the GPU, so a launch that bypassed
        # :func:`launch` (and would be missing from the plan) is noticed (the interpreter calls no
        # hook: there the count stays 0)
        self.triton_launches = 0
        self._thread = threading.get_ident()
        self._hooks = _launch_hooks()
        if self._hooks is not None:
            self._hooks.add(self._count_launch)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._hooks is not None:
                self._hooks.remove(self._count_launch)
            _dispatch._own_modes.depth -= 1
            _local.rec = None


def _launch_hooks():
    """Triton's chain of launch-enter hooks (None without triton or where it is not a chain)."""
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - depends on the installation
        return None
    hooks = knobs.runtime.launch_enter_hook
    return hooks if hasattr(hooks, "add") and hasattr(hooks, "remove") else None


class _Slow:
    """The plan of a signature that cannot be replayed; ``why`` says what stopped it."""

    def __init__(self, why: str):
        self.why = why

    def __call__(self, *args):
        return MISS


# ----------------------------------------------------------------------------- plan building
def _span(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1) * t.element_size()


class _Unplannable(Exception):
    """The recorded call cannot become a plan (the message says why; for debugging)."""


class _Sources:
    """The tensors a plan can address: the call's tensor arguments, then its allocations."""

    def __init__(self, args, allocs, fixed=()):
        # (kind, index, tensor): ("arg", position), ("alloc", k) or ("fixed", k): a tensor whose
        # address cannot change while the guards hold (a workspace's control block)
        self.items = []
        for j, a in enumerate(args):
            if a.__class__ in _TENSOR_TYPES:
                self.items.append(("arg", j, a))
        for k, t in enumerate(allocs):
            self.items.append(("alloc", k, t))
        for k, t in enumerate(fixed):
            self.items.append(("fixed", k, t))
        self.ptrs = [t.data_ptr() for _, _, t in self.items]
        self.spans = [_span(t) for _, _, t in self.items]
        self.equal_pairs: set[tuple[int, int]] = set()

    def by_identity(self, t) -> int:
        """The source that is ``t`` (an argument itself, or an allocation: the dispatch mode saw
        another Python object of the same tensor, so allocations match by memory and layout)."""
        for s, (_, _, src) in enumerate(self.items):
            if src is t:
                return s
        for s, (kind, _, src) in enumerate(self.items):
            if kind == "alloc" and src.data_ptr() == t.data_ptr() and _same_layout(src, t):
                return s
        raise _Unplannable("a checked or returned tensor is not an argument or an allocation")

    def locate(self, t: torch.Tensor) -> tuple[int, int]:
        """(source, byte offset) of a kernel's tensor argument."""
        ptr = t.data_ptr()
        hits = [
            s
            for s, (p, n) in enumerate(zip(self.ptrs, self.spans))
            if self.items[s][2].device == t.device and p <= ptr < p + max(n, 1)
        ]
        if not hits:
            raise _Unplannable("a kernel argument lies outside the call's tensors")
        bases = {self.ptrs[s] for s in hits}
        if len(bases) > 1:
            raise _Unplannable("a kernel argument lies inside two different tensors")
        for other in hits[1:]:  # exact aliases: replay only while they still alias
            self.equal_pairs.add((hits[0], other))
        return hits[0], ptr - self.ptrs[hits[0]]


def _result_spec(result, sources: _Sources):
    if result is None:
        return None
    if isinstance(result, tuple):
        return tuple(_result_spec(r, sources) for r in result)
    if isinstance(result, torch.Tensor):
        return ("src", sources.by_identity(result))
    raise _Unplannable(f"returns a {type(result).__name__}")


def _result_expr(spec) -> str:
    if spec is None:
        return "None"
    if isinstance(spec, tuple) and (not spec or spec[0] != "src"):
        return "(" + "".join(_result_expr(s) + ", " for s in spec) + ")"
    return f"t{spec[1]}"


class _Code:
    """Source of one plan function plus the objects it refers to."""

    def __init__(self):
        self.lines: list[str] = []
        self.env: dict = {
            "MISS": MISS,
            "_empty": torch.empty_strided,
            "_empty_like": torch.empty_like,
        }

    def const(self, value) -> str:
        if value is None or value.__class__ in (int, bool):
            return repr(value)
        name = f"_c{len(self.env)}"
        self.env[name] = value
        return name


def _build(rec: _Recorder, args: tuple, result, guard_positions: tuple[int, ...]):
    """Turn a watched slow call into a plan function ``plan(*args) -> result | MISS``."""
    if rec.impure is not None:
        raise _Unplannable(f"ran {rec.impure}")
    if not rec.launches:
        raise _Unplannable("launched no kernel")
    if rec.triton_launches > len(rec.launches):
        raise _Unplannable("a Triton kernel was launched without moefuse._fastpath.launch")
    if rec.side_stream:
        raise _Unplannable("launched on a stream other than the caller's")
    fixed = [t for j in guard_positions if args[j] is not None for t in args[j].fastpath_tensors()]
    # guards whose calls do host work around the launches (a CPU workspace: clock, status poll)
    hooked = tuple(
        j
        for j in guard_positions
        if args[j] is not None and getattr(args[j], "fastpath_host_work", False)
    )
    sources = _Sources(args, rec.allocs, fixed)
    code = _Code()
    launch_lines = []
    devices = set()
    for kernel, compiled, grid, kargs, consts in rec.launches:
        if callable(grid):
            raise _Unplannable("callable grid")
        located = [_locate_arg(sources, a) for a in kargs]
        devices.update(a.device for a in _tensors(kargs))
        if any(True for _ in _tensors(consts.values())):
            raise _Unplannable("tensor passed as a keyword")
        launch_lines.append(_launch_line(code, kernel, compiled, grid, kargs, consts, located))
    if len(devices) > 1:
        raise _Unplannable("kernels on several devices")
    checks = [
        (kind, sources.by_identity(a), sources.by_identity(b), _same_layout(a, b))
        for kind, a, b in rec.alias_checks
    ]
    spec = _result_spec(result, sources)
    return _assemble(
        code,
        sources,
        launch_lines,
        checks,
        spec,
        len(args),
        guard_positions,
        next(iter(devices)),
        hooked,
    )


def _descriptor(a) -> bool:
    """Triton's host-side ``TensorDescriptor`` (a TMA descriptor over its ``base`` tensor)."""
    return a.__class__.__name__ == "TensorDescriptor" and isinstance(
        getattr(a, "base", None), torch.Tensor
    )


class _Address(int):
    """A device address that answers ``data_ptr()`` as a tensor does: the ``base`` of a
    :class:`_Descriptor`, read by Triton's launcher (the descriptor's CUtensorMap is filled from
    ``base.data_ptr()``, its shape, strides and padding at every launch)."""

    __slots__ = ()

    def data_ptr(self) -> int:
        return int(self)


class _Descriptor:
    """What Triton's launcher reads of a ``TensorDescriptor`` (base, shape, strides, padding),
    over the next call's address: a plan's replay of a recorded descriptor argument (the key
    and layout guard fix its tensor's shape and strides, so only the address changes)."""

    __slots__ = ("base", "shape", "strides", "block_shape", "padding")

    def __init__(self, address: int, shape, strides, block_shape, padding: str):
        self.base = _Address(address)
        self.shape, self.strides, self.block_shape = shape, strides, block_shape
        self.padding = padding


def _locate_arg(sources: _Sources, a):
    """A kernel argument's place: ``(source, byte offset)`` for a tensor, a tuple of places for
    a tuple that holds a tensor (same structure), ``("descriptor", place of its base)`` for a
    TMA descriptor, None for anything else."""
    if isinstance(a, torch.Tensor):
        return sources.locate(a)
    if _descriptor(a):
        return ("descriptor", sources.locate(a.base))
    if isinstance(a, tuple) and any(True for _ in _tensors(a)):
        return tuple(_locate_arg(sources, x) for x in a)
    return None


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def _launch_line(code: _Code, kernel, compiled, grid, kargs, consts, located) -> str:
    grid = tuple(grid) + (1,) * (3 - len(grid))
    types = {a.device.type for a in _tensors(kargs)}
    if types == {"cuda"}:
        return _cuda_launch(code, kernel, compiled, grid, kargs, consts, located)
    if types == {"cpu"}:  # Triton's interpreter (TRITON_INTERPRET=1)
        return _interpreted_launch(code, kernel, grid, kargs, consts, located)
    raise _Unplannable(f"kernel arguments on devices {sorted(types)}")


def _cuda_launch(code: _Code, kernel, compiled, grid, kargs, consts, located) -> str:
    """``launcher(gx, gy, gz, stream, function, coop, pdl, scratch..., *args)`` with addresses as
    integers: Triton's C launcher then skips its per-pointer ``data_ptr()`` call and
    ``cuPointerGetAttribute`` (unified addressing makes the address the device pointer)."""
    from triton import knobs

    if _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook):
        raise _Unplannable("a Triton launch hook is installed (profiler?)")
    runner = compiled.run
    if runner.global_scratch_size or runner.profile_scratch_size:
        raise _Unplannable("kernel needs scratch memory")
    binder = kernel.device_caches[torch.cuda.current_device()][4]
    bound, _, _ = binder(*kargs, **consts)
    by_id = {}
    for a, loc in zip(kargs, located):
        _places(a, loc, by_id)
    exprs = [_launcher_arg(code, value, by_id) for value in bound.values()]
    fn = code.const(runner.launch)
    head = (
        f"{fn}({grid[0]}, {grid[1]}, {grid[2]}, s, {code.const(compiled.function)}, "
        f"{int(runner.launch_cooperative_grid)}, {int(runner.launch_pdl)}, None, None, "
        f"{code.const(compiled.packed_metadata)}, None, None, None"
    )
    return head + "".join(", " + e for e in exprs) + ")"


def _places(a, loc, out: dict) -> None:
    """``out[id(tensor)] = (source, offset)`` for every tensor of ``a`` (tuples walked)."""
    if isinstance(a, torch.Tensor) or _descriptor(a):
        out[id(a)] = loc
    elif loc is not None:
        for x, x_loc in zip(a, loc):
            _places(x, x_loc, out)


def _launcher_arg(code: _Code, value, by_id: dict) -> str:
    """One bound argument as the C launcher takes it: a tensor as its address, a tuple as a
    tuple of the same structure (the launcher parses it with a nested format, ``"(OiO)"``; its
    constexpr elements are parsed and ignored), anything else as the recorded value."""
    if isinstance(value, torch.Tensor):
        loc = by_id.get(id(value))
        if loc is None:  # the binder handed over a tensor the recording did not locate
            raise _Unplannable("a bound tensor argument was not located")
        src, off = loc
        if off % 16:
            raise _Unplannable("unaligned kernel argument")
        return f"p{src} + {off}" if off else f"p{src}"
    if isinstance(value, tuple) and any(True for _ in _tensors(value)):
        return "(" + "".join(_launcher_arg(code, x, by_id) + ", " for x in value) + ")"
    if _descriptor(value):
        loc = by_id.get(id(value))
        if loc is None:
            raise _Unplannable("a bound descriptor argument was not located")
        src, off = loc[1]
        if off % 16:
            raise _Unplannable("unaligned descriptor base")
        fields = (tuple(value.shape), tuple(value.strides), tuple(value.block_shape))
        return (
            f"{code.const(_Descriptor)}(p{src} + {off}, {code.const(fields[0])}, "
            f"{code.const(fields[1])}, {code.const(fields[2])}, {value.padding!r})"
        )
    return code.const(value)


def _hooked(hook) -> bool:
    """Whether a launch hook other than a recorder's launch counter is installed. Triton 3.6
    keeps launch hooks in a ``HookChain``, empty unless a profiler added one; a recording on
    another thread of this process (ranks as threads, an engine's thread per GPU) has its own
    counter in the chain while it runs, which a plan built on this thread can ignore."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    if calls is None:
        return True
    return any(getattr(c, "__func__", None) is not _Recorder._count_launch for c in calls)


def _interpreted_launch(code: _Code, kernel, grid, kargs, consts, located) -> str:
    """Interpreter: relaunch ``kernel[grid]`` with views of the new sources at the recorded
    offsets (the interpreter needs tensors, not addresses)."""
    layouts = [_layout_of(a, loc) for a, loc in zip(kargs, located)]

    def relaunch(srcs):
        new_args = [_reviewed(a, lay, srcs) for a, lay in zip(kargs, layouts)]
        kernel[grid](*new_args, **consts)

    return f"{code.const(relaunch)}(_srcs)"


def _layout_of(a, loc):
    """What the interpreter needs to re-view ``a`` on new sources: ``(place, dtype, shape,
    strides)`` for a tensor, a tuple of these for a tuple holding tensors, None otherwise."""
    if loc is None:
        return None
    if isinstance(a, torch.Tensor):
        return (loc, a.dtype, tuple(a.shape), a.stride())
    if _descriptor(a):
        fields = (list(a.shape), list(a.strides), list(a.block_shape), a.padding)
        return ("descriptor", _layout_of(a.base, loc[1]), fields)
    return tuple(_layout_of(x, x_loc) for x, x_loc in zip(a, loc))


def _reviewed(a, lay, srcs):
    """``a`` with each of its tensors (tuples walked) replaced by the same view of ``srcs``."""
    if lay is None:
        return a
    if _descriptor(a):
        return a.__class__(_reviewed(a.base, lay[1], srcs), *lay[2])
    if not isinstance(a, torch.Tensor):
        return tuple(_reviewed(x, x_lay, srcs) for x, x_lay in zip(a, lay))
    (src, off), dtype, shape, stride = lay
    base = srcs[src]
    byte = base.storage_offset() * base.element_size() + off
    view = torch.empty(0, dtype=dtype, device=base.device)
    view.set_(base.untyped_storage(), byte // view.element_size(), shape, stride)
    return view


TEMPLATE_MAX_BYTES = 64 * 1024


def _alloc_expr(code: _Code, t: torch.Tensor, sources: _Sources) -> str:
    """A fresh tensor like the recorded allocation ``t``, by the cheapest call that makes it:
    ``empty_like`` of an argument with the same layout; else ``empty_like`` of a small template
    the plan keeps (decode-size outputs: keyword arguments cost 0.4 µs a call); else
    ``empty_strided``."""
    for kind, idx, a in sources.items:
        if (
            kind == "arg"
            and a.shape == t.shape
            and a.stride() == t.stride()
            and a.device == t.device
            and a.dtype == t.dtype
            and a.is_contiguous()
        ):
            return f"_empty_like(a{idx})"
    if t.is_contiguous() and t.numel() * t.element_size() <= TEMPLATE_MAX_BYTES:
        template = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return f"_empty_like({code.const(template)})"
    return (
        f"_empty({tuple(t.shape)}, {t.stride()}, dtype={code.const(t.dtype)}, "
        f"device={code.const(t.device)})"
    )


def _assemble(
    code: _Code,
    sources: _Sources,
    launch_lines,
    checks,
    spec,
    nargs: int,
    guard_positions,
    device: torch.device,
    hooked=(),
):
    params = ", ".join(f"a{j}" for j in range(nargs))
    body = code.lines
    arg_tensors = [(idx, t) for kind, idx, t in sources.items if kind == "arg"]
    if arg_tensors:  # the key holds only the first argument's shape and the tensors' types:
        # their layouts, devices (type and index) and dispatch keys are checked here
        check = _layout_check([t for _, t in arg_tensors])
        body.insert(
            0,
            f"if not {code.const(check)}({''.join(f'a{j}, ' for j, _ in arg_tensors)}"
            "): return MISS",
        )
    for j in guard_positions:
        body.append(f"if a{j} is None or not a{j}.fastpath_ready(): return MISS")
    for s, (kind, idx, t) in enumerate(sources.items):
        if kind == "arg":
            body.append(f"t{s} = a{idx}")
        elif kind == "fixed":
            body.append(f"t{s} = {code.const(t)}")
            body.append(f"p{s} = {t.data_ptr()}")
            continue
        else:
            body.append(f"t{s} = {_alloc_expr(code, t, sources)}")
        body.append(f"p{s} = t{s}.data_ptr()")
    if sources.items:
        body.append(
            f"if ({' | '.join(f'p{s}' for s in range(len(sources.items)))}) & 15: return MISS"
        )
    for a, b in sorted(sources.equal_pairs):
        body.append(f"if p{a} != p{b}: return MISS")
    for kind, a, b, same in dict.fromkeys(checks):  # a pair validated twice is checked once
        na, nb = sources.spans[a], sources.spans[b]
        if not na or not nb:
            continue
        overlap = f"(p{a} < p{b} + {nb} and p{b} < p{a} + {na})"
        if kind == "exact_or_disjoint" and same:
            body.append(f"if p{a} != p{b} and {overlap}: return MISS")
        else:
            body.append(f"if {overlap}: return MISS")
    if device.type == "cuda":
        getdev = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)
        body.append(f"if {code.const(getdev)}() != {device.index}: return MISS")
        body.append(f"s = {code.const(torch._C._cuda_getCurrentRawStream)}({device.index})")
    else:
        body.append(f"_srcs = ({''.join(f't{s}, ' for s in range(len(sources.items)))})")
    body.extend(f"a{j}.fastpath_before()" for j in hooked)
    body.extend(launch_lines)
    body.extend(f"a{j}.fastpath_after()" for j in hooked)
    body.append(f"return {_result_expr(spec)}")
    src = f"def plan({params}):\n" + "".join(f"    {line}\n" for line in body)
    exec(compile(src, "<moefuse plan>", "exec"), code.env)  # noqa: S102 - generated above
    plan = code.env["plan"]
    plan.source = src
    return plan


def _layout_check(tensors: list[torch.Tensor]):
    """``check(*tensors) -> bool``: True when the tensors have the recorded Python types,
    dtypes, devices, shapes, strides, ``requires_grad`` and dispatch keys (which include the
    grad / inference mode the plan was recorded under). Uses dynamo's C++ tensor guard, about
    0.35 µs for any number of tensors (a Python tuple per tensor costs 0.4 µs each); a plain
    Python comparison where that private class is missing."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        guard = TensorGuards(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
        if guard.check(*tensors):
            return guard.check
    except Exception:  # noqa: BLE001 - the fallback below is exact, only slower
        pass
    recorded = [_layout(t) for t in tensors]

    def check(*args):
        return [_layout(t) for t in args] == recorded

    return check


def _layout(t: torch.Tensor):
    return (t.__class__, t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


# ----------------------------------------------------------------------------- the decorator
def _key_expr(name: str, has_default: bool) -> str:
    """The key part of one argument: ``_DEF`` when it is its parameter's default object (one
    identity test: most keyword arguments of a call are left at their defaults); a tensor's
    Python type (its layout is checked by the plan's first line, :func:`_layout_check`); a
    value that only equals its own type's values as itself; numbers with their type
    (``True == 1 == 1.0``, and validation tells bool from int)."""
    part = (
        f"{name}.__class__ if {name}.__class__ in _TT else {name} "
        f"if {name}.__class__ in _PLAIN else ({name}.__class__, {name}) "
        f"if {name}.__class__ in _SC else _other({name})"
    )
    return f"(_DEF if {name} is _d_{name} else {part})" if has_default else f"({part})"


def _folded(p: inspect.Parameter) -> bool:
    """Parameters with a default share a key part with the others of their kind, positional
    or keyword-only (:func:`_folded_key_expr`)."""
    return p.default is not p.empty


def _folded_key_expr(names: list[str]) -> list[str]:
    """One key part for the keyword-only parameters with defaults: ``_DEF`` when every one of
    them is its default object (the usual eager call passes none: a chain of identity tests),
    else the tuple of their :func:`_key_expr` parts. Saves hashing and comparing a key part per
    parameter (ops with a dozen keyword options: ~0.4 µs a call on an H100 host)."""
    if not names:
        return []
    every_default = " and ".join(f"{n} is _d_{n}" for n in names)
    parts = "".join(_key_expr(n, True) + ", " for n in names)
    return [f"(_DEF if {every_default} else ({parts}))"]


def _first_shape_expr(name: str) -> str:
    """The first argument's shape joins the key (it carries the token count in every op), so
    that calls of many sizes do not share one list of plans."""
    return f"({name}.shape if {name}.__class__ in _TT else None)"


def _other(value):
    if isinstance(value, torch.Tensor):  # a tensor subclass: not ours to replay
        raise TypeError("tensor subclass")
    return (value.__class__, value)


def _recorder(fn, plans: dict, guard_positions: tuple[int, ...]):
    """The wrapper's ``_record(key, call_args, run)`` for ``fn``: runs the call under a
    :class:`_Recorder`, builds its plan (or a :class:`_Slow` refusal, logged) and files it under
    ``key`` in ``plans``; returns the call's result."""

    def record(key, call_args, run):
        if not knobs.get("MOEFUSE_FASTPATH"):
            ENABLED[0] = False
            return run()
        rec = _Recorder()
        with rec:
            result = run()
        try:
            plan = _build(rec, call_args, result, guard_positions)
        except _Unplannable as why:
            plan = _Slow(str(why))
            logger.debug("moefuse.%s: this signature stays on the slow path: %s", fn.__name__, why)
        except Exception as exc:  # a plan is an optimisation: never fail the user's call for it
            plan = _Slow(f"plan building failed: {type(exc).__name__}: {exc}")
            logger.warning(
                "moefuse.%s: %s (this signature stays on the slow path)", fn.__name__, plan.why
            )
        if len(plans) >= MAX_KEYS_PER_OP:
            plans.clear()
        kept = plans.get(key, [])
        # a refused signature is closed (a tuple): it is not recorded again on later calls
        plans[key] = (*kept, plan) if isinstance(plan, _Slow) else [*kept, plan]
        return result

    return record


def fast_op(fn=None, *, guards: tuple[str, ...] = ()):
    """Decorate a public op: calls with a recorded signature replay the plan (module docstring).

    ``guards`` names arguments whose ``fastpath_ready()`` must be True for a replay (for example a
    communication workspace, which checks its health there); their ``fastpath_tensors()`` are
    tensors whose addresses stay fixed while that holds (kernels may get them). A guard whose
    ``fastpath_host_work`` is True has host work of its own around every call, done without
    torch ops (so the recorder does not see it): the plan calls its ``fastpath_before()`` before
    the launches and ``fastpath_after()`` after them (a CPU workspace refreshes its clock word
    and polls its status word). The wrapper has ``fn``'s signature.
    """
    if fn is None:
        return lambda f: fast_op(f, guards=guards)
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY) for p in params):
        return fn
    names = [p.name for p in params]
    guard_positions = tuple(names.index(g) for g in guards)
    plans: dict = {}
    _caches.append(plans)
    env = {
        "_fn": fn,
        "_plans": plans,
        "_TT": _TENSOR_TYPES,
        "_SC": _SCALAR_TYPES,
        "_PLAIN": _PLAIN_TYPES,
        "_other": _other,
        "_MISS": MISS,
        "_local": _local,
        "_ON": ENABLED,
        "_compiling": _dispatch._is_dynamo_compiling,
        "_depth": _dispatch._dispatch_depth,
        "_own": _dispatch._own_modes,
        "_MAXP": MAX_PLANS_PER_KEY,
        "_DEF": _DEFAULT,
    }
    decl, call = [], []
    star = False
    for p in params:
        if p.kind is p.KEYWORD_ONLY and not star:
            decl.append("*")
            star = True
        if p.default is p.empty:
            decl.append(p.name)
        else:
            env[f"_d_{p.name}"] = p.default
            decl.append(f"{p.name}=_d_{p.name}")
        call.append(f"{p.name}={p.name}" if p.kind is p.KEYWORD_ONLY else p.name)
    args = ", ".join(names)
    calls = ", ".join(call)
    key = ", ".join(
        [_first_shape_expr(names[0])]
        + [_key_expr(p.name, False) for p in params if p.default is p.empty]
        + _folded_key_expr([p.name for p in params if _folded(p) and p.kind is not p.KEYWORD_ONLY])
        + _folded_key_expr([p.name for p in params if _folded(p) and p.kind is p.KEYWORD_ONLY])
    )
    # the guard reads the thread's dispatch-mode depth first: at 0 (every eager call) no
    # recorder can be active on this thread (a recorder is a dispatch mode of its thread's
    # stack), so the two thread-local reads behind it are skipped
    src = f"""
def {fn.__name__}({", ".join(decl)}):
    if _ON[0] and not _compiling() and (
        not _depth() or _local.rec is None and _depth() <= _own.depth
    ):
        try:
            plans = _plans.get(key := ({key},))
        except TypeError:
            return _fn({calls})
        if plans is None:
            return _record(key, ({args},), lambda: _fn({calls}))
        for plan in plans:
            result = plan({args})
            if result is not _MISS:
                return result
        if plans.__class__ is list and len(plans) < _MAXP:
            return _record(key, ({args},), lambda: _fn({calls}))
    return _fn({calls})
"""

    env["_record"] = _recorder(fn, plans, guard_positions)
    exec(compile(src, f"<moefuse fast_op {fn.__name__}>", "exec"), env)  # noqa: S102
    wrapper = env[fn.__name__]
    wrapper.__doc__ = fn.__doc__
    wrapper.__module__ = fn.__module__
    wrapper.__qualname__ = fn.__qualname__
    wrapper.__wrapped__ = fn
    wrapper._moefuse_plans = plans
    return wrapper
