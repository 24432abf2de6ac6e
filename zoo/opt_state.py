"""Where the training state lives between steps: the optimizer's moments in HBM, or in pinned host memory
(`--opt-state host`), as a change of the state's shardings' memory kind. The step (`zoo.train_step.jit_step`)
brings host-resident leaves into HBM inside the step and sends them back after it."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Where the optimizer's moments live between steps: in HBM, or in pinned host memory (`opt_state_shardings`).
OPT_STATE_PLACES = ("device", "host")
HOST = "pinned_host"   # the memory kind of host-resident state (page-locked: the copies run as DMA)


def opt_state_shardings(state, shardings, where: str):
    """`shardings` (a tree like `state`, the state of `nnx.split((model, optimizer))`) with the optimizer's
    moments, its floating-point arrays, in HBM (`where="device"`: unchanged) or in pinned host memory ("host").
    Its step counters stay in HBM: they are scalars the step reads first."""
    if where not in OPT_STATE_PLACES:
        raise ValueError(f"--opt-state must be one of {', '.join(OPT_STATE_PLACES)}, got {where!r}")
    if where == "device":
        return shardings

    def place(path, x, s):
        moment = path[0].key == 1 and jnp.issubdtype(x.dtype, jnp.floating) and len(x.shape) > 0
        return s.with_memory_kind(HOST) if moment else s
    return jax.tree.map_with_path(place, state, shardings)


def on_host(s) -> bool:
    """Whether sharding `s` places its array in host memory."""
    return getattr(s, "memory_kind", None) == HOST
