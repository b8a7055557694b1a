"""MoE-reduction fusions on CPU (spec: MoE reduction, MoE finalize): the references against an
independent scalar oracle, and the Triton kernels in the interpreter across 2-4 real processes (gloo
group, shared-memory peer buffers): every algorithm against the oracle of all ranks' inputs, bitwise
across algorithms, paths (impl="reference"), ranks and batch positions; invalid indices over
NaN-poisoned rows; bad-input ValueErrors."""

from __future__ import annotations

import contextlib
import hashlib
import zlib

import pytest
import torch

from comm_mp import assert_compiles_to_eager_bits, run_group
from moefuse.comm.moe_reduction import reference as mref
from moefuse.comm.workspace import CTRL_GEN
from moefuse.quant import reference as quant_ref
from moefuse.testing import (
    assert_bitwise_equal,
    assert_close,
    bits,
    expect_value_error,
    moe_reduction_case,
    poison_,
)

pytestmark = pytest.mark.interpreter

ALGOS = ("oneshot", "twoshot", "torch")
FP8_SCALE = 0.0125
NVFP4_GS = 448.0 * 6 / 6.0
RSF = 2.5


# ----------------------------------------------------------------------------- inputs
def seed_of(*key) -> int:
    return zlib.crc32(repr(key).encode())


def finalize_case(seed, p, m, h, k, *, weights_dtype=torch.bfloat16, shared=True, bias=False):
    """Every rank's permuted rows (unused rows NaN), one index map with invalid slots (-1, -7,
    R, R + 5), per-rank weights and shared rows, the replicated residual and gain, and with
    ``bias`` per-rank expert biases [5, H] with expert ids (some outside [0, 5))."""
    g = torch.Generator().manual_seed(seed)
    r_rows = m * k + 3
    perm = torch.randperm(r_rows, generator=g)[: m * k].to(torch.int32).view(m, k)
    bad = [-1, -7, r_rows, r_rows + 5]
    for t in range(m):  # one invalid slot in most tokens; token 0 fully masked when m > 2
        if t % 3 != 2:
            perm[t, (t + 1) % k] = bad[t % 4]
    if m > 2:
        perm[0, :] = -1
    used = perm[(perm >= 0) & (perm < r_rows)].long()
    ins, ws, shs = [], [], []
    for _ in range(p):
        x = torch.randn(r_rows, h, generator=g).to(torch.bfloat16)
        keep = torch.zeros(r_rows, dtype=torch.bool)
        keep[used] = True
        x[~keep] = float("nan")  # never read: a read would poison the result
        x[:, 0] = -0.0
        ins.append(x)
        ws.append((torch.rand(m, k, generator=g) + 0.1).to(weights_dtype))
        shs.append(torch.randn(m, h, generator=g).to(torch.bfloat16) if shared else None)
    residual = torch.randn(m, h, generator=g).to(torch.bfloat16)
    weight = (torch.rand(h, generator=g) + 0.5).to(torch.bfloat16)
    bs, eids = None, None
    if bias:
        bs = [torch.randn(5, h, generator=g).to(torch.bfloat16) for _ in range(p)]
        eids = torch.randint(-1, 6, (m, k), generator=g, dtype=torch.int32)
    return ins, perm, ws, shs, residual, weight, bs, eids


def digest(*tensors) -> str:
    sha = hashlib.sha1()
    for t in tensors:
        if t is not None:
            sha.update(bits(t).numpy().tobytes())
    return sha.hexdigest()


# ----------------------------------------------------------------------------- references
def _scalar_stepwise(rows, ws, rsf, shared):
    """Element-by-element MoE-finalize stepwise partial of the spec (Python scalars through BF16
    tensors)."""
    bf = lambda x: float(torch.tensor(x, dtype=torch.float32).to(torch.bfloat16).float())  # noqa
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
    acc = 0.0
    for x, w in zip(rows, ws):
        acc = bf(f32(acc + bf(f32(x * w))))
    if rsf != 1.0:
        acc = bf(f32(acc * rsf))
    if shared is not None:
        acc = bf(f32(acc + shared))
    return acc


def test_reference_partial_matches_scalar_oracle():
    ins, perm, ws, shs, _, _, bs, eids = finalize_case(7, 1, 4, 6, 3, bias=True)
    x, w, sh, b = ins[0], ws[0], shs[0], bs[0]
    f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
    for bias in (False, True):
        kw = dict(bias=b, expert_ids=eids) if bias else {}
        got = mref.finalize_partial(x, perm, w, RSF, sh, "stepwise", **kw)
        for t in range(4):
            for j in range(6):
                rows, wts = [], []
                for k in range(3):
                    i = int(perm[t, k])
                    if 0 <= i < x.shape[0]:
                        e = int(eids[t, k])
                        add = float(b[e, j]) if bias and 0 <= e < b.shape[0] else 0.0
                        rows.append(f32(float(x[i, j]) + add))  # FP32 add, not rounded to T
                        wts.append(float(w[t, k]))
                want = _scalar_stepwise(rows, wts, RSF, float(sh[t, j]))
                assert float(got[t, j]) == want, (bias, t, j)
        assert torch.isfinite(got.float()).all()
    # fp32 mode is the deterministic finalize of spec: moe_finalize
    from moefuse.moe.reference import moe_finalize_reference

    want = moe_finalize_reference(
        x, perm, w, routed_scaling_factor=RSF, shared_expert_output=sh, bias=b, expert_ids=eids
    )
    got = mref.finalize_partial(x, perm, w, RSF, sh, "fp32", b, eids)
    assert_bitwise_equal(got, want, "fp32 partial")


def test_reference_reduction_is_dense_finalize():
    xs, scales, toks, res, w = moe_reduction_case(3, 2, 3, 8, 4, "cpu")
    for acc in ("stepwise", "fp32"):
        part = mref.reduction_partial(xs[0], scales[0], toks[0], acc)
        rows = xs[0].permute(1, 0, 2).reshape(12, 8)
        idx = torch.arange(12, dtype=torch.int32).view(3, 4)
        want = mref.finalize_partial(rows, idx, scales[0].t(), 1.0, toks[0], acc)
        assert_bitwise_equal(part, want, acc)


# ----------------------------------------------------------------------------- kernels
def _check(outs, want, quant, layout, what):
    assert_bitwise_equal(outs[0], want["residual_out"], f"{what} residual_out")
    assert_close(outs[1], want["norm_out"], "rsqrt_half", f"{what} norm_out")
    if quant == "fp8":
        q = quant_ref.fp8_quantize_reference(outs[1], torch.tensor([FP8_SCALE]))
        assert_bitwise_equal(outs[2].view(torch.uint8), q.view(torch.uint8), f"{what} fp8")
    elif quant == "nvfp4":  # interpreter: rcp_fast is the IEEE reciprocal, as the reference's
        q, sf = quant_ref.fp4_quantize_reference(
            outs[1], torch.tensor([NVFP4_GS]), layout, recipe="fast"
        )
        assert_bitwise_equal(outs[2], q, f"{what} nvfp4 codes")
        assert_bitwise_equal(outs[3], sf.reshape(outs[3].shape), f"{what} nvfp4 scales")


def _quant_kw(quant, layout):
    if quant == "fp8":
        return dict(quant="fp8", scale_factor=torch.tensor([FP8_SCALE]))
    if quant == "nvfp4":
        return dict(quant="nvfp4", scale_factor=torch.tensor([NVFP4_GS]), layout=layout)
    return {}


def _finalize_call(moefuse, ws, rank, case, rows, opts, algo, impl="triton"):
    ins, perm, wts, shs, res, w, bs, eids = case
    sl = slice(*rows) if rows is not None else slice(None)
    if bs is not None:
        opts = dict(opts, bias=bs[rank], expert_ids=eids[sl])
    kw = dict(
        workspace=ws,
        algorithm=algo,
        impl=impl,
        expert_scale_factor=wts[rank][sl],
        routed_scaling_factor=opts["rsf"],
        weight_bias=opts["weight_bias"],
        accumulate=opts["accumulate"],
        **_quant_kw(opts["quant"], opts["layout"]),
        bias=opts.get("bias"),
        expert_ids=opts.get("expert_ids"),
    )
    if shs[rank] is not None:
        kw["shared_expert_output"] = shs[rank][sl]
    m = res[sl].shape[0]
    kw["residual_out"] = poison_(torch.empty_like(res[sl]))
    kw["norm_out"] = poison_(torch.empty_like(res[sl]))
    return (
        moefuse.moe_finalize_allreduce_residual_rmsnorm(ins[rank], res[sl], w, perm[sl], **kw)[:4]
        if m
        else None
    )


def _reduction_call(moefuse, ws, rank, case, rows, opts, algo, impl="triton"):
    xs, scales, toks, res, w = case
    sl = slice(*rows) if rows is not None else slice(None)
    ar = poison_(torch.empty_like(res[sl]))
    outs = moefuse.moe_allreduce_residual_rmsnorm(
        xs[rank][:, sl].contiguous(),
        scales[rank][:, sl].contiguous(),
        toks[rank][sl],
        res[sl],
        w,
        workspace=ws,
        algorithm=algo,
        impl=impl,
        weight_bias=opts["weight_bias"],
        accumulate=opts["accumulate"],
        allreduce_out=ar,
        residual_out=poison_(torch.empty_like(res[sl])),
        norm_out=poison_(torch.empty_like(res[sl])),
        **_quant_kw(opts["quant"], opts["layout"]),
    )
    return (*outs, ar)


def _case_and_oracle(op, i, world_size, m, h, k, opts, bias=False):
    """(inputs of every rank, oracle outputs, call function) of one case."""
    key = (op, h, m, k, opts["accumulate"], opts["quant"])
    sf = torch.tensor([FP8_SCALE if opts["quant"] == "fp8" else NVFP4_GS])
    common = dict(
        weight_bias=opts["weight_bias"],
        accumulate=opts["accumulate"],
        quant=opts["quant"],
        scale_factor=sf,
        layout=opts["layout"],
    )
    if op == "finalize":
        case = finalize_case(
            seed_of(*key),
            world_size,
            m,
            h,
            k,
            weights_dtype=(torch.bfloat16, torch.float32)[i % 2],
            shared=i % 2 == 0,
            bias=bias,
        )
        ins, perm, wts, shs, res, w, bs, eids = case
        want = mref.moe_finalize_allreduce_from_ranks(
            ins,
            perm,
            res,
            w,
            expert_scale_factors=wts,
            routed_scaling_factor=opts["rsf"],
            shared_expert_outputs=shs if shs[0] is not None else None,
            biases=bs,
            expert_ids=eids,
            **common,
        )
        return case, want, _finalize_call
    case = moe_reduction_case(seed_of(*key), world_size, m, h, k, "cpu")
    xs, scales, toks, res, w = case
    return case, mref.moe_allreduce_from_ranks(xs, scales, toks, res, w, **common), _reduction_call


@contextlib.contextmanager
def _variant(algo: str):
    """``"oneshot/split"``: algorithm "oneshot" with MOEFUSE_MOE_COMM_VARIANT=split around the
    call (launch plans dropped on entry and exit: they record the knob). Yields the algorithm."""
    import os

    from moefuse import _fastpath

    base, _, variant = algo.partition("/")
    if not variant:
        yield base
        return
    os.environ["MOEFUSE_MOE_COMM_VARIANT"] = variant
    _fastpath.clear()
    try:
        yield base
    finally:
        os.environ.pop("MOEFUSE_MOE_COMM_VARIANT")
        _fastpath.clear()


def scenario(rank, world_size, cfg):
    """For each case: every algorithm and the reference path against the oracle, bitwise equal to
    each other; one token alone equals the same token inside the batch. Returns digests.
    ``algorithms`` may name one-shot variants ("oneshot/split");
    ``split_ctas`` sets the split variant's CTAs per row."""
    import os

    import moefuse
    from moefuse.comm.moe_reduction.ops import extra_regions

    if cfg.get("split_ctas"):  # several CTAs per row even at a tiny H
        os.environ["MOEFUSE_MOE_COMM_SPLIT_CTAS"] = str(cfg["split_ctas"])
    if cfg.get("ctas_per_sm"):  # another grid for the peer kernels: same bits
        os.environ["MOEFUSE_MOE_COMM_CTAS_PER_SM"] = str(cfg["ctas_per_sm"])
    if cfg.get("wide_from"):  # the wide-row rules at a tiny H: MoE reduction auto two-shot, 2 CTAs
        from moefuse.comm.moe_reduction import kernels as moe_kernels
        from moefuse.comm.moe_reduction import ops as moe_ops

        width, tokens = cfg["wide_from"]
        moe_ops.DENSE_TWOSHOT_MIN_WIDTH = width
        moe_ops.DENSE_TWOSHOT_MIN_TOKENS = tokens
        moe_kernels.TWOSHOT_TWO_CTAS_MIN_TOKENS = tokens
    if cfg.get("rows_per_batch"):  # cover the producer's batched row loads at small H
        from moefuse.comm.moe_reduction import kernels as moe_kernels

        moe_kernels.ROWS_PER_BATCH_OVERRIDE = cfg["rows_per_batch"]
    digests = []
    for h, tokens in cfg["shapes"]:
        m_cap = max(tokens)
        ws = moefuse.AllReduceWorkspace(
            None,
            m_cap,
            h,
            torch.bfloat16,
            "cpu",
            timeout_s=120,
            extra_regions=extra_regions(m_cap, h),
        )
        for m in tokens:
            for i, (op, k, accumulate, quant) in enumerate(cfg["cases"]):
                if quant == "nvfp4" and h % 16:
                    continue
                opts = dict(
                    accumulate=accumulate,
                    quant=quant,
                    weight_bias=float(i % 2),
                    layout=("swizzled_128x4", "linear", "swizzled_8x4")[i % 3],
                    rsf=RSF if i % 2 == 0 else 1.0,
                )
                bias = cfg.get("bias", False) or i % 4 in (2, 3)  # per-expert bias + ids
                case, want, call = _case_and_oracle(op, i, world_size, m, h, k, opts, bias)
                first = None
                for algo in (*cfg["algorithms"], "reference"):
                    what = f"rank {rank} {op} H={h} M={m} K={k} {opts} {algo}"
                    impl = "reference" if algo == "reference" else "triton"
                    gen = int(ws.ctrl[CTRL_GEN])
                    with _variant("auto" if algo == "reference" else algo) as base:
                        outs = call(moefuse, ws, rank, case, None, opts, base, impl)
                    if algo.startswith("oneshot"):  # one Lamport generation per one-shot call
                        assert int(ws.ctrl[CTRL_GEN]) == (gen + 1) % 3, f"{what} generation"
                    if algo == "auto" and cfg.get("wide_from"):  # two-shot keeps the generation
                        twoshot = (
                            op == "reduction"
                            and accumulate == "stepwise"
                            and h >= cfg["wide_from"][0]
                            and m >= cfg["wide_from"][1]
                        )
                        moved = int(ws.ctrl[CTRL_GEN]) != gen
                        assert moved != twoshot, f"{what}: auto took two-shot? {not moved}"
                    _check(outs, want, quant, opts["layout"], what)
                    if op == "reduction":
                        assert_bitwise_equal(
                            outs[-1], want["allreduce_out"], f"{what} allreduce_out"
                        )
                    if first is None:
                        first = outs
                    for a, b in zip(outs, first):
                        assert_bitwise_equal(a, b, f"{what} vs {cfg['algorithms'][0]}")
                    # batch invariance on the first algorithm (the others equal it bitwise)
                    if m > 1 and algo == cfg["algorithms"][0] and cfg.get("alone", True):
                        row = m - 2
                        with _variant(algo) as base:
                            alone = call(moefuse, ws, rank, case, (row, row + 1), opts, base)
                        for a, b in zip(alone[:2], outs[:2]):
                            assert_bitwise_equal(a, b[row : row + 1], f"{what} row alone")
                digests.append(digest(*first))
        if cfg.get("bad_inputs") and h == cfg["shapes"][0][0]:
            _bad_inputs(moefuse, ws, h)
            _compat(moefuse, ws, rank, world_size, h)
            _opcheck_compile(moefuse, ws, rank, world_size, h)
        ws.close()
    return digests


def _bad_inputs(moefuse, ws, h):
    ins, perm, wts, shs, res, w, *_ = finalize_case(1, 1, 2, h, 2)
    out = poison_(torch.empty_like(res))
    f = moefuse.moe_finalize_allreduce_residual_rmsnorm
    kw = dict(workspace=ws, residual_out=out)
    expect_value_error(
        lambda: f(ins[0], res, w, perm.long(), **kw), "expanded_idx_to_permuted_idx", out
    )
    expect_value_error(lambda: f(ins[0].float(), res, w, perm, **kw), "allreduce_in", out)
    expect_value_error(
        lambda: f(ins[0], res, w, perm, expert_scale_factor=wts[0][:, :1], **kw),
        "expert_scale_factor",
        out,
    )
    expect_value_error(
        lambda: f(ins[0], res, w, perm, routed_scaling_factor=float("inf"), **kw),
        "routed_scaling_factor",
        out,
    )
    expect_value_error(lambda: f(ins[0], res, w, perm, quant="fp8", **kw), "scale_factor", out)
    expect_value_error(lambda: f(ins[0], res, w, perm, accumulate="fp64", **kw), "accumulate", out)
    expect_value_error(lambda: f(ins[0], res, w, perm, workspace=None), "workspace")
    expect_value_error(lambda: f(ins[0], res, w, perm, norm_out=res, **kw), "norm_out", out)
    expect_value_error(
        lambda: f(ins[0], res, w, perm, bias=torch.zeros(4, h), **kw), "expert_ids", out
    )
    sup = moefuse.supports_moe_finalize_allreduce_residual_rmsnorm
    assert sup(ins[0], res, w, perm, workspace=ws, expert_scale_factor=wts[0])  # interpreter
    assert not sup(ins[0], res, w, perm.long(), workspace=ws)
    assert not sup(ins[0], res, w, perm, workspace=ws, quant="fp8")  # no scale_factor
    xs, scales, toks, res2, w2 = moe_reduction_case(1, 1, 2, h, 2, "cpu")
    sup = moefuse.supports_moe_allreduce_residual_rmsnorm
    assert sup(xs[0], scales[0], toks[0], res2, w2, workspace=ws)
    assert not sup(xs[0], scales[0][:1], toks[0], res2, w2, workspace=ws)
    g = moefuse.moe_allreduce_residual_rmsnorm
    expect_value_error(
        lambda: g(xs[0], scales[0][:1], toks[0], res2, w2, workspace=ws, residual_out=out),
        "scale_input",
        out,
    )
    expect_value_error(
        lambda: g(xs[0][:, :1], scales[0], toks[0], res2, w2, workspace=ws, residual_out=out),
        "active_experts_token_input",
        out,
    )


def _compat(moefuse, ws, rank, world_size, h):
    """FlashInfer call styles write the same bits as the moefuse ops (reference path: the
    argument mapping is what is tested here)."""
    from moefuse.compat import flashinfer as fi

    m, k = 3, 2
    ins, perm, wts, shs, res, w, *_ = finalize_case(11, world_size, m, h, k)
    want = moefuse.moe_finalize_allreduce_residual_rmsnorm(
        ins[rank],
        res,
        w,
        perm,
        workspace=ws,
        expert_scale_factor=wts[rank],
        routed_scaling_factor=RSF,
        shared_expert_output=shs[rank],
        impl="reference",
    )
    ro, no = poison_(torch.empty_like(res)), poison_(torch.empty_like(res))
    fi.trtllm_moe_finalize_allreduce_fusion(
        ins[rank],
        res,
        w,
        perm,
        no,
        ro,
        ws,
        False,
        rank,
        world_size,
        1e-6,
        shs[rank],
        wts[rank],
        RSF,
        impl="reference",
    )
    assert_bitwise_equal(ro, want[0], "compat pattern 7 residual_out")
    assert_bitwise_equal(no, want[1], "compat pattern 7 norm_out")
    ro2, no2 = poison_(torch.empty_like(res)), poison_(torch.empty_like(res))
    fi.trtllm_allreduce_fusion(
        ins[rank],
        world_size,
        rank,
        m,
        h,
        ws,
        False,
        False,
        True,
        7,
        residual_in=res,
        residual_out=ro2,
        norm_out=no2,
        rms_gamma=w,
        rms_eps=1e-6,
        expanded_idx_to_permuted_idx=perm,
        expert_scale_factor=wts[rank],
        routed_scaling_factor=RSF,
        shared_expert_output=shs[rank],
        impl="reference",
    )
    assert_bitwise_equal(ro2, want[0], "compat trtllm_allreduce_fusion(7)")
    xs, scales, toks, res, w = moe_reduction_case(12, world_size, m, h, k, "cpu")
    want = moefuse.moe_allreduce_residual_rmsnorm(
        xs[rank], scales[rank], toks[rank], res, w, workspace=ws, impl="reference"
    )
    ro3, no3 = poison_(torch.empty_like(res)), poison_(torch.empty_like(res))
    fi.trtllm_allreduce_fusion(
        toks[rank],
        world_size,
        rank,
        m,
        h,
        ws,
        False,
        False,
        True,
        6,
        residual_in=res,
        residual_out=ro3,
        norm_out=no3,
        rms_gamma=w,
        rms_eps=1e-6,
        moe_reduction_device_num_experts=k,
        moe_reduction_scale_input=scales[rank].reshape(-1),
        moe_reduction_active_experts_token_input=xs[rank],
        impl="reference",
    )
    assert_bitwise_equal(ro3, want[0], "compat trtllm_allreduce_fusion(6) residual_out")
    assert_bitwise_equal(no3, want[1], "compat trtllm_allreduce_fusion(6) norm_out")


def _opcheck_compile(moefuse, ws, rank, world_size, h):
    """Both custom ops pass torch.library.opcheck (schema, fake tensors, mutation) and run under
    torch.compile(fullgraph=True) with the same bits as eager (reference backend: cheap)."""
    from moefuse.comm.moe_reduction import ops

    m, k = 3, 2
    ins, perm, wts, shs, res, w, *_ = finalize_case(13, world_size, m, h, k)
    e = lambda: torch.empty_like(res)  # noqa: E731
    torch.library.opcheck(
        ops.moe_finalize_allreduce_residual_rmsnorm_op,
        (
            ins[rank],
            perm,
            wts[rank],
            shs[rank],
            None,
            None,
            res,
            w,
            None,
            e(),
            e(),
            None,
            None,
            ws.id,
            RSF,
            1e-6,
            0.0,
            True,
            1,
            0,
            "auto",
            False,
            "reference",
        ),
    )
    xs, scales, toks, res2, w2 = moe_reduction_case(14, world_size, m, h, k, "cpu")
    torch.library.opcheck(
        ops.moe_allreduce_residual_rmsnorm_op,
        (
            xs[rank],
            scales[rank],
            toks[rank],
            res2,
            w2,
            None,
            e(),
            e(),
            e(),
            None,
            None,
            ws.id,
            1e-6,
            0.0,
            False,
            1,
            0,
            "auto",
            False,
            "reference",
        ),
    )

    def layer(x, res, w, perm, wt, sh):
        return moefuse.moe_finalize_allreduce_residual_rmsnorm(
            x,
            res,
            w,
            perm,
            workspace=ws,
            expert_scale_factor=wt,
            shared_expert_output=sh,
            impl="reference",
        )

    args = (ins[rank], res, w, perm, wts[rank], shs[rank])
    assert_compiles_to_eager_bits(layer, args, layer(*args))


def _ranks_agree(results):
    for r, d in enumerate(results[1:], start=1):
        assert d == results[0], f"rank {r} outputs differ bitwise from rank 0"


def test_two_ranks():
    """H = 40 (not a power of two; NVFP4 cases skipped; M in {1, 5}) and 48 (M = 5), K in
    {2, 3}; bad inputs; FlashInfer call styles; opcheck and torch.compile."""
    cfg = dict(
        shapes=((40, (1, 5)), (48, (5,))),
        cases=(
            ("finalize", 2, "stepwise", None),
            ("reduction", 3, "fp32", None),
            ("finalize", 3, "fp32", "fp8"),
            ("finalize", 3, "stepwise", "nvfp4"),
            ("reduction", 2, "stepwise", "nvfp4"),
        ),
        algorithms=ALGOS,
    )
    _ranks_agree(run_group(2, scenario, cfg))
    # the API checks on the first shape's workspace, as processes: ranks that trace (opcheck,
    # torch.compile) cannot be threads of one process
    api = dict(shapes=cfg["shapes"][:1], cases=(), algorithms=ALGOS, bad_inputs=True)
    _ranks_agree(run_group(2, scenario, api, ranks="processes"))


def test_three_ranks():
    """P = 3; the expert rows loaded one at a time (rows_per_batch 1) and 2 CTAs per SM (another
    grid): same bits; expert bias."""
    cfg = dict(
        shapes=((72, (5,)),),
        cases=(("finalize", 3, "stepwise", "fp8"),),
        algorithms=ALGOS,
        alone=False,
        rows_per_batch=1,
        bias=True,
        ctas_per_sm=2,
    )
    _ranks_agree(run_group(3, scenario, cfg))


def test_two_ranks_oneshot_variants():
    """The column-split one-shot (4 CTAs per row, 2 row groups: rows loop) against the oracle
    and bitwise equal to the fused one-shot and the torch path:
    both ops, stepwise / fp32, FP8 / NVFP4, bias, a token alone vs in the batch."""
    cfg = dict(
        shapes=((40, (1, 5)), (48, (5,))),
        cases=(
            ("finalize", 2, "stepwise", None),
            ("finalize", 3, "fp32", "fp8"),
            ("finalize", 3, "stepwise", "nvfp4"),
            ("reduction", 2, "fp32", None),
        ),
        algorithms=("oneshot", "oneshot/split", "torch"),
        split_ctas=4,
    )
    _ranks_agree(run_group(2, scenario, cfg))


def test_three_ranks_oneshot_variants():
    """P = 3: split (2 CTAs per row, rows loaded one at a time, bias) bitwise equal to the fused
    one-shot."""
    cfg = dict(
        shapes=((72, (5,)),),
        cases=(("finalize", 3, "stepwise", "fp8"), ("finalize", 2, "fp32", None)),
        algorithms=("oneshot", "oneshot/split"),
        alone=False,
        rows_per_batch=1,
        bias=True,
        split_ctas=2,
    )
    _ranks_agree(run_group(3, scenario, cfg))


def test_two_ranks_wide_rows_auto():
    """The wide-row rules at H = 40 (thresholds lowered to H >= 33, M >= 5): "auto" of the MoE
    reduction (stepwise) takes two-shot at M = 5 and one-shot at M = 1 (seen from the
    Lamport generation), fp32 and MoE finalize keep one-shot; the two-shot runs 2 CTAs per SM; all
    bitwise equal to the explicit algorithms and the oracle."""
    cfg = dict(
        shapes=((40, (1, 5)),),
        cases=(
            ("reduction", 3, "stepwise", None),
            ("reduction", 2, "fp32", "fp8"),
            ("finalize", 2, "stepwise", None),
        ),
        algorithms=("auto", "oneshot", "twoshot"),
        wide_from=(33, 5),
    )
    _ranks_agree(run_group(2, scenario, cfg))


def test_wide_row_choices(monkeypatch):
    """The rules behind "auto" and the grid, as measured (moe_ops / moe_kernels):
    MoE reduction stepwise takes two-shot from H = 4097 and M = 2048 (not fp32, not MoE finalize,
    not narrower or fewer); two-shot runs 2 CTAs per SM from 2048 tokens at any width; the one-shot
    keeps its table; MOEFUSE_MOE_COMM_CTAS_PER_SM overrides every kernel."""
    from moefuse.comm.moe_reduction.kernels import ctas_per_sm
    from moefuse.comm.moe_reduction.ops import prefers_twoshot

    assert prefers_twoshot(2048, 7168, dense=True, stepwise=True)
    assert prefers_twoshot(16384, 4097, dense=True, stepwise=True)
    assert not prefers_twoshot(2047, 7168, dense=True, stepwise=True)
    assert not prefers_twoshot(2048, 4096, dense=True, stepwise=True)
    assert not prefers_twoshot(2048, 7168, dense=True, stepwise=False)
    assert not prefers_twoshot(2048, 7168, dense=False, stepwise=True)
    assert ctas_per_sm(2048, 7168, True, "twoshot") == 2
    assert ctas_per_sm(2048, 2880, False, "twoshot") == 2
    assert ctas_per_sm(2047, 7168, True, "twoshot") == 1
    assert ctas_per_sm(2048, 7168, True, "oneshot") == 1  # MoE reduction: no faster
    assert ctas_per_sm(2048, 7168, False, "oneshot") == 2
    assert ctas_per_sm(64, 4096, False, "oneshot") == 1
    assert ctas_per_sm(65, 4096, True, "oneshot") == 2
    monkeypatch.setenv("MOEFUSE_MOE_COMM_CTAS_PER_SM", "1")
    assert ctas_per_sm(16384, 7168, True, "twoshot") == 1


def test_four_ranks_smallest():
    cfg = dict(shapes=((40, (1,)),), cases=(("finalize", 2, "stepwise", None),), algorithms=ALGOS)
    _ranks_agree(run_group(4, scenario, cfg))
