"""The mixture-of-experts layer: a router, a dispatch backend, the routed experts and an optional shared expert.

`MoE.__call__` returns (y, `MoEAux`), which a scanned stack stacks over its layers. Training adds
`total_balance_loss(aux)` to its loss and, for a router with a `RoutingBias` (not an `nnx.Param`: optimizers leave it
alone), calls `update_routing_bias(model, aux, rate)` after the step (docs/own-loop.md). Submodule names follow
transformers.
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
from einops import rearrange
from flax import nnx, struct

from zoo import sharding
from zoo.layers.mlp import MLP
from zoo.layers.moe import backend as backends
from zoo.layers.moe import dispatch, expert_parallel
from zoo.layers.moe.experts import Experts
from zoo.layers.moe.router import Router, RoutingBias
from zoo.layers.tagged import TaggedLayer
from zoo.layers.tiles import tiled
from zoo.logical import split_embed


@struct.dataclass
class MoEAux:
    """What a MoE layer reports besides its output (a scanned stack stacks it over its layers).

    Args:
        load: float32 [E]: the token copies routed to each expert (before any drop).
        balance_loss: float32 []: the router's balance loss, already weighted (add it to the loss).
        dropped: int32 []: the copies dropped by capacity dispatch (0 for the dropless backends).

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.layers import MoEAux
        >>> MoEAux(load=jnp.ones(4), balance_loss=jnp.zeros(()), dropped=jnp.zeros((), jnp.int32)).load.shape
        (4,)
    """
    load: jax.Array           # float32 [E]: token copies routed to each expert (before any drop)
    balance_loss: jax.Array   # float32 []: the router's balance loss, already weighted (add it to the loss)
    dropped: jax.Array        # int32 []: copies dropped by capacity dispatch (0 for the dropless backends)


class MoE(TaggedLayer):
    """The mixture-of-experts feed-forward of DeepSeekMoE (Dai et al., 2024; DeepSeek-V2/V3: fine-grained routed experts
    and an always-on shared expert) and of Qwen3-MoE: y = shared(x) + sum over the k chosen experts of
    weight * expert(x). The router chooses; the backend that runs the experts (`runs`, and why: `choice`) is chosen
    once, when the layer is built, never while tracing; a build where "auto" falls back to capacity dispatch warns.

    Args:
        dim: the model width D.
        router: a `Router` (`GroupLimitedRouter`, `SoftmaxRouter`).
        experts: the routed `Experts` (as many as the router chooses among).
        shared: the shared expert, an `MLP(tag_prefix="shared_")`, or None.
        backend: "auto", "ragged_dot", "tokamax" or "capacity" (`zoo.layers.moe.backend`).
        capacity_factor: the capacity backend's rows per expert, as a multiple of an even share.
        ep_dispatch: "gather" or "ragged_a2a" (dropless expert parallelism over a ragged all-to-all).
        dtype: the computation's dtype.
        device: the device the backend is chosen for (default: the first).

    Emits:
        `moe_mlpwi_0`, `moe_mlpwi_1`, `moe_mlpwo` (the routed experts'), and with a shared expert `shared_mlpwi_0`,
        `shared_mlpwi_1`, `shared_mlpwo`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import MoE, SoftmaxRouter
        >>> from zoo.layers.moe import Experts
        >>> rngs = nnx.Rngs(0)
        >>> moe = MoE(dim=8, router=SoftmaxRouter(dim=8, num_experts=4, k=2, rngs=rngs),
        ...           experts=Experts(num_experts=4, dim=8, hidden=16, rngs=rngs), backend="ragged_dot")
        >>> y, aux = moe(jnp.ones((1, 4, 8)))
        >>> y.shape, aux.load.tolist()
        ((1, 4, 8), [0.0, 0.0, 4.0, 4.0])
        >>> list(moe.tag_shapes(batch=1, seq=4))
        ['moe_mlpwi_0', 'moe_mlpwi_1', 'moe_mlpwo']
    """

    def __init__(self, *, dim: int, router: Router, experts: Experts, shared: MLP | None = None,
                 backend: backends.Backend = "auto", capacity_factor: float = 1.25,
                 ep_dispatch: backends.EpDispatch = "gather", dtype=jnp.float32, device: jax.Device | None = None):
        # fails early on an unknown or missing backend, or one ep_dispatch cannot run
        runs, why = backends.backend_choice(backend, dtype=dtype, device=device, ep_dispatch=ep_dispatch)
        if router.num_experts != experts.num_experts:
            raise ValueError(f"MoE: the router chooses among {router.num_experts} experts, but there are "
                             f"{experts.num_experts}")
        if runs == "capacity" and backend == "auto":
            warnings.warn(f"MoE: {why}", stacklevel=2)
        self.dim, self.dtype = dim, dtype
        self.gate, self.experts, self.shared_experts = router, experts, shared
        self.backend, self.capacity_factor, self.ep_dispatch = backend, capacity_factor, ep_dispatch
        self.runs, self.choice = runs, why

    def __call__(self, x: jax.Array, *, tiles: int = 1) -> tuple[jax.Array, MoEAux]:
        """Route each token to its experts and sum their outputs.

        Args:
            x: [B, S, D].
            tiles: run the shared expert (per token) over this many sequence tiles (`zoo.layers.tiles`); the routed
                experts' dispatch always takes the whole batch (capacity and the balance loss count over it).

        Returns:
            (y [B, S, D] in `dtype`, `MoEAux`).
        """
        b, s, _ = x.shape
        backend = self.runs
        # Dispatch groups: one per shard of the batch under a mesh (GShard), one on a single device (a batch the
        # mesh does not divide, e.g. the recipe check's batch of 1, gets gcd(batch, shards)). The dropless backends
        # sort all copies at once (one group), or each device its own under expert parallelism (ragged_a2a; a
        # batch the mesh does not divide takes the one-group path).
        shards = sharding.size_of("batch")
        g = math.gcd(b, shards) if backend == "capacity" else 1
        ep = (self.ep_dispatch == "ragged_a2a" and backend != "capacity" and (b * s) % shards == 0
              and max(shards, sharding.size_of("experts")) > 1)
        flat = rearrange(x, "(g b) s d -> g (b s) d", g=g)
        if g > 1:
            flat = sharding.constrain(flat, ("batch", None, "embed"))
        scores, weights, idx = self.gate(rearrange(flat, "g t d -> (g t) d"))
        if ep:
            out = expert_parallel.expert_parallel(
                flat[0], idx, self.experts.weights(),
                lambda rows, sizes, w: self.experts.grouped(rows, sizes, backend, weights=w))
            out = rearrange(out, "(t k) d -> t k d", k=self.gate.k)
            load = jnp.bincount(idx.reshape(-1), length=self.gate.num_experts)
            dropped = jnp.zeros((), jnp.int32)
        else:
            # One group (dropless): every copy sorted at once, the rows whole over the batch and split like the
            # experts' `embed`, moved there (and the gradients back) explicitly (`split_embed`): left to XLA, the
            # sort's gathers and scatters replicate whole [B*S*k, D] tensors to reach that layout.
            rows = flat if g > 1 else rearrange(split_embed(x, keep_batch=False), "b s d -> 1 (b s) d")
            copies = dispatch.sort_by_expert(rows, rearrange(idx, "(g t) k -> g t k", g=g), self.gate.num_experts)
            if backend == "capacity":
                out, dropped = dispatch.capacity_dispatch(copies, self.experts.batched, self.capacity_factor)
            else:
                out = self.experts.grouped(copies.rows[0], copies.group_sizes[0], backend)[None]
                dropped = jnp.zeros((), jnp.int32)
            # Back to token order.
            out = dispatch.unsort(out, copies)
            if g == 1:   # in the rows' layout (above) until the weighted sum
                out = sharding.constrain(out, (None, None, "embed"))
            out = rearrange(out, "g (t k) d -> (g t) k d", k=self.gate.k)
            load = jnp.sum(copies.group_sizes, axis=0)
        # Weighted sum over each token's k experts (accumulated in float32, or wider for float64 activations).
        y = jnp.einsum("tkd,tk->td", out, weights.astype(out.dtype),
                       preferred_element_type=jnp.promote_types(out.dtype, jnp.float32))
        y = rearrange(y.astype(self.dtype), "(g b s) d -> (g b) s d", g=g, s=s)
        if self.shared_experts is not None:
            y = y + tiled(lambda shared, t: shared(t), self.shared_experts, x, tiles)
        return y, MoEAux(load=load.astype(jnp.float32), balance_loss=self.gate.balance_loss(scores, idx, batch=b),
                         dropped=dropped)


# -- reading a model's aux ({stack: MoEAux stacked over layers, or {} for a stack without experts}) ----------------
def moe_records(aux: Any) -> list[MoEAux]:
    """The MoE records of a model's aux (`model(tokens, return_aux=True)[1]`), or of one layer's own aux.

    Args:
        aux: {stack: `MoEAux` stacked over its layers, or {}}, or a `MoEAux`.

    Returns:
        the `MoEAux` records.

    Examples:
        >>> from zoo.layers.moe import moe_records
        >>> moe_records({"layers": {}})
        []
    """
    if isinstance(aux, MoEAux):
        return [aux]
    return [a for a in (aux.values() if isinstance(aux, dict) else ()) if isinstance(a, MoEAux)]


def total_balance_loss(aux: Any) -> jax.Array:
    """The balance loss summed over every MoE layer (each already weighted): what training adds to its loss.

    Args:
        aux: a model's aux or a layer's (`moe_records`).

    Returns:
        [] float32 (0 without MoE layers).

    Examples:
        >>> from zoo.layers.moe import total_balance_loss
        >>> float(total_balance_loss({}))
        0.0
    """
    return sum((jnp.sum(a.balance_loss) for a in moe_records(aux)), jnp.zeros((), jnp.float32))


def drops(aux: Any) -> tuple[jax.Array, jax.Array]:
    """The token copies dropped by capacity dispatch, and those routed, summed over every MoE layer.

    Args:
        aux: a model's aux or a layer's (`moe_records`).

    Returns:
        (dropped, routed), int32 [].

    Examples:
        >>> from zoo.layers.moe import drops
        >>> [int(n) for n in drops({})]
        [0, 0]
    """
    records = moe_records(aux)
    dropped = sum((jnp.sum(a.dropped).astype(jnp.int32) for a in records), jnp.zeros((), jnp.int32))
    routed = sum((jnp.sum(a.load).astype(jnp.int32) for a in records), jnp.zeros((), jnp.int32))
    return dropped, routed


def routing_bias_delta(load: jax.Array, rate: float) -> jax.Array:
    """DeepSeek-V3's auxiliary-loss-free bias step (arXiv:2412.19437, 2.1.2): rate * sign(mean load - load), raising the
    bias of the under-loaded experts and lowering that of the over-loaded.

    Args:
        load: [..., E] copies routed to each expert.
        rate: the bias update speed (gamma).

    Returns:
        [..., E] float32.

    Examples:
        >>> import jax.numpy as jnp
        >>> from zoo.layers.moe import routing_bias_delta
        >>> (routing_bias_delta(jnp.array([3.0, 1.0]), 0.001) * 1000).tolist()
        [-1.0, 1.0]
    """
    load = jnp.asarray(load, jnp.float32)
    return rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def update_routing_bias(model: nnx.Module, aux: Any, rate: float) -> None:
    """Add `routing_bias_delta` in place to the `RoutingBias` of every stack of `model` whose aux is a `MoEAux` ([L, E]
    loads), or of a single MoE layer given its own aux ([E]): the step after each update of DeepSeek-V3's training.

    Args:
        model: the model (or the MoE layer) holding the biases.
        aux: its aux (`model(tokens, return_aux=True)[1]`).
        rate: the bias update speed (gamma).

    Raises:
        ValueError: where a stack holds no single `RoutingBias` of the loads' shape.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import GroupLimitedRouter, MoE, MoEAux
        >>> from zoo.layers.moe import Experts, update_routing_bias
        >>> rngs = nnx.Rngs(0)
        >>> router = GroupLimitedRouter(dim=8, num_experts=4, k=2, n_group=2, topk_group=1, routed_scaling_factor=1.0,
        ...                             rngs=rngs)
        >>> moe = MoE(dim=8, router=router, experts=Experts(num_experts=4, dim=8, hidden=16, rngs=rngs),
        ...           backend="ragged_dot")
        >>> update_routing_bias(moe, MoEAux(load=jnp.array([3.0, 1.0, 0.0, 0.0]), balance_loss=jnp.zeros(()),
        ...                                 dropped=jnp.zeros((), jnp.int32)), 0.001)
        >>> (moe.gate.e_score_correction_bias[...] * 1000).tolist()
        [-1.0, 0.0, 1.0, 1.0]
    """
    if isinstance(aux, MoEAux):
        targets = [(model, aux.load)]
    else:
        targets = [(getattr(model, n), a.load) for n, a in aux.items() if isinstance(a, MoEAux)]
    for module, load in targets:
        biases = [v for _, v in nnx.iter_graph(module) if isinstance(v, RoutingBias)]
        if len(biases) != 1 or biases[0].shape != load.shape:
            raise ValueError(f"update_routing_bias: expected one RoutingBias of shape {load.shape} in "
                             f"{type(module).__name__}, found {[b.shape for b in biases]}")
        biases[0][...] = biases[0][...] + routing_bias_delta(load, rate).astype(biases[0].dtype)
