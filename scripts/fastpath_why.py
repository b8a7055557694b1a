"""Print, per single-GPU op of ``bench overhead``, whether eager calls replay a launch plan and,
if not, why (moefuse._fastpath.refusals).   PYTHONPATH=src python scripts/fastpath_why.py"""

import torch

import moefuse
from moefuse import _fastpath as fp
from moefuse.bench.overhead import single_gpu_cases

dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
for op, impl, fn in single_gpu_cases(dev):
    if impl != "moefuse":
        continue
    fn()
    fn()
    public = getattr(moefuse, op.split("(")[0])
    print(f"{op:32s} plans={fp.plan_count(public)} refused={fp.refusals(public)}")
