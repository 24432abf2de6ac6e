"""Token embedding and the (untied) language-model head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.linear import logical, projection


class Embed(nnx.Module):
    def __init__(self, *, vocab: int, dim: int, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.embedding = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (vocab, dim), param_dtype),
                                   **logical(("vocab", "embed")))
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)


class LMHead(nnx.Module):
    def __init__(self, *, dim: int, vocab: int, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.proj = projection("bsd,dv->bsv", (dim, vocab), ("embed", "vocab"), n_in=1, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(x)
