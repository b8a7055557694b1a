"""Dump what torch.compile generates (and the autotuned configs it picks) for the benchmark's
gated_residual / gated_residual_next math at H = 8192, M in {512, 16384}: the kernels, their
launch configs and times, to understand where our one-pass kernels lose to it.

Run: PYTHONPATH=src python3 scripts/dump_compile_gated.py > log
"""

import logging

import torch

from moefuse.bench import harness
from moefuse.bench import norm as bn

logging.basicConfig(level=logging.WARNING)
logging.getLogger("torch._inductor.runtime.triton_heuristics").setLevel(logging.DEBUG)
torch._logging.set_logs(output_code=True)

for op in ("gated_residual_rmsnorm", "gated_residual_next_rmsnorm"):
    for m in (512, 16384):
        case, _ = bn._make_case(op, m, 8192, None)
        n = len(case.sets)
        comp = bn._variants(op, {})["compile"]
        us = harness.graph_time_us(lambda i: comp(case.sets[i % n]), calls=max(20, n))
        print(f"RESULT {op} M={m} compile {us:.2f} us", flush=True)
