"""The memory planner: what a recipe keeps in HBM, puts in host memory and recomputes, before launch.

``zoo.plan(cfg, recipe, batch=, seq=)`` builds the model abstractly (``nnx.eval_shape``: no memory), reads each
stack's tags and their shapes from the layers themselves (``model.tag_shapes``) and returns a :class:`Plan`:

- per stack and tag: the shape, the bytes one layer's tensor takes, and its placement. Only tags the backward
  pass needs count: those JAX saves when every tag may be saved (``zoo.plan.measure.residual_tags``). Llama's
  ``mlpwo``, for one, only flows into the residual sum and is never saved, whatever the recipe says; it is
  listed as "not a residual" with 0 bytes.
- the scan carry (``decoder_layer_input``) is saved once per layer on the device by every recipe (the
  rematerialized body needs its input in the backward pass) unless the recipe offloads it.
- JAX's own list of what the stack saves (``saved_residuals`` of the scanned stack at the planned shape, its
  aux outputs such as the MoE balance loss differentiated too, as in training) is read as well: residuals
  beyond the tags (recipe ``none`` keeps every intermediate, e.g. the attention probabilities) are reported
  per layer as "untagged", and values JAX hoists out of the scan (masks, RoPE tables) once per stack as
  "invariant". If JAX saves less than the tags the plan counts, or other host bytes,
  the plan says so in a warning. Constants baked into the program are not counted.
- recompute FLOPs: per layer, the matmul FLOPs (``dot_general`` and ``ragged_dot``, 2*M*N*K) of the gradient's
  jaxpr under the recipe minus those under ``none``. This is what the rematerialized backward pass re-runs of
  the forward pass, counted by JAX's own partial evaluation rather than by a second model of the layer. It
  counts the attention kernel as the XLA path computes it (the full S x S scores, masked), and no elementwise
  FLOPs. A config that asks for cuDNN attention is planned on the XLA path (it traces on any machine, and a
  custom call has no FLOPs to count): the tags and their bytes are the same.
- model state: parameters (their dtype), gradients (same dtype), optimizer state (``OPTIMIZERS``: moments per
  parameter, ``opt_dtype``), and other variables.

Sharding: with ``shard=N``, ``batch`` is the global batch and every byte and FLOP figure is per device: the
batch is split over N devices (data parallel) and model state too (FSDP / ZeRO-3), rounded up. Tag shapes stay
global.

Not counted in the per-tag figures: the embedding, final norm, LM head and loss (their activations, the logits in
float32 among them), XLA's temporaries, copy buffers for overlapping transfers and fragmentation: those figures
are a floor. The peak (``Plan.peak_bytes``, ``zoo.plan.peak``) counts them: on the device present the training
step (``zoo.train_step``, the main job's own) is compiled on abstract inputs and XLA's memory analysis read
(``peak="compile"``; ``"auto"`` does so on an accelerator); under a mesh whose devices are present, the sharded
step is compiled as the main job compiles it and the figure is per device. Planning for another device
(``device_kind=``), for a mesh larger than the devices present, with ``shard=N`` (a uniform split, not a program),
or on the CPU by default, it is an estimate, labelled so (``Plan.peak_source``).

``recipe="auto"`` chooses each tag's placement for an HBM budget, a host link and a FLOP rate (see
``zoo.plan.auto.choose``), and says why each tag landed where it did.
"""
from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
from flax import nnx

from zoo import sharding
from zoo.dtypes import dtype_of
from zoo.layers.attention import resolve_impl
from zoo.models.registry import family_of
from zoo.plan import auto, links
from zoo.plan import mesh as mesh_plan
from zoo.plan import peak as peak_lib
from zoo.plan.measure import abstract_model, layer_cost, stack_residuals
from zoo.plan.measure import nbytes as sds_nbytes
from zoo.plan.types import (
    CARRY,
    OPTIMIZERS,
    POOL_DEFAULT_GIB,
    POOL_ENV,
    GiB,
    ModelState,
    Plan,
    StackPlan,
    TagPlan,
    ceil_div,
    fmt_bytes,
)
from zoo.recipe import Recipe
from zoo.train_step import OPT_STATE_PLACES


def _model_state(model, shard: int, optimizer: str, opt_dtype: str) -> ModelState:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    opt_itemsize = jnp.dtype(dtype_of("opt_dtype", opt_dtype)).itemsize
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    others = jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))
    n = sum(math.prod(p.shape) for p in params)
    pbytes = sum(sds_nbytes(p) for p in params)
    obytes = sum(sds_nbytes(p) for p in others if hasattr(p, "dtype") and hasattr(p, "shape"))
    return ModelState(num_params=n, params=ceil_div(pbytes, shard), grads=ceil_div(pbytes, shard),
                      optimizer=ceil_div(OPTIMIZERS[optimizer] * n * opt_itemsize, shard),
                      other=ceil_div(obytes, shard), optimizer_name=optimizer)


def _placed(state: ModelState, model, grad_accum: int, opt_state: str) -> ModelState:
    """`state` with the float32 gradient sums of gradient accumulation (per device: the parameters' bytes at 4
    bytes a parameter) and the moments where they live."""
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    ratio = 4 * sum(math.prod(p.shape) for p in params) / max(sum(sds_nbytes(p) for p in params), 1)
    accum = int(state.params * ratio) if grad_accum > 1 else 0
    return dataclasses.replace(state, accum=accum, optimizer_host=opt_state == "host")


def host_pool_bytes() -> tuple[int, str | None]:
    """XLA's pinned host pool in bytes, as XLA reads it (an integer GiB; a bad value falls back to 64)."""
    raw = os.environ.get(POOL_ENV)
    if raw is None:
        return POOL_DEFAULT_GIB * GiB, None
    try:
        return int(raw) * GiB, None
    except ValueError:
        return POOL_DEFAULT_GIB * GiB, (f"{POOL_ENV}={raw!r} is not an integer: XLA ignores it and keeps the "
                                        f"{POOL_DEFAULT_GIB} GiB pool")


def machine_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _warnings(p_host: int, activation: int, state: ModelState, hbm_budget: int | None, pool: int,
              extra: list[str]) -> tuple[str, ...]:
    out = list(extra)
    if p_host > pool:
        out.append(f"host memory {fmt_bytes(p_host)} is over XLA's pinned host pool of {fmt_bytes(pool)}: "
                   f"raise {POOL_ENV} (an integer, GiB) before launch, or offload less")
    ram = machine_ram_bytes()
    if ram is not None and p_host > ram:
        out.append(f"host memory {fmt_bytes(p_host)} is over this machine's RAM ({fmt_bytes(ram)})")
    if hbm_budget is not None and activation + state.total > hbm_budget:
        out.append(f"HBM {fmt_bytes(activation + state.total)} (activations {fmt_bytes(activation)} + model "
                   f"state {fmt_bytes(state.total)}) is over the budget of {fmt_bytes(hbm_budget)}, before "
                   f"XLA's temporaries")
    return tuple(out)


def _check_positive(name: str, value, kind=int):
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or not value > 0:
        raise ValueError(f"{name} must be a positive {'number' if kind is float else 'int'}, got {value!r}")


def _target(device: str | None) -> tuple[str, bool, jax.Device]:
    """(the device kind planned for, whether it is the device present, the device present)."""
    present = jax.devices()[0]
    if device is None:
        return present.device_kind, True, present
    same = device.lower() in (present.device_kind.lower(), present.platform.lower()) or (
        present.platform != "cpu" and device.lower() in present.device_kind.lower())
    return device, same, present


def _link(device_kind: str, link_gbps: float | None, overlap) -> tuple[float | None, links.Overlap, str | None]:
    """(link GB/s, overlap per direction, where they come from): given, else measured for the device
    (zoo.plan.links). `overlap` is a fraction for both directions or a (d2h, h2d) pair."""
    m = links.measured(device_kind)
    given = None if overlap is None else links.Overlap.of(overlap)
    if link_gbps is None and m is not None:
        return m.rate_gbps, m.overlap if given is None else given, (
            f"measured on {m.device_kind} with {m.setting}, {m.date}: {m.source}")
    ov = given if given is not None else (m.overlap if m is not None else links.Overlap(0.0, 0.0))
    src = None if link_gbps is None else (
        "given" + ("" if given is not None else
                   f"; overlap {ov}: " + ("measured" if m is not None else "no overlap measured for " + device_kind)))
    return link_gbps, ov, src


def _step_rate(device_kind: str, cfg, step_tflops: float | None) -> tuple[float | None, float, str | None]:
    """(the rate recompute adds time at, the step's non-FLOP work as a fraction, where they come from) for the
    family's training step on the device: given (no overhead), else measured (zoo.plan.links.RATES)."""
    if step_tflops is not None:
        return step_tflops, 0.0, "given"
    r = links.step_rate(device_kind, cfg)
    return ((None, 0.0, None) if r is None else
            (r.tflops, r.overhead, f"measured on {r.device_kind}, {r.date}: {r.source}"))


def _peak_target(mode, compiled, *, device, mesh, amesh, shard) -> tuple[str | None, object, str]:
    """How the peak is found, decided before anything is traced: (mode: "compiled" (given), "compile", "estimate"
    or None; the mesh to compile on or to label a given compiled step with; why it is estimated). ValueError for a
    bad `peak`, or for peak="compile" where nothing here can compile the step asked for."""
    kind, same, present = _target(device)
    if compiled is not None:
        return "compiled", mesh if isinstance(mesh, jax.sharding.Mesh) else amesh, ""
    if mode is None:
        return None, None, ""
    if mode not in ("auto", "compile", "estimate"):
        raise ValueError(f"peak={mode!r}: choose 'auto', 'compile', 'estimate' or None")
    if mode == "compile" and not same:
        raise ValueError(f"peak='compile' compiles for the device present ({peak_lib.device_label(present)}), "
                         f"not for {device!r}: plan there, or take the estimate")
    concrete, why = None, ""
    if not same:
        why = f"planned for {kind} on {peak_lib.device_label(present)}"
    elif amesh is None and shard > 1:
        if mode == "compile":
            raise ValueError(f"peak='compile' with shard={shard}: a uniform split is not a program; give "
                             f"mesh='fsdp={shard}' (or another mesh) to compile the sharded step")
        why = f"shard={shard} is a uniform split: mesh= compiles the sharded step"
    elif amesh is not None:
        n = mesh_plan.devices(amesh)
        if isinstance(mesh, jax.sharding.Mesh):
            concrete = mesh
        else:
            devices = jax.devices()
            if n <= len(devices):
                concrete = sharding.make_mesh(sharding.mesh_sizes(amesh), devices[:n])
            elif mode == "compile":
                raise ValueError(f"peak='compile' under mesh {peak_lib.mesh_label(amesh)} needs {n} devices, but "
                                 f"{len(devices)} {present.platform} device(s) are present: plan on a machine with "
                                 f"{n}, or take the estimate")
            else:
                why = (f"mesh {peak_lib.mesh_label(amesh)} needs {n} devices, {len(devices)} "
                       f"{peak_lib.device_label(present)} present")
    if mode == "auto":
        mode = "compile" if not why and present.platform != "cpu" else "estimate"
    if mode == "estimate" and not why:
        why = "not compiled on the CPU: --peak compile does" if present.platform == "cpu" else "peak='estimate'"
    return mode, concrete, why


def _peak(cfg, recipe, target, compiled, *, batch, seq, shard, optimizer, opt_dtype, floor, shapes, grad_accum,
          opt_state):
    mode, mesh, why = target
    if mode is None:
        return None
    if mode == "compiled":
        return peak_lib.from_compiled(compiled, mesh=mesh)
    if mode == "compile":
        step = peak_lib.compile_step(cfg, recipe, batch=batch, seq=seq, optimizer=optimizer, opt_dtype=opt_dtype,
                                     mesh=mesh, grad_accum=grad_accum, opt_state=opt_state)
        return peak_lib.from_compiled(step, mesh=mesh)
    layer = max(sum(ceil_div(sds_nbytes(t), shard) for t in st.tags.values()) for st in shapes.values())
    return peak_lib.estimate(floor, batch=batch // grad_accum, seq=seq, shard=shard, vocab=cfg.vocab_size,
                             layer_bytes=layer,
                             why=why)


def plan(cfg, recipe: Recipe | str, *, batch: int, seq: int, shard: int = 1, optimizer: str = "adamw",
         opt_dtype: str = "float32", hbm_gib: float | None = None, host_gib: float | None = None,
         link_gbps: float | None = None, tflops: float | None = None, model_name: str | None = None,
         overlap: float | None = None, device_kind: str | None = None, peak: str | None = "auto",
         compiled=None, mesh=None, step_tflops: float | None = None, grad_accum: int = 1,
         opt_state: str = "device") -> Plan:
    """Plan `recipe` (a `zoo.Recipe`, or "auto" to choose one) for the model `cfg` (a config, or a built model,
    whose config is used) at global [batch, seq] split over `shard` devices (data parallel: `shard` must divide
    `batch`). Recipes by name are the front end's business (the application's recipe sets).

    `hbm_gib` is the HBM budget per device (warned about; required by "auto"); `host_gib` bounds host memory per
    device for "auto"; `link_gbps` (GB/s per direction) and `tflops` (TFLOP/s) feed "auto" and the step-time
    estimate. `link_gbps` and `overlap` (the fraction of transfer time hidden under compute) default to the link
    measured on the device planned for (`zoo.plan.links`; `device_kind`: a device kind such as "H200", default the
    device present); with no measurement, overlap is 0: a transfer costs its time unless proven to hide. `overlap`
    is one fraction for both directions or a (device-to-host, host-to-device) pair.

    The predicted step time (`Plan.step_time()`) runs the step's work at `step_tflops`, the executed FLOP rate
    measured for the model family on the device (`zoo.plan.links.RATES`; else `tflops`).

    Peak HBM (`Plan.peak_bytes`, `Plan.peak_source`): `peak="compile"` compiles the main job's training step
    (`zoo.train_step`, with `optimizer` and `opt_dtype`) on abstract inputs for the device present; "estimate"
    does not compile (see `zoo.plan.peak`); "auto" compiles on an accelerator that is the device planned for, and
    estimates otherwise (on the CPU, where a full-size step compiles slowly and says nothing of a GPU); None skips
    it. `compiled` is a step already compiled (the main job's; under `mesh`, sharded on it): its memory analysis
    is used as is. See the module docstring for what is counted and how.

    `mesh` (a spec "fsdp=4,tp=2", a {axis: size} dict, a Mesh or an AbstractMesh; instead of `shard`) gives
    per-device figures by the sharding rules (`zoo.plan.mesh`): model state from each variable's per-device
    shape, each tag's bytes from its per-device shape at the tag site; no devices are needed for these. The peak
    under a mesh is compiled when its devices are present (a Mesh; or a spec, dict or AbstractMesh of at most
    `jax.device_count()` devices, laid out on the first of them): the sharded step, as the main job compiles it,
    whose memory analysis is one device's ("compiled for 4 x ... (mesh fsdp=4), per device"); "auto" does so on
    an accelerator, "compile" on the CPU too (fake devices: `--xla_force_host_platform_device_count`), and raises
    a ValueError naming the mesh's device count and the devices present when there are too few. With `shard=N`
    the peak is only estimated ("compile" raises: give a mesh).

    `grad_accum` K: the step runs K micro-batches of batch / K per update (`zoo.train_step`): activations, their
    host bytes and a layer's working set are a micro-batch's, FLOPs the whole batch's, and the model state gains
    the float32 gradient sums. `opt_state="host"`: the optimizer moments live in pinned host memory between
    steps; they leave the HBM figures, count as host memory and cross the link twice per update.
    """
    if isinstance(cfg, nnx.Module) and hasattr(cfg, "config"):
        cfg = cfg.config
    if getattr(cfg, "attention_impl", None) == "cudnn":
        cfg = dataclasses.replace(cfg, attention_impl=None)
    _check_positive("batch", batch)
    _check_positive("seq", seq)
    _check_positive("shard", shard)
    amesh = None
    if mesh is not None:
        if shard != 1:
            raise ValueError(f"give shard={shard} or mesh={mesh!r}, not both (shard=N is a uniform split over N "
                             f"devices; a mesh splits by the sharding rules)")
        amesh = mesh_plan.as_abstract(mesh)
        sharding.check_mesh(cfg, amesh, batch=batch)
        shard = mesh_plan.devices(amesh)
    _check_positive("grad_accum", grad_accum)
    if batch % grad_accum:
        raise ValueError(f"grad_accum={grad_accum} must divide batch={batch} (micro-batches of batch / grad_accum)")
    if opt_state not in OPT_STATE_PLACES:
        raise ValueError(f"opt_state={opt_state!r}: choose one of {', '.join(OPT_STATE_PLACES)}")
    micro = batch // grad_accum
    if amesh is None and batch % shard:
        raise ValueError(f"batch={batch} does not split evenly over shard={shard} devices (data parallel: the "
                         f"batch must be a multiple of the device count)")
    for n, v in (("hbm_gib", hbm_gib), ("host_gib", host_gib), ("link_gbps", link_gbps), ("tflops", tflops),
                 ("step_tflops", step_tflops)):
        _check_positive(n, v, float)
    target = _peak_target(peak, compiled, device=device_kind, mesh=mesh, amesh=amesh, shard=shard)
    is_auto = isinstance(recipe, str) and recipe == "auto"
    kind, _, _ = _target(device_kind)
    link_gbps, overlap, link_source = _link(kind, link_gbps, overlap)
    if is_auto:
        missing = [n for n, v in (("hbm_gib", hbm_gib), ("link_gbps", link_gbps), ("tflops", tflops)) if v is None]
        if missing:
            raise ValueError(f"recipe 'auto' needs {', '.join(missing)} (HBM budget, link speed, FLOP rate)"
                             + ("" if link_gbps is not None else
                                f"; no link is measured for {kind!r} (zoo.plan.links: "
                                f"{', '.join(m.device_kind for m in links.MEASURED)})"))
    elif not isinstance(recipe, Recipe):
        raise ValueError(f"recipe must be a zoo.Recipe or 'auto', got {recipe!r}; a front end looks names up in the "
                         f"model family's recipe set (the application's)")
    model = abstract_model(cfg)
    step_tflops, overhead, rate_source = _step_rate(kind, cfg, step_tflops)
    model_flops = family_of(cfg).flops_per_token(cfg, model, seq) * batch * seq / shard
    if not is_auto:
        model.check_recipe(recipe)  # raises if the recipe names a tag no stack emits
    state = (_model_state(model, shard, optimizer, opt_dtype) if amesh is None
             else mesh_plan.model_state(model, amesh, optimizer, opt_dtype))
    state = _placed(state, model, grad_accum, opt_state)
    hbm_budget = None if hbm_gib is None else int(hbm_gib * GiB)
    pool, pool_warning = host_pool_bytes()
    shapes = model.tag_shapes(micro, seq)
    # FLOPs are counted on XLA's attention on every device (cuDNN's kernel is one custom call: no dots to count)
    flop_cfg = cfg
    if hasattr(cfg, "attention_impl") and resolve_impl(cfg).impl != "xla":
        flop_cfg = dataclasses.replace(cfg, attention_impl="xla")  # a second abstract model, only where cuDNN runs
    costs = {s: layer_cost(flop_cfg, s, micro, seq) for s in shapes}
    needed = {s: costs[s].residual_tags(shapes[s].tags) for s in shapes}
    # one device's part of each tag: by the sharding rules under a mesh, the batch (rows) split evenly with shard=N
    device_shapes = (sharding.tag_shard_shapes(model, micro, seq, amesh) if amesh is not None else
                     {s: {t: (ceil_div(sds.shape[0], shard),) + tuple(sds.shape[1:]) for t, sds in st.tags.items()}
                      for s, st in shapes.items()} if shard > 1 else None)
    per_device = (mesh_plan.tag_bytes(shapes, device_shapes) if amesh is not None else
                  {s: {t: ceil_div(sds_nbytes(sds), shard) for t, sds in st.tags.items()} for s, st in shapes.items()})

    notes: dict[str, str] = {}
    if is_auto:
        # recompute is priced at the step's measured rate where one is known, else at the given FLOP rate
        recipe, notes = auto.choose(shapes, needed, costs, state, shard, hbm_budget,
                                    None if host_gib is None else int(host_gib * GiB), link_gbps * 1e9,
                                    (step_tflops or tflops) * 1e12, overlap)
    policy = recipe.policy()

    stacks, extra = [], []
    for s, st in shapes.items():
        tag_plans = []
        for tag, sds in st.tags.items():
            place = recipe.placement(tag)
            residual = tag in needed[s]
            nbytes = per_device[s][tag] if residual else 0
            if tag == CARRY:
                host = nbytes if place == "offload" else 0
                device = nbytes - host
                note = notes.get(tag) or ("offloaded scan carry" if host else
                                          "scan carry: saved per layer on the device by any recipe")
                place = "offload" if host else "device"
            else:
                device = nbytes if residual and place == "device" else 0
                host = nbytes if residual and place == "offload" else 0
                note = notes.get(tag) or ("" if residual else "not a residual: the backward pass never needs it")
            split = None if device_shapes is None else tuple(device_shapes[s].get(tag, sds.shape))
            tag_plans.append(TagPlan(tag, tuple(sds.shape), jnp.dtype(sds.dtype).name, place, residual, nbytes,
                                     device, host, note, split))
        # JAX's own account of the stack: anything beyond the tags, and a check of the tags.
        jax_device, jax_host, hoisted = stack_residuals(model, s, micro, seq, policy)
        tag_device = sum(sds_nbytes(st.tags[t]) for t in st.tags if t in needed[s] and (
            recipe.placement(t) == "device" or (t == CARRY and recipe.placement(t) != "offload")))
        tag_host = sum(sds_nbytes(st.tags[t]) for t in st.tags if t in needed[s] and recipe.placement(t) == "offload")
        untagged = jax_device - st.num_layers * tag_device
        if untagged < 0 or jax_host != st.num_layers * tag_host:
            extra.append(f"stack {s}: JAX saves {fmt_bytes(jax_device)} on the device and {fmt_bytes(jax_host)} "
                         f"on the host, the tags account for {fmt_bytes(st.num_layers * tag_device)} and "
                         f"{fmt_bytes(st.num_layers * tag_host)}: the plan is off for this recipe")
        stacks.append(StackPlan(
            name=s, num_layers=st.num_layers, tags=tuple(tag_plans),
            untagged_bytes=ceil_div(max(untagged, 0) // st.num_layers, shard),
            invariant_bytes=ceil_div(hoisted, shard),
            forward_flops=ceil_div(grad_accum * costs[s].forward_flops, shard),
            remat_flops=ceil_div(grad_accum * costs[s].recipe_flops(recipe, st.tags), shard)))
    activation = sum(sp.device_bytes for sp in stacks)
    host = sum(sp.host_bytes for sp in stacks)
    extra += [pool_warning] if pool_warning else []
    if recipe.special == "none":
        extra.append("recipe 'none' keeps every intermediate JAX saves, untagged ones included (attention "
                     "probabilities on the XLA path): counted from JAX's own list of residuals")
    pk = _peak(cfg, recipe, target, compiled, batch=batch, seq=seq, shard=shard, optimizer=optimizer,
               opt_dtype=opt_dtype, floor=activation + state.total, shapes=shapes, grad_accum=grad_accum,
               opt_state=opt_state)
    if pk is not None and hbm_budget is not None and pk.bytes > hbm_budget:
        extra.append(f"peak HBM {fmt_bytes(pk.bytes)} ({pk.source}) is over the budget of {fmt_bytes(hbm_budget)}")
    return Plan(model=model_name or type(cfg).__name__, recipe=recipe, batch=batch, seq=seq, shard=shard,
                mesh=None if amesh is None else sharding.format_mesh(sharding.mesh_sizes(amesh)),
                stacks=tuple(stacks), state=state, hbm_budget=hbm_budget, host_pool=pool,
                warnings=_warnings(host + state.host, activation, state, hbm_budget, pool, extra), link_gbps=link_gbps,
                tflops=tflops, overlap=overlap, link_source=link_source, peak=pk, model_flops=model_flops,
                step_tflops=step_tflops, step_overhead=overhead, step_rate_source=rate_source, grad_accum=grad_accum)


def auto_recipe(cfg, *, batch: int, seq: int, hbm_gib: float, link_gbps: float, tflops: float, **kwargs) -> Recipe:
    """The recipe `plan(cfg, "auto", ...)` chooses."""
    return plan(cfg, "auto", batch=batch, seq=seq, hbm_gib=hbm_gib, link_gbps=link_gbps, tflops=tflops,
                **kwargs).recipe
