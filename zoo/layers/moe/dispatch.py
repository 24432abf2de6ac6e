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
device's. The dropless backends (ragged_dot, tokamax) sort all copies at once: under a mesh they run correctly,
XLA gathering the rows and the expert weights (no expert parallelism; their moe_* tags are not sharded over the
batch). A `jax.lax.ragged_all_to_all` dispatch under `shard_map` is not built (XLA:CPU has no ragged-all-to-all,
so it could not be tested here).
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
                        f"MoEAux.dropped), because tokamax is unusable ({why}) and jax.lax.ragged_dot computes "
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
