"""SwiGLU feed-forward (Shazeer, 2020): down(silu(gate(x)) * up(x)).

Tags: {prefix}mlpwi_0 (gate, before the activation), {prefix}mlpwi_1 (up), {prefix}mlpwo (down); the prefix lets
the layer serve as a mixture of experts' shared expert ("shared_"). `seq_chunks=n` runs it on n equal slices of the
sequence, each slice's tensors tagged with the layer's tags (`zoo.emitted` joins them): the same arithmetic, but an
offloaded piece's copy runs under the later pieces' compute, so only the last piece's copies are exposed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.checks import check_positive
from zoo.layers.linear import projection
from zoo.layers.tagged import TaggedLayer
from zoo.sharding import BSD, BSF
from zoo.tags import name

PREFIXES = ("", "shared_")


class MLP(TaggedLayer):
    """The SwiGLU feed-forward of Shazeer (2020), "GLU Variants Improve Transformer": down(silu(gate(x)) * up(x)),
    without biases, as Llama 3 and Qwen3 use it.

    Args:
        dim: the model width D (input and output).
        hidden: the hidden width F of the gate and up projections.
        dtype: the computation's dtype.
        param_dtype: the dtype the kernels are stored in.
        tag_prefix: "" for a decoder layer's MLP, "shared_" for a mixture of experts' shared expert.
        seq_chunks: run on this many equal slices of the sequence (it must divide the sequence length), each
            slice's tensors named with the layer's tags: the same arithmetic, the offloaded copies overlapping the
            later slices' compute.
        rngs: the random generators of the kernels' initialization.

    Emits:
        `{prefix}mlpwi_0` (the gate projection, before the activation), `{prefix}mlpwi_1` (the up projection),
        `{prefix}mlpwo` (the down projection), where `{prefix}` is `tag_prefix`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import MLP
        >>> mlp = MLP(dim=8, hidden=16, rngs=nnx.Rngs(0))
        >>> mlp(jnp.ones((2, 4, 8))).shape
        (2, 4, 8)
        >>> list(mlp.tag_shapes(batch=2, seq=4))
        ['mlpwi_0', 'mlpwi_1', 'mlpwo']
    """

    def __init__(self, *, dim: int, hidden: int, dtype=jnp.float32, param_dtype=jnp.float32, tag_prefix: str = "",
                 seq_chunks: int = 1, rngs: nnx.Rngs):
        self.dim, self.dtype = dim, dtype
        check_positive("MLP seq_chunks", seq_chunks, optional=False)
        self.seq_chunks = seq_chunks
        if tag_prefix not in PREFIXES:
            raise ValueError(f"MLP tag_prefix must be one of {PREFIXES}, got {tag_prefix!r}")
        common = dict(dtype=dtype, param_dtype=param_dtype, n_in=1, rngs=rngs)
        self.gate_proj = projection("bsd,df->bsf", (dim, hidden), ("embed", "mlp"), **common)
        self.up_proj = projection("bsd,df->bsf", (dim, hidden), ("embed", "mlp"), **common)
        self.down_proj = projection("bsf,fd->bsd", (hidden, dim), ("mlp", "embed"), **common)
        self.tag_prefix = tag_prefix

    def __call__(self, x: jax.Array) -> jax.Array:
        """Apply the feed-forward.

        Args:
            x: [B, S, D].

        Returns:
            [B, S, D] in `dtype`.
        """
        n = self.seq_chunks
        if n == 1:
            return self._ffn(x)
        if x.shape[1] % n:
            raise ValueError(f"MLP seq_chunks={n} must divide the sequence length {x.shape[1]}")
        return jnp.concatenate([self._ffn(part) for part in jnp.split(x, n, axis=1)], axis=1)

    def _ffn(self, x: jax.Array) -> jax.Array:
        p = self.tag_prefix
        gate = name(self.gate_proj(x), f"{p}mlpwi_0", BSF)
        up = name(self.up_proj(x), f"{p}mlpwi_1", BSF)
        return name(self.down_proj(jax.nn.silu(gate) * up), f"{p}mlpwo", BSD)
