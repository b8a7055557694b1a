"""FlashInfer-compatible names and call styles, mapped onto moefuse's ops.

``from moefuse.compat import flashinfer as fi`` then ``fi.fused_add_rmsnorm(...)``,
``fi.moe_unpermute(...)``, ``fi.fp4_quantize(...)``, ``fi.trtllm_allreduce_fusion(...)`` (the
pattern-style all-reduce call) and so on. Each family keeps its own mapping module
(``compat/_<family>.py``); this module gathers them.
"""

from moefuse.compat._norm import *  # noqa: F401,F403
from moefuse.compat._norm import __all__ as _norm_all

__all__ = list(_norm_all)

try:  # each family's mapping is optional while that family is being built
    from moefuse.compat._moe import moe_unpermute  # noqa: F401

    __all__.append("moe_unpermute")
except ImportError:  # pragma: no cover
    pass
try:
    from moefuse.compat._quant import *  # noqa: F401,F403
    from moefuse.compat._quant import __all__ as _quant_all

    __all__ += [n for n in _quant_all if n not in __all__]
except ImportError:  # pragma: no cover
    pass
try:
    from moefuse.compat._comm import *  # noqa: F401,F403
    from moefuse.compat._comm import __all__ as _comm_all

    __all__ += [n for n in _comm_all if n not in __all__]
except ImportError:  # pragma: no cover
    pass
try:
    from moefuse.compat._allgather import *  # noqa: F401,F403
    from moefuse.compat._allgather import __all__ as _allgather_all

    __all__ += [n for n in _allgather_all if n not in __all__]
except ImportError:  # pragma: no cover
    pass
try:
    from moefuse.compat._expert_norm import *  # noqa: F401,F403
    from moefuse.compat._expert_norm import __all__ as _expert_norm_all

    __all__ += [n for n in _expert_norm_all if n not in __all__]
except ImportError:  # pragma: no cover
    pass
try:  # MoE all-reduce fusions (spec: MoE-reduction ops)
    from moefuse.compat._moe_reduction import *  # noqa: F401,F403
    from moefuse.compat._moe_reduction import __all__ as _moe_reduction_all

    __all__ += [n for n in _moe_reduction_all if n not in __all__]
except ImportError:  # pragma: no cover
    pass
