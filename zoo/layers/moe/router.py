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
    """DeepSeek-V3's `e_score_correction_bias` (arXiv:2412.19437, 2.1.2, auxiliary-loss-free load balancing): a
    per-expert bias added to the affinities only to choose the experts, moved by `update_routing_bias` after each
    step, never by gradients (a `Stored` variable, not an `nnx.Param`).

    Args:
        value: [E] float32, zeros at initialization.
        **metadata: the variable's metadata (its logical axes).

    Examples:
        >>> from flax import nnx
        >>> from zoo.layers import GroupLimitedRouter, RoutingBias
        >>> router = GroupLimitedRouter(dim=8, num_experts=4, k=2, n_group=2, topk_group=1, routed_scaling_factor=1.0,
        ...                             rngs=nnx.Rngs(0))
        >>> isinstance(router.e_score_correction_bias, RoutingBias), router.e_score_correction_bias.shape
        (True, (4,))
    """


class Router(Protocol):
    """What a router of `MoE` is: `__call__(x [T, D])` gives (scores [T, E], weights [T, k], expert indices [T, k]) in
    float32, and `balance_loss(scores, idx, batch=B)` its weighted balance loss. `GroupLimitedRouter` and
    `SoftmaxRouter` are the zoo's.

    Examples:
        >>> from flax import nnx
        >>> from zoo.layers import SoftmaxRouter
        >>> router = SoftmaxRouter(dim=8, num_experts=4, k=2, rngs=nnx.Rngs(0))
        >>> (router.num_experts, router.k)
        (4, 2)
    """
    num_experts: int
    k: int

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Route tokens.

        Args:
            x: [T, D] tokens.

        Returns:
            (scores [T, E], weights [T, k], indices [T, k]), float32 (indices int32).
        """

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
    """Check the group-limited router's limits (the one place they are checked: the router and the configs that use it).

    Args:
        num_experts: the routed experts E.
        k: the experts each token visits.
        n_group: the groups the experts are split into (it divides E).
        topk_group: the groups a token may choose from (1..n_group).
        where: what the message names (the config or the layer).

    Raises:
        ValueError: naming the field out of range.

    Examples:
        >>> from zoo.layers.moe import check_routing
        >>> check_routing(num_experts=8, k=2, n_group=4, topk_group=2, where="MoE")
    """
    if num_experts % n_group:
        raise ValueError(f"{where}: n_group={n_group} must divide num_experts={num_experts}")
    if not 0 < topk_group <= n_group:
        raise ValueError(f"{where}: topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 0 < k <= topk_group * (num_experts // n_group):
        raise ValueError(f"{where}: num_experts_per_tok={k} must be in [1, {topk_group * (num_experts // n_group)}] "
                         f"(topk_group * experts per group)")


def route(scores: jax.Array, bias: jax.Array, *, k: int, n_group: int, topk_group: int,
          routed_scaling_factor: float, norm_topk_prob: bool = True) -> tuple[jax.Array, jax.Array]:
    """DeepSeek-V3's node-limited (group-limited) top-k routing (arXiv:2412.19437, 2.1.2): each token keeps its
    `topk_group` best groups (a group scored by its two best biased affinities), then the k best experts in them by
    biased affinity; the weights are the unbiased affinities, normalized to sum to one (`norm_topk_prob`) and times
    `routed_scaling_factor`.

    Args:
        scores: [T, E] float32 sigmoid affinities.
        bias: [E] the selection bias (`RoutingBias`; it only chooses).
        k: the experts each token visits.
        n_group: the groups the experts are split into.
        topk_group: the groups each token may choose from.
        routed_scaling_factor: the factor on the weights.
        norm_topk_prob: whether the k weights are normalized to sum to one first.

    Returns:
        (weights [T, k] float32, expert indices [T, k] int32).

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.layers.moe import route
        >>> w, idx = route(jnp.array([[0.9, 0.1, 0.8, 0.2]]), jnp.zeros(4), k=2, n_group=2, topk_group=1,
        ...                routed_scaling_factor=1.0)
        >>> idx.tolist(), (w * 10).round().tolist()
        ([[0, 1]], [[9.0, 1.0]])
    """
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
    """DeepSeek-V3's complementary sequence-wise balance loss (arXiv:2412.19437, 2.1.2): weight * the mean over
    sequences of sum_i f_i P_i, where f_i = E / (k S) * (the sequence's copies routed to expert i) and P_i is the
    mean over the sequence of expert i's normalized affinity.

    Args:
        scores: [T, E] affinities of T = batch * S tokens.
        idx: [T, k] the experts chosen.
        batch: the sequences B among the T tokens.
        weight: the loss's weight (DeepSeek-V3's alpha).

    Returns:
        [] float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.layers.moe import sequence_balance_loss
        >>> float(sequence_balance_loss(jnp.full((4, 2), 0.5), jnp.array([[0], [1], [0], [1]]), batch=1, weight=1.0))
        1.0
    """
    t, e = scores.shape
    k = idx.shape[1]
    s = t // batch
    counts = jnp.sum(jax.nn.one_hot(idx.reshape(batch, s * k), e, dtype=jnp.float32), axis=1)   # [B, E]
    f = jax.lax.stop_gradient(counts * (e / (k * s)))
    p = jnp.mean((scores / jnp.sum(scores, axis=-1, keepdims=True)).reshape(batch, s, e), axis=1)
    return weight * jnp.mean(jnp.sum(f * p, axis=-1))


class GroupLimitedRouter(nnx.Module):
    """DeepSeek-V3's router (arXiv:2412.19437, 2.1.2): sigmoid affinities of each token to each expert, a `RoutingBias`
    used only to choose, group-limited top-k (`route`); its balance loss is the sequence-wise one
    (`sequence_balance_loss`). Parameter names are transformers'.

    Args:
        dim: the model width D.
        num_experts: the routed experts E.
        k: the experts each token visits.
        n_group: the groups the experts are split into.
        topk_group: the groups each token may choose from.
        routed_scaling_factor: the factor on the routing weights.
        norm_topk_prob: whether the k weights are normalized to sum to one.
        balance_loss_weight: the sequence-wise balance loss's weight.
        param_dtype: the dtype the kernel is stored in (the logits are float32).
        rngs: the random generators of the kernel's initialization.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import GroupLimitedRouter
        >>> router = GroupLimitedRouter(dim=8, num_experts=4, k=2, n_group=2, topk_group=1, routed_scaling_factor=1.0,
        ...                             rngs=nnx.Rngs(0))
        >>> [a.shape for a in router(jnp.ones((3, 8)))]
        [(3, 4), (3, 2), (3, 2)]
    """

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
        """Route tokens.

        Args:
            x: [T, D] tokens.

        Returns:
            (scores [T, E], weights [T, k], indices [T, k]); scores and weights float32, indices int32.
        """
        scores = jax.nn.sigmoid(_logits(x, self.kernel))
        weights, idx = route(scores, self.e_score_correction_bias[...], k=self.k, n_group=self.n_group,
                             topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                             norm_topk_prob=self.norm_topk_prob)
        return scores, weights, idx

    def balance_loss(self, scores: jax.Array, idx: jax.Array, *, batch: int) -> jax.Array:
        return sequence_balance_loss(scores, idx, batch=batch, weight=self.balance_loss_weight)


# -- softmax top-k (Mixtral) --------------------------------------------------------------------------------------
def switch_balance_loss(probs: jax.Array, idx: jax.Array, *, weight: float) -> jax.Array:
    """The Switch Transformer's load-balancing loss (Fedus et al., 2021) as transformers computes it
    (`load_balancing_loss_func`): weight * E * sum_i f_i P_i, f_i the share of the copies routed to expert i and P_i
    its mean router probability, over one forward pass's tokens (a product of two means: with gradient accumulation
    the step takes the micro-batches' mean, as transformers and Megatron do).

    Args:
        probs: [T, E] router probabilities.
        idx: [T, k] the experts chosen.
        weight: the loss's weight (transformers' router_aux_loss_coef).

    Returns:
        [] float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.layers.moe import switch_balance_loss
        >>> float(switch_balance_loss(jnp.full((2, 2), 0.5), jnp.array([[0], [1]]), weight=1.0))
        1.0
    """
    t, e = probs.shape
    f = jax.lax.stop_gradient(jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32), axis=(0, 1)) / t)
    return weight * e * jnp.sum(f * jnp.mean(probs, axis=0))


class SoftmaxRouter(nnx.Module):
    """The softmax top-k router of Qwen3-MoE (Qwen Team, 2025) and Mixtral: a softmax over the experts, the k best kept,
    their weights renormalized to sum to one with `norm_topk_prob`; its balance loss is the Switch Transformer's
    (`switch_balance_loss`).

    Args:
        dim: the model width D.
        num_experts: the routed experts E.
        k: the experts each token visits.
        norm_topk_prob: whether the k weights are renormalized to sum to one.
        balance_loss_weight: the balance loss's weight.
        param_dtype: the dtype the kernel is stored in (the logits are float32).
        rngs: the random generators of the kernel's initialization.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import SoftmaxRouter
        >>> probs, weights, idx = SoftmaxRouter(dim=8, num_experts=4, k=2, rngs=nnx.Rngs(0))(jnp.ones((3, 8)))
        >>> weights.sum(axis=-1).round(3).tolist()
        [1.0, 1.0, 1.0]
    """

    def __init__(self, *, dim: int, num_experts: int, k: int, norm_topk_prob: bool = True,
                 balance_loss_weight: float = 1e-3, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if not 0 < k <= num_experts:
            raise ValueError(f"MoE: num_experts_per_tok={k} must be in [1, num_experts={num_experts}]")
        self.kernel = _router_kernel(dim, num_experts, param_dtype, rngs)
        self.num_experts, self.k, self.norm_topk_prob = num_experts, k, norm_topk_prob
        self.balance_loss_weight = balance_loss_weight

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Route tokens.

        Args:
            x: [T, D] tokens.

        Returns:
            (probabilities [T, E], weights [T, k], indices [T, k]); float32, indices int32.
        """
        probs = jax.nn.softmax(_logits(x, self.kernel), axis=-1)
        weights, idx = jax.lax.top_k(probs, self.k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return probs, weights, idx.astype(jnp.int32)

    def balance_loss(self, scores: jax.Array, idx: jax.Array, *, batch: int) -> jax.Array:
        return switch_balance_loss(scores, idx, weight=self.balance_loss_weight)
