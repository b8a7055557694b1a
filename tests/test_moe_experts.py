"""Fused routed experts on CPU: the Triton kernels in the interpreter against the reference at
small and odd widths, K = 1..8, expert-parallel sentinels, both weight storages and the
extensions; the routing plan kernel against a Python model; bad input; custom op, fake,
torch.compile and launch plans."""

import pytest
import torch

import moefuse
from moefuse import _fastpath
from moefuse.moe import reference as ref
from moefuse.moe.experts_plan import (
    experts_plan_buffers,
    launch_experts_plan,
)
from moefuse.moe.experts_triton import launch_moe_experts
from moefuse.moe.tiles import EXPERTS_WIDE, EXPERTS_WIDE_ROWS, experts_item_count
from moefuse.testing import assert_bitwise_equal, bits, expect_value_error, poison_

pytestmark = pytest.mark.interpreter


def case(
    tokens,
    hidden,
    inter,
    experts,
    top_k,
    *,
    dtype=torch.bfloat16,
    seed=0,
    sentinels=False,
    index_dtype=torch.int64,
):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gu = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)
    dn = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(dtype)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    if sentinels:
        idx[::2, -1] = experts + 3  # expert-parallel sentinel (held elsewhere)
        idx[1::3, 0] = -1
    w = torch.rand(tokens, top_k, generator=g)
    return x, gu, dn, idx.to(index_dtype), w


def rel_err(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [
    (1, 16, 16, 4, 1), (3, 40, 24, 6, 2), (5, 33, 17, 8, 3), (17, 64, 40, 8, 8), (2, 24, 8, 5, 5),
])  # fmt: skip
def test_kernels_match_reference(tokens, hidden, inter, experts, top_k):
    for sentinels, dtype in ((False, torch.bfloat16), (True, torch.float16)):
        x, gu, dn, idx, w = case(
            tokens,
            hidden,
            inter,
            experts,
            top_k,
            dtype=dtype,
            sentinels=sentinels and top_k > 1,
            seed=tokens + top_k,
        )
        out = poison_(torch.empty(tokens, hidden, dtype=dtype))
        got = moefuse.moe_experts(x, gu, dn, idx, w, out=out, impl="triton")
        assert got is out
        want = ref.moe_experts_reference(x, gu, dn, idx, w)
        assert torch.isfinite(got.float()).all()
        assert rel_err(got, want) < 1e-2, rel_err(got, want)


def test_extensions_transposed_and_token_tiles():
    x, gu, dn, idx, w = case(12, 48, 24, 6, 3, sentinels=True, seed=3, index_dtype=torch.int32)
    g = torch.Generator().manual_seed(4)
    kw = dict(
        bias=torch.randn(6, 48, generator=g).to(torch.bfloat16),
        shared_expert_output=torch.randn(12, 48, generator=g).to(torch.bfloat16),
        routed_scaling_factor=2.5,
    )
    got = moefuse.moe_experts(x, gu, dn, idx, w, impl="triton", **kw)
    want = ref.moe_experts_reference(x, gu, dn, idx, w, **kw)
    assert rel_err(got, want) < 1e-2
    gu_t, dn_t = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
    tr = moefuse.moe_experts(x, gu_t, dn_t, idx, w, transposed=True, impl="triton", **kw)
    assert_bitwise_equal(tr, got, "transposed storage")
    assert_bitwise_equal(
        ref.moe_experts_reference(x, gu_t, dn_t, idx, w, transposed=True, **kw),
        want,
        "transposed reference",
    )
    # the interpreter's FP32 matmul has its own order: compare to reference. 256 columns take the
    # wide tile (two 64-row gate|up blocks, 128 down rows, BK 64); the last case its 256-row
    # form at 128 columns, with items of up to 16 slots in the tail tile
    rows = {**EXPERTS_WIDE, **EXPERTS_WIDE_ROWS, "tail_tile": 16, "inline_plan_slots": 0}
    for bt, tile in ((16, None), (32, None), (256, None), (128, rows)):
        out = poison_(torch.empty_like(got))
        launch_moe_experts(
            x,
            gu,
            dn,
            idx,
            w,
            out,
            kw["bias"],
            kw["shared_expert_output"],
            2.5,
            False,
            False,
            tile=tile,
            token_tile=bt,
        )
        assert rel_err(out, want) < 1e-2, (bt, rel_err(out, want))


@pytest.mark.parametrize(
    "tokens,top_k,experts,want_tile,want_wide,want_rows",
    [
        (1, 8, 128, 16, False, False),  # decode: narrow tile, 16 columns
        (256, 8, 128, 32, False, False),  # Qwen3 T = 256: mean 16 slots per expert
        (1024, 8, 128, 128, True, False),  # Qwen3 T = 1024: mean 64 -> wide tile, 128 columns
        (2048, 8, 128, 128, True, True),  # mean 128: 128 columns (measured faster than 256),
        # and 16,384 slots: 256 weight rows per program
        (8192, 8, 128, 256, True, False),  # mean 512: 256 columns
        (256, 2, 8, 128, True, False),  # Mixtral T = 256: mean 64
        (1024, 2, 8, 256, True, False),  # Mixtral T = 1024: mean 256 fills 256 columns
        (1024, 8, 256, 64, False, False),  # DeepSeek-V3 T = 1024: mean 32
        (2048, 8, 256, 128, True, True),  # DeepSeek-V3 T = 2048: mean 64, 16,384 slots
        (0, 8, 128, 16, False, False),
    ],
)
def test_token_tile_policy(tokens, top_k, experts, want_tile, want_wide, want_rows):
    """The measured tile policy (moefuse.moe.tiles): which columns, which tile, which rows; and
    the tail tile from 64 columns on."""
    from moefuse.moe.tiles import EXPERTS_WIDE, EXPERTS_WIDE_ROWS, experts_tile, experts_token_tile

    slots = tokens * top_k
    token_tile = experts_token_tile(slots, experts)
    assert token_tile == want_tile
    tile = experts_tile(2048, 768, token_tile, slots)
    wide = {**EXPERTS_WIDE, **EXPERTS_WIDE_ROWS} if want_rows else EXPERTS_WIDE
    assert all(tile[k] == v for k, v in wide.items()) == want_wide
    assert tile["tail_tile"] == (32 if token_tile >= 64 else 0)


def _plan_model(idx, experts, bt):
    flat = idx.reshape(-1).tolist()
    valid = [0 <= e < experts for e in flat]
    order = sorted((e, s) for s, e in enumerate(flat) if valid[s])
    items = []
    pos = 0
    for e in sorted({e for e, _ in order}):
        c = sum(1 for ee, _ in order if ee == e)
        for j in range(0, c, bt):
            items.append((e, pos + j, min(bt, c - j)))
        pos += c
    return items, [s for _, s in order], [s if valid[s] else -1 for s in range(len(flat))]


@pytest.mark.parametrize(
    "tokens,top_k,experts,bt",
    [(1, 8, 128, 16), (70, 4, 5, 16), (9, 3, 300, 32), (40, 2, 3, 16), (360, 3, 5, 256)],
)  # fmt: skip
def test_plan_kernel(tokens, top_k, experts, bt):
    """Items (expert, first sorted slot, slots), sorted slots and the slot map against a Python
    model, with duplicates, sentinels, a transposed (strided) index and the -1 tail; the last
    two over several plan programs (blocks of 1,024 slots), experts spanning blocks."""
    g = torch.Generator().manual_seed(tokens)
    idx = torch.randint(-2, experts + 2, (top_k, tokens), generator=g).t()  # strided view
    items, sorted_slots, slot_map = experts_plan_buffers(
        tokens, top_k, experts_item_count(tokens * top_k, experts, bt), torch.device("cpu")
    )
    want_items, want_sorted, want_map = _plan_model(idx, experts, bt)
    # chunks of ids as wide as a block, and (several blocks) 4x wider: a chunk then holds
    # earlier blocks' slots and this block's, and takes the second histogram; and the two-phase
    # plan (per-block counts first)
    several = tokens * top_k > 1024
    modes = [(1024, False), (4096, False), (1024, True)] if several else [(1024, False)]
    for chunk, two_phase in modes:
        for t in (items, sorted_slots, slot_map):
            t.fill_(-7)
        launch_experts_plan(
            idx,
            experts,
            bt,
            items,
            sorted_slots,
            slot_map,
            False,
            chunk=chunk,
            two_phase=two_phase,
        )
        got = items.view(-1, 3).tolist()
        assert [tuple(r) for r in got[: len(want_items)]] == want_items, (chunk, two_phase)
        assert all(r[0] == -1 for r in got[len(want_items) :])
        assert sorted_slots[: len(want_sorted)].tolist() == want_sorted
        assert slot_map.reshape(-1).tolist() == want_map


@pytest.mark.parametrize(
    "tokens,top_k,experts,bt",
    [
        (1, 8, 128, 16),
        (40, 2, 3, 16),
        (9, 3, 7, 16),
        (5, 4, 300, 32),
        (3, 2, 4, 16),
        (40, 2, 3, 32),
    ],
)
def test_inline_plan_and_fused_finalize_match_plan_kernel(tokens, top_k, experts, bt):
    """At T*K <= the inline limit each GEMM program computes its work item from the ids and the
    down kernel's last program per H tile runs the finalize: same items, same finalize, so the
    same bits as plan kernel + separate finalize, and the reference's values, with duplicate ids
    in a token, sentinels (all of them in the last case: the output is the shared expert's),
    an expert over several token tiles (40 x 2 over 3 experts), a strided index, expert bias,
    shared expert output and a routed scaling factor."""
    g = torch.Generator().manual_seed(tokens + experts)
    hidden, inter = 40, 24
    x, gu, dn, _idx, _w = case(tokens, hidden, inter, experts, top_k, seed=tokens)
    idx = torch.randint(-2, experts + 2, (top_k, tokens), generator=g).t()  # strided, duplicates
    if experts == 4:
        idx = idx + 10  # every slot a sentinel
    w = torch.rand(tokens, top_k, generator=g)
    kw = dict(
        bias=torch.randn(experts, hidden, generator=g).to(torch.bfloat16),
        shared_expert_output=torch.randn(tokens, hidden, generator=g).to(torch.bfloat16),
        routed_scaling_factor=2.5,
    )
    want = ref.moe_experts_reference(x, gu, dn, idx, w, **kw)
    outs = {}
    modes = {
        "plan": {"inline_plan_slots": 0},
        "inline": {"inline_plan_slots": 128, "fuse_finalize_slots": 0},
        "fused": {"inline_plan_slots": 128, "fuse_finalize_slots": 128},
        # items of at most 16 slots run the 16-column tail tile (40 x 2 over 3 experts at 32
        # columns: full items and an expert's few left over); the interpreter's matmul may order
        # a narrower product differently, so values here, bits in the GPU tests
        "tail": {"inline_plan_slots": 0, "tail_tile": 16},
    }
    for mode, tile in modes.items():
        out = poison_(torch.empty(tokens, hidden, dtype=torch.bfloat16))
        launch_moe_experts(
            x,
            gu,
            dn,
            idx,
            w,
            out,
            kw["bias"],
            kw["shared_expert_output"],
            2.5,
            False,
            False,
            tile=tile,
            token_tile=bt,
        )
        assert rel_err(out, want) < 1e-2, (mode, rel_err(out, want))
        outs[mode] = out
    tail_items = [r for r in _plan_model(idx, experts, bt)[0] if r[2] <= 16]
    assert bt == 16 or tail_items, "the tail tile must run"
    assert_bitwise_equal(outs["inline"], outs["plan"], "inline plan vs plan kernel")
    assert_bitwise_equal(outs["fused"], outs["plan"], "fused finalize vs finalize kernel")


def test_bad_inputs_raise_and_write_nothing():
    x, gu, dn, idx, w = case(3, 16, 8, 4, 2)
    out = poison_(torch.empty(3, 16, dtype=torch.bfloat16))

    def call(**change):
        args = dict(
            hidden_states=x,
            gate_up_proj=gu,
            down_proj=dn,
            top_k_index=idx,
            top_k_weights=w,
            out=out,
            impl="triton",
        )
        args.update(change)
        return lambda: moefuse.moe_experts(**args)

    for name, change in (
        ("hidden_states", dict(hidden_states=x.float())),
        ("gate_up_proj", dict(gate_up_proj=gu[:, :-1])),
        ("gate_up_proj", dict(gate_up_proj=gu.half())),
        ("gate_up_proj", dict(gate_up_proj=gu[..., :-1])),
        ("down_proj", dict(down_proj=dn[..., :-1])),
        ("top_k_index", dict(top_k_index=idx.float())),
        ("top_k_index", dict(top_k_index=idx[:2])),
        ("top_k_weights", dict(top_k_weights=w[:, :1])),
        ("activation", dict(activation="gelu")),
        ("transposed", dict(transposed=1)),
        ("bias", dict(bias=torch.zeros(3, 16, dtype=torch.bfloat16))),
        ("shared_expert_output", dict(shared_expert_output=torch.zeros(2, 16))),
        ("routed_scaling_factor", dict(routed_scaling_factor=float("inf"))),
        ("out", dict(out=torch.empty(3, 16))),
        ("out", dict(out=x)),
    ):
        expect_value_error(call(**change), name, out)
    with pytest.raises(ValueError, match="impl"):
        moefuse.moe_experts(x, gu, dn, idx, w, impl="cuda")
    assert not moefuse.supports_moe_experts(x, gu, dn, idx.float(), w)
    assert moefuse.supports_moe_experts(x, gu, dn, idx, w)  # the interpreter runs the kernels
    empty = moefuse.moe_experts(x[:0], gu, dn, idx[:0], w[:0], impl="triton")
    assert empty.shape == (0, 16)


def test_custom_op_compile_and_plans():
    from moefuse.moe import ops

    x, gu, dn, idx, w = case(4, 16, 8, 4, 2, seed=8)
    bias = torch.randn(4, 16).to(torch.bfloat16)
    out = torch.empty(4, 16, dtype=torch.bfloat16)
    for backend in ("triton", "reference"):
        torch.library.opcheck(
            ops.moe_experts_op,
            (x, gu, dn, idx, w, out, bias, None, 0.5, False, False, False, backend),
        )
    eager = moefuse.moe_experts(x, gu, dn, idx, w, impl="triton")
    again = moefuse.moe_experts(x, gu, dn, idx, w, impl="triton")
    assert _fastpath.plan_count(moefuse.moe_experts) == 1, _fastpath.refusals(moefuse.moe_experts)
    assert_bitwise_equal(again, eager, "launch plan replay")

    def f(x, idx, w):
        return moefuse.moe_experts(x, gu, dn, idx, w, impl="triton") * 1

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, idx, w)
    assert_bitwise_equal(got, eager, "torch.compile(fullgraph=True)")
    assert bits(moefuse.moe_experts(x, gu, dn, idx, w, impl="reference")).shape == (4, 16)
