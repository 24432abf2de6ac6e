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
    """The token embedding: a [vocab, dim] table (normal initialization, stddev 1) looked up by token id. Under a
    mesh (`zoo.sharding.use`) the lookup runs in the table's layout, so the gradient's scatter-add stays local.

    Args:
        vocab: the number of token ids.
        dim: the model width D.
        dtype: the dtype of the embeddings returned.
        param_dtype: the dtype the table is stored in.
        rngs: the random generators of the table's initialization.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import Embed
        >>> embed = Embed(vocab=16, dim=8, rngs=nnx.Rngs(0))
        >>> embed(jnp.array([[1, 2, 3]])).shape
        (1, 3, 8)
    """

    def __init__(self, *, vocab: int, dim: int, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.embedding = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (vocab, dim), param_dtype),
                                   **logical(("vocab", "embed")))
        self.dtype = dtype

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Look the tokens up.

        Args:
            tokens: int [B, S] token ids.

        Returns:
            [B, S, D] in `dtype`.
        """
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
    """The language-model head: an untied [dim, vocab] projection of the last hidden states to logits, no bias.

    Args:
        dim: the model width D.
        vocab: the number of token ids.
        dtype: the computation's dtype.
        param_dtype: the dtype the kernel is stored in.
        rngs: the random generators of the kernel's initialization.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import LMHead
        >>> head = LMHead(dim=8, vocab=16, rngs=nnx.Rngs(0))
        >>> head(jnp.ones((1, 3, 8))).shape
        (1, 3, 16)
    """

    def __init__(self, *, dim: int, vocab: int, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.proj = projection("bsd,dv->bsv", (dim, vocab), ("embed", "vocab"), n_in=1, dtype=dtype,
                               param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """The logits of hidden states.

        Args:
            x: [B, S, D].

        Returns:
            [B, S, vocab] in `dtype`.
        """
        return self.proj(x)
