"""Explicit offload: the stack moves its offloaded residuals itself, a layer ahead of need.

Under the default mechanism (``offload_impl="xla"``) a recipe's offload is JAX's: the checkpoint policy marks
tagged tensors `Offloadable`, JAX copies each to pinned host memory where it is made and back where the backward
pass uses it, and XLA's scheduler decides how much of each copy hides under compute. Inside one scan iteration a
reload can only overlap the work of that same iteration that does not need it.

This module is the other way (``offload_impl="explicit"``), owned by the stack and invisible to recipes. It is a
`jax.custom_vjp` of the whole stack:

- forward: one scan over the layers computes each layer as is and returns its tagged tensors (read at the
  `zoo.tags.name` sites) as scan outputs: the recipe's `device` tags stay in HBM, its `offload` tags go to
  pinned host memory (`jax.memory.Space.Host`). With ``"explicit"`` each layer's offloaded tensors are written
  one iteration late (carried to iteration i+1, so the copy of layer i's tensors overlaps all of layer i+1's
  compute); the last layer's stay in HBM, where the backward pass starts. ``"explicit_prefetch"`` writes them
  in the iteration that makes them, like JAX.
- backward: one reverse scan. Iteration i starts copying layer i-1's offloaded tensors to the device
  (double buffering through the scan carry: they are the next iteration's input) while it computes layer i's
  backward from tensors that arrived during iteration i+1. Layer i's backward is `jax.vjp` of the layer run
  again with each saved tensor standing in for its recomputation (same value, the derivative still flows
  through the operation that made it), so exactly what the recipe recomputes is recomputed: nothing more.

Gradients are those of the recipe under JAX's mechanism (and of `none`), which tests check. Traps kept:
- only tags the backward pass needs move (JAX saves no residual the backward does not read, e.g. `mlpwo`);
- a one-layer stack is not scanned (XLA removes a loop that runs once, and the host copies in it);
- `decoder_layer_input` is the layer's input: offloading it moves the scan carry's checkpoint to the host.
- where the platform has no `pinned_host` memory the tensors simply stay where they are (same numbers).

Policies that offload nothing by name (e.g. `none`, `full`, device-only recipes) take the ordinary path.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo import tags as tags_lib
from zoo.models.config import OFFLOAD_IMPLS

INPUT = "decoder_layer_input"


# -- which tags go where: read off the checkpoint policy -------------------------------------------------------
def placements(policy) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(device tags, offloaded tags) of a checkpoint policy, by asking it about each tag of the vocabulary.

    Works for any policy that decides by name (`Recipe.policy()`, `save_and_offload_only_these_names`, ...);
    an offload is counted only if its destination is pinned host memory (the only one JAX moves to)."""
    from jax._src.ad_checkpoint import name_p  # the primitive `checkpoint_name` binds; policies see it

    aval = jax.core.ShapedArray((1,), jnp.float32)
    device, offload = [], []
    for tag in tags_lib.NAMES:
        got = policy(name_p, aval, name=tag)
        if isinstance(got, jax.ad_checkpoint.Offloadable):
            if got.dst == "pinned_host":
                offload.append(tag)
        elif got is True or got == jax.ad_checkpoint.Saveable:
            device.append(tag)
    return tuple(device), tuple(offload)


@functools.lru_cache(maxsize=1)
def host_memory_supported() -> bool:
    """Whether the default device has a `pinned_host` memory (GPU, TPU, and the CPU backend of jax >= 0.10)."""
    try:
        return "pinned_host" in {m.kind for m in jax.devices()[0].addressable_memories()}
    except Exception:  # a backend without memories
        return False


def to_host(tree):
    if not host_memory_supported():
        return tree
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Host), tree)


def to_device(tree):
    if not host_memory_supported():
        return tree
    return jax.tree.map(lambda a: jax.device_put(a, jax.memory.Space.Device), tree)


# -- the saved tensor standing in for a recomputed one ---------------------------------------------------------
@jax.custom_jvp
def stand_in(recomputed: jax.Array, saved: jax.Array) -> jax.Array:
    """`saved`'s value with `recomputed`'s derivative: the recomputation itself is dead code (XLA drops it)."""
    return saved


@stand_in.defjvp
def _stand_in_jvp(primals, tangents):
    _, saved = primals
    d_recomputed, _ = tangents
    return saved, d_recomputed


# -- one layer, reading or substituting its tags -----------------------------------------------------------------
def _run_layer(graphdef, p, x, tags: frozenset, saved: dict | None = None):
    """(y, aux, {tag: tensor}) of one layer. With `saved`, those tensors stand in for their recomputation."""
    from zoo.models.stack import layer_body

    seen: dict[str, jax.Array] = {}

    def hook(v, tag):
        if tag not in tags:
            return v
        if saved is None:
            seen[tag] = v
            return v
        return stand_in(v, saved[tag])

    layer = nnx.merge(graphdef, p)
    with tags_lib.intercepted(hook):
        y, aux = layer_body(layer, x)
    after = jax.tree.leaves(nnx.split(layer)[1])
    if any(a is not b for a, b in zip(after, jax.tree.leaves(p))):
        raise ValueError("offload_impl='explicit': a layer changed its own state while running; the explicit "
                         "mechanism applies layers as pure functions (use offload_impl='xla')")
    if saved is None and set(seen) != set(tags):
        raise ValueError(f"offload_impl='explicit': the layer emitted {sorted(seen)} of the tags "
                         f"{sorted(tags)} while tracing; a tag site inside a nested transform cannot be read")
    return y, aux, seen


_NEEDED: dict[Any, frozenset] = {}


def needed_tags(graphdef, layer_state, x, candidates: tuple[str, ...]) -> frozenset:
    """Tags among `candidates` that one layer's backward pass reads (JAX's own answer, cached per shapes)."""
    from zoo.models.stack import layer_body
    from zoo.plan import measure as audit

    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), layer_state)
    xa = jax.ShapeDtypeStruct(x.shape, x.dtype)
    try:
        key = (graphdef, jax.tree.structure(abstract), tuple((a.shape, a.dtype) for a in jax.tree.leaves(abstract)),
               (xa.shape, xa.dtype), candidates)
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _NEEDED:
        return _NEEDED[key]
    policy = jax.checkpoint_policies.save_only_these_names(*candidates)
    body = jax.checkpoint(lambda s, x: layer_body(nnx.merge(graphdef, s), x), policy=policy, prevent_cse=False)
    found = frozenset(r.tag for r in audit.residuals(lambda s, x: audit.sum_outputs(body(s, x)), abstract, xa)
                      if r.tag in candidates)
    if key is not None:
        _NEEDED[key] = found
    return found


# -- helpers over pytrees with integer leaves --------------------------------------------------------------------
def _is_float(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def _float0_like(a):
    return np.zeros(a.shape, dtype=jax.dtypes.float0)


def _index(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


# -- the stack -----------------------------------------------------------------------------------------------------
def apply(stack, x: jax.Array, policy, impl: str):
    """Apply `stack` (a `zoo.models.Stack`) to `x` under `policy` with the explicit mechanism `impl`.

    Returns (y, aux stacked over layers), or None when the policy offloads no tag (nothing to move: the caller
    takes its ordinary path)."""
    if impl not in OFFLOAD_IMPLS or impl == "xla":
        raise ValueError(f"offload_impl must be one of {OFFLOAD_IMPLS[1:]} here, got {impl!r}")
    device, offload = placements(policy)
    if not offload:
        return None
    graphdef, state = nnx.split(stack.layers)
    layer_state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state)
    candidates = tuple(t for t in device + offload if t != INPUT)
    needed = needed_tags(graphdef, layer_state, x, candidates)
    dev_tags = tuple(t for t in device if t in needed)
    off_tags = tuple(t for t in offload if t in needed)
    input_offloaded = INPUT in offload
    if not off_tags and not input_offloaded:
        return None  # the offloaded tags are not residuals of this stack (e.g. moe_* in a dense stack)
    fn = _explicit(graphdef, frozenset(dev_tags + off_tags), dev_tags, off_tags, input_offloaded,
                   num_layers=stack.num_layers, defer_store=impl == "explicit")
    return fn(state, x)


def _explicit(graphdef, tags, dev_tags, off_tags, input_offloaded, *, num_layers: int, defer_store: bool):
    L = num_layers
    run = functools.partial(_run_layer, graphdef, tags=tags)

    def split_saved(x, seen):
        """(what stays in HBM, what goes to the host) of one layer's residuals."""
        dev = {t: seen[t] for t in dev_tags}
        off = {t: seen[t] for t in off_tags}
        if input_offloaded:
            off[INPUT] = x
        return dev, off

    def layer_vjp(p, x_keep, dev, off, ct_y, ct_aux):
        """(d float leaves of the layer state, d x) of one layer from its saved tensors and the cotangents
        of its outputs; `ct_aux` is a list over aux leaves, None where a leaf is not a float."""
        saved = {**dev, **{t: off[t] for t in off_tags}}
        x_in = off[INPUT] if input_offloaded else x_keep
        leaves, treedef = jax.tree.flatten(p)
        is_f = [_is_float(a) for a in leaves]

        def f(pf, x):
            it = iter(pf)
            full = [next(it) if m else a for a, m in zip(leaves, is_f)]
            y, aux, _ = run(jax.tree.unflatten(treedef, full), x, saved=saved)
            return y, aux

        (_, aux), vjp = jax.vjp(f, [a for a, m in zip(leaves, is_f) if m], x_in)
        aux_leaves, aux_tree = jax.tree.flatten(aux)
        cts = [c if c is not None else _float0_like(a) for a, c in zip(aux_leaves, ct_aux)]
        d_pf, dx = vjp((ct_y, jax.tree.unflatten(aux_tree, cts)))
        return d_pf, dx

    def float_cts(ct_aux) -> list:
        """The aux cotangents as a list over leaves, None for integer outputs (their cotangents are float0)."""
        return [None if c.dtype == jax.dtypes.float0 else c for c in jax.tree.leaves(ct_aux)]

    def join_grads(state, d_float):
        """Gradients shaped like `state`: the computed ones for float leaves, float0 zeros for the others."""
        leaves, treedef = jax.tree.flatten(state)
        it = iter(d_float)
        return jax.tree.unflatten(treedef, [next(it) if _is_float(a) else _float0_like(a) for a in leaves])

    def primal(state, x):
        if L == 1:
            y, aux, _ = run(_index(state, 0), x)
            return y, jax.tree.map(lambda a: a[None], aux)

        def body(x, p):
            y, aux, _ = run(p, x)
            return y, aux
        return jax.lax.scan(body, x, state)

    @jax.custom_vjp
    def stack_fn(state, x):
        return primal(state, x)

    # -- one layer: no scan (XLA drops a loop that runs once, and the host copies in it) ----------------------
    def fwd_one(state, x):
        y, aux, seen = run(_index(state, 0), x)
        dev, off = split_saved(x, seen)
        res = (state, None if input_offloaded else x, dev, to_host(off))
        return (y, jax.tree.map(lambda a: a[None], aux)), res

    def bwd_one(res, cts):
        state, x_keep, dev, off_host = res
        ct_y, ct_aux = cts
        ct_a = [None if c is None else c[0] for c in float_cts(ct_aux)]
        d_pf, dx = layer_vjp(_index(state, 0), x_keep, dev, to_device(off_host), ct_y, ct_a)
        return join_grads(state, [d[None] for d in d_pf]), dx

    # -- a scanned stack --------------------------------------------------------------------------------------
    def fwd_scan(state, x):
        if defer_store:
            # layer i's offloaded tensors are written in iteration i+1; slot 0 holds zeros (one layer of host
            # memory and one copy unused), the last layer's stay on the device for the backward pass.
            p0 = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state)
            shapes = jax.eval_shape(lambda p, x: split_saved(x, run(p, x)[2])[1], p0, x)
            pending0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        else:
            pending0 = None

        def body(carry, p):
            x, pending = carry
            y, aux, seen = run(p, x)
            dev, off = split_saved(x, seen)
            if defer_store:
                store, pending = to_host(pending), off
            else:
                store = to_host(off)
            return (y, pending), (aux, None if input_offloaded else x, dev, store)

        (y, last), (aux, xs, dev, host) = jax.lax.scan(body, (x, pending0), state)
        return (y, aux), (state, xs, dev, host, last)

    def bwd_scan(res, cts):
        state, xs, dev, host, last = res
        ct_y, ct_aux = cts
        if defer_store:
            # host[j] holds layer j-1's tensors (host[0]: zeros, fetched and unused): reading it as scan input j
            # is the very pattern of JAX's own offload, which XLA turns into an asynchronous host-to-device copy.
            first, ahead = last, host
        else:
            # host[j] holds layer j's: layer j-1's are read at an index computed from the layer number.
            first, ahead = to_device(_index(host, L - 1)), jnp.arange(L)

        def body(carry, inp):
            ct_x, cur = carry
            p, x_keep, d, ct_a, a = inp
            h = a if defer_store else _index(host, jnp.maximum(a - 1, 0))
            nxt = to_device(h)                                       # layer j-1's: arrives during this iteration
            d_pf, dx = layer_vjp(p, x_keep, d, cur, ct_x, ct_a)
            return (dx, nxt), d_pf

        (dx, _), d_pf = jax.lax.scan(body, (ct_y, first), (state, xs, dev, float_cts(ct_aux), ahead), reverse=True)
        return join_grads(state, d_pf), dx

    if L == 1:
        stack_fn.defvjp(fwd_one, bwd_one)
    else:
        stack_fn.defvjp(fwd_scan, bwd_scan)
    return stack_fn
