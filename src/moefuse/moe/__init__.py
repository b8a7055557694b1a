"""The MoE family: the deterministic finalize (spec), its scatter-add baseline, the fused routed
experts (gate|up, activation, down and finalize at transformers' weight layouts), the fused
router top-k, the routing helpers that build a finalize's inputs, and a whole-layer pipeline for
benchmarks."""

from moefuse.moe.api import (
    moe_finalize,
    moe_finalize_scatter_add,
    moe_permute,
    supports_moe_finalize,
    supports_moe_finalize_scatter_add,
    supports_moe_permute,
)
from moefuse.moe.experts import moe_experts, supports_moe_experts
from moefuse.moe.layer import MoEWeights, moe_layer
from moefuse.moe.linear import fp8_linear, supports_fp8_linear
from moefuse.moe.router import router_topk, supports_router_topk
from moefuse.moe.routing import RoutingPlan, route_topk, sort_by_expert

__all__ = [
    "moe_finalize",
    "supports_moe_finalize",
    "moe_finalize_scatter_add",
    "supports_moe_finalize_scatter_add",
    "moe_permute",
    "supports_moe_permute",
    "moe_experts",
    "supports_moe_experts",
    "fp8_linear",
    "supports_fp8_linear",
    "router_topk",
    "supports_router_topk",
    "route_topk",
    "sort_by_expert",
    "RoutingPlan",
    "MoEWeights",
    "moe_layer",
]
