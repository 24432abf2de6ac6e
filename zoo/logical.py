"""Sharding constraints by logical axis names: the one piece of sharding a tag site needs (`zoo.tags.name`).

A no-op unless a mesh and Flax's logical-axis rules are both active (`zoo.sharding.use`). Logical names become mesh
axes with priority semantics (`mesh_spec`: rules tried in order, a mesh axis used at most once per array) through
`flax.linen.logical_to_mesh_axes`: NNX's plain lookup would give an fsdp activation [batch, seq, embed]
P('fsdp', None, 'fsdp'), a spec JAX rejects (docs/internals.md, "Sharding").
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from flax.core import spmd
from flax.linen import logical_to_mesh_axes
from flax.typing import LogicalRules
from jax.sharding import PartitionSpec

LAYERS = "layers"   # the logical name of a stack's leading axis (zoo.models.stack)


def axis_names(var) -> tuple:
    """The logical axis names a Variable's sharding metadata gives its axes.

    Args:
        var: an `nnx.Variable`, abstract or concrete.

    Returns:
        a tuple of names (None for an axis without one); empty for a Variable without sharding metadata.
    """
    return tuple(var.get_metadata().get("out_sharding") or ())


def stacked(var) -> bool:
    """Whether a Variable is stacked over a decoder stack's layers.

    Args:
        var: an `nnx.Variable`, abstract or concrete.

    Returns:
        True where its first logical axis is `LAYERS`.
    """
    return axis_names(var)[:1] == (LAYERS,)


def active() -> bool:
    """True while a mesh and logical-axis rules are both active, outside `shard_map` (inside it every value is one
    device's shard: there is nothing to constrain)."""
    mesh = jax.sharding.get_abstract_mesh()
    return bool(spmd.get_logical_axis_rules()) and not mesh.empty and not mesh.manual_axes


def mesh_spec(axes: Sequence[str | None], rules: LogicalRules | None = None) -> PartitionSpec:
    """The PartitionSpec of an array with logical `axes` under `rules` (default: the active ones): rules in order,
    each mesh axis at most once per array, a name no rule maps (or `None`) whole. ValueError for a name given twice."""
    return logical_to_mesh_axes(tuple(axes), rules)


def constrain(x: jax.Array, axes: Sequence[str | None]) -> jax.Array:
    """A sharding constraint by logical axis names (`mesh_spec` under the active rules); a no-op unless a mesh and
    rules are active (see `zoo.sharding.use`)."""
    if len(axes) != x.ndim:
        raise ValueError(f"constrain: {len(axes)} logical axes {tuple(axes)} for an array of rank {x.ndim}")
    if not active():
        return x
    return jax.lax.with_sharding_constraint(x, mesh_spec(axes))


def mesh_axes(logical: str) -> tuple[str, ...]:
    """The mesh axes the active rules map the logical axis `logical` to (() when none are active)."""
    if not active():
        return ()
    spec = mesh_spec((logical,))[0]
    return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def size_of(logical: str) -> int:
    """How many shards the active rules split the logical axis `logical` into (1 when none are active)."""
    shape = jax.sharding.get_abstract_mesh().shape
    return math.prod(shape[a] for a in mesh_axes(logical))


def rows_beside_embed() -> tuple[str, ...]:
    """The batch's mesh axes that the logical axis `embed` does not use (() when no rules are active)."""
    embed = mesh_axes("embed")
    return tuple(a for a in mesh_axes("batch") if a not in embed)


def _spec(x: jax.Array, rows: Sequence[str], cols: Sequence[str]) -> PartitionSpec:
    return PartitionSpec(tuple(rows) or None, *(None,) * (x.ndim - 2), tuple(cols) or None)


def split_embed(x: jax.Array, *, keep_batch: bool = True) -> jax.Array:
    """x [batch, ..., embed] from the activations' layout (batch over every data axis, embed whole) to the parameters'
    layout of `embed` (the last dim over fsdp, the batch over its other axes, `rows_beside_embed`; with
    `keep_batch=False`, whole). The moves go one mesh axis at a time: a move XLA's SPMD partitioner cannot split
    replicates the whole tensor. A no-op unless a mesh and rules are active."""
    if not active():
        return x
    embed, batch = mesh_axes("embed"), list(mesh_axes("batch"))
    if keep_batch:
        return jax.lax.with_sharding_constraint(x, _spec(x, rows_beside_embed(), embed))
    moved: list[str] = []
    while batch:
        axis = batch.pop()
        if axis in embed:
            moved.insert(0, axis)
        x = jax.lax.with_sharding_constraint(x, _spec(x, batch, moved))
    return x if tuple(moved) == embed else jax.lax.with_sharding_constraint(x, _spec(x, (), embed))

