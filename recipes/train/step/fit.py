"""Fitting the step to the device: the main job's checks before it allocates anything (the first section below), and
`--recipe auto`'s inputs taken from the device (the second).

Does the compiled step fit? The step is compiled on abstract inputs first (`zoo.train_step`: nothing allocated); its
peak (arguments + outputs - donated + temporaries, `zoo.plan.peak`) is compared with the device's budget
(`recipes.train.settings.job.budget`): `--hbm-limit GiB` if given, else the device's `memory_stats()["bytes_limit"]`,
else, on the CPU (whose "device memory" is the machine's RAM), the machine's RAM. Host bytes (offloaded residuals) are
compared with XLA's pinned host pool. A step that cannot fit is refused with the plan and what to change, instead of an
out-of-memory traceback; `--force` launches it anyway. A budget the model state alone is over (`check_state`) is refused
before anything compiles, by the training command and the planner alike. `check_model_state` and `check_fits` are the
training command's, on its resolved run (`recipes.train.settings.job.Job`).

`--recipe auto` on a device: what `zoo.plan.plan(model_cfg, "auto", ...)` needs (an HBM budget, a host link and a FLOP
rate), each given by its flag or taken from the device (`inputs`; the second section says from where).
"""
from __future__ import annotations

import dataclasses

import jax
from rich.console import Console

import zoo
from recipes.train.settings.job import FRACTION_ENV, Job, ram_bytes
from recipes.train.watching import meter
from zoo.plan import links
from zoo.plan.build import ONE_DEVICE
from zoo.plan.peak import Peak, allocator_limit
from zoo.plan.types import GiB, ModelState, fmt_bytes
from zoo.training import STEP


# -- does the compiled step fit? -----------------------------------------------------------------------------------
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

# -- --recipe auto's inputs, taken from the device -----------------------------------------------------------------
# What `zoo.plan.plan(model_cfg, "auto", ...)` needs on a device: the planner's automatic recipe (`zoo.plan.auto`)
# needs an HBM budget, a host link (rate and overlap) and a FLOP rate. On a device each has a default, and every
# figure says where it came from (`inputs`):
#
# - HBM: `--hbm-limit`, else the device's allocator limit (`memory_stats()["bytes_limit"]`); a device without one
#   (the CPU) needs `--hbm-limit`.
# - link: `--link` (GB/s per direction, with `--overlap`, default 0), else the link measured for the device kind
#   inside a training step (`zoo.plan.links`: on the H200 with jax 0.11.2, 55.3 GB/s, 63% of the stores and 48% of
#   the reloads hidden under compute once the step's copies leave the compute stream).
# - FLOP rate: `--peak-tflops`, else the main job's per-device table (`recipes.train.watching.meter.peak_tflops`: the
#   datasheet bf16 peak).
#
# The planner fills the budget with saved activations and model state beside what it expects XLA's temporaries to
# take; the main job compiles the choice and, while its peak is over the device's limit, plans again with the budget
# lowered (`zoo.plan.fitting.lowered`, through `zoo.plan.fit`): the recipe that runs is one whose compiled peak fits.
@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the planner's automatic recipe is chosen for on this device (`inputs`): the HBM budget, the host link and
    its overlap, the FLOP rate, each with where it came from (a flag, the device, a measurement, a table)."""
    hbm_gib: float
    hbm_source: str
    link_gbps: float
    overlap: links.Overlap
    link_source: str
    tflops: float
    tflops_source: str

    def hardware(self, hbm_gib: float | None = None) -> zoo.plan.Hardware:
        """These inputs as the planner's `Hardware` (the HBM budget `hbm_gib` if given)."""
        return zoo.plan.Hardware(hbm_gib=self.hbm_gib if hbm_gib is None else hbm_gib, link_gbps=self.link_gbps,
                                 overlap=self.overlap, tflops=self.tflops)

    def describe(self) -> str:
        """The inputs in one line, each with its source (the main job prints it beside the recipe chosen)."""
        return (f"HBM {self.hbm_gib:.1f} GiB ({self.hbm_source}), link {self.link_gbps:g} GB/s with overlap "
                f"{self.overlap} ({self.link_source}), {self.tflops:g} TFLOP/s ({self.tflops_source})")


def inputs(device: jax.Device, *, hbm_gib: float | None = None, link_gbps: float | None = None,
           overlap: float | None = None, tflops: float | None = None) -> Inputs:
    """The automatic recipe's inputs for `device`, each given or taken from the device. Where neither is possible
    (the CPU: all three), one ValueError names every missing input and its flag at once."""
    kind = device.device_kind
    missing = []
    if hbm_gib is not None:
        hbm, hbm_src = hbm_gib, "--hbm-limit"
    else:
        limit = allocator_limit(device)
        hbm, hbm_src = (limit or 0) / GiB, f"{kind}'s bytes_limit"
        if not limit:
            missing.append(f"an HBM budget: {kind} reports no memory limit; pass --hbm-limit GIB")
    if link_gbps is not None:
        rate, ovl, link_src = link_gbps, links.Overlap.of(0.0 if overlap is None else overlap), "--link"
    else:
        measured = links.measured(kind)
        if measured is None:
            rate, ovl, link_src = 0.0, links.Overlap.of(0.0), ""
            missing.append(f"a host link: none is measured for {kind!r} (zoo.plan.links: "
                           f"{', '.join(m.device_kind for m in links.MEASURED)}); pass --link GBPS")
        else:
            rate, ovl = measured.rate_gbps, measured.overlap if overlap is None else links.Overlap.of(overlap)
            link_src = f"measured on the {measured.device_kind}, zoo.plan.links"
    rate_tflops, tflops_src = meter.peak_tflops(device, tflops)
    if rate_tflops is None:
        missing.append(f"a FLOP rate: no datasheet peak is known for {kind!r} (recipes.train.watching.meter); "
                       f"pass --peak-tflops TFLOPS")
    if missing:
        raise ValueError("--recipe auto needs " + "; and ".join(missing))
    return Inputs(hbm, hbm_src, rate, ovl, link_src, rate_tflops, tflops_src)


def choose(model_cfg, ins: Inputs, *, batch: int, seq: int, training: zoo.plan.Training = STEP,
           parallel: zoo.plan.Parallelism = ONE_DEVICE) -> zoo.Recipe:
    """The recipe `zoo.plan` chooses for the model config `model_cfg` at [batch, seq] with `ins`."""
    return zoo.plan.plan(model_cfg, "auto", batch=batch, seq=seq, hardware=ins.hardware(), parallel=parallel,
                         training=training, peak=None).recipe


def summary(recipe: zoo.Recipe) -> str:
    """The chosen recipe in words: the tags kept in HBM, those offloaded (and what the first layer of each group keeps
    or offloads beside), and that the rest are recomputed."""
    names = recipe.resolve()
    kept = ", ".join(names.device) or "none"
    sent = ", ".join(names.offload) or "none"
    first = "".join(f", the first layer of each group {verb} [{', '.join(tags)}]"
                    for verb, tags in (("keeps", names.lead_device), ("offloads", names.lead_offload)) if tags)
    return f"keeps [{kept}] in HBM, offloads [{sent}]{first}, recomputes every other tag"
