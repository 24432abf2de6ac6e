"""The run resolved once (`Job`): what every phase of `python -m recipes.train` reads, from its settings to the
compiled step.

`resolve(settings)` looks up the model family, its config (the preset and `--set`) and the recipe, takes this
process's device, its memory budget and the kernels that run there, makes the mesh and the learning-rate schedule,
and checks them, before anything touches the disk or compiles: bad names and values raise ValueError here. The
phases of the run (`recipes.train.loop`) take the `Job` it returns; none of them resolves anything again.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import optax

import zoo
from recipes import registry as recipe_registry
from recipes.train.processes import mesh as mesh_lib
from recipes.train.settings import cli
from recipes.train.settings.config import RunConfig
from recipes.train.step import fit
from zoo.layers.attention_kernel import resolve_impl
from zoo.models.registry import Family
from zoo.opt_state import check_params
from zoo.optim import lr_schedule


@dataclasses.dataclass(frozen=True)
class Job:
    """A run's settings and what they resolve to."""
    settings: RunConfig
    family: Family
    model_cfg: Any
    recipe_name: str
    recipe: zoo.Recipe | None    # None: --recipe auto, chosen once the step's shapes are known
    device: jax.Device           # this process's first (memory statistics of another's fail)
    kernels: dict[str, str]      # what runs on the device: the attention kernel, a MoE's grouped matmul
    mesh: jax.sharding.Mesh      # over every device of every process; each micro-batch splits over its data axes
    identity: dict[str, Any]     # what a checkpoint must match to be resumed (`RunConfig.identity`)
    schedule: optax.Schedule
    budget: tuple[int | None, str]   # the device bytes the step may use, and where the figure comes from

    @property
    def training(self) -> zoo.plan.Training:
        """The step the settings describe, as the step and the planner take it."""
        s = self.settings
        return zoo.plan.Training(opt_dtype=s.opt_dtype, grad_accum=s.grad_accum, opt_state=s.opt_state,
                                 params=s.params, loss_chunk=s.loss_chunk, clip=s.clip, weight_decay=s.weight_decay)

    @property
    def parallel(self) -> zoo.plan.Parallelism:
        """The mesh as the planner takes it (one device: none)."""
        return zoo.plan.Parallelism(mesh=self.mesh if self.mesh.devices.size > 1 else None)


def resolve(settings: RunConfig) -> Job:
    """The `Job` of `settings`, checked: bad names, config values, a config the device cannot run (e.g. cuDNN
    attention on a CPU, `--params host` with float32 parameters) and a mesh the model or the batch does not split
    over raise ValueError."""
    identity = settings.identity()
    family = cli.family(settings.model)
    recipe_name = settings.recipe or recipe_registry.default_recipe(family)
    recipe = None if recipe_name == "auto" else cli.recipe(family, recipe_name)
    device = jax.local_devices()[0]
    budget = fit.budget(device, settings.hbm_limit)
    model_cfg = cli.model_config(family, settings.preset, settings.overrides)
    try:
        model_cfg.check_seq(settings.seq)
    except ValueError as e:
        raise ValueError(f"--seq {settings.seq}: {e}") from None
    if recipe is not None:
        cli.check_recipe_fits(family, recipe, recipe_name, model_cfg, settings.seq)
    check_params(settings.params, model_cfg.param_dtype)
    # What runs on the device: the attention kernel and, for a mixture of experts, the grouped matmul. A choice the
    # device cannot run raises; an explicit one is said to be the user's --set or the preset's.
    kernels = {"attention": str(resolve_impl(model_cfg, device))}
    for kernel, choice in model_cfg.kernel_choices(device).items():
        field = kernel.replace(" ", "_")   # a kernel is chosen by the config field of its name
        who = f"--set {field}" if field in dict(settings.overrides) else f"the preset's {field}"
        kernels[kernel] = choice.replace("(asked for", f"({who}", 1)
    mesh = mesh_lib.resolve(settings.mesh, model_cfg, settings.micro_batch)
    schedule = lr_schedule(lr=settings.peak_lr, steps=settings.total_schedule, warmup=settings.total_warmup)
    return Job(settings, family, model_cfg, recipe_name, recipe, device, kernels, mesh, identity, schedule, budget)
