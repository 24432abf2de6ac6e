"""The memory planner: what a recipe keeps in HBM, puts in host memory and recomputes, before launch.

``zoo.plan.plan(cfg, recipe, batch=, seq=)`` builds the model abstractly (no memory), reads each stack's tags and their
shapes off the layers (``model.tag_shapes``) and returns a :class:`Plan`: per stack and tag its bytes and placement,
what JAX saves beside the tags, the recompute FLOPs, the model state and the peak. What is counted and how:
docs/internals.md, "What a plan counts".
"""
from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from flax import nnx

from zoo import sharding
from zoo.layers.attention_kernel import resolve_impl
from zoo.layers.tiles import check_tiles
from zoo.loss import resolve_chunk
from zoo.models.registry import family_of
from zoo.opt_state import check_params
from zoo.plan import auto, links
from zoo.plan import mesh as mesh_plan
from zoo.plan import state as state_lib
from zoo.plan.inputs import Hardware, Parallelism, Training, check_positive
from zoo.plan.measure import abstract_model, layer_cost, stack_residuals, working_bytes
from zoo.plan.measure import nbytes as sds_nbytes
from zoo.plan.peak import chunk_to_fit, loss_bytes
from zoo.plan.target import device_target, find_peak, link_of, peak_target, step_rate_of
from zoo.plan.types import CARRY, GiB, ModelState, Plan, StackPlan, TagPlan, ceil_div, fmt_bytes
from zoo.recipe import Recipe
from zoo.tags import LEAD, role_name
from zoo.training import STEP

NO_HARDWARE, ONE_DEVICE = Hardware(), Parallelism()


def plan(cfg, recipe: Recipe | str, *, batch: int, seq: int, hardware: Hardware = NO_HARDWARE,
         parallel: Parallelism = ONE_DEVICE, training: Training = STEP, peak: str | None = "auto", compiled=None,
         model_name: str | None = None) -> Plan:
    """What a recipe costs before launch: for each tag of each stack, its bytes per layer and where they live (HBM,
    pinned host memory, or recomputed), the model state, the recompute FLOPs, the peak HBM of the step and its
    predicted time. The byte counts are read off the layers (their tags' shapes) and checked against JAX's own list of
    residuals. What is counted, and how: docs/internals.md, "What a plan counts".

    Args:
        cfg: the model's config (a family's frozen config dataclass), or a built model (its config is read).
        recipe: a `zoo.Recipe`, or "auto" to choose the tags' placements, the sequence tiles and the layer groups for
            `hardware` (it needs `hbm_gib`, a link and a FLOP rate).
        batch: the global batch (sequences per step).
        seq: the sequence length.
        hardware: the device planned for (`zoo.plan.Hardware`: its kind, HBM and host budgets, link and FLOP rate).
        parallel: how the step is split over devices (`zoo.plan.Parallelism`: a mesh, or `shard=N` even splits).
        training: the step (`zoo.plan.Training`: optimizer, where its state lives, micro-batches, loss chunks).
        peak: "compile" compiles the step for the device present, "estimate" estimates it, "auto" compiles where the
            device present is the one planned for, None leaves the peak out.
        compiled: a training step already compiled, whose memory analysis is read as it is.
        model_name: the model's name in the plan's header.

    Returns:
        A `zoo.plan.Plan` (`zoo.plan.render` prints it; `.to_dict()` is its JSON).

    Raises:
        ValueError: a recipe naming a tag the model does not emit, a group that does not divide a stack, a sequence
            beyond the model's context, a batch or mesh that does not split, "auto" without its budgets.

    Examples:
        >>> import zoo
        >>> cfg = zoo.models.LlamaConfig.preset("tiny")
        >>> p = zoo.plan.plan(cfg, zoo.Recipe("qkv", offload=("query_proj", "key_proj", "value_proj")),
        ...                   batch=2, seq=64, peak=None)
        >>> [t.tag for t in p.stacks[0].tags if t.placement == "offload"]
        ['query_proj', 'key_proj', 'value_proj']
        >>> p.host_bytes == 2 * (2 * 64 * 4 * 16 + 2 * 2 * 64 * 2 * 16) * 4
        True
    """
    if isinstance(cfg, nnx.Module) and hasattr(cfg, "config"):
        cfg = cfg.config
    kernel = getattr(cfg, "attention_impl", None)
    if kernel in links.GPU_KERNELS:   # planned from shapes: the abstract model needs no GPU
        cfg = dataclasses.replace(cfg, attention_impl=None)
    amesh, shard = _split(cfg, batch, seq, parallel, training)
    check_params(training.params, getattr(cfg, "param_dtype", None))   # a bad cfg is refused below, by name
    micro = batch // training.grad_accum
    target = peak_target(peak, compiled, device=hardware.device_kind, mesh=parallel.mesh, amesh=amesh, shard=shard)
    kind, here, present = device_target(hardware.device_kind)
    if kernel is None and hasattr(cfg, "attention_impl") and here and present.platform == "gpu":
        # attention at the rate of the kernel auto takes on this GPU
        kernel = resolve_impl(cfg, present).impl
    # this machine's RAM bounds the pinned host memory of its own accelerator (not another machine's; the CPU has none)
    ram = state_lib.machine_ram_bytes() if here and present.platform != "cpu" else None
    link_gbps, overlap, link_source = link_of(kind, hardware.link_gbps, hardware.overlap)
    is_auto = _check_recipe(recipe, hardware, link_gbps, kind)
    model = abstract_model(cfg)
    step_tflops, overhead, rate_source = step_rate_of(kind, cfg, hardware.step_tflops)
    att = links.attention_rate(kind, kernel if kernel in links.GPU_KERNELS else "cudnn") \
        if hardware.step_tflops is None else None
    model_flops = family_of(cfg).flops_per_token(cfg, model, seq) * batch * seq / shard
    if not is_auto:
        model.check_recipe(recipe)  # raises if the recipe names a tag no stack emits
    state = _model_state(model, amesh, shard, training)
    hbm_budget = None if hardware.hbm_gib is None else int(hardware.hbm_gib * GiB)
    pool, pool_warning = state_lib.host_pool_bytes()

    notes: dict[str, str] = {}
    host_full = False   # auto left a tag out of host memory that would have paid to offload
    if is_auto:
        # recompute is priced at the step's measured rate where one is known, else at the given FLOP rate
        host_budget = state_lib.host_budget(hardware.host_gib, pool, ram) - state.host
        choice, notes = auto.choose_structure(
            lambda tiles, group, keep, subgroup: layout(cfg, micro, seq, amesh, shard, tiles, group, keep, subgroup),
            candidates=auto.structures(model, seq), state=state, shard=shard, hbm_budget=hbm_budget,
            host_budget=host_budget, link=link_gbps * 1e9, rate=(step_tflops or hardware.tflops) * 1e12,
            overlap=overlap, reserve=lambda lay, r: loss_reserve(cfg, training, micro, seq, shard) + lay.working(r))
        recipe, host_full = choice.recipe, choice.host_full
    lay = layout(cfg, micro, seq, amesh, shard, recipe.seq_tiles, recipe.group, recipe.resolve().group_keep,
                 recipe.subgroup)
    state = state.in_groups(recipe.group)
    shapes = lay.shapes
    stacks, extra = [], []
    for s, st in shapes.items():
        stack, check = _stack_plan(model, s, st, recipe, lay, notes, micro=micro, seq=seq, shard=shard,
                                   grad_accum=training.grad_accum)
        stacks.append(stack)
        extra += check
    activation = sum(sp.device_bytes for sp in stacks)
    host = sum(sp.host_bytes for sp in stacks)
    extra += [pool_warning] if pool_warning else []
    if host_full:
        extra += state_lib.pool_bound(hardware.host_gib, pool, ram, state.host)
    if recipe.special == "none":
        extra.append("recipe 'none' keeps every intermediate JAX saves, untagged ones included (attention "
                     "probabilities on the XLA path): counted from JAX's own list of residuals")
    if (isinstance(training.loss_chunk, str) and training.loss_chunk == "auto" and hbm_budget is not None
            and compiled is None):
        # the whole sequence where the step is expected to fit that way, else the fewest chunks expected to fit
        rows = ceil_div(micro, shard)
        whole = activation + state.total + lay.working(recipe) + loss_bytes(cfg, None, rows, seq, shard)
        chunk = None if whole <= hbm_budget else chunk_to_fit(cfg, peak=whole, limit=hbm_budget, chunk=None,
                                                              rows=rows, seq=seq, shard=shard)
        training = dataclasses.replace(training, loss_chunk=chunk)
    pk = find_peak(cfg, recipe, target, compiled, training, batch=batch, seq=seq, shard=shard,
                   floor=activation + state.total, working=lay.working(recipe))
    if pk is not None and hbm_budget is not None and pk.bytes > hbm_budget:
        extra.append(f"peak HBM {fmt_bytes(pk.bytes)} ({pk.source}) is over the budget of {fmt_bytes(hbm_budget)}")
    return Plan(model=model_name or type(cfg).__name__, recipe=recipe, batch=batch, seq=seq, shard=shard,
                mesh=None if amesh is None else sharding.format_mesh(sharding.mesh_sizes(amesh)),
                stacks=tuple(stacks), state=state, hbm_budget=hbm_budget, host_pool=pool,
                warnings=state_lib.warnings(host + state.host, activation, state, hbm_budget, pool, extra, ram),
                link_gbps=link_gbps, tflops=hardware.tflops, overlap=overlap, link_source=link_source, peak=pk,
                model_flops=model_flops, step_tflops=step_tflops, step_overhead=overhead,
                attention_tflops=None if att is None else att.tflops_at(seq),
                attention_forward_tflops=None if att is None else att.forward_tflops,
                attention_kernel=None if att is None else att.kernel,
                step_rate_source=rate_source, grad_accum=training.grad_accum,
                loss_chunk=resolve_chunk(training.loss_chunk, ceil_div(micro, shard), seq, cfg.vocab_size))


def model_state(cfg, *, training: Training = STEP, parallel: Parallelism = ONE_DEVICE) -> ModelState:
    """The model state per device that `plan` counts (parameters, gradients, the optimizer's moments, gradient sums
    and a master copy, where `training` puts them), from shapes alone: under `parallel.mesh` by the sharding rules,
    else split evenly over `parallel.shard` devices.

    Args:
        cfg: the model's config.
        training: the step (`zoo.plan.Training`): the optimizer, its moments' dtype and place, the parameters' place.
        parallel: how the state is split (`zoo.plan.Parallelism`).

    Returns:
        A `zoo.plan.ModelState` (bytes per device).

    Examples:
        >>> import zoo
        >>> s = zoo.plan.model_state(zoo.models.LlamaConfig.preset("tiny"))
        >>> s.params == s.grads == 4 * s.num_params, s.optimizer == 2 * s.params
        (True, True)
    """
    amesh = None if parallel.mesh is None else mesh_plan.as_abstract(parallel.mesh)
    shard = parallel.shard if amesh is None else mesh_plan.devices(amesh)
    return _model_state(abstract_model(cfg), amesh, shard, training)


def _model_state(model, amesh, shard: int, training: Training) -> ModelState:
    state = (state_lib.model_state(model, shard, training.optimizer, training.opt_dtype) if amesh is None
             else mesh_plan.model_state(model, amesh, training.optimizer, training.opt_dtype))
    return state_lib.placed(state, model, training.grad_accum, training.opt_state, training.params)


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the planner reads off the layers for one structure (sequence tiles, layers per group): each stack's tags
    and their shapes, the recompute costs (per layer), the tags the backward pass needs, each tag's per-device shape
    and bytes, and each stack's group."""
    model: object
    micro: int
    seq: int
    shard: int
    tiles: int
    shapes: dict
    costs: dict
    needed: dict
    device_shapes: dict | None
    per_device: dict
    groups: dict
    memo: dict = dataclasses.field(default_factory=dict, compare=False)

    def working(self, recipe: Recipe) -> int:
        """Per device: the most one group's backward pass holds beyond the plan's saved bytes (`measure.working_bytes`,
        the largest over the stacks)."""
        key = (recipe.offload, recipe.device, recipe.special, recipe.group_keep, recipe.subgroup, recipe.lead_device,
               recipe.lead_offload)
        if key not in self.memo:
            self.memo[key] = max(ceil_div(working_bytes(self.model, s, self.micro, self.seq, recipe, self.groups[s]),
                                          self.shard) for s in self.shapes)
        return self.memo[key]


@functools.lru_cache(maxsize=32)
def layout(cfg, micro: int, seq: int, amesh, shard: int, tiles: int, group: int, keep: tuple[str, ...] = (),
           subgroup: int = 1) -> Layout:
    """The `Layout` of the model of `cfg` at [micro, seq] for `tiles` sequence tiles and `group` layers per group (a
    main stack's; an extra head's layers run one at a time) in subgroups of `subgroup`, each layer of a group keeping
    the tags `keep` while the group's backward runs. Cached: auto and a run's fitting ask it again."""
    check_tiles(tiles, seq)
    model = abstract_model(cfg)
    shapes = model.tag_shapes(micro, seq, tiles=tiles)
    groups = {s: model.stack_group(s, group) for s in shapes}
    # attention's FLOPs are counted from its shapes whatever kernel runs (zoo.plan.measure.LayerCost)
    costs = {s: layer_cost(cfg, s, micro, seq, groups[s], tiles, frozenset(keep) if groups[s] > 1 else frozenset(),
                           subgroup if groups[s] > 1 else 1)
             for s in shapes}
    needed = {s: costs[s].residual_tags(shapes[s].tags) for s in shapes}
    device_shapes, per_device = _per_device(model, shapes, micro, seq, amesh, shard)
    return Layout(model, micro, seq, shard, tiles, shapes, costs, needed, device_shapes, per_device, groups)


def loss_reserve(cfg, training: Training, micro: int, seq: int, shard: int) -> int:
    """Per device: the loss's float32 logits and gradient at the step's chunk (`zoo.plan.peak.loss_bytes`)."""
    return loss_bytes(cfg, training.loss_chunk, ceil_div(micro, shard), seq, shard)


def _per_device(model, shapes, micro: int, seq: int, amesh, shard: int):
    """(each tag's per-device shape or None on one device, each tag's per-device bytes): one device's part of each
    tag by the sharding rules under a mesh, the batch (rows) split evenly with shard=N."""
    device_shapes = (sharding.tag_shard_shapes(model, micro, seq, amesh) if amesh is not None else
                     {s: {t: (ceil_div(sds.shape[0], shard),) + tuple(sds.shape[1:]) for t, sds in st.tags.items()}
                      for s, st in shapes.items()} if shard > 1 else None)
    per_device = (mesh_plan.tag_bytes(shapes, device_shapes) if amesh is not None else
                  {s: {t: ceil_div(sds_nbytes(sds), shard) for t, sds in st.tags.items()} for s, st in shapes.items()})
    return device_shapes, per_device


def _split(cfg, batch: int, seq: int, parallel: Parallelism, training: Training):
    """(the abstract mesh or None, the device count): the shape checked against the split and the micro-batches."""
    check_positive("batch", batch)
    check_positive("seq", seq)
    if hasattr(cfg, "check_seq"):
        cfg.check_seq(seq)
    shard, amesh = parallel.shard, None
    if parallel.mesh is not None:
        amesh = mesh_plan.as_abstract(parallel.mesh)
        sharding.check_mesh(cfg, amesh, batch=batch)
        shard = mesh_plan.devices(amesh)
    if batch % training.grad_accum:
        raise ValueError(f"grad_accum={training.grad_accum} must divide batch={batch} (micro-batches of batch / "
                         f"grad_accum)")
    if amesh is None and batch % shard:
        raise ValueError(f"batch={batch} does not split evenly over shard={shard} devices (data parallel: the "
                         f"batch must be a multiple of the device count)")
    return amesh, shard


def _check_recipe(recipe, hardware: Hardware, link_gbps: float | None, kind: str) -> bool:
    """Whether `recipe` is "auto" (then with what it needs: a budget, a link, a rate); else it must be a Recipe."""
    if isinstance(recipe, str) and recipe == "auto":
        missing = [n for n, v in (("hbm_gib", hardware.hbm_gib), ("link_gbps", link_gbps),
                                  ("tflops", hardware.tflops)) if v is None]
        if missing:
            raise ValueError(f"recipe 'auto' needs {', '.join(missing)} (HBM budget, link speed, FLOP rate)"
                             + ("" if link_gbps is not None else
                                f"; no link is measured for {kind!r} (zoo.plan.links: "
                                f"{', '.join(m.device_kind for m in links.MEASURED)})"))
        return True
    if not isinstance(recipe, Recipe):
        raise ValueError(f"recipe must be a zoo.Recipe or 'auto', got {recipe!r}; a front end looks names up in the "
                         f"model family's recipe set (the application's)")
    return False


def _stack_plan(model, s: str, st, recipe: Recipe, lay: Layout, notes: dict, *, micro: int, seq: int, shard: int,
                grad_accum: int):
    """(one stack's plan, warnings): each tag's bytes where the recipe puts them, and JAX's own account of what
    the stack saves checked against the tags (anything beyond them is "untagged", values hoisted out of the scan
    "invariant"). With `group` k the scan carry is saved once per group: 1/k of its bytes per layer."""
    needed, cost, per_device, group = lay.needed[s], lay.costs[s], lay.per_device[s], lay.groups[s]
    device_shapes = None if lay.device_shapes is None else lay.device_shapes[s]
    tag_plans = []
    for tag, sds in st.tags.items():
        place = recipe.placement(tag)
        residual = tag in needed
        nbytes = per_device[tag] if residual else 0
        if tag == CARRY:
            nbytes = ceil_div(nbytes, group)
            host = nbytes if place == "offload" else 0
            device = nbytes - host
            every = f" every {group} layers" if group > 1 else " per layer"
            note = notes.get(tag) or (f"offloaded scan carry (saved{every})" if host else
                                      f"scan carry: saved{every} on the device by any recipe")
            place = "offload" if host else "device"
        else:
            device = nbytes if residual and place == "device" else 0
            host = nbytes if residual and place == "offload" else 0
            note = notes.get(tag) or ("" if residual else
                                      "recomputed tile by tile" if tag in st.tiled and place == "remat" else
                                      "not a residual: the backward pass never needs it")
        split = None if device_shapes is None else tuple(device_shapes.get(tag, sds.shape))
        tag_plans.append(TagPlan(tag, tuple(sds.shape), jnp.dtype(sds.dtype).name, place, residual, nbytes,
                                 device, host, note, split))
    lead = _lead_places(recipe, group)
    for tag, place in lead.items():   # the first layer of each group's: 1/k of its bytes per layer
        sds = st.tags[tag]
        nbytes = ceil_div(per_device[tag], group)
        split = None if device_shapes is None else tuple(device_shapes.get(tag, sds.shape))
        tag_plans.append(TagPlan(role_name(tag, LEAD), tuple(sds.shape), jnp.dtype(sds.dtype).name, place, True,
                                 nbytes, nbytes if place == "device" else 0, nbytes if place == "offload" else 0,
                                 notes.get(role_name(tag, LEAD)) or f"the first layer of each group's (1 in {group} "
                                 f"layers), {'in HBM' if place == 'device' else 'offloaded'} between the passes",
                                 split))
    carry = "offload" if recipe.placement(CARRY) == "offload" else "device"   # any recipe saves the carry
    jax_device, jax_host, hoisted = stack_residuals(model, s, micro, seq, recipe.policy(), group=group,
                                                    tiles=lay.tiles, layer_policy=recipe.layer_policy(), carry=carry,
                                                    subgroup=recipe.subgroup if group > 1 else 1,
                                                    lead_policy=recipe.lead_policy() if group > 1 else None)

    def share(t):   # the bytes per layer of tag t as JAX saves it: the carry once per group
        return sds_nbytes(st.tags[t]) // (group if t == CARRY else 1)
    tag_device = sum(share(t) for t in st.tags if t in needed and (
        recipe.placement(t) == "device" or (t == CARRY and recipe.placement(t) != "offload")))
    tag_host = sum(share(t) for t in st.tags if t in needed and recipe.placement(t) == "offload")
    tag_device += sum(sds_nbytes(st.tags[t]) // group for t, place in lead.items() if place == "device")
    tag_host += sum(sds_nbytes(st.tags[t]) // group for t, place in lead.items() if place == "offload")
    untagged = jax_device - st.num_layers * tag_device
    warnings = []
    if untagged < 0 or jax_host != st.num_layers * tag_host:
        warnings.append(f"stack {s}: JAX saves {fmt_bytes(jax_device)} on the device and {fmt_bytes(jax_host)} "
                        f"on the host, the tags account for {fmt_bytes(st.num_layers * tag_device)} and "
                        f"{fmt_bytes(st.num_layers * tag_host)}: the plan is off for this recipe")
    stack = StackPlan(name=s, num_layers=st.num_layers, tags=tuple(tag_plans),
                      untagged_bytes=ceil_div(max(untagged, 0) // st.num_layers, shard),
                      invariant_bytes=ceil_div(hoisted, shard),
                      forward_flops=ceil_div(grad_accum * cost.forward_flops, shard),
                      remat_flops=ceil_div(grad_accum * cost.recipe_flops(recipe, st.tags), shard),
                      attention_flops=ceil_div(grad_accum * cost.attention_flops, shard),
                      remat_attention_flops=ceil_div(grad_accum * cost.recipe_attention_flops(recipe, st.tags),
                                                     shard))
    return stack, warnings


def _lead_places(recipe: Recipe, group: int) -> dict[str, str]:
    """{tag: "device" or "offload"}: what the first layer of each group of `group` layers keeps between the passes
    ({} for a stack whose layers run one at a time)."""
    if group == 1:
        return {}
    r = recipe.resolve()
    return {**{t: "device" for t in r.lead_device}, **{t: "offload" for t in r.lead_offload}}


def auto_recipe(cfg, *, batch: int, seq: int, hardware: Hardware, **kwargs) -> Recipe:
    """The recipe `plan(cfg, "auto", ...)` chooses: each tag's placement, the sequence tiles and the layer groups
    whose recompute and exposed copies cost least within the HBM and host budgets of `hardware`.

    Args:
        cfg: the model's config.
        batch: the global batch.
        seq: the sequence length.
        hardware: the device, with `hbm_gib` and a FLOP rate (`tflops`); the link is the measured one of a known
            device kind, or `link_gbps`.
        **kwargs: what `plan` takes beside (`parallel`, `training`, `peak`).

    Returns:
        A `zoo.Recipe` named "auto".

    Examples:
        >>> import zoo
        >>> cfg = zoo.models.LlamaConfig.preset("tiny")
        >>> r = zoo.plan.auto_recipe(cfg, batch=2, seq=64, peak=None,
        ...                          hardware=zoo.plan.Hardware(device_kind="H200", hbm_gib=80, tflops=760))
        >>> r.name, r.group
        ('auto', 1)
    """
    return plan(cfg, "auto", batch=batch, seq=seq, hardware=hardware, **kwargs).recipe
