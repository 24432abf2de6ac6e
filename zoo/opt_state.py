"""Where the training state lives between steps, as a change of the state's shardings' memory kind: the
optimizer's moments in HBM or in pinned host memory (`--opt-state host`), the float32 master copy of 16-bit
parameters (`zoo.optim.with_master`) in HBM or in pinned host memory (`--params host`), and with `--params stream`
the decoder stacks' 16-bit parameters themselves in pinned host memory too: each layer's slice is brought into HBM
as the stack's scan reaches it (`zoo.models.stack.in_hbm`) and its gradient leaves for the host as the backward pass
makes it. The step (`zoo.train_step.train_step`) updates host-resident leaves streamed through HBM, a layer slice at
a time (`zoo.streamed_update`); they enter and leave the jitted step as host arrays."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.logical import stacked
from zoo.optim import MASTER

# Where a part of the state lives between steps: in HBM, or in pinned host memory (`state_shardings`).
OPT_STATE_PLACES = ("device", "host")   # the optimizer's moments (--opt-state)
PARAMS_PLACES = ("device", "host", "stream")   # the float32 master copy (host, stream), the stacks' parameters (stream)
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


def streamed(var) -> bool:
    """Whether `--params stream` keeps a Variable in pinned host memory.

    Args:
        var: an `nnx.Variable` (abstract or concrete) with its sharding metadata.

    Returns:
        True for a parameter of a decoder stack (an `nnx.Param` whose logical axes begin with `layers`).
    """
    return isinstance(var, nnx.Param) and stacked(var)


def _streamed_prefixes(state) -> tuple[str, ...]:
    """The key paths (as `jax.tree_util.keystr` writes them) of the model's streamed Variables in `state`."""
    found = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
    return tuple(jax.tree_util.keystr(path) for path, v in found
                 if isinstance(v, nnx.Variable) and getattr(path[0], "key", None) == 0 and streamed(v))


def state_shardings(state, shardings, *, opt_state: str = "device", params: str = "device"):
    """`shardings` (a tree like `state`, the state of `nnx.split((model, optimizer))`) with the optimizer's moments,
    its floating-point arrays outside the master, in HBM (`opt_state="device"`: unchanged) or in pinned host memory
    ("host"), and the float32 master copy of the parameters likewise (`params` "host" or "stream"; they need an
    optimizer with a master, `zoo.optim.make_optimizer(master=True)`: ValueError otherwise). With `params="stream"`
    the decoder stacks' parameters (`streamed`) live in pinned host memory too, found by their Variables' metadata
    in `state`; every other parameter the forward pass reads stays in HBM. The step counters stay in HBM: they are
    scalars the step reads first."""
    check_places(opt_state=opt_state, params=params)
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    if params != "device" and not any(is_master(p) for p in paths):
        raise ValueError(f"--params {params} places the optimizer's float32 master copy of the parameters in pinned "
                         f"host memory, but this optimizer keeps none (zoo.optim.make_optimizer(..., master=True) "
                         f"does)")
    if opt_state == "device" and params == "device":
        return shardings
    stacked = _streamed_prefixes(state) if params == "stream" else ()
    if params == "stream" and not stacked:
        raise ValueError("--params stream keeps the decoder stacks' parameters in pinned host memory, but this state "
                         "has no stacked parameter (Variables whose first logical axis is 'layers'): pass the state "
                         "of nnx.split((model, optimizer)) with its Variables")

    def place(path, x, s):
        if is_master(path):
            host = params != "device"
        elif stacked and path[0].key == 0:
            where = jax.tree_util.keystr(path)
            host = any(where == p or where.startswith(p + ".") for p in stacked)
        else:
            host = (opt_state == "host" and path[0].key == 1 and jnp.issubdtype(x.dtype, jnp.floating)
                    and len(x.shape) > 0)
        return s.with_memory_kind(HOST) if host else s
    return jax.tree.map_with_path(place, state, shardings)


def check_params(params: str, param_dtype: str) -> None:
    """ValueError unless `params` (--params) is a place and, for "host" and "stream", the parameters are 16-bit:
    the master copy is their float32 copy, and float32 parameters have no separate one."""
    check_places(params=params)
    if params != "device" and param_dtype == "float32":
        where = ("bf16 parameters in HBM" if params == "host" else
                 "the stacks' bf16 parameters streamed from the host a layer at a time")
        raise ValueError(f"--params {params} keeps a float32 master copy of 16-bit parameters in pinned host memory, "
                         f"but the parameters are float32 (param_dtype=float32): there is no separate master. Add "
                         f"--set param_dtype=bfloat16 ({where}, their float32 master on the host), or leave "
                         f"--params device")


def on_host(s) -> bool:
    """Whether sharding `s` places its array in host memory."""
    return getattr(s, "memory_kind", None) == HOST
