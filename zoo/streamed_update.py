"""The optimizer update streamed through HBM a slice at a time, for optimizer state in pinned host memory (`--opt-state
host`, `--params host`: `zoo.opt_state`).

The clip's norm is computed once over the gradients; then each parameter's arrays are cut into equal chunks (`chunking`)
and the parameters with as many chunks are updated in one `jax.lax.fori_loop` that brings chunk i of each into HBM,
updates it (the NaN guard's select included) and writes it back in place. HBM holds a few chunks, never the state; the
numbers are the unstreamed update's up to an ulp (docs/internals.md, "The streamed update").
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from zoo.logical import axis_names, mesh_axes, stacked
from zoo.optim import TxParts, parts_of
from zoo.sharding import in_host_memory

CHUNK_BYTES = 256 * 2 ** 20   # the most one chunk of a parameter that is not stacked takes, in its widest dtype
_KEY = "params"               # the key of the tuple of parameters in the trees the elementwise transform runs on


def on_host(x) -> bool:
    """Whether array (or tracer) `x` lives in host memory."""
    return in_host_memory(x)


def _over_slices(x: jax.Array, fn: Callable[[jax.Array], jax.Array]) -> jax.Array:
    """The float32 sum of `fn` over `x`: at once for an array in HBM; for one in host memory, over its slices along
    the first axis, each brought into HBM in turn (a `jax.lax.fori_loop`), so that HBM never holds it whole."""
    if not on_host(x):
        return fn(x).astype(jnp.float32)
    if x.ndim == 0 or x.shape[0] == 1:
        return fn(jax.device_put(x, jax.memory.Space.Device)).astype(jnp.float32)

    def body(i, total):
        piece = jax.device_put(jax.lax.dynamic_slice_in_dim(x, i, 1, 0), jax.memory.Space.Device)
        return total + fn(piece).astype(jnp.float32)
    return jax.lax.fori_loop(0, x.shape[0], body, jnp.zeros((), jnp.float32))


def global_norm(tree) -> jax.Array:
    """The global L2 norm of a tree, its leaves in host memory read a slice at a time.

    Args:
        tree: a pytree of arrays (gradients); a leaf in host memory is read along its first axis, one slice in HBM
            at a time, and summed in float32.

    Returns:
        a float32 scalar: `optax.global_norm(tree)` itself where every leaf is in HBM.
    """
    leaves = jax.tree.leaves(tree)
    if not any(on_host(x) for x in leaves):
        return optax.global_norm(tree)
    return jnp.sqrt(sum(_over_slices(x, lambda a: jnp.sum(jnp.square(a.astype(jnp.float32)))) for x in leaves))


def all_finite(leaves: list) -> jax.Array:
    """Whether every array of a list is finite, those in host memory read a slice at a time (the others at once):
    `zoo.train_step.all_finite` for state in pinned host memory.

    Args:
        leaves: floating-point arrays, at least one.

    Returns:
        a boolean scalar.
    """
    return sum(_over_slices(x, lambda a: jnp.sum(~jnp.isfinite(a))) for x in leaves) == 0


def hosted(optimizer: nnx.Optimizer) -> bool:
    """Whether any of `optimizer`'s state lives in host memory: its update must then be streamed (`update`)."""
    return any(on_host(x) for x in jax.tree.leaves(nnx.as_pure(nnx.state(optimizer))))


class _Leaf(NamedTuple):
    """One parameter as the streamed update sees it: its Variable, gradient, master Variable (or None) and
    per-parameter state Variables (in the order of the elementwise state's leaves), cut into `chunks` along
    `axis`."""
    param: nnx.Variable
    grad: jax.Array
    master: nnx.Variable | None
    states: list
    axis: int
    chunks: int


class _Update(NamedTuple):
    """What every chunk's update shares: the transform's parts, the per-parameter flags of its state's leaves
    (`_template`), the old shared scalars, the clip's global norm and the guard's verdict."""
    parts: TxParts
    flags: list
    shared: list
    norm: jax.Array
    ok: jax.Array


def _variables(tree) -> list:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _template(parts: TxParts, m: int = 1) -> tuple[Any, list[bool]]:
    """(structure, flags) of the elementwise transform's state over a tuple of `m` parameters. A flag per leaf of
    the one-parameter state says whether it is per-parameter (a tree like the parameters': a run of `m` leaves in
    the structure, one per parameter, in their order) or a scalar the parameters share (the step counts)."""
    def state(k: int):
        return jax.eval_shape(parts.elementwise.init, {_KEY: (jax.ShapeDtypeStruct((0,), jnp.float32),) * k})
    paths = jax.tree_util.tree_flatten_with_path(state(1))[0]
    flags = [any(isinstance(k, jax.tree_util.DictKey) and k.key == _KEY for k in path) for path, _ in paths]
    return jax.tree.structure(state(m)), flags


def _split(flags: list[bool], leaves: list, m: int) -> tuple[list, list[list]]:
    """(shared scalars, per-parameter leaves [parameter][flag]) of the leaves of a state over `m` parameters."""
    if sum(m if f else 1 for f in flags) != len(leaves):
        raise ValueError(f"streamed update: the optimizer's state has {len(leaves)} leaves, not those of its "
                         f"elementwise transform over {m} parameters")
    shared, runs, it = [], [], iter(leaves)
    for f in flags:
        if f:
            runs.append([next(it) for _ in range(m)])
        else:
            shared.append(next(it))
    return shared, [list(per) for per in zip(*runs)] if runs else [[] for _ in range(m)]


def _join(flags: list[bool], shared: list, per_param: list[list]) -> list:
    """`_split`'s inverse: the leaves of a state from its shared scalars and per-parameter leaves."""
    shared, runs = iter(shared), iter(zip(*per_param))
    return [leaf for f in flags for leaf in (next(runs) if f else (next(shared),))]


def chunking(param: nnx.Variable, itemsize: int) -> tuple[int, int]:
    """(axis, number of equal chunks) a parameter's arrays are streamed in: a stacked parameter (logical axis
    `layers` first) one layer per chunk; any other the fewest chunks of at most `CHUNK_BYTES` (at `itemsize`
    bytes an element) along its first axis the active sharding rules leave whole (a chunk is then a local slice
    on every device); a 0-d or 1-d one, or one with every axis split, whole."""
    shape = param.shape
    names = axis_names(param)
    if stacked(param):
        return 0, shape[0]
    whole = [a for a in range(len(shape)) if a >= len(names) or names[a] is None or not mesh_axes(names[a])]
    if len(shape) < 2 or not whole:
        return 0, 1
    axis, size = whole[0], shape[whole[0]]
    nbytes = math.prod(shape) * itemsize
    return axis, next(d for d in range(1, size + 1) if size % d == 0 and (nbytes <= d * CHUNK_BYTES or d == size))


def _plan(model: nnx.Module, optimizer: nnx.Optimizer) -> tuple[TxParts, list[bool], list, list]:
    """(parts, flags, shared scalar Variables, (parameter, master or None, per-parameter state) Variables per
    parameter); ValueError for an optimizer `zoo.optim.make_optimizer` did not make."""
    parts = parts_of(optimizer)
    if parts is None:
        raise ValueError("optimizer state in host memory is updated a slice at a time (zoo.streamed_update), which "
                         "needs an optimizer made by zoo.optim.make_optimizer (its transform's parts)")
    masters, inner = parts.states(optimizer.opt_state)
    params = _variables(nnx.state(model, optimizer.wrt))
    flags = _template(parts)[1]
    shared, states = _split(flags, _variables(inner), len(params))
    masters = [None] * len(params) if masters is None else _variables(masters)
    for p, s in zip(params, states):
        if any(v.shape != p.shape for v in s):
            raise ValueError(f"streamed update: a per-parameter state of shape {[v.shape for v in s]} for a "
                             f"parameter of shape {p.shape}")
    return parts, flags, shared, list(zip(params, masters, states))


def unguarded(model: nnx.Module, optimizer: nnx.Optimizer):
    """An nnx filter of the state `update` does not guard itself (the caller's NaN guard selects it): all but the
    parameters and their per-parameter optimizer state (moments, master)."""
    own = {id(v) for p, m, s in _plan(model, optimizer)[-1] for v in (p, m, *s) if v is not None}
    return lambda path, v: id(v) not in own


def _clip(g: jax.Array, norm: jax.Array, max_norm: float) -> jax.Array:
    """`optax.clip_by_global_norm`'s scaling of one gradient, given the global norm it computes: its expression."""
    return jax.lax.select(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm)


def _update_chunks(u: _Update, grads: list, params: list, masters: list, states: list[list]):
    """(parameters, masters, states) of one chunk of each of a group's parameters, every array in HBM: the clip,
    one update of the elementwise transform over the tuple of chunks (as the unstreamed update runs it over the
    parameters, so XLA rewrites the expressions alike: its algebraic simplifier's rewrites depend on how many
    users a scalar has), against the masters if there are any (weight decay reads them), the parameters (the new
    masters rounded, with masters), and the NaN guard's select (the old chunks where `u.ok` is False).
    `states[j]`: parameter j's per-parameter state chunks."""
    m, master = len(grads), u.parts.master
    if master:
        grads = [g.astype(jnp.float32) for g in grads]   # zoo.optim.with_master clips and updates float32 gradients
    grads = tuple(_clip(g, u.norm, u.parts.clip) for g in grads)
    state = jax.tree.unflatten(_template(u.parts, m)[0], _join(u.flags, u.shared, states))
    steps, new = u.parts.elementwise.update({_KEY: grads}, state, {_KEY: tuple(masters if master else params)})
    new_states = _split(u.flags, jax.tree.leaves(new), m)[1]
    if master:
        new_masters = [optax.apply_updates(w, s) for w, s in zip(masters, steps[_KEY])]
        new_params = [w.astype(p.dtype) for w, p in zip(new_masters, params)]
    else:
        new_masters = masters
        new_params = [optax.apply_updates(p, s) for p, s in zip(params, steps[_KEY])]
    keep = functools.partial(jax.tree.map, functools.partial(jnp.where, u.ok))
    return keep(new_params, params), keep(new_masters, masters), keep(new_states, states)


def _take(x: jax.Array, axis: int, start, size: int) -> jax.Array:
    """Chunk [start, start + size) of `x` along `axis`, in HBM."""
    chunk = x if size == x.shape[axis] else jax.lax.dynamic_slice_in_dim(x, start, size, axis)
    return jax.device_put(chunk, jax.memory.Space.Device) if on_host(x) else chunk


def _give(x: jax.Array, chunk: jax.Array, axis: int, start) -> jax.Array:
    """`x` with `chunk` written at `start` along `axis`, in `x`'s memory."""
    if on_host(x):
        chunk = jax.device_put(chunk, jax.memory.Space.Host)
    return chunk if chunk.shape == x.shape else jax.lax.dynamic_update_slice_in_dim(x, chunk, start, axis)


def _chunk_step(u: _Update, leaves: list[_Leaf], i, carry: list) -> list:
    """`carry` (per parameter of a group: its parameter, master or None, states) with chunk `i` of each parameter
    updated (`_update_chunks`) and written back."""
    takes, gives = [], []
    for leaf in leaves:
        size = leaf.grad.shape[leaf.axis] // leaf.chunks
        takes.append(functools.partial(_take, axis=leaf.axis, start=i * size, size=size))
        gives.append(functools.partial(_give, axis=leaf.axis, start=i * size))
    new = _update_chunks(u, [take(leaf.grad) for take, leaf in zip(takes, leaves)],
                         [take(p) for take, (p, _, _) in zip(takes, carry)],
                         [None if w is None else take(w) for take, (_, w, _) in zip(takes, carry)],
                         [[take(s) for s in states] for take, (_, _, states) in zip(takes, carry)])
    return [(give(p, new_p), None if w is None else give(w, new_w), [give(s, c) for s, c in zip(states, new_s)])
            for give, (p, w, states), new_p, new_w, new_s in zip(gives, carry, *new)]


def _run(u: _Update, leaves: list[_Leaf], n: int) -> None:
    """Update a group of parameters (`leaves`, each in `n` chunks) in place: chunk by chunk in a
    `jax.lax.fori_loop` whose carry is their arrays (host arrays included, written in place), or at once for
    `n` = 1."""
    def body(i, carry):
        return _chunk_step(u, leaves, i, carry)

    carry = [(leaf.param[...], None if leaf.master is None else leaf.master[...], [s[...] for s in leaf.states])
             for leaf in leaves]
    carry = body(0, carry) if n == 1 else jax.lax.fori_loop(0, n, body, carry)
    for leaf, (p, master, states) in zip(leaves, carry):
        leaf.param[...] = p
        if leaf.master is not None:
            leaf.master[...] = master
        for var, x in zip(leaf.states, states):
            var[...] = x


def _shared_after(u: _Update, states: list, ref_dtype) -> list:
    """The shared scalars after the update (they depend on nothing else): those of the elementwise transform's
    update of one empty parameter, with empty per-parameter `states` of their dtypes."""
    empty = [[jnp.zeros((0,), x.dtype) for x in states]]
    state = jax.tree.unflatten(_template(u.parts)[0], _join(u.flags, u.shared, empty))
    zeros = {_KEY: (jnp.zeros((0,), ref_dtype),)}
    return _split(u.flags, jax.tree.leaves(u.parts.elementwise.update(zeros, state, zeros)[1]), 1)[0]


def _groups(per_param: list, grads: list) -> dict[int, list[_Leaf]]:
    """The parameters by their number of chunks (`chunking`, at the widest dtype of their arrays)."""
    groups: dict[int, list[_Leaf]] = {}
    for (p, master, states), g in zip(per_param, grads):
        widest = max(jnp.dtype(x.dtype).itemsize for x in (g, p, *states, *([master] if master is not None else [])))
        axis, n = chunking(p, widest)
        groups.setdefault(n, []).append(_Leaf(p, g, master, states, axis, n))
    return groups


def update(model: nnx.Module, optimizer: nnx.Optimizer, grads, *, ok: jax.Array) -> None:
    """`optimizer.update(model, grads)` streamed (module docstring), with the NaN guard's select of the parameters
    and their per-parameter state done per chunk: where `ok` (decided before the update) is False they keep their
    values. The shared scalars and `optimizer.step` are updated unguarded: the caller selects them (`unguarded`)."""
    parts, flags, shared, per_param = _plan(model, optimizer)
    grads = nnx.as_pure(nnx.state(grads, optimizer.wrt))
    if len(jax.tree.leaves(grads)) != len(per_param):
        raise ValueError(f"streamed update: {len(jax.tree.leaves(grads))} gradients for {len(per_param)} parameters")
    # The clip's norm, of the gradients the clip sees (zoo.optim.with_master upcasts them first).
    if any(on_host(g) for g in jax.tree.leaves(grads)):   # streamed parameters' gradients: read a slice at a time
        norm = global_norm(grads)
    else:
        norm = optax.tree.norm(jax.tree.map(lambda g: g.astype(jnp.float32), grads) if parts.master else grads)
    u = _Update(parts, flags, [v[...] for v in shared], norm, ok)
    new_shared = _shared_after(u, [s[...] for s in per_param[0][2]], jnp.float32 if parts.master else
                               per_param[0][0].dtype)
    for n, leaves in _groups(per_param, jax.tree.leaves(grads)).items():
        _run(u, leaves, n)
    for var, x in zip(shared, new_shared):
        var[...] = x
    optimizer.step[...] += 1
