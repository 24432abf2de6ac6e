"""Token embedding and the (untied) language-model head."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from zoo.layers.linear import logical, projection
from zoo.logical import active, constrain, rows_beside_embed, split_embed
from zoo.sharding import BSD


class Embed(nnx.Module):
    def __init__(self, *, vocab: int, dim: int, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.embedding = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (vocab, dim), param_dtype),
                                   **logical(("vocab", "embed")))
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if not active():
            return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)
        # Under a mesh the table is split vocab -> tp and embed -> fsdp while the tokens' batch is split over fsdp
        # too. Looked up as they come, the gradient's scatter-add into the table has its updates' batch and the
        # table's embed on the same mesh axis, and XLA's SPMD partitioner replicates the whole [B, S, D] cotangent
        # on every device to resolve it ("Involuntary full rematerialization"). So the lookup runs in the table's
        # layout: the tokens gathered over the embed axes (ints, cheap), the rows [B, S, D] split like the
        # table's embed. The gradient's scatter-add is then local to each device's [vocab/tp, embed/fsdp] block,
        # and the way to and from the layers' layout (batch split, embed whole: returned constrained so, or XLA
        # may carry the lookup's layout into the layer scan) is one all-to-all of an activation.
        tokens = jax.lax.with_sharding_constraint(tokens, PartitionSpec(rows_beside_embed() or None, None))
        x = split_embed(jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype))
        return constrain(x, BSD)


class LMHead(nnx.Module):
    def __init__(self, *, dim: int, vocab: int, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.proj = projection("bsd,dv->bsv", (dim, vocab), ("embed", "vocab"), n_in=1, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.proj(x)
