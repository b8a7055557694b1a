"""Column tiles of the MoE kernels — a function of the row width H alone (no triton import, so
the public API can answer ``supports_*`` without loading triton).

The finalize gives every output element its own sequential FMA chain over the K slots, so the tile
cannot change a result bit; it is still fixed per H so that a new token count never recompiles.
"""

from __future__ import annotations

#: K up to this is unrolled with tl.static_range (all K row loads in flight at once); larger K
#: uses a run-time loop (same order, same bits)
MAX_UNROLL_K = 16
#: columns of one program for wide rows: 128 threads x one 16-byte vector of 16-bit elements
MAX_BLOCK = 1024
ELEMS_PER_THREAD = 8
#: ``enable_pdl=None`` for moe_permute / moe_finalize: PDL on while tokens x H <= this, off above.
#: MEASURED on H200 (90f68c0:scripts/sweep_pdl_moe.py, permute -> finalize chain in CUDA graphs,
#: K = 8, notes/moe.md): on/on vs off/off us, H = 4096: M = 1 2.42 / 3.59, 64 6.08 / 6.20, 96 7.95 /
#: 7.23, 2048 115.3 / 90.7; H = 7168: 32 5.69 / 6.13, 48 7.64 / 6.80. A dependent launched early
#: holds SM slots that a large producer grid still needs; small grids gain the overlapped launch.
PDL_MAX_ELEMENTS = 256 * 1024


def pdl_default(tokens: int, hidden: int) -> bool:
    """The measured PDL default of the MoE permute / finalize kernels (see PDL_MAX_ELEMENTS)."""
    return tokens * hidden <= PDL_MAX_ELEMENTS


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def finalize_tile(hidden: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for rows of ``hidden`` columns.

    Rows up to 1024 columns are one program each; wider rows are split into 1024-column tiles
    (one 16-byte load per thread and slot, so K independent loads in flight per thread).
    """
    block = max(32, min(MAX_BLOCK, next_pow2(hidden)))
    warps = max(1, min(8, block // (32 * ELEMS_PER_THREAD)))
    return block, warps


def vec_width(hidden: int, *row_strides: int) -> int:
    """8 when H and every row stride are multiples of 8 elements (16-byte vectors), else 1."""
    return 8 if hidden % 8 == 0 and all(s % 8 == 0 for s in row_strides) else 1


# ----------------------------------------------------------------------------- routed experts
#: Tiles of the fused experts kernels (moefuse.moe.experts_triton). A program of the gate|up
#: kernel computes ``BN_GATE_UP`` gate rows and the same ``BN_GATE_UP`` up rows of one expert for
#: the tokens routed to it; a down program ``BN_DOWN`` rows of H. ``BK`` is the step of the
#: reduction loop (over H, then over I), fixed so that every output element sums its products in
#: one order: k16 MMA steps, ascending, in FP32, whatever the token count.
EXPERTS_BN_GATE_UP = 32
EXPERTS_BN_DOWN = 64
EXPERTS_BK = 128
EXPERTS_WARPS = 4
EXPERTS_STAGES = 4
#: token columns of one program: a multiple of 16 (the MMA's n8 blocks, two per 16 columns).
#: A column's result is a chain of m16n8k16 MMAs over k whatever the number of columns, so the
#: width may follow the expected load per expert (more columns: each weight tile is read once for
#: more tokens); the GPU tests check that a token's bits do not depend on it.
EXPERTS_TOKEN_TILES = (16, 32, 64, 128, 256)
#: from this token tile on (a mean load over 40 slots per expert), the wide tile below replaces the
#: keys above it names: more weight rows and token columns per program, so each program moves
#: fewer bytes per MMA (the weight tile is re-read once per token tile, the token rows once per
#: weight tile). The gate|up tile is whole 64-row blocks (32 gate + 32 up rows), BK = 64 keeps
#: the stages in shared memory, and the reduction is still k16 steps in ascending k, so no bit
#: moves (the GPU tests and ``75a3027:scripts/probe_experts_variants.py`` compare the bits of both
#: tiles). MEASURED (H200, 2026-12-04, b21ac12, notes/moe-experts.md), us at 128 columns narrow
#: -> wide: Qwen3 T = 256 518 -> 358, 1024 574 -> 421, 2048 869 -> 609; Mixtral 256 994 -> 746,
#: 1024 2455 -> 1779, 2048 4636 -> 3304; DeepSeek-V3 256 7647 -> 5653, 1024 8072 -> 6393, 2048
#: 9551 -> 7319 (at 256 columns, 2026-12-03, 5fd72aa: Qwen3 8192 2936 -> 1977, Mixtral 8192
#: 22202 -> 11685, DeepSeek-V3 8192 27682 -> 18736).
EXPERTS_WIDE_FROM_TILE = 128
EXPERTS_WIDE = {"bn_gate_up": 64, "bn_down": 128, "bk": 64, "warps": 8, "stages": 3}
#: from this many routed slots (T*K) on, the wide tile at 128 token columns takes 256 weight rows
#: per program (:data:`EXPERTS_WIDE_ROWS`: 128 gate + 128 up rows, 256 down rows, 16 warps, one
#: 64-row MMA block per warp group, 4 stages of 48 KB): each k-step moves (256 + 128) x 64 x 2 B
#: for 256 x 128 x 64 MACs (85 flop/B where 128 rows give 64). MEASURED (H200, 2026-12-04,
#: notes/moe-experts.md), CUDA-graph us, 128 -> 256 rows: Qwen3 T = 2048 (16,384 slots) 568.1 ->
#: 543.6 and 590.3 -> 558.9 (two runs), DeepSeek-V3 2048 7207.1 -> 6600.6; below the cut: Qwen3
#: 1024 410.2 -> 420.5 and 418.2 -> 425.2, 1536 470.9 -> 475.2, Mixtral 256 739.0 -> 723.3 and
#: 780.1 -> 762.1, 512 1127.7 -> 1152.8, DeepSeek-V3 1536 7109.8 -> 6622.0. At 256 token
#: columns it does not fit the registers (ptxas: 154 needed, 128 available at 16 warps).
EXPERTS_WIDE_ROWS_FROM_SLOTS = 16384
EXPERTS_WIDE_ROWS = {"bn_gate_up": 128, "bn_down": 256, "warps": 16, "stages": 4}
#: the widest token tile (256 columns) only when the mean load per expert fills this share of it;
#: below, 128 columns and several programs for the busiest experts. MEASURED (H200, 2026-12-04,
#: b21ac12, wide tile, us at 256 -> 128 columns): Qwen3 T = 2048 (mean 128 slots per expert)
#: 708 -> 609; Mixtral 1024 (mean 256) 1723 -> 1779, 2048 (512) 3129 -> 3304; 2026-12-03,
#: 5fd72aa: Qwen3 8192 (512) 1977 -> 2127, DeepSeek-V3 8192 (256) 18736 -> 19271. The cut
#: between 128 and 256 is unmeasured; 3/4 splits it.
EXPERTS_WIDEST_TILE_FILL = 0.75
#: token columns of the tail tile: with a token tile of at least :data:`EXPERTS_TAIL_FROM_TILE`
#: columns, an item of at most this many slots (an expert's last item, holding what its full
#: items leave) runs a tile this wide (:func:`moefuse.moe.experts_triton._tail_item`); the same
#: bits. MEASURED (H200, 2026-12-04, notes/moe-experts.md), CUDA-graph us without -> with a
#: 32-column tail: Qwen3 T = 1024 421.5 -> 419.1, 2048 611.4 -> 587.0, 4096 1097.6 -> 1028.0;
#: Mixtral 256 750.2 -> 751.4, 1024 1742.9 -> 1700.1; DeepSeek-V3 1024 7188.0 -> 7077.2, 2048
#: 7273.5 -> 7236.1 (16 and 128 columns: no better anywhere; 64: better at a mean load of half
#: the token tile, worse at a full one).
EXPERTS_TAIL_TILE = 32
EXPERTS_TAIL_FROM_TILE = 64
#: experts up to this many (the plan kernel's per-expert histogram is one block)
EXPERTS_MAX = 4096
#: up to this many routed slots (T*K), no plan kernel runs: each GEMM program computes its work
#: item from the expert ids (a [T*K, T*K] compare: one launch fewer at decode). Work items, and so
#: every bit, are the plan kernel's. Measured (H200, 2026-12-03, notes/moe-experts.md): Qwen3 T = 1
#: 29.3 -> 26.1 us, T = 2 50.9 -> 47.1, T = 4 80.3 -> 79.5; at T = 8 (64 slots) the compare in
#: every program costs more than the launch (129.0 -> 162.1).
EXPERTS_INLINE_PLAN_SLOTS = 32
#: up to this many routed slots, the finalize runs in the down kernel too (the last program of
#: each H tile sums every token's slots of that tile): one launch fewer again, the same bits.
#: Measured: a gain at T*K <= 8 (0.2-0.9 us), a loss from 16 slots on (the last program's serial
#: sum over tokens).
EXPERTS_FUSE_FINALIZE_SLOTS = 8


def experts_tile(hidden: int, inter: int, token_tile: int = 16, slots: int = 0) -> dict:
    """Tile of the fused experts kernels for hidden size ``hidden``, expert width ``inter``,
    token tile ``token_tile`` (:func:`experts_token_tile`) and ``slots`` = T*K routed slots:
    ``{"bn_gate_up", "bn_down", "bk", "warps", "stages", "inline_plan_slots",
    "fuse_finalize_slots", "tail_tile"}``, with :data:`EXPERTS_WIDE`'s keys from
    :data:`EXPERTS_WIDE_FROM_TILE` token columns on, and :data:`EXPERTS_WIDE_ROWS`' at 128
    columns from :data:`EXPERTS_WIDE_ROWS_FROM_SLOTS` slots on."""
    wide = EXPERTS_WIDE if token_tile >= EXPERTS_WIDE_FROM_TILE else {}
    if token_tile == 128 and slots >= EXPERTS_WIDE_ROWS_FROM_SLOTS:
        wide = {**EXPERTS_WIDE, **EXPERTS_WIDE_ROWS}
    return {
        "bn_gate_up": EXPERTS_BN_GATE_UP,
        "bn_down": EXPERTS_BN_DOWN,
        "bk": EXPERTS_BK,
        "warps": EXPERTS_WARPS,
        "stages": EXPERTS_STAGES,
        "inline_plan_slots": EXPERTS_INLINE_PLAN_SLOTS,
        "fuse_finalize_slots": EXPERTS_FUSE_FINALIZE_SLOTS,
        "tail_tile": EXPERTS_TAIL_TILE if token_tile >= EXPERTS_TAIL_FROM_TILE else 0,
        **wide,
    }


def experts_token_tile(slots: int, experts: int) -> int:
    """Token columns per program for ``slots`` = T*K routed slots over ``experts`` experts: room
    for about 1.5x the mean load per expert plus 4 (random routing's busiest experts), rounded up
    to :data:`EXPERTS_TOKEN_TILES`; the widest only where the mean load fills at least
    :data:`EXPERTS_WIDEST_TILE_FILL` of it (the next one below otherwise). Experts with more
    tokens take several programs."""
    experts = max(1, experts)
    want = (3 * slots) // (2 * experts) + 4
    widest = EXPERTS_TOKEN_TILES[-1]
    width = next((w for w in EXPERTS_TOKEN_TILES if want <= w), widest)
    if width == widest and slots < EXPERTS_WIDEST_TILE_FILL * widest * experts:
        return EXPERTS_TOKEN_TILES[-2]
    return width


# ----------------------------------------------------------------------------- FP8 experts
#: Tiles of the FP8 experts kernels (moefuse.moe.experts_fp8). The reduction step is the 128-wide
#: K-block of the weight scales (fixed: one FP8 MMA chain per block, then scaled), so only the
#: rows, warps, stages and token columns vary; a token's bits do not depend on any of them.
#: MEASURED (H100, 2026-12-06, notes/moe-experts-fp8.md), CUDA-graph us: the BF16 kernels' wide
#: tile (128 weight rows x 128 columns, 8 warps) lost to this narrow one wherever the policy
#: would take it: Qwen3 T = 2048 912 -> 780, Mixtral 256 1238 -> 782, 2048 8362 -> 4733,
#: DeepSeek-V3 2048 10217 -> 7154 (one program per SM at 255 registers: no program's MMA runs
#: under another's scaling epilogue; offline, every FP8 block dot waits for its MMA before the
#: FMA). Six stages at 16 columns (decode): Mixtral T = 1 148.5 -> 144.5, T = 4 361 -> 346,
#: DeepSeek-V3 T = 4 488 -> 483, Qwen3 25.0 -> 25.2.
EXPERTS_FP8_NARROW = {"bn_gate_up": 32, "bn_down": 64, "warps": 4, "stages": 4}
EXPERTS_FP8_DECODE_STAGES = 6
#: the widest token tile: 128 columns with the narrow rows (64 weight rows, 4 warps: the m64n128
#: FP8 MMA, two programs per SM at ~240 registers). MEASURED (H100 80GB HBM3, 2026-12-06, 6bcbc44,
#: scripts of notes/gpu-logs/2026-12-06-experts-fp8-large-tiles-6bcbc44.log, every variant
#: bitwise equal to the 64-column default), CUDA-graph us, 64 -> 128 columns: Qwen3 T = 2048
#: 787.6 -> 568.0, 8192 2916 -> 2113; Mixtral 2048 4540 -> 3378, 8192 18775 -> 16754;
#: DeepSeek-V3 2048 7191 -> 6945, 8192 23049 -> 21357 (each weight tile is read once for twice
#: the tokens and the MMA is twice as wide). 128 weight rows x 128 columns at 8 warps lost
#: (922 / 5272 / 10272 at T = 2048), as did 256 columns in the BF16 policy (not compiled: the
#: accumulator and the block's product alone would take 256 registers per thread).
EXPERTS_FP8_MAX_TOKEN_TILE = 128


#: the values of MOEFUSE_FP8_ACCUMULATION and the ``ACCUM`` codes of the FP8 kernels
#: (:data:`moefuse.moe.fp8_device.ACCUM_BLOCK` / ``_K32`` / ``_FP16``)
FP8_ACCUMULATION_CODES = {"block": 0, "k32": 1, "fp16": 2}


def fp8_accumulation() -> int:
    """The FP8 products' accumulation (``MOEFUSE_FP8_ACCUMULATION``) as the kernels' ``ACCUM``
    code: ``block`` (default, 0), Hopper's FP8 MMA carries each 128-wide K-block's four k32 steps
    in its own, narrower accumulator (DeepGEMM's numerics); ``k32`` (1), every k32 step is added
    to the FP32 sum; ``fp16`` (2), the E4M3 codes widened exactly to FP16 and multiplied by the
    FP16 MMA (exact products, FP32 sums). One mode for every tile and token count, or the bits
    would follow the batch. MEASURED (H100, 2026-12-06, notes/moe-experts-fp8.md): relative RMS
    from the FP64 formula at T = 64: block 4.6-5.2e-3, k32 3.1-3.6e-3, fp16 1.4-2.6e-4; k32
    doubled the time at 2,048 tokens and cost 1-3 % at one token; fp16 cost 8-44 % at one and
    64 tokens and 1.5-1.8 x at 2,048."""
    from moefuse import knobs

    return FP8_ACCUMULATION_CODES[knobs.get("MOEFUSE_FP8_ACCUMULATION") or "block"]


#: The many-token launch (:mod:`moefuse.moe.experts_fp8_tma`: the token columns on the MMA's M
#: side, the weight tiles loaded by TMA), taken with the widest token tile above the decode slots
#: (:data:`EXPERTS_FP8_DECODE_MAX_SLOTS`); where its launch cannot run (a GEMM's rows across a
#: scale block: an interleaved gate|up or a stacked one with I % 128 != 0; unaligned weights,
#: ...) that GEMM runs the pointer kernel on :data:`EXPERTS_FP8_NARROW`. Same bits (every
#: variant below bitwise equal to the pointer kernel's). MEASURED (H100 80GB HBM3, 2026-12-07,
#: d207e79, `python scripts/bench_fp8_decode_variants.py time --tokens 2048 8192 --variants tma
#: tma_s4 tma_w4 tma_gu128`, notes/gpu-logs/2026-12-07-experts-fp8-tma-d207e79.log), CUDA-graph
#: us at T = 2048 / 8192, pointer kernel (narrow rows, 128 token columns) -> this tile (128
#: gate|up rows, 128 down rows, 8 warps, 3 stages): Qwen3 541 / 2072 -> 521 / 1634, Mixtral 3341
#: / 15472 -> 2226 / 8949, DeepSeek-V3 6612 / 20509 -> 5549 / 12496; 64 gate|up rows 574 / 1789,
#: 2635 / 10329, 5990 / 14335; 4 stages between the two; 4 warps (32 / 64 rows) no better than
#: the pointer kernel. The gate|up programs then quantize the activation themselves
#: (``fuse_act_quant``: a program's 128 rows of I are one whole group), no launch of its own;
#: MEASURED (H100 80GB HBM3, 2026-12-07, 22ccc69, `python scripts/bench_fp8_decode_variants.py
#: time --tokens 2048 8192 --variants tma_gu128_fq`,
#: notes/gpu-logs/2026-12-07-experts-fp8-tma-fused-quant-22ccc69.log; bitwise equal), us at
#: T = 2048 / 8192, launch -> in the gate|up programs: Qwen3 518.0 / 1627.7 -> 504.8 / 1578.4,
#: Mixtral 2194.4 / 9007.9 -> 2146.7 / 8696.1, DeepSeek-V3 5534.4 / 12429.9 -> 5511.5 / 12420.1.
#: Where the pointer kernel runs instead, the activation's launch stays (as measured there).
EXPERTS_FP8_TMA = {
    "tma": True,
    "bn_gate_up": 128,
    "bn_down": 128,
    "warps": 8,
    "stages": 3,
    "fuse_act_quant": True,
}
#: Work items of 64 slots at 4 warps (one warpgroup, two programs per SM) where the mean load is
#: at most :data:`EXPERTS_FP8_TMA64_MAX_MEAN_LOAD` slots per expert above the decode slots (the
#: token tile :data:`EXPERTS_FP8_TMA64_TOKEN_TILE`); gate|up 64 rows per program (the activation
#: then quantized by its own launch: a 128-column group spans two programs) where 2I is at most
#: :data:`EXPERTS_FP8_TMA64_NARROW_GATE_UP_MAX_ROWS`, 128 rows otherwise. Same bits. MEASURED (H100
#: 80GB HBM3, 2026-12-07, 69c3c74, `python scripts/bench_fp8_decode_variants.py time --tokens 2048
#: 1024 4096 --variants tma64_d4 tma64_gu64 tma64_gu64_d4 ...`, then `--tokens 512`,
#: notes/gpu-logs/2026-12-07-experts-fp8-tma64-69c3c74.log; every variant bitwise equal to the
#: default), CUDA-graph us, default -> 64-slot items (128 / 64 gate|up rows): Qwen3 T = 512 298 ->
#: 263 / 260, 1024 358 -> 328 / 309, 2048 505 -> 487 / 460, 4096 (mean load 256) 866 -> 836 /
#: 828; DeepSeek-V3 512 4270 -> 4180 / 4110, 1024 5015 -> 4465 / 4476, 2048 5517 -> 5277 / 5516,
#: 4096 7623 -> 7293 / 7880; Mixtral 512 757 -> 732 / 725, but 1024 (mean load 256) 1163 ->
#: 1215 / 1241 and 2048 2148 -> 2222 / 2307.
EXPERTS_FP8_TMA64 = {
    "tma": True,
    "bn_gate_up": 128,
    "bn_down": 128,
    "warps": 4,
    "stages": 2,
    "down_stages": 4,
    "fuse_act_quant": True,
}
EXPERTS_FP8_TMA64_NARROW_GATE_UP = {"bn_gate_up": 64, "stages": 3, "fuse_act_quant": False}
EXPERTS_FP8_TMA64_NARROW_GATE_UP_MAX_ROWS = 2048
EXPERTS_FP8_TMA64_MAX_MEAN_LOAD = 128
EXPERTS_FP8_TMA64_TOKEN_TILE = 64
#: The 64-slot items also serve, above the decode slots, every load of experts this many or
#: more, and, at the decode slots, a mean load of EXPERTS_FP8_TMA64_DECODE_MIN_MEAN_LOAD or more;
#: their gate|up takes 64 rows also where the 128-row programs would be at most
#: EXPERTS_FP8_TMA64_NARROW_GATE_UP_MAX_PROGRAMS (the grid's bound: items x 128-row tiles).
#: Same bits. MEASURED (H100 80GB HBM3, 2026-12-07, 270104f, `python
#: scripts/bench_fp8_decode_variants.py time --tokens 256 8192 --variants tma64_d4 tma64_gu64_d4`,
#: notes/gpu-logs/2026-12-07-experts-fp8-tma64-loads-270104f.log; bitwise equal), CUDA-graph us,
#: default -> 64-slot items with 128 / 64 gate|up rows: Mixtral T = 256 (512 slots, mean load 64)
#: 693.1 -> 568.8 / 541.9; Qwen3 T = 8192 (mean load 512) 1570.4 -> 1531.2 / 1533.2; DeepSeek-V3
#: T = 8192 (mean load 256) 11959.0 -> 11912.9 / 12645.2, T = 256 (128-row programs 9,088) 4014.2
#: -> 4013.2 / 3918.2; Mixtral T = 8192 8460.3 -> 8860.0 / 9108.9 (E = 8: not taken); then at
#: ea54c2a (`... time --tokens 64 128 --shapes mixtral ...`, same log) Mixtral T = 64 (mean load
#: 16) 496.0 -> 506.9 / 490.9, T = 128 (mean load 32) 527.8 -> 515.5 / 503.2. With the earlier
#: run (constant above): DeepSeek-V3 T = 512 (10,112 programs) 4180 / 4110, T = 1024 (12,160)
#: 4465 / 4476, T = 2048 5277 / 5516.
EXPERTS_FP8_TMA64_ANY_LOAD_MIN_EXPERTS = 128
EXPERTS_FP8_TMA64_DECODE_MIN_MEAN_LOAD = 16
EXPERTS_FP8_TMA64_NARROW_GATE_UP_MAX_PROGRAMS = 10240
#: ``down_persistent`` / ``gate_up_persistent`` (tile keys, programs per SM; no default takes
#: them): the TMA down / gate|up tiles on a persistent grid with the tile loop flattened into the
#: K loop (a tile's first loads under the one before's last blocks; the same bits). MEASURED
#: slower at every shape and T = 1024 / 2048 / 4096 (same run as above), us at T = 2048, default
#: -> persistent down / gate|up / both (1 program per SM): Qwen3 505 -> 596 / 600 / 686, Mixtral
#: 2148 -> 2913 / 2793 / 3680, DeepSeek-V3 5517 -> 6644 / 6345 / 7423; the 64-row gate|up items
#: with the down on 2 programs per SM 515 / 2937 / 6177 (notes/moe-experts-fp8.md).


def experts_item_count(slots: int, experts: int, token_tile: int) -> int:
    """Static upper bound of the experts plan's work items: sum_e cdiv(c_e, BT) <= D + (T*K -
    D) // BT with D = min(E, T*K) experts in use."""
    used = min(experts, slots)
    return used + (slots - used) // token_tile


def experts_fp8_tma64(slots: int, experts: int) -> bool:
    """Whether the 64-slot TMA items serve ``slots`` routed slots over ``experts`` experts:
    above :data:`EXPERTS_FP8_DECODE_MAX_SLOTS` up to a mean load of
    :data:`EXPERTS_FP8_TMA64_MAX_MEAN_LOAD` (any load from
    :data:`EXPERTS_FP8_TMA64_ANY_LOAD_MIN_EXPERTS` experts), at or below it from a mean load of
    :data:`EXPERTS_FP8_TMA64_DECODE_MIN_MEAN_LOAD`. ``experts`` 0 (unknown): above the decode
    slots."""
    if experts <= 0:
        return slots > EXPERTS_FP8_DECODE_MAX_SLOTS
    if slots <= EXPERTS_FP8_DECODE_MAX_SLOTS:
        return slots >= EXPERTS_FP8_TMA64_DECODE_MIN_MEAN_LOAD * experts
    return (
        slots <= EXPERTS_FP8_TMA64_MAX_MEAN_LOAD * experts
        or experts >= EXPERTS_FP8_TMA64_ANY_LOAD_MIN_EXPERTS
    )


def _narrow_tma64_gate_up(inter: int, slots: int, experts: int) -> bool:
    """64 gate|up rows per 64-slot item: where 2I is small, or where the 128-row programs'
    grid (items x 128-row tiles) is small (:data:`EXPERTS_FP8_TMA64` comment)."""
    if 2 * inter <= EXPERTS_FP8_TMA64_NARROW_GATE_UP_MAX_ROWS:
        return True
    if experts <= 0:
        return False
    items = experts_item_count(slots, experts, EXPERTS_FP8_TMA64_TOKEN_TILE)
    programs = items * -(-2 * inter // 128)
    return programs <= EXPERTS_FP8_TMA64_NARROW_GATE_UP_MAX_PROGRAMS


def experts_fp8_tile(
    hidden: int, inter: int, token_tile: int = 16, slots: int = 0, experts: int = 0
) -> dict:
    """Tile of the FP8 experts kernels: :func:`experts_tile`'s plan keys (inline plan, fused
    finalize, tail tile, plan chunks) with the rows and warps of :data:`EXPERTS_FP8_NARROW`
    (``token_tile``: :func:`experts_fp8_token_tile`); above :data:`EXPERTS_FP8_DECODE_MAX_SLOTS`
    slots :data:`EXPERTS_FP8_TMA` at the widest token tile; :data:`EXPERTS_FP8_TMA64` (with
    :data:`EXPERTS_FP8_TMA64_NARROW_GATE_UP` where 2I or the grid is small) at 64 token columns
    where :func:`experts_fp8_tma64` says so (``experts`` 0: above the decode slots)."""
    base = experts_tile(hidden, inter, token_tile, slots)
    stages = EXPERTS_FP8_DECODE_STAGES if token_tile <= 16 else EXPERTS_FP8_NARROW["stages"]
    tile = {**EXPERTS_FP8_NARROW, "stages": stages}
    if token_tile == EXPERTS_FP8_TMA64_TOKEN_TILE and experts_fp8_tma64(slots, experts):
        tile = dict(EXPERTS_FP8_TMA64)
        if _narrow_tma64_gate_up(inter, slots, experts):
            tile.update(EXPERTS_FP8_TMA64_NARROW_GATE_UP)
    elif slots > EXPERTS_FP8_DECODE_MAX_SLOTS and token_tile >= EXPERTS_FP8_MAX_TOKEN_TILE:
        tile = dict(EXPERTS_FP8_TMA)
    return {**base, **tile, "accumulation": fp8_accumulation()}


def experts_fp8_token_tile(slots: int, experts: int, tma64: bool = True) -> int:
    """:func:`experts_token_tile`, at most :data:`EXPERTS_FP8_MAX_TOKEN_TILE` columns; with
    ``tma64``, :data:`EXPERTS_FP8_TMA64_TOKEN_TILE` where :func:`experts_fp8_tma64` says so (the
    64-slot TMA items of :func:`experts_fp8_tile`; the launcher asks without them where their
    gate|up GEMM cannot take the TMA launch: ``experts_fp8.policy_token_tile``)."""
    experts = max(1, experts)
    if tma64 and experts_fp8_tma64(slots, experts):
        return EXPERTS_FP8_TMA64_TOKEN_TILE
    return min(experts_token_tile(slots, experts), EXPERTS_FP8_MAX_TOKEN_TILE)


# ----------------------------------------------------------------------------- FP8 experts, decode
#: Decode keys of the FP8 experts laid over :func:`experts_fp8_tile` (T*K <= 512 slots only; the
#: large-token tiles live there). None moves a bit: stages, rows per program and token columns
#: change which program computes what, not a column's k32 chain or block order, and
#: ``fuse_act_quant`` (the gate|up kernel quantizes the activation itself: the last program of
#: each 128-column group of I, per_token_group_quant_8bit's device function) writes that op's
#: bytes (GPU log below: every variant bitwise equal to the default at every point; GPU tests).
#: MEASURED (H100 80GB HBM3, 2026-12-06, 81e3edb, scripts/bench_fp8_decode_variants.py,
#: notes/gpu-logs/2026-12-06-experts-fp8-decode-variants-81e3edb.log), CUDA-graph us, default ->
#: chosen: DeepSeek-V3 T = 1 144.2 -> 134.9 (fused quantization + 8 gate|up stages), Mixtral T = 1
#: 139.7 -> 136.8 (the same; 128 gate|up rows ran 134.2), Mixtral T = 4 327.8 -> 328.5, Mixtral
#: T = 256 772.1 -> 723.7 (fused quantization + 128 token columns). The fused quantization alone
#: did not pay (the standalone launch overlaps under PDL; the group's last program quantizes
#: at the gate|up kernel's occupancy): Qwen3 T = 1 24.5 -> 25.9, DeepSeek-V3 144.2 -> 145.2,
#: Mixtral T = 256 772 -> 823; 8 gate|up stages at Qwen3 T = 1 26.7; so Qwen3 keeps the default.
EXPERTS_FP8_DECODE_MAX_SLOTS = 512
#: one-token-sized calls (T*K <= 8) of experts of at least this many H*I weights per matrix:
#: the gate|up kernel quantizes the activation and runs 8 stages (the down kernel keeps 6)
EXPERTS_FP8_DEEP_GATE_UP_MIN_HI = 8 << 20
EXPERTS_FP8_DEEP_GATE_UP = {"fuse_act_quant": True, "stages": 8, "down_stages": 6}
EXPERTS_FP8_DEEP_GATE_UP_SLOTS = 8
#: from this token tile on, at decode (up to EXPERTS_FP8_DECODE_MAX_SLOTS slots: Mixtral
#: T = 256), the gate|up kernel quantizes the activation itself
EXPERTS_FP8_DECODE_WIDE_TOKEN_TILE = 128
#: Two more placements of the group quantizations, the same bytes (CPU and GPU tests), which no
#: default takes: MEASURED slower at every shape and T = 1 / 4 / 16 (H100 80GB HBM3, 2026-12-06,
#: `python scripts/bench_fp8_decode_variants.py time`, notes/moe-experts-fp8.md; Qwen3 T = 1
#: 24.5 -> 28.8 us with the tokens', 25.5 with the activation's, Mixtral 137.7 -> 150.1 / 158.2):
#: ``fuse_tokens_quant``, every gate|up program quantizes its token columns per 128-channel
#: K-block in registers (no launch for the tokens); ``down_act_quant``, every down program its
#: activation columns (no launch and no counters for the activation).
#: Two more decode keys, same bits (GPU test `test_fp8_quant_placements_bitwise`), which no
#: default takes: ``prefetch`` (bytes per weight row), every gate|up and down program with an
#: inline work item asks the L2 for that much of each of its weight rows (one
#: ``cp.async.bulk.prefetch.L2`` per row) before its ``gdc_wait``; ``early_dependents``, the
#: gate|up kernel lets the kernel after it launch right after its own wait. MEASURED slower
#: (H100 80GB HBM3, 2026-12-07, 167f99f, `scripts/bench_fp8_decode_variants.py`, variants
#: ``pf*``, notes/moe-experts-fp8.md): whole rows Qwen3 T = 1 24.1 -> 28.9 us, Mixtral 137.3 ->
#: 195.9, DeepSeek-V3 T = 4 476.4 -> 728.7; 512-byte heads 23.6 / 153.1 / 482.6 (base again
#: 23.5 / 137.2 / 477.4).


def experts_fp8_decode_tile(hidden: int, inter: int, token_tile: int, slots: int) -> dict:
    """Keys the FP8 experts launcher lays over :func:`experts_fp8_tile` up to
    :data:`EXPERTS_FP8_DECODE_MAX_SLOTS` slots: :data:`EXPERTS_FP8_DEEP_GATE_UP` at T*K <=
    :data:`EXPERTS_FP8_DEEP_GATE_UP_SLOTS` when H*I >= :data:`EXPERTS_FP8_DEEP_GATE_UP_MIN_HI`;
    the fused activation quantization with the wide token tile; else nothing."""
    if slots > EXPERTS_FP8_DECODE_MAX_SLOTS:
        return {}
    if (
        slots <= EXPERTS_FP8_DEEP_GATE_UP_SLOTS
        and hidden * inter >= EXPERTS_FP8_DEEP_GATE_UP_MIN_HI
    ):
        return dict(EXPERTS_FP8_DEEP_GATE_UP)
    if token_tile >= EXPERTS_FP8_DECODE_WIDE_TOKEN_TILE:
        return {"fuse_act_quant": True}
    return {}


# ----------------------------------------------------------------------------- fp8_linear
#: programs the split launch of ``fp8_linear`` aims at (two per SM of a 132-SM H100 / H200): the
#: K-blocks are cut into chunks so that row tiles x chunks reach it; a function of (N, K) only,
#: so the summation order never depends on M (moefuse.moe.linear_triton). UNMEASURED.
LINEAR_FP8_TARGET_PROGRAMS = 264
#: the fewest K-blocks of one chunk
LINEAR_FP8_MIN_CHUNK = 2
#: MEASURED (H100, 2026-12-06, notes/moe-experts-fp8.md), CUDA-graph us at M = 2,048 / 8,192:
#: 128 rows x 128 columns (8 warps) 4717 / 18892 (DeepSeek-V3 o_proj), 128 x 64 (8 warps) 1543 /
#: 6080; the experts' 64 x 64 (4 warps) beat 128 x 64 there: it serves every M above 16 here.
#: Eight stages at M = 16 (DeepSeek-V3 o_proj 53.5 -> 49.1, MLP down 59.2 -> 54.2) lost at M = 1
#: (46.9 -> 48.2, 52.6 -> 53.3; Qwen3 q_proj 6.6 -> 7.3).
LINEAR_FP8_NARROW = {"bn": 64, "warps": 4, "stages": 4}
LINEAR_FP8_DECODE_STAGES = 8
#: MEASURED (H100 80GB HBM3, 2026-12-06, `python -m moefuse bench fp8-linear --shapes dsv3_o_proj
#: qwen3_q_proj --rows 1 16 2048 8192 --tiles ...`, notes/moe-experts-fp8.md), CUDA-graph us at
#: M = 2,048 / 8,192, DeepSeek-V3 o_proj: 64 x 64 (4 warps) 1317 / 5532, 64 x 128 (4 warps)
#: 1342 / 5272, 128 x 64 (8 warps) 1218 / 5177, 64 x 256 (8 warps, 3 stages) 971 / 3907; Qwen3
#: q_proj 100 / 370, 93 / 378, 106 / 418, 77 / 292. Taken from M = 256 where it still gives
#: every SM a program (LINEAR_FP8_WIDE_MIN_PROGRAMS); 64 x 64 below.
LINEAR_FP8_WIDE = {"bn": 64, "bt": 256, "warps": 8, "stages": 3}
#: ``prefetch`` (bytes per weight row, tile key of ``fp8_linear``, no default takes it): each
#: program asks the L2 for the first bytes of each of its weight rows in its chunk before its
#: ``gdc_wait``. Same bits. MEASURED (H100 80GB HBM3, 2026-12-07, 167f99f, `bench fp8-linear
#: --rows 1 4 16 --prefetch 2048 8192 65536`, notes/moe-experts-fp8.md): 8192 and 65536 bytes
#: slower everywhere; 2048 slower in 13 of 15 cells (Qwen3 q_proj M = 1 5.3 -> 8.6 us), faster in
#: two (DeepSeek-V3 MLP down M = 1 59.4 -> 54.1).
LINEAR_FP8_WIDE_MIN_PROGRAMS = 132
#: ``tma`` (tile key, with ``bn`` 64 or 128): the many-row launch of :mod:`moefuse.moe.linear_tma`,
#: the tokens on the MMA's M side and TMA loads, the same bits; taken from
#: :data:`LINEAR_FP8_TMA_MIN_ROWS` rows (where its launch cannot run: the pointer tile the plan
#: keeps under ``pointer_tile``). MEASURED (H100 80GB HBM3, 2026-12-07, d207e79, `python -m
#: moefuse bench fp8-linear --shapes dsv3_o_proj dsv3_mlp_down qwen3_q_proj qwen3_o_proj
#: dsv3_q_b_proj --rows 2048 8192 --replays 10 --tiles tma128x128x8x4 tma128x128x8x3`,
#: notes/gpu-logs/2026-12-07-fp8-linear-tma-d207e79.log; each tile bitwise equal to the default
#: first), CUDA-graph us at M = 2048 / 8192, pointer kernel (:data:`LINEAR_FP8_WIDE`) -> 3 / 4
#: stages: DeepSeek-V3 o_proj 975 / 4029 -> 638 / 2702, 638 / 2596; MLP down 1198 / 4814 -> 721 /
#: 2976, 691 / 2982; q_b_proj 286 / 1149 -> 267 / 1046, 265 / 1132; Qwen3 q_proj 76.2 / 293 ->
#: 53.6 / 204, 53.8 / 222; o_proj 79.8 / 318 -> 52.3 / 213, 52.4 / 244 (BF16 torch.mm 586 / 2742,
#: 763 / 2957, 202 / 894, 47.0 / 177, 44.0 / 173). Rows 512-2047: LINEAR_FP8_TMA_NARROW below.
LINEAR_FP8_TMA = {"tma": True, "bn": 128, "bt": 128, "warps": 8, "stages": 3}
LINEAR_FP8_TMA_MIN_ROWS = 2048
#: The same launch with 64 token rows at 4 warps (one warpgroup, 216 registers and 74 KB of
#: shared memory at 3 stages, sm_90a: two programs per SM), one launch whatever the grid (the
#: chunks summed in registers): taken from :data:`LINEAR_FP8_TMA_NARROW_MIN_ROWS` rows where
#: :data:`LINEAR_FP8_TMA` is not. MEASURED (H100 80GB HBM3, 2026-12-07, 6574900, `python -m
#: moefuse bench fp8-linear --shapes qwen3_kv_proj qwen3_q_proj qwen3_o_proj dsv3_o_proj --rows
#: 512 2048 8192 --replays 10 --tiles tma64x64x4x4 tma128x64x4x2 tma128x64x4x3 tma128x64x4x4`,
#: notes/gpu-logs/2026-12-07-fp8-linear-tma-narrow-6574900.log; each tile bitwise equal to the
#: default first), CUDA-graph us, default -> this tile: M = 512 (the pointer tile) Qwen3 q_proj
#: 27.27 -> 13.75, o_proj 28.03 -> 18.40, k/v proj 12.09 -> 10.48, DeepSeek-V3 o_proj 281.3 ->
#: 178.3 (BF16 torch.mm 13.51 / 19.52 / 6.38 / 163.1); k/v proj M = 2048 (split pointer
#: programs) 18.55 -> 13.99. Where LINEAR_FP8_TMA runs it stays (M = 2048 / 8192, this tile:
#: q_proj 51.3 / 197.9 -> 50.5 / 198.4, o_proj 52.1 / 199.8 -> 50.0 / 201.3, DeepSeek-V3 o_proj
#: 648 / 2641 -> 814 / 3006; k/v proj 8192 41.2 -> 39.0). 2 stages slower everywhere, 4 stages
#: within 2 % at 512.
LINEAR_FP8_TMA_NARROW = {"tma": True, "bn": 128, "bt": 64, "warps": 4, "stages": 3}
LINEAR_FP8_TMA_NARROW_MIN_ROWS = 512
#: Below :data:`LINEAR_FP8_TMA_NARROW_MIN_ROWS` the same tile from
#: :data:`LINEAR_FP8_TMA_FEW_MIN_ROWS` rows where its grid has at least
#: :data:`LINEAR_FP8_TMA_FEW_MIN_PROGRAMS` programs (else the pointer tile, whose K chunks run as
#: programs of their own). MEASURED (H100 80GB HBM3, 2026-12-08, `python -m moefuse bench
#: fp8-linear --shapes dsv3_o_proj dsv3_mlp_down dsv3_q_b_proj qwen3_q_proj qwen3_o_proj
#: qwen3_kv_proj --rows 128 256 --replays 5 --tiles tma128x64x4x3`,
#: notes/gpu-logs/2026-12-08-fp8-linear-rows-128-256.log; each tile bitwise equal to the default
#: first), CUDA-graph us, pointer tile -> this tile (programs): M = 128 DeepSeek-V3 o_proj 93.5 ->
#: 76.1 (112), MLP down 106.5 -> 87.2 (112), q_b_proj 32.4 -> 22.7 (384), Qwen3 q_proj 15.3 ->
#: 12.4 (64), o_proj 15.3 -> 19.5 (32), k/v proj 6.3 -> 10.0 (8); M = 256 o_proj 168.5 -> 87.7,
#: MLP down 200.2 -> 100.6, q_b_proj 38.9 -> 39.1 (768: a tie), q_proj 15.4 -> 12.7, Qwen3 o_proj
#: 24.4 -> 19.7 (64), k/v proj 8.5 -> 10.1 (16). At M = 64 it lost (same day, o_proj 56.5 ->
#: 73.6, q_proj 10.1 -> 12.3): rows 65-127 keep the pointer tile (unmeasured between).
LINEAR_FP8_TMA_FEW_MIN_ROWS = 128
LINEAR_FP8_TMA_FEW_MIN_PROGRAMS = 64
#: ``fused_reduce`` (tile key of the split launch; this is its default): each row x column
#: tile's last split program adds the tile's chunk sums (counters zeroed by the op's own
#: quantization launch) instead of a reduce kernel of their own; the same bits, one launch
#: fewer. A pre-quantized input (``input_scale``) takes the reduce kernel unless the call
#: passes a ``workspace`` (zeroed counters the launch leaves zeroed). UNMEASURED:
#: off until timed against the reduce kernel (`python -m moefuse bench fp8-linear --rows 1 4 16
#: 64 128 --tiles fused`); ``MOEFUSE_FP8_LINEAR_FUSED_REDUCE`` overrides it.
LINEAR_FP8_FUSED_REDUCE = False
#: int32 counters an ``fp8_linear`` workspace holds: more than the row x column tiles of any
#: split launch (the K chunks run as programs of their own only below half the target)
LINEAR_FP8_WORKSPACE = LINEAR_FP8_TARGET_PROGRAMS // 2


def linear_fp8_fused_reduce() -> bool:
    """Whether the split launch adds its chunk sums in each tile's last program:
    ``MOEFUSE_FP8_LINEAR_FUSED_REDUCE`` where set, else :data:`LINEAR_FP8_FUSED_REDUCE`."""
    from moefuse import knobs

    value = knobs.get("MOEFUSE_FP8_LINEAR_FUSED_REDUCE")
    return LINEAR_FP8_FUSED_REDUCE if value is None else bool(value)


def linear_fp8_splits(n: int, k: int) -> tuple[int, int]:
    """``(splits, chunk)``: the K-blocks of ``fp8_linear`` cut into ``splits`` chunks of ``chunk``
    blocks (the last may be shorter), from (N, K) alone."""
    blocks = max(1, -(-k // 128))
    tiles = -(-n // LINEAR_FP8_NARROW["bn"])
    want = max(1, min(blocks // LINEAR_FP8_MIN_CHUNK, LINEAR_FP8_TARGET_PROGRAMS // max(1, tiles)))
    chunk = -(-blocks // want)
    return -(-blocks // chunk), chunk


def _linear_fp8_split_programs(m: int, n: int, splits: int, tile: dict) -> bool:
    """Whether the K chunks run as programs of their own: more than one chunk, and ``tile``'s
    row tiles alone fill less than half of :data:`LINEAR_FP8_TARGET_PROGRAMS`."""
    programs = -(-n // tile["bn"]) * -(-m // tile["bt"])
    return splits > 1 and programs < LINEAR_FP8_TARGET_PROGRAMS // 2


def linear_fp8_plan(m: int, n: int, k: int) -> dict:
    """Launch of ``fp8_linear`` for M rows: ``{"bn", "bt", "warps", "stages", "splits", "chunk",
    "split_programs", "accumulation"}``, from :data:`LINEAR_FP8_TMA_MIN_ROWS` rows
    :data:`LINEAR_FP8_TMA`'s keys (where its row tiles fill the GPU; else from
    :data:`LINEAR_FP8_TMA_NARROW_MIN_ROWS` rows, or from :data:`LINEAR_FP8_TMA_FEW_MIN_ROWS` where
    its grid has :data:`LINEAR_FP8_TMA_FEW_MIN_PROGRAMS` programs, :data:`LINEAR_FP8_TMA_NARROW`'s)
    with the pointer
    kernel's plan under ``"pointer_tile"``. The tile and whether the chunks run as programs of
    their own may follow M; the chunks (the summation order) do not."""
    splits, chunk = linear_fp8_splits(n, k)
    bt = 16 if m <= 16 else 32 if m <= 32 else 64
    tile = dict(LINEAR_FP8_NARROW, bt=bt)
    wide = LINEAR_FP8_WIDE
    if (
        m >= wide["bt"]
        and -(-n // wide["bn"]) * -(-m // wide["bt"]) >= LINEAR_FP8_WIDE_MIN_PROGRAMS
    ):
        tile = dict(wide)
    if 1 < m <= 16:
        tile["stages"] = LINEAR_FP8_DECODE_STAGES
    plan = {
        **tile,
        "splits": splits,
        "chunk": chunk,
        "split_programs": _linear_fp8_split_programs(m, n, splits, tile),
        "fused_reduce": linear_fp8_fused_reduce(),
        "accumulation": fp8_accumulation(),
    }
    tma = LINEAR_FP8_TMA  # one launch: taken only where its chunks need no programs of their own
    if m >= LINEAR_FP8_TMA_MIN_ROWS and not _linear_fp8_split_programs(m, n, splits, tma):
        return {**plan, **tma, "split_programs": False, "pointer_tile": plan}
    narrow = LINEAR_FP8_TMA_NARROW
    narrow_programs = -(-n // narrow["bn"]) * -(-m // narrow["bt"])
    if m >= LINEAR_FP8_TMA_NARROW_MIN_ROWS or (
        m >= LINEAR_FP8_TMA_FEW_MIN_ROWS and narrow_programs >= LINEAR_FP8_TMA_FEW_MIN_PROGRAMS
    ):
        return {**plan, **narrow, "split_programs": False, "pointer_tile": plan}
    return plan
