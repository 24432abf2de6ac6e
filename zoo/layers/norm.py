"""RMSNorm (Zhang & Sennrich, 2019), statistics in float32 (or wider: float64 inputs stay float64).

Written out rather than `nnx.RMSNorm` so that the order of operations is the published one (normalise in float32,
cast to the activation dtype, then scale), which is what the published checkpoints were trained with.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.linear import logical


class RMSNorm(nnx.Module):
    """Root mean square layer normalization (Zhang & Sennrich, 2019): y = scale * x / sqrt(mean(x^2) + eps) over the
    last axis, the statistics in float32 (float64 for a float64 input), then cast to `dtype` and scaled.

    Args:
        dim: the size of the normalized (last) axis, and of `scale`.
        eps: added to the mean square before the square root.
        dtype: the dtype of the output (the computation's).
        param_dtype: the dtype `scale` is stored in (initialized to ones).
        axis_name: the logical axis name of `scale` (`zoo.sharding`'s rules map it to a mesh axis).
        rngs: unused (the initialization is deterministic); accepted as flax's layers accept it.

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.layers import RMSNorm
        >>> norm = RMSNorm(4)
        >>> norm(jnp.array([[1.0, -1.0, 1.0, -1.0]])).round(3)
        Array([[ 1., -1.,  1., -1.]], dtype=float32)
    """

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype=jnp.float32, param_dtype=jnp.float32,
                 axis_name: str = "embed", rngs: nnx.Rngs | None = None):
        del rngs  # deterministic init: ones
        self.eps = eps
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), **logical((axis_name,)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """Normalize `x` over its last axis.

        Args:
            x: [..., dim].

        Returns:
            [..., dim] in `dtype`.
        """
        x32 = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * y.astype(self.dtype)
