"""Sequence tiles (ALST's tiled compute, arXiv:2506.13996): `tiled(fn, module, x, tiles)` computes a part of a layer
with no dependency across positions as `tiles` slices of the sequence in a loop of `jax.checkpoint`s, so only one tile's
intermediates exist at a time. A tag named inside keeps its full shape and placement but may not be offloaded; 16-bit
parameters enter in float32, so their summed gradient is rounded once.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.checks import check_positive
from zoo.loop_guard import TILE_SCOPE


def check_tiles(tiles: Any, seq: int | None = None, *, what: str = "seq_tiles") -> None:
    """ValueError unless `tiles` is a positive int that divides `seq` (when given)."""
    check_positive(what, tiles, optional=False, hint=" (sequence tiles of the per-position parts)")
    if seq is not None and seq % tiles:
        raise ValueError(f"{what}={tiles} does not divide the sequence length {seq}: the sequence is cut into "
                         f"{what} tiles of equal length")


def _widen(x):
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize < 4 else x


def rematerialized(fn: Callable[..., Any], module: Any, *, prevent_cse: bool = True) -> Callable[..., Any]:
    """`fn(module, *args)` as a function of `args` alone under `jax.checkpoint` with nothing saved: its backward
    recomputes it from its arguments. The module's parameters enter as arguments of the checkpoint (16-bit ones in
    float32, so a gradient summed over several calls is rounded once); `prevent_cse=False` inside a loop (as JAX
    advises)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    dtypes = jax.tree.map(lambda p: p.dtype, params)
    wide = jax.tree.map(_widen, params)

    def one(wide, rest, *args):
        m = nnx.merge(graphdef, jax.tree.map(lambda p, d: p.astype(d), wide, dtypes), rest)
        return fn(m, *args)

    body = jax.checkpoint(one, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=prevent_cse)
    return lambda *args: body(wide, rest, *args)


def write_tile(out: jax.Array, tile: jax.Array, start: jax.Array) -> jax.Array:
    """`out` with `tile` written at rows `start` of axis 1, where `out` holds zeros that no input of the
    differentiated function made (a loop's output, filled tile by tile from zeros).

    The forward pass is XLA's in-place dynamic-update-slice. The backward pass hands the output's cotangent on
    untouched and the tile's rows of it to `tile`. (JAX's own transpose of a dynamic-update-slice zeroes the tile's
    rows in the carried cotangent, which XLA does by copying the whole cotangent at every step of the loop; the rows
    it would zero only reach the zeros the loop started from.)

    Args:
        out: [B, S, ...], zeros at the tile's rows.
        tile: [B, T, ...], T <= S.
        start: the first row (an int32 scalar, traced in a loop).

    Returns:
        [B, S, ...]: `out` with rows `start` to `start + T` equal to `tile`.
    """
    return _write_tile(tile.shape[1], out, tile, start)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _write_tile(size, out, tile, start):
    return jax.lax.dynamic_update_slice_in_dim(out, tile, start, axis=1)


def _write_tile_fwd(size, out, tile, start):
    return _write_tile(size, out, tile, start), start


def _write_tile_bwd(size, start, ct):
    return ct, jax.lax.dynamic_slice_in_dim(ct, start, size, axis=1), None


_write_tile.defvjp(_write_tile_fwd, _write_tile_bwd)


def tile_loop(body: Callable[[jax.Array], Any], seq: int, tiles: int) -> Any:
    """`body(start)` for each of `tiles` tiles of a sequence of `seq` positions, one after another in one loop (the
    loop the tag reader and the loop guard know), each tile's outputs [B, seq / tiles, ...] written in place into the
    whole outputs [B, seq, ...] (`write_tile`).

    Args:
        body: the tile starting at row `start` (an int32 scalar, traced) to its outputs, a pytree of [B, T, ...]
            arrays; it slices what it reads itself, so the loop keeps no per-tile copy of the sequence.
        seq: the sequence length; `tiles` divides it.
        tiles: how many tiles.

    Returns:
        The whole outputs, [B, seq, ...] each.
    """
    size = seq // tiles
    whole = jax.tree.map(lambda t: jnp.zeros(t.shape[:1] + (seq,) + t.shape[2:], t.dtype),
                         jax.eval_shape(body, jnp.int32(0)))

    def step(out, start):
        return jax.tree.map(lambda o, t: write_tile(o, t, start), out, body(start)), None

    starts = jnp.arange(tiles, dtype=jnp.int32) * size
    with jax.named_scope(TILE_SCOPE):   # how the tag reader and the loop guard know the loop
        out, _ = jax.lax.scan(step, whole, starts)
    return out


def tiled(fn: Callable[[Any, jax.Array], Any], module: Any, x: jax.Array, tiles: int) -> Any:
    """`fn(module, x)` over `tiles` sequence tiles of x [B, S, ...] (axis 1), one at a time, each rematerialized on
    its own. `fn` must treat positions independently and return [B, S, ...] arrays (a pytree of them). Each tile's
    rows of x are sliced inside the loop and its outputs written into the whole outputs in place (`tile_loop`),
    so the loop keeps no per-tile copy of x. `module`: the NNX module(s) `fn` reads, whose parameters the loop takes
    as arguments (their gradient summed over the tiles in float32)."""
    if tiles == 1:
        return fn(module, x)
    check_tiles(tiles, x.shape[1])
    size = x.shape[1] // tiles

    def one(m, x, start):
        return fn(m, jax.lax.dynamic_slice_in_dim(x, start, size, axis=1))

    body = rematerialized(one, module, prevent_cse=False)
    return tile_loop(lambda start: body(x, start), x.shape[1], tiles)
