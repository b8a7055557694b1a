"""Public op of the fused routed experts: ``moe_experts`` and ``supports_moe_experts``.

The whole routed-expert computation of an MoE layer at transformers' weight layouts — gate|up
GEMM, gated activation, down GEMM and the deterministic weighted top-k sum — in Triton kernels
that read each routed expert's weights once per token tile and never copy them
(:mod:`moefuse.moe.experts_triton`). Validation raises ``ValueError`` naming the argument before
anything is written; ``impl`` follows DESIGN.md.
"""

from __future__ import annotations

import torch

from moefuse import _validate as v
from moefuse._fastpath import fast_op
from moefuse._runtime import choose_impl, kernel_device_reason, resolve_pdl
from moefuse.moe import ops
from moefuse.moe.api import (
    EXTRA_DTYPES,
    HALF,
    MAX_PROGRAMS,
    SCALE_DTYPES,
    check_expert_bias,
)
from moefuse.moe.reference_fp8 import BLOCK, cdiv
from moefuse.moe.reference_fp8 import SCALE_DTYPES as FP8_SCALE_DTYPES
from moefuse.moe.tiles import (
    EXPERTS_BN_DOWN,
    EXPERTS_BN_GATE_UP,
    EXPERTS_MAX,
    EXPERTS_TOKEN_TILES,
)

ACTIVATIONS = ("silu",)
INDEX_DTYPES = (torch.int32, torch.int64)
GATE_UP_LAYOUTS = ("stacked", "interleaved")
FP8 = torch.float8_e4m3fn
NO_FP8 = {
    "gate_up_proj_scale_inv": None,
    "down_proj_scale_inv": None,
    "block_size": (BLOCK, BLOCK),
    "gate_up_layout": "stacked",
}


def _check_fp8(op, fp8: dict, gate_up, down, transposed, hidden, inter, experts, dev) -> bool:
    """The FP8 arguments (``fp8`` = scales, block size, layout); True for FP8 weights."""
    gu_scale, d_scale = fp8["gate_up_proj_scale_inv"], fp8["down_proj_scale_inv"]
    if fp8["gate_up_layout"] not in GATE_UP_LAYOUTS:
        raise ValueError(
            f"moefuse.{op}: argument 'gate_up_layout' must be one of {GATE_UP_LAYOUTS}, "
            f"got {fp8['gate_up_layout']!r}"
        )
    if gate_up.dtype != FP8:
        for name in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):
            if fp8[name] is not None:
                raise ValueError(
                    f"moefuse.{op}: argument '{name}' is for float8_e4m3fn weights, got "
                    f"gate_up_proj of dtype {gate_up.dtype}"
                )
        return False
    block = fp8["block_size"]
    if not isinstance(block, (tuple, list)) or tuple(block) != (BLOCK, BLOCK):
        raise ValueError(
            f"moefuse.{op}: argument 'block_size' must be (128, 128) (the one measured "
            f"weight block), got {block!r}"
        )
    gu_rows = cdiv(2 * inter, BLOCK)
    v.check_tensor(op, "gate_up_proj_scale_inv", gu_scale, dtypes=FP8_SCALE_DTYPES, ndims=(3,),
                   device=dev, last_dim_contiguous=False)  # fmt: skip
    # transformers allocates at least two scale rows for a gate|up matrix under 128 rows
    rows_ok = gu_scale.shape[1] == gu_rows or (gu_rows == 1 and gu_scale.shape[1] == 2)
    want = (experts, gu_rows, cdiv(hidden, BLOCK))
    if not rows_ok or (gu_scale.shape[0], gu_scale.shape[2]) != (want[0], want[2]):
        raise ValueError(
            f"moefuse.{op}: argument 'gate_up_proj_scale_inv' must be [E, ceil(2I/128), "
            f"ceil(H/128)] = {want} (one scale per 128 x 128 block of the gate|up matrix as "
            f"stored), got {tuple(gu_scale.shape)}"
        )
    v.check_tensor(op, "down_proj_scale_inv", d_scale, dtypes=FP8_SCALE_DTYPES,
                   shape=(experts, cdiv(hidden, BLOCK), cdiv(inter, BLOCK)), device=dev,
                   last_dim_contiguous=False)  # fmt: skip
    return True


def _check_experts(
    op, x, gate_up, down, idx, weights, activation, transposed, bias, shared, rsf, out, fp8=None
) -> tuple[int, int, int, int, int]:
    """Validate; returns (T, H, E, I, K). ``fp8``: the FP8 keyword arguments (scales, block
    size, gate|up layout; :data:`NO_FP8` when None)."""
    fp8 = fp8 or NO_FP8
    v.check_tensor(op, "hidden_states", x, dtypes=HALF, ndims=(2,))
    dev = x.device
    tokens, hidden = x.shape
    if not isinstance(transposed, bool):
        raise ValueError(f"moefuse.{op}: argument 'transposed' must be a bool")
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"moefuse.{op}: argument 'activation' must be one of {ACTIVATIONS}, got {activation!r}"
        )
    v.check_tensor(op, "gate_up_proj", gate_up, dtypes=(x.dtype, FP8), ndims=(3,), device=dev)
    if gate_up.dtype == FP8 and transposed:
        raise ValueError(
            f"moefuse.{op}: argument 'transposed' must be False for float8_e4m3fn weights "
            "(FP8 experts store [E, 2I, H] and [E, H, I])"
        )
    experts = gate_up.shape[0]
    two_i = gate_up.shape[2] if transposed else gate_up.shape[1]
    if two_i < 2 or two_i % 2:
        raise ValueError(
            f"moefuse.{op}: argument 'gate_up_proj' must hold 2*I >= 2 gate and up "
            f"rows, got shape {tuple(gate_up.shape)} "
            f"(transposed={transposed})"
        )
    inter = two_i // 2
    layout = "[E, H, 2I]" if transposed else "[E, 2I, H]"
    want = (experts, hidden, two_i) if transposed else (experts, two_i, hidden)
    if tuple(gate_up.shape) != want:
        raise ValueError(
            f"moefuse.{op}: argument 'gate_up_proj' must be {layout} = {want} for "
            f"hidden_states of width {hidden}, "
            f"got {tuple(gate_up.shape)}"
        )
    want = (experts, inter, hidden) if transposed else (experts, hidden, inter)
    v.check_tensor(op, "down_proj", down, dtypes=(gate_up.dtype,), shape=want, device=dev)
    is_fp8 = _check_fp8(op, fp8, gate_up, down, transposed, hidden, inter, experts, dev)
    v.check_tensor(
        op,
        "top_k_index",
        idx,
        dtypes=INDEX_DTYPES,
        ndims=(2,),
        device=dev,
        last_dim_contiguous=False,
    )
    if idx.shape[0] != tokens or idx.shape[1] < 1:
        raise ValueError(
            f"moefuse.{op}: argument 'top_k_index' must be [T, K] = [{tokens}, K >= 1]"
            f", got {tuple(idx.shape)}"
        )
    top_k = idx.shape[1]
    v.check_tensor(
        op, "top_k_weights", weights, dtypes=SCALE_DTYPES, shape=(tokens, top_k), device=dev
    )
    check_expert_bias(op, bias, idx if bias is not None else None, hidden, (tokens, top_k), dev)
    if bias is not None and bias.shape[0] != experts:
        raise ValueError(
            f"moefuse.{op}: argument 'bias' must be [E, H] = [{experts}, {hidden}], "
            f"got {tuple(bias.shape)}"
        )
    v.check_real(op, "routed_scaling_factor", rsf)
    if shared is not None:
        v.check_tensor(
            op,
            "shared_expert_output",
            shared,
            dtypes=EXTRA_DTYPES,
            shape=(tokens, hidden),
            device=dev,
        )
    if out is not None:
        v.check_tensor(op, "out", out, dtypes=(x.dtype,), shape=(tokens, hidden), device=dev)
        for name, t in (
            ("hidden_states", x),
            ("gate_up_proj", gate_up),
            ("down_proj", down),
            ("top_k_index", idx),
            ("top_k_weights", weights),
            ("bias", bias),
            ("shared_expert_output", shared),
            ("gate_up_proj_scale_inv", fp8["gate_up_proj_scale_inv"] if is_fp8 else None),
            ("down_proj_scale_inv", fp8["down_proj_scale_inv"] if is_fp8 else None),
        ):
            if t is not None:
                v.check_no_overlap(op, "out", out, name, t)
    return tokens, hidden, experts, inter, top_k


def _kernel_reason(x, tokens, hidden, experts, inter, top_k, fp8=False) -> str | None:
    del fp8  # the FP8 kernels run wherever the BF16 ones do (SM90: FP8 tensor cores)
    reason = kernel_device_reason(x.device)
    if reason is not None:
        return reason
    if experts > EXPERTS_MAX:
        return f"{experts} experts exceed the plan kernel's {EXPERTS_MAX}"
    # the launch grid (work items x weight tiles) bounded over every tile the launcher may pick:
    # at most E + slots / (narrowest token tile) items, and the narrowest weight tiles. The
    # tile policy is not consulted, so that the answer does not depend on T through it: a call
    # traced with a symbolic token count (torch.compile(dynamic=True), torch.export) keeps one
    # graph for every T instead of one per token tile.
    slots = tokens * top_k
    items = experts + slots // EXPERTS_TOKEN_TILES[0]
    tiles = max(inter // EXPERTS_BN_GATE_UP, hidden // EXPERTS_BN_DOWN)
    if items > MAX_PROGRAMS or tiles >= 65535:
        return f"T*K = {slots} slots at H = {hidden}, I = {inter} exceed one launch grid"
    return None


@fast_op
@v.checked(writes=("out",))
def moe_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    activation: str = "silu",
    transposed: bool = False,
    bias: torch.Tensor | None = None,
    shared_expert_output: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    gate_up_proj_scale_inv: torch.Tensor | None = None,
    down_proj_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] = (BLOCK, BLOCK),
    gate_up_layout: str = "stacked",
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """Routed experts of an MoE layer with a deterministic, batch-invariant result. Per token t
    and valid slot k (expert ``e = top_k_index[t, k]`` in [0, E); other ids are expert-parallel
    sentinels: skipped, their weights never read)::

        g, u = W_gate[e] x_t, W_up[e] x_t          # FP32 accumulation of BF16/FP16 products
        a    = cast(silu(g) * u)                   # FP32 math, rounded once (the down operand)
        y    = W_down[e] a                         # FP32, not rounded
        acc  = +0.0; for k ascending: acc = fma.rn.ftz.f32(y + f32(bias[e]), f32(w[t, k]), acc)
        out[t] = cast(acc * routed_scaling_factor + f32(shared_expert_output[t]))   # one rounding

    (the finalize of :func:`moefuse.moe_finalize`; the multiply is skipped when the factor is
    1.0). Layouts and names are transformers' experts modules: ``gate_up_proj`` [E, 2I, H] (gate
    rows first, then up rows), ``down_proj`` [E, H, I]; ``transposed=True`` takes [E, H, 2I] and
    [E, I, H] (``is_transposed`` modules). ``hidden_states`` [T, H] BF16/FP16 (rows may be
    strided), weights of the same dtype, ``top_k_index`` [T, K] int32/int64, ``top_k_weights``
    [T, K] FP32/BF16/FP16, ``bias`` [E, H] (the down projection's, added before the routing
    weight), ``shared_expert_output`` [T, H], ``out`` [T, H] (allocated when None; must not alias
    an input). ``activation``: ``"silu"``.

    Determinism: each output element's products are summed in a fixed order (ascending k16 MMA
    steps of a fixed tile, FP32) whatever T, the other tokens or the launch, so a token's output
    bits do not depend on the batch it came in; the kernels read every routed expert's weights
    once per token tile (module :mod:`moefuse.moe.experts_triton`). ``impl="reference"`` runs
    :func:`moefuse.moe.reference.moe_experts_reference` (same formula, FP64 products: a few FP32
    ulps apart before the roundings). Returns ``out``.

    ``gate_up_layout``: ``"stacked"`` (gate rows, then up rows) or ``"interleaved"`` (g0, u0, g1,
    u1, ...: the layout some transformers versions store), for every weight dtype.

    FP8 weights (``float8_e4m3fn``, block-scaled W8A8; docs/spec.md "moe_experts, FP8
    weights"): ``gate_up_proj_scale_inv`` [E, ceil(2I/128), ceil(H/128)] and
    ``down_proj_scale_inv`` [E, ceil(H/128), ceil(I/128)] (FP32 or ``float8_e8m0fnu``: the
    names and layouts of transformers' FP8 experts and DeepSeek-V3's ``weight_scale_inv``) are
    required; ``block_size`` must be (128, 128). Gate|up row ``r`` of the matrix as stored takes
    scale row ``r // 128`` (what transformers' FP8 quantizer writes for the fused matrix; a
    128-row block may then hold gate and up rows where I % 128 != 0). Per token and valid
    slot::

        xq, xs = group_quant(x_t)        # per_token_group_quant_8bit: groups of 128, eps 1e-10
        g|u[n] = sum over K-blocks b of dot_b(xq, W[e][n]) * xs[b] * Ws[e][n // 128, b]
        a      = cast(silu(g) * u);  aq, as = group_quant(a)
        y[h]   = sum over K-blocks b of dot_b(aq, Wd[e][h]) * as[b] * Wds[e][h // 128, b]

    then the finalize above. ``dot_b`` is the FP32 sum of a block's products in an order fixed by
    the kernel's tile, so the bits stay batch-invariant; the reference takes FP64 dots.
    """
    op = "moe_experts"
    fp8 = {
        "gate_up_proj_scale_inv": gate_up_proj_scale_inv,
        "down_proj_scale_inv": down_proj_scale_inv,
        "block_size": block_size,
        "gate_up_layout": gate_up_layout,
    }
    x, gu, dn, idx, w = hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights
    rest = (activation, transposed, bias, shared_expert_output, routed_scaling_factor, out, fp8)
    tokens, hidden, experts, inter, top_k = _check_experts(op, x, gu, dn, idx, w, *rest)
    if out is None:
        out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0 or hidden == 0:
        return out
    rsf = float(routed_scaling_factor)
    is_fp8 = gu.dtype == FP8
    reason = _kernel_reason(x, tokens, hidden, experts, inter, top_k, is_fp8)
    backend = choose_impl(op, impl, x.device, reason)
    use_pdl = backend == "triton" and resolve_pdl(enable_pdl, x.device)
    interleaved = gate_up_layout == "interleaved"
    extras = (out, bias, shared_expert_output, rsf)
    if is_fp8:
        gs, ds = gate_up_proj_scale_inv, down_proj_scale_inv
        ops.moe_experts_fp8_op(x, gu, gs, dn, ds, idx, w, *extras, interleaved, use_pdl, backend)
        return out
    ops.moe_experts_op(x, gu, dn, idx, w, *extras, transposed, interleaved, use_pdl, backend)
    return out


def supports_moe_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    activation: str = "silu",
    transposed: bool = False,
    bias: torch.Tensor | None = None,
    shared_expert_output: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
    gate_up_proj_scale_inv: torch.Tensor | None = None,
    down_proj_scale_inv: torch.Tensor | None = None,
    block_size: tuple[int, int] = (BLOCK, BLOCK),
    gate_up_layout: str = "stacked",
    out: torch.Tensor | None = None,
) -> bool:
    """True when the Triton kernels can run these arguments on their device (no side effects)."""
    fp8 = {
        "gate_up_proj_scale_inv": gate_up_proj_scale_inv,
        "down_proj_scale_inv": down_proj_scale_inv,
        "block_size": block_size,
        "gate_up_layout": gate_up_layout,
    }
    args = (
        "moe_experts",
        hidden_states,
        gate_up_proj,
        down_proj,
        top_k_index,
        top_k_weights,
        activation,
        transposed,
        bias,
        shared_expert_output,
        routed_scaling_factor,
        out,
        fp8,
    )
    try:
        dims = _check_experts(*args)
    except ValueError:
        return False
    return _kernel_reason(hidden_states, *dims, gate_up_proj.dtype == FP8) is None
