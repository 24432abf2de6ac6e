"""The scanned, rematerialized decoder stack: where a recipe is applied.

`num_layers` identical layers are created stacked (`nnx.vmap`, logical axis `layers`) and applied by one `nnx.scan` over
`nnx.remat(policy=recipe.policy(), prevent_cse=False)`; a recipe's `group` k scans over groups of k layers (sublinear
checkpointing) and its `seq_tiles` goes to each layer (`zoo.layers.block`). The stack owns its body (`Stack.layer_fn`)
and abstract input, which the planner measures. The traps it is built around: docs/internals.md, "The stack's traps".
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo import emitted as emitted_lib
from zoo import sharding
from zoo import tags as tags_lib
from zoo.logical import LAYERS


def _run(layer: nnx.Module, x: jax.Array, tiles: int = 1) -> tuple[jax.Array, Any]:
    out = layer(x) if tiles == 1 else layer(x, tiles=tiles)
    return out if isinstance(out, tuple) else (out, {})


def layer_body(layer: nnx.Module, x: jax.Array, tiles: int = 1) -> tuple[jax.Array, Any]:
    """One layer as the scan sees it: name the input first, then run the layer (its per-position parts in `tiles`
    sequence tiles). Returns (x, aux)."""
    x = tags_lib.name(x, "decoder_layer_input", ("batch", "seq", "embed"))
    return _run(layer, x, tiles)


def group_body(group: nnx.Module, x: jax.Array, tiles: int = 1, layer_policy=None, subgroup: int = 1,
               lead_policy=None) -> tuple[jax.Array, Any]:
    """A group of layers (`group`'s variables [k, ...]) as the scan sees it: the group's input named, then each layer
    in order, each rematerialized on its own under `layer_policy` (two-level checkpoints; None: the layers run
    plainly inside the group), runs of `subgroup` layers rematerialized together first (three levels). Returns (x,
    aux stacked over the k layers).

    The group's backward pass recomputes the group's forward keeping each layer's input and what `layer_policy`
    saves, then each layer's backward recomputes that layer alone: it holds k inputs and one layer's residuals, not k
    layers' residuals (JAX saves an inner checkpoint's inputs as residuals of the outer one). With subgroups of s
    layers the group's recompute keeps the k / s subgroups' inputs, and each subgroup's backward recomputes its s
    layers keeping theirs: at most k / s + s - 1 inputs at once, for one more forward pass of the group. The inner
    checkpoints prevent CSE: the group's recompute and a layer's own are the same expressions within one loop
    iteration, and XLA would merge them, keeping the group's intermediates alive until each layer's backward.

    With `lead_policy` the group's first layer runs under it instead, its tags named apart (`zoo.tags.role_name(tag,
    zoo.tags.LEAD)`), so the group's policy can keep what that layer alone keeps between the passes
    (`Recipe.lead_device`, `Recipe.lead_offload`).

    Args:
        group: the group's layers, their variables stacked [k, ...].
        x: the group's input [batch, seq, dim].
        tiles: sequence tiles of each layer's per-position parts.
        layer_policy: the checkpoint policy of each layer (and subgroup) inside the group; None runs them plainly.
        subgroup: layers per inner checkpoint between the group's and each layer's; 1: none (two levels). It must
            divide k.
        lead_policy: the checkpoint policy of the group's first layer, its tags named apart (`Recipe.lead_policy()`);
            None: the first layer runs as the others. Two levels only.

    Returns:
        (x, aux): the group's output and each layer's aux, stacked over the k layers.
    """
    x = tags_lib.name(x, "decoder_layer_input", ("batch", "seq", "embed"))
    if subgroup == 1 or layer_policy is None:
        return _layers(group, x, tiles, layer_policy, lead_policy)
    run = remat(lambda part, x: _layers(part, x, tiles, layer_policy), layer_policy, scanned=False)
    x, auxes = _in_order(run, grouped(group, subgroup), x)
    return x, jax.tree.map(lambda *a: jnp.concatenate(a), *auxes)


def _layers(group: nnx.Module, x: jax.Array, tiles: int, layer_policy, lead_policy=None) -> tuple[jax.Array, Any]:
    """The layers of `group` in order, each under `layer_policy` (None: plainly), the first under `lead_policy` with
    its tags named apart where one is given. Returns (x, aux stacked)."""
    run = functools.partial(_run, tiles=tiles)
    if layer_policy is not None:
        run = remat(lambda layer, x: _run(layer, x, tiles), layer_policy, scanned=False)
    first = run
    if lead_policy is not None:
        lead = remat(lambda layer, x: _run(layer, x, tiles), lead_policy, scanned=False)

        def first(layer, x):
            with tags_lib.role(tags_lib.LEAD):   # traced here: its names are the lead's
                return lead(layer, x)
    x, auxes = _in_order(run, group, x, first)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *auxes)


def _in_order(run: Callable, modules: nnx.Module, x: jax.Array, first: Callable | None = None
              ) -> tuple[jax.Array, list]:
    """`run(module, x) -> (x, aux)` over the modules stacked in `modules` (a leading axis), one after another (the
    first through `first`, where given). Returns (the last x, each one's aux)."""
    auxes = []
    for i in range(_leading(modules)):
        x, aux = (first if i == 0 and first is not None else run)(module_at(modules, i), x)
        auxes.append(aux)
    return x, auxes


def body_of(group: int, tiles: int, layer_policy=None, subgroup: int = 1, lead_policy=None
            ) -> Callable[[nnx.Module, jax.Array], tuple[jax.Array, Any]]:
    """The plain `(modules, x)` function the scan applies: `layer_body` (`group` 1) or `group_body` (its layers under
    `layer_policy`, in subgroups of `subgroup`, the first under `lead_policy` where given), with `tiles`; the layer's
    (or group's) variables that live in host memory brought into HBM first (`in_hbm`)."""
    def body(modules: nnx.Module, x: jax.Array) -> tuple[jax.Array, Any]:
        modules = in_hbm(modules)
        if group == 1:
            return layer_body(modules, x, tiles)
        return group_body(modules, x, tiles, layer_policy, subgroup, lead_policy)
    return body


def in_hbm(modules: nnx.Module) -> nnx.Module:
    """Bring a layer's (or group's) variables that live in pinned host memory into HBM.

    Called inside the rematerialized body, it copies a layer's slice in as the scan reaches it and again where the
    backward pass recomputes the layer, so HBM never holds the stack's parameters (`--params stream`:
    `zoo.opt_state`); the copy's transpose sends the layer's gradient to the host.

    Args:
        modules: a layer, or a group of layers, as the scan's body receives it.

    Returns:
        `modules` with those variables in HBM, the others as they are; `modules` itself where none is on the host.
    """
    graphdef, state = nnx.split(modules)
    if not any(sharding.in_host_memory(x) for x in jax.tree.leaves(state)):
        return modules
    return nnx.merge(graphdef, sharding.to_hbm(state))


def _leading(modules: nnx.Module) -> int:
    return jax.tree.leaves(nnx.state(modules))[0].shape[0]


def grouped(modules: nnx.Module, k: int) -> nnx.Module:
    """`modules` (variables [L, ...]) seen as L / k groups of k (variables [L / k, k, ...]; a reshape, no copy)."""
    graphdef, state = nnx.split(modules)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a.reshape((a.shape[0] // k, k) + a.shape[1:]), state))


def remat(fn: Callable, policy, *, scanned: bool = True) -> Callable:
    """`fn` rematerialized under the checkpoint `policy`: the one remat wrapper of the zoo (the stack and the planner's
    measures, zoo.plan.measure, use it).

    Args:
        fn: the function to rematerialize (an NNX module is its first argument).
        policy: the JAX checkpoint policy: what the backward pass may keep instead of recomputing.
        scanned: `fn` is a scan's whole body, whose recompute CSE cannot merge with its forward (they run in
            different iterations), so `prevent_cse=False`. Anything else, a checkpoint nested inside a body
            included, prevents CSE.

    Returns:
        `fn` under `nnx.remat`.
    """
    return nnx.remat(fn, policy=policy, prevent_cse=not scanned)


@functools.lru_cache(maxsize=64)
def _emitted(graphdef, treedef, leaves: tuple, x: jax.ShapeDtypeStruct, tiles: int = 1) -> tuple:
    state = jax.tree.unflatten(treedef, leaves)
    found, tiled = emitted_lib.read_tags(lambda s, x: layer_body(nnx.merge(graphdef, s), x, tiles), state, x)
    return tuple(found.items()), tiled


def stacked_modules(make: Callable[[nnx.Rngs], nnx.Module], n: int, rngs: nnx.Rngs) -> nnx.Module:
    """`n` modules `make(rngs)` builds, as one module whose variables have a leading `layers` axis of size n."""
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def create(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return create(rngs)


def scannable(modules: nnx.Module) -> nnx.Module:
    """`modules` as `nnx.scan` takes them: a new module over the same values (no data is copied), which the scan
    updates and the stack then drops.

    `nnx.scan` returns the state of every module it scans over, stacked, and writes it back into that module. Were
    it the stack's own layers, everything after the forward pass (the optimizer's update among it) would read the
    layers' parameters from that output: a copy of every layer's parameters, written a layer at a time and held from
    the forward pass to the update (for the 8B, 13 GiB of HBM at any length). Dropping it loses nothing: the layers'
    forward pass reads its variables and never writes them (a router's bias is moved after the step,
    `zoo.layers.moe.update_routing_bias`). It is also how a variable of an enclosing trace, which cannot be written
    here, is scanned.

    Args:
        modules: the layers (or groups of layers) the scan runs, their variables stacked on a leading axis.

    Returns:
        a module of the same structure whose variables hold the same values.
    """
    return nnx.merge(*nnx.split(modules), copy=True)


def module_at(modules: nnx.Module, index: int) -> nnx.Module:
    """Module `index` of `stacked_modules`' result (its variables sliced; gradients flow back into the stack)."""
    graphdef, state = nnx.split(modules)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))


class Stack(nnx.Module):
    """`num_layers` copies of one decoder layer, their variables stacked on a leading `layers` axis, applied in order
    by one `nnx.scan` over `nnx.remat` of the layer (or of a group of layers) under a recipe's checkpoint policy.

    Args:
        make_layer: builds one layer from `rngs` (a module whose `__call__(x)` returns x or (x, aux)).
        num_layers: the number of layers.
        rngs: the random generators; split over the layers (`nnx.split_rngs` and `nnx.vmap`).

    Examples:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.layers import MLP
        >>> from zoo.models.stack import Stack
        >>> stack = Stack(lambda rngs: MLP(dim=8, hidden=16, rngs=rngs), num_layers=4, rngs=nnx.Rngs(0))
        >>> y, aux = stack(jnp.ones((2, 4, 8)), jax.checkpoint_policies.nothing_saveable, group=2)
        >>> y.shape
        (2, 4, 8)
    """

    def __init__(self, make_layer: Callable[[nnx.Rngs], nnx.Module], *, num_layers: int, rngs: nnx.Rngs):
        if num_layers <= 0:
            raise ValueError(f"Stack: num_layers must be positive, got {num_layers}")
        self.layers = stacked_modules(make_layer, num_layers, rngs)
        self.num_layers = num_layers

    def apply_layer(self, index: int, x: jax.Array, policy, *, tiles: int = 1) -> tuple[jax.Array, Any]:
        """Layer `index` alone (no scan) under the checkpoint `policy`. Returns (x, its own aux)."""
        return remat(body_of(1, tiles), policy, scanned=False)(module_at(self.layers, index), x)

    def check_group(self, group: int, name: str = "the stack") -> None:
        """ValueError unless `group` divides the number of layers."""
        if self.num_layers % group:
            raise ValueError(f"group={group} does not divide the {self.num_layers} layers of {name}: a recipe's "
                             f"group must divide every stack's layer count")

    def __call__(self, x: jax.Array, policy, *, group: int = 1, tiles: int = 1,
                 layer_policy=None, subgroup: int = 1, lead_policy=None) -> tuple[jax.Array, Any]:
        """Apply every layer in order.

        Args:
            x: the stack's input [batch, seq, dim].
            policy: the JAX checkpoint policy of each rematerialized body (`Recipe.policy()`).
            group: layers per rematerialized body; it must divide the number of layers.
            tiles: sequence tiles of each layer's per-position parts.
            layer_policy: the checkpoint policy of each layer inside a group (`Recipe.layer_policy()`; default
                `policy`): two-level checkpoints.
            subgroup: layers per inner checkpoint inside a group (`group_body`); it must divide `group`.
            lead_policy: the checkpoint policy of each group's first layer, its tags named apart
                (`Recipe.lead_policy()`; None: as the others).

        Returns:
            (x, aux): the last layer's output and each layer's aux, stacked over the layers.
        """
        self.check_group(group)
        if group % subgroup:
            raise ValueError(f"subgroup={subgroup} does not divide group={group}: a group runs in whole subgroups")
        modules = self.layers if group == 1 else grouped(self.layers, group)
        layer_policy = policy if layer_policy is None else layer_policy
        body, n = body_of(group, tiles, layer_policy, subgroup, lead_policy), self.num_layers // group
        if n == 1:
            # XLA removes a while loop that runs once, and the host offloads inside it with it: measured on the
            # H200 (jax 0.11.2), a one-layer scan offloaded nothing. One layer (or group) is applied without a scan.
            x, aux = remat(body, policy, scanned=False)(module_at(modules, 0), x)
            aux = jax.tree.map(lambda a: a[None], aux)
        else:
            scan = nnx.scan(remat(body, policy), in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
            x, aux = scan(scannable(modules), x)
        if group > 1:   # [L / k, k, ...] -> [L, ...]
            aux = jax.tree.map(lambda a: a.reshape((self.num_layers,) + a.shape[2:]), aux)
        return x, aux

    def abstract_layer(self) -> tuple[nnx.GraphDef, Any]:
        """Graph definition and abstract state (ShapeDtypeStructs) of one layer of the stack."""
        graphdef, state = nnx.split(self.layers)
        return graphdef, jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state)

    def abstract_input(self, batch: int, seq: int) -> jax.ShapeDtypeStruct:
        """The [batch, seq, dim] input of a layer, as a ShapeDtypeStruct of the layers' activation dtype."""
        return jax.ShapeDtypeStruct((batch, seq, self.layers.dim), self.layers.dtype)

    def layer_fn(self, policy=None, *, group: int = 1, tiles: int = 1, layer_policy=None, subgroup: int = 1,
                 lead_policy=None) -> tuple[Callable, Any]:
        """(f, abstract state): one layer (`group` > 1: one group of that many layers, its state [group, ...], each
        layer under `layer_policy`, default `policy`, in subgroups of `subgroup`, the first under `lead_policy` where
        given) as a pure function f(state, x) -> (x, aux), rematerialized under the checkpoint `policy` as the scan
        runs it (None: not rematerialized), its per-position parts in `tiles` sequence tiles."""
        graphdef, state = self.abstract_layer()
        if group > 1:
            state = jax.tree.map(lambda a: jax.ShapeDtypeStruct((group,) + a.shape, a.dtype), state)
        fn = body_of(group, tiles, policy if layer_policy is None else layer_policy, subgroup, lead_policy)
        body = fn if policy is None else remat(fn, policy)
        return (lambda s, x: body(nnx.merge(graphdef, s), x)), state

    def tag_shapes(self, x: jax.ShapeDtypeStruct, tiles: int = 1) -> dict[str, jax.ShapeDtypeStruct]:
        """{tag: shape} that one layer of this stack emits for an input shaped like `x` (its per-position parts in
        `tiles` sequence tiles), read from a trace (cached per layer structure and input shape: building, planning
        and measuring a model trace it once)."""
        return dict(self._read(x, tiles)[0])

    def tiled_tags(self, x: jax.ShapeDtypeStruct, tiles: int) -> frozenset[str]:
        """The tags one layer makes inside its sequence tiles (`zoo.layers.tiles`) for an input shaped like `x`."""
        return self._read(x, tiles)[1]

    def _read(self, x: jax.ShapeDtypeStruct, tiles: int):
        graphdef, state = self.abstract_layer()
        leaves, treedef = jax.tree.flatten(state)
        return _emitted(graphdef, treedef, tuple(leaves), jax.ShapeDtypeStruct(x.shape, x.dtype), tiles)
