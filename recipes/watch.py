"""Watching a run: a live line while something long and silent runs (compiling), the ETA of the progress line,
and TensorBoard scalars (`--tensorboard DIR`).

- `busy(console, what)`: a context manager. On a terminal, a spinner with `what` and the elapsed seconds, updated
  live and gone when done; in a log file, the line once and then `... still <what>: 60 s` every 30 s.
- `eta(done, total, seconds)`: "ETA 1m05s" from the mean time of the steps done.
- `Progress(console, total, start)`: the training progress: a rich bar on a terminal, and a plain line per logged
  step always (loss, grad norm, tok/s, TFLOP/s, MFU, HBM, host bytes, ETA, held-out loss).
- `DropWatch(console, threshold)`: capacity dispatch's dropped token copies, warned about once and summed up.
- `Board(directory)`: scalars through tensorboardX (a pure-Python event writer, no TensorFlow; `pip install -e
  ".[watch]"`); `tensorboard --logdir DIR` shows them.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from rich.console import Console

from recipes import meter

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


class DropWatch:
    """Capacity dispatch drops token copies over an expert's capacity: warn when a step drops more than
    `threshold` of its routed copies, once (at the first such step), and sum them up at the end of the run."""

    def __init__(self, console: Console, threshold: float, every: int = 0):
        self.console, self.threshold, self.last = console, threshold, None
        self.steps, self.worst = 0, 0.0    # steps over the threshold, the largest fraction dropped

    def fraction(self, m: dict) -> float | None:
        routed = int(m.get("routed", 0))
        return int(m["dropped"]) / routed if routed else None

    def check(self, step: int, m: dict) -> None:
        frac = self.fraction(m)
        if frac is None or frac <= self.threshold:
            return
        self.steps, self.worst = self.steps + 1, max(self.worst, frac)
        if self.last is not None:
            return
        self.last = step
        self.console.print(f"[bold yellow]step {step}: capacity dispatch dropped {int(m['dropped']):,} of "
                           f"{int(m['routed']):,} token copies ({100 * frac:.2f}% > --max-drop-warn "
                           f"{100 * self.threshold:g}%): raise capacity_factor (--set capacity_factor=...) or use "
                           f"a dropless moe_backend (tokamax, ragged_dot); said once, summed up at the end[/]",
                           soft_wrap=True)

    def summary(self) -> None:
        if self.steps > 1:
            self.console.print(f"[bold yellow]capacity dispatch dropped more than {100 * self.threshold:g}% of the "
                               f"token copies in {self.steps} steps (at most {100 * self.worst:.2f}%; per step: "
                               f"`dropped` in --metrics)[/]", soft_wrap=True)


class Progress:
    """A rich progress bar on a terminal; plain log lines always (they are what a log file keeps)."""

    def __init__(self, console: Console, total: int, start: int):
        self.console, self.total = console, total
        self.first = None   # (time, step) of the first logged step: the pace for the ETA is measured from it
        self.bar = None
        if console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console)
            self.task = self.bar.add_task("train", total=total, completed=start, info="")
            self.bar.start()

    def log(self, row: dict) -> None:
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "-"
        mtp = f"  mtp loss {row['mtp_loss']:.4f}" if "mtp_loss" in row else ""
        line = (f"step {row['step']:>6}  loss {row['loss']:.4f}{mtp}  grad {row['grad_norm']:.3f}  "
                f"tok/s {row['tokens_per_s']:,.0f}  TFLOP/s {row['model_tflops']:.3g}  MFU {mfu}")
        if row["peak_hbm_bytes"] is not None:   # backends that keep memory statistics (GPU, TPU)
            line += f"  HBM peak {meter.fmt_bytes(row['peak_hbm_bytes'])}"
        if row["host_bytes"] is not None:
            line += f"  host {meter.fmt_bytes(row['host_bytes'])}"
        now = time.perf_counter()
        if self.first is None:
            self.first = (now, row["step"])
        elif row["step"] < self.total:
            line += "  " + eta(row["step"] - self.first[1], self.total - self.first[1], now - self.first[0])
        if "eval_loss" in row:
            line += f"  held-out loss {row['eval_loss']:.4f}  ppl {row['eval_perplexity']:.2f}"
        self.console.print(line, soft_wrap=True)

    def advance(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=f"loss {loss:.4f}")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
