"""All-reduce fusions on CPU: the references against an independent FP64 oracle, and the real
Triton kernels in the interpreter across 2-8 real processes (gloo group, shared-memory peer
buffers): every pattern x algorithm against the oracle, bitwise across algorithms, ranks and batch
sizes, -0.0 inputs, bounded waits, opcheck and torch.compile (spec: All-reduce fusions)."""

from __future__ import annotations

import hashlib
import zlib

import pytest
import torch

from comm_mp import run_group
from moefuse.comm.all_reduce import reference as ref
from moefuse.quant import reference as quant_ref
from moefuse.testing import assert_bitwise_equal, assert_close, bits, poison_

pytestmark = pytest.mark.interpreter

ALGOS = ("oneshot", "twoshot", "torch")
LAYOUTS = ("swizzled_128x4", "swizzled_8x4", "linear")
FP8_SCALE = 0.0125
NVFP4_GS = 448.0 * 6 / 5.0
FP32_ACC = {"mixed": lambda i: i % 2 == 0, True: lambda i: True, False: lambda i: False}


# ----------------------------------------------------------------------------- inputs
def make_case(seed, world_size, m, h, dtype, neg_zero=True):
    """Every rank's partial (rank order), the replicated residual and weight. All ranks build the
    same tensors from ``seed``, so each can evaluate the oracle locally."""
    g = torch.Generator().manual_seed(seed)
    scales = [0.5, 2.0, 1.0, 4.0, 0.25, 1.5, 3.0, 0.75]
    partials = [
        (torch.randn(m, h, generator=g) * scales[r % 8]).to(dtype) for r in range(world_size)
    ]
    if neg_zero and m > 0:
        for p in partials:  # column 0: -0.0 on every rank (sum must be +0.0); a few more singly
            p[:, 0] = -0.0
            p[0, 1 : min(h, 4)] = -0.0
    residual = torch.randn(m, h, generator=g).to(dtype)
    weight = (torch.rand(h, generator=g) + 0.5).to(dtype)
    return partials, residual, weight


def digest(*tensors) -> str:
    sha = hashlib.sha1()
    for t in tensors:
        if t is not None:
            sha.update(bits(t).numpy().tobytes())
    return sha.hexdigest()


def norm_tol(dtype) -> str:
    return "fp32_stream" if dtype == torch.float32 else "rsqrt_half"


# ----------------------------------------------------------------------------- one call
def run_pattern(
    moefuse,
    ws,
    pattern,
    x,
    res,
    w,
    algo,
    *,
    weight_bias=0.0,
    fp32_acc=True,
    layout="swizzled_128x4",
    impl="triton",
):
    """Run ``pattern`` with poisoned caller-provided outputs; returns the output tuple."""
    kw = dict(workspace=ws, algorithm=algo, impl=impl, fp32_acc=fp32_acc)
    m, h = x.shape
    like = lambda dt=x.dtype, shape=(m, h): poison_(torch.empty(shape, dtype=dt))  # noqa: E731
    scale = torch.tensor([FP8_SCALE])
    if pattern == "ar":
        return (moefuse.allreduce(x, out=like(), **kw),)
    kw.update(weight_bias=weight_bias)
    if pattern == "norm":
        return moefuse.allreduce_residual_rmsnorm(
            x, res, w, residual_out=like(), norm_out=like(), **kw
        )
    if pattern in ("fp8", "fp8_out"):
        q = like(torch.uint8).view(torch.float8_e4m3fn)
        if pattern == "fp8":
            return moefuse.allreduce_residual_rmsnorm_fp8(
                x, res, w, scale, residual_out=like(), quant_out=q, **kw
            )
        return moefuse.allreduce_residual_rmsnorm_out_fp8(
            x, res, w, scale, residual_out=like(), norm_out=like(), quant_out=q, **kw
        )
    from moefuse.quant.formats import scale_layout_shape

    gs = torch.tensor([NVFP4_GS])
    q = like(torch.uint8, (m, h // 2))
    sf = like(torch.uint8, scale_layout_shape(m, h // 16, layout))
    if pattern == "nvfp4":
        return moefuse.allreduce_residual_rmsnorm_nvfp4(
            x, res, w, gs, layout=layout, residual_out=like(), quant_out=q, scale_out=sf, **kw
        )
    return moefuse.allreduce_residual_rmsnorm_out_nvfp4(
        x,
        res,
        w,
        gs,
        layout=layout,
        residual_out=like(),
        norm_out=like(),
        quant_out=q,
        scale_out=sf,
        **kw,
    )


def check_against_oracle(
    pattern, outs, partials, res, w, weight_bias, fp32_acc, layout, n_kernel, what
):
    """Bitwise where the math is exact (sum, residual_out, quantization of the kernel's own rounded
    norm output ``n_kernel``), <= 1 ulp on norm_out (rsqrt.approx, FP32 vs FP64 statistic)."""
    if pattern == "ar":
        assert_bitwise_equal(outs[0], ref.allreduce_from_partials(partials, fp32_acc), what)
        return
    h_ref, n_ref = ref.allreduce_residual_rmsnorm_from_partials(
        partials, res, w, 1e-6, weight_bias, fp32_acc
    )
    assert_bitwise_equal(outs[0], h_ref, f"{what} residual_out")
    if pattern == "norm":
        assert_close(outs[1], n_ref, norm_tol(res.dtype), f"{what} norm_out")
        return
    if pattern.endswith("_out"):
        assert_bitwise_equal(outs[1], n_kernel, f"{what} norm_out (pattern 1 kernel)")
    if pattern.startswith("fp8"):
        q_exp = quant_ref.fp8_quantize_reference(n_kernel, torch.tensor([FP8_SCALE]))
        assert_bitwise_equal(outs[-1].view(torch.uint8), q_exp.view(torch.uint8), f"{what} fp8")
        return
    packed_exp, sf_exp = quant_ref.fp4_quantize_reference(
        n_kernel, torch.tensor([NVFP4_GS]), layout, recipe="ieee"
    )
    assert_bitwise_equal(outs[-2], packed_exp, f"{what} nvfp4 codes")
    assert_bitwise_equal(outs[-1], sf_exp, f"{what} nvfp4 scales (padding zeroed)")


# ----------------------------------------------------------------------------- scenarios
def case_seed(*key) -> int:
    return zlib.crc32(repr(key).encode())  # not hash(): it differs between processes


def in_cover(cfg, d, i, j, k) -> bool:
    """Whether the case (dtype ``d``, width ``i``, token count ``j``, pattern ``k``: indices into
    ``cfg``) runs. ``cfg["cover"]``: "all" (default) every combination; "pairwise" the cases
    with ``(i + j + k) % max(len(dtypes), 2) == d``, half of them: still every (H, M) cell, and
    every pair of dtype, H, M and pattern values, each with every algorithm."""
    if cfg.get("cover", "all") == "all":
        return True
    return (i + j + k) % max(len(cfg["dtypes"]), 2) == d


def scenario_patterns(rank, world_size, cfg):
    """Every (dtype, H, M, pattern) of ``cfg`` (:func:`in_cover`): each algorithm against the
    oracle and bitwise equal to the others; for "norm", one row run alone equals the same row
    inside the batch. Returns one digest of the outputs per case (the caller compares ranks)."""
    import moefuse

    algos = cfg.get("algorithms", ALGOS)
    digests = []
    for d, dtype in enumerate(cfg["dtypes"]):
        for i, h in enumerate(cfg["widths"]):
            ws = moefuse.AllReduceWorkspace(
                None, max(cfg["tokens"]), h, dtype, "cpu", timeout_s=120
            )
            for j, m in enumerate(cfg["tokens"]):
                for k, pattern in enumerate(cfg["patterns"]):
                    if pattern.startswith("nvfp4") and h % 16 or not in_cover(cfg, d, i, j, k):
                        continue
                    partials, res, w = make_case(
                        case_seed(str(dtype), h, m, pattern), world_size, m, h, dtype
                    )
                    x = partials[rank]
                    opts = dict(
                        weight_bias=float((m + k) % 2),  # plain and Gemma gains
                        fp32_acc=FP32_ACC[cfg.get("fp32_acc", "mixed")](m + k),
                        layout=LAYOUTS[(m + k) % 3],
                    )
                    n_kernel = None
                    if pattern not in ("ar", "norm"):
                        n_kernel = run_pattern(moefuse, ws, "norm", x, res, w, algos[0], **opts)[1]
                    first = None
                    for algo in algos:
                        what = f"rank {rank} {dtype} H={h} M={m} {pattern} {opts} {algo}"
                        outs = run_pattern(moefuse, ws, pattern, x, res, w, algo, **opts)
                        check_against_oracle(
                            pattern,
                            outs,
                            partials,
                            res,
                            w,
                            opts["weight_bias"],
                            opts["fp32_acc"],
                            opts["layout"],
                            n_kernel,
                            what,
                        )
                        if first is None:
                            first = outs
                        for a, b in zip(outs, first):
                            assert_bitwise_equal(a, b, f"{what} vs {algos[0]}")
                        if m > 1 and pattern == "norm" and cfg.get("batch_invariance", True):
                            row = m // 2
                            alone = run_pattern(
                                moefuse,
                                ws,
                                pattern,
                                x[row : row + 1],
                                res[row : row + 1],
                                w,
                                algo,
                                **opts,
                            )
                            for a, b in zip(alone, outs):
                                assert_bitwise_equal(a, b[row : row + 1], f"{what} row alone")
                    digests.append(digest(*first))
            ws.close()
    return digests


def _assert_ranks_agree(results):
    for r, d in enumerate(results[1:], start=1):
        assert d == results[0], f"rank {r} outputs differ bitwise from rank 0"


def test_reference_matches_fp64_oracle():
    """The comm reference against straightforward formulas written here (FP64 statistic)."""
    for dtype in (torch.bfloat16, torch.float16):
        partials, res, w = make_case(7, 3, 5, 40, dtype)
        acc = torch.zeros(5, 40)
        for p in partials:
            acc = acc + p.float()
        s = acc.to(dtype)
        assert_bitwise_equal(ref.allreduce_from_partials(partials), s, "sum")
        assert ref.allreduce_from_partials(partials)[:, 0].view(torch.int16).eq(0).all()  # +0.0
        h = (s.float() + res.float()).to(dtype)
        h64 = h.double()
        r64 = 1 / torch.sqrt(h64.square().mean(-1, keepdim=True) + 1e-6)
        for wb in (0.0, 1.0):
            ro, no = ref.allreduce_residual_rmsnorm_from_partials(partials, res, w, 1e-6, wb)
            assert_bitwise_equal(ro, h, "residual_out")
            assert_close(no, (h64 * r64 * (w.double() + wb)).to(dtype), "rsqrt_half", "norm_out")
        step = torch.zeros(5, 40, dtype=dtype)
        for p in partials:
            step = (step.float() + p.float()).to(dtype)
        assert_bitwise_equal(ref.allreduce_from_partials(partials, fp32_acc=False), step, "step")


def test_two_ranks_every_pattern():
    """Every width with every token count (odd rows of 48 and 200 columns, one to several rows
    per CTA), each cell once per pattern, the dtypes alternating over the cells (pairwise: every
    dtype with every width, token count and pattern), every algorithm on every case."""
    cfg = dict(
        dtypes=(torch.bfloat16, torch.float16),
        widths=(48, 64, 200),
        tokens=(1, 3, 17),
        patterns=("ar", "norm"),
        cover="pairwise",
    )
    _assert_ranks_agree(run_group(2, scenario_patterns, cfg))


def test_two_ranks_quant_patterns():
    """Pairwise over width x token count x pattern (each width and token count with every
    pattern, each (H, M) cell with two of them): the NVFP4 patterns in all three scale layouts,
    swizzled 128x4 at H = 48 (padding rows and a padding block column); every algorithm."""
    cfg = dict(
        dtypes=(torch.bfloat16,),
        widths=(48, 64),
        tokens=(1, 17),
        patterns=("fp8", "fp8_out", "nvfp4", "nvfp4_out"),
        cover="pairwise",
    )
    _assert_ranks_agree(run_group(2, scenario_patterns, cfg))


def test_fp32_activations_and_stepwise_accumulation():
    cfg = dict(
        dtypes=(torch.float32, torch.float16),
        widths=(64,),
        tokens=(3,),
        patterns=("ar", "norm"),
        fp32_acc=False,
    )
    _assert_ranks_agree(run_group(2, scenario_patterns, cfg))


def test_three_and_four_ranks():
    cfg = dict(
        dtypes=(torch.bfloat16,),
        widths=(200,),
        tokens=(1, 17),
        patterns=("norm",),
        batch_invariance=False,
    )
    _assert_ranks_agree(run_group(3, scenario_patterns, cfg))
    cfg = dict(
        dtypes=(torch.float16,),
        widths=(64,),
        tokens=(3,),
        patterns=("ar", "norm"),
        batch_invariance=False,
    )
    _assert_ranks_agree(run_group(4, scenario_patterns, cfg))


def test_eight_ranks_basic_pattern():
    cfg = dict(
        dtypes=(torch.bfloat16,),
        widths=(48,),
        tokens=(3,),
        patterns=("norm",),
        batch_invariance=False,
    )
    _assert_ranks_agree(run_group(8, scenario_patterns, cfg))


# ----------------------------------------------------------------------------- one-shot variants
#: MOEFUSE_COMM_* settings of the experimental one-shot variants (tiles.OneshotVariant)
VARIANTS = {
    "prefetch": {"MOEFUSE_COMM_ONESHOT_PREFETCH": "1"},
    "persistent": {"MOEFUSE_COMM_ONESHOT_PREFETCH": "1",
                   "MOEFUSE_COMM_ROWS_PER_CTA": "4", "MOEFUSE_COMM_ONESHOT_WARPS": "2"},
}  # fmt: skip


def scenario_variant(rank, world_size, env, patterns, widths, tokens):
    """Default one-shot, then the variant in ``env`` on the same inputs (-0.0 included), several
    calls in a row (generations cycle): bitwise equal outputs. Returns a digest per case."""
    import os

    import moefuse

    digests = []
    for h in widths:
        ws = moefuse.AllReduceWorkspace(None, max(tokens), h, torch.bfloat16, "cpu", timeout_s=120)
        for m in tokens:
            for pattern in patterns:
                partials, res, w = make_case(
                    case_seed("variant", h, m, pattern), world_size, m, h, torch.bfloat16
                )
                x = partials[rank]
                base = run_pattern(moefuse, ws, pattern, x, res, w, "oneshot")
                os.environ.update(env)
                try:
                    for rep in range(2):
                        outs = run_pattern(moefuse, ws, pattern, x, res, w, "oneshot")
                        for a, b in zip(outs, base):
                            assert_bitwise_equal(
                                a, b, f"rank {rank} {env} H={h} M={m} {pattern} call {rep}"
                            )
                finally:
                    for key in env:
                        del os.environ[key]
                digests.append(digest(*base))
        ws.close()
    return digests


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_oneshot_variant_bitwise_equal_to_default(variant):
    """Each variant of the one-shot kernel gives the default's bits (CPU grids are <= 8 CTAs, so
    M = 17 runs several rows per CTA through the prefetch pipeline); P = 3 for one of them."""
    world = 3 if variant == "persistent" else 2
    patterns = ("ar", "norm", "nvfp4_out") if variant == "prefetch" else ("norm",)
    args = (VARIANTS[variant], patterns, (48,), (1, 17))
    _assert_ranks_agree(run_group(world, scenario_variant, *args))


def test_oneshot_variant_defaults_by_token_count_and_env_overrides(monkeypatch):
    """The measured per-size choice (comm/tiles.py) applies unless a variant variable is set."""
    from moefuse.comm import tiles as ct

    for name in ct._VARIANT_ENV:
        monkeypatch.delenv(name, raising=False)
    assert ct.oneshot_variant(64) == ct.OneshotVariant()
    assert ct.oneshot_variant(512) == ct.OneshotVariant(prefetch=True, rows_per_cta=4)
    assert ct.oneshot_variant(16384) == ct.OneshotVariant(prefetch=True, rows_per_cta=8)
    monkeypatch.setenv("MOEFUSE_COMM_ROWS_PER_CTA", "2")
    assert ct.oneshot_variant(16384) == ct.OneshotVariant(rows_per_cta=2)
