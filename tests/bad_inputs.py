"""The bad-input walk over every public op, shared by the CPU suite (tests/test_bad_inputs.py) and
its GPU variant (tests/test_bad_inputs_gpu.py).

Each op has a small valid call (:func:`local_cases`, :func:`comm_cases`). Hypothesis draws one
mutation of it: another dtype, shape or stride for a tensor argument, a partial alias of an output
with an input, ``requires_grad`` on a written tensor, a wrong-typed scalar, None or a non-tensor
where a tensor goes. The call must then either

* raise ``ValueError`` / ``TypeError`` whose message names an argument of the op (the mutated one
  for the mutations that leave no doubt), with no byte of any tensor argument changed; or
* be accepted and give, bit for bit, what the same call gives on contiguous copies of its
  arguments (results and every argument after the call).

Partial aliases and ``requires_grad`` on written tensors must always be refused. The
communication ops get only mutations no op may accept (a wrongly accepted call would wait for a
peer that never calls; the workspace's bounded wait then fails the test).
"""

from __future__ import annotations

import inspect

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

import moefuse
from moefuse.testing import bits

BF16, F32 = torch.bfloat16, torch.float32
E4M3 = torch.float8_e4m3fn
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int32, torch.int64,
          torch.uint8, torch.bool, E4M3)  # fmt: skip
#: the mutations whose outcome is fixed: refused, naming the mutated argument
STRICT = ("alias", "grad")
SCALAR_PARAMS = {
    "eps", "post_eps", "next_eps", "gain_center", "next_gain_center", "post_gain_center",
    "routed_scaling_factor", "enable_pdl", "impl", "layout", "recipe", "dtype", "out_dtype",
    "top_k", "input_is_expanded", "transposed", "activation", "scoring", "renormalize", "pad_to",
    "num_experts", "use_fused_finalize", "weight_bias", "fp32_acc", "algorithm", "accumulate",
    "quant", "weight_before_norm", "weights_dtype", "ids_dtype", "group_size", "dst_dtype",
    "column_major_scales", "scale_tma_aligned", "scale_ue8m0", "quant_eps",
}  # fmt: skip
BAD_SCALARS = ("1", True, float("nan"), -1, None, object())
#: budget: examples per op (fixed, derandomized: the same calls on every run)
EXAMPLES = 10
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))  # fmt: skip


# ----------------------------------------------------------------------------- valid calls
def local_cases(dev) -> dict:
    """op name -> builder of a valid keyword call on ``dev`` (tiny shapes); ``op[variant]``: a
    second valid call of the same op (FP8 weights, pre-quantized input)."""
    g = torch.Generator().manual_seed(7)

    def r(*shape, dtype=BF16):
        return torch.randn(shape, generator=g).to(dtype=dtype, device=dev)

    def e(*shape, dtype=BF16):
        return torch.zeros(shape, dtype=dtype, device=dev)

    def i32(*vals, shape=None):
        t = torch.tensor(vals, dtype=torch.int32, device=dev)
        return t.view(shape) if shape else t

    perm = (5, 0, 7, 2, 1, 4, 3, 6)
    m, h = 4, 32
    return {
        "rmsnorm": lambda: dict(input=r(m, h), weight=r(h), out=e(m, h)),
        "gemma_rmsnorm": lambda: dict(input=r(m, h), weight=r(h), out=e(m, h)),
        "fused_add_rmsnorm": lambda: dict(input=r(m, h), residual=r(m, h), weight=r(h)),
        "gemma_fused_add_rmsnorm": lambda: dict(input=r(m, h), residual=r(m, h), weight=r(h)),
        "gated_residual_rmsnorm": lambda: dict(
            branch=r(m, h),
            residual=r(m, h, dtype=F32),
            weight=r(h),
            alpha=r(h, dtype=F32),
            beta=r(h, dtype=F32),
            gain_center=0.0,
            out=e(m, h, dtype=F32),
        ),
        "gated_residual_next_rmsnorm": lambda: dict(
            branch=r(m, h),
            residual=r(m, h, dtype=F32),
            next_weight=r(h),
            alpha=r(h, dtype=F32),
            beta=r(h, dtype=F32),
            next_gain_center=1.0,
            residual_out=e(m, h, dtype=F32),
            ffn_input=e(m, h),
            router_input=e(m, h, dtype=F32),
        ),
        "rmsnorm_sigmoid_gate": lambda: dict(input=r(m, 2, 16), gate=r(m, 2, 16)),
        "moe_finalize": lambda: dict(
            permuted_input=r(8, h),
            expanded_idx_to_permuted_idx=i32(*perm, shape=(m, 2)),
            topk_scales=r(m, 2, dtype=F32),
            out=e(m, h),
            routed_scaling_factor=2.0,
        ),
        "moe_finalize_scatter_add": lambda: dict(
            permuted_input=r(8, h),
            permuted_idx_to_expanded_idx=i32(*perm),
            topk_scales=r(m, 2, dtype=F32),
            out=e(m, h),
        ),
        "moe_permute": lambda: dict(
            input=r(m, h), permuted_idx_to_expanded_idx=i32(*perm), top_k=2, out=e(8, h)
        ),
        "moe_experts": lambda: dict(
            hidden_states=r(m, h),
            gate_up_proj=r(3, 16, h) * 0.1,
            down_proj=r(3, h, 8) * 0.1,
            top_k_index=i32(0, 2, 1, 0, 2, 2, 1, 0, shape=(m, 2)),
            top_k_weights=r(m, 2, dtype=F32),
            out=e(m, h),
        ),
        "fp8_linear": lambda: dict(
            input=r(m, h),
            weight=r(24, h).to(E4M3),
            weight_scale_inv=r(1, 1, dtype=F32).abs() + 0.01,
            bias=r(24),
            out=e(m, 24),
        ),
        "fp8_linear[input_scale]": lambda: dict(
            input=r(m, h).to(E4M3),
            weight=r(24, h).to(E4M3),
            weight_scale_inv=r(1, 1, dtype=F32).abs() + 0.01,
            input_scale=r(m, 1, dtype=F32).abs() + 0.01,
            out=e(m, 24),
            workspace=e(132, dtype=torch.int32),
        ),
        "moe_experts[fp8]": lambda: dict(
            hidden_states=r(m, h),
            gate_up_proj=r(3, 16, h).to(E4M3),
            down_proj=r(3, h, 8).to(E4M3),
            top_k_index=i32(0, 2, 1, 0, 2, 2, -1, 0, shape=(m, 2)),
            top_k_weights=r(m, 2, dtype=F32),
            out=e(m, h),
            gate_up_proj_scale_inv=r(3, 1, 1, dtype=F32).abs() + 0.01,
            down_proj_scale_inv=r(3, 1, 1, dtype=F32).abs() + 0.01,
        ),
        "route_topk": lambda: dict(router_logits=r(m, 6, dtype=F32), top_k=2, scoring="softmax"),
        "router_topk": lambda: dict(
            router_logits=r(m, 6),
            top_k=2,
            weights_out=e(m, 2, dtype=F32),
            ids_out=e(m, 2, dtype=torch.int32),
        ),
        "sort_by_expert": lambda: dict(
            topk_ids=i32(0, 2, 1, 0, 2, 2, 1, 0, shape=(m, 2)), num_experts=3, pad_to=2
        ),
        "moe_layer": lambda: dict(
            x=r(m, h),
            weights=moefuse.MoEWeights.random(3, h, 8, generator=g, device=dev),
            top_k=2,
            out=e(m, h),
        ),
        "fp8_quantize": lambda: dict(
            input=r(m, h), scale=r(1, dtype=F32).abs() + 0.01, out=e(m, h, dtype=E4M3)
        ),
        "fp8_quantize_per_token": lambda: dict(
            input=r(m, h), out=e(m, h, dtype=E4M3), scale_out=e(m, 1, dtype=F32)
        ),
        "fp8_dequantize": lambda: dict(
            input=r(m, h).to(E4M3), scale=r(m, 1, dtype=F32), out=e(m, h)
        ),
        "fp4_quantize": lambda: dict(
            input=r(m, h),
            global_scale=r(1, dtype=F32).abs() + 1,
            layout="linear",
            out=e(m, h // 2, dtype=torch.uint8),
            scale_out=e(m, h // 16, dtype=torch.uint8),
        ),
        "fp4_dequantize": lambda: dict(
            packed=torch.randint(0, 256, (m, h // 2), generator=g).to(torch.uint8).to(dev),
            scales=torch.full((m, h // 16), 0x38, dtype=torch.uint8, device=dev),
            global_scale=r(1, dtype=F32).abs() + 1,
            layout="linear",
            out=e(m, h, dtype=F32),
        ),
        "rmsnorm_quant": lambda: dict(
            input=r(m, h),
            weight=r(h),
            scale=r(1, dtype=F32).abs() + 0.01,
            gain_center=0.0,
            out=e(m, h, dtype=E4M3),
        ),
        "fused_add_rmsnorm_quant": lambda: dict(
            input=r(m, h),
            residual=r(m, h),
            weight=r(h),
            scale=r(1, dtype=F32).abs() + 0.01,
            out=e(m, h, dtype=E4M3),
        ),
        "rmsnorm_fp4_quantize": lambda: dict(
            input=r(m, h),
            weight=r(h),
            global_scale=r(1, dtype=F32).abs() + 1,
            layout="linear",
            out=e(m, h // 2, dtype=torch.uint8),
            scale_out=e(m, h // 16, dtype=torch.uint8),
            norm_out=e(m, h),
        ),
        "fused_add_rmsnorm_fp4_quantize": lambda: dict(
            input=r(m, h),
            residual=r(m, h),
            weight=r(h),
            global_scale=r(1, dtype=F32).abs() + 1,
            layout="linear",
            out=e(m, h // 2, dtype=torch.uint8),
            scale_out=e(m, h // 16, dtype=torch.uint8),
            norm_out=e(m, h),
        ),
        "per_token_group_quant_8bit": lambda: dict(
            x=r(m, h),
            group_size=32,
            out=e(m, h, dtype=E4M3),
            scale_out=e(m, -(-h // 32), dtype=F32),
        ),
        "rmsnorm_group_quant": lambda: dict(
            input=r(m, h),
            weight=r(h),
            group_size=32,
            out=e(m, h, dtype=E4M3),
            scale_out=e(m, -(-h // 32), dtype=F32),
        ),
        "fused_add_rmsnorm_group_quant": lambda: dict(
            input=r(m, h),
            residual=r(m, h),
            weight=r(h),
            group_size=32,
            out=e(m, h, dtype=E4M3),
            scale_out=e(m, -(-h // 32), dtype=F32),
        ),
    }


def comm_cases(dev, ws) -> dict:
    """Valid calls of the communication ops on a BF16 workspace ``ws`` of hidden size 32 (two
    ranks: the all-gather shards are 16 wide)."""
    g = torch.Generator().manual_seed(11)

    def r(*shape, dtype=BF16):
        return torch.randn(shape, generator=g).to(dtype=dtype, device=dev)

    def e(*shape, dtype=BF16):
        return torch.zeros(shape, dtype=dtype, device=dev)

    m, h = 2, 32
    idx = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=dev)
    one = torch.ones(1, device=dev)
    u8 = torch.uint8
    return {
        "allreduce": lambda: dict(input=r(m, h), workspace=ws, out=e(m, h)),
        "allreduce_residual_rmsnorm": lambda: dict(
            input=r(m, h),
            residual=r(m, h),
            weight=r(h),
            workspace=ws,
            residual_out=e(m, h),
            norm_out=e(m, h),
        ),
        "allreduce_residual_rmsnorm_fp8": lambda: dict(
            input=r(m, h),
            residual=r(m, h),
            weight=r(h),
            scale=one.clone(),
            workspace=ws,
            residual_out=e(m, h),
            quant_out=e(m, h, dtype=E4M3),
        ),
        "allreduce_residual_rmsnorm_out_fp8": lambda: dict(
            input=r(m, h),
            residual=r(m, h),
            weight=r(h),
            scale=one.clone(),
            workspace=ws,
            residual_out=e(m, h),
            norm_out=e(m, h),
            quant_out=e(m, h, dtype=E4M3),
        ),
        "allreduce_residual_rmsnorm_nvfp4": lambda: dict(
            input=r(m, h),
            residual=r(m, h),
            weight=r(h),
            global_scale=one.clone(),
            workspace=ws,
            layout="linear",
            residual_out=e(m, h),
            quant_out=e(m, h // 2, dtype=u8),
            scale_out=e(m, h // 16, dtype=u8),
        ),
        "allreduce_residual_rmsnorm_out_nvfp4": lambda: dict(
            input=r(m, h),
            residual=r(m, h),
            weight=r(h),
            global_scale=one.clone(),
            workspace=ws,
            layout="linear",
            residual_out=e(m, h),
            norm_out=e(m, h),
            quant_out=e(m, h // 2, dtype=u8),
            scale_out=e(m, h // 16, dtype=u8),
        ),
        "all_gather_rmsnorm": lambda: dict(
            shard=r(m, h // 2), weight=r(h), workspace=ws, out=e(m, h)
        ),
        "all_gather_rmsnorm_fp8": lambda: dict(
            shard=r(m, h // 2),
            weight=r(h),
            scale=one.clone(),
            workspace=ws,
            out=e(m, h, dtype=E4M3),
        ),
        "all_gather_rmsnorm_fp4_quantize": lambda: dict(
            shard=r(m, h // 2),
            weight=r(h),
            global_scale=one.clone(),
            workspace=ws,
            layout="linear",
            out=e(m, h // 2, dtype=u8),
            scale_out=e(m, h // 16, dtype=u8),
        ),
        "all_gather_gated_residual_next_rmsnorm": lambda: dict(
            branch_shard=r(m, h // 2),
            residual=r(m, h, dtype=F32),
            alpha=r(h, dtype=F32),
            beta=r(h, dtype=F32),
            next_weight=r(h),
            workspace=ws,
            residual_out=e(m, h, dtype=F32),
            ffn_input=e(m, h),
            router_input=e(m, h, dtype=F32),
        ),
        "moe_allreduce_residual_rmsnorm": lambda: dict(
            active_experts_token_input=r(2, m, h),
            scale_input=r(2, m, dtype=F32),
            token_input=r(m, h),
            residual=r(m, h),
            weight=r(h),
            workspace=ws,
            allreduce_out=e(m, h),
            residual_out=e(m, h),
            norm_out=e(m, h),
        ),
        "moe_finalize_allreduce_residual_rmsnorm": lambda: dict(
            allreduce_in=r(4, h),
            residual=r(m, h),
            norm_weight=r(h),
            expanded_idx_to_permuted_idx=idx.clone(),
            workspace=ws,
            expert_scale_factor=r(m, 2, dtype=F32),
            residual_out=e(m, h),
            norm_out=e(m, h),
        ),
        "moe_finalize_rmsnorm_allreduce": lambda: dict(
            routed_rows=r(4, h),
            route_weights=r(m, 2, dtype=F32),
            permuted_idx=idx.clone(),
            norm_weight=r(h),
            output=e(m, h),
            workspace=ws,
            eps=1e-6,
        ),
        # no workspace: every refused call is refused before one is looked for
        "tp_moe_finalize_rmsnorm": lambda: dict(
            gemm2_permuted=r(4, h),
            expert_weights=r(m, 2, dtype=F32),
            expanded_idx_to_permuted_idx=idx.clone(),
            norm_weight=r(h),
            output=e(m, h),
            eps=1e-6,
            gain_center=0.0,
            weight_before_norm=True,
        ),
    }


# ----------------------------------------------------------------------------- mutations
def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _written(fn) -> tuple[str, ...]:
    """The tensor arguments an op writes (the names its shared checks were declared with)."""
    names = set(_params(fn))
    written = {
        "out",
        "residual_out",
        "norm_out",
        "quant_out",
        "scale_out",
        "allreduce_out",
        "ffn_input",
        "router_input",
        "output",
    }
    if fn.__name__ in ("fused_add_rmsnorm", "gemma_fused_add_rmsnorm", "rmsnorm_sigmoid_gate"):
        written |= {"input"}
    if fn.__name__.startswith("fused_add_rmsnorm_") or fn.__name__.endswith("fused_add_rmsnorm"):
        written |= {"residual"}
    return tuple(sorted(names & written))


def _strided(t: torch.Tensor, how: str) -> torch.Tensor:
    """``t``'s values in a non-contiguous layout: every other element of the last dim, or padded
    rows."""
    if how == "last":
        buf = torch.zeros((*t.shape[:-1], 2 * t.shape[-1]), dtype=t.dtype, device=t.device)
        view = buf[..., ::2]
    else:
        buf = torch.zeros((*t.shape[:-1], t.shape[-1] + 8), dtype=t.dtype, device=t.device)
        view = buf[..., : t.shape[-1]]
    view.copy_(t)
    return view


def draw_mutation(data, fn, kw: dict, *, comm: bool):
    """Mutate ``kw`` in place; returns (kind, argument name)."""
    tensors = sorted(k for k, t in kw.items() if isinstance(t, torch.Tensor))
    scalars = sorted(p for p in _params(fn) if p in SCALAR_PARAMS)
    written = [w for w in _written(fn) if w in kw]
    kinds = ["dtype", "shape", "grad", "scalar", "type", "alias"]
    if not comm:
        kinds += ["stride", "none"]
    kind = data.draw(st.sampled_from(kinds), label="kind")
    if kind in ("grad", "alias") and not written:
        kind = "dtype"
    if kind == "scalar":
        name = data.draw(st.sampled_from(scalars), label="scalar")
        bad = ("1", object()) if comm else BAD_SCALARS
        kw[name] = data.draw(st.sampled_from(bad), label="value")
        return kind, name
    if kind == "grad":
        name = data.draw(st.sampled_from(written), label="written")
        t = kw[name]
        if not (t.is_floating_point() and t.element_size() >= 2):
            t = torch.zeros(t.shape, dtype=BF16, device=t.device)
        kw[name] = t.requires_grad_(True)
        return kind, name
    if kind == "alias":
        name = data.draw(st.sampled_from(written), label="written")
        out = kw[name]
        others = [
            k
            for k in tensors
            if k != name
            and kw[k].numel() > out.shape[-1] > 0
            and kw[k].dtype == out.dtype
            and kw[k].dim() == out.dim() >= 2
        ]
        if not others:
            kind, name = "shape", name
        else:
            src = data.draw(st.sampled_from(others), label="source")
            a = kw[src]
            rows = max(a.shape[0], out.shape[0])
            buf = torch.zeros((rows + 1, *a.shape[1:]), dtype=a.dtype, device=a.device)
            buf[: a.shape[0]].copy_(a)
            if tuple(out.shape[1:]) == tuple(a.shape[1:]):
                kw[src] = buf[: a.shape[0]]
                kw[name] = buf[1 : out.shape[0] + 1]  # one row shifted: a partial overlap
                return kind, name
            kind = "shape"
    name = data.draw(st.sampled_from(tensors), label="tensor")
    t = kw[name]
    if kind == "dtype":
        choices = (torch.bool, torch.float64) if comm else DTYPES
        dt = data.draw(st.sampled_from([d for d in choices if d != t.dtype]), label="dtype")
        kw[name] = t.to(dt)
    elif kind == "shape":
        how = (
            "unsqueeze"
            if comm
            else data.draw(
                st.sampled_from(["unsqueeze", "drop_col", "drop_row", "flat"]), label="how"
            )
        )
        if how == "drop_col" and t.dim() >= 1 and t.shape[-1] > 1:
            kw[name] = t[..., :-1].contiguous()
        elif how == "drop_row" and t.dim() >= 2 and t.shape[0] > 1:
            kw[name] = t[1:].contiguous()
        elif how == "flat" and t.dim() >= 2:
            kw[name] = t.reshape(-1)
        else:
            kw[name] = t.unsqueeze(0)
    elif kind == "stride":
        kw[name] = _strided(t, data.draw(st.sampled_from(["last", "rows"]), label="how"))
    elif kind == "type":
        kw[name] = "1" if comm else data.draw(st.sampled_from(["1", 1.5, [1.0]]), label="value")
    elif kind == "none":
        kw[name] = None
    return kind, name


# ----------------------------------------------------------------------------- the check
def _tensors_of(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors_of(y)


def _names_argument(msg: str, names) -> bool:
    return any(f"'{n}'" in msg or f"'{n}." in msg for n in names)


def check_call(fn, kw: dict, kind: str, name: str, impl: str | None) -> None:
    """Run ``fn(**kw)`` and assert one of the two allowed outcomes (module docstring)."""
    if impl is not None:
        kw = dict(kw, impl=kw.get("impl", impl))
    ids: dict[int, torch.Tensor] = {}
    contiguous = {}  # contiguous copies of the pre-call state, aliases kept as one tensor
    for k, t in kw.items():
        if isinstance(t, torch.Tensor):
            if id(t) not in ids:
                ids[id(t)] = t.detach().clone(memory_format=torch.contiguous_format)
            contiguous[k] = ids[id(t)]
    before = {k: bits(t.detach()).clone() for k, t in kw.items() if isinstance(t, torch.Tensor)}
    try:
        result = fn(**kw)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        strict = kind in STRICT or kind in ("scalar", "type")
        want = [name] if strict else _params(fn)
        assert _names_argument(msg, want), f"{kind} of {name!r}: the error names {want}: {msg}"
        for k, b in before.items():
            assert torch.equal(bits(kw[k].detach()), b), f"{k!r} written before the error: {msg}"
        return
    assert kind not in STRICT, f"{fn.__name__}: {kind} of {name!r} was accepted"
    again = fn(**{k: contiguous.get(k, v) for k, v in kw.items()})
    got, want = list(_tensors_of(result)), list(_tensors_of(again))
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(bits(a.detach()), bits(b)), f"{fn.__name__}: {kind} of {name!r}"
    for k in contiguous:
        assert torch.equal(bits(kw[k].detach()), bits(contiguous[k])), f"argument {k!r} differs"
