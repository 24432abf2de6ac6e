"""DeepSeek-V3's mixture of experts (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report", sections 2.1.2 and 2.1.3).

Routing. Each token's affinity to expert i is s_i = sigmoid(x . g_i), in float32. A score-correction bias b_i,
used only to *choose* experts, keeps the load balanced without an auxiliary loss. Choice is group-limited: the
experts are split into `n_group` groups; a group scores the sum of its two best biased affinities; the
`topk_group` best groups are kept and the top-k experts are chosen among them by biased affinity. The chosen
experts' weights are their *unbiased* affinities, normalised to sum to one and times `routed_scaling_factor`.

Dispatch. The B*S*k token copies are sorted by expert, run through the experts' SwiGLU as a grouped matmul, put
back in token order and summed with the routing weights. One shared expert sees every token. Backends:

- ``"ragged_dot"``: `jax.lax.ragged_dot`, dropless; the reference, and right on CPU. On GPUs (jax 0.11) XLA
  computes every expert for every row: 48 TFLOP/s on an H200 where a batched einsum reaches 805 (ANCHORS.md).
- ``"tokamax"``: tokamax's `ragged_dot` (a real grouped GEMM; Mosaic GPU kernel), dropless, same API and
  results; imported only when chosen (it needs jax >= 0.11.1 and is not a dependency of the zoo). On an NVIDIA
  GPU the zoo asks for its Mosaic kernel by name, so an unsupported case fails loudly instead of falling back to
  XLA's dense ragged_dot; elsewhere tokamax picks (XLA on a CPU). Its kernel has a scan of its own, with no tag
  and no offload inside: `zoo.tags` allows that (it refuses only a loop that holds a tag or an offload).
- ``"capacity"``: each expert takes at most C = ceil(capacity_factor * B*S*k / experts) copies (the first ones
  in token order); the experts run as a batched einsum over an [experts, C, hidden] buffer. Copies over an
  expert's capacity are dropped (they add nothing) and counted in the aux output. Its tags moe_mlpwi_0,
  moe_mlpwi_1, moe_mlpwo are the [experts, C, F] / [experts, C, D] buffers, not [B*S*k, ...] rows.
- ``"auto"``: only a backend known to run well on the device. On an NVIDIA GPU: tokamax when it imports and its
  Mosaic kernel covers the case (bf16/fp16, compute capability 8.x, 9.x or 10.x); otherwise capacity dispatch,
  with a warning that it drops copies over capacity, since ragged_dot computes every expert for every row there
  (48 against 805 TFLOP/s on an H200, and out of memory at the deepseek-slice batch; ANCHORS.md). On any other
  device: ragged_dot (exact, and what XLA does well on CPUs and TPUs). `backend_choice` says which and why.

Every backend gives the same outputs when nothing is dropped.

Under a mesh (`zoo.sharding`). The capacity backend is GShard's: the batch is cut into G groups, one per shard of
the batch (dp x fsdp x ep; G = 1 on one device), each group routes and fills its own C = ceil(capacity_factor *
group copies / experts) slots, and the buffer is laid out [experts, G*C, ...] with experts over `ep` and the groups
over dp x fsdp: XLA moves each copy to its expert's device and back with all-to-alls, and every expert's
activations stay on its device (the tags are these sharded buffers: per-device host bytes = plan / shards).
Capacity is per group, so which copies drop can depend on the mesh; with nothing dropped the results equal one
device's. The dropless backends (ragged_dot, tokamax) sort all copies at once: under a mesh they run correctly,
XLA gathering the rows and the expert weights (no expert parallelism; their moe_* tags are not sharded over the
batch). A `jax.lax.ragged_all_to_all` dispatch under `shard_map` is not built (XLA:CPU has no ragged-all-to-all,
so it could not be tested here). Load statistics (`aux["load"]`, summed over groups) and the balance loss are
global: the routing-bias update is the same on any mesh.

Tags: moe_mlpwi_0 (experts' gate, before the activation), moe_mlpwi_1 (up), moe_mlpwo (down) over the dispatched
rows; shared_mlpwi_0, shared_mlpwi_1, shared_mlpwo (the shared expert). No tag sits inside a loop: the stack is the
only scan that holds tags (a grouped-matmul kernel may loop internally).

Balance. `MoE.__call__` returns (y, aux) with
- ``aux["load"]``: float32 [experts], token copies routed to each expert (before any drop),
- ``aux["balance_loss"]``: float32 [], the complementary sequence-wise balance loss, already times
  `balance_loss_weight` (add it to the training loss; its gradient reaches the router weights),
- ``aux["dropped"]``: int32 [], token copies dropped by capacity dispatch (0 for the dropless backends).
A scanned stack stacks them over layers ([L, experts], [L], [L]). The training loop applies the bias update
b += rate * sign(mean(load) - load) with `update_routing_bias(model, aux, rate)` (or `routing_bias_delta` in a
functional loop). The bias is a `RoutingBias`, not an `nnx.Param`: optimizers over `nnx.Param` leave it alone.
A functional loop that splits (params, rest) and merges inside `jax.grad` must merge with
`nnx.merge(graphdef, params, rest, copy=True)`: otherwise the bias variable belongs to the outer trace and
`nnx.scan` refuses it ("Cannot extract graph node from different trace level").

Parameter names follow transformers' `DeepseekV3MoE`: gate (kernel [D, experts] and e_score_correction_bias),
experts (gate_proj, up_proj [experts, D, F], down_proj [experts, F, D]), shared_experts (an `MLP`).
"""
from __future__ import annotations

import functools
import importlib
import math
import warnings
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
from einops import rearrange, repeat
from flax import nnx

from zoo import sharding
from zoo.layers import grouped_matmul
from zoo.layers.linear import fan_in_init, logical
from zoo.layers.mlp import MLP
from zoo.layers.tagged import TaggedLayer
from zoo.tags import name

Backend = Literal["auto", "ragged_dot", "tokamax", "capacity"]
BACKENDS: tuple[str, ...] = ("auto", "ragged_dot", "tokamax", "capacity")


class RoutingBias(nnx.Variable):
    """DeepSeek-V3's e_score_correction_bias: set by the load-balancing update, never by gradients."""


# -- routing ------------------------------------------------------------------------------------------------
def route(scores: jax.Array, bias: jax.Array, *, k: int, n_group: int, topk_group: int,
          routed_scaling_factor: float, norm_topk_prob: bool = True) -> tuple[jax.Array, jax.Array]:
    """Group-limited top-k of DeepSeek-V3 over sigmoid `scores` [T, E] (float32) with the selection `bias` [E].

    Returns (weights [T, k] float32, expert indices [T, k] int32). The bias only chooses; weights are unbiased."""
    t, e = scores.shape
    biased = scores + jax.lax.stop_gradient(bias)
    grouped = biased.reshape(t, n_group, e // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, e // n_group))[0], axis=-1)        # [T, G]
    _, top_groups = jax.lax.top_k(group_scores, topk_group)                                 # [T, topk_group]
    group_mask = jnp.any(jax.nn.one_hot(top_groups, n_group, dtype=jnp.bool_), axis=1)                 # [T, G]
    expert_mask = jnp.repeat(group_mask, e // n_group, axis=1)                              # [T, E]
    _, idx = jax.lax.top_k(jnp.where(expert_mask, jax.lax.stop_gradient(biased), -jnp.inf), k)
    weights = jnp.take_along_axis(scores, idx, axis=1)
    if norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * routed_scaling_factor, idx.astype(jnp.int32)


class Router(nnx.Module):
    """Sigmoid affinities of each token to each expert, and DeepSeek-V3's group-limited choice."""

    def __init__(self, *, dim: int, num_experts: int, k: int, n_group: int, topk_group: int,
                 routed_scaling_factor: float, norm_topk_prob: bool = True, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        self.kernel = nnx.Param(fan_in_init((dim, num_experts), 1)(rngs.params(), (dim, num_experts), param_dtype),
                                **logical(("embed", "experts")))
        self.e_score_correction_bias = RoutingBias(jnp.zeros((num_experts,), jnp.float32), **logical(("experts",)))
        self.k, self.n_group, self.topk_group = k, n_group, topk_group
        self.routed_scaling_factor, self.norm_topk_prob = routed_scaling_factor, norm_topk_prob

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [T, D] -> (scores [T, E], weights [T, k], indices [T, k]); scores and weights in float32."""
        scores = jax.nn.sigmoid(x.astype(jnp.float32) @ self.kernel[...].astype(jnp.float32))
        weights, idx = route(scores, self.e_score_correction_bias[...], k=self.k, n_group=self.n_group,
                             topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                             norm_topk_prob=self.norm_topk_prob)
        return scores, weights, idx


def balance_loss(scores: jax.Array, idx: jax.Array, *, batch: int, weight: float) -> jax.Array:
    """The complementary sequence-wise balance loss: weight * mean over sequences of sum_i f_i P_i, where
    f_i = E / (k S) * (copies of the sequence routed to i) and P_i = mean over the sequence of s_i / sum_j s_j."""
    t, e = scores.shape
    k = idx.shape[1]
    s = t // batch
    counts = jnp.sum(jax.nn.one_hot(idx.reshape(batch, s * k), e, dtype=jnp.float32), axis=1)   # [B, E]
    f = jax.lax.stop_gradient(counts * (e / (k * s)))
    p = jnp.mean((scores / jnp.sum(scores, axis=-1, keepdims=True)).reshape(batch, s, e), axis=1)
    return weight * jnp.mean(jnp.sum(f * p, axis=-1))


def routing_bias_delta(load: jax.Array, rate: float) -> jax.Array:
    """The auxiliary-loss-free step of the bias for per-expert `load` [..., E]: rate * sign(mean - load)."""
    load = jnp.asarray(load, jnp.float32)
    return rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def update_routing_bias(model: nnx.Module, aux: dict[str, Any], rate: float) -> None:
    """Add `routing_bias_delta` in place to every stack of `model` whose aux has a "load" ([L, E] from
    `model(tokens, return_aux=True)`), or to a single MoE layer given its own aux ([E])."""
    if "load" in aux:
        targets = [(model, aux["load"])]
    else:
        targets = [(getattr(model, n), a["load"]) for n, a in aux.items() if isinstance(a, dict) and "load" in a]
    for module, load in targets:
        biases = [v for _, v in nnx.iter_graph(module) if isinstance(v, RoutingBias)]
        if len(biases) != 1 or biases[0].shape != load.shape:
            raise ValueError(f"update_routing_bias: expected one RoutingBias of shape {load.shape} in "
                             f"{type(module).__name__}, found {[b.shape for b in biases]}")
        biases[0][...] = biases[0][...] + routing_bias_delta(load, rate).astype(biases[0].dtype)


# -- the experts and their dispatch ---------------------------------------------------------------------------
@functools.cache
def tokamax_status() -> tuple[bool, str]:
    """(True, version) if tokamax imports here, else (False, why not). Imported once, only when asked."""
    try:
        tokamax = importlib.import_module("tokamax")
    except Exception as e:  # ImportError, or a dependency failing at import
        return False, f"tokamax does not import ({type(e).__name__}: {str(e)[:200]})"
    return True, f"tokamax {getattr(tokamax, '__version__', '?')}"


def tokamax_available() -> bool:
    return tokamax_status()[0]


def _is_nvidia(device: jax.Device) -> bool:
    return device.platform == "gpu" and "cuda" in str(getattr(device.client, "platform_version", "")).lower()


def _tokamax_kernel_covers(device: jax.Device, dtype) -> str | None:
    """None if tokamax's Mosaic GPU grouped matmul covers `dtype` on `device`, else the reason it does not."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"its Mosaic GPU kernel takes bf16/fp16, not {jnp.dtype(dtype).name}"
    cc = str(getattr(device, "compute_capability", ""))
    if cc.split(".")[0] not in ("8", "9", "10"):
        return f"its Mosaic GPU kernel has no version for compute capability {cc or 'unknown'}"
    return None


def backend_choice(backend: str, *, dtype=jnp.bfloat16, device: jax.Device | None = None) -> tuple[str, str]:
    """(the backend that runs, why) for the configured `backend` on `device` (default: the first device)."""
    if backend not in BACKENDS:
        raise ValueError(f"moe_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "tokamax":
        ok, why = tokamax_status()
        if not ok:
            raise ValueError(f"moe_backend='tokamax' needs the tokamax package (pip install tokamax; jax >= 0.11.1): "
                             f"{why}; use 'ragged_dot' or 'capacity'")
        device = device or jax.devices()[0]
        tiles = f"; {grouped_matmul.tiles_for(device.device_kind)[1]}" if _is_nvidia(device) else ""
        return "tokamax", f"asked for ({why}){tiles}"
    if backend != "auto":
        return backend, "asked for"
    device = device or jax.devices()[0]
    if not _is_nvidia(device):
        return "ragged_dot", f"auto on {device.platform}: jax.lax.ragged_dot, dropless"
    ok, why = tokamax_status()
    if ok:
        why = _tokamax_kernel_covers(device, dtype)
        if why is None:
            return "tokamax", (f"auto on {device.device_kind}: tokamax's Mosaic GPU grouped matmul, dropless; "
                               f"{grouped_matmul.tiles_for(device.device_kind)[1]}")
    return "capacity", (f"auto on {device.device_kind}: capacity dispatch (drops copies over capacity; counted in "
                        f"aux['dropped']), because tokamax is unusable ({why}) and jax.lax.ragged_dot computes "
                        f"every expert for every row on GPUs")


def resolve_backend(backend: str, *, dtype=jnp.bfloat16, device: jax.Device | None = None) -> str:
    """The backend that runs for the configured `backend` (see `backend_choice`)."""
    return backend_choice(backend, dtype=dtype, device=device)[0]


def _tokamax_ragged_dot() -> Callable:
    tokamax = importlib.import_module("tokamax")
    device = jax.devices()[0]
    if not _is_nvidia(device):  # CPU tests: tokamax chooses, i.e. XLA
        return functools.partial(tokamax.ragged_dot, implementation=None)
    # On an NVIDIA GPU the Mosaic kernel by name: an unsupported case raises instead of silently taking XLA's
    # dense ragged_dot. With measured tiles for this device, every problem (forward and backward) runs its own.
    tiles, _ = grouped_matmul.tiles_for(device.device_kind)
    if tiles:
        return grouped_matmul.tokamax_tiled(tiles)
    return functools.partial(tokamax.ragged_dot, implementation="mosaic")


# backend -> a factory of its grouped matmul, with `jax.lax.ragged_dot`'s signature (rows [N, D] sorted by group,
# weights [G, D, F], group_sizes [G]) -> [N, F]. Tests swap an entry for a stand-in (with monkeypatch).
GROUPED_MATMULS: dict[str, Callable[[], Callable]] = {
    "ragged_dot": lambda: jax.lax.ragged_dot,
    "tokamax": _tokamax_ragged_dot,
}


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)


def capacity(num_rows: int, num_experts: int, capacity_factor: float) -> int:
    """Rows each expert takes under capacity dispatch: ceil(capacity_factor * rows / experts), at least 1."""
    return max(1, math.ceil(capacity_factor * num_rows / num_experts))


class Experts(nnx.Module):
    """`num_experts` SwiGLU experts, stored stacked: gate_proj, up_proj [E, D, F], down_proj [E, F, D]."""

    def __init__(self, *, num_experts: int, dim: int, hidden: int, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):
        def param(shape, axes):
            init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=1, out_axis=2,
                                                     batch_axis=(0,))
            return nnx.Param(init(rngs.params(), shape, param_dtype), **logical(axes))

        self.gate_proj = param((num_experts, dim, hidden), ("experts", "embed", "moe_mlp"))
        self.up_proj = param((num_experts, dim, hidden), ("experts", "embed", "moe_mlp"))
        self.down_proj = param((num_experts, hidden, dim), ("experts", "moe_mlp", "embed"))
        self.dtype = dtype

    def weights(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return tuple(w[...].astype(self.dtype) for w in (self.gate_proj, self.up_proj, self.down_proj))

    def grouped(self, rows: jax.Array, group_sizes: jax.Array, backend: str) -> jax.Array:
        """rows [N, D] sorted by expert, group_sizes [E] -> [N, D] through each row's expert (dropless)."""
        matmul = GROUPED_MATMULS[backend]()
        w_gate, w_up, w_down = self.weights()
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


def check_routing(*, num_experts: int, k: int, n_group: int, topk_group: int, where: str) -> None:
    """The group-limited router's limits (the one place they are checked: the MoE layer and DeepSeekV3Config)."""
    if num_experts % n_group:
        raise ValueError(f"{where}: n_group={n_group} must divide num_experts={num_experts}")
    if not 0 < topk_group <= n_group:
        raise ValueError(f"{where}: topk_group={topk_group} must be in [1, n_group={n_group}]")
    if not 0 < k <= topk_group * (num_experts // n_group):
        raise ValueError(f"{where}: num_experts_per_tok={k} must be in [1, {topk_group * (num_experts // n_group)}] "
                         f"(topk_group * experts per group)")


class MoE(TaggedLayer):
    def __init__(self, *, dim: int, num_experts: int, k: int, hidden: int, num_shared_experts: int = 1,
                 n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
                 norm_topk_prob: bool = True, backend: Backend = "auto", capacity_factor: float = 1.25,
                 balance_loss_weight: float = 1e-4, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.dim, self.dtype = dim, dtype
        check_routing(num_experts=num_experts, k=k, n_group=n_group, topk_group=topk_group, where="MoE")
        backend_choice(backend, dtype=dtype)  # fail early on an unknown or missing backend
        self.gate = Router(dim=dim, num_experts=num_experts, k=k, n_group=n_group, topk_group=topk_group,
                           routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob,
                           param_dtype=param_dtype, rngs=rngs)
        self.experts = Experts(num_experts=num_experts, dim=dim, hidden=hidden, dtype=dtype, param_dtype=param_dtype,
                               rngs=rngs)
        self.shared_experts = MLP(dim=dim, hidden=hidden * num_shared_experts, dtype=dtype, param_dtype=param_dtype,
                                  tag_prefix="shared_", rngs=rngs) if num_shared_experts else None
        self.num_experts, self.k = num_experts, k
        self.backend, self.capacity_factor = backend, capacity_factor
        self.balance_loss_weight = balance_loss_weight

    def __call__(self, x: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """x [B, S, D] -> (y [B, S, D], aux); see the module docstring for aux."""
        b, s, _ = x.shape
        e, k = self.num_experts, self.k
        backend, why = backend_choice(self.backend, dtype=self.dtype)
        if backend == "capacity" and self.backend == "auto":
            _warn_once(f"MoE: {why}")
        # Dispatch groups: one per shard of the batch under a mesh (GShard), one on a single device (a batch the
        # mesh does not divide, e.g. the recipe check's batch of 1, gets gcd(batch, shards)). The dropless backends
        # sort all copies at once (one group).
        g = math.gcd(b, sharding.size_of("batch")) if backend == "capacity" else 1
        flat = rearrange(x, "(g b) s d -> g (b s) d", g=g)
        if g > 1:
            flat = sharding.constrain(flat, ("batch", None, "embed"))
        scores, weights, idx = self.gate(rearrange(flat, "g t d -> (g t) d"))
        idx_g = rearrange(idx, "(g t) k -> g (t k)", g=g)                               # expert of each copy

        # Sort each group's T*k token copies by expert (stable: token order within an expert).
        order = jnp.argsort(idx_g, axis=-1, stable=True)
        inverse = jnp.argsort(order, axis=-1)
        group_sizes = jax.vmap(lambda i: jnp.bincount(i, length=e))(idx_g).astype(jnp.int32)        # [G, E]
        rows = jnp.take_along_axis(repeat(flat, "g t d -> g (t k) d", k=k), order[..., None], axis=1)  # by expert
        expert = jnp.take_along_axis(idx_g, order, axis=-1)

        if backend == "capacity":
            out, dropped = self._capacity_dispatch(rows, expert, group_sizes)
        else:
            out = self.experts.grouped(rows[0], group_sizes[0], backend)[None]
            dropped = jnp.zeros((), jnp.int32)

        # Back to token order, weighted sum over each token's k experts (accumulated in float32).
        out = rearrange(jnp.take_along_axis(out, inverse[..., None], axis=1), "g (t k) d -> (g t) k d", k=k)
        y = jnp.einsum("tkd,tk->td", out, weights.astype(out.dtype), preferred_element_type=jnp.float32)
        y = rearrange(y.astype(self.dtype), "(g b s) d -> (g b) s d", g=g, s=s)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        aux = {"load": jnp.sum(group_sizes, axis=0).astype(jnp.float32),     # global: summed over the groups
               "balance_loss": balance_loss(scores, idx, batch=b, weight=self.balance_loss_weight),
               "dropped": dropped}
        return y, aux

    def _capacity_dispatch(self, rows: jax.Array, expert: jax.Array, group_sizes: jax.Array):
        """rows [G, N, D] sorted by `expert` [G, N] within each group -> (out [G, N, D] with dropped rows zero,
        number dropped). Each group fills its own [E, C] slots; the buffer is laid out [E, G*C, D] with experts
        over `ep`, so under expert parallelism XLA moves the copies to their experts' devices (an all-to-all)."""
        g, n, d = rows.shape                                                             # n: copies per group
        e = self.num_experts
        c = capacity(n, e, self.capacity_factor)
        starts = jnp.cumsum(group_sizes, axis=-1) - group_sizes                          # [G, E]
        slot = jnp.arange(n, dtype=jnp.int32) - jnp.take_along_axis(starts, expert, axis=-1)  # rank in its expert
        group = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32)[:, None], (g, n))
        buf = jnp.zeros((g, e, c, d), rows.dtype).at[group, expert, slot].set(rows, mode="drop")
        buf = rearrange(buf, "g e c d -> e (g c) d")
        out = rearrange(self.experts.batched(buf), "e (g c) d -> g e c d", g=g)
        out = sharding.constrain(out, ("batch", None, None, "embed"))
        out = out.at[group, expert, slot].get(mode="fill", fill_value=0)
        return out, jnp.sum(slot >= c, dtype=jnp.int32)
