"""Before the first step: the run's names resolved and checked against the device, its step compiled on shapes
(the executable that runs), what runs said, its memory plan printed and checked to fit, and the model built
sharded. A step that cannot fit is refused here, before anything is allocated.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from rich.console import Console

import zoo
import zoo.sharding
from recipes import registry as recipe_registry
from recipes.train import auto, cli, fit, meter, watch
from recipes.train import mesh as mesh_lib
from recipes.train.config import RunConfig
from zoo import compile_options
from zoo.layers.attention import resolve_impl
from zoo.models.registry import Family
from zoo.opt_state import check_params, state_shardings
from zoo.optim import make_optimizer
from zoo.plan.peak import allocator_limit
from zoo.train_step import compile_abstract


def resolve(cfg: RunConfig):
    """(family, recipe name, recipe, model config, device, kernels), checked: bad names, config values and a config
    the device cannot run (e.g. cuDNN attention on a CPU) raise ValueError here, before anything touches the disk
    or compiles (--params host with float32 parameters among them)."""
    family = cli.family(cfg.model)
    recipe_name = cfg.recipe or recipe_registry.default_recipe(family)
    recipe = None if recipe_name == "auto" else cli.recipe(family, recipe_name)   # auto: chosen once shapes are known
    model_cfg = cli.model_config(family, cfg.preset, cfg.overrides)
    try:
        model_cfg.check_seq(cfg.seq)
    except ValueError as e:
        raise ValueError(f"--seq {cfg.seq}: {e}") from None
    check_params(cfg.params, model_cfg.param_dtype)
    device = jax.local_devices()[0]   # this process's own (memory statistics of another's fail)
    kernels = kernel_choices(model_cfg, device, cfg.overrides)
    return family, recipe_name, recipe, model_cfg, device, kernels


def kernel_choices(model_cfg, device: jax.Device, overrides=()) -> dict[str, str]:
    """What runs on `device` for this config: the attention kernel and, for a mixture of experts, the grouped
    matmul (a backend not "auto" is said to be the preset's unless `overrides` set it). Raises ValueError for an
    explicit choice that cannot run there (before anything is built)."""
    out = {"attention": str(resolve_impl(model_cfg, device))}
    for kernel, choice in model_cfg.kernel_choices(device).items():
        if "(asked for" in choice:   # an explicit choice: the user's --set or the preset's
            field = kernel.replace(" ", "_")   # a kernel is chosen by the config field of its name
            who = f"--set {field}" if field in dict(overrides) else f"the preset's {field}"
            choice = choice.replace("(asked for", f"({who}", 1)
        out[kernel] = choice
    return out


def build_sharded(family: Family, model_cfg, recipe: zoo.Recipe, mesh, make_opt: Callable, *, seed: int,
                  opt_state: str = "device", params: str = "device"):
    """(model, optimizer) created on `mesh` by the rules (`zoo.sharding.init`: an abstract init, then one jitted
    init onto the shardings; no device holds a full copy of a sharded variable), the optimizer's moments where
    `opt_state` says and its float32 master copy (if `make_opt` makes one) where `params` says
    (`zoo.opt_state.state_shardings`). Values are the unsharded build's."""
    def make():
        model = family.build(model_cfg, recipe=recipe, rngs=nnx.Rngs(seed))
        return model, make_opt(model)
    return zoo.sharding.init(make, mesh, place=lambda state, out: state_shardings(state, out, opt_state=opt_state,
                                                                                   params=params))


def build_run(cfg: RunConfig, family: Family, model_cfg, recipe: zoo.Recipe, mesh, schedule):
    """The run's (model, optimizer), built sharded (`build_sharded`): its optimizer as the flags say, with a float32
    master copy of the parameters in pinned host memory under --params host."""
    return build_sharded(family, model_cfg, recipe, mesh, seed=cfg.seed, opt_state=cfg.opt_state, params=cfg.params,
                         make_opt=lambda m: make_optimizer(m, schedule, clip=cfg.clip, weight_decay=cfg.weight_decay,
                                                           opt_dtype=cfg.opt_dtype, master=cfg.params == "host"))


def show_memory_plan(console: Console, model_cfg, recipe: zoo.Recipe, *, batch: int, seq: int,
                     device: jax.Device, compiled=None, hbm_limit: float | None = None,
                     opt_dtype: str = "float32", mesh=None, grad_accum: int = 1,
                     opt_state: str = "device", params: str = "device", loss_chunk="auto") -> zoo.plan.Plan:
    """Print the recipe's memory plan (`zoo.plan`, with the device's HBM as its budget and, given the compiled
    step, its peak with XLA's temporaries; per device under a mesh of several devices) and return it."""
    limit = allocator_limit(device)
    hbm_gib = hbm_limit or (limit / 2 ** 30 if limit else None)
    parallel = zoo.plan.Parallelism(mesh=mesh if mesh is not None and mesh.devices.size > 1 else None)
    p = zoo.plan.plan(model_cfg, recipe, batch=batch, seq=seq, compiled=compiled, peak=None if compiled is None else
                      "compile", hardware=zoo.plan.Hardware(hbm_gib=hbm_gib), parallel=parallel,
                      training=zoo.plan.Training(opt_dtype=opt_dtype, grad_accum=grad_accum, opt_state=opt_state,
                                                 params=params, loss_chunk=loss_chunk))
    zoo.plan.render(p, console)
    return p


def compile_for_shapes(family: Family, model_cfg, recipe: zoo.Recipe, cfg: RunConfig, schedule, mesh,
                       loss_chunk="auto"):
    """(compiled step, graphdef, abstract state): the run's step compiled on shapes alone, laid out on `mesh`
    (`zoo.train_step.compile_abstract`, the planner's compile too), its loss in chunks of `loss_chunk`."""
    return compile_abstract(family, model_cfg, recipe, batch=cfg.batch, seq=cfg.seq, schedule=schedule,
                            clip=cfg.clip, weight_decay=cfg.weight_decay, opt_dtype=cfg.opt_dtype, seed=cfg.seed,
                            mesh=mesh, grad_accum=cfg.grad_accum, opt_state=cfg.opt_state, params=cfg.params,
                            loss_chunk=loss_chunk)


def check_fits(console: Console, cfg: RunConfig, plan, recipe_name: str, device: jax.Device, compiled,
               param_dtype: str = "float32") -> None:
    """Refuse (ValueError: exit 2) a step whose compiled peak exceeds the device's budget, or whose host bytes
    exceed the pinned pool, before anything is allocated; --force launches it anyway (`recipes.train.fit`)."""
    # the offloaded activations (XLA's host temporaries) and the state kept in pinned host memory
    host = plan.host_total
    if device.platform != "cpu":
        temps = meter.host_bytes(compiled, state_on_host=plan.state.host > 0)
        host = (plan.host_bytes if temps is None else temps) + plan.state.host
    problems, notes = fit.check(plan.peak, host=host or 0, pool=plan.host_pool, device=device,
                                hbm_limit_gib=cfg.hbm_limit)
    for n in notes:
        console.print(n, soft_wrap=True, markup=False)
    if not problems:
        return
    why = "; ".join(problems)
    tips = fit.advice(batch=cfg.batch, seq=cfg.seq, recipe=recipe_name, opt_dtype=cfg.opt_dtype,
                      optimizer_bytes=plan.state.optimizer, gpu=device.platform == "gpu", opt_state=cfg.opt_state,
                      grad_accum=cfg.grad_accum, params=cfg.params, param_dtype=param_dtype,
                      param_bytes=plan.state.params)
    if cfg.force:
        console.print(f"warning: {why}; launching anyway (--force)", soft_wrap=True, markup=False)
        return
    raise ValueError(f"{why}: it would run out of memory. The plan is above; {tips}")


@dataclasses.dataclass
class Step:
    """The run's step compiled on shapes (`compile_for_shapes`), under the recipe and with the loss's chunk length
    (None: unchunked) it was compiled for."""
    recipe: zoo.Recipe
    compiled: Any
    graphdef: Any
    abstract: Any
    seconds: float
    loss_chunk: int | None = None


def compile_run(cfg: RunConfig, console: Console, family: Family, model_cfg, recipe_name: str, recipe, device, schedule,
                mesh) -> Step:
    """Compile the step (with a live status line), fitted to the device (`zoo.plan.fit`): --recipe auto the planner's
    choice for this device, --loss-chunk auto the whole sequence where the step fits that way (else the fewest chunks
    that fit); each choice said."""
    t0 = time.perf_counter()
    what = (f"compiling the training step ({cfg.model} {cfg.preset}, batch {cfg.batch} x seq {cfg.seq}, recipe "
            f"{recipe_name}) for {device.platform}")
    fit.check_run_state(cfg, model_cfg, device, mesh, console)   # a budget the model state alone is over: no compile
    # --recipe auto: its inputs (ValueError naming every missing flag) before the compile's status line
    ins = None if recipe is not None else auto.inputs(device, hbm_gib=cfg.hbm_limit, link_gbps=cfg.link,
                                                      overlap=cfg.overlap, tflops=cfg.peak_tflops)
    limit, _ = fit.budget(device, cfg.hbm_limit)
    training = zoo.plan.Training(opt_dtype=cfg.opt_dtype, grad_accum=cfg.grad_accum, opt_state=cfg.opt_state,
                                 params=cfg.params, loss_chunk=cfg.loss_chunk)
    parallel = zoo.plan.Parallelism(mesh=mesh if mesh.devices.size > 1 else None)
    with watch.busy(console, what):
        fitted = zoo.plan.fit(model_cfg, recipe if recipe is not None else "auto", batch=cfg.batch, seq=cfg.seq,
                              limit=limit, hardware=ins.hardware() if ins else zoo.plan.Hardware(),
                              training=training, parallel=parallel,
                              compile=lambda r, chunk: compile_for_shapes(family, model_cfg, r, cfg, schedule, mesh,
                                                                          chunk))
    for note in fitted.notes:
        console.print(note, soft_wrap=True, markup=False)
    if recipe_name == "auto":
        console.print(f"recipe auto for {ins.describe()}: {auto.summary(fitted.recipe)}", soft_wrap=True,
                      markup=False)
    if cfg.loss_chunk == "auto":
        console.print("loss: " + (f"chunks of {fitted.loss_chunk} positions (--loss-chunk auto: the whole sequence "
                                  f"does not fit)" if fitted.loss_chunk else
                                  "the whole sequence at once (--loss-chunk auto: the step fits that way)"),
                      soft_wrap=True, markup=False)
    compiled, graphdef, abstract = fitted.compiled
    return Step(fitted.recipe, compiled, graphdef, abstract, time.perf_counter() - t0, fitted.loss_chunk)


def show_and_check(cfg: RunConfig, console: Console, model_cfg, step: Step, recipe_name: str, device, kernels,
                    mesh) -> zoo.plan.Plan:
    """Say what runs (the model, the mesh, the recipe, the XLA options, the kernels), print the memory plan with
    the compiled peak, and refuse a step that does not fit (`check_fits`); the plan."""
    n_params = zoo.models.count_params(nnx.merge(step.graphdef, step.abstract)[0])
    accum = (f" ({cfg.grad_accum} micro-batches of {cfg.micro_batch} per update)" if cfg.grad_accum > 1 else "")
    hosted = [what for what, flag in (("optimizer state", cfg.opt_state), ("float32 master parameters", cfg.params))
              if flag == "host"]
    placed = f"; {' and '.join(hosted)} in pinned host memory between steps" if hosted else ""
    console.print(f"model {cfg.model} {cfg.preset}: {n_params:,} parameters; batch {cfg.batch} x seq {cfg.seq}"
                  f"{accum}; {cfg.steps} steps on {device.platform} ({device.device_kind}){placed}")
    console.print(f"mesh {mesh_lib.describe(mesh)} over {jax.device_count()} device(s), {jax.process_count()} "
                  f"process(es)")
    console.print(f"recipe {step.recipe}")
    console.print(f"XLA options of the step: {compile_options.for_step(step.recipe, device.platform).describe()}",
                  soft_wrap=True, markup=False)
    hint = compile_options.chunking_hint(step.recipe, model_cfg.mlp_seq_chunks, device.platform)
    if hint:
        console.print(hint, soft_wrap=True, markup=False)
    for what, choice in kernels.items():
        console.print(f"{what}: {choice}", soft_wrap=True)
    plan = show_memory_plan(console, model_cfg, step.recipe, batch=cfg.batch, seq=cfg.seq, device=device,
                            compiled=step.compiled, hbm_limit=cfg.hbm_limit, opt_dtype=cfg.opt_dtype, mesh=mesh,
                            grad_accum=cfg.grad_accum, opt_state=cfg.opt_state, params=cfg.params,
                            loss_chunk=step.loss_chunk)
    if device.platform == "cpu" and step.recipe.offload:
        console.print("on the CPU there is no pinned host memory: offload placements compile and run but move "
                      "nothing (use a GPU to see HBM fall)")
    check_fits(console, cfg, plan, recipe_name, device, step.compiled, model_cfg.param_dtype)
    peak, peak_src = meter.peak_tflops(device, cfg.peak_tflops)
    console.print(f"MFU against {peak} TFLOP/s ({peak_src})" if peak else f"MFU: {peak_src}")
    return plan
