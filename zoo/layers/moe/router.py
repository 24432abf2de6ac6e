"""Routers: which k experts each token visits and with what weights (`Router`: `__call__(x [T, D]) -> (scores, weights
[T, k], indices [T, k])`, float32), and each router's balance loss, already weighted. `GroupLimitedRouter`
(arXiv:2412.19437, 2.1.2-2.1.3: sigmoid affinities, a `RoutingBias` used only to choose, group-limited top-k) and
`SoftmaxRouter` (softmax top-k; Switch Transformer's balance loss). Parameter names follow transformers.
"""
from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.linear import Stored, fan_in_init, logical


class RoutingBias(Stored):
    """The group-limited router's e_score_correction_bias: set by the load-balancing update, never by gradients."""


class Router(Protocol):
    num_experts: int
    k: int

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]: ...

    def balance_loss(self, scores: jax.Array, idx: jax.Array, *, batch: int) -> jax.Array: ...


def _router_kernel(dim: int, num_experts: int, param_dtype, rngs: nnx.Rngs) -> nnx.Param:
    return nnx.Param(fan_in_init((dim, num_experts), 1)(rngs.params(), (dim, num_experts), param_dtype),
                     **logical(("embed", "experts")))


def _logits(x: jax.Array, kernel: nnx.Param) -> jax.Array:
    """x @ kernel in float32, or wider where x or the kernel is (float64)."""
    dtype = jnp.promote_types(jnp.promote_types(x.dtype, kernel.dtype), jnp.float32)
    return x.astype(dtype) @ kernel[...].astype(dtype)


# -- group-limited --------------------------------------------------------------------------------------------
def check_routing(*, num_experts: int, k: int, n_group: int, topk_group: int, where: str) -> None:
    """The group-limited router's limits (the one place they are checked: the router and the configs that use it)."""
    if num_experts % n_group:
        raise ValueError(f"{where}: n_group={n_group} must divide num_experts={num_experts}")
    if not 0 < topk_group <= n_group:
        raise ValueError(f"{where}: topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 0 < k <= topk_group * (num_experts // n_group):
        raise ValueError(f"{where}: num_experts_per_tok={k} must be in [1, {topk_group * (num_experts // n_group)}] "
                         f"(topk_group * experts per group)")


def route(scores: jax.Array, bias: jax.Array, *, k: int, n_group: int, topk_group: int,
          routed_scaling_factor: float, norm_topk_prob: bool = True) -> tuple[jax.Array, jax.Array]:
    """Group-limited top-k (arXiv:2412.19437) over sigmoid `scores` [T, E] (float32) with the selection `bias` [E].

    Returns (weights [T, k] float32, expert indices [T, k] int32). The bias only chooses; weights are unbiased."""
    t, e = scores.shape
    biased = scores + jax.lax.stop_gradient(bias)
    grouped = biased.reshape(t, n_group, e // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, e // n_group))[0], axis=-1)        # [T, G]
    _, top_groups = jax.lax.top_k(group_scores, topk_group)                                 # [T, topk_group]
    group_mask = jnp.any(jax.nn.one_hot(top_groups, n_group, dtype=jnp.bool_), axis=1)      # [T, G]
    expert_mask = jnp.repeat(group_mask, e // n_group, axis=1)                              # [T, E]
    _, idx = jax.lax.top_k(jnp.where(expert_mask, jax.lax.stop_gradient(biased), -jnp.inf), k)
    weights = jnp.take_along_axis(scores, idx, axis=1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, idx.astype(jnp.int32)


def sequence_balance_loss(scores: jax.Array, idx: jax.Array, *, batch: int, weight: float) -> jax.Array:
    """The complementary sequence-wise balance loss: weight * mean over sequences of sum_i f_i P_i, where
    f_i = E / (k S) * (copies of the sequence routed to i) and P_i = mean over the sequence of s_i / sum_j s_j."""
    t, e = scores.shape
    k = idx.shape[1]
    s = t // batch
    counts = jnp.sum(jax.nn.one_hot(idx.reshape(batch, s * k), e, dtype=jnp.float32), axis=1)   # [B, E]
    f = jax.lax.stop_gradient(counts * (e / (k * s)))
    p = jnp.mean((scores / jnp.sum(scores, axis=-1, keepdims=True)).reshape(batch, s, e), axis=1)
    return weight * jnp.mean(jnp.sum(f * p, axis=-1))


class GroupLimitedRouter(nnx.Module):
    """Sigmoid affinities of each token to each expert, and the group-limited choice."""

    def __init__(self, *, dim: int, num_experts: int, k: int, n_group: int, topk_group: int,
                 routed_scaling_factor: float, norm_topk_prob: bool = True, balance_loss_weight: float = 1e-4,
                 param_dtype=jnp.float32, rngs: nnx.Rngs):
        check_routing(num_experts=num_experts, k=k, n_group=n_group, topk_group=topk_group, where="MoE")
        self.kernel = _router_kernel(dim, num_experts, param_dtype, rngs)
        self.e_score_correction_bias = RoutingBias(jnp.zeros((num_experts,), jnp.float32), **logical(("experts",)))
        self.num_experts, self.k, self.n_group, self.topk_group = num_experts, k, n_group, topk_group
        self.routed_scaling_factor, self.norm_topk_prob = routed_scaling_factor, norm_topk_prob
        self.balance_loss_weight = balance_loss_weight

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] -> (scores [T, E], weights [T, k], indices [T, k]); scores and weights in float32."""
        scores = jax.nn.sigmoid(_logits(x, self.kernel))
        weights, idx = route(scores, self.e_score_correction_bias[...], k=self.k, n_group=self.n_group,
                             topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                             norm_topk_prob=self.norm_topk_prob)
        return scores, weights, idx

    def balance_loss(self, scores: jax.Array, idx: jax.Array, *, batch: int) -> jax.Array:
        return sequence_balance_loss(scores, idx, batch=batch, weight=self.balance_loss_weight)


# -- softmax top-k (Mixtral) --------------------------------------------------------------------------------------
def switch_balance_loss(probs: jax.Array, idx: jax.Array, *, weight: float) -> jax.Array:
    """Switch Transformer's load-balancing loss as transformers computes it (`load_balancing_loss_func`):
    weight * E * sum_i f_i P_i (f_i: copies routed to i / tokens, P_i: mean router probability of i) over one
    forward pass's tokens. A product of two means, it does not add up over micro-batches: the step takes their mean,
    as transformers and Megatron do (`sequence_balance_loss` adds up exactly)."""
    t, e = probs.shape
    f = jax.lax.stop_gradient(jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32), axis=(0, 1)) / t)
    return weight * e * jnp.sum(f * jnp.mean(probs, axis=0))


class SoftmaxRouter(nnx.Module):
    """Softmax over the experts, the top-k kept; their weights renormalised to sum to one when `norm_topk_prob`."""

    def __init__(self, *, dim: int, num_experts: int, k: int, norm_topk_prob: bool = True,
                 balance_loss_weight: float = 1e-3, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if not 0 < k <= num_experts:
            raise ValueError(f"MoE: num_experts_per_tok={k} must be in [1, num_experts={num_experts}]")
        self.kernel = _router_kernel(dim, num_experts, param_dtype, rngs)
        self.num_experts, self.k, self.norm_topk_prob = num_experts, k, norm_topk_prob
        self.balance_loss_weight = balance_loss_weight

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] -> (probabilities [T, E], weights [T, k], indices [T, k]); float32."""
        probs = jax.nn.softmax(_logits(x, self.kernel), axis=-1)
        weights, idx = jax.lax.top_k(probs, self.k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return probs, weights, idx.astype(jnp.int32)

    def balance_loss(self, scores: jax.Array, idx: jax.Array, *, batch: int) -> jax.Array:
        return switch_balance_loss(scores, idx, weight=self.balance_loss_weight)
