"""Checkpoints of a training run with orbax: the model's and the optimizer's NNX state, and a small JSON record.

The record holds the step and what the run was, so that `--resume` refuses a checkpoint of a different run; the data is
a pure function of (seed, step) and the schedule reads the optimizer's step count, so restoring the two states and the
step reproduces the uninterrupted run exactly.

- Saving is synchronous; a checkpoint is never written from non-finite values; a failed write is one CheckpointError
  naming the directory and the cause, the partial checkpoint removed (the library's logs go to `zoo-library.log` there,
  `library_log`).
- Each step ends with its manifest (`recipes.train.checkpoints.manifest`), which `damage(step)` checks before orbax
reads the step. - Rotation touches only this run's checkpoints; `newest_intact` walks back past damaged steps and, once
  an older one proves intact, renames each damaged folder `<step>.damaged` (kept, never deleted).

- The checkpoint library's noise is kept from the user's terminal (the last section: `quiet_stderr`,
  `collect_quietly`, `library_log`): what orbax, tensorstore and asyncio print when a read or write fails goes to a
  log file in the checkpoint directory; the zoo says what happened in one line.

Why each of these: docs/internals.md, "Checkpoints".
"""
from __future__ import annotations

import gc
import glob
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import nnx

from recipes.train.checkpoints import guard
from recipes.train.checkpoints.manifest import MANIFEST, check_manifest, unlisted, write_manifest

RECORD_FILE = os.path.join("record", "metadata")    # where orbax's JsonSave puts the record, inside a step folder
ORBAX_COMMIT = "_CHECKPOINT_METADATA"                # orbax's record of a step: its commit time, among others
ORBAX_STATE = os.path.join("state", "_METADATA")      # orbax's metadata of the state's tree
ITEMS = ("record", "state")                          # the items of a step folder this zoo writes
def _reason(e: BaseException) -> str:
    """The cause of a failed write in a few words: the OS error (tensorstore reports os_error_code='28' deep in a
    long message), else the message's first line, shortened."""
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code:
        return os.strerror(int(code.group(1)))
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


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
        self.unverified: set[int] = set()            # steps without a manifest that orbax recorded as committed
        self.noted: set[tuple[int, str]] = set()     # (step, note) said already
        self.undeletable: set[int] = set()           # steps rotation could not delete (said once, then left)
        # orbax's, tensorstore's and asyncio's logs, warnings and stray tracebacks: into a file here, not the terminal
        # (from before orbax first reads the steps: it logs a step whose metadata it cannot read)
        os.makedirs(self.directory, exist_ok=True)
        self.log = library_log(self.directory, jax.process_index())
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=None, create=True,
                                                                 enable_async_checkpointing=False))

    def foreign(self) -> list[str]:
        """The step-numbered folders here that hold neither a record nor a state (not a checkpoint of this zoo:
        a user's own folder, or another tool's checkpoint)."""
        return [str(step) for step in self.steps()
                if not any(os.path.exists(os.path.join(self.directory, str(step), item)) for item in ITEMS)]

    def _rotate(self, run: Any, say: Callable[[str], None]) -> None:
        """Delete this run's checkpoints older than the newest `max_to_keep`; one that cannot be deleted (read-only)
        is kept, and said so once through `say`: the new checkpoint is written and the run goes on."""
        if self.max_to_keep is None:
            return
        ours = [s for s in self.steps() if s in self.written or self._run_of(s) == run]
        for step in (s for s in ours[:-self.max_to_keep] if s not in self.undeletable):
            try:
                self.manager.delete(step)
            except Exception as e:   # orbax raises what the file system does (PermissionError, ...), or its own
                self.manager.reload()
                self.undeletable.add(step)
                say(f"warning: checkpoint rotation could not delete step {step} in {self.directory} ({_reason(e)}); "
                    f"it is kept (delete it by hand to free its space) and the run goes on")

    def _run_of(self, step: int) -> Any:
        try:
            return self.record(step).get("run")
        except ValueError:
            return None

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, model: nnx.Module, optimizer: nnx.Optimizer, record: dict[str, Any],
             say: Callable[[str], None] = print) -> None:
        state = {"model": nnx.state(model), "optimizer": nnx.state(optimizer)}
        bad = guard.nonfinite_leaves(state)
        if bad:
            raise ValueError(f"refusing to write checkpoint step {step} to {self.directory}: {len(bad)} "
                             f"non-finite value(s), e.g. {bad[0]}")
        folder = os.path.join(self.directory, str(step))
        existed = os.path.exists(folder)
        failure = None
        with quiet_stderr(self.log) as noise:   # orbax's threads log and print tracebacks of a failed write
            try:
                saved = self.manager.save(step, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    record=ocp.args.JsonSave({**record, "step": step, "manifest": MANIFEST,
                                              "directory": self.directory})))   # (`resume.same`)
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
                                  f"{self.steps() or 'none'}; the library's log: {self.log})") from None
        if not saved:   # orbax skips a step at or before its latest one, silently
            raise CheckpointError(f"orbax did not write checkpoint step {step} to {self.directory} "
                                  f"(its latest step is {self.latest_step()})")
        self.written.add(step)
        self.verified.pop(step, None)
        self.unverified.discard(step)
        self._rotate(record.get("run"), say)

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
                why = check_manifest(folder, step)
                if why is not None and not os.path.exists(os.path.join(folder, MANIFEST)) and self._committed(folder):
                    why = None
                    self.unverified.add(step)
                self.verified[step] = why
            return self.verified[step]
        return None

    def _committed(self, folder: str) -> bool:
        """Did orbax record the step folder as complete (a commit time, and its state's metadata)?"""
        try:
            with open(os.path.join(folder, ORBAX_COMMIT)) as f:
                committed = json.load(f).get("commit_timestamp_nsecs")
        except (OSError, ValueError, AttributeError):
            return False
        return bool(committed) and os.path.isfile(os.path.join(folder, ORBAX_STATE))

    def notes(self, step: int) -> list[str]:
        """What is said of a step that is resumed though not all it holds is its manifest's (each once)."""
        folder = os.path.join(self.directory, str(step))
        out = []
        if step in self.unverified:
            out.append(f"checkpoint step {step} in {self.directory} has no manifest ({os.path.join(folder, MANIFEST)}: "
                       f"deleted, or the run was killed before writing it): orbax recorded the step as complete, so it "
                       f"is resumed if it restores, its bytes unverified against checksums")
        extra = unlisted(folder)
        if extra:
            out.append(f"checkpoint step {step} in {self.directory}: {len(extra)} file(s) not written with the step "
                       f"(not in its manifest), ignored: {', '.join(os.path.join(folder, f) for f in extra[:3])}"
                       + (" ..." if len(extra) > 3 else ""))
        fresh = [n for n in out if (step, n) not in self.noted]
        self.noted.update((step, n) for n in fresh)
        return fresh

    def set_aside(self, step: int) -> str:
        """Rename the step's folder to `<step>.damaged` (or `.damaged-2`, ...); orbax then no longer sees it."""
        src = os.path.join(self.directory, str(step))
        self.verified.pop(step, None)
        self.unverified.discard(step)
        if jax.process_index() != 0:   # several processes: each finds the same damage; process 0 renames
            return f"{src}.damaged (by process 0)"
        dst, k = src + ".damaged", 1
        while os.path.exists(dst):
            k += 1
            dst = f"{src}.damaged-{k}"
        os.rename(src, dst)
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
                    with quiet_stderr(self.log) as noise:   # a failed read's C++ and thread output: into the log
                        try:
                            record = self.restore(model, optimizer, step)
                            noise.keep()
                        except Exception as e:   # orbax/tensorstore errors have no common base class
                            detail = str(e).split("\n")[0].split(" See full TensorStore details")[0]
                            reason = f"restoring it failed: {detail[:200]} (the library's log: {self.log})"
                            del e
                            collect_quietly()
            if reason is not None:
                damaged.append((step, reason))
                continue
            for note in self.notes(step):
                say(note)
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


# -- the checkpoint library's noise, kept from the user's terminal -------------------------------------------------
# What orbax, tensorstore and asyncio print when a read or write fails goes to a log file in the checkpoint directory;
# the zoo says what happened in one line.
# - `quiet_stderr(log)`: hold what is written to file descriptor 2 (C++ and thread output too) during a block: printed
#   at the end if `keep()` was called, else appended to `log` (or dropped without one).
# - `collect_quietly()`: collect a failed read's or write's coroutines, tasks and event loop now, their
#   "Exception ignored in ..." tracebacks silenced.
# - `library_log(directory)`: from now on in this process, the loggers of orbax (through absl), asyncio and
#   tensorstore, the warnings raised in orbax's code, and the unraisable errors of orbax's and tensorstore's
#   callbacks (an "Event loop is closed" traceback printed from a reader thread after a failed restore) are written
#   to `directory/zoo-library.log` (created only when something is written; `zoo-library.process-N.log` on process
#   N > 0) instead of stderr. Its path is returned.
LOG_NAME = "zoo-library.log"
LOGGERS = ("absl", "orbax", "asyncio", "tensorstore")
_routed: dict[str, object] = {}   # the log file's path, once routed (one per process)


class quiet_stderr:
    """Hold what is written to the process's stderr (file descriptor 2: C++ and thread output too) during a block;
    it is printed at the end if `keep()` was called, else appended to `log` (dropped without one): a failure is
    then reported in one line."""

    def __init__(self, log: str | None = None):
        self.log = log

    def __enter__(self) -> quiet_stderr:
        sys.stderr.flush()
        self.kept, self.saved, self.buffer = False, os.dup(2), tempfile.TemporaryFile()
        os.dup2(self.buffer.fileno(), 2)
        return self

    def keep(self) -> None:
        self.kept = True

    def __exit__(self, *_exc) -> None:
        sys.stderr.flush()
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.buffer.seek(0)
        held = self.buffer.read()
        self.buffer.close()
        if self.kept:
            sys.stderr.write(held.decode(errors="replace"))
        elif self.log and held:
            try:
                with open(self.log, "ab") as f:
                    f.write(held)
            except OSError:
                pass


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


def _is_library(frame_files: list[str]) -> bool:
    return any(f"{os.sep}{name}{os.sep}" in f for f in frame_files for name in ("orbax", "tensorstore", "asyncio"))


def library_log(directory: str, process: int = 0) -> str:
    """Route the libraries' noise to a log file in `directory` (see the module docstring); its path."""
    if "path" in _routed:
        return _routed["path"]
    name = LOG_NAME if process == 0 else LOG_NAME.replace(".log", f".process-{process}.log")
    path = os.path.join(directory, name)
    handler = logging.FileHandler(path, delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for logger in map(logging.getLogger, LOGGERS):
        logger.addHandler(handler)
        logger.propagate = False

    def write(text: str) -> None:
        handler.acquire()
        try:
            with open(path, "a") as f:
                f.write(text if text.endswith("\n") else text + "\n")
        except OSError:
            pass
        finally:
            handler.release()

    previous_hook, previous_show = sys.unraisablehook, warnings.showwarning

    def hook(unraisable) -> None:
        tb = traceback.extract_tb(unraisable.exc_traceback) if unraisable.exc_traceback else []
        owner = getattr(getattr(unraisable.object, "cr_code", None), "co_filename", "") or ""
        if _is_library([fr.filename for fr in tb] + [owner]):
            write("".join(traceback.format_exception(unraisable.exc_type, unraisable.exc_value,
                                                     unraisable.exc_traceback)))
        else:
            previous_hook(unraisable)

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if _is_library([filename]):
            write(warnings.formatwarning(message, category, filename, lineno, line))
        else:
            previous_show(message, category, filename, lineno, file, line)

    sys.unraisablehook, warnings.showwarning = hook, show
    _routed["path"] = path
    return path
