"""Which grouped matmul runs the experts (the backend), and why: ``"ragged_dot"`` (`jax.lax.ragged_dot`, dropless, the
reference), ``"tokamax"`` (tokamax's grouped GEMM, dropless), ``"capacity"`` (a batched einsum over [experts, C,
hidden]; copies over capacity dropped and counted) or ``"auto"`` (one known to run well on the device). `backend_choice`
says which and why; the measurements behind it: docs/internals.md, "MoE backends".
"""
from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp

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
    """Whether tokamax (the grouped GEMM of the "tokamax" backend) imports here.

    Returns:
        True or False (`tokamax_status` says why not).

    Examples:
        >>> from zoo.layers.moe import tokamax_available
        >>> tokamax_available() in (True, False)
        True
    """
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
    """The MoE backend that runs for the configured `backend` on `device`, and why. With `ep_dispatch="ragged_a2a"` the
    backend is a dropless grouped matmul: "auto" never picks capacity then.

    Args:
        backend: "auto", "ragged_dot", "tokamax" or "capacity".
        dtype: the activations' dtype.
        device: the device (default: the first).
        ep_dispatch: "gather" or "ragged_a2a".

    Returns:
        (the backend that runs, why).

    Raises:
        ValueError: for an unknown backend, one missing here, or one `ep_dispatch` cannot run.

    Examples:
        >>> from zoo.layers.moe import backend_choice
        >>> backend_choice("ragged_dot")[0]
        'ragged_dot'
    """
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
    """The backend that runs for the configured `backend` (the first half of `backend_choice`).

    Args:
        backend: "auto", "ragged_dot", "tokamax" or "capacity".
        dtype: the activations' dtype.
        device: the device (default: the first).
        ep_dispatch: "gather" or "ragged_a2a".

    Returns:
        the backend's name.

    Examples:
        >>> from zoo.layers.moe import resolve_backend
        >>> resolve_backend("capacity")
        'capacity'
    """
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
