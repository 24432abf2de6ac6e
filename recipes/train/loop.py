"""`python -m recipes.train`'s run, as one flow: `run(settings)` resolves the settings once into a
`recipes.train.settings.job.Job` and passes it down its phases, each one call into its room and back:

1. resolve (`recipes.train.settings.job.resolve`): names, model config, recipe, device and its memory budget, kernels,
   mesh, learning rate and warm-up, checked;
2. open what the run reads and writes (`recipes.train.checkpoints.resume.Session.open`): --ckpt-dir checked and
   locked (`recipes.train.processes.lock`), SIGINT/SIGTERM caught (`recipes.train.processes.interrupt`), the
   checkpoints, the data, the step to resume from, the metrics file and TensorBoard;
3. build the learning-rate schedule, compile the step on shapes, show its plan and refuse one that does not fit, build
   the model sharded, and find what each step is measured against and the held-out loss
   (`recipes.train.step.prepare.prepare`);
4. restore it (`recipes.train.checkpoints.resume.restore`);
5. train (`_Loop`): log, evaluate, checkpoint every K steps and at the end, stop on a non-finite step keeping the
   last good checkpoint, or after the step a signal arrived in, with a checkpoint.

The step is `zoo.train_step.train_step` (the planner compiles the same one). Everything is a pure function of
(seed, step), so a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from rich.console import Console

from recipes.train.checkpoints import resume
from recipes.train.processes import mesh as mesh_lib
from recipes.train.processes.interrupt import Interrupts
from recipes.train.settings import cli
from recipes.train.settings.config import RunConfig
from recipes.train.settings.job import Job, resolve
from recipes.train.step import prepare
from recipes.train.watching import meter, watch
from zoo import renames

__all__ = ["Result", "RunConfig", "run"]
# names handed on to the room of their phase, for one release (docs/changes.md)
renames.ATTRIBUTES[__name__] = {"make_eval": "recipes.train.step.prepare.make_eval"}
__getattr__ = renames.attributes(__name__)


@dataclasses.dataclass
class Result:
    steps: list[int]
    losses: list[float]
    stopped: str | None          # None: ran to the end; "nonfinite"; "stop_after"; "nothing_to_do" (resumed a
                                 # run already at --steps: nothing was built); "interrupted" (SIGINT/SIGTERM)
    last_checkpoint: int | None
    model: nnx.Module | None = None  # the trained model (its last good state)
    exit_code: int = 0           # what the command exits with: 1 after a non-finite step, 128 + signal if interrupted


def evaluate(eval_fn: Callable, state, held, n: int, mesh) -> dict[str, float]:
    """Held-out loss (the mean over `n` batches, at most the split once over) and its perplexity."""
    n = min(n, held.eval_batches()) if hasattr(held, "eval_batches") else n
    losses = [eval_fn(state, mesh_lib.put_batch(held.eval_batch(i), mesh)) for i in range(n)]
    value = float(np.mean([float(x) for x in losses]))
    return {"eval_loss": value, "eval_perplexity": math.exp(min(value, 700.0))}


def run(settings: RunConfig, console: Console | None = None) -> Result:
    """Train as `settings` say, in phases, each one call into its room (see the module docstring). With --ckpt-dir,
    the directory is checked and taken for this run (`recipes.train.processes.lock.DirLock`) before anything else is
    opened, and given back at the end."""
    # Off a terminal (a log file, CI), print wide lines rather than wrapping at 80 columns.
    console = console or cli.console()
    job = resolve(settings)   # bad names, values or mesh: ValueError before anything touches the disk
    with contextlib.ExitStack() as stack:
        session = resume.Session(stack, stack.enter_context(Interrupts()))
        inputs = session.open(job, console)
        if inputs.finished:   # --resume of a run already at --steps: said, nothing built
            return Result([], [], "nothing_to_do", inputs.resume_step)
        # Compile the step on shapes alone (nothing allocated), check that it fits, and only then build the model:
        # the executable compiled here is the one that runs.
        built = prepare.prepare(job, console)
        start = resume.restore(console, inputs, built.model, built.optimizer)
        return _Loop(job, console, session, built, inputs, start).run()


class _Loop:
    """The training loop over the compiled step: the state it carries, the checkpoints it saves, what it logs and
    how it stops (at --steps, on a non-finite step, on a signal, at --stop-after)."""

    def __init__(self, job: Job, console: Console, session: resume.Session, built: prepare.Built,
                 inputs: resume.Inputs, start: int):
        cadence, device = job.cadence, job.device
        step, plan, model, optimizer = built.step, built.plan, built.model, built.optimizer
        self.cadence, self.console, self.session, self.step, self.mesh, self.schedule = (
            cadence, console, session, step, job.mesh, built.schedule)
        self.inputs, self.ckpts, self.model, self.optimizer = inputs, inputs.ckpts, model, optimizer
        self.start, self.metrics_file, self.board, self.device, self.plan = (
            start, session.metrics_file, session.board, device, plan)
        # the mesh is recorded, not checked: a run may resume on another mesh
        self.record = {"run": job.identity, "recipe": job.recipe_name,
                       "metrics": self.metrics_file.path if self.metrics_file else None, "data": inputs.data_id,
                       "mesh": mesh_lib.describe(job.mesh)}
        self.host, self.flops_per_step, self.peak = built.host, built.flops_per_step, built.peak_tflops
        predicted = plan.step_time()
        self.planned_step_s = None if predicted is None else predicted["total_s"]
        self.last_ckpt = start if start else None
        _, self.state = nnx.split((model, optimizer))
        self.eval_fn = built.eval_fn if inputs.held is not None else None
        self.progress = watch.Progress(console, cadence.steps, start)
        self.drops = watch.DropWatch(console, cadence.max_drop_warn)
        self.trace = watch.StepTrace(cadence.profile, min(start + 2, cadence.steps), console)
        self.t_last, self.n_since = time.perf_counter(), 0

    def save(self, step: int) -> None:
        nnx.update((self.model, self.optimizer), self.state)
        self.ckpts.save(step, self.model, self.optimizer, self.record,
                        say=lambda m: self.console.print(m, soft_wrap=True, markup=False))
        self.ckpts.wait()
        self.last_ckpt = step

    def run(self) -> Result:
        cadence, session, mesh, source = self.cadence, self.session, self.mesh, self.inputs.source
        if self.metrics_file:
            self.metrics_file.start_at(self.start)
        if self.board:
            self.board.start_at(self.start)
        result = Result([], [], None, self.last_ckpt)
        session.interrupts.training = True   # from here a signal ends the run after its step, with a checkpoint
        try:
            batch = mesh_lib.put_batch(source.batch(self.start + 1), mesh) if self.start < cadence.steps else None
            for step in range(self.start + 1, cadence.steps + 1):
                self.trace.begin(step)
                self.state, m = self.step.compiled(self.state, batch)   # dispatched: the device runs the step
                if step < cadence.steps:   # while the host makes and sends the next batch, not while the device idles
                    batch = mesh_lib.put_batch(source.batch(step + 1), mesh)
                m = jax.device_get(m)
                self.trace.end(step)
                if not m["ok"]:
                    self._stop_nonfinite(step, m)
                    result.stopped = "nonfinite"
                    break
                self._record(step, m, result)
                if step < cadence.steps and session.interrupts.requested():   # at the last step: finish as usual
                    _interrupted(self.console, session.interrupts, step,
                                 self.save if self.ckpts is not None else None, self.last_ckpt)
                    result.stopped, result.exit_code = "interrupted", session.interrupts.exit_code
                    break
                if cadence.stop_after is not None and step == cadence.stop_after and step < cadence.steps:
                    result.stopped = "stop_after"
                    self.console.print(f"--stop-after {step}: stopping as if preempted (last checkpoint: "
                                       f"{self.last_ckpt})")
                    break
            else:
                if self.ckpts is not None and self.last_ckpt != cadence.steps:
                    self.save(cadence.steps)
        finally:
            self._close()
        return self._finish(result)

    def _record(self, step: int, m: dict, result: Result) -> None:
        """A good step: count it, log it (every --log-every, the first, the last, at evaluations), checkpoint it
        (every --ckpt-every)."""
        cadence = self.cadence
        loss = float(m["loss"])
        self.drops.check(step, m)
        result.steps.append(step)
        result.losses.append(loss)
        self.n_since += 1
        evaluating = cadence.eval_every and step % cadence.eval_every == 0
        if step % cadence.log_every == 0 or step == cadence.steps or step == self.start + 1 or evaluating:
            self._log(step, m, loss)
        self.progress.advance(step, loss)
        if self.ckpts is not None and cadence.ckpt_every and step % cadence.ckpt_every == 0:
            self.save(step)
            self.t_last, self.n_since = time.perf_counter(), 0   # checkpoint time is not step time

    def _log(self, step: int, m: dict, loss: float) -> None:
        """One row of figures since the last: printed, written to --metrics and TensorBoard; held-out loss on
        evaluation steps."""
        cadence = self.cadence
        jax.block_until_ready(self.state)
        now = time.perf_counter()
        dt, self.t_last, n = now - self.t_last, now, self.n_since
        self.n_since = 0
        tflops = self.flops_per_step * n / dt / 1e12 / self.mesh.devices.size   # per device, as its peak
        row = {"step": step, "loss": loss, "aux_loss": float(m["aux_loss"]), "grad_norm": float(m["grad_norm"]),
               "lr": float(self.schedule(step - 1)), "tokens_per_s": cadence.batch * cadence.seq * n / dt,
               "model_tflops": tflops, "mfu": tflops / self.peak if self.peak else None,
               "peak_hbm_bytes": meter.peak_hbm_bytes(self.device), "host_bytes": self.host,
               "dropped": int(m["dropped"]), "drop_fraction": self.drops.fraction(m),
               "planned_peak_bytes": self.plan.peak_bytes, "planned_peak_source": self.plan.peak_source,
               "planned_step_s": self.planned_step_s, "planned_host_bytes": self.plan.host_total,
               "recipe": str(self.step.recipe), "loss_chunk": self.step.loss_chunk}
        for name in self.model.extra_head_names:   # each extra head's loss, before its weight
            row[f"{name}_loss"] = float(m[f"{name}_loss"])
        if self.eval_fn is not None and (step % cadence.eval_every == 0 or step == cadence.steps):
            row.update(evaluate(self.eval_fn, self.state, self.inputs.held, cadence.eval_batches, self.mesh))
            self.t_last = time.perf_counter()   # evaluation time is not step time
        self.progress.log(row)
        if self.metrics_file:
            self.metrics_file.write(row)
        if self.board:
            self.board.write(row)

    def _stop_nonfinite(self, step: int, m: dict) -> None:
        """The step left the state as it was (unless `kept` says an update that passed the guard still made a
        parameter non-finite): then it is the last good state, after step - 1; save it and say why the run stops."""
        kept = bool(m.get("kept", True))
        if kept and self.ckpts is not None and step - 1 > 0 and self.last_ckpt != step - 1:
            self.save(step - 1)
        where = (f"The last good checkpoint is step {self.last_ckpt} in {self.ckpts.directory}" if self.last_ckpt
                 else "No checkpoint was written (no --ckpt-dir, or no good step yet)")
        self.progress.stop()
        if not (math.isfinite(m["total_loss"]) and math.isfinite(m["grad_norm"])):
            cause = f"the loss ({m['total_loss']}) or the gradient norm ({m['grad_norm']}) is not finite"
        elif "lr" in m and not math.isfinite(m["lr"]):
            cause = (f"the learning rate ({m['lr']}) is not finite (the loss {m['total_loss']:.4f} and the "
                     f"gradient norm {m['grad_norm']:.4f} are: check --lr and the schedule)")
        else:
            cause = (f"the update made parameters non-finite (the loss {m['total_loss']:.4f} and the "
                     f"gradient norm {m['grad_norm']:.4f} are finite: check --lr)")
        what = ("the update was not applied" if kept else
                "the update was applied (an overflow the guard cannot foresee) and is not saved")
        self.console.print(f"[bold red]step {step}: {cause}; {what} and the run stops. {where}.[/]", soft_wrap=True)

    def _close(self) -> None:
        """Whatever happened: the progress bar, the drop summary, the trace, the metrics file, TensorBoard, the
        checkpoints."""
        self.progress.stop()
        self.trace.close()
        self.drops.summary()
        if self.metrics_file:
            self.metrics_file.close()
        if self.ckpts is not None:
            try:
                self.ckpts.close()
            except Exception as e:  # never hide the error that got us here, never hang on the way out
                self.console.print(f"closing the checkpoint manager failed: {e}")

    def _finish(self, result: Result) -> Result:
        """The trained model (its last good state) into the result, and the loss from first to last step."""
        nnx.update((self.model, self.optimizer), self.state)
        result.last_checkpoint, result.model = self.last_ckpt, self.model
        if result.losses:
            self.console.print(f"loss {result.losses[0]:.4f} (step {result.steps[0]}) -> {result.losses[-1]:.4f} "
                               f"(step {result.steps[-1]})"
                               + (f"; checkpoint: step {self.last_ckpt}" if self.last_ckpt else ""))
        return result


def _interrupted(console: Console, interrupts: Interrupts, step: int, save: Callable | None,
                 last_ckpt: int | None) -> None:
    """SIGINT/SIGTERM while training: the step has finished; save it (with --ckpt-dir) and say so in one line."""
    if save is not None and last_ckpt != step:
        save(step)
    what = ("checkpoint step {step} is saved: the same command with --resume continues" if save is not None else
            "no --ckpt-dir, nothing saved").format(step=step)
    console.print(f"{interrupts.name}: stopped after step {step}; {what} (exit {interrupts.exit_code})",
                  soft_wrap=True, markup=False)
