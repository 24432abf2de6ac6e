"""The run resolved once (`Job`): what every phase of `python -m recipes.train` reads, from its settings to the
compiled step.

`resolve(settings)` looks up the model family, its config (the preset and `--set`) and the recipe, takes this
process's device, its memory budget and the kernels that run there, makes the mesh, takes the peak learning rate and
the warm-up (plain values: the schedule itself is built beside the optimizer, `recipes.train.step.prepare`), and
checks them, before anything touches the disk or compiles: bad names and values raise ValueError here. The phases of
the run (`recipes.train.loop`) take the `Job` it returns, each its group of resolved values (`Data`, `Storage`,
`Fitting`, `Cadence`, `Job.training`); none of them reads the settings or resolves anything again.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax

import zoo
from recipes.train.processes import mesh as mesh_lib
from recipes.train.settings import cli
from recipes.train.settings.config import RunConfig
from zoo.layers.attention_kernel import resolve_impl
from zoo.models.registry import Family
from zoo.opt_state import check_params
from zoo.plan.types import GiB


@dataclasses.dataclass(frozen=True)
class Cadence:
    """The training loop's course, resolved from the settings: where it stops and what it does every so many
    steps (0: never)."""
    steps: int                   # --steps: train up to this step
    schedule_steps: int          # the learning-rate schedule's length (`RunConfig.total_schedule`)
    batch: int
    seq: int
    log_every: int
    eval_every: int
    eval_batches: int
    ckpt_every: int
    stop_after: int | None       # debug: stop after this step as if preempted
    max_drop_warn: float
    peak_tflops: float | None    # --peak-tflops: the device's peak for MFU (None: the datasheet table's)
    profile: str | None          # --profile: a profiler trace of one step goes here

    @classmethod
    def of(cls, s: RunConfig) -> Cadence:
        return cls(s.steps, s.total_schedule, s.batch, s.seq, s.log_every, s.eval_every, s.eval_batches, s.ckpt_every,
                   s.stop_after, s.max_drop_warn, s.peak_tflops, s.profile)


@dataclasses.dataclass(frozen=True)
class Data:
    """What the run reads, resolved from the settings: a token file or text (None: the synthetic source) and how
    it is read."""
    path: str | None             # --data
    tokenizer: str | None        # text --data: the tokenizer
    dtype: str | None            # a token file's id type (None: from the vocabulary)
    held_out: float              # the fraction kept out of training (`RunConfig.held_out`)
    encoding: str | None         # text --data: the files' encoding
    seed: int                    # seeds the data's order (and the synthetic source)
    evaluate: bool               # --eval-every: a held-out source is opened
    poison_step: int | None      # debug: this step's batch carries NaN loss weights

    @classmethod
    def of(cls, s: RunConfig) -> Data:
        return cls(s.data, s.tokenizer, s.data_dtype, s.held_out, s.text_encoding, s.seed, bool(s.eval_every),
                   s.poison_step)


@dataclasses.dataclass(frozen=True)
class Storage:
    """What the run keeps and writes, resolved from the settings: its checkpoint directory, whether it resumes, what
    a resumed run may change, its metrics file and TensorBoard."""
    ckpt_dir: str | None         # --ckpt-dir (None: no checkpoints)
    resume: bool                 # --resume
    allow_data_change: bool      # --allow-data-change
    schedule_given: bool         # --schedule-steps or --warmup given (else the schedule follows --steps)
    metrics: str | None          # --metrics
    tensorboard: str | None      # --tensorboard
    coordinator_timeout: float   # multi-host: how long process 0's decisions are waited for

    @classmethod
    def of(cls, s: RunConfig) -> Storage:
        return cls(s.ckpt_dir, s.resume, s.allow_data_change, s.schedule_steps is not None or s.warmup is not None,
                   s.metrics, s.tensorboard, s.coordinator_timeout)


@dataclasses.dataclass(frozen=True)
class Fitting:
    """What the step is fitted against, resolved from the settings: the memory budget asked for, --recipe auto's
    link and overlap, and whether a step that does not fit launches anyway."""
    hbm_limit: float | None      # --hbm-limit, in GiB
    link: float | None           # --link, GB/s
    overlap: float | None        # --overlap
    force: bool                  # --force

    @classmethod
    def of(cls, s: RunConfig) -> Fitting:
        return cls(s.hbm_limit, s.link, s.overlap, s.force)


@dataclasses.dataclass(frozen=True)
class Job:
    """What a run's settings resolve to: every phase of the run reads this, none reads the settings."""
    model: str                   # --model and --preset, as the messages name the model
    family: Family
    model_cfg: Any
    recipe_name: str
    recipe: zoo.Recipe | None    # None: --recipe auto, chosen once the step's shapes are known
    device: jax.Device           # this process's first (memory statistics of another's fail)
    kernels: dict[str, str]      # what runs on the device: the attention kernel, a MoE's grouped matmul
    mesh: jax.sharding.Mesh      # over every device of every process; each micro-batch splits over its data axes
    identity: dict[str, Any]     # what a checkpoint must match to be resumed (`RunConfig.identity`)
    lr: float                    # the schedule's peak learning rate (`RunConfig.peak_lr`: --lr, else the preset's)
    warmup: int                  # its warm-up steps (`RunConfig.total_warmup`); length: `Cadence.schedule_steps`
    budget: tuple[int | None, str]   # the device bytes the step may use, and where the figure comes from
    training: zoo.plan.Training  # the step as the step and the planner take it
    cadence: Cadence             # the training loop's course
    seed: int                    # seeds the parameters
    fitting: Fitting             # what the step is fitted against
    data: Data                   # what the run reads
    storage: Storage             # what the run keeps and writes

    @property
    def parallel(self) -> zoo.plan.Parallelism:
        """The mesh as the planner takes it (one device: none)."""
        return zoo.plan.Parallelism(mesh=self.mesh if self.mesh.devices.size > 1 else None)


def ram_bytes() -> tuple[int | None, int | None]:
    """(the machine's RAM, what is available now) in bytes, from /proc/meminfo or sysconf (None if unknown)."""
    total = avail = None
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        total, avail = info.get("MemTotal"), info.get("MemAvailable")
    except (OSError, ValueError, IndexError):
        pass
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = None
    return total, avail


FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def allocator_share() -> str:
    """Which share of the GPU XLA's allocator takes, and how to raise it (the budget's bytes_limit follows it)."""
    frac = os.environ.get(FRACTION_ENV)
    now = f"{FRACTION_ENV}={frac}" if frac else f"{FRACTION_ENV} unset: JAX's default, 75% of the GPU"
    return f"the allocator's share ({now}; {FRACTION_ENV}=.95 raises it)"


def budget(device: jax.Device, hbm_limit_gib: float | None) -> tuple[int | None, str]:
    """(device bytes the step may use, where the figure comes from)."""
    if hbm_limit_gib is not None:
        return int(hbm_limit_gib * GiB), "--hbm-limit"
    limit = zoo.plan.allocator_limit(device)
    if limit:
        return int(limit), f"{device.device_kind}'s bytes_limit, {allocator_share()}"
    if device.platform == "cpu":
        total, _ = ram_bytes()
        n = jax.local_device_count()
        if n > 1 and total:   # fake CPU devices (--xla_force_host_platform_device_count) share the RAM
            return total // n, f"this machine's RAM shared by {n} CPU devices: the CPU's device memory"
        return total, "this machine's RAM: the CPU's device memory"
    return None, f"no memory limit known for {device.device_kind}"


def resolve(settings: RunConfig) -> Job:
    """The `Job` of `settings`, checked: bad names, config values, a config the device cannot run (e.g. cuDNN
    attention on a CPU, `--params host` with float32 parameters) and a mesh the model or the batch does not split
    over raise ValueError."""
    device = jax.local_devices()[0]
    memory = budget(device, settings.hbm_limit)
    identity = settings.identity()
    family, model_cfg, recipe_name, recipe = cli.model_and_recipe(settings.model, settings.preset, settings.overrides,
                                                                  settings.recipe, settings.seq)
    check_params(settings.params, model_cfg.param_dtype)
    # What runs on the device: the attention kernel and, for a mixture of experts, the grouped matmul. A choice the
    # device cannot run raises; an explicit one is said to be the user's --set or the preset's.
    kernels = {"attention": str(resolve_impl(model_cfg, device))}
    for kernel, choice in model_cfg.kernel_choices(device).items():
        field = kernel.replace(" ", "_")   # a kernel is chosen by the config field of its name
        who = f"--set {field}" if field in dict(settings.overrides) else f"the preset's {field}"
        kernels[kernel] = choice.replace("(asked for", f"({who}", 1)
    mesh = mesh_lib.resolve(settings.mesh, model_cfg, settings.micro_batch)
    training = zoo.plan.Training(opt_dtype=settings.opt_dtype, grad_accum=settings.grad_accum,
                                 opt_state=settings.opt_state, params=settings.params, loss_chunk=settings.loss_chunk,
                                 clip=settings.clip, weight_decay=settings.weight_decay)
    return Job(f"{settings.model} {settings.preset}", family, model_cfg, recipe_name, recipe, device, kernels, mesh,
               identity, settings.peak_lr, settings.total_warmup, memory, training, Cadence.of(settings),
               settings.seed, Fitting.of(settings), Data.of(settings), Storage.of(settings))
