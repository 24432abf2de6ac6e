"""Does the compiled step fit? The main job's check before it allocates anything.

The step is compiled on abstract inputs first (`zoo.train_step`: nothing allocated); its peak (arguments +
outputs - donated + temporaries, `zoo.plan.peak`) is compared with the device's budget
(`recipes.train.settings.job.budget`): `--hbm-limit GiB` if given, else the device's `memory_stats()["bytes_limit"]`,
else, on the CPU (whose "device memory" is the machine's RAM), the machine's RAM. Host bytes (offloaded residuals) are
compared with XLA's pinned host pool. A step that cannot fit is refused with the plan and what to change, instead of an
out-of-memory traceback; `--force` launches it anyway. A budget the model state alone is over (`check_state`) is refused
before anything compiles, by the training command and the planner alike. `check_model_state` and `check_fits` are the
training command's, on its resolved run (`recipes.train.settings.job.Job`).
"""
from __future__ import annotations

import jax
from rich.console import Console

import zoo
from recipes.train.settings.job import FRACTION_ENV, Job, ram_bytes
from zoo.plan.peak import Peak
from zoo.plan.types import ModelState, fmt_bytes


def check(peak: Peak, *, host: int, pool: int, device: jax.Device, budget: tuple[int | None, str],
          hbm_limit_gib: float | None) -> tuple[list[str], list[str]]:
    """(problems that refuse the launch, notes to print); `budget`: the run's (`budget`, `Job.budget`)."""
    problems, notes = [], []
    limit, where = budget
    d = peak.detail
    parts = (f"arguments {fmt_bytes(d['argument'])} + outputs {fmt_bytes(d['output'])} - donated "
             f"{fmt_bytes(d['alias'])} + temporaries {fmt_bytes(d['temp'])}") if peak.compiled else peak.source
    if limit is None:
        notes.append(f"peak {fmt_bytes(peak.bytes)} ({peak.source}): not checked, {where}")
    elif peak.bytes > limit:
        problems.append(f"the step needs {fmt_bytes(peak.bytes)} of device memory at its peak ({peak.source}: "
                        f"{parts}), over the {fmt_bytes(limit)} of {where}")
    else:
        notes.append(f"peak device memory {fmt_bytes(peak.bytes)} ({peak.source}) of {fmt_bytes(limit)} ({where})")
        if peak.bytes > 0.95 * limit:
            notes.append("warning: within 5% of the limit: the allocator's fragmentation and buffers outside the "
                         "step (the next batch, metrics) may still run out of memory")
        if device.platform == "cpu" and hbm_limit_gib is None:
            _, avail = ram_bytes()
            if avail is not None and peak.bytes > avail:
                notes.append(f"warning: that is more than the {fmt_bytes(avail)} of RAM available now: the run may "
                             f"swap or be killed")
    if device.platform == "cpu":
        if host:
            notes.append("host memory: on the CPU offloaded values stay in (host) device memory: not checked "
                         "against the pinned pool")
    elif host > pool:
        problems.append(f"the offloaded values need {fmt_bytes(host)} of pinned host memory, over XLA's pool of "
                        f"{fmt_bytes(pool)} (raise XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, an integer GiB, or offload "
                        f"less)")
    else:
        total, _ = ram_bytes()
        if total is not None and host > total:
            problems.append(f"the offloaded values and the state on the host need {fmt_bytes(host)} of pinned host "
                            f"memory, over this machine's {fmt_bytes(total)} of RAM (offload less, or keep the "
                            f"layer input in HBM every few layers: a recipe's group)")
    return problems, notes


def advice(training: zoo.plan.Training, *, batch: int, seq: int, recipe: str, state: ModelState, gpu: bool = False,
           param_dtype: str = "float32") -> str:
    """What to change to fit a step of `training` whose model state per device is `state` (its parameters in
    `param_dtype`) under the recipe named `recipe`."""
    optimizer_bytes, grad_accum = state.optimizer, training.grad_accum
    tips = [f"a larger share of the GPU for XLA's allocator ({FRACTION_ENV}=.95; default .75)"] if gpu else []
    if training.opt_state == "device" and optimizer_bytes and gpu:   # on the CPU host memory is the device's memory
        tips.append(f"--opt-state host (the {fmt_bytes(optimizer_bytes)} of optimizer state in pinned host memory "
                    f"between steps)")
    if training.params == "device" and param_dtype == "float32" and state.params and gpu:
        tips.append(f"--set param_dtype=bfloat16 --params host (bf16 parameters and gradients in HBM, saving "
                    f"{fmt_bytes(state.params)}; the float32 master copy the update runs on in pinned host memory)")
    micro = batch // grad_accum
    if micro > 1:
        tips.append(f"--grad-accum {grad_accum * 2 if micro % 2 == 0 else grad_accum * micro} (the same batch in "
                    f"smaller micro-batches, now {micro} sequences: activations are a micro-batch's)")
    tips += [f"a smaller --batch (now {batch}) or --seq (now {seq})",
            f"a recipe that offloads or recomputes more than {recipe!r} (e.g. --recipe full; "
            f"`python -m recipes.train.plan ... --recipe auto --hbm GIB` chooses one for a budget)",
            "sequence tiles and layer groups (a recipe's seq_tiles and group, e.g. --recipe long_context: a tile's "
            "intermediates at a time, the layer input of every second layer on the host)",
            "more devices (the batch and the model state split over them)"]
    if training.opt_dtype == "float32" and optimizer_bytes:
        tips.append(f"--opt-dtype bfloat16 (saves {fmt_bytes(optimizer_bytes // 2)} of optimizer state)")
    tips.append("--set num_layers=N for a slice")
    return "to fit: " + "; ".join(tips) + ". --force launches anyway"


def check_state(state: ModelState, limit: int | None, where: str, flag: str) -> None:
    """ValueError when the model state alone is over the device budget `limit` (from `where`): no recipe, batch or
    sequence length can fit that, so it is said before anything is planned or compiled. `flag` is the budget's
    flag in this command."""
    if limit is None or state.total <= limit:
        return
    parts = [("parameters", state.params), ("gradients", state.grads), ("gradient sums", state.accum),
             ("optimizer state", 0 if state.optimizer_host else state.optimizer),
             ("master copy", 0 if state.master_host else state.master), ("other variables", state.other)]
    sums = " + ".join(f"{what} {fmt_bytes(n)}" for what, n in parts if n)
    tips = [f"a larger {flag}" if where == flag else "a device with more memory",
            "more devices (--mesh: the model state split over them)"]
    if not state.optimizer_host and state.optimizer:
        tips.append("--opt-state host (the optimizer state in pinned host memory)")
    tips.append("--set num_layers=N for a slice")
    raise ValueError(f"the model state alone needs {fmt_bytes(state.total)} of device memory per device ({sums}), "
                     f"over the {fmt_bytes(limit)} of {where}: no recipe, batch or sequence length fits it; to fit: "
                     + "; ".join(tips))


def check_model_state(job: Job, console: Console) -> None:
    """The training command's `check_state`, before it compiles: against the run's budget (`Job.budget`), for its
    optimizer state and master copy where its flags put them; `--force` says so and goes on."""
    limit, where = job.budget
    try:
        check_state(zoo.plan.model_state(job.model_cfg, training=job.training, parallel=job.parallel), limit, where,
                    "--hbm-limit")
    except ValueError as e:
        if not job.fitting.force:
            raise
        console.print(f"warning: {e}; launching anyway (--force)", soft_wrap=True, markup=False)


def check_fits(job: Job, console: Console, plan: zoo.plan.Plan, temps: int | None) -> None:
    """Refuse (ValueError: exit 2) a step whose compiled peak exceeds the device's budget, or whose host bytes
    exceed the pinned pool, before anything is allocated; --force launches it anyway.
    `temps`: the compiled step's host temporaries (`meter.host_bytes`; None on the CPU or where XLA does not say)."""
    device, cadence, fitting = job.device, job.cadence, job.fitting
    # the offloaded activations (XLA's host temporaries) and the state kept in pinned host memory
    host = plan.host_total
    if device.platform != "cpu":
        host = (plan.host_bytes if temps is None else temps) + plan.state.host
    problems, notes = check(plan.peak, host=host or 0, pool=plan.host_pool, device=device, budget=job.budget,
                            hbm_limit_gib=fitting.hbm_limit)
    for n in notes:
        console.print(n, soft_wrap=True, markup=False)
    if not problems:
        return
    why = "; ".join(problems)
    tips = advice(job.training, batch=cadence.batch, seq=cadence.seq, recipe=job.recipe_name, state=plan.state,
                  gpu=device.platform == "gpu", param_dtype=job.model_cfg.param_dtype)
    if fitting.force:
        console.print(f"warning: {why}; launching anyway (--force)", soft_wrap=True, markup=False)
        return
    raise ValueError(f"{why}: it would run out of memory. The plan is above; {tips}")
