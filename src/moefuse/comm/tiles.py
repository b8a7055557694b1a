"""Row tiles of the communication kernels — functions of the hidden size alone (no triton import).

One program handles one token row at a time in registers (``BLOCK`` = next power of two of H, at
least 64 so that an NVFP4 row always covers its padded scale columns). The row statistic's
reduction tree therefore depends on H only, never on the token count or the grid.
"""

from __future__ import annotations

from dataclasses import dataclass

from moefuse import knobs

#: widest row the kernels hold in registers (wider rows use the reference path)
MAX_HIDDEN = 32768
MIN_BLOCK = 64


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class CommTile:
    block: int  # columns held per row (power of two >= H)
    num_warps: int
    kp_block: int  # scale columns covered per row (NVFP4): block // 16 >= round_up(H/16, 4)


def comm_tile(hidden: int, pattern: int = 1) -> CommTile:
    """~16 elements per thread: 4 warps up to H = 2048, 8 at 4096, 16 at 8192, 32 beyond.
    MOEFUSE_COMM_ELEMS_PER_THREAD (read per call; the same on every rank, or grids would
    differ) sets num_warps = BLOCK / (32 x it), within [4, 32]."""
    if not 1 <= hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size must be in [1, {MAX_HIDDEN}], got {hidden}")
    block = max(MIN_BLOCK, next_pow2(hidden))
    warps = min(32, max(4, block // (32 * knobs.get("MOEFUSE_COMM_ELEMS_PER_THREAD"))))
    return CommTile(block=block, num_warps=warps, kp_block=block // 16)


def resident_ctas_per_sm(num_warps: int) -> int:
    """A conservative count of co-resident CTAs per SM (2048 threads, 64K registers at <= 128 per
    thread): the grids of the peer algorithms never exceed what can run at once.
    MOEFUSE_COMM_CTAS_PER_SM > 0 replaces the estimate (the same on every rank)."""
    override = knobs.get("MOEFUSE_COMM_CTAS_PER_SM")
    if override > 0:
        return override
    return max(1, min(4, 16 // num_warps))


@dataclass(frozen=True)
class OneshotVariant:
    """Experimental one-shot variants (2026-11-29, notes/comm-all-reduce.md "Mid-size one-shot").
    All give
    the same bits as the default (same rank-order sum, same epilogue); only scheduling differs.
    (A probe poll, spinning on a slot's first elements before the whole row, was deleted: it
    lost at every size, notes/gpu-logs/comm-variants-p2-2026-11-29.log.)

    * ``prefetch`` (MOEFUSE_COMM_ONESHOT_PREFETCH=1): ``_oneshot_prefetch_kernel`` — every row's
      input and residual are loaded once, two rows ahead, so the push of row i+1 and the
      epilogue of row i never wait on a load issued after the poll.
    * ``rows_per_cta`` (MOEFUSE_COMM_ROWS_PER_CTA=R, default 1): grid = ceil(M / R) capped by
      the co-resident CTA count — fewer, persistent CTAs (deeper per-CTA pipeline in prefetch).
    * ``num_warps`` (MOEFUSE_COMM_ONESHOT_WARPS, 0 = the tile's): warps of the one-shot kernels.
    """

    prefetch: bool = False
    rows_per_cta: int = 1
    num_warps: int = 0


#: token counts from which the one-shot kernel defaults to the prefetch pipeline, and the rows per
#: CTA it then uses. Measured on 2 x H200 (90f68c0:scripts/sweep_comm_variants.py, notes/gpu-logs/
#: comm-variants-p2-2026-11-29.log; us, default -> prefetch with R rows per CTA): H = 4096
#: M = 512 19.17 -> 18.07 (R = 4), M = 2048 58.68 -> 54.84 (R = 8); H = 7168 M = 512 30.18 ->
#: 29.85, M = 2048 92.73 -> 92.08. At M <= 128 the default kernel was as fast or faster
#: (H = 4096 M = 128: 7.40 vs 7.52) and more rows per CTA were much slower (M = 8: 4.47 -> 9.14).
PREFETCH_MIN_TOKENS = 384
PREFETCH_ROWS_PER_CTA = ((1024, 4), (None, 8))  # (up to M tokens, rows per CTA)

_VARIANT_ENV = (
    "MOEFUSE_COMM_ONESHOT_PREFETCH",
    "MOEFUSE_COMM_ROWS_PER_CTA",
    "MOEFUSE_COMM_ONESHOT_WARPS",
)


def default_oneshot_variant(m_tokens: int) -> OneshotVariant:
    """The measured choice for ``m_tokens`` rows (every variant gives the same bits)."""
    if m_tokens < PREFETCH_MIN_TOKENS:
        return OneshotVariant()
    rows = next(r for limit, r in PREFETCH_ROWS_PER_CTA if limit is None or m_tokens <= limit)
    return OneshotVariant(prefetch=True, rows_per_cta=rows)


def oneshot_variant(m_tokens: int = 1) -> OneshotVariant:
    """The variant for ``m_tokens`` rows: :func:`default_oneshot_variant`, unless one of the
    MOEFUSE_COMM_* variant variables is set (then the environment alone decides). Read at every
    launch; it must be the same on every rank, or grids and slot schedules would differ."""
    prefetch, rows, warps = (knobs.get(name) for name in _VARIANT_ENV)
    if prefetch is None and rows is None and warps is None:
        return default_oneshot_variant(m_tokens)
    return OneshotVariant(prefetch=bool(prefetch), rows_per_cta=rows or 1, num_warps=warps or 0)
