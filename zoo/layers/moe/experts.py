"""The routed experts: `num_experts` SwiGLU feed-forwards stored stacked, run over the rows dispatched to them.

Tags moe_mlpwi_0 (gate), moe_mlpwi_1 (up), moe_mlpwo (down), over the sorted rows [B*S*k, ...], one device's
receive buffer under expert parallelism, or the capacity buffer [experts, C, ...]. Parameter names follow
transformers: gate_proj, up_proj [E, D, F], down_proj [E, F, D].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo import sharding
from zoo.layers.linear import logical
from zoo.layers.moe.backend import GROUPED_MATMULS
from zoo.tags import name


class Experts(nnx.Module):
    """The routed experts of a mixture of experts: `num_experts` SwiGLU feed-forwards (Shazeer, 2020) stored stacked,
    gate_proj and up_proj [E, D, F], down_proj [E, F, D] (transformers' names), run over the rows dispatched to them
    by a grouped matmul (`grouped`) or a batched einsum over a capacity buffer (`batched`).

    Args:
        num_experts: the experts E.
        dim: the model width D.
        hidden: each expert's hidden width F.
        dtype: the computation's dtype.
        param_dtype: the dtype the kernels are stored in.
        rngs: the random generators of the kernels' initialization.

    Emits:
        `moe_mlpwi_0` (gate), `moe_mlpwi_1` (up), `moe_mlpwo` (down), over the dispatched rows.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers.moe import Experts
        >>> experts = Experts(num_experts=2, dim=8, hidden=16, rngs=nnx.Rngs(0))
        >>> experts.grouped(jnp.ones((3, 8)), jnp.array([2, 1], jnp.int32), "ragged_dot").shape
        (3, 8)
    """

    def __init__(self, *, num_experts: int, dim: int, hidden: int, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        def param(shape, axes):
            init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2,
                                                     batch_axis=(0,))
            return nnx.Param(init(rngs.params(), shape, param_dtype), **logical(axes))

        self.gate_proj = param((num_experts, dim, hidden), ("experts", "embed", "moe_mlp"))
        self.up_proj = param((num_experts, dim, hidden), ("experts", "embed", "moe_mlp"))
        self.down_proj = param((num_experts, hidden, dim), ("experts", "moe_mlp", "embed"))
        self.num_experts, self.dtype = num_experts, dtype

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(w[...].astype(self.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))

    def grouped(self, rows: jax.Array, group_sizes: jax.Array, backend: str,
                weights: tuple[jax.Array, jax.Array, jax.Array] | None = None) -> jax.Array:
        """rows [N, D] sorted by expert, group_sizes [E] -> [N, D] through each row's expert (dropless; rows past
        sum(group_sizes) give zeros). `weights`: (gate, up, down) of these E experts, default all of `weights()`
        (expert parallelism passes one device's share)."""
        matmul = GROUPED_MATMULS[backend]()
        w_gate, w_up, w_down = self.weights() if weights is None else weights
        gate = name(matmul(rows, w_gate, group_sizes), "moe_mlpwi_0", (None, "moe_mlp"))
        up = name(matmul(rows, w_up, group_sizes), "moe_mlpwi_1", (None, "moe_mlp"))
        return name(matmul(jax.nn.silu(gate) * up, w_down, group_sizes), "moe_mlpwo", (None, "embed"))

    def batched(self, buf: jax.Array) -> jax.Array:
        """buf [E, C, D] (expert e's rows in buf[e]) -> [E, C, D]: a batched einsum per expert. Under a mesh the
        buffers are constrained experts -> ep (and their rows over the batch groups' data axes)."""
        w_gate, w_up, w_down = self.weights()
        buf = sharding.constrain(buf, ("experts", "exp_batch", "embed"))
        gate = name(jnp.einsum("ecd,edf->ecf", buf, w_gate), "moe_mlpwi_0", ("experts", "exp_batch", "moe_mlp"))
        up = name(jnp.einsum("ecd,edf->ecf", buf, w_up), "moe_mlpwi_1", ("experts", "exp_batch", "moe_mlp"))
        return name(jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w_down), "moe_mlpwo",
                    ("experts", "exp_batch", "embed"))
