"""Host µs per eager call of the group ops: whole call, and with the C launcher replaced by a no-op
(the plan's Python part). Median of 15 repeats of 2000 calls."""
import statistics, time, torch, moefuse, json, os
import torch.nn.functional as F
dev = "cuda"
x = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
w = torch.randn(4096, dtype=torch.bfloat16, device=dev)
r = torch.randn(1, 4096, dtype=torch.bfloat16, device=dev)
ops = {
    "F.rms_norm": lambda: F.rms_norm(x, (4096,), w, 1e-6),
    "rmsnorm": lambda: moefuse.rmsnorm(x, w),
    "fused_add_rmsnorm": lambda: moefuse.fused_add_rmsnorm(x, r, w),
    "per_token_group_quant_8bit": lambda: moefuse.per_token_group_quant_8bit(x, 128),
    "rmsnorm_group_quant": lambda: moefuse.rmsnorm_group_quant(x, w),
    "fused_add_rmsnorm_group_quant": lambda: moefuse.fused_add_rmsnorm_group_quant(x, r, w),
    "empty_like": lambda: torch.empty_like(x),
    "empty_like2": lambda: (torch.empty_like(x), torch.empty_like(x)),
}
def bench(f, n=2000, reps=15):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(n): f()
        t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
        out.append(((t1 - t) / n * 1e6, (t2 - t) / n * 1e6))
    return statistics.median(a for a, _ in out), statistics.median(b for _, b in out)
res = {}
for name, f in ops.items():
    for _ in range(50): f()
    res[name] = {"host_us": bench(f)}
# the plans' launchers replaced by a no-op
for name in ("rmsnorm", "fused_add_rmsnorm", "per_token_group_quant_8bit", "rmsnorm_group_quant", "fused_add_rmsnorm_group_quant"):
    fn = getattr(moefuse, name)
    plans = [p for ps in fn._moefuse_plans.values() for p in ps if hasattr(p, "source")]
    if not plans: res[name]["noplan"] = True; continue
    p = plans[0]; env = p.__globals__
    launchers = [k for k, v in env.items() if k.startswith("_c") and getattr(v, "__name__", "") == "launch"]
    saved = {k: env[k] for k in launchers}
    for k in launchers: env[k] = lambda *a: None
    res[name]["no_launch_us"] = bench(ops[name])
    res[name]["n_launch_args"] = [p.source.count(",")]
    for k in launchers: env[k] = saved[k]
    res[name]["source"] = p.source
print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "source"} for k, v in res.items()}, indent=1))
json.dump(res, open(os.environ.get("OUT", ".") + "/hostprobe.json", "w"), indent=1)
