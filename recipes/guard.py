"""Checks `python -m recipes.train` makes before it builds or compiles anything: every one a ValueError naming the
flag and the path, so a run that cannot finish (or would destroy something) fails in a second, not after training.

- `check_ckpt_dir`: --ckpt-dir is (or can be made) a writable directory; it is created here.
- `check_metrics`: --metrics' directory exists; an existing file is only continued by the run that wrote it.
- `nonfinite_leaves`: which leaves of a state hold NaN or infinity (no checkpoint is written from them).
"""
from __future__ import annotations

import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np


def check_ckpt_dir(path: str) -> str:
    """Make `path` a directory we can write checkpoints into, or raise ValueError saying why not. Returns its
    absolute path. A write probe (a temporary file, removed at once) catches what permission bits do not
    (read-only file systems, root-squashed network mounts)."""
    path = os.path.abspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--ckpt-dir {path} exists and is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--ckpt-dir {path} cannot be created: {e.strerror or e}") from None
    try:
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ValueError(f"--ckpt-dir {path} is not writable: {e.strerror or e}") from None
    return path


def read_metrics_steps(path: str) -> list[tuple[int, str]]:
    """(step, line) of every well-formed JSON line in an existing metrics file (a line cut by a kill is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append((int(json.loads(line)["step"]), line if line.endswith("\n") else line + "\n"))
            except (ValueError, KeyError, TypeError):
                continue
    return rows


def check_metrics(path: str, *, owner: str | None) -> str:
    """--metrics: its directory must exist (ValueError now, not after training). An existing non-empty file is
    refused unless `owner`, the metrics path recorded in the checkpoint being resumed, is this file: then the run
    continues it (keeping the lines up to the checkpoint's step). Returns the absolute path."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"--metrics {path}: the directory {parent} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"--metrics {path} is a directory")
    if os.path.exists(path) and os.path.getsize(path) > 0 and owner != path:
        raise ValueError(f"--metrics {path} already exists and is not this run's (it would be overwritten); "
                         f"choose another path or move it away" +
                         ("" if owner is None else f" (the resumed checkpoint wrote {owner})"))
    if not os.access(parent, os.W_OK):
        raise ValueError(f"--metrics {path}: the directory {parent} is not writable")
    return path


def open_metrics(path: str, start: int):
    """Open the metrics file at step `start`: keep the lines of steps up to `start` (those after it belong to the
    part of an interrupted run that is about to be re-run) and append. The kept lines are written to a new file
    that replaces the old one atomically, so a crash here loses nothing."""
    kept = [line for step, line in read_metrics_steps(path) if step <= start] if start and os.path.exists(path) else []
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".metrics-")
    with os.fdopen(fd, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return open(path, "a")  # noqa: SIM115


@jax.jit
def _all_finite(leaves):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.ones((0,), bool)


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the floating-point leaves of `tree` holding a NaN or an infinity (one compiled reduction)."""
    flat = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    ok = np.asarray(_all_finite([x for _, x in flat]))
    return [p for (p, _), good in zip(flat, ok) if not good]
