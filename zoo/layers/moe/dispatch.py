"""How token copies reach their experts on one device or under capacity dispatch: each group's copies sorted by expert
(`sort_by_expert`, every backend's) and the capacity backend's [experts, C, hidden] buffer (`capacity_dispatch`). Under
a mesh the capacity backend is GShard's: a group per batch shard, each with its own capacity, the buffer's experts over
`ep` (XLA's all-to-alls move each copy); which copies drop can depend on the mesh.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from einops import rearrange, repeat

from zoo import sharding


def capacity(num_rows: int, num_experts: int, capacity_factor: float) -> int:
    """The rows each expert takes under capacity dispatch (GShard; Lepikhin et al., 2020).

    Args:
        num_rows: the token copies of a group (tokens * k).
        num_experts: the experts E.
        capacity_factor: the capacity as a multiple of an even share.

    Returns:
        ceil(capacity_factor * num_rows / num_experts), at least 1.

    Examples:
        >>> from zoo.layers.moe import capacity
        >>> capacity(16, 4, 1.25)
        5
    """
    return max(1, math.ceil(capacity_factor * num_rows / num_experts))


# -- moving token copies ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sorted:
    """Each group's T*k token copies sorted by expert (stable: token order within an expert), as `sort_by_expert` gives.

    Args:
        rows: [G, N, D] the copies, by expert.
        expert: [G, N] the expert of each sorted copy.
        group_sizes: [G, E] the copies per expert.
        inverse: [G, N] where each copy (in token order) sits among the sorted ones.

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.layers.moe.dispatch import sort_by_expert
        >>> sort_by_expert(jnp.ones((1, 2, 4)), jnp.array([[[1], [0]]]), 2).expert.tolist()
        [[0, 1]]
    """
    rows: jax.Array          # [G, N, D] the copies, by expert
    expert: jax.Array        # [G, N] the expert of each sorted copy
    group_sizes: jax.Array   # [G, E] copies per expert
    inverse: jax.Array       # [G, N] where each copy (in token order) sits among the sorted ones


def sort_by_expert(flat: jax.Array, idx: jax.Array, num_experts: int) -> Sorted:
    """flat [G, T, D] tokens, idx [G, T, k] their experts -> the T*k copies of each group sorted by expert."""
    k = idx.shape[-1]
    idx = idx.reshape(idx.shape[0], -1)                                                   # [G, T*k]
    order = jnp.argsort(idx, axis=-1, stable=True)
    group_sizes = jax.vmap(lambda i: jnp.bincount(i, length=num_experts))(idx).astype(jnp.int32)
    rows = jnp.take_along_axis(repeat(flat, "g t d -> g (t k) d", k=k), order[..., None], axis=1)
    return Sorted(rows, jnp.take_along_axis(idx, order, axis=-1), group_sizes, jnp.argsort(order, axis=-1))


def unsort(out: jax.Array, s: Sorted) -> jax.Array:
    """[G, N, D] outputs in sorted order -> [G, N, D] in token-copy order."""
    return jnp.take_along_axis(out, s.inverse[..., None], axis=1)


def capacity_dispatch(s: Sorted, experts: Callable[[jax.Array], jax.Array], capacity_factor: float
                      ) -> tuple[jax.Array, jax.Array]:
    """Run `experts` ([E, G*C, D] -> [E, G*C, D]) over each group's first C copies per expert -> (out [G, N, D] in
    sorted order with dropped rows zero, number dropped). Each group fills its own [E, C] slots; the buffer is laid
    out [E, G*C, D] with experts over `ep`, so under expert parallelism XLA moves the copies to their experts'
    devices (an all-to-all)."""
    g, n, d = s.rows.shape                                                                # n: copies per group
    e = s.group_sizes.shape[-1]
    c = capacity(n, e, capacity_factor)
    starts = jnp.cumsum(s.group_sizes, axis=-1) - s.group_sizes                           # [G, E]
    slot = jnp.arange(n, dtype=jnp.int32) - jnp.take_along_axis(starts, s.expert, axis=-1)  # rank in its expert
    group = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32)[:, None], (g, n))
    buf = jnp.zeros((g, e, c, d), s.rows.dtype).at[group, s.expert, slot].set(s.rows, mode="drop")
    buf = rearrange(buf, "g e c d -> e (g c) d")
    out = rearrange(experts(buf), "e (g c) d -> g e c d", g=g)
    out = sharding.constrain(out, ("batch", None, None, "embed"))
    out = out.at[group, s.expert, slot].get(mode="fill", fill_value=0)
    return out, jnp.sum(slot >= c, dtype=jnp.int32)
