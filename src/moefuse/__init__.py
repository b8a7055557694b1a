"""moefuse: fused, deterministic Triton kernels for the epilogue of MoE layers.

Every op has a PyTorch reference (``impl="reference"``) that defines its meaning and runs on CPU,
a Triton kernel for SM90+ GPUs, and a ``supports_*`` helper. See DESIGN.md and docs/spec.md.
"""

from moefuse import comm, moe, norm, quant
from moefuse.comm import *  # noqa: F401,F403
from moefuse.moe import *  # noqa: F401,F403
from moefuse.norm import *  # noqa: F401,F403
from moefuse.quant import *  # noqa: F401,F403

__version__ = "0.1.0"
__all__ = [*norm.__all__, *moe.__all__, *quant.__all__, *comm.__all__]
