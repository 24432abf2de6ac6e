"""The model state a plan counts (parameters, gradients, optimizer moments, other variables, gradient sums, a
float32 master copy of the parameters; per device under a uniform split) and the host memory it is checked against
(XLA's pinned pool, the machine's RAM)."""
from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from zoo import opt_state as opt_state_lib
from zoo.dtypes import dtype_of
from zoo.plan.measure import nbytes as sds_nbytes
from zoo.plan.types import OPTIMIZERS, POOL_DEFAULT_GIB, POOL_ENV, GiB, ModelState, ceil_div, fmt_bytes


def model_state(model, shard: int, optimizer: str, opt_dtype: str) -> ModelState:
    """The model's state per device, every byte split evenly over `shard` devices (rounded up)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    opt_itemsize = jnp.dtype(dtype_of("opt_dtype", opt_dtype)).itemsize
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    others = jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))
    n = sum(math.prod(p.shape) for p in params)
    pbytes = sum(sds_nbytes(p) for p in params)
    obytes = sum(sds_nbytes(p) for p in others if hasattr(p, "dtype") and hasattr(p, "shape"))
    return ModelState(num_params=n, params=ceil_div(pbytes, shard), grads=ceil_div(pbytes, shard),
                      optimizer=ceil_div(OPTIMIZERS[optimizer] * n * opt_itemsize, shard),
                      other=ceil_div(obytes, shard), optimizer_name=optimizer)


def placed(state: ModelState, model, grad_accum: int, opt_state: str, params: str = "device") -> ModelState:
    """`state` with the float32 gradient sums of gradient accumulation and, with `params` "host" or "stream", the
    float32 master copy of the parameters in pinned host memory (each per device: the parameters' bytes at 4 bytes a
    parameter), the moments where they live, and with "stream" the stacks' parameters and gradients on the host,
    one layer's of them in HBM at a time (`zoo.opt_state.streamed`; a recipe's group multiplies it:
    `ModelState.in_groups`)."""
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    total = max(sum(sds_nbytes(p) for p in leaves), 1)
    ratio = 4 * sum(math.prod(p.shape) for p in leaves) / total
    f32 = int(state.params * ratio)
    streamed = window = 0
    if params == "stream":
        stacked = [v for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)) if opt_state_lib.streamed(v)]
        share = sum(sds_nbytes(v) for v in stacked) / total
        streamed = int(state.params * share)
        # one layer's parameters and their gradients: its slice of each stack (an upper bound with several stacks)
        window = int(2 * sum(sds_nbytes(v) / v.shape[0] for v in stacked) * state.params / total)
    return dataclasses.replace(state, accum=f32 if grad_accum > 1 else 0, optimizer_host=opt_state == "host",
                               master=f32 if params != "device" else 0, master_host=params != "device",
                               streamed=streamed, streamed_window=window)


def host_pool_bytes() -> tuple[int, str | None]:
    """The size of XLA's pinned host memory pool on GPUs, which offloaded tensors live in, as XLA reads it from
    `zoo.plan.POOL_ENV`: an integer of GiB; unset, or a value that is not an integer, the 64 GiB default.

    Returns:
        (bytes, warning): the pool's bytes, and a line saying XLA ignores the variable's value (None if it does not).

    Examples:
        >>> import os
        >>> from unittest import mock
        >>> from zoo.plan import POOL_ENV, host_pool_bytes
        >>> with mock.patch.dict(os.environ, {POOL_ENV: "16"}):
        ...     host_pool_bytes()
        (17179869184, None)
        >>> with mock.patch.dict(os.environ, {POOL_ENV: "lots"}):
        ...     host_pool_bytes()[1]
        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB='lots' is not an integer: XLA ignores it and keeps the 64 GiB pool"
    """
    raw = os.environ.get(POOL_ENV)
    if raw is None:
        return POOL_DEFAULT_GIB * GiB, None
    try:
        return int(raw) * GiB, None
    except ValueError:
        return POOL_DEFAULT_GIB * GiB, (f"{POOL_ENV}={raw!r} is not an integer: XLA ignores it and keeps the "
                                        f"{POOL_DEFAULT_GIB} GiB pool")


def machine_ram_bytes() -> int | None:
    """This machine's RAM in bytes, None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def host_budget(host_gib: float | None, pool: int, ram: int | None) -> int:
    """Pinned host bytes a plan may use: XLA's pool, the machine's RAM (None: unknown, e.g. planning for another
    machine) and `host_gib` (given), whichever is least."""
    return min((pool, *_other_limits(host_gib, ram)))


def _other_limits(host_gib: float | None, ram: int | None) -> list[int]:
    """The host budget's limits beside XLA's pool, in bytes: the RAM and `host_gib`, those that are known."""
    return [b for b in (ram, None if host_gib is None else int(host_gib * GiB)) if b is not None]


def pool_bound(host_gib: float | None, pool: int, ram: int | None, state_host: int) -> list[str]:
    """For a plan whose `--recipe auto` found the host budget full: a line where XLA's pinned pool alone is what
    bounds that budget (`host_budget`: the RAM and `host_gib` are both larger), naming the pool's variable (a larger
    `host_gib` alone does nothing); else nothing (where `host_gib` or the RAM is as small, raising the pool alone
    would do nothing either).

    Args:
        host_gib: the host budget asked for, GiB (None: none).
        pool: XLA's pinned pool, bytes (`host_pool_bytes`).
        ram: the machine's RAM, bytes (None: not this machine's, or unknown).
        state_host: the model state's bytes in the pool.

    Returns:
        [the line] or [].
    """
    if any(b <= pool for b in _other_limits(host_gib, ram)):
        return []
    over = f" (a host budget of {host_gib:g} GiB is over it)" if host_gib is not None else ""
    return [f"--recipe auto had more to offload than XLA's pinned host pool holds ({fmt_bytes(pool)}, of which the "
            f"state takes {fmt_bytes(state_host)}){over}: raise {POOL_ENV} (an integer, GiB) before launch to let "
            f"it offload more"]


def warnings(p_host: int, activation: int, state: ModelState, hbm_budget: int | None, pool: int,
              extra: list[str], ram: int | None = None) -> tuple[str, ...]:
    """`extra`, then host bytes over the pinned pool or the RAM (`ram`: None where the machine planned for is not
    this one), and a floor over the HBM budget."""
    out = list(extra)
    if p_host > pool:
        out.append(f"host memory {fmt_bytes(p_host)} is over XLA's pinned host pool of {fmt_bytes(pool)}: "
                   f"raise {POOL_ENV} (an integer, GiB) before launch, or offload less")
    if ram is not None and p_host > ram:
        out.append(f"host memory {fmt_bytes(p_host)} is over this machine's RAM ({fmt_bytes(ram)})")
    if hbm_budget is not None and activation + state.total > hbm_budget:
        out.append(f"HBM {fmt_bytes(activation + state.total)} (activations {fmt_bytes(activation)} + model "
                   f"state {fmt_bytes(state.total)}) is over the budget of {fmt_bytes(hbm_budget)}, before "
                   f"XLA's temporaries")
    return tuple(out)
