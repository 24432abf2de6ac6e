"""Checkpoints of a training run with orbax: the model's and the optimizer's NNX state, and a small JSON record.

The record holds the step and what the run was (model, preset, recipe, batch, seq, seed, data) so that
`--resume` refuses a checkpoint of a different run instead of silently continuing it. The data is a pure
function of (seed, step) (`recipes.data`), the optimizer state holds its step count and the learning-rate
schedule reads it: restoring these two states and the step reproduces the uninterrupted run exactly.

Safety:
- Saving is synchronous (the loop waits for every save anyway): a failing write raises in the caller, instead of
  in orbax's background threads, which left the process hanging. Orbax writes each step into a temporary folder
  and renames it when complete, so a `kill -9` during a write leaves the previous checkpoints as they were.
- A checkpoint is never written from non-finite values (`save` raises).
- A failed write (a full disk) is one CheckpointError naming the directory and the cause; the partial checkpoint
  is removed and the earlier ones are intact. The library's own logs and thread tracebacks of that failure are
  held back (`quiet_stderr`).
- Rotation touches only this run's checkpoints (`Checkpoints` docstring).
- `newest_intact` walks back from the newest step past damaged ones (unreadable record, missing or truncated
  state); once an older step proves intact, each damaged step folder is renamed `<step>.damaged` (kept, never
  deleted; out of orbax's sight, so its keep-N rotation neither counts it nor deletes it, and the resumed run can
  write that step again).
"""
from __future__ import annotations

import concurrent.futures
import gc
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from recipes import guard

RECORD_FILE = os.path.join("record", "metadata")    # where orbax's JsonSave puts the record, inside a step folder
ITEMS = ("record", "state")                          # the items of a step folder this zoo writes
MANIFEST = "zoo-manifest.json"   # in a step folder, written last: the step and each file's size and sha256


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(folder: str) -> list[str]:
    """Every file under `folder` (relative paths, sorted) but the manifest."""
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(f for f in out if f != MANIFEST and not f.startswith(MANIFEST + "."))


def _digests(folder: str, files: list[str]) -> list[str]:
    """The files' sha256, read in parallel (hashlib releases the GIL while it hashes)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda f: _sha256(os.path.join(folder, f)), files))


def write_manifest(folder: str, step: int) -> None:
    """The manifest of a complete step folder: its step and each file's size and sha256; written atomically (a
    temporary file renamed), after everything else, so that a step with a manifest was complete when it was
    written."""
    files = _files(folder)
    body = {"step": step, "files": {f: [os.path.getsize(os.path.join(folder, f)), d]
                                    for f, d in zip(files, _digests(folder, files))}}
    tmp = os.path.join(folder, f"{MANIFEST}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_manifest(folder: str, step: int) -> str | None:
    """Why the step folder is not what its manifest says it wrote (a file missing, added, of another size or with
    other bytes; the manifest of another step), or None."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            body = json.load(f)
        files = {str(k): (int(v[0]), str(v[1])) for k, v in body["files"].items()}
        written = body["step"]
    except FileNotFoundError:
        return f"its manifest {path} is missing (written last: the step was not completed, or it was deleted)"
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"its manifest {path} is unreadable: {e}"
    if written != step:
        return f"its manifest {path} is of step {written}: its files were copied from another step"
    have = _files(folder)
    missing, extra = sorted(set(files) - set(have)), sorted(set(have) - set(files))
    if missing and extra:
        return (f"its files are not the ones written with the step ({len(missing)} missing, {len(extra)} not in its "
                f"manifest, e.g. {os.path.join(folder, extra[0])}): replaced by another step's?")
    if missing:
        return f"{os.path.join(folder, missing[0])} is missing" + (f" (and {len(missing) - 1} more files)"
                                                                     if len(missing) > 1 else "")
    if extra:
        return f"{os.path.join(folder, extra[0])} was not written with the step (not in its manifest)"
    for f in files:
        size = os.path.getsize(os.path.join(folder, f))
        if size != files[f][0]:
            return f"{os.path.join(folder, f)} has {size:,} bytes, its manifest says {files[f][0]:,}"
    names = sorted(files)
    for f, d in zip(names, _digests(folder, names)):
        if d != files[f][1]:
            return f"{os.path.join(folder, f)} does not hold the bytes written (its sha256 differs from the manifest's)"
    return None


def _reason(e: BaseException) -> str:
    """The cause of a failed write in a few words: the OS error (tensorstore reports os_error_code='28' deep in a
    long message), else the message's first line, shortened."""
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code:
        return os.strerror(int(code.group(1)))
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


class quiet_stderr:
    """Hold what is written to the process's stderr (file descriptor 2: C++ and thread output too) during a block;
    it is printed at the end if `keep()` was called, else dropped (a failure is then reported in one line)."""

    def __enter__(self) -> quiet_stderr:
        sys.stderr.flush()
        self.kept, self.saved, self.buffer = False, os.dup(2), tempfile.TemporaryFile()
        os.dup2(self.buffer.fileno(), 2)
        return self

    def keep(self) -> None:
        self.kept = True

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        if self.kept:
            self.buffer.seek(0)
            sys.stderr.write(self.buffer.read().decode(errors="replace"))
        self.buffer.close()


def collect_quietly() -> None:
    """Collect what a failed orbax read or write left behind (its coroutines and tasks, and their event loop) now,
    with `sys.unraisablehook` silenced: collected later, each prints an "Exception ignored in ..." traceback for an
    error the caller has already reported in one line."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        for _ in range(3):   # a coroutine's frame holds the task that holds the loop: a few rounds free them all
            gc.collect()
    finally:
        sys.unraisablehook = hook


class CheckpointError(RuntimeError):
    """A checkpoint could not be written."""


class Checkpoints:
    """Save and restore `(model, optimizer)` under `directory` (one sub-folder per step).

    Rotation keeps the newest `max_to_keep` checkpoints of the run being saved and deletes only older checkpoints
    of that same run (written by this object, or whose record names the same run): orbax's own rotation would
    delete any step-numbered folder it finds. `foreign()` lists step-numbered folders that are not checkpoints of
    this zoo, which the main job refuses before training."""

    def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = 3):
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep = max_to_keep
        self.written: set[int] = set()
        self.verified: dict[int, str | None] = {}   # step: why its files are not its manifest's (None: they are)
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                                                 enable_async_checkpointing=False))

    def foreign(self) -> list[str]:
        """The step-numbered folders here that hold neither a record nor a state (not a checkpoint of this zoo:
        a user's own folder, or another tool's checkpoint)."""
        return [str(step) for step in self.steps()
                if not any(os.path.exists(os.path.join(self.directory, str(step), item)) for item in ITEMS)]

    def _rotate(self, run: Any) -> None:
        if self.max_to_keep is None:
            return
        ours = [s for s in self.steps() if s in self.written or self._run_of(s) == run]
        for step in ours[:-self.max_to_keep]:
            self.manager.delete(step)

    def _run_of(self, step: int) -> Any:
        try:
            return self.record(step).get("run")
        except ValueError:
            return None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, record: dict[str, Any]) -> None:
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        bad = guard.nonfinite_leaves(state)
        if bad:
            raise ValueError(f"refusing to write checkpoint step {step} to {self.directory}: {len(bad)} "
                             f"non-finite value(s), e.g. {bad[0]}")
        folder = os.path.join(self.directory, str(step))
        existed = os.path.exists(folder)
        failure = None
        with quiet_stderr() as noise:   # orbax's threads log and print tracebacks of a failed write
            try:
                saved = self.manager.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    record=ocp.args.JsonSave({**record, "step": step, "manifest": MANIFEST})))
                if saved and jax.process_index() == 0:   # the step is complete (every process's files): sum it up
                    write_manifest(folder, step)
                noise.keep()
            except Exception as e:
                failure = e
                time.sleep(0.5)   # writes still in flight fail in the library's threads: their output is held too
                collect_quietly()   # and the failed tasks' "exception was never retrieved" logs
                logging.getLogger("asyncio").setLevel(logging.CRITICAL)   # any still to come: the run is ending
                self._remove_partial(step, None if existed else folder)
        if failure is not None:
            raise CheckpointError(f"writing checkpoint step {step} to {self.directory} failed: {_reason(failure)} "
                                  f"(the partial checkpoint is removed; the earlier ones are intact: steps "
                                  f"{self.steps() or 'none'})") from None
        if not saved:   # orbax skips a step at or before its latest one, silently
            raise CheckpointError(f"orbax did not write checkpoint step {step} to {self.directory} "
                                  f"(its latest step is {self.latest_step()})")
        self.written.add(step)
        self.verified.pop(step, None)
        self._rotate(record.get("run"))

    def _remove_partial(self, step: int, folder: str | None) -> None:
        """Remove what a failed save of `step` left: orbax's temporary folder, and the step's folder if the save
        made it (`folder`)."""
        for path in glob.glob(os.path.join(glob.escape(self.directory), f"{step}.orbax-checkpoint-tmp*")) + \
                ([folder] if folder else []):
            shutil.rmtree(path, ignore_errors=True)
        self.manager.reload()

    def record(self, step: int | None = None) -> dict[str, Any]:
        """The JSON record of `step` (default: the latest). ValueError naming the file if it is unreadable."""
        step = self.latest_step() if step is None else step
        file = os.path.join(self.directory, str(step), RECORD_FILE)
        try:
            with open(file) as f:
                record = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"checkpoint record {file} is unreadable: {e}") from None
        if not isinstance(record, dict) or record.get("step") != step:
            raise ValueError(f"checkpoint record {file} is not a record of step {step}")
        return record

    def damage(self, step: int) -> str | None:
        """Why the checkpoint of `step` cannot be resumed, from its files alone, or None: its record, its state,
        and each file against the step's manifest (sizes and sha256: read once per step; a checkpoint written
        before manifests is checked when restored)."""
        folder = os.path.join(self.directory, str(step))
        try:
            self.record(step)
        except ValueError as e:
            return str(e)
        state = os.path.join(folder, "state")
        if not os.path.isdir(state) or not os.listdir(state):
            return f"{state} is missing" if not os.path.exists(state) else f"{state} is empty"
        if self.record(step).get("manifest"):   # (checkpoints written before manifests have none to check)
            if step not in self.verified:
                self.verified[step] = check_manifest(folder, step)
            return self.verified[step]
        return None

    def set_aside(self, step: int) -> str:
        """Rename the step's folder to `<step>.damaged` (or `.damaged-2`, ...); orbax then no longer sees it."""
        src = os.path.join(self.directory, str(step))
        dst, k = src + ".damaged", 1
        while os.path.exists(dst):
            k += 1
            dst = f"{src}.damaged-{k}"
        if jax.process_index() == 0:   # several processes: each finds the same damage; process 0 renames
            os.rename(src, dst)
        self.verified.pop(step, None)
        return dst

    def newest_intact(self, check: Callable[[dict], None] = lambda record: None,
                      model: nnx.Module | None = None, optimizer: nnx.Optimizer | None = None,
                      say: Callable[[str], None] = print) -> tuple[int | None, dict | None]:
        """(step, record) of the newest intact checkpoint; (None, None) if there is none at all. `check(record)` may
        raise to refuse it (a different run: not damage, so the walk stops there). With `model` and `optimizer`,
        each candidate is restored into them, and a failure (e.g. a truncated array file) counts as damage.

        The newer, damaged steps are set aside (`set_aside`, reported through `say`) only once an older one has
        proved intact: if none is, nothing is renamed (a failure common to all, such as code that no longer
        matches the checkpoints, must not look like damage) and ValueError lists each step's reason."""
        damaged: list[tuple[int, str]] = []
        for step in reversed(self.steps()):
            reason = self.damage(step)
            record = None
            if reason is None:
                record = self.record(step)
                check(record)
                if model is not None:
                    try:
                        record = self.restore(model, optimizer, step)
                    except Exception as e:   # orbax/tensorstore errors have no common base class
                        detail = str(e).split("\n")[0].split(" See full TensorStore details")[0]
                        reason = f"restoring it failed: {detail[:200]}"
                        del e
                        collect_quietly()
            if reason is not None:
                damaged.append((step, reason))
                continue
            for bad, why in damaged:
                moved = self.set_aside(bad)
                say(f"checkpoint step {bad} in {self.directory} is damaged ({why}); moved to {moved} (kept, not "
                    f"deleted); step {step} is intact")
            if damaged:
                if jax.process_count() > 1:   # every process sees the folders process 0 renamed
                    from jax.experimental import multihost_utils
                    multihost_utils.sync_global_devices(f"offload_zoo/set_aside/{step}")
                self.manager.reload()
            return step, record
        if damaged:
            raise ValueError(f"no checkpoint in {self.directory} can be resumed (nothing was changed): " +
                             "; ".join(f"step {s}: {why}" for s, why in damaged) +
                             ". To start afresh, move them away or choose another --ckpt-dir")
        return None, None

    def restore(self, model: nnx.Module, optimizer: nnx.Optimizer, step: int | None = None) -> dict[str, Any]:
        """Load the checkpoint of `step` (default: the latest) into `model` and `optimizer`; return its record.
        Nothing is changed unless the whole checkpoint reads."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"no checkpoint in {self.directory}")
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        # The target is abstract and carries the live state's shardings: a checkpoint written on one mesh is read
        # straight onto this run's mesh (each device reads only its shards).
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                                state)
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                 record=ocp.args.JsonRestore()))
        nnx.update(model, out["state"]["model"])
        nnx.update(optimizer, out["state"]["optimizer"])
        return out["record"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()
        collect_quietly()   # a failed restore's coroutines, held by orbax until now
