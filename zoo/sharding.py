"""Sharding: the mesh (axes dp, fsdp, tp, ep), the logical-axis rules, parameters created sharded, and the activation
constraint every tag site applies.

Parameters and tagged activations carry logical axis names; `rules_for(mesh)` maps them to the mesh's axes (`RULES`;
docs/internals.md, "Sharding").

    mesh = zoo.sharding.make_mesh("fsdp=4,tp=2")
    zoo.sharding.check_mesh(cfg, mesh, batch=8)           # ValueError before compiling
    model = zoo.sharding.create(zoo.models.registry.family_of(cfg).build, cfg, recipe=r, mesh=mesh, seed=0)
    with zoo.sharding.use(mesh):                           # jax.set_mesh + nnx.logical_axis_rules
        step = jax.jit(...)                                # traced inside: the activation constraints see the rules
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from zoo.checks import check_positive
from zoo.emitted import join_chunks
from zoo.jaxprs import sub_jaxprs
from zoo.logical import active, constrain, mesh_axes, mesh_spec, size_of  # noqa: F401  what the tag sites apply
from zoo.names import did_you_mean

AXES: tuple[str, ...] = ("dp", "fsdp", "tp", "ep")
MESH_ORDER: tuple[str, ...] = ("dp", "fsdp", "ep", "tp")   # device order: tp innermost (fastest links)

# Activation axes used at the tag sites (logical names; see zoo.layers).
BSD = ("batch", "seq", "embed")
BSH = ("batch", "seq", "heads", "head_dim")
BSK = ("batch", "seq", "kv_heads", "head_dim")
BSF = ("batch", "seq", "mlp")

# Logical names: parameters (layers .. kv_lora) and activations (batch, seq, exp_batch; plus the shared ones).
LOGICAL: tuple[str, ...] = ("layers", "embed", "heads", "kv_heads", "head_dim", "mlp", "moe_mlp", "vocab",
                            "experts", "q_lora", "kv_lora", "batch", "seq", "exp_batch")

# One rule set per parallelism. Order is priority (flax's rules): the batch rules come first, so that an
# activation's `embed` never takes the fsdp axis its batch already uses.
RULES: dict[str, tuple[tuple[str, Any], ...]] = {
    "dp": (("batch", "dp"), ("exp_batch", "dp")),
    "fsdp": (("batch", "fsdp"), ("exp_batch", "fsdp"), ("embed", "fsdp")),
    "tp": (("heads", "tp"), ("kv_heads", "tp"), ("mlp", "tp"), ("moe_mlp", "tp"), ("vocab", "tp")),
    # ep splits the batch too; on the expert side of the dispatch (`exp_batch`) the groups stay on dp x fsdp.
    "ep": (("batch", "ep"), ("experts", "ep")),
}


def in_host_memory(x) -> bool:
    """Whether an array lives in host memory (pinned or not).

    Args:
        x: an array or a tracer.

    Returns:
        True for host memory, False for the device's.
    """
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def to_hbm(tree):
    """Copy the arrays of a tree that live in host memory into HBM.

    Under jit each is one host-to-device copy (`jax.device_put` to the device memory space), whose transpose sends
    the gradient back to the host.

    Args:
        tree: a pytree of arrays.

    Returns:
        `tree` with those arrays in HBM and the other leaves as they are.
    """
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if in_host_memory(x) else x, tree)


def parse_mesh(spec: str | Mapping[str, int] | None, num_devices: int) -> dict[str, int]:
    """"fsdp=2,tp=1,ep=1" or {"fsdp": 2, ...} -> {axis: size} over all of AXES (missing axes are 1; None: every
    device on fsdp). ValueError for an unknown axis, a bad size, or a product other than `num_devices`."""
    if spec is None or spec == "":
        sizes = {"fsdp": num_devices}
    elif isinstance(spec, str):
        sizes = {}
        for part in spec.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or not value.strip().lstrip("-").isdigit():
                raise ValueError(f"mesh {spec!r}: expected axis=size pairs like 'fsdp=2,tp=1', got {part!r}")
            if key.strip() in sizes:
                raise ValueError(f"mesh {spec!r}: axis {key.strip()!r} given twice")
            sizes[key.strip()] = int(value)
    elif isinstance(spec, Mapping):
        sizes = dict(spec)
    else:
        raise ValueError(f"mesh must be a string like 'fsdp=2,tp=1' or a dict, got {type(spec).__name__}")
    unknown = sorted(set(sizes) - set(AXES))
    if unknown:
        raise ValueError(f"mesh: unknown axis {unknown[0]!r}{did_you_mean(unknown[0], AXES)}; the axes are "
                         f"{', '.join(AXES)}")
    for axis, size in sizes.items():
        check_positive(f"mesh: {axis}", size, optional=False)
    sizes = {a: int(sizes.get(a, 1)) for a in AXES}
    product = math.prod(sizes.values())
    if product != num_devices:
        raise ValueError(f"mesh {format_mesh(sizes)}: the product of the axes is {product}, but there are "
                         f"{num_devices} devices")
    return sizes


def format_mesh(sizes: Mapping[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in AXES if a in sizes)


def make_mesh(spec: str | Mapping[str, int] | None = None, devices: Sequence[Any] | None = None) -> jax.sharding.Mesh:
    """A mesh over `devices` (default: all) with the four axes (size 1 where not given), Auto axis types."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = parse_mesh(spec, len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_ORDER)
    return jax.make_mesh(tuple(sizes[a] for a in MESH_ORDER), MESH_ORDER, axis_types=auto, devices=devices)


def abstract_mesh(spec: str | Mapping[str, int] | None, num_devices: int) -> jax.sharding.AbstractMesh:
    """The mesh of `make_mesh(spec)` over `num_devices` devices, without devices (for planning and tracing)."""
    sizes = parse_mesh(spec, num_devices)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_ORDER)
    return jax.sharding.AbstractMesh(tuple(sizes[a] for a in MESH_ORDER), MESH_ORDER, axis_types=auto)


def mesh_sizes(mesh) -> dict[str, int]:
    """{axis: size} for the four axes (1 for an axis the mesh lacks)."""
    shape = dict(mesh.shape) if mesh is not None and not mesh.empty else {}
    return {a: int(shape.get(a, 1)) for a in AXES}


def rules_for(mesh) -> tuple[tuple[str, Any], ...]:
    """The rule set for `mesh`: the sets of its axes of size > 1 merged (a logical name gets the tuple of its mesh
    axes, in MESH_ORDER), then every other logical name replicated. A mesh of one device: all replicated."""
    sizes = mesh_sizes(mesh)
    merged: dict[str, list[str]] = {}
    for axis in MESH_ORDER:
        if sizes[axis] > 1:
            for logical, mesh_axis in RULES[axis]:
                merged.setdefault(logical, []).append(mesh_axis)
    out = [(n, axes[0] if len(axes) == 1 else tuple(axes)) for n, axes in merged.items()]
    return tuple(out) + tuple((n, None) for n in LOGICAL if n not in merged)


# -- the context ---------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def use(mesh, rules: Iterable[tuple[str, Any]] | None = None):
    """Activate `mesh` (`jax.set_mesh`; an AbstractMesh for tracing without devices) and its logical-axis rules
    (`nnx.logical_axis_rules`; default `rules_for(mesh)`). Trace (first call) jitted steps inside it: the activation
    constraints read both then."""
    rules = tuple(rules) if rules is not None else rules_for(mesh)
    mesh_context = (jax.sharding.use_abstract_mesh(mesh) if isinstance(mesh, jax.sharding.AbstractMesh)
                    else jax.set_mesh(mesh))
    with mesh_context, nnx.logical_axis_rules(rules):
        yield


# -- parameters ----------------------------------------------------------------------------------------------------
def logical_specs(tree):
    """Logical PartitionSpecs (the `out_sharding` names) of a state, read with no rules active."""
    with nnx.logical_axis_rules(()):
        return nnx.get_partition_spec(tree)


def shardings(tree, mesh, rules: Iterable[tuple[str, Any]] | None = None):
    """NamedShardings for every variable of an nnx state (parameters, routing biases, optimizer state): each
    logical axis mapped by `rules` (default `rules_for(mesh)`) with `mesh_spec`."""
    rules = tuple(rules) if rules is not None else rules_for(mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, mesh_spec(spec, rules)), logical_specs(tree),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def check_divisible(state, mesh, rules: Iterable[tuple[str, Any]] | None = None) -> None:
    """ValueError naming the variable, its dimension and the mesh axes when a sharded dimension does not divide."""
    rules = tuple(rules) if rules is not None else rules_for(mesh)
    sizes = dict(mesh.shape)
    specs = dict(nnx.to_flat_state(logical_specs(state)))
    for path, var in nnx.to_flat_state(state):
        logical = specs[path].get_value() if isinstance(specs[path], nnx.Variable) else specs[path]
        spec = mesh_spec(logical, rules) if logical else PartitionSpec()
        for dim, (size, axes) in enumerate(zip(var.shape, spec)):
            axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            shards = math.prod(sizes[a] for a in axes)
            if size % shards:
                raise ValueError(f"mesh: {'.'.join(map(str, path))} dimension {dim} ({logical[dim]}) has size {size}, "
                                 f"which {'x'.join(axes)}={shards} does not divide")


def init(make: Callable[[], Any], mesh=None, rules: Iterable[tuple[str, Any]] | None = None,
         place: Callable[[Any, Any], Any] | None = None):
    """`make()` (a model, or `(model, optimizer)`) with every variable created on its sharding: an abstract init, then
    one jitted init onto the rules' shardings, so no device holds a full copy of a sharded variable; values are
    `make()`'s. `place(abstract state, shardings)` may move variables to another memory
    (`zoo.opt_state.state_shardings`). `mesh` defaults to the active one; without any, `make()`."""
    mesh = mesh if mesh is not None else jax.sharding.get_mesh()
    if mesh is None or mesh.empty:
        return make()
    rules = tuple(rules) if rules is not None else rules_for(mesh)
    # Logical names are not mesh axes: build the abstract model with no mesh active (nnx.eval_shape would read
    # them as mesh axes), then map them with the rules.
    no_mesh = jax.sharding.AbstractMesh((), ())
    with jax.sharding.use_abstract_mesh(no_mesh):
        abstract = nnx.eval_shape(make)
    graphdef, state = nnx.split(abstract)
    check_divisible(state, mesh, rules)
    out = shardings(state, mesh, rules)
    if place is not None:
        out = place(state, out)
    with jax.sharding.use_abstract_mesh(no_mesh):
        state = jax.jit(lambda: nnx.state(make()), out_shardings=out)()
    return nnx.merge(graphdef, state)


def create(build: Callable[..., nnx.Module], cfg, *, recipe=None, mesh=None,
           rules: Iterable[tuple[str, Any]] | None = None, seed: int = 0) -> nnx.Module:
    """`build(cfg, recipe=recipe, rngs=nnx.Rngs(seed))` created sharded (`init`), after `check_mesh(cfg, mesh)`."""
    mesh = mesh if mesh is not None else jax.sharding.get_mesh()
    if mesh is not None and not mesh.empty:
        check_mesh(cfg, mesh)
    return init(lambda: build(cfg, recipe=recipe, rngs=nnx.Rngs(seed)), mesh, rules)


def shard_shape(shape: Sequence[int], axes: Sequence[str | None], mesh,
                rules: Iterable[tuple[str, Any]] | None = None) -> tuple[int, ...]:
    """Per-device shape of a [shape] array with logical `axes` under `mesh` (a Mesh or an AbstractMesh) and
    `rules`: what the planner divides by (`--mesh`)."""
    rules = tuple(rules) if rules is not None else rules_for(mesh)
    spec = mesh_spec(axes, rules)
    sizes = dict(mesh.shape)
    out = []
    for size, a in zip(shape, spec):
        n = math.prod(sizes[x] for x in (() if a is None else (a,) if isinstance(a, str) else a))
        out.append(-(-size // n))
    return tuple(out)


# -- checks --------------------------------------------------------------------------------------------------------
def check_mesh(cfg, mesh, batch: int | None = None) -> None:
    """ValueError, before anything compiles, when `mesh` does not divide the model `cfg` or the global `batch`:
    heads, kv_heads, the MLP and expert hidden dims and the vocabulary by tp, experts by ep, the model dim by
    fsdp, the batch by dp x fsdp x ep. The message names both numbers."""
    sizes = mesh_sizes(mesh) if not isinstance(mesh, Mapping) else {a: int(mesh.get(a, 1)) for a in AXES}
    for axis, field in cfg.mesh_divisors():   # the model's own rules: (mesh axis, config field it must divide)
        value = getattr(cfg, field)
        if sizes[axis] > 1 and value % sizes[axis]:
            raise ValueError(f"mesh {format_mesh(sizes)}: {axis}={sizes[axis]} does not divide "
                             f"{type(cfg).__name__}.{field}={value}")
    if batch is not None:
        data = sizes["dp"] * sizes["fsdp"] * sizes["ep"]
        if batch % data:
            raise ValueError(f"mesh {format_mesh(sizes)}: the batch {batch} is not divisible by dp x fsdp x ep = "
                             f"{data}")


def batch_sharding(mesh, rules: Iterable[tuple[str, Any]] | None = None, ndim: int = 2) -> NamedSharding:
    """The sharding of a [batch, seq, ...] input: batch over the data axes, the rest whole."""
    rules = tuple(rules) if rules is not None else rules_for(mesh)
    return NamedSharding(mesh, mesh_spec(("batch",) + (None,) * (ndim - 1), rules))


# -- per-device tag shapes (for the planner) -------------------------------------------------------------------------
def _walk(jaxpr, constrained: dict, found: dict) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sharding_constraint":
            constrained[eqn.outvars[0]] = eqn.params["sharding"]
        elif eqn.primitive.name == "name":
            aval = eqn.outvars[0].aval
            s = constrained.get(eqn.invars[0])
            part = jax.ShapeDtypeStruct(tuple(aval.shape) if s is None else tuple(s.shard_shape(aval.shape)),
                                        aval.dtype)
            tag = eqn.params["name"]
            # made in sequence chunks: the chunks' concatenation, checked as zoo.emitted checks it
            found[tag] = join_chunks(tag, found[tag], part, 1) if tag in found else part
        else:
            for sub in sub_jaxprs(eqn.params):
                _walk(sub, constrained, found)


def tag_shard_shapes(model, batch: int, seq: int, mesh, rules: Iterable[tuple[str, Any]] | None = None
                     ) -> dict[str, dict[str, tuple[int, ...]]]:
    """{stack: {tag: per-device shape}} of one layer of each stack of a `CausalLM` for a global [batch, seq]
    input under `mesh` (an AbstractMesh is enough: nothing runs) and `rules`: each tag's shape divided by the
    sharding constraint at its tag site (a tag with no constraint keeps its global shape). Host bytes per device
    of a recipe = these shapes' bytes over the offloaded tags, times the layers."""
    x = jax.ShapeDtypeStruct((batch, seq, model.config.dim), jax.numpy.dtype(model.config.dtype))
    out = {}
    for stack_name, stack in model.stacks().items():
        layer, state = stack.layer_fn()
        with use(mesh, rules):
            jaxpr = jax.make_jaxpr(layer)(state, x)
        found: dict[str, jax.ShapeDtypeStruct] = {}
        _walk(jaxpr.jaxpr, {}, found)
        out[stack_name] = {tag: tuple(sds.shape) for tag, sds in found.items()}
    return out
