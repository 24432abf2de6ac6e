"""Watching a run: a live line while something long and silent runs (compiling), the ETA of the progress line,
and TensorBoard scalars (`--tensorboard DIR`).

- `busy(console, what)`: a context manager. On a terminal, a spinner with `what` and the elapsed seconds, updated
  live and gone when done; in a log file, the line once and then `... still <what>: 60 s` every 30 s.
- `eta(done, total, seconds)`: "ETA 1m05s" from the mean time of the steps done.
- `Board(directory)`: scalars through tensorboardX (a pure-Python event writer, no TensorFlow; `pip install -e
  ".[watch]"`); `tensorboard --logdir DIR` shows them.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from rich.console import Console

EVERY_S = 30.0   # off a terminal: a "still ..." line this often


@contextlib.contextmanager
def busy(console: Console, what: str, every_s: float = EVERY_S) -> Iterator[None]:
    """Say what runs while it runs (see the module docstring)."""
    if console.is_terminal:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        with Progress(SpinnerColumn(), TextColumn(what), TimeElapsedColumn(), console=console, transient=True) as p:
            p.add_task(what, total=None)
            yield
        return
    console.print(f"{what} ...", soft_wrap=True, markup=False)
    t0, done = time.perf_counter(), threading.Event()

    def tick() -> None:
        while not done.wait(every_s):
            console.print(f"... still {what}: {time.perf_counter() - t0:.0f} s", soft_wrap=True, markup=False)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 42s."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def eta(done: int, total: int, seconds: float) -> str:
    """The time the `total - done` steps left take at the mean pace of the `done` steps timed in `seconds`."""
    return f"ETA {duration(seconds / done * (total - done))}" if done > 0 and total > done else "ETA 0s"


def bytes_bar(console: Console) -> Callable[[int], Callable[[int], None]]:
    """A progress bar over bytes for `recipes.text.prepare` on a terminal: start(total) -> advance(done); the bar
    closes when done reaches total."""
    def start(total: int) -> Callable[[int], None]:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
        bar = Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                       console=console)
        task = bar.add_task("tokenizing", total=total)
        bar.start()

        def advance(done: int) -> None:
            bar.update(task, completed=min(done, total))
            if done >= total:
                bar.stop()
        return advance
    return start


# The progress row's keys written as scalars, under TensorBoard names (grouped by the part before the slash).
SCALARS = {"loss": "train/loss", "mtp_loss": "train/mtp_loss", "aux_loss": "train/aux_loss",
           "grad_norm": "train/grad_norm", "lr": "train/lr",
           "eval_loss": "eval/loss", "eval_perplexity": "eval/perplexity",
           "tokens_per_s": "speed/tokens_per_s", "model_tflops": "speed/model_tflops", "mfu": "speed/mfu",
           "peak_hbm_bytes": "memory/peak_hbm_bytes", "host_bytes": "memory/host_bytes",
           "dropped": "moe/dropped", "drop_fraction": "moe/drop_fraction"}


class Board:
    """TensorBoard scalars of each logged row (keys in SCALARS; a None value is skipped)."""

    def __init__(self, directory: str):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ValueError("--tensorboard needs the `tensorboardX` package: pip install -e \".[watch]\"") from None
        self.writer = SummaryWriter(directory)

    def write(self, row: dict) -> None:
        for key, name in SCALARS.items():
            if row.get(key) is not None:
                self.writer.add_scalar(name, float(row[key]), row["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
