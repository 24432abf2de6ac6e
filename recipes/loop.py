"""The training loop of `python -m recipes.train`: a plain `train_step` you can copy, and `run` around it.

`train_step(model, optimizer, batch)` is an ordinary function of NNX objects: next-token loss (plus the model's
auxiliary loss), gradients, the optimizer update, the model's non-gradient updates (e.g. DeepSeek-V3's routing
bias), and the NaN guard: a step whose loss, gradient norm or updated parameters are not finite leaves every
state as it was. The whole step runs under one `jax.jit` (`compile_step`: split into graph and state, merge
inside, donate the state).

`run(config)` builds the model with its recipe, prints the recipe and its memory plan, restores a checkpoint
(`--resume`), trains, logs, checkpoints every K steps and at the end, and stops on a non-finite step keeping the
last good checkpoint. Everything is a pure function of (seed, step), so a resumed run equals an uninterrupted one.
Before it builds anything, `run` checks what could make a run fail late or destroy something (`recipes.guard`),
takes the checkpoint directory and the metrics file for itself (`recipes.lock`, `recipes.guard.MetricsFile`), and
catches SIGINT/SIGTERM: a signal while training ends the run after its step, with a checkpoint (`recipes.interrupt`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from rich.console import Console

import zoo
import zoo.sharding
from recipes import auto, cli, fit, guard, meter, watch
from recipes import data as data_lib
from recipes import mesh as mesh_lib
from recipes import registry as recipe_registry
from recipes.checkpoint import Checkpoints
from recipes.config import RunConfig
from recipes.interrupt import Interrupts
from recipes.lock import DirLock
from zoo import compile_options
from zoo.models.registry import Family
from zoo.plan.peak import allocator_limit
from zoo.train_step import (
    all_finite,
    compile_abstract,
    lr_schedule,
    make_optimizer,
    moe_drops,
    next_token_loss,
    opt_state_shardings,
    train_step,
)
from zoo.train_step import jit_step as compile_step

# The step itself is zoo.train_step's (the planner compiles the same one); its names are re-exported here.
__all__ = ["all_finite", "compile_step", "lr_schedule", "make_optimizer", "moe_drops", "next_token_loss", "run",
           "train_step", "RunConfig"]


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



@dataclasses.dataclass
class Result:
    steps: list[int]
    losses: list[float]
    stopped: str | None          # None: ran to the end; "nonfinite"; "stop_after"; "nothing_to_do" (resumed a
                                 # run already at --steps: nothing was built); "interrupted" (SIGINT/SIGTERM)
    last_checkpoint: int | None
    model: nnx.Module | None = None  # the trained model (its last good state)
    exit_code: int = 0           # what the command exits with: 1 after a non-finite step, 128 + signal if interrupted


def _sources(cfg: RunConfig, vocab: int, console: Console) -> tuple[data_lib.Source, Any]:
    """(training source, held-out source or None: without --eval-every)."""
    if cfg.data:
        src, held = data_lib.open_data(cfg.data, tokenizer=cfg.tokenizer, vocab=vocab, batch=cfg.batch, seq=cfg.seq,
                                       seed=cfg.seed, dtype=cfg.data_dtype, heldout=cfg.held_out,
                                       say=lambda m: console.print(m, soft_wrap=True, markup=False),
                                       progress=watch.bytes_bar(console) if console.is_terminal else None)
    else:
        src = held = data_lib.Synthetic(vocab=vocab, batch=cfg.batch, seq=cfg.seq, seed=cfg.seed)
    src = data_lib.Poisoned(src, cfg.poison_step) if cfg.poison_step is not None else src
    return src, held if cfg.eval_every else None


def make_eval(graphdef, mesh) -> Callable:
    """(state, batch) -> the held-out batch's mean next-token loss: the model's forward pass alone, jitted (traced
    under the mesh's rules, as the step)."""
    @jax.jit
    def loss(state, batch):
        model, _ = nnx.merge(graphdef, state)
        logits = model(batch["tokens"][:, :-1])
        return next_token_loss(logits, batch["tokens"][:, 1:], batch["weights"])

    def run(state, batch):
        with zoo.sharding.use(mesh):
            return loss(state, batch)
    return run


def evaluate(eval_fn: Callable, state, held, n: int, mesh) -> dict[str, float]:
    """Held-out loss (the mean over `n` batches, at most the split once over) and its perplexity."""
    n = min(n, held.eval_batches()) if hasattr(held, "eval_batches") else n
    losses = [eval_fn(state, mesh_lib.put_batch(held.eval_batch(i), mesh)) for i in range(n)]
    value = float(np.mean([float(x) for x in losses]))
    return {"eval_loss": value, "eval_perplexity": math.exp(min(value, 700.0))}


def kernel_choices(model_cfg, device: jax.Device, overrides=()) -> dict[str, str]:
    """What runs on `device` for this config: the attention kernel and, for a mixture of experts, the grouped
    matmul (a backend not "auto" is said to be the preset's unless `overrides` set it). Raises ValueError for an
    explicit choice that cannot run there (before anything is built)."""
    from zoo.layers.attention import resolve_impl

    out = {"attention": str(resolve_impl(model_cfg, device))}
    for kernel, choice in model_cfg.kernel_choices(device).items():
        if "(asked for" in choice:   # an explicit choice: the user's --set or the preset's
            field = kernel.replace(" ", "_")   # a kernel is chosen by the config field of its name
            who = f"--set {field}" if field in dict(overrides) else f"the preset's {field}"
            choice = choice.replace("(asked for", f"({who}", 1)
        out[kernel] = choice
    return out


def build_sharded(family: Family, model_cfg, recipe: zoo.Recipe, mesh, make_opt: Callable, *, seed: int,
                  opt_state: str = "device"):
    """(model, optimizer) created on `mesh` by the rules (`zoo.sharding.init`: an abstract init, then one jitted
    init onto the shardings; no device holds a full copy of a sharded variable), the optimizer's moments where
    `opt_state` says (`zoo.train_step.opt_state_shardings`). Values are the unsharded build's."""
    def make():
        model = family.build(model_cfg, recipe=recipe, rngs=nnx.Rngs(seed))
        return model, make_opt(model)
    return zoo.sharding.init(make, mesh, place=lambda state, out: opt_state_shardings(state, out, opt_state))


def show_memory_plan(console: Console, model_cfg, recipe: zoo.Recipe, *, batch: int, seq: int,
                     device: jax.Device, compiled=None, hbm_limit: float | None = None,
                     opt_dtype: str = "float32", mesh=None, grad_accum: int = 1,
                     opt_state: str = "device") -> zoo.plan.Plan:
    """Print the recipe's memory plan (`zoo.plan`, with the device's HBM as its budget and, given the compiled
    step, its peak with XLA's temporaries; per device under a mesh of several devices) and return it."""
    limit = allocator_limit(device)
    kwargs = {"hbm_gib": hbm_limit} if hbm_limit else {"hbm_gib": limit / 2 ** 30} if limit else {}
    if mesh is not None and mesh.devices.size > 1:
        kwargs["mesh"] = mesh
    p = zoo.plan(model_cfg, recipe, batch=batch, seq=seq, compiled=compiled, opt_dtype=opt_dtype,
                 peak=None if compiled is None else "compile", grad_accum=grad_accum, opt_state=opt_state, **kwargs)
    zoo.plan.render(p, console)
    return p


def compile_for_shapes(family: Family, model_cfg, recipe: zoo.Recipe, cfg: RunConfig, schedule, mesh):
    """(compiled step, graphdef, abstract state): the run's step compiled on shapes alone, laid out on `mesh`
    (`zoo.train_step.compile_abstract`, the planner's compile too)."""
    return compile_abstract(family, model_cfg, recipe, batch=cfg.batch, seq=cfg.seq, schedule=schedule,
                            clip=cfg.clip, weight_decay=cfg.weight_decay, opt_dtype=cfg.opt_dtype, seed=cfg.seed,
                            mesh=mesh, grad_accum=cfg.grad_accum, opt_state=cfg.opt_state)


def check_fits(console: Console, cfg: RunConfig, plan, recipe_name: str, device: jax.Device, compiled) -> None:
    """Refuse (ValueError: exit 2) a step whose compiled peak exceeds the device's budget, or whose host bytes
    exceed the pinned pool, before anything is allocated; --force launches it anyway (`recipes.fit`)."""
    # the offloaded activations (XLA's host temporaries) and the state kept in pinned host memory
    host = (meter.host_bytes(compiled) or 0) + plan.state.host if device.platform != "cpu" else plan.host_total
    problems, notes = fit.check(plan.peak, host=host or 0, pool=plan.host_pool, device=device,
                                hbm_limit_gib=cfg.hbm_limit)
    for n in notes:
        console.print(n, soft_wrap=True, markup=False)
    if not problems:
        return
    why = "; ".join(problems)
    tips = fit.advice(batch=cfg.batch, seq=cfg.seq, recipe=recipe_name, opt_dtype=cfg.opt_dtype,
                      optimizer_bytes=plan.state.optimizer, gpu=device.platform == "gpu", opt_state=cfg.opt_state,
                      grad_accum=cfg.grad_accum)
    if cfg.force:
        console.print(f"warning: {why}; launching anyway (--force)", soft_wrap=True, markup=False)
        return
    raise ValueError(f"{why}: it would run out of memory. The plan is above; {tips}")


def _check_resumable(record: dict, cfg: RunConfig, directory: str, data: dict | None = None) -> None:
    """ValueError unless the checkpoint's record is of this run: its identity, and the token file it read
    (`_check_data`)."""
    want = cfg.identity()
    have = dict(record.get("run", {}))
    if cfg.allow_data_change:   # the data's path may change too
        have["data"] = want["data"]
    _check_data(record.get("data"), data, cfg, directory)
    if "schedule_steps" not in have and "steps" in have:   # a record written before --schedule-steps existed
        have["schedule_steps"] = have.pop("steps")
        have["warmup"] = have["warmup"] if have.get("warmup") is not None else max(1, have["schedule_steps"] // 10)
    diff = {k: (have.get(k), v) for k, v in want.items() if have.get(k) != v}
    if diff:
        if set(diff) <= {"schedule_steps", "warmup"} and cfg.schedule_steps is None and cfg.warmup is None:
            planned = diff["schedule_steps"][0]
            raise ValueError(f"--resume --steps {cfg.steps}: the run in {directory} was planned for {planned} steps "
                             f"(its learning-rate schedule); to train on past step {planned} at the schedule's final "
                             f"learning rate (lr/10), add --schedule-steps {planned}")
        lines = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"--resume: the checkpoint in {directory} is of a different run ({lines})")


def _check_data(have: dict | None, now: dict | None, cfg: RunConfig, directory: str) -> None:
    """--resume on a token file other than the one the checkpoint's run read (path, dtype, size or fingerprint,
    `recipes.data.TokenFile.identity`) is refused unless --allow-data-change. Records written before the data was
    recorded have none: nothing to compare."""
    if have is None or now is None or cfg.allow_data_change:
        return
    diff = [f"{k}: checkpoint {have.get(k)!r}, now {v!r}" for k, v in now.items() if have.get(k) != v]
    if diff:
        raise ValueError(f"--resume: --data {cfg.data} is not the file the run in {directory} read "
                         f"({'; '.join(diff)}); pass --allow-data-change to resume on it anyway")


def _resolve(cfg: RunConfig):
    """(family, recipe name, recipe, model config, device, kernels), checked: bad names, config values and a config
    the device cannot run (e.g. cuDNN attention on a CPU) raise ValueError here, before anything touches the disk
    or compiles."""
    family = cli.family(cfg.model)
    recipe_name = cfg.recipe or recipe_registry.default_recipe(family)
    recipe = None if recipe_name == "auto" else cli.recipe(family, recipe_name)   # auto: chosen once shapes are known
    model_cfg = cli.model_config(family, cfg.preset, cfg.overrides)
    device = jax.local_devices()[0]   # this process's own (memory statistics of another's fail)
    kernels = kernel_choices(model_cfg, device, cfg.overrides)
    return family, recipe_name, recipe, model_cfg, device, kernels


def run(cfg: RunConfig, console: Console | None = None) -> Result:
    """Train as `cfg` says (see the module docstring). With --ckpt-dir, the directory is checked and taken for
    this run (`recipes.lock.DirLock`) before anything else, and given back at the end."""
    # Off a terminal (a log file, CI), print wide lines rather than wrapping at 80 columns.
    console = console or Console(highlight=False, width=None if os.isatty(1) else 160)
    model_cfg = _resolve(cfg)[3]
    mesh_lib.resolve(cfg.mesh, model_cfg, cfg.micro_batch)   # a mesh that does not fit: ValueError before the disk
    with contextlib.ExitStack() as stack:
        session = _Session(stack, stack.enter_context(Interrupts()))
        if cfg.ckpt_dir:
            directory = guard.check_ckpt_dir(cfg.ckpt_dir)
        if cfg.ckpt_dir and jax.process_index() == 0:   # multi-host: one lock for the run, held by process 0
            # The lock file also names the run and its metrics file: a run killed before its first checkpoint is
            # recognised by the same command with --resume (its metrics file is its own).
            lock = stack.enter_context(DirLock(directory, info={
                "run": cfg.identity(), "metrics": os.path.abspath(cfg.metrics) if cfg.metrics else None}))
            if lock.taken_over:
                console.print(f"took over the stale lock of a run that ended without releasing it "
                              f"(pid {lock.taken_over.get('pid')}, started {lock.taken_over.get('started')})",
                              soft_wrap=True)
                session.previous = lock.taken_over
        return _run(cfg, console, session)


@dataclasses.dataclass
class _Session:
    """What `run` holds for `_run`: resources closed when it returns (the lock, the metrics file), the signal
    handlers, and the record of a previous run in the same --ckpt-dir that was killed (its stale lock)."""
    stack: contextlib.ExitStack
    interrupts: Interrupts
    previous: dict | None = None

    def metrics_owner(self, cfg: RunConfig, resume_record: dict | None) -> str | None:
        """The metrics path the run being continued wrote: its checkpoint's, or, for a run killed before its first
        checkpoint, its stale lock's (same run identity, --resume given)."""
        if resume_record is not None:
            return resume_record.get("metrics")
        if cfg.resume and self.previous and self.previous.get("run") == cfg.identity():
            return self.previous.get("metrics")
        return None


def _run(cfg: RunConfig, console: Console, session: _Session) -> Result:
    family, recipe_name, recipe, model_cfg, device, kernels = _resolve(cfg)
    # Refuse to overwrite a run, or to resume a different one, before spending time on the model.
    ckpts = Checkpoints(cfg.ckpt_dir) if cfg.ckpt_dir else None
    if ckpts is not None and ckpts.foreign():
        raise ValueError(f"--ckpt-dir {ckpts.directory} holds step-numbered folders that are not checkpoints of this "
                         f"zoo: {', '.join(ckpts.foreign())} (checkpoint rotation and --resume would take them for "
                         f"checkpoints); move them away or choose another --ckpt-dir")
    source, held = _sources(cfg, model_cfg.vocab_size, console)   # a token file is checked (and fingerprinted) now
    if ckpts is not None and ckpts.steps() and not cfg.resume:
        raise ValueError(f"{ckpts.directory} already holds checkpoints (latest step {ckpts.latest_step()}): "
                         f"pass --resume to continue that run, or choose another --ckpt-dir")
    data_id = source.identity()
    check = lambda record: _check_resumable(record, cfg, ckpts.directory, data_id)  # noqa: E731
    say = lambda message: console.print(message, soft_wrap=True, markup=False)  # noqa: E731  (whole lines in logs)
    resume_step, resume_record = ckpts.newest_intact(check, say=say) if cfg.resume else (None, None)
    resuming = resume_step is not None
    if resuming and resume_step >= cfg.steps:
        console.print(f"nothing left to do: the checkpoint in {ckpts.directory} is at step {resume_step} and "
                      f"--steps is {cfg.steps}. To train on, raise --steps" +
                      (f" and add --schedule-steps {cfg.total_schedule} (the schedule stays as it was; the steps "
                       f"past it run at its final learning rate, lr/10)" if resume_step >= cfg.total_schedule
                       else ""), soft_wrap=True)
        ckpts.close()
        return Result([], [], "nothing_to_do", resume_step)
    metrics_file = (session.stack.enter_context(guard.check_metrics(
        cfg.metrics, owner=session.metrics_owner(cfg, resume_record)))
        if cfg.metrics and jax.process_index() == 0 else None)   # multi-host: process 0 writes
    metrics_path = metrics_file.path if metrics_file else None

    mesh = mesh_lib.resolve(cfg.mesh, model_cfg, cfg.micro_batch)   # each micro-batch splits over the data axes
    schedule = lr_schedule(lr=cfg.peak_lr, steps=cfg.total_schedule, warmup=cfg.total_warmup)
    board = watch.Board(cfg.tensorboard) if cfg.tensorboard and jax.process_index() == 0 else None
    # Compile the step on shapes alone (nothing allocated), check that it fits, and only then build the model:
    # the executable compiled here is the one that runs.
    t0 = time.perf_counter()
    what = (f"compiling the training step ({cfg.model} {cfg.preset}, batch {cfg.batch} x seq {cfg.seq}, recipe "
            f"{recipe_name}) for {device.platform}")
    accum = (f" ({cfg.grad_accum} micro-batches of {cfg.micro_batch} per update)" if cfg.grad_accum > 1 else "")
    placed = "; optimizer state in pinned host memory between steps" if cfg.opt_state == "host" else ""
    with watch.busy(console, what):
        if recipe is None:   # --recipe auto: the planner's choice for this device, compiled and checked to fit
            ins = auto.inputs(device, hbm_gib=cfg.hbm_limit, link_gbps=cfg.link, overlap=cfg.overlap,
                              tflops=cfg.peak_tflops)
            recipe, (compiled, graphdef, abstract), notes = auto.fit(
                model_cfg, ins, lambda r: compile_for_shapes(family, model_cfg, r, cfg, schedule, mesh),
                batch=cfg.batch, seq=cfg.seq, opt_dtype=cfg.opt_dtype, grad_accum=cfg.grad_accum,
                opt_state=cfg.opt_state, mesh=mesh if mesh.devices.size > 1 else None)
        else:
            compiled, graphdef, abstract = compile_for_shapes(family, model_cfg, recipe, cfg, schedule, mesh)
    if recipe_name == "auto":
        for note in notes:
            console.print(note, soft_wrap=True, markup=False)
        console.print(f"recipe auto for {ins.describe()}: {auto.summary(recipe)}", soft_wrap=True, markup=False)
    compile_s = time.perf_counter() - t0
    n_params = zoo.models.count_params(nnx.merge(graphdef, abstract)[0])
    tokens_per_step = cfg.batch * cfg.seq
    peak, peak_src = meter.peak_tflops(device, cfg.peak_tflops)
    n_devices = mesh.devices.size   # recipes.mesh.resolve always gives a mesh (one device: all axes 1)

    console.print(f"model {cfg.model} {cfg.preset}: {n_params:,} parameters; batch {cfg.batch} x seq {cfg.seq}"
                  f"{accum}; {cfg.steps} steps on {device.platform} ({device.device_kind}){placed}")
    console.print(f"mesh {mesh_lib.describe(mesh)} over {jax.device_count()} device(s), {jax.process_count()} "
                  f"process(es)")
    console.print(f"recipe {recipe}")
    console.print(f"XLA options of the step: {compile_options.for_step(recipe, device.platform).describe()}",
                  soft_wrap=True, markup=False)
    for what, choice in kernels.items():
        console.print(f"{what}: {choice}", soft_wrap=True)
    plan = show_memory_plan(console, model_cfg, recipe, batch=cfg.batch, seq=cfg.seq, device=device,
                            compiled=compiled, hbm_limit=cfg.hbm_limit, opt_dtype=cfg.opt_dtype, mesh=mesh,
                            grad_accum=cfg.grad_accum, opt_state=cfg.opt_state)
    if device.platform == "cpu" and recipe.offload:
        console.print("on the CPU there is no pinned host memory: offload placements compile and run but move "
                      "nothing (use a GPU to see HBM fall)")
    check_fits(console, cfg, plan, recipe_name, device, compiled)
    console.print(f"MFU against {peak} TFLOP/s ({peak_src})" if peak else f"MFU: {peak_src}")

    model, optimizer = build_sharded(family, model_cfg, recipe, mesh, seed=cfg.seed, make_opt=lambda m: make_optimizer(
        m, schedule, clip=cfg.clip, weight_decay=cfg.weight_decay, opt_dtype=cfg.opt_dtype),
        opt_state=cfg.opt_state)
    flops_per_step = family.flops_per_token(model_cfg, model, cfg.seq) * tokens_per_step

    record = {"run": cfg.identity(), "recipe": recipe_name, "metrics": metrics_path, "data": data_id,
              "mesh": mesh_lib.describe(mesh)}   # recorded, not checked: a run may resume on another mesh
    start = 0
    if ckpts is not None and resuming:
        # Restoring reads every array: a truncated one shows here, and the walk goes on to an older step.
        start, _ = ckpts.newest_intact(check, model, optimizer, say=say)
        console.print(f"resumed from {ckpts.directory} at step {start}")
    elif cfg.resume:
        console.print(f"--resume: no checkpoint in {ckpts.directory} yet; starting from step 0")
    last_ckpt = start if start else None

    _, state = nnx.split((model, optimizer))
    host = meter.host_bytes(compiled) if device.platform != "cpu" else None
    console.print(f"compiled the step in {compile_s:.1f} s"
                  + (f"; host memory for offloaded values: {meter.fmt_bytes(host)}" if host is not None else ""))

    def save(step: int) -> None:
        nonlocal last_ckpt
        nnx.update((model, optimizer), state)
        ckpts.save(step, model, optimizer, record)
        ckpts.wait()
        last_ckpt = step

    if metrics_file:
        metrics_file.start_at(start)
    eval_fn = make_eval(graphdef, mesh) if held is not None else None
    result = Result([], [], None, last_ckpt)
    progress = _Progress(console, cfg.steps, start)
    drops = DropWatch(console, cfg.max_drop_warn)
    t_last, n_since = time.perf_counter(), 0
    session.interrupts.training = True   # from here a signal ends the run after its step, with a checkpoint
    try:
        batch = mesh_lib.put_batch(source.batch(start + 1), mesh) if start < cfg.steps else None
        for step in range(start + 1, cfg.steps + 1):
            state, m = compiled(state, batch)   # dispatched: the device runs the step while the host goes on
            if step < cfg.steps:                 # the next batch is made and sent meanwhile, not while the device idles
                batch = mesh_lib.put_batch(source.batch(step + 1), mesh)
            m = jax.device_get(m)
            if not m["ok"]:
                # The step left `state` as it was (unless `kept` says an update that passed the guard still made a
                # parameter non-finite): then it is the last good state, after step - 1.
                kept = bool(m.get("kept", True))
                if kept and ckpts is not None and step - 1 > 0 and last_ckpt != step - 1:
                    save(step - 1)
                where = (f"The last good checkpoint is step {last_ckpt} in {ckpts.directory}" if last_ckpt
                         else "No checkpoint was written (no --ckpt-dir, or no good step yet)")
                progress.stop()
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
                console.print(f"[bold red]step {step}: {cause}; {what} and the run stops. {where}.[/]",
                              soft_wrap=True)
                result.stopped = "nonfinite"
                break
            loss = float(m["loss"])
            drops.check(step, m)
            result.steps.append(step)
            result.losses.append(loss)
            n_since += 1
            evaluating = cfg.eval_every and step % cfg.eval_every == 0
            if step % cfg.log_every == 0 or step == cfg.steps or step == start + 1 or evaluating:
                jax.block_until_ready(state)
                now = time.perf_counter()
                dt, t_last, n = now - t_last, now, n_since
                n_since = 0
                tok_s = tokens_per_step * n / dt
                tflops = flops_per_step * n / dt / 1e12 / n_devices   # per device, as the peak it is held to
                row = {"step": step, "loss": loss, "aux_loss": float(m["total_loss"]) - loss,
                       "grad_norm": float(m["grad_norm"]),
                       "lr": float(schedule(step - 1)), "tokens_per_s": tok_s, "model_tflops": tflops,
                       "mfu": tflops / peak if peak else None, "peak_hbm_bytes": meter.peak_hbm_bytes(device),
                       "host_bytes": host, "dropped": int(m["dropped"]), "drop_fraction": drops.fraction(m),
                       "planned_peak_bytes": plan.peak_bytes, "planned_peak_source": plan.peak_source}
                if eval_fn is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
                    row.update(evaluate(eval_fn, state, held, cfg.eval_batches, mesh))
                    t_last = time.perf_counter()   # evaluation time is not step time
                progress.log(row)
                if metrics_file:
                    metrics_file.write(row)
                if board:
                    board.write(row)
            progress.advance(step, loss)
            if ckpts is not None and cfg.ckpt_every and step % cfg.ckpt_every == 0:
                save(step)
                t_last, n_since = time.perf_counter(), 0   # checkpoint time is not step time
            if step < cfg.steps and session.interrupts.requested():   # at the last step: finish as usual
                _interrupted(console, session.interrupts, step, save if ckpts is not None else None, last_ckpt)
                result.stopped, result.exit_code = "interrupted", session.interrupts.exit_code
                break
            if cfg.stop_after is not None and step == cfg.stop_after and step < cfg.steps:
                result.stopped = "stop_after"
                console.print(f"--stop-after {step}: stopping as if preempted (last checkpoint: {last_ckpt})")
                break
        else:
            if ckpts is not None and last_ckpt != cfg.steps:
                save(cfg.steps)
    finally:
        progress.stop()
        drops.summary()
        if metrics_file:
            metrics_file.close()
        if board:
            board.close()
        if ckpts is not None:
            try:
                ckpts.close()
            except Exception as e:  # never hide the error that got us here, never hang on the way out
                console.print(f"closing the checkpoint manager failed: {e}")
    nnx.update((model, optimizer), state)
    result.last_checkpoint, result.model = last_ckpt, model
    if result.losses:
        console.print(f"loss {result.losses[0]:.4f} (step {result.steps[0]}) -> {result.losses[-1]:.4f} "
                      f"(step {result.steps[-1]})" + (f"; checkpoint: step {last_ckpt}" if last_ckpt else ""))
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


class _Progress:
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
        line = (f"step {row['step']:>6}  loss {row['loss']:.4f}  grad {row['grad_norm']:.3f}  "
                f"tok/s {row['tokens_per_s']:,.0f}  TFLOP/s {row['model_tflops']:.3g}  MFU {mfu}")
        if row["peak_hbm_bytes"] is not None:   # backends that keep memory statistics (GPU, TPU)
            line += f"  HBM peak {meter.fmt_bytes(row['peak_hbm_bytes'])}"
        if row["host_bytes"] is not None:
            line += f"  host {meter.fmt_bytes(row['host_bytes'])}"
        now = time.perf_counter()
        if self.first is None:
            self.first = (now, row["step"])
        elif row["step"] < self.total:
            line += "  " + watch.eta(row["step"] - self.first[1], self.total - self.first[1], now - self.first[0])
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
