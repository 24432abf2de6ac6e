"""Measuring what JAX saves and re-runs, on any machine (shapes only): `residuals`, `layer_residuals` (with
`placements_seen`), `residual_tags`, `stack_residuals` and `model_residuals` read JAX's own list of what the backward
pass keeps under a policy; `LayerCost` counts the matmul FLOPs of a layer's gradient under any set of saved tags
(attention's from its shapes, `zoo.layers.attention_kernel.attention_flops`). No function changes a model's recipe.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import math
import re
import sys
import threading
from typing import Any

import jax
import jax.ad_checkpoint
import jax.extend.core
import jax.numpy as jnp
from flax import nnx

from zoo import recipe as recipe_lib
from zoo import tags as tags_lib
from zoo.jaxprs import sub_jaxprs
from zoo.layers.attention_kernel import SCOPE as ATTENTION_SCOPE
from zoo.layers.attention_kernel import attention_flops
from zoo.models.registry import family_of
from zoo.models.stack import remat
from zoo.recipe import Recipe
from zoo.tags import LEAD

_NAMED = re.compile(r"named '([^']+)'")
CARRY = "decoder_layer_input"
# One line of `jax.ad_checkpoint.print_saved_residuals`: "f32<host>[2,8] named 'q' from ...", the aval in JAX's
# short form (`aval.str_short(short_dtypes=True)`), then where it comes from.
_LINE = re.compile(r"^(\w+)(<(\w+)>)?\[([\d,]*)\] (.*)$")
# JAX's short dtype names (float32 -> f32, int8 -> i8, uint8 -> u8, bfloat16 -> bf16) back to dtypes.
_SHORT_DTYPES = {jnp.dtype(d).name.replace("float", "f").replace("uint", "u").replace("int", "i"): jnp.dtype(d)
                 for d in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                           "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2")}


@dataclasses.dataclass(frozen=True)
class Residual:
    shape: tuple[int, ...]
    dtype: Any
    host: bool
    tag: str | None  # the checkpoint name, when JAX reports one
    source: str

    @property
    def nbytes(self) -> int:
        return int(jnp.dtype(self.dtype).itemsize) * math.prod(self.shape)  # math.prod: no int32 overflow


class _ThisThreadOnly(io.TextIOBase):
    """stdout while JAX prints its residuals: this thread's lines into `text`, every other thread's (a progress
    line, a user's logging) on to the stream that was stdout before."""

    def __init__(self, text: io.StringIO, before):
        self.text, self.before, self.thread = text, before, threading.current_thread()

    def write(self, s: str) -> int:
        return (self.text if threading.current_thread() is self.thread else self.before).write(s)

    def flush(self) -> None:
        self.before.flush()


def saved_residuals(fn, *args) -> list[tuple[tuple[int, ...], Any, bool, str]]:
    """(shape, dtype, on the host, source) of each residual JAX saves for `fn(*args)`, read through the public
    `jax.ad_checkpoint.print_saved_residuals` (jax 0.10-0.11 keep `saved_residuals` itself private); what other
    threads print meanwhile goes where it would have gone.

    Args:
        fn: the function JAX differentiates (a scalar function, as `jax.grad` takes it).
        *args: its arguments (arrays or `jax.ShapeDtypeStruct`s: nothing runs).

    Returns:
        One (shape, dtype, on the host, where it comes from) per residual, in JAX's order.
    """
    text = io.StringIO()
    with contextlib.redirect_stdout(_ThisThreadOnly(text, sys.stdout)):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    out = []
    for line in text.getvalue().splitlines():
        m = _LINE.match(line)
        if m is None or m.group(1) not in _SHORT_DTYPES:
            raise ValueError(f"print_saved_residuals printed a line zoo.plan.measure cannot read: {line!r}")
        shape = tuple(int(d) for d in m.group(4).split(",") if d)
        out.append((shape, _SHORT_DTYPES[m.group(1)], "host" in (m.group(3) or ""), m.group(5)))
    return out


def residuals(fn, *args) -> list[Residual]:
    """Residuals JAX saves to differentiate `fn(*args)` (a scalar function), excluding the arguments."""
    out = []
    for shape, dtype, host, src in saved_residuals(fn, *args):
        if src.startswith("from the argument"):
            continue
        m = _NAMED.search(src)
        out.append(Residual(shape, dtype, host, m.group(1) if m else None, src))
    return out


def sum_outputs(tree) -> jax.Array:
    return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(tree))


def nbytes(sds) -> int:
    return math.prod(sds.shape) * jnp.dtype(sds.dtype).itemsize


def _all_saved(emitted) -> Recipe:
    return Recipe("all_saved", device=tuple(emitted))


# -- one layer, one stack, the model --------------------------------------------------------------------------------
def layer_residuals(model, stack_name: str, batch: int, seq: int, policy=None, tiles: int | None = None
                    ) -> list[Residual]:
    """Residuals of one layer of `stack_name` under `policy` (default: the model's recipe's), for [batch, seq], its
    per-position parts in `tiles` sequence tiles (default: the model's recipe's)."""
    stack = model.stacks()[stack_name]
    tiles = model.recipe.seq_tiles if tiles is None else tiles
    fn, state = stack.layer_fn(model.recipe.policy() if policy is None else policy, tiles=tiles)
    return residuals(lambda s, x: sum_outputs(fn(s, x)), state, stack.abstract_input(batch, seq))


def residual_tags(model, stack_name: str, batch: int = 1, seq: int = 8) -> tuple[str, ...]:
    """Tags of `stack_name` that the backward pass needs at all: those JAX saves when every tag may be saved.

    A tag outside this set (e.g. the MLP's down projection, whose value only flows into the residual sum) costs
    nothing under any placement; the planner counts it as zero bytes."""
    stack = model.stacks()[stack_name]
    emitted = tuple(stack.tag_shapes(stack.abstract_input(batch, seq)))
    saved = {r.tag for r in layer_residuals(model, stack_name, batch, seq, _all_saved(emitted).policy())}
    return tuple(t for t in emitted if t in saved)


def placements_seen(model, stack_name: str, batch: int = 1, seq: int = 8, recipe: Recipe | None = None
                    ) -> dict[str, str]:
    """{tag: 'device' | 'offload' | 'remat'} as JAX really saves the tags of one layer of `stack_name` under `recipe`
    (default: the model's). A host residual carries no name, so it is matched to the emitted tags by shape and dtype
    (tags of equal shapes are interchangeable there, as is a tag kept inside sequence tiles)."""
    recipe = model.recipe if recipe is None else recipe
    stack = model.stacks()[stack_name]
    x = stack.abstract_input(batch, seq)
    emitted, tiled = stack.tag_shapes(x, recipe.seq_tiles), stack.tiled_tags(x, recipe.seq_tiles)
    seen = {t: "remat" for t in emitted}
    host = []
    n = recipe.seq_tiles

    def tile_of(t):   # the shape a tiled tag is saved in
        e = emitted[t].shape
        return (n, e[0], e[1] // n) + tuple(e[2:])
    for r in layer_residuals(model, stack_name, batch, seq, recipe.policy(), recipe.seq_tiles):
        if r.tag is not None:
            seen[r.tag] = "offload" if r.host else "device"
        elif r.host:
            host.append((r.shape, jnp.dtype(r.dtype)))
        elif n > 1 and r.source.startswith("output of") and "tiles.py" in r.source:
            match = sorted((t for t in tiled if seen[t] == "remat" and tile_of(t) == r.shape
                            and jnp.dtype(emitted[t].dtype) == jnp.dtype(r.dtype)),
                           key=lambda t: recipe.placement(t) != "device")
            if match:
                seen[match[0]] = "device"
    # A tag made in sequence chunks (zoo.emitted) is saved as one residual per chunk: each host residual fills
    # its tag's sequence axis until the whole tag is on the host. Prefer a tag already partly filled, then the tags
    # the recipe offloads when shapes tie, so that a faithful recipe reads back as itself.
    left = {t: sds.shape[1] if len(sds.shape) > 1 else 1 for t, sds in emitted.items()}

    def fits(t, shape, dtype) -> bool:
        e = emitted[t].shape
        if seen[t] != "remat" or jnp.dtype(emitted[t].dtype) != dtype or len(e) != len(shape):
            return False
        return e == shape if len(e) < 2 else (e[:1] + e[2:] == shape[:1] + shape[2:] and shape[1] <= left[t])

    for shape, dtype in host:
        order = sorted(emitted, key=lambda t: (left[t] == (emitted[t].shape[1:2] or (1,))[0],
                                               recipe.placement(t) != "offload"))
        t = next((t for t in order if fits(t, shape, dtype)), None)
        if t is None:
            raise AssertionError(f"host residual {dtype}{list(shape)} matches no tag of {stack_name}")
        left[t] -= shape[1] if len(shape) > 1 else 1
        if left[t] == 0:
            seen[t] = "offload"
    return seen


def _view_of_parameters(r: Residual) -> bool:
    """A residual that is the stack's parameters seen another way (a layer's slice, a group's reshape): the same
    bytes as the parameters, which the model state counts."""
    return "(module_at." in r.source or "(grouped." in r.source


def stack_residuals(model, stack_name: str, batch: int, seq: int, policy, *, group: int = 1,
                    tiles: int = 1, layer_policy=None, carry: str | None = None, subgroup: int = 1,
                    lead_policy=None) -> tuple[int, int, int]:
    """What JAX saves for the scanned stack `stack_name` under `policy` (`group` layers per rematerialized body, in
    subgroups of `subgroup`, `tiles` sequence tiles, each group's first layer under `lead_policy`), for a [batch, seq]
    input: (device bytes stacked over the layers, host bytes stacked over the layers, device bytes hoisted out of the
    scan). Constants and views of the parameters are left out. `carry`: where the recipe keeps the layer input
    ("device": a stack run without a scan counts its input, the body's argument, as saved on the device)."""
    stack = model.stacks()[stack_name]
    graphdef, state = nnx.split(stack)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    res = residuals(lambda s, x: sum_outputs(nnx.merge(graphdef, s)(x, policy, group=group, tiles=tiles,
                                                                             layer_policy=layer_policy,
                                                                             subgroup=subgroup,
                                                                             lead_policy=lead_policy)), state,
                    stack.abstract_input(batch, seq))
    res = [r for r in res if not r.source.startswith("from a constant") and not _view_of_parameters(r)]
    scans = stack.num_layers // group
    if scans == 1:  # applied without a scan (see Stack.__call__): every residual is the layer's (group's) own
        stacked, hoisted = res, []
        x = stack.abstract_input(batch, seq)
        if carry == "device" and not any(r.shape == x.shape and r.dtype == x.dtype and not r.host for r in res):
            # its input is the body's argument, which its backward reads: JAX lists it as the program's argument
            stacked = res + [Residual(x.shape, x.dtype, False, CARRY, "the input of a stack run without a scan")]
    else:
        stacked = [r for r in res if r.source.startswith("output of scan") and r.shape[:1] == (scans,)]
        hoisted = [r for r in res if r not in stacked]
    return (sum(r.nbytes for r in stacked if not r.host), sum(r.nbytes for r in stacked if r.host),
            sum(r.nbytes for r in hoisted if not r.host))


def model_residuals(model, tokens: jax.Array) -> list[Residual]:
    """Residuals of the mean-logit loss of the whole model on `tokens`: stacked per scanned stack."""
    graphdef, state = nnx.split(model)
    return residuals(lambda s, t: jnp.mean(nnx.merge(graphdef, s)(t).astype(jnp.float32)), state, tokens)


# -- what the backward pass re-runs ---------------------------------------------------------------------------------
# The tags whose keeping leaves no attention forward in the backward pass (the kernel's residuals).
ATTENTION_RESIDUALS = frozenset(recipe_lib.ATTENTION_RESIDUALS)


def _in_attention_kernel(eqn) -> bool:
    return ATTENTION_SCOPE in str(getattr(eqn.source_info, "name_stack", ""))


def flops(jaxpr) -> int:
    """Matmul FLOPs (2*M*N*K) of `jaxpr` and every jaxpr inside it (a scan's body times its length), but the
    attention kernel's own (counted from shapes: `LayerCost.attention_flops`)."""
    total = 0
    for eqn in jaxpr.eqns:
        if _in_attention_kernel(eqn):
            continue
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
        trips = eqn.params.get("length", 1) if prim == "scan" else 1   # a scan's body runs `length` times
        for sub in sub_jaxprs(eqn.params):
            total += trips * flops(sub)
    return total


@functools.lru_cache(maxsize=8)
def abstract_model(cfg):
    """The model of the config `cfg` with every array a ShapeDtypeStruct (`nnx.eval_shape`): nothing is allocated.
    Cached per config; never given a recipe (measurements pass policies)."""
    build = family_of(cfg).build
    return nnx.eval_shape(lambda: build(cfg, rngs=nnx.Rngs(0)))


class LayerCost:
    """One layer of a stack, abstract, at [batch, seq], traced once to a jaxpr: its forward FLOPs, the tags its
    backward pass needs, and, for any set of saved tags, the FLOPs its backward pass re-runs (cached). With `group`
    k, one rematerialized group of k layers is traced and every figure is per layer (the group's over k): the
    recompute then includes the group's forward and each layer's own (two-level checkpoints), each layer keeping
    the saved tags and `keep` (the recipe's `group_keep`) while the group's backward runs, and with `subgroup` s > 1
    each subgroup's forward once more (three levels). A saved set may name tags as a group's first layer keeps them
    between the passes (`zoo.tags.role_name(tag, zoo.tags.LEAD)`: `Recipe.lead_device`, `Recipe.lead_offload`).
    `tiles`: the recipe's sequence tiles. Differentiating the traced jaxpr rather than the module keeps each question
    to a fraction of a second for a 671B layer."""

    def __init__(self, model, stack_name: str, batch: int, seq: int, group: int = 1, tiles: int = 1,
                 keep: frozenset[str] = frozenset(), subgroup: int = 1):
        stack = model.stacks()[stack_name]
        self.group, self.keep, self.subgroup = group, frozenset(keep), subgroup
        self._stack, self._tiles = stack, tiles
        self._query_tiles = model.config.attention_tiles
        fn, state = stack.layer_fn(group=group, tiles=tiles)
        self.args, self._treedef = jax.tree.flatten((state, stack.abstract_input(batch, seq)))
        closed = self._trace(fn)
        tags = stack.tag_shapes(stack.abstract_input(batch, seq), tiles)
        self._tags = frozenset(tags)   # a saved set is read as its part in this layer (the rest changes nothing)
        # causal attention, whatever kernel runs (0 for a layer without attention)
        self.attention_flops = (attention_flops(tags["query_proj"], tags["value_proj"])
                                if {"query_proj", "value_proj", "context"} <= set(tags) else 0)
        self.forward_flops = flops(closed.jaxpr) // group + self.attention_flops
        self._fn = self._as_fn(closed)
        self._wrt = tuple(i for i, a in enumerate(self.args) if jnp.issubdtype(a.dtype, jnp.inexact))
        self._cache: dict = {}
        self._grad_none = self._grad_flops(Recipe.none().policy(), jax.checkpoint_policies.everything_saveable)

    def _trace(self, fn):
        return jax.make_jaxpr(lambda *a: fn(*jax.tree.unflatten(self._treedef, a))[0])(*self.args)

    @staticmethod
    def _as_fn(closed):
        as_fun = jax.extend.core.jaxpr_as_fun(closed)
        return lambda *a: as_fun(*a)[0]

    def _loss(self, policy, inner=None, lead=None):
        fn = self._fn
        if self.group > 1 and inner is not None:   # the group's layers, each under the checkpoint policy `inner`
            fn = self._as_fn(self._trace(self._stack.layer_fn(group=self.group, tiles=self._tiles,
                                                              layer_policy=inner, subgroup=self.subgroup,
                                                              lead_policy=lead)[0]))
        body = remat(fn, policy)
        return lambda *a: jnp.sum(body(*a).astype(jnp.float32))

    def _grad_flops(self, policy, inner=None, lead=None) -> int:
        grad = jax.grad(self._loss(policy, inner, lead), argnums=self._wrt)
        return flops(jax.make_jaxpr(grad)(*self.args).jaxpr)

    def residual_tags(self, emitted) -> frozenset[str]:
        """Tags JAX saves when every tag may be saved: those the backward pass needs (as `residual_tags`, at the
        planned shape)."""
        loss = self._loss(_all_saved(emitted).policy())
        return frozenset(r.tag for r in residuals(loss, *self.args) if r.tag is not None)

    def remat_flops(self, saved: frozenset[str]) -> int:
        """Forward FLOPs the backward pass re-runs, per layer, when the tags `saved` are kept (in HBM or on the host;
        a tag named as a group's first layer names it, `zoo.tags.role_name(tag, LEAD)`, for that layer alone)."""
        saved = self._known(saved)
        if saved not in self._cache:
            attention = self._attention_again(saved)
            self._cache[saved] = (self._grad_flops(*self.policies(saved)) - self._grad_none) // self.group + attention
        return self._cache[saved]

    def _known(self, saved) -> frozenset[str]:
        """`saved` as it changes this layer: its own tags, and its lead tags where it runs in groups."""
        lead = {tags_lib.role_name(t, LEAD) for t in self._tags} if self.group > 1 else set()
        return frozenset(saved) & (self._tags | lead)

    @staticmethod
    def _lead(saved) -> frozenset[str]:
        return frozenset(t for t, role in map(tags_lib.split_name, saved) if role == LEAD)

    def policies(self, saved: frozenset[str]) -> tuple:
        """(the group's policy, its layers', its first layer's or None) for the tags `saved` (in HBM), as a recipe
        keeping them builds them, with this cost's `keep`, for the matmuls re-run (the kernel's pair counts only
        whole: `_matmul_part`)."""
        saved = self._known(saved)
        lead, saved = self._lead(saved), frozenset(t for t in saved if t in self._tags)
        kept = tuple(sorted(_matmul_part(saved)))
        lead = tuple(sorted(_matmul_part(lead) - set(kept)))
        keep = tuple(sorted(_matmul_part(saved | self.keep) - set(kept)))
        r = Recipe("saved", device=kept, group=self.group if lead or keep else 1, group_keep=keep, lead_device=lead)
        return r.policy(), r.layer_policy(), r.lead_policy()

    def _attention_again(self, saved) -> int:
        """Attention's forward FLOPs run again, per layer, when the tags `saved` are kept: once, in each layer's own
        backward, unless both of the kernel's residuals are kept (zoo.recipe.TOGETHER); under query tiles
        (`attention_tiles`), once more in each tile's own backward. In a group of k layers whose layers do not keep
        the pair (`keep`) while its backward runs, the group's recompute runs attention again for every layer
        before its last subgroup (k - s of k, s = 1 for two levels) and each subgroup's for every layer before its
        last (s - 1 of s): a checkpoint's last layers make only its output, which the backward pass does not read
        (the compiled step's attention calls count this way: docs/internals.md). A group's first layer keeping the
        pair between the passes (a `lead` name in `saved`) runs it in neither, and the group's recompute runs it for
        the layers after the first (but the last, where they do not keep the pair)."""
        a, k, s = self.attention_flops, self.group, self.subgroup
        tiles = a if self._query_tiles > 1 else 0
        if ATTENTION_RESIDUALS <= saved:
            return tiles
        if k > 1 and ATTENTION_RESIDUALS <= self._lead(saved):   # two levels: the other k - 1 layers
            return a * ((k - 1) + (0 if ATTENTION_RESIDUALS <= self.keep else k - 2)) // k + tiles
        again = a
        if not ATTENTION_RESIDUALS <= saved | self.keep:
            again += a * ((k - s) * s + (s - 1) * k) // (k * s)
        return again + tiles

    @staticmethod
    def _kept(recipe: Recipe, emitted) -> frozenset[str]:
        lead = {tags_lib.role_name(t, LEAD) for t in recipe.resolve().lead if t in emitted}
        return frozenset(t for t in emitted if recipe.placement(t) != "remat") | lead

    def recipe_attention_flops(self, recipe: Recipe, emitted) -> int:
        """Of `recipe_flops`, attention's forward run again (0 where the recipe keeps the kernel's residuals)."""
        if recipe.special == "none":
            return self.attention_flops if self._query_tiles > 1 else 0
        return self._attention_again(self._kept(recipe, emitted))

    def recipe_flops(self, recipe: Recipe, emitted) -> int:
        """Forward FLOPs the backward pass re-runs under `recipe`."""
        return 0 if recipe.special == "none" else self.remat_flops(self._kept(recipe, emitted))


def _matmul_part(saved: frozenset[str]) -> frozenset[str]:
    """`saved` as it changes the matmuls re-run: the kernel's residuals only count together (attention's own FLOPs
    are counted from its shapes)."""
    return saved if ATTENTION_RESIDUALS <= saved else saved - ATTENTION_RESIDUALS


@functools.lru_cache(maxsize=64)
def layer_cost(cfg, stack_name: str, batch: int, seq: int, group: int = 1, tiles: int = 1,
               keep: frozenset[str] = frozenset(), subgroup: int = 1) -> LayerCost:
    return LayerCost(abstract_model(cfg), stack_name, batch, seq, group, tiles, keep, subgroup)


def _remade(fn, state, x, kept) -> tuple[list[Residual], int]:
    """(the residuals of `fn(state, x)` but views of the parameters, the bytes of those a recompute remakes: all but
    the tags `kept` and the named layer input)."""
    res = [r for r in residuals(lambda s, x: sum_outputs(fn(s, x)), state, x) if not _view_of_parameters(r)]
    return res, sum(r.nbytes for r in res if r.tag not in kept and r.tag != "decoder_layer_input")


def working_bytes(model, stack_name: str, batch: int, seq: int, recipe: Recipe, group: int = 1) -> int:
    """What the backward pass of one rematerialized group (one layer where `group` is 1) of `stack_name` holds at
    once beyond what the recipe keeps: the residuals one layer's recompute remakes (read off JAX's list for the layer
    differentiated as it is recomputed: the recipe's sequence tiles rematerialized on their own) less the tags the
    recipe keeps and its input (the plan counts those); in a group (two-level checkpoints), also the inputs of its
    other layers and what each keeps while the group's backward runs (`group_keep`), and in subgroups (three
    levels) the inputs of its other subgroups and of one subgroup's other layers instead of its layers'; plus the
    cotangents of its largest tensors: twice the largest residual and, for attention, its q, k, v, output and their
    gradients (one query tile's q and output under `attention_tiles`), and one sequence tile's (and query tile's)
    tagged tensors and their cotangents."""
    stack = model.stacks()[stack_name]
    x = stack.abstract_input(batch, seq)
    kept = {t for t in tags_lib.NAMES if recipe.placement(t) != "remat"}
    fn, state = stack.layer_fn(tiles=recipe.seq_tiles)
    res, remade = _remade(fn, state, x, kept | set(recipe.resolve().group_keep))
    if group > 1:
        fn, state = stack.layer_fn(group=group, tiles=recipe.seq_tiles, layer_policy=recipe.layer_policy(),
                                   lead_policy=recipe.lead_policy())
        # the first layer's tags as it names them: what it keeps between the passes the plan counts
        lead = {tags_lib.role_name(t, LEAD) for t in kept | set(recipe.resolve().lead)}
        held, more = _remade(fn, state, x, kept | lead)
        if recipe.subgroup > 1:
            # three levels: the group's recompute keeps its subgroups' inputs, not its layers' (JAX lists what the
            # layers keep under the subgroups' checkpoints without their tags, so the two-level list is read),
            # and one subgroup's backward its layers' inputs: k / s + s - 2 inputs beside the group's own, not k - 1
            k, s = group, recipe.subgroup
            more -= (k - 1 - (k // s - 1) - (s - 1)) * nbytes(x)
        res, remade = res + held, remade + more
    made = model.tag_shapes(batch, seq, recipe.seq_tiles)[stack_name]
    tags, in_query, query_tiles = made.tags, made.query_tiled, model.config.attention_tiles
    kernel = ("query_proj", "key_proj", "value_proj", "attention_out")
    attention = sum(nbytes(tags[t]) // (query_tiles if t in in_query else 1) for t in kernel if t in tags)
    largest = max((r.nbytes for r in res), default=0)
    # one tile's own tensors and their cotangents, while its backward step runs
    tile = 2 * sum(nbytes(tags[t]) for t in made.tiled - in_query) // recipe.seq_tiles
    tile += 2 * sum(nbytes(tags[t]) for t in in_query - set(kernel)) // query_tiles
    return remade + 2 * largest + 2 * attention + tile
