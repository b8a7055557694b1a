"""Triton kernels of ``fp8_linear`` (:func:`moefuse.moe.linear.fp8_linear`).

``out [M, N] = cast(y + bias)`` with ``y`` the block-scaled FP8 product of
:func:`moefuse.moe.fp8_device.block_fp8_product`: the weight rows are the MMA's M operand (``BN``
rows of W per program), the tokens its N operand (``BT`` columns).

Summation order, fixed by (N, K) alone: the K-blocks are cut into ``SPLITS`` contiguous chunks of
``CHUNK`` blocks (:func:`moefuse.moe.tiles.linear_fp8_splits`); each chunk is summed in ascending
block order from +0.0 and the chunk sums are added in ascending order from +0.0, then the bias.
Two launches compute that same order:

* few programs (decode: M small, W streamed once): one program per (row tile, column tile,
  chunk) writes its chunk sum to an FP32 scratch ``[SPLITS, M, N]``; the chunks and the bias are
  then added by the tile's last program (``FUSED_REDUCE``: it counts itself in a counter of its
  tile, and the one that counts last zeroes the counter and reads the tile's chunk sums; the
  counters are the caller's ``workspace`` or a fresh allocation the op's quantization launch
  zeroes), or, for a pre-quantized input without a workspace, by a second kernel
  (:func:`_fp8_linear_reduce_kernel`). The split fills the GPU where ``N / BN`` programs alone
  would leave SMs idle, so the weights stream at full bandwidth.
* many programs: each loops over the chunks itself, the same additions in registers.

So a row's bits do not depend on M or on which launch ran. The activation is quantized once by
:func:`moefuse.quant.group_triton.launch_group_quant` (per_token_group_quant_8bit's kernel), or
given pre-quantized (``input_scale``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moefuse._device import round_to, widen_f32
from moefuse._fastpath import launch
from moefuse._runtime import interpreter_active, pdl_launch_kwargs
from moefuse.moe.experts_fp8_quant import group_quant_rows, tokens_quant
from moefuse.moe.fp8_device import (
    block_fp8_product,
    fp8_codes,
    prefetch_row_bytes,
    prefetch_rows_l2,
)
from moefuse.moe.linear_tma import fp8_linear_metadata, launch_fp8_linear_tma, tma_ready
from moefuse.moe.tiles import FP8_ACCUMULATION_CODES, linear_fp8_plan


@triton.jit
def _add_chunks(part_ptr, c64, n64, mask, m_rows, N: tl.constexpr, SPLITS: tl.constexpr):
    """``((+0.0 + part[0]) + part[1]) + ...`` over the ``SPLITS`` chunk sums of columns ``c64`` x
    rows ``n64`` (``mask`` [len(n64), len(c64)]), loaded past the L1: other SMs wrote them in
    this launch."""
    acc = tl.zeros(mask.shape, dtype=tl.float32)
    for c in tl.static_range(SPLITS):
        ptrs = part_ptr + (c * m_rows + c64[None, :]) * N + n64[:, None]
        acc = acc + tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _store_out(acc, bias_ptr, out_ptr, rows, c64, r_in, out_st, HAS_BIAS: tl.constexpr, PTX):
    """``out[c, n] = cast(acc + bias[n])`` for weight rows ``rows`` = (n, n < N) and token
    columns ``c64`` (``r_in``: valid): one rounding to the output's dtype."""
    n, n_in = rows
    if HAS_BIAS:
        acc = acc + widen_f32(tl.load(bias_ptr + n, mask=n_in, other=0.0), PTX)[:, None]
    ptrs = out_ptr + c64[None, :] * out_st + n.to(tl.int64)[:, None]
    tl.store(ptrs, round_to(acc, out_ptr.dtype.element_ty, PTX), mask=n_in[:, None] & r_in[None, :])


@triton.jit(launch_metadata=fp8_linear_metadata)
def _fp8_linear_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, bias_ptr, out_ptr, part_ptr, count_ptr,
    m_rows, strides,
    N: tl.constexpr, KDIM: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr,
    SPLITS: tl.constexpr, CHUNK: tl.constexpr, SPLIT_PROGRAMS: tl.constexpr,
    STAGES: tl.constexpr, ACCUM: tl.constexpr, HAS_BIAS: tl.constexpr, E8M0: tl.constexpr,
    PTX: tl.constexpr, USE_PDL: tl.constexpr, PF_BYTES: tl.constexpr = 0,
    FUSED_REDUCE: tl.constexpr = False,
):  # fmt: skip
    """The block-scaled product of ``BN`` weight rows and ``BT`` token columns (module
    docstring); ``strides`` = (x row, x-scale row, weight row, scale row, out row). With
    ``SPLIT_PROGRAMS`` grid axis 2 is the chunk and the program stores its chunk sum into
    ``part`` [SPLITS, M, N] (with ``FUSED_REDUCE`` it then counts itself in ``count[tile]``,
    zero before the launch, and the tile's last program zeroes it again, adds the chunk sums and
    writes ``out``); otherwise it adds all chunks and writes ``out``. ``PF_BYTES`` > 0: the
    first ``PF_BYTES`` of each of the program's weight rows (of its chunk) are requested from
    the L2 before the ``gdc_wait`` (the weights are no kernel's output)."""
    x_st, xs_st, w_st, s_st, out_st = strides
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    n_in = n < N
    n64 = n.to(tl.int64)
    cols = tl.program_id(1) * BT + tl.arange(0, BT)
    r_in = cols < m_rows
    c64 = cols.to(tl.int64)
    w_rows = w_ptr + n64[:, None] * w_st
    TILE_SCALE: tl.constexpr = BN <= 128  # the row tile inside one 128-row weight block
    if TILE_SCALE:
        s_rows = s_ptr + ((tl.program_id(0) * BN) // 128).to(tl.int64) * s_st
    else:
        s_rows = s_ptr + (n64 // 128) * s_st
    x_cols = x_ptr + c64[None, :] * x_st
    xs_cols = xs_ptr + c64 * xs_st
    n_blocks: tl.constexpr = (KDIM + 127) // 128
    if PF_BYTES > 0:
        k0 = tl.program_id(2) * CHUNK * 128 if SPLIT_PROGRAMS else 0
        size = tl.minimum(KDIM - k0, PF_BYTES)
        prefetch_rows_l2(w_ptr + n64 * w_st + k0, n_in & (size > 0), size, PTX)
    if USE_PDL:
        gdc_wait()
    if SPLIT_PROGRAMS:
        c = tl.program_id(2)
        acc = block_fp8_product(
            w_rows, n_in, 1, s_rows, 1, x_cols, r_in, xs_cols, c * CHUNK, CHUNK, KDIM, BT,
            STAGES, PTX, E8M0, ACCUM, 0, TILE_SCALE,
        )  # fmt: skip
        if USE_PDL:
            gdc_launch_dependents()
        mask = n_in[:, None] & r_in[None, :]
        ptrs = part_ptr + (c.to(tl.int64) * m_rows + c64[None, :]) * N + n64[:, None]
        tl.store(ptrs, acc, mask=mask)
        if FUSED_REDUCE:
            tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            tl.debug_barrier()  # every thread's chunk-sum stores precede the release below
            old = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if old == SPLITS - 1:  # every chunk counted: the counter is free again
                tl.store(count_ptr + tile, 0)
                tl.debug_barrier()  # the acquire precedes every thread's loads
                acc = _add_chunks(part_ptr, c64, n64, mask, m_rows, N, SPLITS)
                _store_out(acc, bias_ptr, out_ptr, (n, n_in), c64, r_in, out_st, HAS_BIAS, PTX)
    else:
        acc = block_fp8_product(
            w_rows, n_in, 1, s_rows, 1, x_cols, r_in, xs_cols, 0, n_blocks, KDIM, BT, STAGES,
            PTX, E8M0, ACCUM, CHUNK if SPLITS > 1 else 0, TILE_SCALE,
        )  # fmt: skip
        if USE_PDL:
            gdc_launch_dependents()
        _store_out(acc, bias_ptr, out_ptr, (n, n_in), c64, r_in, out_st, HAS_BIAS, PTX)


@triton.jit
def _fp8_linear_reduce_kernel(
    part_ptr, bias_ptr, out_ptr, m_rows, out_st,
    N: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr,
    PTX: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """``out[m, n] = cast(((+0.0 + part[0]) + part[1]) + ... + bias)``: the chunk sums of the
    split launch added in ascending order, as the one-launch kernel adds them."""
    m = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_in = n < N
    if USE_PDL:
        gdc_wait()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in tl.static_range(SPLITS):
        acc = acc + tl.load(part_ptr + (c * m_rows + m).to(tl.int64) * N + n, mask=n_in, other=0.0)
    if HAS_BIAS:
        acc = acc + widen_f32(tl.load(bias_ptr + n, mask=n_in, other=0.0), PTX)
    tl.store(
        out_ptr + m.to(tl.int64) * out_st + n,
        round_to(acc, out_ptr.dtype.element_ty, PTX),
        mask=n_in,
    )


def _prefetch_bytes(cfg: dict, weight: torch.Tensor, ptx: bool) -> int:
    """The kernel's ``PF_BYTES``: :func:`moefuse.moe.fp8_device.prefetch_row_bytes` of
    ``cfg["prefetch"]`` (0 in the interpreter)."""
    return prefetch_row_bytes(int(cfg.get("prefetch", 0)), weight) if ptx else 0


def _tma_launch(cfg: dict, codes: torch.Tensor, weight: torch.Tensor, split_programs) -> bool:
    """Whether the tile's ``tma`` key may run :mod:`moefuse.moe.linear_tma`: one launch (no
    split programs), block accumulation (the orientation-invariance of ``dot_b`` was measured
    there), a weight-row tile inside one 128-row scale block, TMA-readable operands."""
    return (
        not split_programs
        and cfg["accumulation"] == FP8_ACCUMULATION_CODES["block"]
        and cfg["bn"] in (64, 128)
        and tma_ready(codes, weight)
    )


def launch_fp8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    out: torch.Tensor,
    use_pdl: bool,
    *,
    tile: dict | None = None,
    workspace: torch.Tensor | None = None,
) -> None:
    """Writes ``out`` [M, N] from ``input`` [M, K] (BF16/FP16, or E4M3 codes with
    ``input_scale`` [M, ceil(K/128)]) (module docstring). ``tile`` overrides the policy of
    :func:`moefuse.moe.tiles.linear_fp8_plan` (benchmarks and the invariance tests only).
    ``workspace``: int32 zeros the split launch may count its tiles in (left zeroed)."""
    m, k = input.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return
    cfg = dict(linear_fp8_plan(m, n, k), **(tile or {}))
    ptx = not interpreter_active()
    tiles = triton.cdiv(n, cfg["bn"]) * triton.cdiv(m, cfg["bt"])
    # the split programs' chunk sums added by each tile's last program (tile key
    # ``fused_reduce``), counted in the caller's workspace or, where the op quantizes the input
    # itself, in counters its quantization launch zeroes
    has_workspace = workspace is not None and tiles <= workspace.numel()
    fused_reduce = bool(
        cfg["split_programs"]
        and cfg.get("fused_reduce")
        and not cfg.get("tma")
        and (input_scale is None or has_workspace)
    )
    counters = workspace if fused_reduce and has_workspace else out
    if input_scale is not None:
        x, xs = fp8_codes(input), input_scale
    elif fused_reduce and not has_workspace:  # the codes, and the counters zeroed
        counters = torch.empty(tiles, dtype=torch.int32, device=input.device)
        x, xs = tokens_quant(input, counters, tiles, use_pdl)
    else:  # quantized once here, not once per row tile (the codes of per_token_group_quant_8bit)
        x, xs = group_quant_rows(input, use_pdl)
    scale = weight_scale_inv
    e8m0 = scale.dtype == torch.float8_e8m0fnu
    if e8m0:
        scale = scale.view(torch.uint8)
    if scale.stride(1) != 1:
        scale = scale.contiguous()
    if cfg.get("tma") and not _tma_launch(cfg, x, weight, cfg["split_programs"]):
        cfg = cfg.get("pointer_tile") or dict(cfg, tma=False)  # the pointer kernel's tile
    splits, chunk, split_programs = cfg["splits"], cfg["chunk"], cfg["split_programs"]
    if cfg.get("tma"):
        args = (x, xs, fp8_codes(weight), scale, bias, out, cfg, e8m0)
        if cfg.get("wgmma") and ptx:  # the Gluon loop of the same launch (GPU only)
            from moefuse.moe.linear_wgmma import launch_fp8_linear_wgmma

            launch_fp8_linear_wgmma(*args, use_pdl, chunk if splits > 1 else 0)
        else:
            launch_fp8_linear_tma(*args, ptx, use_pdl, chunk if splits > 1 else 0)
        return
    part = torch.empty(splits if split_programs else 1, m, n, dtype=torch.float32,
                       device=input.device) if split_programs else out  # fmt: skip
    strides = (x.stride(0), xs.stride(0), weight.stride(0), scale.stride(0), out.stride(0))
    grid = (triton.cdiv(n, cfg["bn"]), triton.cdiv(m, cfg["bt"]), splits if split_programs else 1)
    launch(
        _fp8_linear_kernel,
        grid,
        x, xs, fp8_codes(weight), scale,
        bias if bias is not None else out, out, part, counters,
        m, strides,
        N=n, KDIM=k, BN=cfg["bn"], BT=cfg["bt"], SPLITS=splits, CHUNK=chunk,
        SPLIT_PROGRAMS=split_programs, STAGES=cfg["stages"], ACCUM=cfg["accumulation"],
        HAS_BIAS=bias is not None, E8M0=e8m0, PTX=ptx, USE_PDL=use_pdl,
        PF_BYTES=_prefetch_bytes(cfg, weight, ptx), FUSED_REDUCE=fused_reduce,
        num_warps=cfg["warps"], enable_fp_fusion=False,
        **pdl_launch_kwargs(use_pdl),
    )  # fmt: skip
    if split_programs and not fused_reduce:
        block = 1024
        launch(
            _fp8_linear_reduce_kernel,
            (m, triton.cdiv(n, block)),
            part, bias if bias is not None else out, out, m, out.stride(0),
            N=n, SPLITS=splits, BLOCK=block, HAS_BIAS=bias is not None, PTX=ptx,
            USE_PDL=use_pdl, num_warps=4,
            **pdl_launch_kwargs(use_pdl),
        )  # fmt: skip
