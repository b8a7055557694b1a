"""The MoE finalize family (SPEC §2): the deterministic finalize, its scatter-add baseline, the
routing helpers that build a finalize's inputs, and a whole-layer pipeline for benchmarks."""

from moefuse.moe.api import (
    moe_finalize,
    moe_finalize_scatter_add,
    moe_permute,
    supports_moe_finalize,
    supports_moe_finalize_scatter_add,
    supports_moe_permute,
)
from moefuse.moe.layer import MoEWeights, moe_layer
from moefuse.moe.routing import RoutingPlan, route_topk, sort_by_expert

__all__ = [
    "moe_finalize",
    "supports_moe_finalize",
    "moe_finalize_scatter_add",
    "supports_moe_finalize_scatter_add",
    "moe_permute",
    "supports_moe_permute",
    "route_topk",
    "sort_by_expert",
    "RoutingPlan",
    "MoEWeights",
    "moe_layer",
]
