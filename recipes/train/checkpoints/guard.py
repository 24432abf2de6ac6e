"""Checks `python -m recipes.train` makes before it builds or compiles anything: every one a ValueError naming the
flag and the path, so a run that cannot finish (or would destroy something) fails in a second, not after training.

- `check_ckpt_dir`: --ckpt-dir is (or can be made) a writable directory; it is created here.
- `check_metrics`: --metrics' directory exists; the file is opened and locked at once (`MetricsFile`); an existing
  file is only continued by the run that wrote it.
- `nonfinite_leaves`: which leaves of a state hold NaN or infinity (no checkpoint is written from them).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import stat
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


def check_metrics(path: str, *, owner: str | None) -> MetricsFile:
    """--metrics, opened now (before anything compiles) and held for the run: `MetricsFile`. Its directory must
    exist; an existing non-empty regular file is refused unless `owner`, the metrics path recorded by the run being
    resumed, is this path: then the run continues it. Raises ValueError saying why, having changed nothing."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ValueError(f"--metrics {path}: the directory {parent} does not exist")
    if os.path.isdir(path):
        raise ValueError(f"--metrics {path} is a directory")
    return MetricsFile(path, owner=owner)


class MetricsFile:
    """The --metrics file of a run, opened as a user expects and never replaced:

    - a regular file is created with the umask's mode (or opened, through any symlink: the link's target is
      written), appended to, and locked (`fcntl.flock`) for the run at once, so two runs given one path cannot both
      write it: the second is refused while the first still compiles;
    - a FIFO, a character device (`/dev/null`, `/dev/stdout`) or a socket is a stream: written, never truncated or
      locked (a FIFO with no reader is refused rather than waited on);
    - `start_at(step)` keeps the lines of steps up to `step` (a resumed run re-runs the ones after it) by truncating
      the file in place after the last kept line: its inode, mode, owner and links stay;
    - `write(row)` writes one JSON line with non-finite numbers as null (strict JSON), and names the path when the
      write fails (a full disk, a FIFO whose reader left).

    A file this run created and never wrote to is removed on `close` (a run that failed before its first step
    leaves nothing behind)."""

    def __init__(self, path: str, *, owner: str | None):
        self.path, self.created, self.written = path, False, False
        self.fd = self._open(path)
        self.stream = not stat.S_ISREG(os.fstat(self.fd).st_mode)
        if self.stream:
            return
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise ValueError(f"--metrics {path} is being written by another run (it holds the file's lock); choose "
                             f"another path") from None
        if os.fstat(self.fd).st_size > 0 and owner != path:
            os.close(self.fd)
            raise ValueError(f"--metrics {path} already exists and is not this run's (it would be overwritten); "
                             f"choose another path or move it away" +
                             ("" if owner is None else f" (the resumed checkpoint wrote {owner})"))

    def _open(self, path: str) -> int:
        flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)   # the umask applies
                self.created = True
            except FileExistsError:
                fd = os.open(path, flags | os.O_CREAT, 0o666)   # follows a symlink, even a dangling one
        except OSError as e:
            if e.errno == errno.ENXIO:
                raise ValueError(f"--metrics {path} is a FIFO with no reader: start the reader first") from None
            raise ValueError(f"--metrics {path} cannot be opened for writing: {e.strerror or e}") from None
        os.set_blocking(fd, True)   # O_NONBLOCK only so that opening a FIFO cannot wait forever
        return fd

    def start_at(self, step: int) -> None:
        """Keep the lines of steps <= `step` (none at step 0); a last line cut by a kill goes too."""
        if self.stream:
            return
        end = 0
        with open(self.path, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                try:
                    if int(json.loads(line)["step"]) > step:
                        break
                except (ValueError, KeyError, TypeError):
                    pass
                end += len(line)
        if end < os.fstat(self.fd).st_size:
            os.ftruncate(self.fd, end)

    def write(self, row: dict) -> None:
        data = (json.dumps(finite_json(row)) + "\n").encode()
        try:
            while data:
                data = data[os.write(self.fd, data):]
        except OSError as e:
            raise OSError(e.errno, f"writing --metrics {self.path} failed: {e.strerror or e}") from None
        self.written = True

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()

    def close(self) -> None:
        if self.fd is None:
            return
        if self.created and not self.written and os.fstat(self.fd).st_size == 0:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        os.close(self.fd)
        self.fd = None


def finite_json(value):
    """`value` with every non-finite float (NaN, infinity) replaced by None: JSON has no NaN, and a strict reader
    (jq, JavaScript, Go) refuses Python's bare `NaN`."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(v) for v in value]
    return value


@jax.jit
def _all_finite(leaves):
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]) if leaves else jnp.ones((0,), bool)


def nonfinite_leaves(tree) -> list[str]:
    """Paths of the floating-point leaves of `tree` holding a NaN or an infinity (one compiled reduction)."""
    flat = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    ok = np.asarray(_all_finite([x for _, x in flat]))
    return [p for (p, _), good in zip(flat, ok) if not good]
