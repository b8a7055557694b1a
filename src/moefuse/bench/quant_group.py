"""The per-token-group 8-bit ops in ``python -m moefuse bench quant`` (results
``quant-group-<gpu>.json`` / ``.png``): ``per_token_group_quant_8bit``, ``rmsnorm_group_quant``
and ``fused_add_rmsnorm_group_quant`` (E4M3, groups of 128, FP32 row-major scales, BF16) at
H in {2048, 2880, 4096, 7168} and M in {1, 16, 128, 2048, 16384}, against ``torch.compile`` of
the unfused chain (norm rounded to BF16, then the group quantization; M dynamic, H static: one
graph per width, as a serving engine compiles) and the SM copy of the same bytes, timed in the
same run; CUDA-graph replays, median µs.

Every case is checked first, bitwise: the standalone op against the reference; each fused op
against the reference quantization of moefuse's own norm output and against moefuse's unfused
chain (the norm kernel, then the standalone quantizer).

Bytes per element: 2 read + 1 code + 4/128 scale (rmsnorm_group_quant the same, the weight is
negligible); fused_add_rmsnorm_group_quant 4 read + 2 (residual) + 1 + 4/128 written.

Bars (printed PASS / FAIL, kept in meta.bars): fused ops >= 1.3 x compile at M <= 2048 and
>= 1.0 x at 16384, and >= 0.85 x the copy ceiling at M >= 2048; the standalone op >= 0.9 x the
copy ceiling at M >= 2048. The ceiling fraction is read from the rotating-output timing
(every output a DRAM write), the compile ratio from fixed outputs (compile's own policy).
"""

from __future__ import annotations

import torch

import moefuse
from moefuse.bench import harness
from moefuse.quant import reference as ref

OPS = ("per_token_group_quant_8bit", "rmsnorm_group_quant", "fused_add_rmsnorm_group_quant")
TOKENS = [1, 16, 128, 2048, 16384]
WIDTHS = [2048, 2880, 4096, 7168]
GS = 128
DEV = "cuda"
E4M3 = torch.float8_e4m3fn
BYTES_PER_ELEM = {
    "per_token_group_quant_8bit": 3.0 + 4 / GS,
    "rmsnorm_group_quant": 3.0 + 4 / GS,
    "fused_add_rmsnorm_group_quant": 7.0 + 4 / GS,
}


# ----------------------------------------------------------------------------- PyTorch chain
def torch_group_quant(v32):
    """Group-of-128 E4M3 of an FP32 [M, H] tensor (last group zero-padded): (q, s [M, G])."""
    m, h = v32.shape
    g = -(-h // GS)
    vp = torch.nn.functional.pad(v32, (0, g * GS - h)).reshape(m, g, GS)
    s = vp.abs().amax(-1, keepdim=True).clamp_min(1e-10) / 448.0
    q = (vp / s).clamp(-448.0, 448.0).to(E4M3).reshape(m, g * GS)[:, :h]
    return q, s.squeeze(-1)


def _norm(h32, w, eps=1e-6):
    return h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def torch_per_token_group(x):
    return torch_group_quant(x.float())


def torch_rmsnorm_group(x, w):
    return torch_group_quant(_norm(x.float(), w).to(x.dtype).float())


def torch_fused_add_rmsnorm_group(x, r, w):
    h = x.float() + r.float()
    return torch_group_quant(_norm(h, w).to(x.dtype).float()), h.to(r.dtype)


TORCH_FNS = {
    "per_token_group_quant_8bit": torch_per_token_group,
    "rmsnorm_group_quant": torch_rmsnorm_group,
    "fused_add_rmsnorm_group_quant": torch_fused_add_rmsnorm_group,
}


def _compiled(fn):
    """``torch.compile`` of ``fn`` with the width static (``mark_static`` on every input's last
    dim) and the token count dynamic from its second value (dynamo's automatic dynamic shapes):
    a graph for M = 1 and one for every other M, per width, as a serving engine compiles."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 512)
    compiled = torch.compile(fn)

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor):
                torch._dynamo.mark_static(a, a.dim() - 1)
        return compiled(*args)

    return call


# ----------------------------------------------------------------------------- cases
def _outs(m, h):
    return torch.empty(m, h, dtype=E4M3, device=DEV), torch.empty(
        m, -(-h // GS), dtype=torch.float32, device=DEV
    )


def _sets(op, m, h, n):
    sets = []
    for _ in range(n):
        x = torch.randn(m, h, device=DEV).to(torch.bfloat16)
        r = torch.randn(m, h, device=DEV).to(torch.bfloat16) if "add" in op else None
        sets.append((x, r, *_outs(m, h)))
    return sets


def _moefuse(op, w, pdl=True):
    kw = dict(enable_pdl=pdl, impl="triton")
    if op == "per_token_group_quant_8bit":
        return lambda s: moefuse.per_token_group_quant_8bit(
            s[0], GS, out=s[2], scale_out=s[3], **kw
        )
    if op == "rmsnorm_group_quant":
        return lambda s: moefuse.rmsnorm_group_quant(s[0], w, out=s[2], scale_out=s[3], **kw)
    return lambda s: moefuse.fused_add_rmsnorm_group_quant(
        s[0], s[1], w, out=s[2], scale_out=s[3], **kw
    )


def _unfused(op, w):
    """moefuse's two-kernel chain (norm kernel, then the standalone quantizer)."""
    q = moefuse.per_token_group_quant_8bit
    if op == "rmsnorm_group_quant":
        return lambda s: q(
            moefuse.rmsnorm(s[0], w, impl="triton"), GS, out=s[2], scale_out=s[3], impl="triton"
        )
    if op == "fused_add_rmsnorm_group_quant":

        def chain(s):
            moefuse.fused_add_rmsnorm(s[0], s[1], w, impl="triton")
            return q(s[0], GS, out=s[2], scale_out=s[3], impl="triton")

        return chain
    return None


def _torch_call(op, fn, w):
    if op == "per_token_group_quant_8bit":
        return lambda s: fn(s[0])
    if op == "rmsnorm_group_quant":
        return lambda s: fn(s[0], w)
    return lambda s: fn(s[0], s[1], w)


def _same(a, b) -> bool:
    a = a.view(torch.uint8) if a.dtype.itemsize == 1 else a
    b = b.view(torch.uint8) if b.dtype.itemsize == 1 else b
    return torch.equal(a, b)


def check_case(op, x, r, w) -> None:
    """Bitwise: the op against the reference quantization (of moefuse's own norm output for the
    fused ops) and, for the fused ops, against moefuse's unfused chain."""
    if op == "per_token_group_quant_8bit":
        q, s = moefuse.per_token_group_quant_8bit(x, GS, impl="triton")
        eq, es = ref.per_token_group_quant_8bit_reference(x, GS)
        assert _same(q, eq) and _same(s, es), f"{op}: kernel != reference"
        return
    if r is None:
        q, s = moefuse.rmsnorm_group_quant(x, w, impl="triton")
        y = moefuse.rmsnorm(x, w, impl="triton")
    else:
        rk, ru = r.clone(), r.clone()
        q, s = moefuse.fused_add_rmsnorm_group_quant(x, rk, w, impl="triton")
        y = x.clone()
        moefuse.fused_add_rmsnorm(y, ru, w, impl="triton")
        assert _same(rk, ru), f"{op}: residual != fused_add_rmsnorm's"
    uq, us = moefuse.per_token_group_quant_8bit(y, GS, impl="triton")
    assert _same(q, uq) and _same(s, us), f"{op}: fused != unfused chain"
    eq, es = ref.per_token_group_quant_8bit_reference(y, GS)
    assert _same(q, eq) and _same(s, es), f"{op}: != reference quantization of the norm"


def _time(fn, sets) -> float:
    n = len(sets)
    return harness.graph_time_us(lambda i: fn(sets[i % n]), calls=max(20, n))


def case_times(op, m, h, w, compiled) -> tuple[int, dict]:
    nbytes = int(BYTES_PER_ELEM[op] * m * h)
    sets = _sets(op, m, h, harness.rotation_sets(nbytes))
    check_case(op, sets[0][0], sets[0][1], w)
    fixed = _outs(m, h)
    fixed_sets = [(x, r, *fixed) for x, r, *_ in sets]
    times = {"moefuse": _time(_moefuse(op, w), fixed_sets)}
    unfused = _unfused(op, w)
    if unfused is not None:
        times["moefuse_unfused"] = _time(unfused, fixed_sets)
    times["moefuse_rot_out"] = _time(_moefuse(op, w), sets)
    times["compile"] = _time(_torch_call(op, compiled, w), sets)
    times["sm_copy"] = harness.copy_time_us(nbytes)
    return nbytes, times


def verdict(op, m, h, frac, x_comp, x_copy) -> dict:
    """The issue's bars for one case (None where no bar applies)."""
    checks = []
    if op != "per_token_group_quant_8bit":
        checks.append(x_comp >= (1.3 if m <= 2048 else 1.0))
        if m >= 2048:
            checks.append(frac >= 0.85)
    elif m >= 2048:
        checks.append(frac >= 0.9)
    return {
        "op": op,
        "H": h,
        "M": m,
        "frac_ceiling": frac,
        "x_compile": x_comp,
        "x_copy_same_bytes": x_copy,
        "pass": all(checks) if checks else None,
    }


def run(ops, widths, tokens, ceiling) -> tuple[list[dict], list[dict]]:
    """``(rows, verdicts)`` of the group ops."""
    rows, verdicts = [], []
    for op in ops:
        compiled = _compiled(TORCH_FNS[op])
        for h in widths:
            w = torch.randn(h, device=DEV).to(torch.bfloat16)
            for m in tokens:
                nbytes, times = case_times(op, m, h, w, compiled)
                for name, us in times.items():
                    tbs = nbytes / (us * 1e-6) / 1e12
                    rows.append(
                        {
                            "op": op,
                            "shape": f"H={h}",
                            "M": m,
                            "variant": name,
                            "us": us,
                            "tbs": tbs,
                            "frac_ceiling": tbs / ceiling,
                            "x_compile": times["compile"] / us,
                            "x_copy_same_bytes": times["sm_copy"] / us,
                        }
                    )
                frac = nbytes / (times["moefuse_rot_out"] * 1e-6) / 1e12 / ceiling
                x_comp = times["compile"] / times["moefuse"]
                x_copy = times["sm_copy"] / times["moefuse_rot_out"]
                verdicts.append(verdict(op, m, h, frac, x_comp, x_copy))
                print(
                    f"{op:30s} H={h:5d} M={m:6d} "
                    + "  ".join(f"{k}={v:8.2f}us" for k, v in times.items())
                    + f"  | {frac:.2f} x ceiling, {x_comp:.2f} x compile, "
                    f"{x_copy:.2f} x same-bytes copy"
                )
    return rows, verdicts


def print_bars(verdicts: list[dict]) -> None:
    print(
        "\nbars (fused: >= 1.3 x compile at M <= 2048, >= 1.0 x at 16384, >= 0.85 x ceiling at "
        "M >= 2048; per_token_group_quant_8bit: >= 0.9 x ceiling at M >= 2048):"
    )
    for v in verdicts:
        if v["pass"] is None:
            continue
        print(
            f"  BAR {'PASS' if v['pass'] else 'FAIL'} {v['op']:30s} H={v['H']:5d} M={v['M']:6d} "
            f"{v['frac_ceiling']:.2f} x ceiling  {v['x_compile']:.2f} x compile  "
            f"{v['x_copy_same_bytes']:.2f} x same-bytes copy"
        )
