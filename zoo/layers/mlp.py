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
