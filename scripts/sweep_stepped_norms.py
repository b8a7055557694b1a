"""H200 experiment (2026-11-30): stepped rows for rmsnorm and fused_add_rmsnorm with the one-pass
tile's thread layout (8 warps x 8 columns = 16-byte vectors per step).

Why: at M = 16384 torch.compile's looped two-pass kernel beats the one-pass tile by 3-5 %, also
when it writes in place (scripts/probe_inplace.py). The earlier stepped try
(sweep-fused-add-stepped-v8) used 16 warps per row, which lost 10-20 % at M = 1. Stepped rows
with the tile's own warps may keep the small-M speed (unrolled: the row in registers) and get
compile's large-M speed (looped: two passes, the second from L2) with the SAME bits in both modes.

1. Bitwise: unrolled == looped for every variant, H in {2880, 4096, 8192}, M in {1, 7, 300}; both
   against the reference (residual bitwise, normed within tolerance).
2. CUDA-graph replay times (inputs rotated over sets > L2, PDL on): the one-pass tile (main),
   each variant unrolled and looped, torch.compile (pool outputs) and, for fused_add, torch.compile
   written back in place.

Run: PYTHONPATH=src python3 scripts/sweep_stepped_norms.py
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

import moefuse
from moefuse.bench import harness
from moefuse.bench.norm import torch_fused_add_rmsnorm, torch_rmsnorm
from moefuse.norm import reference as ref
from moefuse.norm.gated import _ldp, _param, _step_cols
from moefuse.norm.triton import _inv_rms, _st
from moefuse.testing import assert_close

DEV, BF, EPS = "cuda", torch.bfloat16, 1e-6
VARIANTS = ((8, 8), (16, 8), (4, 8))  # (warps, columns per thread per step)


@triton.jit
def _fa_stepped_kernel(x_ptr, res_ptr, w_ptr, H, Hf, x_st, r_st, eps, gc,
                       STEP: tl.constexpr, STEPS: tl.constexpr, UNROLL: tl.constexpr,
                       MASKED: tl.constexpr, USE_PDL: tl.constexpr,
                       POLICY: tl.constexpr, EARLY_RES: tl.constexpr = False):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = row * x_st
    r_row = row * r_st
    acc = tl.zeros([1, STEP], dtype=tl.float32)
    if UNROLL:
        ws = ()
        for k in tl.static_range(STEPS):
            cols, cm = _step_cols(k, H, STEP)
            ws = ws + (_param(w_ptr, cols, cm, gc, MASKED, True),)
        if USE_PDL:
            gdc_wait()
        hs = ()
        for k in tl.static_range(STEPS):
            cols, cm = _step_cols(k, H, STEP)
            h = _ldp(x_ptr + x_row + cols, cm, MASKED, POLICY)
            h += _ldp(res_ptr + r_row + cols, cm, MASKED, POLICY)
            hs = hs + (h,)
        if USE_PDL:
            gdc_launch_dependents()
        if EARLY_RES:
            for k in tl.static_range(STEPS):
                cols, cm = _step_cols(k, H, STEP)
                _st(res_ptr + r_row + cols, hs[k], cm, MASKED, True)
        for k in tl.static_range(STEPS):
            acc = tl.fma(hs[k], hs[k], acc)
        r = _inv_rms(tl.sum(acc, axis=1)[:, None], Hf, eps)
        for k in tl.static_range(STEPS):
            cols, cm = _step_cols(k, H, STEP)
            if not EARLY_RES:
                _st(res_ptr + r_row + cols, hs[k], cm, MASKED, True)
            _st(x_ptr + x_row + cols, (hs[k] * r) * ws[k], cm, MASKED, True)
    else:
        if USE_PDL:
            gdc_wait()
        for k in tl.range(0, STEPS):
            cols, cm = _step_cols(k, H, STEP)
            h = _ldp(x_ptr + x_row + cols, cm, MASKED, "evict_last")
            h += _ldp(res_ptr + r_row + cols, cm, MASKED, "evict_last")
            acc = tl.fma(h, h, acc)
        r = _inv_rms(tl.sum(acc, axis=1)[:, None], Hf, eps)
        for k in tl.range(0, STEPS):
            cols, cm = _step_cols(k, H, STEP)
            h = _ldp(x_ptr + x_row + cols, cm, MASKED, "evict_first")
            h += _ldp(res_ptr + r_row + cols, cm, MASKED, "evict_first")
            w = _param(w_ptr, cols, cm, gc, MASKED, True)
            _st(res_ptr + r_row + cols, h, cm, MASKED, True)
            _st(x_ptr + x_row + cols, (h * r) * w, cm, MASKED, True)
        if USE_PDL:
            gdc_launch_dependents()


@triton.jit
def _rms_stepped_kernel(x_ptr, w_ptr, out_ptr, H, Hf, x_st, o_st, eps, gc,
                        STEP: tl.constexpr, STEPS: tl.constexpr, UNROLL: tl.constexpr,
                        MASKED: tl.constexpr, USE_PDL: tl.constexpr,
                        POLICY: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = row * x_st
    o_row = row * o_st
    acc = tl.zeros([1, STEP], dtype=tl.float32)
    if UNROLL:
        ws = ()
        for k in tl.static_range(STEPS):
            cols, cm = _step_cols(k, H, STEP)
            ws = ws + (_param(w_ptr, cols, cm, gc, MASKED, True),)
        if USE_PDL:
            gdc_wait()
        xs = ()
        for k in tl.static_range(STEPS):
            cols, cm = _step_cols(k, H, STEP)
            xs = xs + (_ldp(x_ptr + x_row + cols, cm, MASKED, POLICY),)
        if USE_PDL:
            gdc_launch_dependents()
        for k in tl.static_range(STEPS):
            acc = tl.fma(xs[k], xs[k], acc)
        r = _inv_rms(tl.sum(acc, axis=1)[:, None], Hf, eps)
        for k in tl.static_range(STEPS):
            cols, cm = _step_cols(k, H, STEP)
            _st(out_ptr + o_row + cols, (xs[k] * r) * ws[k], cm, MASKED, True)
    else:
        if USE_PDL:
            gdc_wait()
        for k in tl.range(0, STEPS):
            cols, cm = _step_cols(k, H, STEP)
            x = _ldp(x_ptr + x_row + cols, cm, MASKED, "evict_last")
            acc = tl.fma(x, x, acc)
        r = _inv_rms(tl.sum(acc, axis=1)[:, None], Hf, eps)
        for k in tl.range(0, STEPS):
            cols, cm = _step_cols(k, H, STEP)
            x = _ldp(x_ptr + x_row + cols, cm, MASKED, "evict_first")
            w = _param(w_ptr, cols, cm, gc, MASKED, True)
            _st(out_ptr + o_row + cols, (x * r) * w, cm, MASKED, True)
        if USE_PDL:
            gdc_launch_dependents()


def _consts(h, warps, vec, unroll, pdl, policy="evict_first", **extra):
    step = 32 * warps * vec
    steps = -(-h // step)
    return dict(STEP=step, STEPS=steps, UNROLL=unroll, MASKED=h != step * steps, USE_PDL=pdl,
                POLICY=policy, **extra,
                num_warps=warps, **({"launch_pdl": True} if pdl else {}))


def fa_stepped(x, r, w, warps, vec, unroll, pdl=True, policy="evict_first", early=False):
    m, h = x.shape
    _fa_stepped_kernel[(m,)](x, r, w, h, float(h), x.stride(0), r.stride(0), EPS, 0.0,
                             **_consts(h, warps, vec, unroll, pdl, policy,
                                       EARLY_RES=early))  # fmt: skip


def rms_stepped(x, w, out, warps, vec, unroll, pdl=True, policy="evict_first"):
    m, h = x.shape
    _rms_stepped_kernel[(m,)](x, w, out, h, float(h), x.stride(0), out.stride(0), EPS, 0.0,
                              **_consts(h, warps, vec, unroll, pdl, policy))  # fmt: skip


def _fits(h, warps, vec):
    return -(-h // (32 * warps * vec)) <= 4


def check() -> int:
    bad = 0
    for h in (2880, 4096, 8192):
        for m in (1, 7, 300):
            x, r, w = (torch.randn(m, h, device=DEV).to(BF), torch.randn(m, h, device=DEV).to(BF),
                       torch.randn(h, device=DEV).to(BF))  # fmt: skip
            normed, r_ref = ref.fused_add_rmsnorm_reference(x, r, w, EPS)
            rms_ref = ref.rmsnorm_reference(x, w, EPS)
            for warps, vec in VARIANTS:
                fa, rm = [], []
                for unroll in (True, False):
                    if unroll and not _fits(h, warps, vec):
                        continue
                    xi, ri = x.clone(), r.clone()
                    fa_stepped(xi, ri, w, warps, vec, unroll)
                    fa.append((xi, ri))
                    o = torch.full_like(x, float("nan"))
                    rms_stepped(x, w, o, warps, vec, unroll)
                    rm.append(o)
                torch.cuda.synchronize()
                same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                           for a, b in zip(fa[0], fa[-1])) and torch.equal(
                    rm[0].view(torch.int16), rm[-1].view(torch.int16))  # fmt: skip
                ok = torch.equal(fa[0][1], r_ref)
                try:
                    assert_close(fa[0][0], normed, "rsqrt_half", "fused_add normed")
                    assert_close(rm[0], rms_ref, "rsqrt_half", "rmsnorm")
                except AssertionError as e:
                    ok = False
                    print("  reference:", str(e)[:200])
                bad += not (same and ok)
                print(f"check H={h:5d} M={m:4d} {warps}w x {vec}: "
                      f"{'bitwise' if same else 'DIFFERENT'} ref {'ok' if ok else 'BAD'}",
                      flush=True)  # fmt: skip
    return bad


def time_sets(fn, sets):
    n = len(sets)
    return harness.graph_time_us(lambda i: fn(sets[i % n]), calls=max(20, n), replays=20)


def fa_inplace(x, r, w):
    normed, h = torch_fused_add_rmsnorm(x, r, w)
    x.copy_(normed)
    r.copy_(h)


#: (name, warps, vec, unroll, load policy of the unrolled mode, residual stored before the sum)
SWEEP = (("16x8u", 16, 8, True, "evict_first", False), ("16x8u_e", 16, 8, True, "", True),
         ("16x8u_fe", 16, 8, True, "evict_first", True), ("8x8u_e", 8, 8, True, "", True),
         ("16x8l", 16, 8, False, "evict_first", False))  # fmt: skip


def sweep(widths=(4096, 7168, 8192), ops=("fused_add",)) -> None:
    c_fa = harness.compile_baseline(torch_fused_add_rmsnorm)
    c_fa_in = harness.compile_baseline(fa_inplace)
    c_rms = harness.compile_baseline(torch_rmsnorm)
    for op in ops:
        for h in widths:
            w = torch.randn(h, device=DEV).to(BF)
            for m in (1, 16, 128, 1024, 2048, 4096, 16384):
                per = 8 if op == "fused_add" else 4
                k = harness.rotation_sets(per * m * h)
                t = {}
                if op == "fused_add":
                    sets = [(torch.randn(m, h, device=DEV).to(BF),
                             torch.randn(m, h, device=DEV).to(BF)) for _ in range(k)]  # fmt: skip
                    t["onepass"] = time_sets(
                        lambda s: moefuse.fused_add_rmsnorm(s[0], s[1], w, enable_pdl=True), sets)
                    for name, warps, vec, unroll, pol, early in SWEEP:
                        if unroll and not _fits(h, warps, vec):
                            continue
                        t[name] = time_sets(
                            lambda s, a=warps, b=vec, u=unroll, p=pol, e=early: fa_stepped(
                                s[0], s[1], w, a, b, u, policy=p, early=e), sets)
                    if m in (1, 128, 2048, 16384):
                        t["cmp"] = time_sets(lambda s: c_fa(s[0], s[1], w), sets)
                        t["cmp_in"] = time_sets(lambda s: c_fa_in(s[0], s[1], w), sets)
                else:
                    sets = [(torch.randn(m, h, device=DEV).to(BF),) for _ in range(k)]
                    out = torch.empty(m, h, device=DEV, dtype=BF)
                    t["onepass"] = time_sets(
                        lambda s: moefuse.rmsnorm(s[0], w, out=out, enable_pdl=True), sets)
                    for name, warps, vec, unroll, pol, _ in SWEEP:
                        if unroll and not _fits(h, warps, vec):
                            continue
                        t[name] = time_sets(
                            lambda s, a=warps, b=vec, u=unroll, p=pol: rms_stepped(
                                s[0], w, out, a, b, u, policy=p), sets)
                    if m in (1, 128, 2048, 16384):
                        t["cmp"] = time_sets(lambda s: c_rms(s[0], w), sets)
                print(f"{op:9s} H={h:5d} M={m:6d} " + " ".join(f"{n}={v:7.2f}" for n, v in
                                                              t.items()), flush=True)  # fmt: skip


if __name__ == "__main__":
    print(torch.cuda.get_device_name(0), flush=True)
    failures = check()
    sweep()
    print("check failures:", failures)
