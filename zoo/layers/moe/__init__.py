"""Mixture of experts in parts: `router` (which experts, what weights, the balance loss), `backend` (which grouped
matmul runs the experts), `dispatch` (token copies sorted by expert; capacity dispatch), `expert_parallel`
(dropless expert parallelism over a ragged all-to-all), `experts` (the routed SwiGLU experts), `layer` (`MoE`,
composing them with an optional shared expert, and its typed aux record `MoEAux`)."""
from zoo.layers.moe.backend import (
    BACKENDS,
    EP_DISPATCHES,
    GROUPED_MATMULS,
    Backend,
    backend_choice,
    resolve_backend,
    tokamax_available,
    tokamax_status,
)
from zoo.layers.moe.dispatch import capacity
from zoo.layers.moe.experts import Experts
from zoo.layers.moe.layer import (
    MoE,
    MoEAux,
    drops,
    moe_records,
    routing_bias_delta,
    total_balance_loss,
    update_routing_bias,
)
from zoo.layers.moe.router import (
    GroupLimitedRouter,
    Router,
    RoutingBias,
    SoftmaxRouter,
    check_routing,
    route,
    sequence_balance_loss,
    switch_balance_loss,
)

__all__ = ["BACKENDS", "EP_DISPATCHES", "GROUPED_MATMULS", "Backend", "backend_choice", "capacity", "resolve_backend",
           "tokamax_available", "tokamax_status", "Experts", "MoE", "MoEAux", "drops", "moe_records",
           "routing_bias_delta", "total_balance_loss", "update_routing_bias", "GroupLimitedRouter", "Router",
           "RoutingBias", "SoftmaxRouter", "check_routing", "route", "sequence_balance_loss", "switch_balance_loss"]
