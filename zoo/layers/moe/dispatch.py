"""Dispatch: which grouped matmul runs the experts (the backend), and how token copies reach their experts.

Every backend sorts the B*S*k token copies by expert and gives the same outputs when nothing is dropped:

- ``"ragged_dot"``: `jax.lax.ragged_dot`, dropless; the reference, and right on CPU. On GPUs (jax 0.11) XLA
  computes every expert for every row: 48 TFLOP/s on an H200 where a batched einsum reaches 805 (ANCHORS.md).
- ``"tokamax"``: tokamax's `ragged_dot` (a real grouped GEMM; Mosaic GPU kernel), dropless, same API and
  results; imported only when chosen (it needs jax >= 0.11.1 and is not a dependency of the zoo). On an NVIDIA
  GPU the zoo asks for its Mosaic kernel by name, so an unsupported case fails loudly instead of falling back to
  XLA's dense ragged_dot; elsewhere tokamax picks (XLA on a CPU). Its kernel has a scan of its own, with no tag
  and no offload inside: `zoo.tags` allows that (it refuses only a loop that holds a tag or an offload).
- ``"capacity"``: each expert takes at most C = ceil(capacity_factor * B*S*k / experts) copies (the first ones
  in token order); the experts run as a batched einsum over an [experts, C, hidden] buffer. Copies over an
  expert's capacity are dropped (they add nothing) and counted. Its tags moe_mlpwi_0, moe_mlpwi_1, moe_mlpwo are
  the [experts, C, F] / [experts, C, D] buffers, not [B*S*k, ...] rows.
- ``"auto"``: only a backend known to run well on the device. On an NVIDIA GPU: tokamax when it imports and its
  Mosaic kernel covers the case (bf16/fp16, compute capability 8.x, 9.x or 10.x); otherwise capacity dispatch,
  with a warning that it drops copies over capacity, since ragged_dot computes every expert for every row there
  (48 against 805 TFLOP/s on an H200, and out of memory at the deepseek-slice batch; ANCHORS.md). On any other
  device: ragged_dot (exact, and what XLA does well on CPUs and TPUs). `backend_choice` says which and why.

Under a mesh (`zoo.sharding`) the capacity backend is GShard's: the batch is cut into G groups, one per shard of
the batch (dp x fsdp x ep; G = 1 on one device), each group routes and fills its own C = ceil(capacity_factor *
group copies / experts) slots, and the buffer is laid out [experts, G*C, ...] with experts over `ep` and the groups
over dp x fsdp: XLA moves each copy to its expert's device and back with all-to-alls, and every expert's
activations stay on its device (the tags are these sharded buffers: per-device host bytes = plan / shards).
Capacity is per group, so which copies drop can depend on the mesh; with nothing dropped the results equal one
device's.

How the dropless backends (ragged_dot, tokamax) reach their experts under a mesh is `ep_dispatch`:
- ``"gather"`` (the default): all copies are sorted at once; XLA gathers the rows and the expert weights (no expert
  parallelism; the moe_* tags are not sharded over the batch).
- ``"ragged_a2a"``: dropless expert parallelism (`expert_parallel`), under `shard_map` over the whole mesh. Each
  device sorts its own tokens' copies by expert, sends each to its expert's device over `ep` with
  `jax.lax.ragged_all_to_all`, runs the grouped matmul over its E/ep local experts, and sends the results back with
  the reverse exchange; the router's weights combine them outside. The receive buffer has a static size that
  nothing can overflow: `receive_rows` = ep x T x min(k, E/ep) rows for T tokens per device (every copy of the ep
  group that can land on one device), i.e. ep times the device's own T*k copies when k <= E/ep. That is the
  memory cost: the moe_* tags are [ep*T*k, ...] per device (capacity dispatch: ~capacity_factor*T*k), so the
  planner's per-device tag bytes are one device's plan / (dp x fsdp), not / (dp x fsdp x ep). Rows past what
  arrived are in no expert's group (the grouped matmul gives them zeros; they are never sent back). The expert
  weights enter the shard_map split over ep only (XLA all-gathers them over fsdp and tp first), the tokens split
  over the batch axes; a mesh without ep > 1 runs the same code with no exchange (data-parallel dropless).
  XLA:CPU has no ragged-all-to-all: `ragged_all_to_all` lowers jax's on every other platform and, on a CPU, the
  same exchange built from `jax.lax.all_to_all` on padded buffers (`padded_ragged_all_to_all`).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import warnings
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from einops import rearrange, repeat

from zoo import sharding
from zoo.layers import grouped_matmul

Backend = Literal["auto", "ragged_dot", "tokamax", "capacity"]
BACKENDS: tuple[str, ...] = ("auto", "ragged_dot", "tokamax", "capacity")
EpDispatch = Literal["gather", "ragged_a2a"]
EP_DISPATCHES: tuple[str, ...] = ("gather", "ragged_a2a")


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


def backend_choice(backend: str, *, dtype=jnp.bfloat16, device: jax.Device | None = None,
                   ep_dispatch: str = "gather") -> tuple[str, str]:
    """(the backend that runs, why) for the configured `backend` on `device` (default: the first device). With
    `ep_dispatch="ragged_a2a"` the backend is a dropless grouped matmul: "auto" never picks capacity then."""
    if backend not in BACKENDS:
        raise ValueError(f"moe_backend must be one of {BACKENDS}, got {backend!r}")
    if ep_dispatch not in EP_DISPATCHES:
        raise ValueError(f"ep_dispatch must be one of {EP_DISPATCHES}, got {ep_dispatch!r}")
    if ep_dispatch == "ragged_a2a" and backend == "capacity":
        raise ValueError("ep_dispatch='ragged_a2a' is dropless expert parallelism: it runs a grouped matmul "
                         "(moe_backend 'ragged_dot', 'tokamax' or 'auto'), not capacity dispatch (which shards "
                         "experts over ep by itself)")
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
    if ep_dispatch == "ragged_a2a":
        return "ragged_dot", (f"auto on {device.device_kind} with ep_dispatch='ragged_a2a' (dropless): "
                              f"jax.lax.ragged_dot, which computes every expert for every row on GPUs, because "
                              f"tokamax is unusable ({why})")
    return "capacity", (f"auto on {device.device_kind}: capacity dispatch (drops copies over capacity; counted in "
                        f"MoEAux.dropped), because tokamax is unusable ({why}) and jax.lax.ragged_dot computes "
                        f"every expert for every row on GPUs")


def resolve_backend(backend: str, *, dtype=jnp.bfloat16, device: jax.Device | None = None,
                    ep_dispatch: str = "gather") -> str:
    """The backend that runs for the configured `backend` (see `backend_choice`)."""
    return backend_choice(backend, dtype=dtype, device=device, ep_dispatch=ep_dispatch)[0]


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


# -- moving token copies ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sorted:
    """Each group's T*k token copies sorted by expert (stable: token order within an expert)."""
    rows: jax.Array          # [G, N, D] the copies, by expert
    expert: jax.Array        # [G, N] the expert of each sorted copy
    group_sizes: jax.Array   # [G, E] copies per expert
    inverse: jax.Array       # [G, N] where each copy (in token order) sits among the sorted ones


def sort_by_expert(flat: jax.Array, idx: jax.Array, num_experts: int) -> Sorted:
    """flat [G, T, D] tokens, idx [G, T, k] their experts -> the T*k copies of each group sorted by expert."""
    k = idx.shape[-1]
    idx = idx.reshape(idx.shape[0], -1)                                                   # [G, T*k]
    order = jnp.argsort(idx, axis=-1, stable=True)
    group_sizes = jax.vmap(lambda i: jnp.bincount(i, length=num_experts))(idx).astype(jnp.int32)
    rows = jnp.take_along_axis(repeat(flat, "g t d -> g (t k) d", k=k), order[..., None], axis=1)
    return Sorted(rows, jnp.take_along_axis(idx, order, axis=-1), group_sizes, jnp.argsort(order, axis=-1))


def unsort(out: jax.Array, s: Sorted) -> jax.Array:
    """[G, N, D] outputs in sorted order -> [G, N, D] in token-copy order."""
    return jnp.take_along_axis(out, s.inverse[..., None], axis=1)


def capacity_dispatch(s: Sorted, experts: Callable[[jax.Array], jax.Array], capacity_factor: float
                      ) -> tuple[jax.Array, jax.Array]:
    """Run `experts` ([E, G*C, D] -> [E, G*C, D]) over each group's first C copies per expert -> (out [G, N, D] in
    sorted order with dropped rows zero, number dropped). Each group fills its own [E, C] slots; the buffer is laid
    out [E, G*C, D] with experts over `ep`, so under expert parallelism XLA moves the copies to their experts'
    devices (an all-to-all)."""
    g, n, d = s.rows.shape                                                                # n: copies per group
    e = s.group_sizes.shape[-1]
    c = capacity(n, e, capacity_factor)
    starts = jnp.cumsum(s.group_sizes, axis=-1) - s.group_sizes                           # [G, E]
    slot = jnp.arange(n, dtype=jnp.int32) - jnp.take_along_axis(starts, s.expert, axis=-1)  # rank in its expert
    group = jnp.broadcast_to(jnp.arange(g, dtype=jnp.int32)[:, None], (g, n))
    buf = jnp.zeros((g, e, c, d), s.rows.dtype).at[group, s.expert, slot].set(s.rows, mode="drop")
    buf = rearrange(buf, "g e c d -> e (g c) d")
    out = rearrange(experts(buf), "e (g c) d -> g e c d", g=g)
    out = sharding.constrain(out, ("batch", None, None, "embed"))
    out = out.at[group, s.expert, slot].get(mode="fill", fill_value=0)
    return out, jnp.sum(slot >= c, dtype=jnp.int32)


# -- dropless expert parallelism: ragged all-to-all under shard_map -------------------------------------------------
def padded_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                             output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: str) -> jax.Array:
    """`jax.lax.ragged_all_to_all`'s exchange (one slice per device of `axis_name`) from `jax.lax.all_to_all` on
    padded buffers, for XLA:CPU, which has no ragged-all-to-all: slice j (operand[input_offsets[j]:][:send_sizes[j]])
    is padded to the operand's length and sent to device j, which writes it into its `output` at the offset the
    sender gave (output_offsets[j]); rows of `output` nothing is written to keep their value. Pure data movement,
    so its values and gradients are exact. Costs ep x operand per device."""
    p = jax.lax.axis_size(axis_name)
    if input_offsets.shape != (p,):
        raise ValueError(f"padded_ragged_all_to_all: one slice per device of {axis_name!r} ({p}), got offsets of "
                         f"shape {input_offsets.shape}")
    n, m = operand.shape[0], output.shape[0]
    r = jnp.arange(n, dtype=jnp.int32)
    rows = jnp.clip(input_offsets[:, None] + r, 0, n - 1)                                 # [P, N]
    keep = (r < send_sizes[:, None]).reshape(p, n, *(1,) * (operand.ndim - 1))
    sent = jnp.where(keep, operand[rows], jnp.zeros((), operand.dtype))                   # [P, N, ...]: to each device
    got = jax.lax.all_to_all(sent, axis_name, 0, 0)                                       # [P, N, ...]: from each
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)                  # [P]: where each lands here
    dest = jnp.where(r < recv_sizes[:, None], at[:, None] + r, m)                         # m: out of range, dropped
    return output.at[dest.reshape(-1)].set(got.reshape(p * n, *operand.shape[1:]), mode="drop")


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: str) -> jax.Array:
    """The collective of `expert_parallel`, with `jax.lax.ragged_all_to_all`'s signature and semantics: jax's on
    every platform but the CPU, `padded_ragged_all_to_all` there (chosen when the step is lowered, so a step
    lowered for CUDA on a CPU machine holds the real ragged-all-to-all)."""
    args = (operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)
    return jax.lax.platform_dependent(
        *args, cpu=functools.partial(padded_ragged_all_to_all, axis_name=axis_name),
        default=functools.partial(jax.lax.ragged_all_to_all, axis_name=axis_name))


def receive_rows(tokens: int, k: int, num_experts: int, ep: int) -> int:
    """Rows of a device's receive buffer under `expert_parallel` for `tokens` tokens per device: every copy the ep
    devices can send to one device's E/ep experts (a token's k experts are distinct), so nothing can drop."""
    return ep * tokens * min(k, num_experts // ep)


def _exclusive_cumsum(x: jax.Array, axis: int = -1) -> jax.Array:
    return jnp.cumsum(x, axis=axis) - x


def _local_expert_parallel(x: jax.Array, idx: jax.Array, weights: tuple[jax.Array, ...], *, num_experts: int,
                           ep_axis: str | None, batch_axes: tuple[str, ...], grouped: Callable) -> jax.Array:
    """One device's part of `expert_parallel`: x [T, D], idx [T, k], its E/ep experts' weights -> [T*k, D], each
    copy through its expert, in token-copy order."""
    s = sort_by_expert(x[None], idx[None], num_experts)
    rows, sizes = s.rows[0], s.group_sizes[0]                                   # [N, D] by expert; [E]
    if ep_axis is None:
        return unsort(grouped(rows, sizes, weights)[None], s)[0]
    p, e_local = jax.lax.axis_size(ep_axis), weights[0].shape[0]
    n, d = rows.shape
    me = jax.lax.axis_index(ep_axis)
    counts = jax.lax.all_gather(sizes.reshape(p, e_local), ep_axis)             # [src, dst, local expert]
    sent = jnp.sum(counts, axis=-1)                                             # [src, dst] copies
    mine = counts[:, me]                                                        # [src, local expert] coming here
    send, recv = sent[me], sent[:, me]                                          # [dst], [src]
    send_at = _exclusive_cumsum(sent, axis=1)                                   # where src's chunk for dst starts
    recv_at = _exclusive_cumsum(sent, axis=0)                                   # where it lands on dst
    m = receive_rows(n // idx.shape[1], idx.shape[1], num_experts, p)

    def buffer(rows_: int) -> jax.Array:  # varying over the batch axes, as the rows and the exchange's result are
        return jax.lax.pcast(jnp.zeros((rows_, d), rows.dtype), batch_axes, to="varying")

    got = ragged_all_to_all(rows, buffer(m), send_at[me], send, recv_at[me], recv, axis_name=ep_axis)
    # `got` holds each source's copies in turn, each sorted by local expert; sort them by local expert (stable:
    # source order, i.e. token order, within an expert). Rows past the last copy get expert e_local: last, no group.
    seg = jnp.searchsorted(jnp.cumsum(mine.reshape(-1)), jnp.arange(m, dtype=jnp.int32), side="right")
    order = jnp.argsort(jnp.where(seg < p * e_local, seg % e_local, e_local), stable=True)
    out = grouped(got[order], jnp.sum(mine, axis=0), weights)
    out = out[jnp.argsort(order)]                                               # back in arrival order
    back = ragged_all_to_all(out, buffer(n), _exclusive_cumsum(recv), recv, send_at[:, me], send,
                             axis_name=ep_axis)
    return unsort(back[None], s)[0]


def expert_parallel(flat: jax.Array, idx: jax.Array, weights: tuple[jax.Array, ...], grouped: Callable
                    ) -> jax.Array:
    """Dropless expert parallelism under the active mesh: flat [T, D] tokens (split over the batch axes), idx
    [T, k] their experts, `weights` the experts' stacked weights ([E, ...] each, split over ep) -> [T*k, D], each
    token copy through its expert, in token-copy order (the layer combines them). `grouped(rows, group_sizes,
    weights)` runs one device's experts over its rows sorted by expert (rows past sum(group_sizes) in no group).
    See the module's docstring (ep_dispatch "ragged_a2a")."""
    batch = sharding.mesh_axes("batch")
    ep = sharding.mesh_axes("experts")
    if len(ep) > 1:
        raise ValueError(f"ep_dispatch='ragged_a2a': experts split over one mesh axis, got {ep}")
    num_experts = weights[0].shape[0]
    body = functools.partial(_local_expert_parallel, num_experts=num_experts, ep_axis=ep[0] if ep else None,
                             batch_axes=batch, grouped=grouped)
    rows = jax.sharding.PartitionSpec(batch or None)
    experts = jax.sharding.PartitionSpec(ep[0] if ep else None)
    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(), in_specs=(rows, rows, experts),
                         out_specs=rows)(flat, idx, weights)
