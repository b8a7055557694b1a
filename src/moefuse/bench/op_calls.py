"""One decode-size call of every public op that has launch plans (:mod:`moefuse._fastpath`).

Shared by ``moefuse bench overhead`` (host µs per eager call; the communication ops at P ranks
on P GPUs or on loopback ranks on one GPU) and by the launch-plan tests (every op must record a
plan, and a replay must give the custom op's bits). The calls are the ops' common
configurations at ``m`` tokens and ``h`` columns, BF16. ``impl`` is passed to every op
("triton" in the interpreter: "auto" would run the reference on CPU tensors). Every call set
comes with ``refresh()``, which redraws every input in place (the next call sees fresh data
through the same tensors, so a recorded plan replays).

Single-GPU ops: :func:`single_gpu_calls`. Communication ops: :func:`comm_calls`, on this rank of
a group, outputs preallocated (as an engine calls them at decode), every input the same on every
rank except the rank's own partials (seeded by the rank).

Workspaces: one :class:`moefuse.AllReduceWorkspace` with the all-gather and MoE-fusion extra
regions (all-reduce, all-gather and MoE-reduction families) and one
:class:`moefuse.ExpertNormWorkspace` (the TP / EP per-expert-norm family); the caller closes
them with the returned ``close()``.
"""

from __future__ import annotations

import torch

#: top-k of the MoE ops' calls
TOP_K = 8
#: experts of the single-GPU MoE calls' routing
NUM_EXPERTS = 16
#: the public communication ops, in the order :func:`comm_calls` calls them
COMM_OPS = (
    "allreduce",
    "allreduce_residual_rmsnorm",
    "allreduce_residual_rmsnorm_fp8",
    "allreduce_residual_rmsnorm_out_fp8",
    "allreduce_residual_rmsnorm_nvfp4",
    "allreduce_residual_rmsnorm_out_nvfp4",
    "all_gather_rmsnorm",
    "all_gather_rmsnorm_fp8",
    "all_gather_rmsnorm_fp4_quantize",
    "all_gather_gated_residual_next_rmsnorm",
    "moe_allreduce_residual_rmsnorm",
    "moe_finalize_allreduce_residual_rmsnorm",
    "tp_moe_finalize_rmsnorm",
    "moe_finalize_rmsnorm_allreduce",
)


class _Inputs:
    """The input tensors of a call set, redrawn in place by :meth:`refresh` (same shapes,
    dtypes and addresses; new values from a generator that advances with every refresh)."""

    def __init__(self, dev, seed: int):
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        self.dev = dev
        self.tensors: list[tuple[torch.Tensor, str]] = []

    def add(self, t: torch.Tensor, kind: str = "normal") -> torch.Tensor:
        """Register ``t`` ("normal": N(0, 1); "positive": U[0.5, 1.5); "fixed": kept)."""
        self.tensors.append((t, kind))
        return t

    def refresh(self, seed: int | None = None) -> None:
        """New values (``seed``: reseed first, so the same seed redraws the same values)."""
        if seed is not None:
            self.gen.manual_seed(seed)
        for t, kind in self.tensors:
            if kind == "fixed":
                continue
            v = torch.randn(t.shape, generator=self.gen, device=self.dev)
            if kind == "positive":
                v = torch.rand(t.shape, generator=self.gen, device=self.dev) + 0.5
            t.copy_(v.to(t.dtype))


def single_gpu_calls(dev, *, m: int = 1, h: int = 4096, impl: str = "auto"):
    """``(calls, refresh)``: one ``(public op name, label, fn)`` per single-GPU op with launch
    plans (a few ops twice: the label tells the variant), BF16 inputs at [m, h]."""
    import moefuse
    from moefuse.moe.routing import route_topk, sort_by_expert

    bf = torch.bfloat16
    ins = _Inputs(dev, 4321)

    def rnd(*shape, dtype=bf, kind="normal"):
        t = torch.empty(*shape, dtype=dtype, device=dev)
        return ins.add(t, kind)

    heads, head_dim = 4, 32
    x, r, w = rnd(m, h), rnd(m, h), rnd(h, kind="positive")
    out = torch.empty(m, h, dtype=bf, device=dev)
    f32 = torch.float32
    res32, alpha, beta = rnd(m, h, dtype=f32), rnd(h, dtype=f32, kind="positive"), rnd(h, dtype=f32)
    ro, ffn = torch.empty_like(res32), torch.empty(m, h, dtype=bf, device=dev)
    hx, hg = rnd(m, heads, head_dim), rnd(m, heads, head_dim)
    scale = torch.tensor([0.05], device=dev)
    gscale = torch.tensor([448.0 * 6 / 3.0], device=dev)
    g = torch.Generator(device=dev).manual_seed(7)
    _, ids = route_topk(torch.randn(m, NUM_EXPERTS, generator=g, device=dev), TOP_K)
    plan = sort_by_expert(ids, NUM_EXPERTS)
    weights = rnd(m, TOP_K, dtype=torch.float32, kind="positive")
    logits = rnd(m, NUM_EXPERTS)
    rows = rnd(plan.num_rows, h)
    xp = torch.empty(plan.num_rows, h, dtype=bf, device=dev)
    ins.refresh()
    # quantized inputs of the dequantize ops: fixed codes of random rows
    q8 = torch.randn(m, h, generator=g, device=dev).to(torch.float8_e4m3fn)
    packed, scales = moefuse.fp4_quantize(
        torch.randn(m, h, generator=g, device=dev).to(bf), gscale, impl=impl
    )
    e2p, p2e = plan.expanded_idx_to_permuted_idx, plan.permuted_idx_to_expanded_idx
    inter = 64  # routed experts: transformers' layouts, E experts of width I
    gate_up = (torch.randn(NUM_EXPERTS, 2 * inter, h, generator=g, device=dev) * h**-0.5).to(bf)
    down = (torch.randn(NUM_EXPERTS, h, inter, generator=g, device=dev) * inter**-0.5).to(bf)
    # fp8_linear: a [256, h] E4M3 weight with its 128 x 128 block scales
    w8 = (torch.randn(256, h, generator=g, device=dev) * h**-0.5 * 448).to(torch.float8_e4m3fn)
    w8s = torch.rand(2, -(-h // 128), generator=g, device=dev) * 0.01 + 0.001
    kw = dict(impl=impl)
    calls = [
        ("rmsnorm", "rmsnorm", lambda: moefuse.rmsnorm(x, w, **kw)),
        ("rmsnorm", "rmsnorm(out=)", lambda: moefuse.rmsnorm(x, w, out=out, **kw)),
        ("gemma_rmsnorm", "gemma_rmsnorm", lambda: moefuse.gemma_rmsnorm(x, w, **kw)),
        ("fused_add_rmsnorm", "fused_add_rmsnorm",
         lambda: moefuse.fused_add_rmsnorm(x, r, w, **kw)),
        ("gemma_fused_add_rmsnorm", "gemma_fused_add_rmsnorm",
         lambda: moefuse.gemma_fused_add_rmsnorm(x, r, w, **kw)),
        ("gated_residual_rmsnorm", "gated_residual_rmsnorm",
         lambda: moefuse.gated_residual_rmsnorm(x, res32, w, alpha, beta, **kw)),
        ("gated_residual_next_rmsnorm", "gated_residual_next_rmsnorm",
         lambda: moefuse.gated_residual_next_rmsnorm(x, res32, w, alpha, beta, residual_out=ro,
                                                     ffn_input=ffn, **kw)),
        ("rmsnorm_sigmoid_gate", "rmsnorm_sigmoid_gate",
         lambda: moefuse.rmsnorm_sigmoid_gate(hx, hg, **kw)),
        ("moe_finalize", "moe_finalize", lambda: moefuse.moe_finalize(rows, e2p, weights, **kw)),
        ("moe_finalize_scatter_add", "moe_finalize_scatter_add",
         lambda: moefuse.moe_finalize_scatter_add(rows, p2e, weights, **kw)),
        ("moe_experts", "moe_experts",
         lambda: moefuse.moe_experts(x, gate_up, down, ids, weights, **kw)),
        ("moe_permute", "moe_permute",
         lambda: moefuse.moe_permute(x, p2e, TOP_K, out=xp, **kw)),
        ("router_topk", "router_topk",
         lambda: moefuse.router_topk(logits, TOP_K, weights_dtype=bf, ids_dtype=torch.int64,
                                     **kw)),
        ("fp8_linear", "fp8_linear", lambda: moefuse.fp8_linear(x, w8, w8s, **kw)),
        ("fp8_quantize", "fp8_quantize", lambda: moefuse.fp8_quantize(x, scale, **kw)),
        ("fp8_quantize_per_token", "fp8_quantize_per_token",
         lambda: moefuse.fp8_quantize_per_token(x, **kw)),
        ("fp8_dequantize", "fp8_dequantize", lambda: moefuse.fp8_dequantize(q8, scale, **kw)),
        ("fp4_quantize", "fp4_quantize", lambda: moefuse.fp4_quantize(x, gscale, **kw)),
        ("fp4_dequantize", "fp4_dequantize",
         lambda: moefuse.fp4_dequantize(packed, scales, gscale, **kw)),
        ("rmsnorm_quant", "rmsnorm_quant", lambda: moefuse.rmsnorm_quant(x, w, scale, **kw)),
        ("fused_add_rmsnorm_quant", "fused_add_rmsnorm_quant",
         lambda: moefuse.fused_add_rmsnorm_quant(x, r, w, scale, **kw)),
        ("rmsnorm_fp4_quantize", "rmsnorm_fp4_quantize",
         lambda: moefuse.rmsnorm_fp4_quantize(x, w, gscale, **kw)),
        ("fused_add_rmsnorm_fp4_quantize", "fused_add_rmsnorm_fp4_quantize",
         lambda: moefuse.fused_add_rmsnorm_fp4_quantize(x, r, w, gscale, **kw)),
        ("per_token_group_quant_8bit", "per_token_group_quant_8bit",
         lambda: moefuse.per_token_group_quant_8bit(x, 128, **kw)),
        ("rmsnorm_group_quant", "rmsnorm_group_quant",
         lambda: moefuse.rmsnorm_group_quant(x, w, **kw)),
        ("fused_add_rmsnorm_group_quant", "fused_add_rmsnorm_group_quant",
         lambda: moefuse.fused_add_rmsnorm_group_quant(x, r, w, **kw)),
    ]  # fmt: skip
    return calls, ins.refresh


def comm_calls(
    dev, group, *, m: int = 1, h: int = 4096, impl: str = "auto", timeout_s: float | None = None
):
    """``(calls, refresh, close)``: ``calls`` is a list of ``(public op name, fn)``, one per
    public communication op (:data:`moefuse.comm.__all__` ops with launch plans), each ``fn()``
    making one call of that op on this rank; ``close()`` closes the workspaces (collective)."""
    import torch.distributed as dist

    import moefuse
    from moefuse.comm.moe_reduction.ops import extra_regions

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    shared, mine = _Inputs(dev, 1234), _Inputs(dev, 77 + rank)  # same on every rank / per rank
    regions = {**moefuse.allgather_regions(m, h), **extra_regions(m, h)}
    ws = moefuse.AllReduceWorkspace(
        group, m, h, torch.bfloat16, dev, extra_regions=regions, timeout_s=timeout_s
    )
    moefuse.prepare_allgather(ws, torch.bfloat16)
    ens = moefuse.ExpertNormWorkspace(group, h, TOP_K, dev, timeout_s=timeout_s)
    t = _comm_tensors(dev, shared, mine, m, h, rank, world)
    calls = _comm_call_list(moefuse, t, ws, ens, impl)

    def refresh(seed: int | None = None):
        shared.refresh(seed)
        mine.refresh(None if seed is None else seed + 1 + rank)

    def close():
        ens.close()
        ws.close()

    refresh()
    return calls, refresh, close


def _comm_tensors(dev, shared, mine, m: int, h: int, rank: int, world: int):
    """The inputs and preallocated outputs of :func:`comm_calls` (a namespace): inputs drawn by
    ``shared`` (the same on every rank) or ``mine`` (this rank's partials and shards)."""
    from types import SimpleNamespace

    bf, f32 = torch.bfloat16, torch.float32
    g = torch.Generator(device=dev).manual_seed(99)

    def rnd(*shape, dtype=bf, kind="normal", ins=shared):
        return ins.add(torch.empty(*shape, dtype=dtype, device=dev), kind)

    def own(*shape):
        return rnd(*shape, ins=mine)

    t = SimpleNamespace()
    t.x, t.res, t.w = own(m, h), rnd(m, h), rnd(h, kind="positive")
    t.ro, t.no, t.ao = torch.empty_like(t.x), torch.empty_like(t.x), torch.empty_like(t.x)
    t.scale = torch.tensor([0.05], device=dev)
    t.gscale = torch.tensor([448.0 * 6 / 3.0], device=dev)
    t.q8 = torch.empty(m, h, dtype=torch.float8_e4m3fn, device=dev)
    # all-gather: this rank's column shard, replicated parameters and full-width outputs
    t.shard = own(m, h // world)
    t.res32, t.alpha = rnd(m, h, dtype=f32), rnd(h, dtype=f32, kind="positive")
    t.beta = rnd(h, dtype=f32)
    t.ro32, t.ffn = torch.empty(m, h, device=dev), torch.empty(m, h, dtype=bf, device=dev)
    t.q4 = torch.empty(m, h // 2, dtype=torch.uint8, device=dev)
    t.sf4 = torch.empty(m, h // 16, dtype=torch.uint8, device=dev)
    # MoE reduction: K dense expert rows per token, and the finalize's permuted rows
    t.rows_e, t.tok = own(TOP_K, m, h), own(m, h)
    t.scales_e = rnd(TOP_K, m, dtype=f32, kind="positive")
    r_rows = m * TOP_K
    t.perm = torch.randperm(r_rows, generator=g, device=dev).to(torch.int32).view(m, TOP_K)
    t.rows_p = own(r_rows, h)
    t.wts = rnd(m, TOP_K, kind="positive")
    t.wts32 = rnd(m, TOP_K, dtype=f32, kind="positive")
    # EP: slot k is local on rank k mod P
    slot = torch.arange(TOP_K, device=dev).expand(m, TOP_K)
    t.ep_idx = torch.where(slot % world == rank, t.perm, -1).to(torch.int32)
    t.tp_out = torch.empty(m, h, dtype=bf, device=dev)
    t.ep_out = torch.empty(m, h, dtype=bf, device=dev)
    return t


def _comm_call_list(moefuse, t, ws, ens, impl: str) -> list:
    """``[(public op name, fn)]`` of :func:`comm_calls` on the tensors ``t``."""
    kw = dict(workspace=ws, impl=impl)
    norm_opts = dict(eps=1e-6, gain_center=0.0, weight_before_norm=True)
    x, res, w, ro, no = t.x, t.res, t.w, t.ro, t.no
    return [
        ("allreduce", lambda: moefuse.allreduce(x, out=t.ao, **kw)),
        ("allreduce_residual_rmsnorm",
         lambda: moefuse.allreduce_residual_rmsnorm(x, res, w, residual_out=ro, norm_out=no,
                                                    **kw)),
        ("allreduce_residual_rmsnorm_fp8",
         lambda: moefuse.allreduce_residual_rmsnorm_fp8(x, res, w, t.scale, residual_out=ro,
                                                        quant_out=t.q8, **kw)),
        ("allreduce_residual_rmsnorm_out_fp8",
         lambda: moefuse.allreduce_residual_rmsnorm_out_fp8(x, res, w, t.scale, residual_out=ro,
                                                            norm_out=no, quant_out=t.q8, **kw)),
        ("allreduce_residual_rmsnorm_nvfp4",
         lambda: moefuse.allreduce_residual_rmsnorm_nvfp4(x, res, w, t.gscale, layout="linear",
                                                          residual_out=ro, quant_out=t.q4,
                                                          scale_out=t.sf4, **kw)),
        ("allreduce_residual_rmsnorm_out_nvfp4",
         lambda: moefuse.allreduce_residual_rmsnorm_out_nvfp4(x, res, w, t.gscale,
                                                              layout="linear", residual_out=ro,
                                                              norm_out=no, quant_out=t.q4,
                                                              scale_out=t.sf4, **kw)),
        ("all_gather_rmsnorm", lambda: moefuse.all_gather_rmsnorm(t.shard, w, out=t.ffn, **kw)),
        ("all_gather_rmsnorm_fp8",
         lambda: moefuse.all_gather_rmsnorm_fp8(t.shard, w, t.scale, out=t.q8, **kw)),
        ("all_gather_rmsnorm_fp4_quantize",
         lambda: moefuse.all_gather_rmsnorm_fp4_quantize(t.shard, w, t.gscale, out=t.q4,
                                                         scale_out=t.sf4, **kw)),
        ("all_gather_gated_residual_next_rmsnorm",
         lambda: moefuse.all_gather_gated_residual_next_rmsnorm(
             t.shard, t.res32, t.alpha, t.beta, w, residual_out=t.ro32, ffn_input=t.ffn, **kw)),
        ("moe_allreduce_residual_rmsnorm",
         lambda: moefuse.moe_allreduce_residual_rmsnorm(t.rows_e, t.scales_e, t.tok, res, w,
                                                        residual_out=ro, norm_out=no, **kw)),
        ("moe_finalize_allreduce_residual_rmsnorm",
         lambda: moefuse.moe_finalize_allreduce_residual_rmsnorm(
             t.rows_p, res, w, t.perm, expert_scale_factor=t.wts, shared_expert_output=t.tok,
             residual_out=ro, norm_out=no, **kw)),
        ("tp_moe_finalize_rmsnorm",
         lambda: moefuse.tp_moe_finalize_rmsnorm(t.rows_p, t.wts32, t.perm, w, t.tp_out,
                                                 workspace=ens, impl=impl, **norm_opts)),
        ("moe_finalize_rmsnorm_allreduce",
         lambda: moefuse.moe_finalize_rmsnorm_allreduce(t.rows_p, t.wts32, t.ep_idx, w, t.ep_out,
                                                        workspace=ws, impl=impl, **norm_opts)),
    ]  # fmt: skip
