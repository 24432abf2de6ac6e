"""Before the first step, from the resolved run (`recipes.train.settings.job.Job`): its learning-rate schedule built
(read by the step and the optimizer), its step compiled on shapes (the executable that runs), what runs said, its
memory plan printed and checked to fit, the model built sharded, and what the loop measures each step against (the
step's host bytes, the device's peak, the model's FLOPs) and its held-out loss, found once. A step that cannot fit is
refused here, before anything is allocated.
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from rich.console import Console

import zoo
import zoo.sharding
from recipes.train.processes import mesh as mesh_lib
from recipes.train.settings.job import Job
from recipes.train.step import fit
from recipes.train.watching import meter, watch
from zoo import compile_options, renames
from zoo.models.registry import Family
from zoo.opt_state import state_shardings
from zoo.optim import lr_schedule, make_optimizer
from zoo.train_step import compile_abstract, eval_loss

# the fit checks, moved to recipes.train.step.fit, for one release (docs/changes.md)
renames.ATTRIBUTES[__name__] = {"check_fits": "recipes.train.step.fit.check_fits",
                                "check_model_state": "recipes.train.step.fit.check_model_state"}
__getattr__ = renames.attributes(__name__)


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


def make_schedule(job: Job) -> optax.Schedule:
    """The run's learning-rate schedule (`zoo.optim.lr_schedule`: warm-up to the peak `Job.lr` over `Job.warmup`
    steps, then cosine decay to lr/10 over `Cadence.schedule_steps`), built in this phase beside the optimizer that
    reads it: the step compiled (`compile_for_shapes`) and the optimizer built (`build_run`) read it, and the loop
    logs it (`Built.schedule`)."""
    return lr_schedule(lr=job.lr, steps=job.cadence.schedule_steps, warmup=job.warmup)


def build_run(job: Job, recipe: zoo.Recipe, schedule: optax.Schedule):
    """The run's (model, optimizer), built sharded (`build_sharded`): its optimizer as the settings say, on the
    learning-rate `schedule` (`make_schedule`), with a float32 master copy of the parameters in pinned host memory
    under --params host."""
    t = job.training
    return build_sharded(job.family, job.model_cfg, recipe, job.mesh, seed=job.seed, opt_state=t.opt_state,
                         params=t.params, make_opt=lambda m: make_optimizer(
                             m, schedule, clip=t.clip, weight_decay=t.weight_decay, opt_dtype=t.opt_dtype,
                             master=t.params != "device"))


def show_memory_plan(job: Job, console: Console, step: Step) -> zoo.plan.Plan:
    """Print the memory plan of the compiled step (`zoo.plan`: its peak with XLA's temporaries, per device under a
    mesh of several devices, with the device's HBM as its budget) and return it."""
    limit = zoo.plan.allocator_limit(job.device)
    hbm_gib = job.fitting.hbm_limit or (limit / 2 ** 30 if limit else None)
    p = zoo.plan.plan(job.model_cfg, step.recipe, batch=job.cadence.batch, seq=job.cadence.seq,
                      compiled=step.compiled, peak="compile", hardware=zoo.plan.Hardware(hbm_gib=hbm_gib),
                      parallel=job.parallel, training=dataclasses.replace(job.training, loss_chunk=step.loss_chunk))
    zoo.plan.render(p, console)
    return p


def compile_for_shapes(job: Job, recipe: zoo.Recipe, schedule: optax.Schedule, loss_chunk="auto"):
    """(compiled step, graphdef, abstract state): the run's step compiled on shapes alone, laid out on its mesh
    (`zoo.train_step.compile_abstract`, the planner's compile too), on the learning-rate `schedule`
    (`make_schedule`), its loss in chunks of `loss_chunk`."""
    return compile_abstract(job.family, job.model_cfg, recipe, batch=job.cadence.batch, seq=job.cadence.seq,
                            training=dataclasses.replace(job.training, loss_chunk=loss_chunk),
                            schedule=schedule, mesh=job.mesh)


@dataclasses.dataclass(frozen=True)
class Step:
    """The run's step compiled on shapes (`compile_for_shapes`): the recipe, the loss's chunk length (None:
    unchunked) and the XLA options it was compiled for, and what its recipe's chunking could change."""
    recipe: zoo.Recipe
    compiled: Any
    graphdef: Any
    abstract: Any
    seconds: float
    loss_chunk: int | None
    options: compile_options.StepOptions
    hint: str | None


@dataclasses.dataclass(frozen=True)
class Built:
    """The run's step compiled (`Step`), its memory plan, the model and optimizer built sharded, and what the loop
    reads beside them, found once here."""
    step: Step
    plan: zoo.plan.Plan
    model: Any
    optimizer: Any
    schedule: optax.Schedule     # the learning-rate schedule the step and the optimizer read (`make_schedule`)
    host: int | None             # the step's host bytes as XLA compiled them (`meter.host_bytes`; None on the CPU)
    peak_tflops: float | None    # the device's peak for MFU (--peak-tflops or the datasheet's; None: unknown)
    flops_per_step: float        # the model's FLOPs in one step (`Family.flops_per_token`)
    eval_fn: Callable | None     # the held-out loss (`make_eval`; None: no --eval-every)


def make_eval(graphdef, mesh, loss_chunk="auto") -> Callable:
    """(state, batch) -> the held-out batch's mean next-token loss: the model's forward pass alone, its loss over
    chunks of `loss_chunk` positions as the step's (`zoo.train_step.eval_loss`), jitted (traced under the mesh's
    rules, as the step)."""
    @jax.jit
    def loss(state, batch):
        model, _ = nnx.merge(graphdef, state)
        return eval_loss(model, batch, loss_chunk)

    def run(state, batch):
        with zoo.sharding.use(mesh):
            return loss(state, batch)
    return run


def prepare(job: Job, console: Console) -> Built:
    """Build the learning-rate schedule (`make_schedule`), compile the step on shapes alone (nothing allocated,
    `compile_run`), show it and refuse one that does not fit (`show_and_check`), and only then build the model
    (`build_run`): the executable compiled here is the one that runs, and what it is measured against is found here
    once."""
    schedule = make_schedule(job)
    step = compile_run(job, console, schedule)
    plan, host, peak = show_and_check(job, console, step)
    model, optimizer = build_run(job, step.recipe, schedule)
    cadence = job.cadence
    flops = job.family.flops_per_token(job.model_cfg, model, cadence.seq) * cadence.batch * cadence.seq
    eval_fn = make_eval(step.graphdef, job.mesh, step.loss_chunk) if job.data.evaluate else None
    return Built(step, plan, model, optimizer, schedule, host, peak, flops, eval_fn)


def compile_run(job: Job, console: Console, schedule: optax.Schedule) -> Step:
    """Compile the step on the learning-rate `schedule` (with a live status line), fitted to the device
    (`zoo.plan.fit`): --recipe auto the planner's choice for this device, --loss-chunk auto the whole sequence where
    the step fits that way (else the fewest chunks that fit); each choice said."""
    t0 = time.perf_counter()
    cadence, device, fitting = job.cadence, job.device, job.fitting
    what = (f"compiling the training step ({job.model}, batch {cadence.batch} x seq {cadence.seq}, recipe "
            f"{job.recipe_name}) for {device.platform}")
    fit.check_model_state(job, console)   # a budget the model state alone is over: no compile
    # --recipe auto: its inputs (ValueError naming every missing flag) before the compile's status line
    ins = None if job.recipe is not None else fit.inputs(device, hbm_gib=fitting.hbm_limit, link_gbps=fitting.link,
                                                         overlap=fitting.overlap, tflops=cadence.peak_tflops)
    limit, _ = job.budget
    with watch.busy(console, what):
        fitted = zoo.plan.fit(job.model_cfg, job.recipe or "auto", batch=cadence.batch, seq=cadence.seq,
                              limit=limit, hardware=ins.hardware() if ins else zoo.plan.Hardware(),
                              training=job.training, parallel=job.parallel,
                              compile=lambda recipe, chunk: compile_for_shapes(job, recipe, schedule, chunk))
    for note in fitted.notes:
        console.print(note, soft_wrap=True, markup=False)
    if job.recipe is None:
        console.print(f"recipe auto for {ins.describe()}: {fit.summary(fitted.recipe)}", soft_wrap=True,
                      markup=False)
    if job.training.loss_chunk == "auto":
        console.print("loss: " + (f"chunks of {fitted.loss_chunk} positions (--loss-chunk auto: the whole sequence "
                                  f"does not fit)" if fitted.loss_chunk else
                                  "the whole sequence at once (--loss-chunk auto: the step fits that way)"),
                      soft_wrap=True, markup=False)
    compiled, graphdef, abstract = fitted.compiled
    return Step(fitted.recipe, compiled, graphdef, abstract, time.perf_counter() - t0, fitted.loss_chunk,
                compile_options.for_step(fitted.recipe, device.platform),
                compile_options.chunking_hint(fitted.recipe, job.model_cfg.mlp_seq_chunks, device.platform))


def show_and_check(job: Job, console: Console, step: Step) -> tuple[zoo.plan.Plan, int | None, float | None]:
    """Say what runs (the model, the mesh, the recipe, the XLA options, the kernels), print the memory plan with
    the compiled peak, and refuse a step that does not fit (`recipes.train.step.fit.check_fits`); (the plan, the
    step's host bytes as compiled: None on the CPU, the device's peak TFLOP/s)."""
    cadence, training, device = job.cadence, job.training, job.device
    n_params = zoo.models.count_params(nnx.merge(step.graphdef, step.abstract)[0])
    accum = (f" ({training.grad_accum} micro-batches of {cadence.batch // training.grad_accum} per update)"
             if training.grad_accum > 1 else "")
    hosted = [what for what, flag in (("optimizer state", training.opt_state),
                                      ("float32 master parameters", training.params)) if flag == "host"]
    placed = f"; {' and '.join(hosted)} in pinned host memory between steps" if hosted else ""
    console.print(f"model {job.model}: {n_params:,} parameters; batch {cadence.batch} x seq {cadence.seq}{accum}; "
                  f"{cadence.steps} steps on {device.platform} ({device.device_kind}){placed}")
    console.print(f"mesh {mesh_lib.describe(job.mesh)} over {jax.device_count()} device(s), {jax.process_count()} "
                  f"process(es)")
    console.print(f"recipe {step.recipe}")
    console.print(f"XLA options of the step: {step.options.describe()}", soft_wrap=True, markup=False)
    if step.hint:
        console.print(step.hint, soft_wrap=True, markup=False)
    for what, choice in job.kernels.items():
        console.print(f"{what}: {choice}", soft_wrap=True)
    plan = show_memory_plan(job, console, step)
    if device.platform == "cpu" and step.recipe.offload:
        console.print("on the CPU there is no pinned host memory: offload placements compile and run but move "
                      "nothing (use a GPU to see HBM fall)")
    # what the loop measures each step against: the step's host bytes as compiled (not on the CPU: nothing moves)
    # and the device's peak
    host = meter.host_bytes(step.compiled, state_on_host=plan.state.host > 0) if device.platform != "cpu" else None
    peak, peak_src = meter.peak_tflops(device, cadence.peak_tflops)
    compiled = f"compiled the step in {step.seconds:.1f} s" + meter.host_note(host, plan, device.platform)
    fit.check_fits(job, console, plan, host)
    console.print(f"MFU against {peak} TFLOP/s ({peak_src})" if peak else f"MFU: {peak_src}")
    console.print(compiled)
    return plan, host, peak
