"""Where the training state lives between steps, as a change of the state's shardings' memory kind: the
optimizer's moments in HBM or in pinned host memory (`--opt-state host`), and the float32 master copy of 16-bit
parameters (`zoo.optim.with_master`) in HBM or in pinned host memory (`--params host`), each independently of
the other. The step (`zoo.train_step.train_step`) updates host-resident leaves streamed through HBM, a layer slice at
a time (`zoo.streamed_update`); they enter and leave the jitted step as host arrays."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from zoo.optim import MASTER

# Where a part of the state lives between steps: in HBM, or in pinned host memory (`state_shardings`).
OPT_STATE_PLACES = ("device", "host")   # the optimizer's moments (--opt-state)
PARAMS_PLACES = ("device", "host")      # the float32 master copy of the parameters (--params)
HOST = "pinned_host"   # the memory kind of host-resident state (page-locked: the copies run as DMA)


def check_places(*, opt_state: str = "device", params: str = "device") -> None:
    """ValueError unless `opt_state` (--opt-state) and `params` (--params) are places a part of the state may live."""
    for flag, value, places in (("--opt-state", opt_state, OPT_STATE_PLACES), ("--params", params, PARAMS_PLACES)):
        if value not in places:
            raise ValueError(f"{flag} must be one of {', '.join(places)}, got {value!r}")


def is_master(path) -> bool:
    """Whether `path` (a key path into the state of `nnx.split((model, optimizer))`) is in the optimizer's float32
    master copy: `optimizer.opt_state.master` (`zoo.optim.MasterState`, the root of the optimizer's state)."""
    keys = [getattr(k, "key", None) for k in path[:3]]
    return keys == [1, "opt_state", MASTER]


def state_shardings(state, shardings, *, opt_state: str = "device", params: str = "device"):
    """`shardings` (a tree like `state`, the state of `nnx.split((model, optimizer))`) with the optimizer's moments,
    its floating-point arrays outside the master, in HBM (`opt_state="device"`: unchanged) or in pinned host memory
    ("host"), and the float32 master copy of the parameters likewise (`params`; "host" needs an optimizer with a
    master, `zoo.optim.make_optimizer(master=True)`: ValueError otherwise). The step counters stay in HBM: they are
    scalars the step reads first. The 16-bit parameters the forward pass reads stay in HBM in every case."""
    check_places(opt_state=opt_state, params=params)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    if params == "host" and not any(is_master(p) for p in paths):
        raise ValueError("--params host places the optimizer's float32 master copy of the parameters in pinned host "
                         "memory, but this optimizer keeps none (zoo.optim.make_optimizer(..., master=True) does)")
    if opt_state == "device" and params == "device":
        return shardings

    def place(path, x, s):
        if is_master(path):
            host = params == "host"
        else:
            host = (opt_state == "host" and path[0].key == 1 and jnp.issubdtype(x.dtype, jnp.floating)
                    and len(x.shape) > 0)
        return s.with_memory_kind(HOST) if host else s
    return jax.tree.map_with_path(place, state, shardings)


def check_params(params: str, param_dtype: str) -> None:
    """ValueError unless `params` (--params) is a place and, for "host", the parameters are 16-bit: the master copy
    is their float32 copy, and float32 parameters have no separate one."""
    check_places(params=params)
    if params == "host" and param_dtype == "float32":
        raise ValueError("--params host keeps a float32 master copy of 16-bit parameters in pinned host memory, but "
                         "the parameters are float32 (param_dtype=float32): there is no separate master. Add --set "
                         "param_dtype=bfloat16 (bf16 parameters in HBM, their float32 master on the host), or leave "
                         "--params device")


def on_host(s) -> bool:
    """Whether sharding `s` places its array in host memory."""
    return getattr(s, "memory_kind", None) == HOST
