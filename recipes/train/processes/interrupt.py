"""Ctrl-C (SIGINT) and SIGTERM (how clusters preempt a job) during `python -m recipes.train`.

- While training: the signal is noted, the step running finishes, a checkpoint of it is written when --ckpt-dir
  is given, one line says so, and the command exits with 128 + the signal's number (130 for SIGINT, 143 for
  SIGTERM: the shell's convention, which schedulers read as "killed by a signal").
- Before training (checks, compile, restore): nothing is worth saving yet; the run stops at once (`Interrupted`,
  raised where the main thread is, which cleans up through the usual `finally` blocks: lock, metrics file).
- A second signal exits at once (`os._exit`, no traceback, no cleanup): a checkpoint being written is left
  incomplete in orbax's temporary folder, and the checkpoints already written are intact.
- Several processes: a scheduler signals each process at its own moment, but a checkpoint is a collective write,
  so they must stop after the same step: `requested()` is a max over the processes of "signal seen" (one small
  all-gather per step, only when there is more than one process).

No KeyboardInterrupt is ever raised, so neither the checkpoint library's threads nor the loop print a traceback.
"""
from __future__ import annotations

import os
import signal
import threading

import numpy as np

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):   # not an Exception: no `except Exception` on the way may swallow it
    """A signal arrived before training started: the run stops with nothing to save."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Interrupts:
    """A context that catches SIGINT and SIGTERM (in the main thread; elsewhere it does nothing)."""

    def __init__(self):
        self.signum: int | None = None
        self.training = False          # True: note the signal and let the loop stop after its step
        self._previous: dict[int, object] = {}
        self._stderr: int | None = None   # a copy of fd 2 as it was: stderr may be held back during a save

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._stderr = os.dup(2)
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *_exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
        if self._stderr is not None:
            os.close(self._stderr)
            self._stderr = None

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            line = f"second {name}: exiting at once without saving (the checkpoints already written are intact)\n"
            os.write(self._stderr if self._stderr is not None else 2, line.encode())
            os._exit(128 + signum)
        self.signum = signum
        if not self.training:
            raise Interrupted(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or 0)

    def requested(self) -> bool:
        """Whether to stop after this step: a signal seen here, or (several processes) by any process."""
        import jax
        if jax.process_count() == 1:
            return self.signum is not None
        from jax.experimental import multihost_utils
        seen = int(np.max(multihost_utils.process_allgather(np.int32(self.signum or 0))))
        if seen and self.signum is None:
            self.signum = seen
        return bool(seen)
