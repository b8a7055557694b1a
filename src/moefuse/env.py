"""``python -m moefuse env``: what this machine runs and why.

Prints (or, with ``--json``, writes as one JSON object) the versions that matter (moefuse, torch,
triton, transformers, Python), the CUDA devices with their compute capability, SM count and PDL
support, the peer-access matrix between them, the communication settings that decide the
all-reduce path, for each op family the implementation that ``impl="auto"`` picks on the
default device, with the reason, and the ``MOEFUSE_*`` knobs that are set (:mod:`moefuse.knobs`;
an invalid value is shown, not raised, and undeclared names are listed).

Nothing here decides anything: the decisions are the library's own. A family's answer is
``moefuse._runtime.choose_impl`` fed with the family's ``supports_*`` helper evaluated on a small
sample of its usual arguments; PDL is ``_runtime.pdl_available``; the all-reduce transport order
and one-shot crossover come from ``moefuse.comm.transport`` / ``moefuse.comm.workspace``. Works
on a CPU-only machine (no CUDA call is made without a device).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moefuse import knobs


# ----------------------------------------------------------------------------- versions
def _installed(module: str) -> bool:
    """``module`` can be found (a missing parent package counts as not installed)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _version(module: str) -> str | None:
    """``module.__version__`` when the module is installed, else None (never raises)."""
    if not _installed(module):
        return None
    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown"))
    except Exception as exc:  # an installed but broken package is worth reporting as such
        return f"import failed: {type(exc).__name__}: {exc}"


def versions() -> dict:
    import moefuse

    return {
        "moefuse": moefuse.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "numpy": _version("numpy"),
        "flashinfer": _version("flashinfer"),
    }


# ----------------------------------------------------------------------------- devices
def devices() -> list[dict]:
    from moefuse._runtime import kernel_device_reason, pdl_available

    out = []
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        dev = torch.device("cuda", i)
        props = torch.cuda.get_device_properties(i)
        reason = kernel_device_reason(dev)
        out.append(
            {
                "index": i,
                "name": props.name,
                "capability": list(torch.cuda.get_device_capability(i)),
                "sm_count": props.multi_processor_count,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "kernels": "supported" if reason is None else reason,
                "pdl": pdl_available(dev),
            }
        )
    return out


def peer_access_matrix() -> list[list[bool | None]]:
    """``m[i][j]``: device i can access device j's memory (None on the diagonal)."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [
        [None if i == j else bool(torch.cuda.can_device_access_peer(i, j)) for j in range(n)]
        for i in range(n)
    ]


# ----------------------------------------------------------------------------- families
@dataclass(frozen=True)
class Probe:
    """One op of a family: its ``supports_*`` helper and a sample of its usual arguments."""

    family: str
    op: str
    supports: Callable[..., bool]
    sample: Callable[[torch.device], tuple]  # device -> positional arguments of ``supports``


def _probes() -> list[Probe]:
    import moefuse

    bf, f32 = torch.bfloat16, torch.float32
    h = 4096  # a real model's width; the samples are tiny (M = 2)

    def x(d, m=2, w=h):
        return torch.zeros(m, w, dtype=bf, device=d)

    def vec(d, dtype=bf):
        return torch.ones(h, dtype=dtype, device=d)

    def scalar(d):
        return torch.ones(1, dtype=f32, device=d)

    def finalize(d):
        idx = torch.arange(2 * 8, dtype=torch.int32, device=d).view(2, 8)
        return x(d, 16), idx, torch.full((2, 8), 0.125, dtype=f32, device=d)

    def permute(d):
        return x(d), torch.arange(16, dtype=torch.int32, device=d), 8

    return [
        Probe("norm", "rmsnorm", moefuse.supports_rmsnorm, lambda d: (x(d), vec(d))),
        Probe(
            "norm",
            "fused_add_rmsnorm",
            moefuse.supports_fused_add_rmsnorm,
            lambda d: (x(d), x(d), vec(d)),
        ),
        Probe(
            "norm",
            "gated_residual_next_rmsnorm",
            moefuse.supports_gated_residual_next_rmsnorm,
            lambda d: (x(d), x(d).float(), vec(d), vec(d, f32), vec(d, f32)),
        ),
        Probe(
            "norm",
            "rmsnorm_sigmoid_gate",
            moefuse.supports_rmsnorm_sigmoid_gate,
            lambda d: (torch.zeros(2, 32, 128, dtype=bf, device=d),),
        ),
        Probe("moe", "moe_finalize", moefuse.supports_moe_finalize, finalize),
        Probe("moe", "moe_permute", moefuse.supports_moe_permute, permute),
        Probe(
            "quant",
            "rmsnorm_quant (FP8)",
            moefuse.supports_rmsnorm_quant,
            lambda d: (x(d), vec(d), scalar(d)),
        ),
        Probe(
            "quant",
            "fp4_quantize (NVFP4)",
            moefuse.supports_fp4_quantize,
            lambda d: (x(d), scalar(d)),
        ),
    ]


def default_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def family_paths(device: torch.device | None = None) -> list[dict]:
    """What ``impl="auto"`` runs for each probed op on ``device`` and why."""
    from moefuse._runtime import choose_impl, interpreter_active, kernel_device_reason

    device = device or default_device()
    rows = []
    for p in _probes():
        try:
            ok = bool(p.supports(*p.sample(device)))
        except Exception as exc:  # a helper must not raise; if it does, say so
            ok, why = False, f"supports_* raised {type(exc).__name__}: {exc}"
        else:
            why = None
        device_reason = kernel_device_reason(device)
        reason = None if ok else (why or device_reason or "supports_* is False for the sample")
        picked = choose_impl(p.op.split(" ")[0], "auto", device, reason)
        if picked == "triton":
            why = f"supports_{p.op.split(' ')[0]} is True on {device}"
        elif device.type != "cuda":
            why = "auto runs the PyTorch reference on non-CUDA tensors"
            why += (
                "; impl='triton' runs the kernel in Triton's interpreter"
                if ok and interpreter_active()
                else f"; impl='triton' cannot run: {reason}"
            )
        else:
            why = f"fallback to the PyTorch reference (logged once): {reason}"
        rows.append(
            {
                "family": p.family,
                "op": p.op,
                "device": str(device),
                "supports": ok,
                "auto": picked,
                "why": why,
            }
        )
    return rows


def comm_path(peer: list[list[bool | None]], devs: list[dict]) -> dict:
    """The all-reduce fusions' path with a workspace over all the local GPUs."""
    from moefuse.comm.transport import cuda_transport_order
    from moefuse.comm.workspace import oneshot_max_bytes

    try:
        order = list(cuda_transport_order(knobs.get("MOEFUSE_COMM_TRANSPORT")))
    except ValueError as exc:
        order = [f"invalid: {exc}"]
    p = len(devs)
    multicast_env = {
        k: os.environ.get(k)
        for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
    }
    info = {
        "world_size_here": p,
        "transport_order": order,
        "no_multicast_env": multicast_env,
        "symmetric_memory_module": _installed("torch.distributed._symmetric_memory"),
    }
    if p < 2:
        info["path"] = (
            "no local peers: a workspace over ranks on other hosts, or CPU ranks "
            "(gloo), takes the torch.distributed path (all-gather + rank-order sum); "
            "CPU ranks with TRITON_INTERPRET=1 run the peer kernels in the "
            "interpreter over shared memory"
        )
        return info
    all_peer = all(v for row in peer for v in row if v is not None)
    kernels = all(d["kernels"] == "supported" for d in devs)
    if not all_peer:
        info["path"] = "torch.distributed path: some GPU pairs lack peer access"
    elif not kernels:
        info["path"] = f"torch.distributed path: {devs[0]['kernels']}"
    else:
        limit = oneshot_max_bytes(p)
        cut = "at every size" if limit is None else f"up to {limit} bytes per rank, then two-shot"
        info["path"] = (
            f"peer kernels over {' then '.join(order)} (every pair has peer "
            f"access); at P = {p} auto picks one-shot {cut}"
        )
    return info


# ----------------------------------------------------------------------------- knobs
def knob_settings() -> dict:
    """The ``MOEFUSE_*`` variables set here (:mod:`moefuse.knobs`): ``set`` (name -> {"raw",
    "value" or "error", "shared"}) and ``unknown`` (set, but no knob has the name)."""
    rows = {}
    for name, raw in knobs.settings().items():
        row = {"raw": raw, "shared": knobs.KNOBS[name].shared}
        try:
            row["value"] = knobs.parse(name, raw)
        except ValueError as exc:
            row["error"] = str(exc)
        rows[name] = row
    return {"set": rows, "unknown": knobs.unknown()}


# ----------------------------------------------------------------------------- report
def collect() -> dict:
    from moefuse._runtime import interpreter_active

    devs = devices()
    peer = peer_access_matrix()
    return {
        "versions": versions(),
        "triton_interpret": interpreter_active(),
        "devices": devs,
        "peer_access": peer,
        "families": family_paths(),
        "comm": comm_path(peer, devs),
        "knobs": knob_settings(),
        "transformers_integration": _installed("moefuse.integrations.transformers")
        and _installed("transformers"),
    }


def format_report(info: dict) -> str:
    v = info["versions"]
    missing = {"torch_cuda": "none (CPU build)"}
    lines = ["versions: " + ", ".join(f"{k} {v[k] or missing.get(k, 'not installed')}" for k in v)]
    lines.append(f"TRITON_INTERPRET: {'on' if info['triton_interpret'] else 'off'}")
    if not info["devices"]:
        lines.append("GPUs: none (CUDA not available); PDL: no (needs an SM90+ GPU)")
    for d in info["devices"]:
        cap = ".".join(map(str, d["capability"]))
        lines.append(
            f"cuda:{d['index']} {d['name']}: SM {cap}, {d['sm_count']} SMs, "
            f"{d['memory_gib']} GiB; kernels: {d['kernels']}; PDL: "
            f"{'yes' if d['pdl'] else 'no'}"
        )
    if len(info["peer_access"]) > 1:
        n = len(info["peer_access"])
        lines.append("peer access (row can read column):")
        lines.append("       " + " ".join(f"{j:>3d}" for j in range(n)))
        for i, row in enumerate(info["peer_access"]):
            cells = " ".join("  -" if c is None else ("yes" if c else " no") for c in row)
            lines.append(f"  {i:>3d}  {cells}")
    lines.append("impl='auto' per family:")
    width = max(len(f"{r['family']}.{r['op']}") for r in info["families"])
    for r in info["families"]:
        name = f"{r['family']}.{r['op']}"
        lines.append(f"  {name:<{width}}  {r['auto']:<9}  {r['why']}")
    c = info["comm"]
    lines.append(f"  {'comm.allreduce_*':<{width}}  {'':<9}  {c['path']}")
    lines.append(
        f"    transports tried: {', '.join(c['transport_order'])}; "
        f"no-multicast env: {c['no_multicast_env']}"
    )
    k = info["knobs"]
    if not k["set"] and not k["unknown"]:
        lines.append("MOEFUSE_* knobs: none set (all defaults; docs/knobs.md lists them)")
    else:
        lines.append("MOEFUSE_* knobs set (* = must be the same on every rank):")
    for name, row in k["set"].items():
        state = f"INVALID: {row['error']}" if "error" in row else f"-> {row['value']!r}"
        lines.append(f"  {name}{'*' if row['shared'] else ''}={row['raw']}  {state}")
    for name in k["unknown"]:
        lines.append(f"  {name}: not a moefuse knob, ignored")
    lines.append(
        "transformers integration: "
        + ("available" if info["transformers_integration"] else "not available")
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moefuse env", description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=1) if args.json else format_report(info))
    return 0
