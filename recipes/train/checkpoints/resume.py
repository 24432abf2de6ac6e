"""What a run reads before it builds anything and what it writes: its checkpoint directory taken (`Session`), its
checkpoints (refusing to overwrite a run or to resume a different one), its data (opened in the inputs room,
`recipes.train.inputs.data.sources`: a token file checked and fingerprinted, text tokenized), the newest intact
checkpoint of this run to resume from (restored by `restore`), and its metrics file and TensorBoard.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
from rich.console import Console

from recipes.train.checkpoints import guard
from recipes.train.checkpoints.checkpoint import Checkpoints
from recipes.train.inputs import data as data_lib
from recipes.train.processes import agree
from recipes.train.processes.interrupt import Interrupts
from recipes.train.processes.lock import DirLock
from recipes.train.settings.job import Cadence, Job
from recipes.train.watching import watch
from zoo import renames

# `sources` opens what a run reads, in the inputs room now, for one release (docs/changes.md)
renames.ATTRIBUTES[__name__] = {"sources": "recipes.train.inputs.data.sources"}
__getattr__ = renames.attributes(__name__)


# Paths a run recorded, found again after its folder moved (`mv run1 run2`, then the same command in run2).
#
# A checkpoint's record and the checkpoint directory's lock hold the directory they were written in (`directory`)
# beside the absolute paths of the run's files (its --metrics file, its token file). When the checkpoint directory
# is elsewhere now, a recorded path is also looked for at the same place relative to it (`rebased`): a file inside
# the folder that moved moved with it, and one outside it stayed where it was. Either place is the run's own.
def rebased(path: str | None, then: str | None, now: str | os.PathLike) -> str | None:
    """`path`, recorded when the checkpoint directory was `then`, where it is if it moved with the directory (now
    `now`); `path` itself when the directory did not move or its old place is not recorded."""
    if not path or not then or os.path.abspath(then) == os.path.abspath(now):
        return path
    return os.path.normpath(os.path.join(os.path.abspath(now), os.path.relpath(path, then)))


def same(recorded: str | None, path: str | os.PathLike | None, then: str | None, now: str | os.PathLike) -> bool:
    """Is `path` the file recorded as `recorded`, where it was or where it moved with the checkpoint directory?"""
    if recorded is None or path is None:
        return False
    return os.path.abspath(path) in {recorded, rebased(recorded, then, now)}


# The settings a run's identity holds only off their default: (the default, why a change is refused). Each is refused
# in both directions, naming the value the checkpoint was written with.
CHANGED_SETTINGS = {
    "params": ("device", "--params host trains a float32 master copy of the parameters (part of the optimizer state) "
                         "and --params device keeps none, so the two runs' states and numbers differ"),
    "opt_dtype": ("float32", "the optimizer moments were stored and updated in that dtype, so the two runs' numbers "
                             "differ (moments cast to another dtype are not the run's)"),
    "grad_accum": (1, "an update sums the gradients of that many micro-batches, in an order that changes its numbers "
                      "(equal up to rounding, not bit for bit)"),
}


def check_resumable(record: dict, job: Job, directory: str, data: dict | None = None) -> None:
    """ValueError unless the checkpoint's record is of this run: its identity, and the token file it read
    (`check_data`)."""
    storage, want = job.storage, job.identity
    have = dict(record.get("run", {}))
    if storage.allow_data_change:   # the data's path may change too
        have["data"] = want["data"]
    had = record.get("data")
    if had and data and same(had.get("path"), data.get("path"), record.get("directory"), directory):
        had = {**had, "path": data["path"]}   # the token file moved with the run's folder
    check_data(had, data, job.data.path, storage.allow_data_change, directory)
    if "schedule_steps" not in have and "steps" in have:   # a record written before --schedule-steps existed
        have["schedule_steps"] = have.pop("steps")
        have["warmup"] = have["warmup"] if have.get("warmup") is not None else max(1, have["schedule_steps"] // 10)
    for key, (default, why) in CHANGED_SETTINGS.items():
        had, now = have.get(key, default), want.get(key, default)
        if had != now:   # either way: the identity holds the key only off its default (as records written before it)
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"--resume: the checkpoint in {directory} was written with {flag} {had}, this run asks "
                             f"for {flag} {now}: {why}; resume with {flag} {had}")
    diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
    if diff:
        if set(diff) <= {"schedule_steps", "warmup"} and not storage.schedule_given:
            planned = diff["schedule_steps"][0]
            raise ValueError(f"--resume --steps {job.cadence.steps}: the run in {directory} was planned for {planned} "
                             f"steps (its learning-rate schedule); to train on past step {planned} at the schedule's "
                             f"final learning rate (lr/10), add --schedule-steps {planned}")
        lines = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"--resume: the checkpoint in {directory} is of a different run ({lines})")


def check_data(have: dict | None, now: dict | None, path: str | None, allowed: bool, directory: str) -> None:
    """--resume on a token file other than the one the checkpoint's run read (path, dtype, size or fingerprint,
    `recipes.train.inputs.data.TokenFile.identity`) is refused unless --allow-data-change. Records written before the
    data was recorded have none: nothing to compare. `path` is --data, `allowed` --allow-data-change."""
    if have is None or now is None or allowed:
        return
    diff = [f"{k}: checkpoint {have.get(k)!r}, now {v!r}" for k, v in now.items() if have.get(k) != v]
    if diff:
        raise ValueError(f"--resume: --data {path} is not the file the run in {directory} read "
                         f"({'; '.join(diff)}); pass --allow-data-change to resume on it anyway")


@dataclasses.dataclass
class Inputs:
    """What a run reads before it builds anything: its checkpoints (None: no --ckpt-dir), its data (training and
    held-out sources, the token file's identity) and the newest intact checkpoint of this run (with --resume)."""
    ckpts: Checkpoints | None
    source: data_lib.Source
    held: Any
    data_id: dict | None
    check: Callable
    say: Callable
    resume_step: int | None
    resume_record: dict | None
    resuming: bool = False   # --resume
    finished: bool = False   # resumed a run already at --steps: nothing to do


def open_inputs(job: Job, console: Console) -> Inputs:
    """Refuse to overwrite a run, or to resume a different one, before spending time on the model; open the data
    (a token file is checked and fingerprinted now) and find the checkpoint to resume from."""
    storage, cadence = job.storage, job.cadence
    ckpts = Checkpoints(storage.ckpt_dir) if storage.ckpt_dir else None
    if ckpts is not None and ckpts.foreign():
        raise ValueError(f"--ckpt-dir {ckpts.directory} holds step-numbered folders that are not checkpoints of this "
                         f"zoo: {', '.join(ckpts.foreign())} (checkpoint rotation and --resume would take them for "
                         f"checkpoints); move them away or choose another --ckpt-dir")
    source, held = data_lib.sources(job.data, job.model_cfg.vocab_size, cadence.batch, cadence.seq, console)
    if ckpts is not None and ckpts.steps() and not storage.resume:
        raise ValueError(f"{ckpts.directory} already holds checkpoints (latest step {ckpts.latest_step()}): "
                         f"pass --resume to continue that run, or choose another --ckpt-dir")
    data_id = source.identity()
    check = lambda record: check_resumable(record, job, ckpts.directory, data_id)  # noqa: E731
    say = lambda message: console.print(message, soft_wrap=True, markup=False)  # noqa: E731  (whole lines in logs)
    resume_step, resume_record = ckpts.newest_intact(check, say=say) if storage.resume else (None, None)
    return Inputs(ckpts, source, held, data_id, check, say, resume_step, resume_record, resuming=storage.resume,
                  finished=resume_step is not None and resume_step >= cadence.steps)


@dataclasses.dataclass
class Session:
    """What a run holds while it runs: resources closed when it ends (the lock, the metrics file, TensorBoard), the
    signal handlers, and the record of a previous run in the same --ckpt-dir that was killed (its stale lock)."""
    stack: contextlib.ExitStack
    interrupts: Interrupts
    previous: dict | None = None
    metrics_file: guard.MetricsFile | None = None
    board: watch.Board | None = None

    def open(self, job: Job, console: Console) -> Inputs:
        """Take --ckpt-dir, open what the run reads (`open_inputs`) and, unless the run is already at --steps
        (`nothing_to_do` says so), what it writes (`open_outputs`)."""
        self.take_ckpt_dir(job, console)
        inputs = open_inputs(job, console)
        if inputs.finished:
            nothing_to_do(job.cadence, console, inputs)
        else:
            self.open_outputs(job, inputs)
        return inputs

    def take_ckpt_dir(self, job: Job, console: Console) -> None:
        """With --ckpt-dir: check it and take its lock (multi-host: one lock for the run, held by process 0; its
        refusal stops every process). The lock file also names the run and its metrics file: a run killed before
        its first checkpoint is recognised by the same command with --resume (its metrics file is its own)."""
        storage = job.storage
        if not storage.ckpt_dir:
            return
        directory = guard.check_ckpt_dir(storage.ckpt_dir)
        info = {"run": job.identity, "metrics": os.path.abspath(storage.metrics) if storage.metrics else None}
        lock = agree.decided_by_0("the lock of --ckpt-dir",
                                  lambda: self.stack.enter_context(DirLock(directory, info=info)),
                                  storage.coordinator_timeout)
        if lock is not None and lock.taken_over:
            console.print(f"took over the stale lock of a run that ended without releasing it "
                          f"(pid {lock.taken_over.get('pid')}, started {lock.taken_over.get('started')})",
                          soft_wrap=True)
            self.previous = lock.taken_over

    def open_outputs(self, job: Job, inputs: Inputs) -> None:
        """The metrics file (checked: another run's is refused) and TensorBoard, written by process 0."""
        storage = job.storage
        if jax.process_index() != 0:
            return
        if storage.metrics:
            owner = self.metrics_owner(job, inputs.resume_record)
            self.metrics_file = self.stack.enter_context(guard.check_metrics(storage.metrics, owner=owner))
        if storage.tensorboard:
            self.board = self.stack.enter_context(contextlib.closing(watch.Board(
                storage.tensorboard, run=job.identity, resume=storage.resume)))

    def metrics_owner(self, job: Job, resume_record: dict | None) -> str | None:
        """The metrics path the run being continued wrote: its checkpoint's, or, for a run killed before its first
        checkpoint, its stale lock's (same run identity, --resume given); where it is now if the run's folder
        moved (`same`)."""
        storage = job.storage
        if resume_record is not None:
            said = resume_record
        elif storage.resume and self.previous and self.previous.get("run") == job.identity:
            said = self.previous
        else:
            return None
        if storage.metrics and same(said.get("metrics"), storage.metrics, said.get("directory"), storage.ckpt_dir):
            return os.path.abspath(storage.metrics)
        return said.get("metrics")


def nothing_to_do(cadence: Cadence, console: Console, inputs: Inputs) -> None:
    """--resume of a run already at --steps: say how to train on, and close the checkpoints (nothing is built)."""
    step = inputs.resume_step
    console.print(f"nothing left to do: the checkpoint in {inputs.ckpts.directory} is at step {step} and "
                  f"--steps is {cadence.steps}. To train on, raise --steps" +
                  (f" and add --schedule-steps {cadence.schedule_steps} (the schedule stays as it was; the steps "
                   f"past it run at its final learning rate, lr/10)" if step >= cadence.schedule_steps
                   else ""), soft_wrap=True)
    inputs.ckpts.close()


def restore(console: Console, inputs: Inputs, model, optimizer) -> int:
    """The step to start after: the newest intact checkpoint's, restored into `model` and `optimizer`; else 0."""
    ckpts = inputs.ckpts
    if ckpts is not None and inputs.resume_step is not None:
        # Restoring reads every array: a truncated one shows here, and the walk goes on to an older step.
        start, _ = ckpts.newest_intact(inputs.check, model, optimizer, say=inputs.say)
        console.print(f"resumed from {ckpts.directory} at step {start}")
        return start
    if inputs.resuming:
        console.print(f"--resume: no checkpoint in {ckpts.directory} yet; starting from step 0")
    return 0
