"""XLA flag sets for overlapping compute with communication and host transfers.

XLA reads `XLA_FLAGS` once, when JAX creates its first backend, so a set must be applied before `import jax`
(`python -m recipes.train` parses its arguments and applies the set first; this module imports no JAX).
The flags are DebugOptions shared by every XLA build: on the CPU they parse and do nothing.

- `none`:    XLA's defaults.
- `lhs`:     the latency-hiding scheduler: it schedules host<->device copies and collectives to overlap with
             compute (the reference study measured its offload recipe with it on).
- `overlap`: `lhs` plus pipelined host offloading, which starts each layer's offload/reload copies a layer
             early. A race was reported with it on: compare the loss curve with `lhs` before trusting it.
"""
from __future__ import annotations

import os
import sys
import warnings

FLAG_SETS: dict[str, tuple[str, ...]] = {
    "none": (),
    "lhs": ("--xla_gpu_enable_latency_hiding_scheduler=true",),
    "overlap": ("--xla_gpu_enable_latency_hiding_scheduler=true",
                "--xla_gpu_enable_pipelined_host_offloading=true"),
}
DEFAULT = "lhs"


def apply(name: str, environ: dict | None = None) -> tuple[str, ...]:
    """Add the flag set `name` to `XLA_FLAGS` (flags the user already set win) and return the set.

    Warns if JAX is already imported: the flags then take effect only if no backend has started yet.
    """
    if name not in FLAG_SETS:
        raise ValueError(f"unknown XLA flag set {name!r}; choose one of: {', '.join(FLAG_SETS)}")
    env = os.environ if environ is None else environ
    existing = env.get("XLA_FLAGS", "").split()
    keys = {f.split("=", 1)[0] for f in existing}
    added = tuple(f for f in FLAG_SETS[name] if f.split("=", 1)[0] not in keys)
    if added:
        env["XLA_FLAGS"] = " ".join(existing + list(added))
        if environ is None and "jax" in sys.modules:
            warnings.warn("XLA flags applied after `import jax`: they take effect only if no JAX backend has "
                          "started yet. Apply them before importing JAX.", stacklevel=2)
    return FLAG_SETS[name]
