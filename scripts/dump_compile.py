"""Dump what torch.compile generates (and the autotuned configs it picks) for benchmark cases, to
see where our kernels lose to it: the kernels, their launch configs and times.

Run: PYTHONPATH=src python3 scripts/dump_compile_gated.py [op:H:M[:head_dim] ...] > log
(default: the gated ops at H = 8192, M in {512, 16384})
"""

import logging
import sys

import torch

from moefuse.bench import harness
from moefuse.bench import norm as bn

logging.basicConfig(level=logging.WARNING)
logging.getLogger("torch._inductor.runtime.triton_heuristics").setLevel(logging.DEBUG)
torch._logging.set_logs(output_code=True)

DEFAULT = [f"{op}:8192:{m}" for op in ("gated_residual_rmsnorm", "gated_residual_next_rmsnorm")
           for m in (512, 16384)]  # fmt: skip

for spec in sys.argv[1:] or DEFAULT:
    op, h, m, *hd = spec.split(":")
    case, _ = bn._make_case(op, int(m), int(h), int(hd[0]) if hd else None)
    n = len(case.sets)
    comp = bn._variants(op, {})["compile"]
    us = harness.graph_time_us(lambda i: comp(case.sets[i % n]), calls=max(20, n))
    print(f"RESULT {spec} compile {us:.2f} us", flush=True)
