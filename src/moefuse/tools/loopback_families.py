"""Op families of ``moefuse.tools.loopback_gpu_check``: per family the workspace, random inputs
on the device, one call of one rank, and the check of rank 0's outputs against the reference of
ALL ranks' inputs (plus the bit-level helpers they share). Imported by the tool after it has set
the environment; ``BF16`` is set by the tool once torch is imported."""

from __future__ import annotations

import os

BF16 = None  # torch.bfloat16 (set by loopback_gpu_check.main)
P = 2
K = int(os.environ.get("LOOPBACK_TOPK", "8"))  # top-k of the MoE families (tests vary it)
RSF = 2.5


# ----------------------------------------------------------------------------- helpers
def raw(t):
    from moefuse.testing import _raw_bits

    return _raw_bits(t)


def same_bits(a, b) -> bool:
    import torch

    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def max_ulp(a, b) -> int:
    """Largest distance in units in the last place of BF16/FP16 ``a`` vs ``b`` (NaN: 1 << 30)."""
    import torch

    from moefuse.testing import ulp_distance

    if a.shape != b.shape:
        return 1 << 30
    if a.numel() == 0:
        return 0
    if not bool(torch.isfinite(a.float()).all()):
        return 1 << 30
    return int(ulp_distance(a, b.to(a.dtype)).max())


def checksum(*tensors) -> int:
    """Position-weighted integer checksum of the bits (compared across ranks on the host)."""
    import torch

    total = 0
    for t in tensors:
        b = raw(t).reshape(-1).long()
        pos = torch.arange(b.numel(), device=b.device) % 1000003 + 1
        total = (total * 1000033 + int((b * pos).sum())) % (1 << 61)
    return total


def record(family, op, algo, m, h, ok, detail="", sums=None, status=None) -> dict:
    return dict(
        family=family,
        op=op,
        algo=algo,
        M=m,
        H=h,
        status=status or ("PASS" if ok else "FAIL"),
        detail=detail,
        checksum=sums,
    )


def gen(seed, dev):
    import torch

    return torch.Generator(device=dev).manual_seed(seed)


_SCRATCH: dict = {}


def _scratch(like):
    """A per-thread [M, H] scratch for the timing-only unfused chains (allocated once per
    shape, outside graph capture's first call)."""
    import threading

    import torch

    key = (threading.get_ident(), tuple(like.shape), like.dtype, like.device)
    if key not in _SCRATCH:
        _SCRATCH[key] = torch.empty_like(like)
    return _SCRATCH[key]


def _fused_options(algo: str) -> dict:
    """``algorithm`` / ``accumulate`` of a fused MoE op from a family algorithm name: "ALGO" or
    "ALGO_fp32"."""
    algorithm, _, acc = algo.partition("_")
    return dict(algorithm=algorithm, accumulate=acc or "stepwise")


def _chain_norm(moefuse, ws, part, res, w, pdl):
    """The unfused chains' second step: ``allreduce_residual_rmsnorm`` of the finalized
    partial (the bench's chain (a))."""
    return moefuse.allreduce_residual_rmsnorm(
        part, res, w, workspace=ws, impl="triton", enable_pdl=pdl
    )


# ----------------------------------------------------------------------------- families
class AllReduceNorm:
    """``allreduce_residual_rmsnorm`` one-shot / two-shot."""

    name, op, algos = "ar_norm", "allreduce_residual_rmsnorm", ("oneshot", "twoshot")

    @staticmethod
    def workspace(moefuse, m_cap, h, dev, timeout_s):
        return moefuse.AllReduceWorkspace(
            None, m_cap, h, BF16, dev, timeout_s=timeout_s, oneshot_max_tokens=m_cap
        )

    @staticmethod
    def inputs(seed, m, h, dev):
        import torch

        g = gen(seed, dev)
        parts = []
        for r in range(P):
            x = (torch.randn(m, h, generator=g, device=dev) * (0.5 + r)).to(BF16)
            x[:, 0] = -0.0  # the sum must be +0.0 there
            parts.append(x)
        res = torch.randn(m, h, generator=g, device=dev).to(BF16)
        w = (torch.rand(h, generator=g, device=dev) + 0.5).to(BF16)
        return parts, res, w

    @staticmethod
    def call(moefuse, ws, rank, case, algo, pdl=None):
        parts, res, w = case
        return moefuse.allreduce_residual_rmsnorm(
            parts[rank], res, w, workspace=ws, algorithm=algo, impl="triton", enable_pdl=pdl
        )

    @staticmethod
    def check(case, outs):
        from moefuse.comm.all_reduce import reference as ref

        parts, res, w = case
        h_ref, n_ref = ref.allreduce_residual_rmsnorm_from_partials(parts, res, w, 1e-6, 0.0)
        ulp = max_ulp(outs[1], n_ref)
        ok = same_bits(outs[0], h_ref) and ulp <= 1
        return ok, f"residual_out bitwise={same_bits(outs[0], h_ref)} norm_out ulp={ulp}"


class MoeFinalize:
    """``moe_finalize_allreduce_residual_rmsnorm`` (K = 8, shared expert, stepwise) one-shot /
    two-shot."""

    name, op, algos = (
        "moe_finalize",
        "moe_finalize_allreduce_residual_rmsnorm",
        ("oneshot", "twoshot"),
    )

    @staticmethod
    def workspace(moefuse, m_cap, h, dev, timeout_s):
        from moefuse.comm.moe_reduction.ops import extra_regions

        return moefuse.AllReduceWorkspace(
            None,
            m_cap,
            h,
            BF16,
            dev,
            timeout_s=timeout_s,
            oneshot_max_tokens=m_cap,
            extra_regions=extra_regions(m_cap, h),
        )

    @staticmethod
    def inputs(seed, m, h, dev):
        """The GPU tests' inputs (``moefuse.testing.moe_finalize_case``), without bias."""
        from moefuse.testing import moe_finalize_case

        return moe_finalize_case(seed, P, m, h, K, dev)[:6]

    @staticmethod
    def call(moefuse, ws, rank, case, algo, pdl=None):
        """``algo``: a fused algorithm, ``ALGO_fp32`` (accumulate="fp32") or, for timing only,
        "chain" (``moe_finalize`` into a scratch, then ``allreduce_residual_rmsnorm``: the
        bench's unfused chain (a); other bits)."""
        ins, perm, wts, shs, res, w = case
        if algo == "chain":
            part = _scratch(res)
            moefuse.moe_finalize(
                ins[rank],
                perm,
                wts[rank],
                out=part,
                routed_scaling_factor=RSF,
                shared_expert_output=shs[rank],
                impl="triton",
                enable_pdl=pdl,
            )
            return _chain_norm(moefuse, ws, part, res, w, pdl)
        return moefuse.moe_finalize_allreduce_residual_rmsnorm(
            ins[rank],
            res,
            w,
            perm,
            workspace=ws,
            expert_scale_factor=wts[rank],
            routed_scaling_factor=RSF,
            shared_expert_output=shs[rank],
            impl="triton",
            enable_pdl=pdl,
            **_fused_options(algo),
        )

    @staticmethod
    def check(case, outs):
        from moefuse.comm.moe_reduction import reference as mref

        ins, perm, wts, shs, res, w = case
        want = mref.moe_finalize_allreduce_from_ranks(
            ins,
            perm,
            res,
            w,
            expert_scale_factors=wts,
            routed_scaling_factor=RSF,
            shared_expert_outputs=shs,
        )
        bitwise = same_bits(outs[0], want["residual_out"])
        ulp = max_ulp(outs[1], want["norm_out"])
        return bitwise and ulp <= 1, f"residual_out bitwise={bitwise} norm_out ulp={ulp}"


class MoeReduce:
    """``moe_allreduce_residual_rmsnorm`` (spec: E_loc = K dense expert rows per token,
    FP32 scales [E_loc, M], token input; stepwise) one-shot / two-shot, as the bench's
    ``reduction_cases``. Timing-only "chain": ``moe_finalize`` of the rows viewed as
    [E_loc * M, H] through map[t, e] = e * M + t, then ``allreduce_residual_rmsnorm`` (the
    bench's chain (a))."""

    name, op, algos = "moe_reduce", "moe_allreduce_residual_rmsnorm", ("oneshot", "twoshot")
    workspace = staticmethod(MoeFinalize.workspace)

    @staticmethod
    def inputs(seed, m, h, dev):
        """The GPU tests' inputs (``moefuse.testing.moe_reduction_case``), plus the chain's
        map and [M, E] scales."""
        import torch

        from moefuse.testing import moe_reduction_case

        xs, scs, toks, res, w = moe_reduction_case(seed, P, m, h, K, dev)
        idx = (torch.arange(K, device=dev)[None, :] * m + torch.arange(m, device=dev)[:, None]).to(
            torch.int32
        )
        scs_t = [s.t().contiguous() for s in scs]
        return xs, scs, toks, res, w, idx, scs_t

    @staticmethod
    def call(moefuse, ws, rank, case, algo, pdl=None):
        """``algo`` as :meth:`MoeFinalize.call`."""
        xs, scs, toks, res, w, idx, scs_t = case
        if algo == "chain":
            m, h = res.shape
            part = _scratch(res)
            moefuse.moe_finalize(
                xs[rank].view(K * m, h),
                idx,
                scs_t[rank],
                out=part,
                shared_expert_output=toks[rank],
                impl="triton",
                enable_pdl=pdl,
            )
            return _chain_norm(moefuse, ws, part, res, w, pdl)
        return moefuse.moe_allreduce_residual_rmsnorm(
            xs[rank],
            scs[rank],
            toks[rank],
            res,
            w,
            workspace=ws,
            impl="triton",
            enable_pdl=pdl,
            **_fused_options(algo),
        )

    @staticmethod
    def check(case, outs):
        from moefuse.comm.moe_reduction import reference as mref

        xs, scs, toks, res, w, _, _ = case
        want = mref.moe_allreduce_from_ranks(xs, scs, toks, res, w)
        bitwise = same_bits(outs[0], want["residual_out"])
        ulp = max_ulp(outs[1], want["norm_out"])
        return bitwise and ulp <= 1, f"residual_out bitwise={bitwise} norm_out ulp={ulp}"


class AllGatherNorm:
    """``all_gather_rmsnorm`` one-shot: bitwise equal to ``moefuse.rmsnorm`` of the full rows.
    Subclasses: the other all-gather ops (``OP`` as in ``moefuse.bench.all_gather``), each
    bitwise equal to its single-GPU op on the full rows."""

    name, op, algos = "allgather_norm", "all_gather_rmsnorm", ("oneshot",)
    OP = "rmsnorm"

    @staticmethod
    def workspace(moefuse, m_cap, h, dev, timeout_s):
        ws = moefuse.AllReduceWorkspace(
            None,
            m_cap,
            h,
            BF16,
            dev,
            timeout_s=timeout_s,
            oneshot_max_tokens=1,
            extra_regions=moefuse.allgather_regions(m_cap, h),
        )
        moefuse.prepare_allgather(ws, BF16)  # (outside any capture)
        return ws

    @staticmethod
    def inputs(seed, m, h, dev):
        import torch

        from moefuse.bench.all_gather import case_tensors

        g = gen(seed, dev)
        full = torch.randn(m, h, generator=g, device=dev).to(BF16)
        full[0, :3] = -0.0
        s = h // P
        shards = [full[:, r * s : (r + 1) * s].contiguous() for r in range(P)]
        # one set of replicated parameters and outputs per rank (each rank writes its own)
        return full, shards, [case_tensors(m, h, dev) for _ in range(P)]

    @classmethod
    def call(cls, moefuse, ws, rank, case, algo, pdl=None):
        from moefuse.bench.all_gather import fused_op

        full, shards, per_rank = case
        if algo != "oneshot":
            raise ValueError(f"{cls.op}: algorithm {algo!r} is not timed here")
        # (outputs in the rank's preallocated buffers: the next call overwrites them)
        return fused_op(moefuse, cls.OP, shards[rank], per_rank[rank], ws, enable_pdl=pdl)

    @classmethod
    def check(cls, case, outs):
        import moefuse
        from moefuse.bench.all_gather import case_tensors, single_op

        full, shards, per_rank = case
        c = case_tensors(full.shape[0], full.shape[1], full.device)
        want = single_op(moefuse, cls.OP, full, c)
        ok = all(same_bits(a, b) for a, b in zip(outs, want))
        diffs = [int((raw(a) != raw(b)).sum()) for a, b in zip(outs, want)]
        return ok, f"bitwise vs {cls.OP} on the full rows={ok} (differing elements {diffs})"


class AllGatherFp8(AllGatherNorm):
    """``all_gather_rmsnorm_fp8`` (E4M3 codes) vs ``rmsnorm_quant`` of the full rows."""

    name, op, OP = "allgather_fp8", "all_gather_rmsnorm_fp8", "fp8"


class AllGatherFp4(AllGatherNorm):
    """``all_gather_rmsnorm_fp4_quantize`` (linear scales) vs ``rmsnorm_fp4_quantize``."""

    name, op, OP = "allgather_fp4", "all_gather_rmsnorm_fp4_quantize", "fp4"


class AllGatherGated(AllGatherNorm):
    """``all_gather_gated_residual_next_rmsnorm`` (tensor alpha, beta, FP32 residual) vs
    ``gated_residual_next_rmsnorm`` of the full branch rows: ffn_input and residual_out."""

    name, op, OP = "allgather_gated", "all_gather_gated_residual_next_rmsnorm", "gated"


class TpFinalize:
    """``tp_moe_finalize_rmsnorm`` (K = 8, FP32 weights, ~10 % invalid slots)."""

    name, op = "tp_finalize", "tp_moe_finalize_rmsnorm"
    algos = ("slot_oneshot", "expert_owner", "token_owner", "staged")
    opts = dict(eps=1e-6, gain_center=0.0, weight_before_norm=True)

    @staticmethod
    def workspace(moefuse, m_cap, h, dev, timeout_s):
        return moefuse.ExpertNormWorkspace(None, h, K, dev, timeout_s=timeout_s)

    @staticmethod
    def inputs(seed, m, h, dev):
        import torch

        g = gen(seed, dev)
        r = m * K + 3
        perm = torch.randperm(r, generator=g, device=dev)[: m * K].view(m, K).to(torch.int32)
        inv = torch.rand(m, K, generator=g, device=dev) < 0.1
        idx = torch.where(inv, torch.full_like(perm, -1), perm)
        valid = idx >= 0
        parts = []
        for q in range(P):
            rows = torch.full((r, h), float("nan"), dtype=BF16, device=dev)
            vals = torch.randn(int(valid.sum()), h, generator=g, device=dev) * (0.5 + q)
            vals[:, 0] = -0.0
            rows[idx[valid].long()] = vals.to(BF16)
            parts.append(rows)
        w = torch.rand(m, K, generator=g, device=dev)
        w[~valid] = float("nan")
        nw = (torch.rand(h, generator=g, device=dev) + 0.5).to(BF16)
        return parts, w, idx, nw

    @classmethod
    def call(cls, moefuse, ws, rank, case, algo, pdl=None):
        parts, w, idx, nw = case
        return (
            moefuse.tp_moe_finalize_rmsnorm(
                parts[rank],
                w,
                idx,
                nw,
                workspace=ws,
                algorithm=algo,
                impl="triton",
                enable_pdl=pdl,
                **cls.opts,
            ),
        )

    @classmethod
    def check(cls, case, outs):
        import torch

        from moefuse.comm.expert_norm import reference as ref

        parts, w, idx, nw = case
        exp = ref.tp_moe_finalize_rmsnorm_from_ranks(parts, w, idx, nw, **cls.opts)
        out = outs[0]
        if out.isnan().any():
            return False, "NaN in the output (an invalid row or weight was read)"
        diff = (out.float() - exp.float()).abs()
        e = torch.floor(torch.log2(exp.float().abs().clamp_min(2.0**-126)))
        ulp = torch.pow(2.0, e - 7).clamp_min(2.0**-133)
        try:  # sum_k |y_k w_k| over the valid slots (the spec's cancellation bound)
            valid, x = ref._slot_rows(parts, idx, nw.shape[0])
            y = torch.zeros_like(x)
            y[valid] = ref.expert_norm(
                x[valid],
                nw,
                cls.opts["eps"],
                cls.opts["gain_center"],
                cls.opts["weight_before_norm"],
            ).abs()
            mag = (y * torch.where(valid, w.float(), 0.0).abs()[..., None]).sum(1)
            bound, how = ulp + mag * 2.0**-20, "1 ulp + 2^-20 sum|y w|"
        except Exception as exc:  # the reference's private helpers changed: 2 ulp only
            bound, how = 2 * ulp, f"2 ulp (magnitude helper unavailable: {exc})"
        bad = int((diff > bound).sum())
        return bad == 0, f"{bad} elements outside {how}; max |diff| {float(diff.max()):.3g}"


class EpFinalize:
    """``moe_finalize_rmsnorm_allreduce`` (EP, K = 8: slot k is local on rank k mod P, ~10 %
    invalid slots; non-local routes are -1 on each rank): one-shot / two-shot, bitwise equal to
    the reference of every rank's rows (the partials and the rank-order sum are exact there)."""

    name, op, algos = "ep_finalize", "moe_finalize_rmsnorm_allreduce", ("oneshot", "twoshot")
    opts = dict(eps=1e-6, gain_center=0.0, weight_before_norm=True)
    workspace = staticmethod(AllReduceNorm.workspace)  # the EP op runs on that workspace

    @staticmethod
    def inputs(seed, m, h, dev):
        import torch

        parts, w, idx, nw = TpFinalize.inputs(seed, m, h, dev)
        slot = torch.arange(K, device=dev).expand(m, K)
        idxs = [torch.where(slot % P == q, idx, -1).to(torch.int32) for q in range(P)]
        return parts, w, idxs, nw

    @classmethod
    def call(cls, moefuse, ws, rank, case, algo, pdl=None):
        parts, w, idxs, nw = case
        return (
            moefuse.moe_finalize_rmsnorm_allreduce(
                parts[rank],
                w,
                idxs[rank],
                nw,
                workspace=ws,
                algorithm=algo,
                impl="triton",
                enable_pdl=pdl,
                **cls.opts,
            ),
        )

    @classmethod
    def check(cls, case, outs):
        """Within the tolerance of tests/test_comm_expert_norm.py ``assert_ep_close``: 1 ulp of
        the result + 2 ulp of each rank's BF16 partial + 2^-20 sum_k |y_k w_k| per rank (the
        kernel's rsqrt against the reference's)."""
        import torch

        from moefuse.comm.expert_norm import reference as ref

        parts, w, idxs, nw = case
        exp = ref.moe_finalize_rmsnorm_allreduce_from_ranks(parts, [w] * P, idxs, nw, **cls.opts)
        out = outs[0]
        if out.isnan().any():
            return False, "NaN in the output (a non-local row or weight was read)"

        def ulp(t):
            e = torch.floor(torch.log2(t.float().abs().clamp_min(2.0**-126)))
            return torch.pow(2.0, e - 7)

        allow = ulp(torch.maximum(out.float().abs(), exp.float().abs()))
        for rows, idx in zip(parts, idxs):
            allow = allow + 2 * ulp(ref.ep_local_partial(rows, w, idx, nw, **cls.opts))
            valid, x = ref._slot_rows([rows], idx, nw.shape[0])
            y = torch.zeros_like(x)
            y[valid] = ref.expert_norm(
                x[valid],
                nw,
                cls.opts["eps"],
                cls.opts["gain_center"],
                cls.opts["weight_before_norm"],
            ).abs()
            allow = (
                allow + (y * torch.where(valid, w.float(), 0.0).abs()[..., None]).sum(1) * 2.0**-20
            )
        diff = (out.float() - exp.float()).abs()
        bad = int((diff > allow).sum())
        return bad == 0, f"{bad} elements outside the EP bound; max |diff| {float(diff.max()):.3g}"


FAMILIES = {
    f.name: f
    for f in (
        AllReduceNorm,
        MoeFinalize,
        MoeReduce,
        AllGatherNorm,
        AllGatherFp8,
        AllGatherFp4,
        AllGatherGated,
        TpFinalize,
        EpFinalize,
    )
}
