"""Projections with logical axis names.

Every parameter carries its logical axes (`layers`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`, ...)
as `out_sharding` metadata, with eager sharding off: the names are logical, and sharding rules map them to mesh
axes later (`zoo.sharding.shardings`) without touching the layers.
"""
from __future__ import annotations

from collections.abc import Sequence

from flax import nnx


class Stored(nnx.Variable):
    """A variable that checkpoints store and no gradient trains (an optimizer over `nnx.Param` leaves it alone),
    e.g. a router's load-balancing bias. Parameter counts include it.

    Args:
        value: the array held (as `nnx.Variable` takes it).
        **metadata: the variable's metadata, e.g. `logical(axes)`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.layers.linear import Stored
        >>> Stored(jnp.zeros(3))[...].shape
        (3,)
    """


def logical(axes: Sequence[str | None]) -> dict:
    """Variable metadata for logical axis names (no mesh needed at creation)."""
    return dict(out_sharding=tuple(axes), eager_sharding=False)


def fan_in_init(shape: Sequence[int], n_in: int, scale: float = 1.0):
    """Truncated normal with variance scale / fan_in, where the first `n_in` kernel axes are the inputs."""
    return nnx.initializers.variance_scaling(
        scale, "fan_in", "truncated_normal", in_axis=tuple(range(n_in)), out_axis=tuple(range(n_in, len(shape))))


def projection(equation: str, shape: Sequence[int], axes: Sequence[str], *, n_in: int, dtype, param_dtype,
               rngs: nnx.Rngs) -> nnx.Einsum:
    """An `nnx.Einsum` with no bias, a fan-in initializer and logical axes on its kernel."""
    if len(shape) != len(axes):
        raise ValueError(f"projection {equation}: shape {tuple(shape)} and axes {tuple(axes)} differ in length")
    return nnx.Einsum(equation, tuple(shape), dtype=dtype, param_dtype=param_dtype,
                      kernel_init=fan_in_init(shape, n_in), kernel_metadata=logical(axes), rngs=rngs)

