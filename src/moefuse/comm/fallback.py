"""The torch.distributed path: for groups that span hosts or lack peer access, for M beyond the
peer buffers, and as the third algorithm the tests compare bit for bit.

NCCL's ``all_reduce`` sums in an order of its own choosing (ring/tree, channel split), so its bits
differ from the peer algorithms'. This path therefore all-gathers the partials (exact: no
arithmetic) and sums them locally in ascending rank order from +0.0 inside the same epilogue
kernel the peer algorithms use (``moefuse.comm.all_reduce.kernels._gathered_kernel``) —
identical bits, at the cost of moving (P-1)/P more data than a reduce-scatter based all-reduce for
P > 2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moefuse._fastpath import note_impure


def gather_stacked(input: torch.Tensor, workspace) -> torch.Tensor:
    """All-gather ``input`` [M, H] of every rank into a new contiguous ``[P, M, H]`` tensor."""
    x = input.contiguous()
    p = workspace.world_size
    out = torch.empty((p, *x.shape), dtype=x.dtype, device=x.device)
    backend = str(dist.get_backend(workspace.group)).lower()
    note_impure("a torch.distributed all-gather")
    if x.is_cuda and "nccl" in backend:
        dist.all_gather_into_tensor(out, x, group=workspace.group)
    else:
        dist.all_gather(list(out.unbind(0)), x, group=workspace.group)
    return out


def gather_partials(input: torch.Tensor, workspace) -> list[torch.Tensor]:
    """Every rank's ``input`` in rank order, via ``torch.distributed.all_gather``."""
    x = input.contiguous()
    parts = [torch.empty_like(x) for _ in range(workspace.world_size)]
    dist.all_gather(parts, x, group=workspace.group)
    return parts
