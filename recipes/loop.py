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
and takes the checkpoint directory for itself (`recipes.lock`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from rich.console import Console

import zoo
import zoo.sharding
from recipes import auto, cli, defaults, fit, guard, meter
from recipes import data as data_lib
from recipes import mesh as mesh_lib
from recipes.checkpoint import Checkpoints
from recipes.lock import DirLock
from zoo.models.registry import Family
from zoo.plan.peak import allocator_limit
from zoo.train_step import (
    all_finite,
    compile_abstract,
    lr_schedule,
    make_optimizer,
    moe_drops,
    next_token_loss,
    train_step,
)
from zoo.train_step import jit_step as compile_step

# The step itself is zoo.train_step's (the planner compiles the same one); its names are re-exported here.
__all__ = ["all_finite", "compile_step", "lr_schedule", "make_optimizer", "moe_drops", "next_token_loss", "run",
           "train_step", "RunConfig"]


class DropWatch:
    """Capacity dispatch drops token copies over an expert's capacity: warn when a step drops more than
    `threshold` of its routed copies (at the first such step, then at most once per `every` steps)."""

    def __init__(self, console: Console, threshold: float, every: int):
        self.console, self.threshold, self.every, self.last = console, threshold, every, None

    def fraction(self, m: dict) -> float | None:
        routed = int(m.get("routed", 0))
        return int(m["dropped"]) / routed if routed else None

    def check(self, step: int, m: dict) -> None:
        frac = self.fraction(m)
        if frac is None or frac <= self.threshold or (self.last is not None and step - self.last < self.every):
            return
        self.last = step
        self.console.print(f"[bold yellow]step {step}: capacity dispatch dropped {int(m['dropped']):,} of "
                           f"{int(m['routed']):,} token copies ({100 * frac:.2f}% > --max-drop-warn "
                           f"{100 * self.threshold:g}%): raise capacity_factor (--set capacity_factor=...) or use "
                           f"a dropless moe_backend (tokamax, ragged_dot)[/]", soft_wrap=True)



# -- the run ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: str = "llama3"
    preset: str = "tiny"
    recipe: str | None = None          # None: the model's study recipe
    overrides: tuple[tuple[str, Any], ...] = ()  # config fields to replace, e.g. (("num_layers", 3),)
    steps: int = 60                    # train up to this step
    schedule_steps: int | None = None  # the learning-rate schedule's length; None: steps. Past it: lr/10
    batch: int = 8
    seq: int = 64
    lr: float | None = None            # None: the preset's (recipes.defaults: 3e-3 tiny, published rates full-size)
    warmup: int | None = None          # None: schedule_steps // 10 (at least 1), capped at the preset's published
    opt_dtype: str = "float32"         # AdamW moments' dtype
    hbm_limit: float | None = None     # GiB: the device budget to check the compiled peak against (default: the
                                       # device's bytes_limit; on the CPU, the machine's RAM)
    force: bool = False                # launch even if the compiled peak does not fit
    clip: float = 1.0
    weight_decay: float = 0.1
    seed: int = 0
    mesh: str | None = None            # "fsdp=2,tp=1,ep=1"; None: every device on fsdp (not part of the identity)
    distributed: bool = False          # multi-host (recipes.mesh.maybe_initialize; the main job calls it)
    data: str | None = None            # a token file; None: the synthetic Markov source
    data_dtype: str | None = None      # uint16 / uint32; None: by vocabulary size
    metrics: str | None = None
    ckpt_dir: str | None = None
    ckpt_every: int = 0                # 0: only at the end
    resume: bool = False
    log_every: int = 10
    peak_tflops: float | None = None
    link: float | None = None          # --recipe auto: host link GB/s per direction (default: measured)
    overlap: float | None = None       # --recipe auto: share of transfer time hidden under compute
    max_drop_warn: float = 0.01        # warn when capacity dispatch drops more than this fraction of token copies
    stop_after: int | None = None      # debug: stop after this step without a final checkpoint (a preemption)
    poison_step: int | None = None     # debug: NaN loss weights at this step (a corrupted record)

    def __post_init__(self):
        for field in ("steps", "batch", "seq", "log_every"):
            if getattr(self, field) <= 0:
                raise ValueError(f"--{field.replace('_', '-')} must be positive, got {getattr(self, field)}")
        if self.schedule_steps is not None and self.schedule_steps <= 0:
            raise ValueError(f"--schedule-steps must be positive, got {self.schedule_steps}")
        for flag, value, lowest, strict in (("lr", self.peak_lr, 0, True), ("clip", self.clip, 0, True),
                                            ("weight-decay", self.weight_decay, 0, False)):
            if not (math.isfinite(value) and (value > lowest if strict else value >= lowest)):
                raise ValueError(f"--{flag} must be a finite number {'>' if strict else '>='} {lowest}, got {value}")
        if self.warmup is not None and not 0 <= self.warmup < self.total_schedule:
            raise ValueError(f"--warmup must be >= 0 and less than the schedule's {self.total_schedule} steps "
                             f"(--schedule-steps, default --steps), got {self.warmup}")
        if self.link is not None and not (math.isfinite(self.link) and self.link > 0):
            raise ValueError(f"--link must be a positive number of GB/s, got {self.link}")
        if self.overlap is not None and not 0 <= self.overlap <= 1:
            raise ValueError(f"--overlap must be in [0, 1], got {self.overlap}")
        if self.hbm_limit is not None and not (math.isfinite(self.hbm_limit) and self.hbm_limit > 0):
            raise ValueError(f"--hbm-limit must be a positive number of GiB, got {self.hbm_limit}")
        if self.opt_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--opt-dtype must be float32 or bfloat16, got {self.opt_dtype!r}")
        if not 0 <= self.max_drop_warn <= 1:
            raise ValueError(f"--max-drop-warn must be a fraction in [0, 1], got {self.max_drop_warn}")
        if self.ckpt_every < 0:
            raise ValueError(f"--ckpt-every must be >= 0, got {self.ckpt_every}")
        if self.resume and not self.ckpt_dir:
            raise ValueError("--resume needs --ckpt-dir")

    @property
    def total_schedule(self) -> int:
        return self.schedule_steps if self.schedule_steps is not None else self.steps

    @property
    def total_warmup(self) -> int:
        return self.warmup if self.warmup is not None else defaults.warmup(self.preset, self.total_schedule)

    @property
    def peak_lr(self) -> float:
        return self.lr if self.lr is not None else defaults.for_preset(self.preset).lr

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed: everything that changes the numbers (not --steps, where to
        stop: a resumed run may go on past its schedule at the final learning rate)."""
        keys = ("model", "preset", "overrides", "batch", "seq", "lr", "clip", "weight_decay", "seed", "data",
                "data_dtype")
        ident = {k: getattr(self, k) for k in keys}
        ident.update(schedule_steps=self.total_schedule, warmup=self.total_warmup, lr=self.peak_lr)
        if self.opt_dtype != "float32":   # records written before --opt-dtype match the float32 default
            ident["opt_dtype"] = self.opt_dtype
        return json.loads(json.dumps(ident))


@dataclasses.dataclass
class Result:
    steps: list[int]
    losses: list[float]
    stopped: str | None          # None: ran to the end; "nonfinite"; "stop_after"; "nothing_to_do" (resumed a
                                 # run already at --steps: nothing was built)
    last_checkpoint: int | None
    model: nnx.Module | None = None  # the trained model (its last good state)


def _source(cfg: RunConfig, vocab: int) -> data_lib.Source:
    if cfg.data:
        src = data_lib.TokenFile(cfg.data, vocab=vocab, batch=cfg.batch, seq=cfg.seq, seed=cfg.seed,
                                 dtype=cfg.data_dtype)
    else:
        src = data_lib.Synthetic(vocab=vocab, batch=cfg.batch, seq=cfg.seq, seed=cfg.seed)
    return data_lib.Poisoned(src, cfg.poison_step) if cfg.poison_step is not None else src


def kernel_choices(model_cfg, device: jax.Device) -> dict[str, str]:
    """What runs on `device` for this config: the attention kernel and, for a mixture of experts, the grouped
    matmul. Raises ValueError for an explicit choice that cannot run there (before anything is built)."""
    from zoo.layers.attention import resolve_impl

    return {"attention": str(resolve_impl(model_cfg, device)), **model_cfg.kernel_choices(device)}


def build_sharded(family: Family, model_cfg, recipe: zoo.Recipe, mesh, make_opt: Callable, *, seed: int):
    """(model, optimizer) created on `mesh` by the rules (`zoo.sharding.init`: an abstract init, then one jitted
    init onto the shardings; no device holds a full copy of a sharded variable). Values are the unsharded build's."""
    def make():
        model = family.build(model_cfg, recipe=recipe, rngs=nnx.Rngs(seed))
        return model, make_opt(model)
    return zoo.sharding.init(make, mesh)


def show_memory_plan(console: Console, model_cfg, recipe: zoo.Recipe, *, batch: int, seq: int,
                     device: jax.Device, compiled=None, hbm_limit: float | None = None,
                     opt_dtype: str = "float32", mesh=None) -> zoo.plan.Plan:
    """Print the recipe's memory plan (`zoo.plan`, with the device's HBM as its budget and, given the compiled
    step, its peak with XLA's temporaries; per device under a mesh of several devices) and return it."""
    limit = allocator_limit(device)
    kwargs = {"hbm_gib": hbm_limit} if hbm_limit else {"hbm_gib": limit / 2 ** 30} if limit else {}
    if mesh is not None and mesh.devices.size > 1:
        kwargs["mesh"] = mesh
    p = zoo.plan(model_cfg, recipe, batch=batch, seq=seq, compiled=compiled, opt_dtype=opt_dtype,
                 peak=None if compiled is None else "compile", **kwargs)
    zoo.plan.render(p, console)
    return p


def compile_for_shapes(family: Family, model_cfg, recipe: zoo.Recipe, cfg: RunConfig, schedule, mesh):
    """(compiled step, graphdef, abstract state): the run's step compiled on shapes alone, laid out on `mesh`
    (`zoo.train_step.compile_abstract`, the planner's compile too)."""
    return compile_abstract(family, model_cfg, recipe, batch=cfg.batch, seq=cfg.seq, schedule=schedule,
                            clip=cfg.clip, weight_decay=cfg.weight_decay, opt_dtype=cfg.opt_dtype, seed=cfg.seed,
                            mesh=mesh)


def check_fits(console: Console, cfg: RunConfig, plan, recipe_name: str, device: jax.Device, compiled) -> None:
    """Refuse (ValueError: exit 2) a step whose compiled peak exceeds the device's budget, or whose host bytes
    exceed the pinned pool, before anything is allocated; --force launches it anyway (`recipes.fit`)."""
    host = meter.host_bytes(compiled) if device.platform != "cpu" else plan.host_bytes
    problems, notes = fit.check(plan.peak, host=host or 0, pool=plan.host_pool, device=device,
                                hbm_limit_gib=cfg.hbm_limit)
    for n in notes:
        console.print(n, soft_wrap=True, markup=False)
    if not problems:
        return
    why = "; ".join(problems)
    tips = fit.advice(batch=cfg.batch, seq=cfg.seq, recipe=recipe_name, opt_dtype=cfg.opt_dtype,
                      optimizer_bytes=plan.state.optimizer)
    if cfg.force:
        console.print(f"warning: {why}; launching anyway (--force)", soft_wrap=True, markup=False)
        return
    raise ValueError(f"{why}: it would run out of memory. The plan is above; {tips}")


def _check_resumable(record: dict, cfg: RunConfig, directory: str) -> None:
    want = cfg.identity()
    have = dict(record.get("run", {}))
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


def _resolve(cfg: RunConfig):
    """(family, recipe name, recipe, model config, device, kernels), checked: bad names, config values and a config
    the device cannot run (e.g. cuDNN attention on a CPU) raise ValueError here, before anything touches the disk
    or compiles."""
    family = cli.family(cfg.model)
    recipe_name = cfg.recipe or family.default_recipe
    recipe = None if recipe_name == "auto" else cli.recipe(family, recipe_name)   # auto: chosen once shapes are known
    model_cfg = cli.model_config(family, cfg.preset, cfg.overrides)
    device = jax.devices()[0]
    kernels = kernel_choices(model_cfg, device)
    return family, recipe_name, recipe, model_cfg, device, kernels


def run(cfg: RunConfig, console: Console | None = None) -> Result:
    """Train as `cfg` says (see the module docstring). With --ckpt-dir, the directory is checked and taken for
    this run (`recipes.lock.DirLock`) before anything else, and given back at the end."""
    # Off a terminal (a log file, CI), print wide lines rather than wrapping at 80 columns.
    console = console or Console(highlight=False, width=None if os.isatty(1) else 160)
    model_cfg = _resolve(cfg)[3]
    mesh_lib.resolve(cfg.mesh, model_cfg, cfg.batch)   # a mesh that does not fit: ValueError before the disk
    lock = None
    if cfg.ckpt_dir:
        directory = guard.check_ckpt_dir(cfg.ckpt_dir)
    if cfg.ckpt_dir and jax.process_index() == 0:   # multi-host: one lock for the run, held by process 0
        lock = DirLock(directory)
        if lock.taken_over:
            console.print(f"took over the stale lock of a run that ended without releasing it "
                          f"(pid {lock.taken_over.get('pid')}, started {lock.taken_over.get('started')})",
                          soft_wrap=True)
    try:
        return _run(cfg, console)
    finally:
        if lock is not None:
            lock.release()


def _run(cfg: RunConfig, console: Console) -> Result:
    family, recipe_name, recipe, model_cfg, device, kernels = _resolve(cfg)
    # Refuse to overwrite a run, or to resume a different one, before spending time on the model.
    ckpts = Checkpoints(cfg.ckpt_dir) if cfg.ckpt_dir else None
    if ckpts is not None and ckpts.steps() and not cfg.resume:
        raise ValueError(f"{ckpts.directory} already holds checkpoints (latest step {ckpts.latest_step()}): "
                         f"pass --resume to continue that run, or choose another --ckpt-dir")
    check = lambda record: _check_resumable(record, cfg, ckpts.directory)  # noqa: E731
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
    metrics_path = (guard.check_metrics(cfg.metrics, owner=(resume_record or {}).get("metrics"))
                    if cfg.metrics and jax.process_index() == 0 else None)   # multi-host: process 0 writes

    mesh = mesh_lib.resolve(cfg.mesh, model_cfg, cfg.batch)
    schedule = lr_schedule(lr=cfg.peak_lr, steps=cfg.total_schedule, warmup=cfg.total_warmup)
    source = _source(cfg, model_cfg.vocab_size)
    # Compile the step on shapes alone (nothing allocated), check that it fits, and only then build the model:
    # the executable compiled here is the one that runs.
    t0 = time.perf_counter()
    if recipe is None:   # --recipe auto: the planner's choice for this device, compiled and checked to fit
        ins = auto.inputs(device, hbm_gib=cfg.hbm_limit, link_gbps=cfg.link, overlap=cfg.overlap,
                          tflops=cfg.peak_tflops)
        recipe, (compiled, graphdef, abstract), notes = auto.fit(
            model_cfg, ins, lambda r: compile_for_shapes(family, model_cfg, r, cfg, schedule, mesh),
            batch=cfg.batch, seq=cfg.seq, opt_dtype=cfg.opt_dtype,
            mesh=mesh if mesh.devices.size > 1 else None)
        for note in notes:
            console.print(note, soft_wrap=True, markup=False)
        console.print(f"recipe auto for {ins.describe()}: {auto.summary(recipe)}", soft_wrap=True, markup=False)
    else:
        compiled, graphdef, abstract = compile_for_shapes(family, model_cfg, recipe, cfg, schedule, mesh)
    compile_s = time.perf_counter() - t0
    n_params = zoo.models.count_params(nnx.merge(graphdef, abstract)[0])
    tokens_per_step = cfg.batch * cfg.seq
    peak, peak_src = meter.peak_tflops(device, cfg.peak_tflops)
    n_devices = mesh.devices.size   # recipes.mesh.resolve always gives a mesh (one device: all axes 1)

    console.print(f"model {cfg.model} {cfg.preset}: {n_params:,} parameters; batch {cfg.batch} x seq {cfg.seq}; "
                  f"{cfg.steps} steps on {device.platform} ({device.device_kind})")
    console.print(f"mesh {mesh_lib.describe(mesh)} over {jax.device_count()} device(s), {jax.process_count()} "
                  f"process(es)")
    console.print(f"recipe {recipe}")
    for what, choice in kernels.items():
        console.print(f"{what}: {choice}", soft_wrap=True)
    plan = show_memory_plan(console, model_cfg, recipe, batch=cfg.batch, seq=cfg.seq, device=device,
                            compiled=compiled, hbm_limit=cfg.hbm_limit, opt_dtype=cfg.opt_dtype, mesh=mesh)
    if device.platform == "cpu":
        console.print("on the CPU there is no pinned host memory: offload placements compile and run but move "
                      "nothing (use a GPU to see HBM fall)")
    check_fits(console, cfg, plan, recipe_name, device, compiled)
    console.print(f"MFU against {peak} TFLOP/s ({peak_src})" if peak else f"MFU: {peak_src}")

    model, optimizer = build_sharded(family, model_cfg, recipe, mesh, seed=cfg.seed, make_opt=lambda m: make_optimizer(
        m, schedule, clip=cfg.clip, weight_decay=cfg.weight_decay, opt_dtype=cfg.opt_dtype))
    flops_per_step = family.flops_per_token(model_cfg, model, cfg.seq) * tokens_per_step

    record = {"run": cfg.identity(), "recipe": recipe_name, "metrics": metrics_path,
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

    metrics_file = guard.open_metrics(metrics_path, start) if metrics_path else None
    result = Result([], [], None, last_ckpt)
    progress = _Progress(console, cfg.steps, start)
    drops = DropWatch(console, cfg.max_drop_warn, cfg.log_every)
    t_last, n_since = time.perf_counter(), 0
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
            if step % cfg.log_every == 0 or step == cfg.steps or step == start + 1:
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
                progress.log(row)
                if metrics_file:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
            progress.advance(step, loss)
            if ckpts is not None and cfg.ckpt_every and step % cfg.ckpt_every == 0:
                save(step)
                t_last, n_since = time.perf_counter(), 0   # checkpoint time is not step time
            if cfg.stop_after is not None and step == cfg.stop_after and step < cfg.steps:
                result.stopped = "stop_after"
                console.print(f"--stop-after {step}: stopping as if preempted (last checkpoint: {last_ckpt})")
                break
        else:
            if ckpts is not None and last_ckpt != cfg.steps:
                save(cfg.steps)
    finally:
        progress.stop()
        if metrics_file:
            metrics_file.close()
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


class _Progress:
    """A rich progress bar on a terminal; plain log lines always (they are what a log file keeps)."""

    def __init__(self, console: Console, total: int, start: int):
        self.console = console
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
        self.console.print(line, soft_wrap=True)

    def advance(self, step: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=f"loss {loss:.4f}")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
