"""Sharding constraints by logical axis names: the one piece of sharding a tag site needs (`zoo.tags.name`).

A no-op unless a mesh and Flax's logical-axis rules are both active (`zoo.sharding.use` activates them); the rule
sets and the mesh live in `zoo.sharding`, which builds on this module.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax import linen as nn
from jax.sharding import PartitionSpec


def active() -> bool:
    """True while a mesh and logical-axis rules are both active, outside `shard_map` (inside it every value is one
    device's shard: there is nothing to constrain)."""
    mesh = jax.sharding.get_abstract_mesh()
    return bool(nn.get_logical_axis_rules()) and not mesh.empty and not mesh.manual_axes


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """A sharding constraint by logical axis names (flax's `with_logical_constraint`); a no-op unless a mesh and
    rules are active (see `use`)."""
    if len(axes) != x.ndim:
        raise ValueError(f"constrain: {len(axes)} logical axes {tuple(axes)} for an array of rank {x.ndim}")
    if not active():
        return x
    return nn.with_logical_constraint(x, tuple(axes))


def mesh_axes(logical: str) -> tuple[str, ...]:
    """The mesh axes the active rules map the logical axis `logical` to (() when none are active)."""
    if not active():
        return ()
    spec = nn.logical_to_mesh_axes((logical,))[0]
    return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def size_of(logical: str) -> int:
    """How many shards the active rules split the logical axis `logical` into (1 when none are active)."""
    shape = jax.sharding.get_abstract_mesh().shape
    return math.prod(shape[a] for a in mesh_axes(logical))


def rows_beside_embed() -> tuple[str, ...]:
    """The batch's mesh axes that the logical axis `embed` does not use (() when no rules are active)."""
    embed = mesh_axes("embed")
    return tuple(a for a in mesh_axes("batch") if a not in embed)


def split_embed(x: jax.Array, *, keep_batch: bool = True) -> jax.Array:
    """x [batch, ..., embed] constrained to the parameters' layout of `embed`: the last dim split over the mesh
    axes of `embed` (fsdp), the batch over its other axes (`rows_beside_embed`), or, with `keep_batch=False`,
    whole. From the activations' layout (batch over every data axis, embed whole) that is one all-to-all, then
    (`keep_batch=False`) one all-gather: two constraints, because XLA's SPMD partitioner makes such a move one
    collective at a time and, for a move it cannot split, replicates the whole tensor on every device
    ("Involuntary full rematerialization"). A no-op unless a mesh and rules are active."""
    if not active():
        return x
    embed = mesh_axes("embed") or None
    rows = rows_beside_embed() or None
    mid = (None,) * (x.ndim - 2)
    x = jax.lax.with_sharding_constraint(x, PartitionSpec(rows, *mid, embed))
    if not keep_batch and rows:
        x = jax.lax.with_sharding_constraint(x, PartitionSpec(None, *mid, embed))
    return x
