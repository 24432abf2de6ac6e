"""Reading tags off a trace: which tags a function or a layer emits, with their shapes and dtypes (`emitted`:
`jax.make_jaxpr`, no FLOPs, no memory, inside jits, conds and custom VJPs), so shapes are never written down twice. A
tag emitted more than once is one tensor made in chunks (`join_chunks`); the loop of sequence tiles is read as one
tensor per tag (`tiled_tags`).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from zoo import loop_guard
from zoo import tags as tags_lib
from zoo.jaxprs import sub_jaxprs


def join_chunks(tag: str, a: jax.ShapeDtypeStruct, b: jax.ShapeDtypeStruct, axis: int) -> jax.ShapeDtypeStruct:
    """A tag emitted more than once in one layer names one tensor made in sequence chunks (e.g. `MLP(seq_chunks=n)`):
    the chunks must agree on everything but the sequence axis (`axis`: 1 of [B, S, ...], the tag's
    `zoo.tags.seq_axis`), and the tag's shape is their concatenation. Anything else is two tensors under one name: a
    ValueError."""
    same = (a.dtype == b.dtype and len(a.shape) == len(b.shape) > axis
            and a.shape[:axis] + a.shape[axis + 1:] == b.shape[:axis] + b.shape[axis + 1:])
    if not same:
        raise ValueError(f"tag {tag!r} is emitted twice in one layer with shapes {a.shape} {a.dtype} and {b.shape} "
                         f"{b.dtype}; a tag names one tensor (sequence chunks of it differ only in the sequence axis)")
    return jax.ShapeDtypeStruct(a.shape[:axis] + (a.shape[axis] + b.shape[axis],) + a.shape[axis + 1:], a.dtype)


def _collect(jaxpr, found: dict[str, jax.ShapeDtypeStruct], tiled: set[str], tiles: int = 1) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            aval = eqn.outvars[0].aval
            shape, tag = tuple(aval.shape), eqn.params["name"]
            axis = tags_lib.seq_axis(tag)
            if tiles > 1:   # one tile of a tensor made in tiles (of the sequence or of queries): `tiles` of them
                shape = shape[:axis] + (shape[axis] * tiles,) + shape[axis + 1:]
                tiled.add(tag)
            sds = jax.ShapeDtypeStruct(shape, aval.dtype)
            found[tag] = join_chunks(tag, found[tag], sds, axis) if tag in found else sds
        elif loop_guard.is_tile_loop(eqn):
            for sub in sub_jaxprs(eqn.params):
                _collect(sub, found, tiled, tiles * eqn.params["length"])
        elif loop_guard.is_loop(eqn):
            loop_guard.check_loop(eqn)   # a loop holding no tag or offload has no tag to collect: not entered
        else:
            for sub in sub_jaxprs(eqn.params):
                _collect(sub, found, tiled, tiles)


def emitted(fn: Callable[..., Any], *args: Any) -> dict[str, jax.ShapeDtypeStruct]:
    """Trace `fn(*args)` abstractly and return {tag: shape and dtype} for every tag it emits, in order.

    `args` may be arrays or `jax.ShapeDtypeStruct`s; nothing is computed. ValueError for a tag emitted twice as two
    tensors (`join_chunks`) and for a loop holding a tag or an offload (`zoo.loop_guard`).
    """
    return read_tags(fn, *args)[0]


def tiled_tags(fn: Callable[..., Any], *args: Any) -> frozenset[str]:
    """The tags `fn(*args)` makes inside a loop of sequence tiles (`zoo.layers.tiles`), read from an abstract trace."""
    return read_tags(fn, *args)[1]


def read_tags(fn: Callable[..., Any], *args: Any) -> tuple[dict[str, jax.ShapeDtypeStruct], frozenset[str]]:
    """(`emitted(fn, *args)`, `tiled_tags(fn, *args)`) from one trace."""
    found: dict[str, jax.ShapeDtypeStruct] = {}
    tiled: set[str] = set()
    _collect(jax.make_jaxpr(fn)(*args).jaxpr, found, tiled)
    return found, frozenset(tiled)


def emitted_by(module: nnx.Module, x: jax.ShapeDtypeStruct) -> dict[str, jax.ShapeDtypeStruct]:
    """Tags emitted by an NNX module applied to an input of shape `x`, read from an abstract trace."""
    graphdef, state = nnx.split(module)
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    return emitted(lambda s, x: nnx.merge(graphdef, s)(x), state, x)
