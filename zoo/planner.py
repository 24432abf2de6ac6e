"""The memory planner: what a recipe keeps in HBM, puts in host memory and recomputes, before launch.

``zoo.plan(cfg, recipe, batch=, seq=)`` builds the model abstractly (``nnx.eval_shape``: no memory), reads each
stack's tags and their shapes from the layers themselves (``model.tag_shapes``) and returns a :class:`Plan`:

- per stack and tag: the shape, the bytes one layer's tensor takes, and its placement. Only tags the backward
  pass needs count: those JAX saves when every tag may be saved (as ``zoo.audit.residual_tags``). Llama's
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

Not counted: the embedding, final norm, LM head and loss (their activations, the logits in float32 among them),
XLA's temporaries, copy buffers for overlapping transfers and fragmentation. A plan is a floor, not a peak.

``recipe="auto"`` chooses each tag's placement for an HBM budget, a host link and a FLOP rate (see
:func:`_choose`), and says why each tag landed where it did.
"""
from __future__ import annotations

import dataclasses
import functools
import heapq
import importlib
import itertools
import math
import os
from typing import Any, Callable

import jax
import jax.extend.core
import jax.numpy as jnp
from flax import nnx

from zoo import audit
from zoo import tags as tags_lib
from zoo.models.config import dtype_of
from zoo.models.stack import layer_body
from zoo.recipe import Recipe

GiB, MiB = 1 << 30, 1 << 20
CARRY = "decoder_layer_input"
# Optimizer moments kept per parameter.
OPTIMIZERS = {"adamw": 2, "adam": 2, "lion": 1, "momentum": 1, "sgd": 0}
# XLA's pinned host pool for GPUs: XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (an integer, GiB), 64 by default.
POOL_ENV, POOL_DEFAULT_GIB = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", 64


# -- models by name ---------------------------------------------------------------------------------------------
def _families() -> list[tuple[type, Callable, str]]:
    """(config class, builder, recipes module) for every model family the zoo has."""
    from zoo import models
    out = [(models.LlamaConfig, models.llama3, "recipes.llama3")]
    if hasattr(models, "DeepSeekV3Config"):
        out.append((models.DeepSeekV3Config, models.deepseek_v3, "recipes.deepseek_v3"))
    return out


def model_names() -> dict[str, Callable[[], Any]]:
    """{name: config factory} for the command line."""
    from zoo import models
    names = {"llama3.1-8b": models.LlamaConfig.llama3_1_8b, "llama3.1-70b": models.LlamaConfig.llama3_1_70b,
             "llama3.1-405b": models.LlamaConfig.llama3_1_405b, "llama3.1-tiny": models.LlamaConfig.tiny}
    if hasattr(models, "DeepSeekV3Config"):
        names.update({"deepseek-v3": models.DeepSeekV3Config.deepseek_v3_671b,
                      "deepseek-v3-tiny": models.DeepSeekV3Config.tiny})
    return names


def config_for(name: str):
    names = model_names()
    if name not in names:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(names)}")
    return names[name]()


def _family(cfg) -> tuple[Callable, str]:
    for cls, builder, recipes_module in _families():
        if isinstance(cfg, cls):
            return builder, recipes_module
    raise ValueError(f"no model family for a {type(cfg).__name__}; the zoo has: "
                     f"{', '.join(c.__name__ for c, _, _ in _families())}")


def recipes_for(cfg) -> dict[str, Recipe]:
    """The model family's named recipes (`RECIPES` of recipes/<family>.py)."""
    return importlib.import_module(_family(cfg)[1]).RECIPES


def recipe_for(cfg, recipe: Recipe | str) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    named = recipes_for(cfg)
    if recipe not in named:
        raise ValueError(f"unknown recipe {recipe!r} for {type(cfg).__name__}; choose one of: "
                         f"{', '.join(named)}, auto")
    return named[recipe]


@functools.lru_cache(maxsize=8)
def abstract_model(cfg):
    """The model with every array a ShapeDtypeStruct (`nnx.eval_shape`): nothing is allocated."""
    builder, _ = _family(cfg)
    return nnx.eval_shape(lambda: builder(cfg, rngs=nnx.Rngs(0)))


# -- the plan ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TagPlan:
    """One tag of one stack. Bytes are per layer and per device."""
    tag: str
    shape: tuple[int, ...]          # global shape of one layer's tensor
    dtype: str
    placement: str                  # device | offload | remat
    residual: bool                  # does the backward pass need it at all?
    nbytes: int                     # bytes of one layer's tensor when it is saved (0 if not a residual)
    device_bytes: int               # held in HBM per layer
    host_bytes: int                 # held in host memory per layer
    note: str = ""                  # why it is where it is

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class StackPlan:
    name: str
    num_layers: int
    tags: tuple[TagPlan, ...]
    untagged_bytes: int             # per layer: residuals JAX saves beyond the tags (recipe `none`)
    invariant_bytes: int            # once per stack: residuals JAX hoists out of the scan (masks, RoPE tables)
    forward_flops: int              # per layer, per device
    remat_flops: int                # per layer, per device: forward work re-run in the backward pass

    @property
    def device_bytes_per_layer(self) -> int:
        return sum(t.device_bytes for t in self.tags) + self.untagged_bytes

    @property
    def host_bytes_per_layer(self) -> int:
        return sum(t.host_bytes for t in self.tags)

    @property
    def device_bytes(self) -> int:
        return self.num_layers * self.device_bytes_per_layer + self.invariant_bytes

    @property
    def host_bytes(self) -> int:
        return self.num_layers * self.host_bytes_per_layer

    def to_dict(self) -> dict:
        return dict(name=self.name, num_layers=self.num_layers, tags=[t.to_dict() for t in self.tags],
                    untagged_bytes_per_layer=self.untagged_bytes,
                    invariant_bytes=self.invariant_bytes,
                    device_bytes_per_layer=self.device_bytes_per_layer,
                    host_bytes_per_layer=self.host_bytes_per_layer, device_bytes=self.device_bytes,
                    host_bytes=self.host_bytes, forward_flops_per_layer=self.forward_flops,
                    remat_flops_per_layer=self.remat_flops, remat_flops=self.num_layers * self.remat_flops)


@dataclasses.dataclass(frozen=True)
class ModelState:
    """Per device: parameters, their gradients, optimizer moments, other variables."""
    num_params: int
    params: int
    grads: int
    optimizer: int
    other: int
    optimizer_name: str

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.other

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total": self.total}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `recipe` costs for `model` at [batch, seq]; every byte and FLOP figure is per device."""
    model: str
    recipe: Recipe
    batch: int
    seq: int
    shard: int
    stacks: tuple[StackPlan, ...]
    state: ModelState
    hbm_budget: int | None
    host_pool: int
    warnings: tuple[str, ...]
    link_gbps: float | None = None
    tflops: float | None = None

    @property
    def activation_bytes(self) -> int:
        """HBM held by saved activations, over all stacks."""
        return sum(s.device_bytes for s in self.stacks)

    @property
    def host_bytes(self) -> int:
        return sum(s.host_bytes for s in self.stacks)

    @property
    def hbm_bytes(self) -> int:
        """Saved activations plus model state (no temporaries: a floor)."""
        return self.activation_bytes + self.state.total

    @property
    def remat_flops(self) -> int:
        """Forward FLOPs re-run in the backward pass, per step."""
        return sum(s.num_layers * s.remat_flops for s in self.stacks)

    @property
    def forward_flops(self) -> int:
        return sum(s.num_layers * s.forward_flops for s in self.stacks)

    def step_time(self) -> dict | None:
        """A roofline estimate of the stacks' time per step, given `tflops` and `link_gbps`: forward, backward
        (twice the forward), recompute, and the transfers that do not hide (device-to-host under the layer's
        forward, host-to-device under its backward)."""
        if self.tflops is None or self.link_gbps is None:
            return None
        rate, link = self.tflops * 1e12, self.link_gbps * 1e9
        out = dict(compute_s=0.0, remat_s=0.0, exposed_transfer_s=0.0)
        for s in self.stacks:
            fwd, remat, move = s.forward_flops / rate, s.remat_flops / rate, s.host_bytes_per_layer / link
            out["compute_s"] += s.num_layers * 3 * fwd
            out["remat_s"] += s.num_layers * remat
            out["exposed_transfer_s"] += s.num_layers * (max(0.0, move - fwd) + max(0.0, move - 2 * fwd - remat))
        out["total_s"] = sum(out.values())
        return out

    def to_dict(self) -> dict:
        return dict(model=self.model, recipe=self.recipe.name, offload=list(self.recipe.offload),
                    device=list(self.recipe.device), special=self.recipe.special, batch=self.batch, seq=self.seq,
                    shard=self.shard, stacks=[s.to_dict() for s in self.stacks], model_state=self.state.to_dict(),
                    totals=dict(activation_bytes=self.activation_bytes, host_bytes=self.host_bytes,
                                hbm_bytes=self.hbm_bytes, remat_flops=self.remat_flops,
                                forward_flops=self.forward_flops),
                    hbm_budget=self.hbm_budget, host_pool=self.host_pool, link_gbps=self.link_gbps,
                    tflops=self.tflops, step_time=self.step_time(), warnings=list(self.warnings))

    def print(self, console=None) -> None:
        """Print the plan as tables (rich)."""
        render(self, console)


# -- measuring one layer ----------------------------------------------------------------------------------------
def _flops(jaxpr) -> int:
    """Matmul FLOPs (2*M*N*K) of `jaxpr` and every jaxpr inside it."""
    total = 0
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            k = math.prod(eqn.invars[0].aval.shape[i] for i in lc)
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * k
        elif prim.startswith("ragged_dot"):  # each row meets one group: 2 * rows * K * N
            dn = eqn.params.get("ragged_dot_dimension_numbers")
            lc = dn.dot_dimension_numbers[0][0] if dn is not None else (eqn.invars[0].aval.ndim - 1,)
            k = math.prod(eqn.invars[0].aval.shape[i] for i in lc)
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * k
        for sub in tags_lib._sub_jaxprs(eqn.params):
            total += _flops(sub)
    return total


class _Layer:
    """One layer of a stack, abstract, at the planned [batch, seq], traced once to a jaxpr: its forward FLOPs,
    the tags its backward pass needs, and, for any set of saved tags, the FLOPs its backward pass re-runs
    (cached). Differentiating the traced jaxpr rather than the module keeps each question to a fraction of a
    second for a 671B layer."""

    def __init__(self, model, stack_name: str, batch: int, seq: int):
        graphdef, state = model.stacks()[stack_name].abstract_layer()
        x = jax.ShapeDtypeStruct((batch, seq, model.config.dim), dtype_of("dtype", model.config.dtype))
        self.args, treedef = jax.tree.flatten((state, x))
        closed = jax.make_jaxpr(
            lambda *a: layer_body(nnx.merge(graphdef, jax.tree.unflatten(treedef, a)[0]), a[-1])[0])(*self.args)
        self.forward_flops = _flops(closed.jaxpr)
        fn = jax.extend.core.jaxpr_as_fun(closed)
        self._fn = lambda *a: fn(*a)[0]
        self._wrt = tuple(i for i, a in enumerate(self.args) if jnp.issubdtype(a.dtype, jnp.inexact))
        self._cache: dict = {}
        self._grad_none = self._grad_flops(Recipe.none().policy())

    def _loss(self, policy):
        body = jax.checkpoint(self._fn, policy=policy, prevent_cse=False)
        return lambda *a: jnp.sum(body(*a).astype(jnp.float32))

    def _grad_flops(self, policy) -> int:
        grad = jax.grad(self._loss(policy), argnums=self._wrt)
        return _flops(jax.make_jaxpr(grad)(*self.args).jaxpr)

    def residual_tags(self, emitted) -> frozenset[str]:
        """Tags JAX saves when every tag may be saved: those the backward pass needs (as zoo.audit.residual_tags,
        at the planned shape)."""
        policy = Recipe("all_saved", device=tuple(emitted)).policy()
        return frozenset(r.tag for r in audit.residuals(self._loss(policy), *self.args) if r.tag is not None)

    def remat_flops(self, saved: frozenset[str]) -> int:
        if saved not in self._cache:
            policy = Recipe("saved", device=tuple(sorted(saved))).policy()
            self._cache[saved] = self._grad_flops(policy) - self._grad_none
        return self._cache[saved]


@functools.lru_cache(maxsize=32)
def _layer(cfg, stack_name: str, batch: int, seq: int) -> _Layer:
    return _Layer(abstract_model(cfg), stack_name, batch, seq)


def _recipe_flops(layer: _Layer, recipe: Recipe, emitted) -> int:
    if recipe.special == "none":
        return 0
    return layer.remat_flops(frozenset(t for t in emitted if recipe.placement(t) != "remat"))


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _nbytes(sds) -> int:
    return math.prod(sds.shape) * jnp.dtype(sds.dtype).itemsize


def stack_residuals(model, stack_name: str, batch: int, seq: int) -> tuple[int, int, int]:
    """What JAX saves for the scanned stack `stack_name` under the model's recipe, for a [batch, seq] input:
    (device bytes stacked over the layers, host bytes stacked over the layers, device bytes hoisted out of the
    scan). Constants are left out."""
    stack = model.stacks()[stack_name]
    graphdef, state = nnx.split(stack)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    x = jax.ShapeDtypeStruct((batch, seq, model.config.dim), dtype_of("dtype", model.config.dtype))
    policy = model.recipe.policy()
    res = audit.residuals(lambda s, x: audit.sum_outputs(nnx.merge(graphdef, s)(x, policy)), state, x)
    if stack.num_layers == 1:  # applied without a scan (see Stack.__call__): every residual is the layer's own
        stacked, hoisted = [r for r in res if not r.source.startswith("from a constant")], []
    else:
        stacked = [r for r in res if r.source.startswith("output of scan") and r.shape[:1] == (stack.num_layers,)]
        hoisted = [r for r in res if r not in stacked and not r.source.startswith("from a constant")]
    return (sum(r.nbytes for r in stacked if not r.host), sum(r.nbytes for r in stacked if r.host),
            sum(r.nbytes for r in hoisted if not r.host))


def _model_state(model, shard: int, optimizer: str, opt_dtype: str) -> ModelState:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    opt_itemsize = jnp.dtype(dtype_of("opt_dtype", opt_dtype)).itemsize
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    others = jax.tree.leaves(nnx.state(model, nnx.Not(nnx.Param)))
    n = sum(math.prod(p.shape) for p in params)
    pbytes = sum(_nbytes(p) for p in params)
    obytes = sum(_nbytes(p) for p in others if hasattr(p, "dtype") and hasattr(p, "shape"))
    return ModelState(num_params=n, params=_ceil_div(pbytes, shard), grads=_ceil_div(pbytes, shard),
                      optimizer=_ceil_div(OPTIMIZERS[optimizer] * n * opt_itemsize, shard),
                      other=_ceil_div(obytes, shard), optimizer_name=optimizer)


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


def fmt_bytes(n: float) -> str:
    if n >= 1024 * GiB:
        return f"{n / (1024 * GiB):.1f} TiB"
    if n >= GiB:
        return f"{n / GiB:.1f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.1f} KiB"
    return f"{int(n)} B"


def _fmt_flops(n: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,.0f} FLOP"


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


def plan(cfg, recipe: Recipe | str, *, batch: int, seq: int, shard: int = 1, optimizer: str = "adamw",
         opt_dtype: str = "float32", hbm_gib: float | None = None, host_gib: float | None = None,
         link_gbps: float | None = None, tflops: float | None = None, model_name: str | None = None) -> Plan:
    """Plan `recipe` (a `zoo.Recipe`, a key of the family's `RECIPES`, or "auto") for the model `cfg` (a config,
    a model name such as "llama3.1-405b", or a built model, whose config is used) at global [batch, seq] split
    over `shard` devices.

    `hbm_gib` is the HBM budget per device (warned about; required by "auto"); `host_gib` bounds host memory per
    device for "auto"; `link_gbps` (GB/s per direction) and `tflops` (TFLOP/s) feed "auto" and the step-time
    estimate. See the module docstring for what is counted and how.
    """
    if isinstance(cfg, str):
        model_name, cfg = cfg, config_for(cfg)
    elif isinstance(cfg, nnx.Module) and hasattr(cfg, "config"):
        cfg = cfg.config
    if getattr(cfg, "attention_impl", None) == "cudnn":
        cfg = dataclasses.replace(cfg, attention_impl=None)
    _check_positive("batch", batch)
    _check_positive("seq", seq)
    _check_positive("shard", shard)
    for n, v in (("hbm_gib", hbm_gib), ("host_gib", host_gib), ("link_gbps", link_gbps), ("tflops", tflops)):
        _check_positive(n, v, float)
    auto = isinstance(recipe, str) and recipe == "auto"
    if auto:
        missing = [n for n, v in (("hbm_gib", hbm_gib), ("link_gbps", link_gbps), ("tflops", tflops)) if v is None]
        if missing:
            raise ValueError(f"recipe 'auto' needs {', '.join(missing)} (HBM budget, link speed, FLOP rate)")
    else:
        recipe = recipe_for(cfg, recipe)
    model = abstract_model(cfg)
    if not auto:
        model.set_recipe(recipe)  # raises if the recipe names a tag no stack emits
    state = _model_state(model, shard, optimizer, opt_dtype)
    hbm_budget = None if hbm_gib is None else int(hbm_gib * GiB)
    pool, pool_warning = host_pool_bytes()
    shapes = model.tag_shapes(batch, seq)
    layers = {s: _layer(cfg, s, batch, seq) for s in shapes}
    needed = {s: layers[s].residual_tags(shapes[s].tags) for s in shapes}

    notes: dict[str, str] = {}
    if auto:
        recipe, notes = _choose(shapes, needed, layers, state, shard, hbm_budget,
                                None if host_gib is None else int(host_gib * GiB), link_gbps * 1e9, tflops * 1e12)
    model.set_recipe(recipe)

    stacks, extra = [], []
    for s, st in shapes.items():
        tag_plans = []
        for tag, sds in st.tags.items():
            place = recipe.placement(tag)
            residual = tag in needed[s]
            nbytes = _ceil_div(_nbytes(sds), shard) if residual else 0
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
            tag_plans.append(TagPlan(tag, tuple(sds.shape), jnp.dtype(sds.dtype).name, place, residual, nbytes,
                                     device, host, note))
        # JAX's own account of the stack: anything beyond the tags, and a check of the tags.
        jax_device, jax_host, hoisted = stack_residuals(model, s, batch, seq)
        tag_device = sum(_nbytes(st.tags[t]) for t in st.tags if t in needed[s] and (
            recipe.placement(t) == "device" or (t == CARRY and recipe.placement(t) != "offload")))
        tag_host = sum(_nbytes(st.tags[t]) for t in st.tags if t in needed[s] and recipe.placement(t) == "offload")
        untagged = jax_device - st.num_layers * tag_device
        if untagged < 0 or jax_host != st.num_layers * tag_host:
            extra.append(f"stack {s}: JAX saves {fmt_bytes(jax_device)} on the device and {fmt_bytes(jax_host)} "
                         f"on the host, the tags account for {fmt_bytes(st.num_layers * tag_device)} and "
                         f"{fmt_bytes(st.num_layers * tag_host)}: the plan is off for this recipe")
        stacks.append(StackPlan(
            name=s, num_layers=st.num_layers, tags=tuple(tag_plans),
            untagged_bytes=_ceil_div(max(untagged, 0) // st.num_layers, shard),
            invariant_bytes=_ceil_div(hoisted, shard),
            forward_flops=_ceil_div(layers[s].forward_flops, shard),
            remat_flops=_ceil_div(_recipe_flops(layers[s], recipe, st.tags), shard)))
    activation = sum(sp.device_bytes for sp in stacks)
    host = sum(sp.host_bytes for sp in stacks)
    extra += [pool_warning] if pool_warning else []
    if recipe.special == "none":
        extra.append("recipe 'none' keeps every intermediate JAX saves, untagged ones included (attention "
                     "probabilities on the XLA path): counted from JAX's own list of residuals")
    return Plan(model=model_name or type(cfg).__name__, recipe=recipe, batch=batch, seq=seq, shard=shard,
                stacks=tuple(stacks), state=state, hbm_budget=hbm_budget, host_pool=pool,
                warnings=_warnings(host, activation, state, hbm_budget, pool, extra), link_gbps=link_gbps,
                tflops=tflops)


# -- choosing a recipe ------------------------------------------------------------------------------------------
def _choose(shapes, needed, layers, state: ModelState, shard: int, hbm_budget: int, host_budget: int | None,
            link: float, rate: float) -> tuple[Recipe, dict[str, str]]:
    """Choose each tag's placement to minimise the estimated step time within the HBM budget.

    A recipe names a tag once for every stack, so each decision weighs all stacks (bytes and FLOPs times their
    layers). The scan carry is saved whatever the recipe: it stays in HBM if it fits, else it is offloaded if
    its transfer hides. Every other tag the backward pass needs is taken in order of value, the recompute
    FLOPs it saves per byte given the tags kept so far (a lazy greedy: values only fall as more is kept):

    1. keep it on the device if it fits in what is left of the HBM budget;
    2. else offload it if its transfer, added to the transfers already chosen, hides under the forward pass of
       every layer that emits it (device-to-host during the forward; host-to-device has the longer backward)
       at the given link speed, and fits the host budget (if one is given);
    3. else recompute it.

    A tag whose saving alone is zero (the norm of a kept tensor; MLA's key and value, two slices of one
    up-projection) is then tried in pairs with the other such tags, and a pair that saves FLOPs goes through the
    same three steps. Hidden transfers are taken as free, so on a fast link everything that hides is offloaded;
    `host_gib` bounds that.
    """
    notes: dict[str, str] = {}
    device: list[str] = []
    offload: list[str] = []
    window = {s: layers[s].forward_flops / shard / rate for s in shapes}  # seconds per layer, per device
    moved = {s: 0.0 for s in shapes}  # seconds of transfer per layer already chosen

    def nbytes(group, s: str) -> int:
        return sum(_ceil_div(_nbytes(shapes[s].tags[t]), shard) for t in group
                   if t in shapes[s].tags and t in needed[s])

    def total(group) -> int:
        return sum(shapes[s].num_layers * nbytes(group, s) for s in shapes)

    def hides(group) -> tuple[bool, str]:
        worst = ""
        for s in shapes:
            b = nbytes(group, s)
            if b and moved[s] + b / link > window[s]:
                return False, (f"its transfer would not hide in {s}: {1e3 * (moved[s] + b / link):.2f} ms per "
                               f"layer > forward {1e3 * window[s]:.2f} ms at {link / 1e9:g} GB/s")
            if b:
                worst = (f"its transfer hides: {1e3 * (moved[s] + b / link):.2f} ms per layer <= forward "
                         f"{1e3 * window[s]:.2f} ms at {link / 1e9:g} GB/s")
        return True, worst

    def saving(group, kept: frozenset) -> int:  # recompute FLOPs per step per device that keeping `group` saves
        return sum(shapes[s].num_layers * _ceil_div(layers[s].remat_flops(kept) - layers[s].remat_flops(kept | set(group)),
                                                    shard) for s in shapes if any(t in needed[s] for t in group))

    hbm_left = hbm_budget - state.total
    host_used = 0
    kept = frozenset()

    def place(group, value: int, what: str) -> None:
        nonlocal hbm_left, host_used, kept
        size = total(group)
        gain = f"saves {_fmt_flops(value)} of recompute per step ({value / size:.0f} FLOP/byte)"
        if size <= hbm_left:
            device.extend(group)
            hbm_left -= size
            kept |= set(group)
            note = f"kept in HBM: {fmt_bytes(size)} fits ({fmt_bytes(hbm_left + size)} left); {gain}"
        else:
            ok, why = hides(group)
            if ok and (host_budget is None or host_used + size <= host_budget):
                offload.extend(group)
                for s in shapes:
                    moved[s] += nbytes(group, s) / link
                host_used += size
                kept |= set(group)
                note = (f"offloaded: {fmt_bytes(size)} does not fit in HBM ({fmt_bytes(max(hbm_left, 0))} left); "
                        f"{why}; {gain}")
            else:
                reason = why if not ok else f"the host budget is full ({fmt_bytes(host_used)} used)"
                note = (f"recomputed: {fmt_bytes(size)} does not fit in HBM ({fmt_bytes(max(hbm_left, 0))} left) "
                        f"and {reason}")
        for t in group:
            notes[t] = what + note

    # the scan carry: saved whatever the recipe says, so the only question is where
    carry = total([CARRY])
    if carry:
        ok, why = hides([CARRY])
        if carry <= hbm_left:
            device.append(CARRY)
            notes[CARRY] = f"scan carry kept in HBM: fits ({fmt_bytes(hbm_left)} left of the budget)"
            hbm_left -= carry
        elif ok and (host_budget is None or carry <= host_budget):
            offload.append(CARRY)
            for s in shapes:
                moved[s] += nbytes([CARRY], s) / link
            host_used += carry
            notes[CARRY] = f"scan carry offloaded: does not fit in HBM; {why}"
        else:
            device.append(CARRY)
            hbm_left -= carry
            notes[CARRY] = "scan carry kept in HBM although over budget: it cannot be recomputed and " + (
                why if not ok else "the host budget is full")

    # single tags, by value
    candidates = [t for t in dict.fromkeys(t for s in shapes for t in shapes[s].tags)
                  if t != CARRY and any(t in needed[s] for s in shapes)]
    order = {t: i for i, t in enumerate(candidates)}
    heap = [(-saving([t], kept) / total([t]), order[t], t) for t in candidates]
    heapq.heapify(heap)
    alone_useless: list[str] = []
    while heap:
        _, i, tag = heapq.heappop(heap)
        value = saving([tag], kept)
        if heap and -value / total([tag]) > heap[0][0] + 1e-12:  # stale: its value fell below the next one's
            heapq.heappush(heap, (-value / total([tag]), i, tag))
        elif value <= 0:
            alone_useless.append(tag)
            notes[tag] = "recomputed: keeping it alone saves no recompute, given the tags already kept"
        else:
            place([tag], value, "")

    # tags that only pay off together, in pairs, by value
    while len(alone_useless) > 1:
        pairs = [(saving(pair, kept), pair) for pair in itertools.combinations(alone_useless, 2)]
        pairs = [(v / total(pair), v, pair) for v, pair in pairs if v > 0]
        if not pairs:
            break
        _, value, pair = max(pairs, key=lambda p: (p[0], -order[p[2][0]], -order[p[2][1]]))
        place(list(pair), value, "")
        for t, other in (pair, pair[::-1]):
            notes[t] = f"together with {other} (alone it saves nothing): {notes[t]}"
            alone_useless.remove(t)
    return Recipe("auto", offload=tuple(offload), device=tuple(device),
                  description="chosen by zoo.plan for an HBM budget, a link and a FLOP rate"), notes


def auto_recipe(cfg, *, batch: int, seq: int, hbm_gib: float, link_gbps: float, tflops: float, **kwargs) -> Recipe:
    """The recipe `plan(cfg, "auto", ...)` chooses."""
    return plan(cfg, "auto", batch=batch, seq=seq, hbm_gib=hbm_gib, link_gbps=link_gbps, tflops=tflops,
                **kwargs).recipe


# -- the tables -------------------------------------------------------------------------------------------------


_SHORT = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}


def render(p: Plan, console=None) -> None:
    """Print `p` as tables: one row per tag and stack, then totals, model state, reasons and warnings."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    shard = f", split over {p.shard} devices (per-device figures)" if p.shard > 1 else ""
    console.print(f"[bold]{p.model}[/]: recipe {p.recipe.name!r}, batch {p.batch}, seq {p.seq}{shard}")
    colour = {"device": "green", "offload": "cyan", "remat": "magenta"}
    for s in p.stacks:
        t = Table(title=f"stack {s.name!r}: {s.num_layers} layers", title_justify="left")
        for col in ("tag", "shape", "per layer", "placement", "note"):
            t.add_column(col, justify="right" if col == "per layer" else "left", no_wrap=col != "note")
        for tp in s.tags:
            place = tp.placement if tp.residual else "-"
            note = "not a residual" if not tp.residual else "scan carry" if tp.tag == CARRY else ""
            t.add_row(tp.tag, "x".join(map(str, tp.shape)) + " " + _SHORT.get(tp.dtype, tp.dtype),
                      fmt_bytes(tp.nbytes) if tp.residual else "0", f"[{colour.get(place, 'white')}]{place}[/]", note)
        if s.untagged_bytes:
            t.add_row("(untagged)", "", fmt_bytes(s.untagged_bytes), "[green]device[/]", "saved by JAX, no tag")
        if s.invariant_bytes:
            t.add_row("(invariant)", "", fmt_bytes(s.invariant_bytes), "[green]device[/]", "once per stack")
        console.print(t)

    st = Table(title="per stack", title_justify="left")
    for col in ("stack", "layers", "HBM/layer", "host/layer", "HBM", "host", "recompute/step"):
        st.add_column(col, justify="left" if col == "stack" else "right")
    for s in p.stacks:
        st.add_row(s.name, str(s.num_layers), fmt_bytes(s.device_bytes_per_layer), fmt_bytes(s.host_bytes_per_layer),
                   fmt_bytes(s.device_bytes), fmt_bytes(s.host_bytes), _fmt_flops(s.num_layers * s.remat_flops))
    console.print(st)

    tt = Table(title="per device (HBM before XLA's temporaries)", title_justify="left", show_header=False)
    tt.add_column("what")
    tt.add_column("value", justify="right")
    ms = p.state
    rows = [("saved activations in HBM", fmt_bytes(p.activation_bytes)),
            ("host memory (pinned)", f"{fmt_bytes(p.host_bytes)} of a {fmt_bytes(p.host_pool)} pool"),
            ("recomputed per step", f"{_fmt_flops(p.remat_flops)} (forward {_fmt_flops(p.forward_flops)})"),
            (f"parameters ({ms.num_params:,})", fmt_bytes(ms.params)),
            ("gradients", fmt_bytes(ms.grads)),
            (f"optimizer state ({ms.optimizer_name})", fmt_bytes(ms.optimizer))]
    if ms.other:
        rows.append(("other variables", fmt_bytes(ms.other)))
    rows.append(("HBM: activations + model state", fmt_bytes(p.hbm_bytes)
                 + (f" of {fmt_bytes(p.hbm_budget)}" if p.hbm_budget is not None else "")))
    est = p.step_time()
    if est is not None:
        rows.append((f"stack time per step at {p.tflops:g} TFLOP/s, {p.link_gbps:g} GB/s (est.)",
                     f"{est['total_s'] * 1e3:,.1f} ms"))
    for r in rows:
        tt.add_row(*r)
    console.print(tt)
    if p.recipe.name == "auto":
        console.print(f"[bold]chosen:[/] {p.recipe}")
        for tag, note in dict.fromkeys((tp.tag, tp.note) for s in p.stacks for tp in s.tags if tp.note):
            console.print(f"  [bold]{tag}[/]: {note}")
    for w in p.warnings:
        console.print(f"[bold yellow]warning:[/] {w}")


# -- the command line -------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """`python -m zoo.plan --model llama3.1-405b --recipe qkv_offload --batch 2 --seq 8192 [--json]`."""
    import argparse
    import json
    import sys

    names = model_names()
    ap = argparse.ArgumentParser(prog="python -m zoo.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help=f"one of: {', '.join(names)}")
    ap.add_argument("--recipe", required=True, help="a key of the model's RECIPES, or 'auto'")
    ap.add_argument("--batch", type=int, required=True, help="global batch")
    ap.add_argument("--seq", type=int, required=True)
    ap.add_argument("--shard", type=int, default=1, help="devices the batch and the model state are split over")
    ap.add_argument("--optimizer", default="adamw", help=f"one of: {', '.join(OPTIMIZERS)}")
    ap.add_argument("--opt-dtype", default="float32")
    ap.add_argument("--hbm", type=float, help="HBM budget per device, GiB (needed by --recipe auto)")
    ap.add_argument("--host", type=float, help="host memory budget per device for --recipe auto, GiB")
    ap.add_argument("--link", type=float, help="host link, GB/s per direction (needed by --recipe auto)")
    ap.add_argument("--flops", type=float, help="matmul rate, TFLOP/s (needed by --recipe auto)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = ap.parse_args(argv)
    try:
        p = plan(config_for(args.model), args.recipe, batch=args.batch, seq=args.seq, shard=args.shard,
                 optimizer=args.optimizer, opt_dtype=args.opt_dtype, hbm_gib=args.hbm, host_gib=args.host,
                 link_gbps=args.link, tflops=args.flops, model_name=args.model)
    except ValueError as e:
        ap.error(str(e))
    if args.json:
        out = p.to_dict()
        if p.recipe.name == "auto":
            out["reasons"] = {t.tag: t.note for s in p.stacks for t in s.tags if t.note}
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        p.print()
    return 0
