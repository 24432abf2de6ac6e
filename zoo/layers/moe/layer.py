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
    """What a MoE layer reports besides its output (stacked over layers by a scanned stack)."""
    load: jax.Array           # float32 [E]: token copies routed to each expert (before any drop)
    balance_loss: jax.Array   # float32 []: the router's balance loss, already weighted (add it to the loss)
    dropped: jax.Array        # int32 []: copies dropped by capacity dispatch (0 for the dropless backends)


class MoE(TaggedLayer):
    """The MoE layer, for one device kind: the backend that runs (`runs`, and why: `choice`) is chosen once, when
    the layer is built (`backend_choice` for `device`, default the first device), never while tracing; a build
    where "auto" falls back to capacity dispatch warns then."""

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
        """x [B, S, D] -> (y [B, S, D], aux). `tiles`: the shared expert (per token) runs over that many sequence
        tiles (`zoo.layers.tiles`); the routed experts' dispatch always takes the whole batch (capacity and the
        balance loss count over it)."""
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
    """The MoE records of a model's aux (`model(tokens, return_aux=True)[1]`), or of one layer's own aux."""
    if isinstance(aux, MoEAux):
        return [aux]
    return [a for a in (aux.values() if isinstance(aux, dict) else ()) if isinstance(a, MoEAux)]


def total_balance_loss(aux: Any) -> jax.Array:
    """The balance loss summed over every MoE layer."""
    return sum((jnp.sum(a.balance_loss) for a in moe_records(aux)), jnp.zeros((), jnp.float32))


def drops(aux: Any) -> tuple[jax.Array, jax.Array]:
    """(token copies dropped by capacity dispatch, token copies routed), summed over every MoE layer."""
    records = moe_records(aux)
    dropped = sum((jnp.sum(a.dropped).astype(jnp.int32) for a in records), jnp.zeros((), jnp.int32))
    routed = sum((jnp.sum(a.load).astype(jnp.int32) for a in records), jnp.zeros((), jnp.int32))
    return dropped, routed


def routing_bias_delta(load: jax.Array, rate: float) -> jax.Array:
    """The auxiliary-loss-free step of the bias for per-expert `load` [..., E]: rate * sign(mean - load)."""
    load = jnp.asarray(load, jnp.float32)
    return rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def update_routing_bias(model: nnx.Module, aux: Any, rate: float) -> None:
    """Add `routing_bias_delta` in place to the `RoutingBias` of every stack of `model` whose aux is a `MoEAux`
    ([L, E] loads), or of a single MoE layer given its own aux ([E])."""
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
