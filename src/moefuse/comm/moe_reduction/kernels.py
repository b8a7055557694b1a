"""Launch policy and launcher of the MoE-reduction family (the spec's MoE-reduction and
MoE-finalize all-reduce fusions): which kernel, grid, CTAs per SM and rows per producer batch.

Each kernel is an all-reduce kernel of :mod:`moefuse.comm.all_reduce.kernels` with a *producer*
stage in front: instead of loading this rank's partial row from an ``[M, H]`` input, it computes it
from the MoE inputs (:mod:`moefuse.comm.moe_reduction.producer`) — K expert rows gathered through
the index map (finalize) or the E_loc rows ``x[e, t]`` (reduction), weighted, summed in
ascending slot order, scaled, plus the shared-expert / token row. The partial never exists in
HBM on the peer paths:

* ``_moe_oneshot_kernel`` (:mod:`moefuse.comm.moe_reduction.oneshot`) — Lamport, same slots,
  generations and control words as ``_oneshot_kernel`` (the workspace is shared with the
  all-reduce fusions): iteration i produces and pushes row i, then polls row i - 1 (its own
  partial kept in registers), sums ranks in ascending order and runs the shared epilogue
  (:func:`moefuse.comm.device.epilogue_row`).
* ``_moe_split_kernel`` (same module) — the one-shot with a column-split producer (decode;
  variant "split" of :func:`oneshot_variant`): C CTAs per row each produce and push 1/C of the
  row (into the peers' Lamport slots and a local Lamport row), the row's last CTA polls every
  rank's whole row and runs the epilogue.
* ``_moe_twoshot_kernel`` (:mod:`moefuse.comm.moe_reduction.twoshot`) — reduce-scatter +
  all-gather: phase 1 produces every row and stores it into its owner's staging slot ``[rank]``
  (the owner's own rows locally), phase 2 sums the staged rows in rank order and pushes the sum
  into every peer's gather buffer (FP32 bits when ``accumulate="fp32"``: the sum is rounded only
  together with the residual), phase 3 finishes the other owners' rows.
* ``_moe_partial_kernel`` + ``_moe_gathered_kernel`` (:mod:`moefuse.comm.moe_reduction.torch_path`)
  — the torch.distributed path: partials written to [M, H], all-gathered, summed and finished.

All three produce the same partial (same device function) and the same rank-order sum handed to
the same epilogue, hence the same bits. FMA contraction is off (``enable_fp_fusion=False``): the
spec rounds between the multiply by the routed scaling factor and the shared-expert add; the one
FMA that is wanted (the FP32 finalize chain) is the explicit ``fma.rn.ftz``.
"""

from __future__ import annotations

import torch
import triton

from moefuse import knobs
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs
from moefuse.comm.moe_reduction.oneshot import _moe_oneshot_kernel, _moe_split_kernel
from moefuse.comm.moe_reduction.torch_path import _moe_gathered_kernel, _moe_partial_kernel
from moefuse.comm.moe_reduction.twoshot import _moe_twoshot_kernel
from moefuse.comm.moe_reduction.workspace import fp32_gather_region
from moefuse.comm.tiles import CommTile, comm_tile

_BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


#: tests only: force the producer's rows per batch (must divide K), to cover batching at small H
ROWS_PER_BATCH_OVERRIDE: int | None = None


#: the fused one-shot kernel runs 2 CTAs per SM from this many tokens at widths up to
#: TWO_CTAS_MAX_WIDTH. MEASURED on 2 x H200 (90f68c0:scripts/bench_moe_reduction_variants.py,
#: bench/results/sweeps/moe-reduction-variants-h200-p2.json; P = 2, H = 4096, K = 8, µs 1 vs 2
#: CTAs per SM): M = 64 8.65 vs 8.80, M = 512 35.39 vs 24.61, M = 2048 136.57 vs 84.02 — one
#: CTA loads a token's K rows while the other waits on NVLink, despite the register cap's
#: spills. Wider rows (16 warps at H = 7168: a 64-register cap, 0.4-1.2 KB spilled) MEASURED in
#: 2 x H200 (`bench moe-reduction --hidden 7168`, bench/results/moe-reduction-h200-p2.json, MoE
#: finalize, µs 1 vs 2 CTAs per SM): M = 64 11.53 vs 12.01, 512 44.35 vs 47.05, 2048 160.57 vs
#: 147.97, 16384 1231.61 vs 1093.49 (the unfused chain: 159.53 / 1168.79): 2 from
#: WIDE_TWO_CTAS_MIN_TOKENS. Not for the MoE reduction (dense rows): at 2 CTAs, M = 2048 / 16384,
#: stepwise 174.04 / 1312.92 against 174.94 / 1325.94 at 1, and accumulate="fp32" 173.84 / 1346.84
#: against 155.51 / 1210.22.
TWO_CTAS_MIN_TOKENS = 65
TWO_CTAS_MAX_WIDTH = 4096
WIDE_TWO_CTAS_MIN_TOKENS = 2048
#: the two-shot kernel runs 2 CTAs per SM from this many tokens, at every width and for both
#: ops. MEASURED in loopback only (2 rank threads on one H200, 66 SMs each;
#: notes/comm-moe-reduction.md "Large-M two-shot at 2 CTAs per SM"; K = 8, stepwise, µs at 1 vs
#: 2 CTAs per SM): MoE
#: reduction H = 7168 M = 2048 269-276 vs 226-227, M = 16384 1999-2005 vs 1728; H = 4096 M = 2048
#: 194 vs 146; MoE finalize H = 7168 M = 2048 252 vs 215, M = 16384 1941 vs 1643; H = 4096 M = 2048
#: 194 vs 138 — as for the one-shot, one CTA loads rows while the other waits on its peer. ptxas at
#: 2 CTAs (ptx_check.py registers moe-reduction): H = 7168 dense 216 B spilled (32 B at 1), H =
#: 4096 80 B. Not yet timed on 2 GPUs (first on the list of notes/comm-moe-reduction.md).
TWOSHOT_TWO_CTAS_MIN_TOKENS = 2048


def ctas_per_sm(
    m: int | None = None, h: int | None = None, dense: bool = False, algorithm: str = "oneshot"
) -> int:
    """Co-resident CTAs per SM of the peer kernels (grid cap = SMs x this; the register budget
    of :func:`rows_per_batch` shrinks with it). MOEFUSE_MOE_COMM_CTAS_PER_SM (1, 2 or 4) when
    set; else (``m`` tokens of width ``h`` given; ``dense``: the MoE reduction) 2 where the
    tables above measured it faster — the fused one-shot kernel (``algorithm`` "oneshot") and
    the two-shot kernel ("twoshot") — and 1 (all K rows of a token in flight). Read at every
    launch: it must be the same on every rank."""
    value = knobs.get("MOEFUSE_MOE_COMM_CTAS_PER_SM")
    if value is not None:
        return value
    if m is None or h is None:
        return 1
    if algorithm == "twoshot":
        return 2 if m >= TWOSHOT_TWO_CTAS_MIN_TOKENS else 1
    if h <= TWO_CTAS_MAX_WIDTH:
        return 2 if m >= TWO_CTAS_MIN_TOKENS else 1
    # wider rows: the MoE reduction (dense) measured no faster with 2 (above): it keeps 1
    return 2 if not dense and m >= WIDE_TWO_CTAS_MIN_TOKENS else 1


def rows_per_batch(k: int, tile, ctas: int = 1, bias: bool = False) -> int:
    """Expert rows loaded together by the producer: all K when they fit in registers next to
    the rest of the kernel (~96 registers: ptxas -v of the one-shot kernel, H = 4096, K = 8, used
    238 of 248 with all 8 rows; ptx_check.py registers moe-reduction), else fewer. With ``ctas``
    co-resident CTAs per SM a thread may use 65536 / (threads x ctas) registers (at most 255); a
    bias row doubles the registers per slot. Always a divisor of K (no ragged static batch);
    never changes the bits."""
    if ROWS_PER_BATCH_OVERRIDE is not None:
        return ROWS_PER_BATCH_OVERRIDE
    threads = 32 * tile.num_warps
    per_thread = tile.block // threads  # elements of a row per thread
    regs = min(255, 65536 // (threads * ctas))
    budget = max(1, min(k, (regs - 96) // max(1, per_thread * (2 if bias else 1))))
    return max(d for d in range(1, budget + 1) if k % d == 0)  # a divisor of K: no ragged batch


#: one-shot variants (MOEFUSE_MOE_COMM_VARIANT; all give the same bits):
#: "fused" — ``_moe_oneshot_kernel``, one CTA produces, pushes and finishes a row;
#: "split" — ``_moe_split_kernel``, C CTAs per row produce column slices (decode).
#: (A third variant, partial kernel + one-shot all-reduce of the partial, was deleted: it never
#: won, bench/results/sweeps/moe-reduction-variants-h200-p2.json, numbers below.)
ONESHOT_VARIANTS = ("fused", "split")
#: "auto" (the variable unset): (up to M tokens, variant). MEASURED on 2 x H200
#: (90f68c0:scripts/bench_moe_reduction_variants.py,
#: bench/results/sweeps/moe-reduction-variants-h200-p2.json; P = 2, H = 4096, K = 8, stepwise, µs
#: fused / split / two kernels): M = 1 6.49 / 4.90 / 7.25, M = 8 7.48 / 5.31 / 8.18, M = 64 8.65 /
#: 7.58 / 11.39; M = 512 fused at 2 CTAs per SM 24.61 against two kernels 36.26, M = 2048 84.02
#: against 114.99. Two kernels never won.
AUTO_ONESHOT_VARIANTS: tuple[tuple[int | None, str], ...] = ((64, "split"), (None, "fused"))
#: most CTAs per row of the split variant (default); MOEFUSE_MOE_COMM_SPLIT_CTAS overrides.
#: MEASURED (2 x H200, P = 2, H = 4096, K = 8, two runs of
#: 90f68c0:scripts/bench_moe_reduction_variants.py): one token, 16 CTAs 4.70 / 4.34 µs against 8
#: CTAs 5.07 / 4.47; at 8 tokens the two counts traded places (5.52 / 5.49 against 5.40 / 5.58), so
#: 16 only for a single token
SPLIT_MAX_CTAS = 8
SPLIT_MAX_CTAS_ONE_TOKEN = 16


def oneshot_variant(m: int, ws) -> str:
    """The one-shot variant for ``m`` tokens: MOEFUSE_MOE_COMM_VARIANT ("auto" / unset: the
    :data:`AUTO_ONESHOT_VARIANTS` table). "split" needs the workspace's "lamport_own" rows
    (``ws.own_slot_tokens``) and falls back to "fused" above them. Read at every launch: it
    must be the same on every rank (launch plans record it: ``moefuse._fastpath.clear()`` after
    changing it)."""
    name = knobs.get("MOEFUSE_MOE_COMM_VARIANT")
    if name == "auto":
        name = next(v for limit, v in AUTO_ONESHOT_VARIANTS if limit is None or m <= limit)
    if name == "split" and m > getattr(ws, "own_slot_tokens", 0):
        return "fused"
    return name


def split_ctas(m: int, tile, capacity: int) -> int:
    """CTAs per row of the split variant: MOEFUSE_MOE_COMM_SPLIT_CTAS (a power of two that
    divides the tile), else the largest power of two <= SPLIT_MAX_CTAS with at least one warp's
    worth of columns per slice and ``m`` rows x C CTAs <= ``capacity`` (all resident); the
    bound is SPLIT_MAX_CTAS_ONE_TOKEN for a single token."""
    env = knobs.get("MOEFUSE_MOE_COMM_SPLIT_CTAS")
    if env:
        if tile.block % env:
            raise ValueError(
                "MOEFUSE_MOE_COMM_SPLIT_CTAS must be a power of two dividing the "
                f"row tile ({tile.block}), got {env}"
            )
        return env
    most = SPLIT_MAX_CTAS_ONE_TOKEN if m == 1 else SPLIT_MAX_CTAS
    c = max(1, min(most, tile.block // (32 * tile.num_warps), capacity // max(1, m)))
    return 1 << (c.bit_length() - 1)


def producer_args(dense: bool, src, idx_map, weights, shared, bias=None, expert_ids=None):
    """(pointer tensors, strides, K, (n_rows, n_experts)) of the producer stage."""
    if dense:  # src [E, M, H], weights [E, M] FP32, shared = token input [M, H]
        k = src.shape[0]
        strides = (
            src.stride(1),
            src.stride(0),
            0,
            weights.stride(1),
            weights.stride(0),
            shared.stride(0),
            0,
            0,
        )
        return (src, src, weights, shared, src, src), strides, k, (0, 0)
    k = idx_map.shape[1]
    w = weights if weights is not None else idx_map
    sh = shared if shared is not None else src
    b = bias if bias is not None else src
    e = expert_ids if expert_ids is not None else idx_map
    strides = (
        src.stride(0),
        0,
        idx_map.stride(0),
        weights.stride(0) if weights is not None else 0,
        weights.stride(1) if weights is not None else 0,
        shared.stride(0) if shared is not None else 0,
        bias.stride(0) if bias is not None else 0,
        expert_ids.stride(0) if expert_ids is not None else 0,
    )
    n_experts = bias.shape[0] if bias is not None else 0
    return (src, idx_map, w, sh, b, e), strides, k, (src.shape[0], n_experts)


def _output_args(
    residual, weight, residual_out, norm_out, allreduce_out, quant_out, scale_out, scale, pattern
):
    """(pointer tensors, row strides, n_kcols, M_pad) of the epilogue's inputs and outputs, in the
    kernels' order: residual, gain, allreduce_out, residual_out, norm_out, quant_out, scale_out,
    scale. An absent output or scale is the residual (never read nor written)."""
    m = residual.shape[0]
    dummy = residual
    ao = allreduce_out if allreduce_out is not None else dummy
    qo = quant_out.view(torch.uint8) if quant_out is not None else dummy
    so = scale_out.view(torch.uint8) if scale_out is not None else dummy
    sc = scale if scale is not None else dummy
    n_kcols = scale_out.shape[-1] if (pattern == 3 and scale_out.dim() == 2) else 0
    m_pad = scale_out.shape[0] if scale_out is not None else m
    ostrides = (
        residual.stride(0),
        ao.stride(0),
        residual_out.stride(0),
        norm_out.stride(0),
        qo.stride(0),
    )
    return (residual, weight, ao, residual_out, norm_out, qo, so, sc), ostrides, n_kcols, m_pad


def _kernel_ctas(ws, algorithm: str, m: int, h: int, dense: bool) -> int:
    """CTAs per SM that this launch's kernel is sized for (the register budget of
    :func:`rows_per_batch`): :func:`ctas_per_sm` at ``m`` x ``h`` for the fused one-shot and the
    two-shot kernels, its setting alone for the split one-shot, 1 for the torch path."""
    fused = algorithm == "twoshot" or (algorithm == "oneshot" and oneshot_variant(m, ws) == "fused")
    if fused:
        return ctas_per_sm(m, h, bool(dense), algorithm)
    return ctas_per_sm() if algorithm == "oneshot" else 1


def launch_moe_reduction(
    ws,
    algorithm: str,
    pattern: int,
    *,
    dense: bool,
    src,
    idx_map,
    weights,
    shared,
    rsf: float,
    bias=None,
    expert_ids=None,
    residual,
    weight,
    residual_out,
    norm_out,
    allreduce_out=None,
    quant_out=None,
    scale_out=None,
    scale=None,
    layout: int = 0,
    eps: float = 1e-6,
    weight_bias: float = 0.0,
    stepwise: bool = True,
    use_pdl: bool = False,
) -> None:
    """One MoE fusion on ``ws`` with ``algorithm`` in "oneshot" | "twoshot" | "torch".

    ``pattern``: 1 residual + RMSNorm, 2 + FP8, 3 + NVFP4 (recipe "fast"); ``norm_out`` is always
    written, ``allreduce_out`` when given. Outputs are allocated and validated by the caller."""
    m, h = residual.shape
    if m == 0:
        return
    tile = comm_tile(h, pattern)
    ptx = not interpreter_active()
    srcs, pstrides, k, counts = producer_args(
        dense, src, idx_map, weights, shared, bias, expert_ids
    )
    outs, ostrides, n_kcols, m_pad = _output_args(
        residual,
        weight,
        residual_out,
        norm_out,
        allreduce_out,
        quant_out,
        scale_out,
        scale,
        pattern,
    )
    ctas = _kernel_ctas(ws, algorithm, m, h, dense)
    producer = dict(
        K=k,
        KB=rows_per_batch(k, tile, ctas, bias is not None),
        DENSE=bool(dense),
        HAS_W=dense or weights is not None,
        HAS_BIAS=bias is not None,
        HAS_RSF=(not dense) and float(rsf) != 1.0,
        HAS_SHARED=dense or shared is not None,
        STEPWISE=bool(stepwise),
    )
    common = dict(
        BLOCK_H=tile.block,
        PATTERN=pattern,
        LAYOUT=layout,
        KP_BLOCK=tile.kp_block,
        WRITE_AR=allreduce_out is not None,
        USE_PDL=bool(use_pdl),
        PTX=ptx,
        num_warps=tile.num_warps,
        enable_fp_fusion=False,
    )
    if use_pdl:
        common["launch_pdl"] = True
    # (pointers, strides, (M, M_pad), H, Hf): the arguments every kernel of the family starts with
    args = ((*srcs, *outs), (*pstrides, *ostrides), (m, max(m_pad, m)), h, float(h))
    scal = (float(eps), float(weight_bias), float(rsf))
    if algorithm == "torch":
        _launch_torch(ws, tile, args, counts, n_kcols, scal, producer, common)
        return
    ws.refresh_clock()
    if ptx:  # cap registers so that ctas CTAs per SM are resident (CTA j waits on CTA j)
        common["maxnreg"] = min(255, 65536 // (32 * tile.num_warps * ctas)) // 8 * 8
    # peer kernels: ctas_per_sm() CTAs per SM (the register budget of rows_per_batch), so that
    # every CTA of the grid is resident at once: CTA j waits on CTA j of the peers
    consts = dict(common, **producer, P=ws.world_size, BITS=_BITS[residual.dtype])
    tail = (n_kcols, counts, scal, ws.timeout_us)
    if algorithm == "oneshot":
        _launch_oneshot(ws, tile, ctas, k, bias is not None, args, tail, consts)
    elif algorithm == "twoshot":
        _launch_twoshot(ws, ctas, args, tail, consts)
    else:
        raise ValueError(f"unknown algorithm {algorithm!r}")


def _launch_torch(ws, tile, args, counts, n_kcols, scal, producer, common) -> None:
    """The torch.distributed path: ``_moe_partial_kernel`` writes this rank's partials, the
    ranks all-gather them (:func:`moefuse.comm.fallback.gather_stacked`),
    ``_moe_gathered_kernel`` sums and finishes them."""
    from moefuse.comm.fallback import gather_stacked

    ptrs, strides, rows, h, hf = args
    m = rows[0]
    part = torch.empty_like(ptrs[6])  # [M, H] like the residual
    grid = (max(1, min(m, ws.max_ctas(tile.num_warps))),)
    use_pdl = common["USE_PDL"]
    launch(
        _moe_partial_kernel,
        grid,
        *ptrs[:6],
        part,
        *strides[:8],
        part.stride(0),
        m,
        h,
        *counts,
        scal[2],
        BLOCK_H=tile.block,
        USE_PDL=use_pdl,
        PTX=common["PTX"],
        num_warps=tile.num_warps,
        enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
        **producer,
    )
    gathered = gather_stacked(part, ws)
    launch(
        _moe_gathered_kernel,
        grid,
        gathered,
        *ptrs[6:],
        *strides[8:],
        *rows,
        h,
        hf,
        n_kcols,
        scal[0],
        scal[1],
        P=ws.world_size,
        STEPWISE=producer["STEPWISE"],
        **common,
    )


def _launch_oneshot(ws, tile, ctas, k, has_bias, args, tail, consts) -> None:
    """The one-shot variant of :func:`oneshot_variant`: ``_moe_oneshot_kernel`` on min(M,
    SMs x ``ctas``) CTAs, or :func:`_launch_split`."""
    ptrs, strides, rows, h, hf = args
    m = rows[0]
    if oneshot_variant(m, ws) == "split":
        _launch_split(ws, tile, k, has_bias, args, tail, consts)
        return
    grid = (max(1, min(m, ws.num_sms * ctas)),)
    lam = (ws.table, ws.offset16("lamport"), ws.ctrl, ws.clock)
    launch(
        _moe_oneshot_kernel,
        grid,
        ptrs,
        strides,
        lam,
        rows,
        h,
        hf,
        ws.rank,
        ws.oneshot_max_tokens,
        *tail,
        **consts,
    )


def _launch_split(ws, tile, k, has_bias, args, tail, consts) -> None:
    """``_moe_split_kernel``: R row groups x C CTAs, R = min(M, capacity // C). Every CTA of the
    grid must be resident (a group's epilogue CTA waits on its producers, and on the peers' CTAs
    of the same group): the grid is capped by :func:`ctas_per_sm` CTAs per SM with a matching
    register cap (default 1 CTA per SM, 248 registers: no spill at H = 4096, K = 8, C = 2-16;
    scripts/ptx_check.py registers moe-reduction)."""
    ptrs, strides, rows, h, hf = args
    m = rows[0]
    resident = ctas_per_sm()
    capacity = ws.num_sms * resident
    c = split_ctas(m, tile, capacity)
    if c > capacity and consts["PTX"]:  # (the interpreter runs CTAs one after another)
        raise ValueError(
            f"MOEFUSE_MOE_COMM_SPLIT_CTAS={c} exceeds the {capacity} co-resident "
            "CTAs of this GPU: the row's epilogue CTA would wait on CTAs that "
            "cannot start"
        )
    groups = max(1, min(m, capacity // c))
    width = CommTile(block=tile.block // c, num_warps=tile.num_warps, kp_block=1)
    consts = dict(consts, KB=rows_per_batch(k, width, resident, has_bias))
    if consts["PTX"]:
        consts["maxnreg"] = min(255, 65536 // (32 * tile.num_warps * resident)) // 8 * 8
    lam = (ws.table, ws.offset16("lamport"), ws.offset16("lamport_own"), ws.ctrl, ws.clock)
    launch(
        _moe_split_kernel,
        (groups * c,),
        ptrs,
        strides,
        lam,
        rows,
        h,
        hf,
        ws.rank,
        ws.oneshot_max_tokens,
        *tail,
        C=c,
        BLOCK_W=tile.block // c,
        **consts,
    )


def _launch_twoshot(ws, ctas, args, tail, consts) -> None:
    """``_moe_twoshot_kernel`` on min(M, SMs x ``ctas``, flag slots) CTAs; the gather region
    holds the activation dtype (stepwise) or FP32 sums."""
    ptrs, strides, rows, h, hf = args
    m = rows[0]
    grid = (max(1, min(m, ws.num_sms * ctas, ws.num_flag_slots)),)
    gather = "gather" if consts["STEPWISE"] else fp32_gather_region(ws)
    regions = (
        ws.table,
        ws.offset16("flags"),
        ws.offset16("stage"),
        ws.offset16(gather),
        ws.ctrl,
        ws.clock,
    )
    launch(
        _moe_twoshot_kernel,
        grid,
        ptrs,
        strides,
        regions,
        rows,
        h,
        hf,
        ws.rank,
        ws.chunk_cap,
        *tail,
        PP=triton.next_power_of_2(ws.world_size),
        NSLOT=ws.num_flag_slots,
        **consts,
    )
