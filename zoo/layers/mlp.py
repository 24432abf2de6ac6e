"""SwiGLU feed-forward (Shazeer, 2020): down(silu(gate(x)) * up(x)).

Tags: {prefix}mlpwi_0 (gate, before the activation), {prefix}mlpwi_1 (up), {prefix}mlpwo (down). The prefix
lets the same layer serve as DeepSeek-V3's shared expert ("shared_").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers.linear import projection
from zoo.layers.tagged import TaggedLayer
from zoo.sharding import BSD, BSF
from zoo.tags import name

PREFIXES = ("", "shared_")


class MLP(TaggedLayer):
    def __init__(self, *, dim: int, hidden: int, dtype=jnp.float32, param_dtype=jnp.float32, tag_prefix: str = "",
                 rngs: nnx.Rngs):
        self.dim, self.dtype = dim, dtype
        if tag_prefix not in PREFIXES:
            raise ValueError(f"MLP tag_prefix must be one of {PREFIXES}, got {tag_prefix!r}")
        common = dict(dtype=dtype, param_dtype=param_dtype, n_in=1, rngs=rngs)
        self.gate_proj = projection("bsd,df->bsf", (dim, hidden), ("embed", "mlp"), **common)
        self.up_proj = projection("bsd,df->bsf", (dim, hidden), ("embed", "mlp"), **common)
        self.down_proj = projection("bsf,fd->bsd", (hidden, dim), ("mlp", "embed"), **common)
        self.tag_prefix = tag_prefix

    def __call__(self, x: jax.Array) -> jax.Array:
        p = self.tag_prefix
        gate = name(self.gate_proj(x), f"{p}mlpwi_0", BSF)
        up = name(self.up_proj(x), f"{p}mlpwi_1", BSF)
        return name(self.down_proj(jax.nn.silu(gate) * up), f"{p}mlpwo", BSD)
