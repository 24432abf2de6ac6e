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
import jax.numpy as jnp
import optax
from flax import nnx
from rich.console import Console

import zoo
import zoo.sharding
from recipes import cli, guard, meter
from recipes import data as data_lib
from recipes import mesh as mesh_lib
from recipes.checkpoint import Checkpoints
from recipes.lock import DirLock
from zoo.models.registry import Family


# -- the step (copy this) ---------------------------------------------------------------------------------------
def next_token_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> jax.Array:
    """Weighted mean cross-entropy, in float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict[str, jax.Array], *,
               aux_loss: Callable = lambda cfg, aux: 0.0,
               after_update: Callable = lambda model, aux: None) -> dict[str, jax.Array]:
    """One optimizer step on `batch` ({"tokens": [B, S+1], "weights": [B, S]}), in place. Returns metrics.

    If the loss, the gradient norm or any updated parameter is not finite, nothing changes (`metrics["ok"]` is
    False; `metrics["params_ok"]` says whether the parameters were the cause).
    """
    tokens = batch["tokens"]

    def loss_fn(model):
        logits, aux = model(tokens[:, :-1], return_aux=True)
        lm_loss = next_token_loss(logits, tokens[:, 1:], batch["weights"])
        return lm_loss + aux_loss(model.config, aux), (lm_loss, aux)

    (loss, (lm_loss, aux)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    grad_norm = optax.global_norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    dropped, routed = moe_drops(aux)

    # nnx.state holds the live Variables; mapping over it snapshots their current values.
    before = jax.tree.map(lambda x: x, nnx.state((model, optimizer)))
    optimizer.update(model, grads)
    after_update(model, aux)
    params_ok = all_finite(nnx.state(model))   # e.g. a non-finite learning rate with finite gradients
    ok = ok & params_ok
    # The NaN guard: keep the old state where the step is not finite (a select, no host round trip).
    nnx.update((model, optimizer), jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                                nnx.state((model, optimizer)), before))
    return {"loss": lm_loss, "total_loss": loss, "grad_norm": grad_norm, "ok": ok, "params_ok": params_ok,
            "dropped": dropped, "routed": routed}



def moe_drops(aux: Any) -> tuple[jax.Array, jax.Array]:
    """(token copies dropped by capacity dispatch, token copies routed), summed over every MoE layer in the
    model's aux ({stack: {"dropped": [L], "load": [L, E]}}); zeros for a model without experts."""
    stacks = [a for a in (aux.values() if isinstance(aux, dict) else ()) if isinstance(a, dict)]
    dropped = sum((jnp.sum(a["dropped"]).astype(jnp.int32) for a in stacks if "dropped" in a), jnp.zeros((), jnp.int32))
    routed = sum((jnp.sum(a["load"]).astype(jnp.int32) for a in stacks if "load" in a), jnp.zeros((), jnp.int32))
    return dropped, routed


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



def all_finite(tree) -> jax.Array:
    """True iff every floating-point leaf of `tree` is finite: one fused reduction under jit."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


def lr_schedule(*, lr: float, steps: int, warmup: int) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup` steps, then cosine decay to lr/10 at `steps`; lr/10 after it."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
                                              end_value=lr / 10)


def make_optimizer(model: nnx.Module, schedule: optax.Schedule, *, clip: float,
                   weight_decay: float) -> nnx.Optimizer:
    """AdamW (b1 0.9, b2 0.95) on `schedule`, after clipping the gradients' global norm to `clip`."""
    tx = optax.chain(optax.clip_by_global_norm(clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def compile_step(model: nnx.Module, optimizer: nnx.Optimizer, step_fn: Callable, *, keep_shardings: bool = False):
    """(jitted step over (state, batch) -> (state, metrics), graphdef, state). The state is donated. With
    `keep_shardings`, the new state is laid out as the old one (a sharded run's state stays on its shardings)."""
    graphdef, state = nnx.split((model, optimizer))
    out = ((jax.tree.map(lambda x: x.sharding, state), None) if keep_shardings else None)

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = step_fn(model, optimizer, batch)
        return nnx.state((model, optimizer)), metrics

    kwargs = {"out_shardings": out} if out is not None else {}
    return jax.jit(step, donate_argnums=0, **kwargs), graphdef, state


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
    lr: float = 3e-3
    warmup: int | None = None          # None: schedule_steps // 10 (at least 1)
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
    max_drop_warn: float = 0.01        # warn when capacity dispatch drops more than this fraction of token copies
    stop_after: int | None = None      # debug: stop after this step without a final checkpoint (a preemption)
    poison_step: int | None = None     # debug: NaN loss weights at this step (a corrupted record)

    def __post_init__(self):
        for field in ("steps", "batch", "seq", "log_every"):
            if getattr(self, field) <= 0:
                raise ValueError(f"--{field.replace('_', '-')} must be positive, got {getattr(self, field)}")
        if self.schedule_steps is not None and self.schedule_steps <= 0:
            raise ValueError(f"--schedule-steps must be positive, got {self.schedule_steps}")
        for flag, value, lowest, strict in (("lr", self.lr, 0, True), ("clip", self.clip, 0, True),
                                            ("weight-decay", self.weight_decay, 0, False)):
            if not (math.isfinite(value) and (value > lowest if strict else value >= lowest)):
                raise ValueError(f"--{flag} must be a finite number {'>' if strict else '>='} {lowest}, got {value}")
        if self.warmup is not None and not 0 <= self.warmup < self.total_schedule:
            raise ValueError(f"--warmup must be >= 0 and less than the schedule's {self.total_schedule} steps "
                             f"(--schedule-steps, default --steps), got {self.warmup}")
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
        return self.warmup if self.warmup is not None else max(1, self.total_schedule // 10)

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed: everything that changes the numbers (not --steps, where to
        stop: a resumed run may go on past its schedule at the final learning rate)."""
        keys = ("model", "preset", "overrides", "batch", "seq", "lr", "clip", "weight_decay", "seed", "data",
                "data_dtype")
        ident = {k: getattr(self, k) for k in keys}
        ident.update(schedule_steps=self.total_schedule, warmup=self.total_warmup)
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

    out = {"attention": str(resolve_impl(model_cfg, device))}
    if hasattr(model_cfg, "moe_backend"):
        from zoo.layers.moe import backend_choice

        name, why = backend_choice(model_cfg.moe_backend, dtype=jnp.dtype(model_cfg.dtype), device=device)
        out["moe backend"] = f"{name} ({why})"
    return out


def build_sharded(family: Family, model_cfg, recipe: zoo.Recipe, mesh, make_opt: Callable, *, seed: int):
    """(model, optimizer) created on `mesh` by the rules (`zoo.sharding.init`: an abstract init, then one jitted
    init onto the shardings; no device holds a full copy of a sharded variable). Values are `build_model`'s."""
    def make():
        model = family.build(model_cfg, recipe=recipe, rngs=nnx.Rngs(seed))
        return model, make_opt(model)
    return zoo.sharding.init(make, mesh)


def build_model(family: Family, model_cfg, recipe: zoo.Recipe, *, seed: int) -> nnx.Module:
    """Initialise the model in one compiled program (eagerly, every initializer would compile on its own)."""
    return nnx.jit(lambda: family.build(model_cfg, recipe=recipe, rngs=nnx.Rngs(seed)))()


def show_memory_plan(console: Console, model_cfg, recipe: zoo.Recipe, *, batch: int, seq: int,
                     device: jax.Device, mesh=None) -> None:
    """Print the recipe's memory plan (`zoo.plan`, with the device's HBM as its budget; per device under a mesh
    of several devices)."""
    limit = (device.memory_stats() or {}).get("bytes_limit")
    kwargs = {"hbm_gib": limit / 2 ** 30} if limit else {}
    if mesh is not None and mesh.devices.size > 1:
        kwargs["mesh"] = mesh
    zoo.plan.render(zoo.plan(model_cfg, recipe, batch=batch, seq=seq, **kwargs), console)


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
    recipe = cli.recipe(family, recipe_name)
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
    schedule = lr_schedule(lr=cfg.lr, steps=cfg.total_schedule, warmup=cfg.total_warmup)
    model, optimizer = build_sharded(family, model_cfg, recipe, mesh, seed=cfg.seed, make_opt=lambda m: make_optimizer(
        m, schedule, clip=cfg.clip, weight_decay=cfg.weight_decay))
    n_params = zoo.models.count_params(model)
    tokens_per_step = cfg.batch * cfg.seq
    flops_per_step = family.flops_per_token(model_cfg, model, cfg.seq) * tokens_per_step
    peak, peak_src = meter.peak_tflops(device, cfg.peak_tflops)

    console.print(f"model {cfg.model} {cfg.preset}: {n_params:,} parameters; batch {cfg.batch} x seq {cfg.seq}; "
                  f"{cfg.steps} steps on {device.platform} ({device.device_kind})")
    console.print(f"mesh {mesh_lib.describe(mesh)} over {jax.device_count()} device(s), {jax.process_count()} "
                  f"process(es)")
    console.print(f"recipe {recipe}")
    for what, choice in kernels.items():
        console.print(f"{what}: {choice}", soft_wrap=True)
    show_memory_plan(console, model_cfg, recipe, batch=cfg.batch, seq=cfg.seq, device=device, mesh=mesh)
    if device.platform == "cpu":
        console.print("on the CPU there is no pinned host memory: offload placements compile and run but move "
                      "nothing (use a GPU to see HBM fall)")
    console.print(f"MFU against {peak} TFLOP/s ({peak_src})" if peak else f"MFU: {peak_src}")

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

    step_fn = lambda m, o, b: train_step(m, o, b, aux_loss=family.aux_loss,  # noqa: E731
                                         after_update=family.after_update)
    jitted, graphdef, state = compile_step(model, optimizer, step_fn, keep_shardings=True)
    source = _source(cfg, model_cfg.vocab_size)
    t0 = time.perf_counter()
    with zoo.sharding.use(mesh):   # trace inside: the activation constraints read the mesh and its rules
        compiled = jitted.lower(state, mesh_lib.put_batch(source.batch(start + 1), mesh)).compile()
    host = meter.host_bytes(compiled) if device.platform != "cpu" else None
    console.print(f"compiled the step in {time.perf_counter() - t0:.1f} s"
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
        for step in range(start + 1, cfg.steps + 1):
            batch = mesh_lib.put_batch(source.batch(step), mesh)
            state, m = compiled(state, batch)
            m = jax.device_get(m)
            if not m["ok"]:
                # The step left `state` as it was: that is the last good state, after step - 1.
                if ckpts is not None and step - 1 > 0 and last_ckpt != step - 1:
                    save(step - 1)
                where = (f"The last good checkpoint is step {last_ckpt} in {ckpts.directory}" if last_ckpt
                         else "No checkpoint was written (no --ckpt-dir, or no good step yet)")
                progress.stop()
                cause = (f"the loss ({m['total_loss']}) or the gradient norm ({m['grad_norm']}) is not finite"
                         if not (math.isfinite(m["total_loss"]) and math.isfinite(m["grad_norm"])) else
                         f"the update made parameters non-finite (the loss {m['total_loss']:.4f} and the gradient "
                         f"norm {m['grad_norm']:.4f} are finite: check --lr)")
                console.print(f"[bold red]step {step}: {cause}; the update was not applied and the run stops. "
                              f"{where}.[/]", soft_wrap=True)
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
                tflops = flops_per_step * n / dt / 1e12
                row = {"step": step, "loss": loss, "aux_loss": float(m["total_loss"]) - loss,
                       "grad_norm": float(m["grad_norm"]),
                       "lr": float(schedule(step - 1)), "tokens_per_s": tok_s, "model_tflops": tflops,
                       "mfu": tflops / peak if peak else None, "peak_hbm_bytes": meter.peak_hbm_bytes(device),
                       "host_bytes": host, "dropped": int(m["dropped"]), "drop_fraction": drops.fraction(m)}
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
