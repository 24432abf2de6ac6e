"""The checkpoint library's noise kept from the user's terminal: what orbax, tensorstore and asyncio print when a
read or write fails goes to a log file in the checkpoint directory; the zoo says what happened in one line.

- `quiet_stderr(log)`: hold what is written to file descriptor 2 (C++ and thread output too) during a block: printed
  at the end if `keep()` was called, else appended to `log` (or dropped without one).
- `collect_quietly()`: collect a failed read's or write's coroutines, tasks and event loop now, their
  "Exception ignored in ..." tracebacks silenced.
- `library_log(directory)`: from now on in this process, the loggers of orbax (through absl), asyncio and
  tensorstore, the warnings raised in orbax's code, and the unraisable errors of orbax's and tensorstore's
  callbacks (an "Event loop is closed" traceback printed from a reader thread after a failed restore) are written
  to `directory/zoo-library.log` (created only when something is written; `zoo-library.process-N.log` on process
  N > 0) instead of stderr. Its path is returned.
"""
from __future__ import annotations

import gc
import logging
import os
import sys
import tempfile
import traceback
import warnings

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
