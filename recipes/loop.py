"""The training loop of `python -m recipes.train`: a plain `train_step` you can copy, and `run` around it.

`train_step(model, optimizer, batch)` is an ordinary function of NNX objects: next-token loss (plus the model's
auxiliary loss), gradients, the optimizer update, the model's non-gradient updates (e.g. DeepSeek-V3's routing
bias), and the NaN guard: a step whose loss or gradient norm is not finite leaves every state as it was. The
whole step runs under one `jax.jit` (`compile_step`: split into graph and state, merge inside, donate the state).

`run(config)` builds the model with its recipe, prints the recipe and its memory plan, restores a checkpoint
(`--resume`), trains, logs, checkpoints every K steps and at the end, and stops on a non-finite step keeping the
last good checkpoint. Everything is a pure function of (seed, step), so a resumed run equals an uninterrupted one.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from rich.console import Console

import zoo
from recipes import cli, meter
from recipes import data as data_lib
from recipes.checkpoint import Checkpoints
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

    If the loss or the gradient norm is not finite, nothing changes (`metrics["ok"]` is False).
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
    # The NaN guard: keep the old state where the step is not finite (a select, no host round trip).
    nnx.update((model, optimizer), jax.tree.map(lambda new, old: jnp.where(ok, new, old),
                                                nnx.state((model, optimizer)), before))
    return {"loss": lm_loss, "total_loss": loss, "grad_norm": grad_norm, "ok": ok, "dropped": dropped,
            "routed": routed}


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


def lr_schedule(*, lr: float, steps: int, warmup: int) -> optax.Schedule:
    """Linear warm-up from 0 to `lr` over `warmup` steps, then cosine decay to lr/10 at `steps`."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps=warmup, decay_steps=max(steps, warmup + 1),
                                              end_value=lr / 10)


def make_optimizer(model: nnx.Module, schedule: optax.Schedule, *, clip: float,
                   weight_decay: float) -> nnx.Optimizer:
    """AdamW (b1 0.9, b2 0.95) on `schedule`, after clipping the gradients' global norm to `clip`."""
    tx = optax.chain(optax.clip_by_global_norm(clip),
                     optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=weight_decay))
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def compile_step(model: nnx.Module, optimizer: nnx.Optimizer, step_fn: Callable):
    """(jitted step over (state, batch) -> (state, metrics), graphdef, state). The state is donated."""
    graphdef, state = nnx.split((model, optimizer))

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        metrics = step_fn(model, optimizer, batch)
        return nnx.state((model, optimizer)), metrics

    return jax.jit(step, donate_argnums=0), graphdef, state


# -- the run ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig:
    model: str = "llama3"
    preset: str = "tiny"
    recipe: str | None = None          # None: the model's study recipe
    overrides: tuple[tuple[str, Any], ...] = ()  # config fields to replace, e.g. (("num_layers", 3),)
    steps: int = 60
    batch: int = 8
    seq: int = 64
    lr: float = 3e-3
    warmup: int | None = None          # None: steps // 10
    clip: float = 1.0
    weight_decay: float = 0.1
    seed: int = 0
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
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.max_drop_warn <= 1:
            raise ValueError(f"--max-drop-warn must be a fraction in [0, 1], got {self.max_drop_warn}")
        if self.ckpt_every < 0:
            raise ValueError(f"--ckpt-every must be >= 0, got {self.ckpt_every}")
        if self.resume and not self.ckpt_dir:
            raise ValueError("--resume needs --ckpt-dir")

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must match to be resumed: everything that changes the numbers."""
        keys = ("model", "preset", "overrides", "steps", "batch", "seq", "lr", "warmup", "clip", "weight_decay",
                "seed", "data", "data_dtype")
        return json.loads(json.dumps({k: getattr(self, k) for k in keys}))


@dataclasses.dataclass
class Result:
    steps: list[int]
    losses: list[float]
    stopped: str | None          # None: ran to the end; "nonfinite"; "stop_after"
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


def build_model(family: Family, model_cfg, recipe: zoo.Recipe, *, seed: int) -> nnx.Module:
    """Initialise the model in one compiled program (eagerly, every initializer would compile on its own)."""
    return nnx.jit(lambda: family.build(model_cfg, recipe=recipe, rngs=nnx.Rngs(seed)))()


def show_memory_plan(console: Console, model_cfg, recipe: zoo.Recipe, *, batch: int, seq: int,
                     device: jax.Device) -> None:
    """Print the recipe's memory plan (`zoo.plan`, with the device's HBM as its budget)."""
    limit = (device.memory_stats() or {}).get("bytes_limit")
    kwargs = {"hbm_gib": limit / 2 ** 30} if limit else {}
    zoo.plan.render(zoo.plan(model_cfg, recipe, batch=batch, seq=seq, **kwargs), console)


def _open_metrics(path: str, start: int):
    """Open the metrics file for this run; on resume keep the lines of steps up to the checkpoint's."""
    kept = []
    if start and os.path.exists(path):
        with open(path) as f:
            kept = [line for line in f if line.strip() and json.loads(line)["step"] <= start]
    f = open(path, "w")  # noqa: SIM115
    f.writelines(kept)
    return f


def _check_resumable(record: dict, cfg: RunConfig, directory: str) -> None:
    want = cfg.identity()
    diff = {k: (record.get("run", {}).get(k), v) for k, v in want.items() if record.get("run", {}).get(k) != v}
    if diff:
        lines = "; ".join(f"{k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"--resume: the checkpoint in {directory} is of a different run ({lines})")


def run(cfg: RunConfig, console: Console | None = None) -> Result:
    # Off a terminal (a log file, CI), print wide lines rather than wrapping at 80 columns.
    console = console or Console(highlight=False, width=None if os.isatty(1) else 160)
    family = cli.family(cfg.model)
    recipe_name = cfg.recipe or family.default_recipe
    recipe = cli.recipe(family, recipe_name)
    model_cfg = cli.model_config(family, cfg.preset, cfg.overrides)
    device = jax.devices()[0]
    # Refuse to overwrite a run, or to resume a different one, before spending time on the model.
    ckpts = Checkpoints(cfg.ckpt_dir) if cfg.ckpt_dir else None
    resuming = ckpts is not None and ckpts.latest_step() is not None
    if resuming and not cfg.resume:
        raise ValueError(f"{ckpts.directory} already holds checkpoints (latest step {ckpts.latest_step()}): "
                         f"pass --resume to continue that run, or choose another --ckpt-dir")
    if resuming:
        _check_resumable(ckpts.record(), cfg, ckpts.directory)

    kernels = kernel_choices(model_cfg, device)   # before building: an impossible explicit choice is a ValueError
    model = build_model(family, model_cfg, recipe, seed=cfg.seed)
    warmup = cfg.warmup if cfg.warmup is not None else max(1, cfg.steps // 10)
    schedule = lr_schedule(lr=cfg.lr, steps=cfg.steps, warmup=warmup)
    optimizer = make_optimizer(model, schedule, clip=cfg.clip, weight_decay=cfg.weight_decay)
    n_params = zoo.models.count_params(model)
    tokens_per_step = cfg.batch * cfg.seq
    flops_per_step = family.flops_per_token(model_cfg, model, cfg.seq) * tokens_per_step
    peak, peak_src = meter.peak_tflops(device, cfg.peak_tflops)

    console.print(f"model {cfg.model} {cfg.preset}: {n_params:,} parameters; batch {cfg.batch} x seq {cfg.seq}; "
                  f"{cfg.steps} steps on {device.platform} ({device.device_kind})")
    console.print(f"recipe {recipe}")
    for what, choice in kernels.items():
        console.print(f"{what}: {choice}", soft_wrap=True)
    show_memory_plan(console, model_cfg, recipe, batch=cfg.batch, seq=cfg.seq, device=device)
    if device.platform == "cpu":
        console.print("on the CPU there is no pinned host memory: offload placements compile and run but move "
                      "nothing (use a GPU to see HBM fall)")
    console.print(f"MFU against {peak} TFLOP/s ({peak_src})" if peak else f"MFU: {peak_src}")

    record = {"run": cfg.identity(), "recipe": recipe_name}
    start = 0
    if ckpts is not None and resuming:
        start = ckpts.restore(model, optimizer)["step"]
        console.print(f"resumed from {ckpts.directory} at step {start}")
    elif cfg.resume:
        console.print(f"--resume: no checkpoint in {ckpts.directory} yet; starting from step 0")
    last_ckpt = start if start else None

    step_fn = lambda m, o, b: train_step(m, o, b, aux_loss=family.aux_loss,  # noqa: E731
                                         after_update=family.after_update)
    jitted, graphdef, state = compile_step(model, optimizer, step_fn)
    source = _source(cfg, model_cfg.vocab_size)
    t0 = time.perf_counter()
    compiled = jitted.lower(state, jax.tree.map(jnp.asarray, source.batch(start + 1))).compile()
    host = meter.host_bytes(compiled) if device.platform != "cpu" else None
    console.print(f"compiled the step in {time.perf_counter() - t0:.1f} s"
                  + (f"; host memory for offloaded values: {meter.fmt_bytes(host)}" if host is not None else ""))

    def save(step: int) -> None:
        nonlocal last_ckpt
        nnx.update((model, optimizer), state)
        ckpts.save(step, model, optimizer, record)
        ckpts.wait()
        last_ckpt = step

    metrics_file = _open_metrics(cfg.metrics, start) if cfg.metrics else None
    result = Result([], [], None, last_ckpt)
    progress = _Progress(console, cfg.steps, start)
    drops = DropWatch(console, cfg.max_drop_warn, cfg.log_every)
    t_last, n_since = time.perf_counter(), 0
    try:
        for step in range(start + 1, cfg.steps + 1):
            batch = jax.tree.map(jnp.asarray, source.batch(step))
            state, m = compiled(state, batch)
            m = jax.device_get(m)
            if not m["ok"]:
                # The step left `state` as it was: that is the last good state, after step - 1.
                if ckpts is not None and step - 1 > 0 and last_ckpt != step - 1:
                    save(step - 1)
                where = (f"The last good checkpoint is step {last_ckpt} in {ckpts.directory}" if last_ckpt
                         else "No checkpoint was written (no --ckpt-dir, or no good step yet)")
                progress.stop()
                console.print(f"[bold red]step {step}: the loss ({m['total_loss']}) or the gradient norm "
                              f"({m['grad_norm']}) is not finite; the update was not applied and the run stops. "
                              f"{where}.[/]")
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
            ckpts.close()
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
            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                                TimeRemainingColumn(), console=console)
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
