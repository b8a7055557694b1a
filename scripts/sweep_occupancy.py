"""Experiment: what limits the row kernels at H = 4096 on the H200 (registers, rows in flight,
kernel length)? Times, in one run:

* the SM copy at the byte counts of the M = 2048 / 16384 cases (not only at 1 GiB), rotated over
  input sets like every benchmark, to show what a kernel of that length can reach;
* rmsnorm, rmsnorm_quant (FP8), fused_add_rmsnorm_quant and rmsnorm_fp4_quantize under register
  caps (``maxnreg``), warps and rows per program;
* a prototype persistent FP8 rmsnorm whose programs prefetch their next row before reducing the
  current one (more bytes in flight per SM without more registers per row).

Run on the GPU: PYTHONPATH=src python3 scripts/sweep_occupancy.py
"""

import torch
import triton
import triton.language as tl

import moefuse
from moefuse.bench import harness
from moefuse.norm import triton as nt
from moefuse.norm.tiles import RowTile
from moefuse.quant import fused as qf

BF = torch.bfloat16
H = 4096
EPS = 1e-6


@triton.jit
def _persistent_fp8(x_ptr, w_ptr, scale_ptr, q_ptr, n_rows, Hf, eps,
                    BLOCK: tl.constexpr, PREFETCH: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    w = tl.load(w_ptr + cols).to(tl.float32)
    inv = tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))
    row = pid
    nxt = tl.load(x_ptr + row.to(tl.int64) * BLOCK + cols, mask=(cols < BLOCK) & (row < n_rows),
                  other=0.0)  # fmt: skip
    while row < n_rows:
        cur = nxt.to(tl.float32)
        if PREFETCH:
            nrow = row + nprog
            nxt = tl.load(x_ptr + nrow.to(tl.int64) * BLOCK + cols,
                          mask=(cols < BLOCK) & (nrow < n_rows), other=0.0)  # fmt: skip
        r = nt._inv_rms(tl.sum(cur * cur, axis=0), Hf, eps)
        q = ((cur * r) * w) * inv
        q = tl.where((q.to(tl.uint32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000, 0x7F,
                     q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)).to(tl.uint8)  # fmt: skip
        tl.store(q_ptr + row.to(tl.int64) * BLOCK + cols, q)
        row += nprog
        if not PREFETCH:
            nxt = tl.load(x_ptr + row.to(tl.int64) * BLOCK + cols,
                          mask=(cols < BLOCK) & (row < n_rows), other=0.0)  # fmt: skip


def _copy_at(nbytes: int) -> tuple[float, float]:
    """(TB/s, us) of the best SM copy over ``nbytes`` (read + written), as benchmarked."""
    us = harness.copy_time_us(nbytes)
    return nbytes / (us * 1e-6) / 1e12, us


def _with_maxnreg(maxnreg):
    """Patch the launch kwargs of the norm and fused-quant launchers to add ``maxnreg``."""

    def kwargs(use_pdl: bool) -> dict:
        out = {"launch_pdl": True} if use_pdl else {}
        if maxnreg:
            out["maxnreg"] = maxnreg
        return out

    nt._pdl_kwargs = kwargs
    qf._pdl_kwargs = kwargs


def _sets(m, n):
    return [(torch.randn(m, H, device="cuda").to(BF), torch.randn(m, H, device="cuda").to(BF),
             torch.empty(m, H, device="cuda", dtype=torch.uint8),
             torch.empty(m, H // 2, device="cuda", dtype=torch.uint8),
             torch.empty(moefuse.scale_shape(m, H), device="cuda", dtype=torch.uint8))
            for _ in range(n)]  # fmt: skip


def main() -> None:
    print(f"ceiling 1 GiB copy {harness.copy_ceiling_tbs():.3f} TB/s", flush=True)
    for m in (2048, 16384):
        for bpe in (3, 4, 7):
            tbs, us = _copy_at(bpe * m * H)
            print(f"copy M={m} bytes/elem={bpe}: {us:8.2f} us {tbs:.3f} TB/s", flush=True)
    w = torch.randn(H, device="cuda").to(BF)
    scale, gs = torch.tensor([0.02], device="cuda"), torch.tensor([300.0], device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m in (2048, 16384):
        sets = _sets(m, harness.rotation_sets(4 * m * H))
        n = len(sets)
        ops = {
            "rmsnorm": (4, lambda i, t: nt.launch_rmsnorm(sets[i % n][0], w, sets[i % n][1], EPS,
                                                            0.0, True) if t is None else None),
            "rms_fp8": (3, lambda i, t: qf.launch_rmsnorm_fp8(
                sets[i % n][0], None, w, scale, sets[i % n][2], 0, EPS, 0.0, True, tile=t)),
            "add_fp8": (7, lambda i, t: qf.launch_rmsnorm_fp8(
                sets[i % n][0], sets[i % n][1], w, scale, sets[i % n][2], 0, EPS, 0.0, True,
                tile=t)),
            "rms_fp4": (2.5625, lambda i, t: qf.launch_rmsnorm_fp4(
                sets[i % n][0], None, w, gs, sets[i % n][3], sets[i % n][4], None, EPS, 0.0,
                "swizzled_128x4", "fast", True, tile=t)),
        }  # fmt: skip
        for name, (bpe, fn) in ops.items():
            line = f"{name} M={m:6d}"
            base = qf.quant_row_tile(H)
            variants = [("default", None, None)]
            variants += [(f"reg{r}", None, r) for r in (32, 40, 48, 64)]
            if name != "rmsnorm":
                variants += [(f"r{rows}w{wp}", RowTile(base.block, 1, rows, wp), None)
                             for rows, wp in ((1, 4), (1, 16), (2, 8), (2, 16), (4, 16))]
            for tag, tile, reg in variants:
                _with_maxnreg(reg)
                us = harness.graph_time_us(lambda i: fn(i, tile), calls=max(20, n))
                line += f" | {tag} {us:7.2f}us {bpe * m * H / us / 1e6:.2f}"
            _with_maxnreg(None)
            print(line, flush=True)
        # persistent prototype (FP8, H = 4096 only; check against the library kernel first)
        x0, q_ref, q_new = sets[0][0], sets[0][2], torch.empty_like(sets[0][2])
        qf.launch_rmsnorm_fp8(x0, None, w, scale, q_ref, 0, EPS, 0.0, False)
        line = f"persist_fp8 M={m:6d}"
        for pre in (True, False):
            for per_sm in (4, 6, 8, 12):
                for wp in (4, 8):
                    grid = (min(m, per_sm * sms),)
                    _persistent_fp8[grid](x0, w, scale, q_new, m, float(H), EPS, BLOCK=H,
                                          PREFETCH=pre, num_warps=wp)  # fmt: skip
                    diff = (q_new.view(torch.int16 if False else torch.uint8).int()
                            - q_ref.int()).abs().max().item()  # fmt: skip
                    us = harness.graph_time_us(
                        lambda i: _persistent_fp8[grid](
                            sets[i % n][0], w, scale, sets[i % n][2], m, float(H), EPS, BLOCK=H,
                            PREFETCH=pre, num_warps=wp), calls=max(20, n))  # fmt: skip
                    line += (f" | {'P' if pre else 'N'}{per_sm}w{wp} {us:7.2f}us "
                             f"{3 * m * H / us / 1e6:.2f} d{diff}")
        print(line, flush=True)
    for kernel in (nt._rmsnorm_kernel, qf._rmsnorm_fp8_kernel, qf._rmsnorm_fp4_kernel,
                   _persistent_fp8):  # fmt: skip
        for cache in kernel.device_caches.values():
            for ck in cache[0].values():
                md = ck.metadata
                print(kernel.fn.__name__ if hasattr(kernel, "fn") else kernel, "warps",
                      md.num_warps, "maxnreg", getattr(md, "maxnreg", None), "regs", ck.n_regs,
                      "spills", ck.n_spills)



if __name__ == "__main__":
    main()
