"""The parts of ``python -m moefuse demo`` beyond the epilogue ops (:mod:`moefuse.demo`): the
routed experts and the router as rows of the demo's table, a communication fusion on two
loopback ranks, and a transformers MoE model patched by :func:`moefuse.integrations.
transformers.patch`.

On a GPU (SM90+) the experts run at Qwen3-30B-A3B's expert shapes (H 2048, I 768, E 128,
K 8) against transformers' own ``grouped_mm`` experts function, the router against the router
tail transformers runs after its linear (FP32 softmax, top-k, renormalize; eager PyTorch), the
communication fusion on two ranks that are threads sharing the one GPU, and the model is a
4-layer Qwen3-MoE with the real block shapes (random weights), timed per greedy decode step as
shipped and patched. On CPU the same code runs at tiny sizes with the kernels in Triton's
interpreter (the ranks are threads too) and nothing is timed.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: expert shapes of the experts row: Qwen3-30B-A3B's on a GPU, tiny ones in the interpreter
EXPERTS_GPU = dict(hidden=2048, inter=768, experts=128, top_k=8)
EXPERTS_CPU = dict(hidden=64, inter=32, experts=8, top_k=2)
#: greedy tokens generated per model (GPU: two lengths, the decode step from their difference)
NEW_TOKENS_CPU = 6
DECODE_SHORT, DECODE_LONG, DECODE_ROUNDS = 8, 40, 3


def rel_norm_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------- table rows
@dataclass
class Step:
    """One row of the demo's table: an op, its shape, how to run it per ``impl`` and how its
    outputs are checked (and, on a GPU, timed)."""

    op: str
    shape: str
    run: Callable[[str], object]  # impl -> outputs (tensor or tuple)
    tol: str | tuple[str, ...]
    #: (reference outputs, kernel outputs) -> expected outputs, for outputs whose spec meaning
    #: is a function of another output (None: the reference outputs)
    expect: Callable[[tuple, tuple], tuple] | None = None
    #: GPU timing: the kernel call alone (None: ``run("triton")``; in-place ops give a call on
    #: buffers of their own so the timed call is not a clone + the op) and the same math in
    #: plain PyTorch, which the demo times under torch.compile
    kernel: Callable[[], object] | None = None
    torch_math: Callable[[], object] | None = None
    #: a check of its own instead of ``tol``: (expected, got) -> None or what failed
    check: Callable[[tuple, tuple], str | None] | None = None
    check_text: str = ""
    #: a baseline timed as it is (not compiled), and its name
    baseline: Callable[[], object] | None = None
    baseline_name: str = ""


def system_steps(m: int, dev: str, on_gpu: bool) -> list:
    """The experts and router rows of the demo's table (:class:`Step`)."""
    return [_experts_step(m, dev, on_gpu), _router_step(m, dev, on_gpu)]


def _experts_step(m: int, dev: str, on_gpu: bool):
    import moefuse

    s = EXPERTS_GPU if on_gpu else EXPERTS_CPU
    h, i, e, k = s["hidden"], s["inter"], s["experts"], s["top_k"]
    g = torch.Generator(device=dev).manual_seed(1)
    bf = torch.bfloat16
    gate_up = (torch.randn(e, 2 * i, h, generator=g, device=dev) * h**-0.5).to(bf)
    down = (torch.randn(e, h, i, generator=g, device=dev) * i**-0.5).to(bf)
    x = torch.randn(m, h, generator=g, device=dev).to(bf)
    top, idx = torch.topk(torch.randn(m, e, generator=g, device=dev), k, dim=-1)
    w = torch.softmax(top, dim=-1)

    def check(expected, got):
        err = rel_norm_error(got[0], expected[0])
        # FP32 accumulation of the BF16 products in the kernels' order against the reference's
        # FP64 products: the tests' bound (tests/test_moe_experts.py)
        return None if err < 1e-2 else f"relative norm error {err:.3g} >= 1e-2"

    return Step(
        f"moe_experts (E={e}, K={k}, I={i})",
        f"{m}x{h}",
        lambda impl: moefuse.moe_experts(x, gate_up, down, idx, w, impl=impl),
        "exact",
        check=check,
        check_text="rel. norm err < 1e-2",
        baseline=_grouped_mm_baseline(gate_up, down, x, idx, w),
        baseline_name="transformers grouped_mm",
    )


def _grouped_mm_baseline(gate_up, down, x, idx, w):
    """transformers' ``grouped_mm`` experts function on a module holding the same weights (None
    where transformers, or that function, is not installed)."""
    try:
        import transformers.integrations.moe as tf_moe

        from moefuse.bench.experts_setup import FakeExperts
    except ImportError:
        return None
    fn = getattr(tf_moe, "grouped_mm_experts_forward", None)
    if fn is None:
        return None
    module = FakeExperts(gate_up, down)
    return lambda: fn(module, x, idx, w)


def _router_step(m: int, dev: str, on_gpu: bool):
    import moefuse

    e, k = (128, 8) if on_gpu else (8, 2)
    g = torch.Generator(device=dev).manual_seed(2)
    logits = (torch.randn(m, e, generator=g, device=dev) * 3).to(torch.bfloat16)

    def check(expected, got):
        if not torch.equal(got[1].long(), expected[1].long()):
            return "expert ids differ from the reference's"
        err = float(((got[0] - expected[0]).abs() / expected[0].abs().clamp_min(1e-30)).max())
        # softmax through exp2 and one FP32 division against torch's exp: a few FP32 ulp
        return None if err <= 1e-6 else f"weights {err:.3g} relative from the reference's"

    def tail():  # what transformers' Qwen3-MoE router runs after its linear (eager PyTorch)
        p = torch.softmax(logits.float(), dim=-1)
        top, ids = torch.topk(p, k, dim=-1)
        return top / top.sum(dim=-1, keepdim=True), ids

    return Step(
        f"router_topk (E={e}, K={k})",
        f"{m}x{e}",
        lambda impl: moefuse.router_topk(logits, k, impl=impl),
        "exact",
        check=check,
        check_text="ids exact, weights 1e-6 rel.",
        baseline=tail,
        baseline_name="eager softmax+topk+renorm",
    )


# ----------------------------------------------------------------------------- communication
def comm_section(on_gpu: bool) -> dict:
    """``allreduce_residual_rmsnorm`` on two loopback ranks (threads of this process, one device:
    :mod:`moefuse.testing_ranks`): each rank's outputs against the reference of both ranks'
    inputs, and the two ranks' outputs against each other."""
    from moefuse.testing_ranks import run_loopback_ranks

    m, h = (128, 4096) if on_gpu else (4, 64)
    dev = "cuda" if on_gpu else "cpu"
    results = run_loopback_ranks(_allreduce_rank, 2, dev, m, h, dev, timeout_s=300)
    fails = [msg for r in results for msg in r["fails"]]
    same = results[0]["digest"] == results[1]["digest"]
    if not same:
        fails.append("the two ranks' outputs differ")
    return dict(
        op="allreduce_residual_rmsnorm",
        shape=f"{m}x{h}",
        residual_bitwise=all(r["residual_bitwise"] for r in results),
        norm_max_ulp=max(r["norm_ulp"] for r in results),
        ranks_bitwise=same,
        fails=fails,
    )


def _allreduce_rank(rank: int, world_size: int, m: int, h: int, dev: str) -> dict:
    import hashlib

    import torch.distributed as dist

    import moefuse
    from moefuse.comm.all_reduce import reference as ref
    from moefuse.testing import ulp_distance

    dev = torch.device(f"cuda:{torch.cuda.current_device()}" if dev == "cuda" else dev)
    g = torch.Generator(device=dev).manual_seed(3)  # every rank draws every rank's input
    bf = torch.bfloat16
    parts = [(torch.randn(m, h, generator=g, device=dev) * (0.5 + r)).to(bf) for r in range(2)]
    res = torch.randn(m, h, generator=g, device=dev).to(bf)
    w = (torch.rand(h, generator=g, device=dev) + 0.5).to(bf)
    ws = moefuse.AllReduceWorkspace(None, m, h, bf, dev, timeout_s=60)
    try:
        res_out, norm_out = moefuse.allreduce_residual_rmsnorm(
            parts[rank], res, w, workspace=ws, impl="triton"
        )
        if res_out.is_cuda:
            torch.cuda.current_stream().synchronize()
        dist.barrier()  # no host work on this rank while the peer's kernel still waits
        h_ref, n_ref = ref.allreduce_residual_rmsnorm_from_partials(parts, res, w)
        bitwise = torch.equal(res_out.view(torch.int16), h_ref.view(torch.int16))
        ulp = int(ulp_distance(norm_out, n_ref).max())
        fails = [] if bitwise else [f"rank {rank}: residual_out differs from the reference"]
        fails += [f"rank {rank}: norm_out {ulp} ulp from the reference"] if ulp > 1 else []
        raw = torch.cat([res_out.view(torch.int16), norm_out.view(torch.int16)]).cpu().numpy()
        dist.barrier()
    finally:
        ws.close()
    return dict(
        residual_bitwise=bitwise,
        norm_ulp=ulp,
        fails=fails,
        digest=hashlib.sha256(raw.tobytes()).hexdigest(),
    )


# ----------------------------------------------------------------------------- transformers
def model_section(on_gpu: bool) -> dict:
    """A Qwen3-MoE model (random weights, BF16) as shipped and patched: the patch report, greedy
    tokens of both, and on a GPU the µs per decode step of each."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return dict(skipped="transformers is not installed (pip install moefuse[transformers])")
    from moefuse.integrations.transformers import patch

    dev = "cuda" if on_gpu else "cpu"
    model, desc = _qwen3_moe(on_gpu, dev)
    patched = copy.deepcopy(model)
    report = patch(patched, impl="auto" if on_gpu else "triton")
    n_prompt = 16 if on_gpu else 6
    prompt = torch.randint(
        0, model.config.vocab_size, (1, n_prompt), generator=torch.Generator().manual_seed(2)
    ).to(dev)
    new = DECODE_LONG if on_gpu else NEW_TOKENS_CPU
    with torch.no_grad():
        shipped_ids = _generate(model, prompt, new)
        patched_ids = _generate(patched, prompt, new)
        # teacher-forced: both models read the shipped continuation, one forward each
        want = model(shipped_ids).logits[0].float()
        got = patched(shipped_ids).logits[0].float()
    out = dict(model=desc, report=report, new_tokens=new)
    out.update(_compare_tokens(shipped_ids[0], patched_ids[0], n_prompt, want, got))
    if on_gpu:
        out.update(_decode_step_us({"shipped": model, "patched": patched}, prompt))
    return out


def _compare_tokens(shipped, patched, n_prompt: int, want, got) -> dict:
    """Greedy tokens of both models (how many lead equal; where the first differs, how far apart
    the shipped model's logits of the two tokens were) and the logits of both on the shipped
    continuation, within the ``bf16_model_logits`` tolerance (moefuse.testing): the check.
    Random weights give near-tied logits, where one BF16 rounding picks the token; after one
    different token the two continuations read different prefixes."""
    from moefuse.testing import TOLERANCES

    new_s, new_p = shipped[n_prompt:], patched[n_prompt:]
    differ = (new_s != new_p).nonzero()
    lead = int(differ[0, 0]) if len(differ) else len(new_s)
    gap = None
    if lead < len(new_s):  # the shipped model's logit of its token minus that of the patched one
        row = want[n_prompt - 1 + lead]
        gap = float(row[new_s[lead]] - row[new_p[lead]])
    atol = TOLERANCES["bf16_model_logits"].atol
    err = float((got - want).abs().max())
    agree = int((got.argmax(-1) == want.argmax(-1))[n_prompt - 1 : -1].sum())
    fails = [] if err <= atol else [f"logits {err:.3g} from the shipped model's (> {atol})"]
    return dict(
        tokens_equal_leading=lead,
        first_difference_gap=gap,
        logits_max_diff=err,
        logits_atol=atol,
        teacher_forced_agree=agree,
        fails=fails,
    )


def _qwen3_moe(on_gpu: bool, dev: str):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if on_gpu:  # the decoder blocks of Qwen3-30B-A3B (moefuse.bench.hf_moe's model), 4 layers
        shape = dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            initializer_range=0.02,
        )
    else:  # tests/test_integrations_transformers.py's tiny Qwen3-MoE at its seed
        shape = dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=3,
            initializer_range=0.1,
        )
    cfg = Qwen3MoeConfig(norm_topk_prob=True, max_position_embeddings=4096, **shape)
    torch.manual_seed(2)
    with torch.device(dev):
        model = Qwen3MoeForCausalLM(cfg)
    desc = (
        f"Qwen3-MoE, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_experts} experts (top-{cfg.num_experts_per_tok}, "
        f"I {cfg.moe_intermediate_size}), random weights, BF16"
    )
    return model.to(torch.bfloat16).eval(), desc


def _generate(model, prompt, n: int) -> torch.Tensor:
    return model.generate(
        prompt,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )


def _decode_step_us(models: dict, prompt) -> dict:
    """µs per greedy decode step of each model, batch 1, eager: ``(t_long - t_short) /
    (DECODE_LONG - DECODE_SHORT)`` of the median times of ``DECODE_ROUNDS`` rounds that take the
    models in turn (prefill cancels out), after a warm-up generate each."""
    times = {name: {DECODE_SHORT: [], DECODE_LONG: []} for name in models}
    with torch.no_grad():
        for model in models.values():
            _generate(model, prompt, DECODE_SHORT)
        for _ in range(DECODE_ROUNDS):
            for name, model in models.items():
                for n in (DECODE_SHORT, DECODE_LONG):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    _generate(model, prompt, n)
                    torch.cuda.synchronize()
                    times[name][n].append(time.perf_counter() - t0)
    us = {}
    for name, t in times.items():
        span = statistics.median(t[DECODE_LONG]) - statistics.median(t[DECODE_SHORT])
        us[f"{name}_step_us"] = span / (DECODE_LONG - DECODE_SHORT) * 1e6
    return us


# ----------------------------------------------------------------------------- picture
def plot(path, title: str, rows: list[dict], model: dict) -> None:
    """The demo's picture: each op's speed-up over its baseline (bars), and the patched model's
    decode step against the shipped one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if r.get("x_baseline")]
    fig, (ax, ax2) = plt.subplots(
        1, 2, figsize=(12, 0.32 * len(timed) + 2.2), gridspec_kw={"width_ratios": [3, 1.2]}
    )
    ys = range(len(timed))
    ax.barh(ys, [r["x_baseline"] for r in timed], color="tab:blue")
    ax.set_yticks(ys, [f"{r['op']}\nvs {r['baseline']}" for r in timed], fontsize=6)
    ax.invert_yaxis()
    ax.axvline(1.0, color="tab:red", lw=1, ls="--")
    for y, r in zip(ys, timed):
        ax.annotate(
            f"{r['x_baseline']:.2f} x ({r['kernel_us']:.1f} µs)",
            (r["x_baseline"], y),
            fontsize=6,
            xytext=(3, -2),
            textcoords="offset points",
        )
    ax.set_xlim(0, 1.3 * max([r["x_baseline"] for r in timed] + [1.0]))
    ax.set_xlabel("speed-up over the baseline (CUDA-graph µs per call)", fontsize=7)
    ax.tick_params(labelsize=6)
    ax.grid(axis="x", alpha=0.3)
    if model.get("shipped_step_us"):
        names, us = ["shipped", "patched"], [model["shipped_step_us"], model["patched_step_us"]]
        ax2.bar(names, us, color=["tab:gray", "tab:blue"])
        for x, v in enumerate(us):
            ax2.annotate(
                f"{v:.0f} µs",
                (x, v),
                ha="center",
                fontsize=7,
                xytext=(0, 2),
                textcoords="offset points",
            )
        ax2.set_title(
            f"{model['model'].split(',')[0]} decode step, eager\n"
            f"{us[0] / us[1]:.2f} x, logits within {model['logits_max_diff']:.2g} of shipped",
            fontsize=7,
        )
        ax2.set_ylim(0, 1.15 * max(us))
        ax2.set_ylabel("µs per greedy decode step (batch 1)", fontsize=7)
        ax2.tick_params(labelsize=6)
    else:
        ax2.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
