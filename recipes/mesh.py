"""The main job's mesh: `--mesh fsdp=2,tp=1,ep=1`, multi-host start-up, and each host's part of the batch.

    python -m recipes.train --mesh fsdp=4,tp=2 ...     # axes dp, fsdp, tp, ep; product = the device count
    python -m recipes.train ...                        # default: every device on fsdp

The mesh, its logical-axis rules and the per-model checks are `zoo.sharding`'s; this module is what the command
line adds around them:

- `resolve(spec, model_cfg, batch)`: the mesh, checked against the model and the global batch
  (`zoo.sharding.check_mesh`: ValueError naming both numbers, before anything compiles; the main job exits 2).
- Multi-host: `maybe_initialize(flag)` calls `jax.distributed.initialize()` when `--distributed` is given, or
  automatically when `JAX_COORDINATOR_ADDRESS` is set (then `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` say how
  many processes and which one this is; on SLURM / Open MPI clusters JAX detects them itself with
  `--distributed`). It must run before JAX touches a device: the main job calls it right after parsing.
- `put_batch(batch, mesh)`: the data source gives every process the same global batch of step k (a pure function
  of (seed, step), `recipes.data`); each process keeps only the rows its devices hold
  (`local_rows`, read from the batch sharding, so it is deterministic and needs no communication) and
  `jax.make_array_from_process_local_data` assembles the global array.
"""
from __future__ import annotations

import math
import os

import jax
import numpy as np

from zoo import sharding

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"


def wants_distributed(flag: bool) -> bool:
    return bool(flag) or bool(os.environ.get(COORDINATOR_ENV))


def maybe_initialize(flag: bool) -> bool:
    """`jax.distributed.initialize()` with the process count and index from JAX_NUM_PROCESSES / JAX_PROCESS_ID
    when they are set (else JAX's cluster auto-detection); True if it ran."""
    if not wants_distributed(flag):
        return False
    kwargs = {}
    if os.environ.get("JAX_NUM_PROCESSES"):
        kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
    if os.environ.get("JAX_PROCESS_ID"):
        kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
    try:
        jax.distributed.initialize(**kwargs)
    except (ValueError, RuntimeError) as e:   # no coordinator found: one line, not a traceback
        raise ValueError(f"--distributed: jax.distributed.initialize() failed: {e} (set {COORDINATOR_ENV}, "
                         f"JAX_NUM_PROCESSES and JAX_PROCESS_ID, or run under SLURM or Open MPI; README, "
                         f"\"Multi-host\")") from None
    return True


def resolve(spec: str | None, model_cfg, batch: int):
    """The mesh of `spec` over every device (of every process), checked against the model and the global batch."""
    try:
        sizes = sharding.parse_mesh(spec, jax.device_count())    # ValueError: unknown axis, wrong product
    except ValueError as e:
        if jax.default_backend() != "cpu" or "product of the axes" not in str(e):
            raise
        n = math.prod(int(part.split("=")[1]) for part in spec.split(",") if "=" in part)
        raise ValueError(f"{e}. On the CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} makes {n} fake "
                         f"devices (set before the command: they share the machine's cores and RAM, so use them to "
                         f"check a mesh, not to train fast)") from None
    sharding.check_mesh(model_cfg, sizes, batch=batch)        # ValueError: a model dimension or the batch
    return sharding.make_mesh(sizes)


def describe(mesh) -> str:
    return sharding.format_mesh(sharding.mesh_sizes(mesh))


def local_rows(global_shape: tuple[int, ...], s: jax.sharding.Sharding) -> slice:
    """The rows (first axis) of a `global_shape` array under sharding `s` that this process's devices hold: one
    contiguous range (the data axes are outermost in the mesh, so a process's devices hold adjacent rows)."""
    index = s.addressable_devices_indices_map(global_shape)
    starts = [ix[0].start or 0 for ix in index.values()]
    stops = [global_shape[0] if ix[0].stop is None else ix[0].stop for ix in index.values()]
    lo, hi = min(starts), max(stops)
    held = sum(b - a for a, b in set(zip(starts, stops)))
    if held != hi - lo:
        raise ValueError(f"this process's devices hold non-adjacent rows of the batch: "
                         f"{sorted(set(zip(starts, stops)))}")
    return slice(lo, hi)


def put_batch(batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """Each array of the global `batch` as a jax.Array sharded over the data axes (`zoo.sharding.batch_sharding`);
    with several processes, each contributes only its own rows."""
    out = {}
    for key, x in batch.items():
        s = sharding.batch_sharding(mesh, ndim=x.ndim)
        if jax.process_count() == 1:
            out[key] = jax.device_put(x, s)
        else:
            out[key] = jax.make_array_from_process_local_data(s, x[local_rows(x.shape, s)], x.shape)
    return out
