"""Watching a run: a live line while something long and silent runs (compiling), the ETA of the progress line,
and TensorBoard scalars (`--tensorboard DIR`).

- `busy(console, what)`: a context manager. On a terminal, a spinner with `what` and the elapsed seconds, updated
  live and gone when done; in a log file, the line once and then `... still <what>: 60 s` every 30 s.
- `eta(done, total, seconds)`: "ETA 1m05s" from the mean time of the steps done.
- `Progress(console, total, start)`: the training progress: a rich bar on a terminal, and a plain line per logged
  step always (loss, grad norm, tok/s, TFLOP/s, MFU, HBM, host bytes, ETA, held-out loss).
- `DropWatch(console, threshold)`: capacity dispatch's dropped token copies, warned about once and summed up.
- `StepTrace(directory, step, console)`: `--profile DIR`, a `jax.profiler` trace of that one step.
- `Board(directory)`: scalars through tensorboardX (a pure-Python event writer, no TensorFlow; `pip install -e
  ".[watch]"`); `tensorboard --logdir DIR` shows them. One run per directory (a resumed run continues its own).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

from rich.console import Console

from recipes.train.watching import meter

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
    # The stream the console writes to now: the heartbeat thread writes there, not to whatever `sys.stdout` is when
    # it wakes, since the work it watches may redirect stdout meanwhile (zoo.plan.measure reads JAX's printed
    # residuals through `contextlib.redirect_stdout`, and a line of ours there would be read as one of JAX's).
    stream = console.file

    def tick() -> None:
        while not done.wait(every_s):
            stream.write(f"... still {what}: {time.perf_counter() - t0:.0f} s\n")
            stream.flush()

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
    """A progress bar over bytes for `recipes.train.inputs.text.prepare` on a terminal: start(total) -> advance(done);
    the bar closes when done reaches total."""
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
    """TensorBoard scalars of each logged row (keys in SCALARS; a None value is skipped), into `directory`, which
    this run holds for itself:

    - a second live run given the same directory is refused (an exclusive `fcntl.flock` on
      `directory/.zoo-tensorboard.lock`, dropped by the kernel when the run ends): two runs' event files in one
      directory are one TensorBoard run, their train/loss interleaved;
    - a directory already holding event files is refused unless this is `--resume` of the run that wrote them (its
      identity is recorded in `directory/.zoo-tensorboard.json`); a resumed run then continues the curves from its
      checkpoint (`start_at`: TensorBoard drops the old events of the steps it runs again).

    ValueError naming the directory, before anything compiles."""

    def __init__(self, directory: str, *, run: dict | None = None, resume: bool = False):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ValueError("--tensorboard needs the `tensorboardX` package: pip install -e \".[watch]\"") from None
        self.directory, self.make, self.writer = os.path.abspath(directory), SummaryWriter, None
        try:
            os.makedirs(self.directory, exist_ok=True)
            self.fd = os.open(os.path.join(self.directory, BOARD_LOCK), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ValueError(f"--tensorboard {self.directory} cannot be written: {e.strerror or e}") from None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 4096, 0).decode(errors="replace").strip() or "a live process"
            os.close(self.fd)
            raise ValueError(f"--tensorboard {self.directory} is being written by another run ({holder}); give each "
                             f"run its own directory (`tensorboard --logdir` of their parent shows them side by "
                             f"side)") from None
        try:
            self._claim(run, resume)
        except BaseException:
            os.close(self.fd)
            raise

    def _claim(self, run: dict | None, resume: bool) -> None:
        record_path = os.path.join(self.directory, BOARD_RECORD)
        events = sorted(f for f in os.listdir(self.directory) if f.startswith("events.out.tfevents"))
        if events:
            try:
                with open(record_path) as f:
                    owner = json.load(f).get("run")
            except (OSError, ValueError, AttributeError):
                owner = None
            if not (resume and owner is not None and owner == run):
                why = ("this run is not --resume" if not resume and owner == run else
                       "they are another run's" if owner is not None else "no run of the zoo recorded them")
                raise ValueError(f"--tensorboard {self.directory} already holds event files ({events[0]}"
                                 f"{' ...' if len(events) > 1 else ''}) and {why}: TensorBoard would show both "
                                 f"runs as one, their steps interleaved; choose an empty directory (e.g. a new "
                                 f"subdirectory: `tensorboard --logdir` of the parent shows every run)")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        with open(record_path + ".tmp", "w") as f:
            json.dump({"run": run}, f)
        os.replace(record_path + ".tmp", record_path)

    def start_at(self, step: int) -> None:
        """Open the writer for steps after `step`: its file starts with a purge at `step + 1` (a session start),
        on which TensorBoard discards the earlier files' events of steps > `step` (those a killed run wrote past
        its last checkpoint, or before its first: `step` 0), so each step has one point."""
        # tensorboardX names its file by the second and the host and opens it "wb": the suffix keeps a resumed
        # run's file from replacing the one it continues
        self.writer = self.make(self.directory, purge_step=step + 1, filename_suffix=f".{os.getpid()}.from{step}")

    def write(self, row: dict) -> None:
        if self.writer is None:
            self.start_at(0)
        for key, name in SCALARS.items():
            if row.get(key) is not None:
                self.writer.add_scalar(name, float(row[key]), row["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        os.close(self.fd)   # the lock goes with it


BOARD_LOCK, BOARD_RECORD = ".zoo-tensorboard.lock", ".zoo-tensorboard.json"


class DropWatch:
    """Capacity dispatch drops token copies over an expert's capacity: warn when a step drops more than
    `threshold` of its routed copies, once (at the first such step), and sum them up at the end of the run."""

    def __init__(self, console: Console, threshold: float):
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


class StepTrace:
    """A `jax.profiler` trace of one training step (`--profile DIR`): started as the step is dispatched, stopped once
    its metrics are back, so it holds the whole step. TensorBoard's profile plugin (xprof) or Perfetto reads it.

    Args:
        directory: where the trace goes (None: no trace).
        step: the step traced.
        console: where the trace's place is said once it is written.
    """

    def __init__(self, directory: str | None, step: int, console: Console):
        self.directory, self.step, self.console, self.on = directory, step, console, False

    def begin(self, step: int) -> None:
        """Start the trace if `step` is the one traced."""
        if self.directory and step == self.step:
            import jax
            jax.profiler.start_trace(self.directory)
            self.on = True

    def end(self, step: int) -> None:
        """Stop the trace after `step` (its metrics read back), and say where it is."""
        if self.on:
            self.close()
            self.console.print(f"profile of step {step}: {self.directory}", soft_wrap=True, markup=False)

    def close(self) -> None:
        """Stop a trace still running (a run that ends inside the traced step)."""
        if self.on:
            import jax
            self.on = False
            jax.profiler.stop_trace()
