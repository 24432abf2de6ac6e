"""Checking that a recipe does what it says, on any machine (no GPU needed).

Two views of what JAX saves between the forward and the backward pass under the model's recipe:

- `layer_residuals`: one layer of a stack under the recipe's policy; residuals carry their tag names, so each
  tag's placement can be read off: on the host (`offload`), in HBM (`device`), or absent (`remat`).
- `model_residuals`: the whole model's loss; residuals of a scanned stack come out stacked over the layer axis,
  one per saved tag, and host residuals are marked as such.

`placements_seen` turns the first into {tag: placement}, which tests compare with `recipe.placements(...)`.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.models.config import dtype_of
from zoo.models.stack import layer_body

try:  # public in newer JAX releases
    from jax.ad_checkpoint import saved_residuals as _saved_residuals  # type: ignore[attr-defined]
except ImportError:  # jax <= 0.11: same function, private module
    from jax._src.ad_checkpoint import saved_residuals as _saved_residuals

_NAMED = re.compile(r"named '([^']+)'")


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


def _is_host(aval) -> bool:
    space = getattr(aval, "memory_space", None)
    return "host" in str(space).lower() or "<host>" in str(aval)


def residuals(fn, *args) -> list[Residual]:
    """Residuals JAX saves to differentiate `fn(*args)` (a scalar function), excluding the arguments."""
    out = []
    for aval, src in _saved_residuals(fn, *args):
        if src.startswith("from the argument"):
            continue
        m = _NAMED.search(src)
        out.append(Residual(tuple(aval.shape), aval.dtype, _is_host(aval), m.group(1) if m else None, src))
    return out


def sum_outputs(tree) -> jax.Array:
    return sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(tree))


def layer_residuals(model, stack_name: str, batch: int, seq: int) -> list[Residual]:
    """Residuals of one layer of `stack_name` under the model's recipe, for a [batch, seq] input."""
    stack = model.stacks()[stack_name]
    graphdef, state = stack.abstract_layer()
    x = jax.ShapeDtypeStruct((batch, seq, model.config.dim), dtype_of("dtype", model.config.dtype))
    body = jax.checkpoint(lambda s, x: layer_body(nnx.merge(graphdef, s), x), policy=model.recipe.policy(),
                          prevent_cse=False)
    return residuals(lambda s, x: sum_outputs(body(s, x)), state, x)


def placements_seen(model, stack_name: str, batch: int = 1, seq: int = 8) -> dict[str, str]:
    """{tag: 'device' | 'offload' | 'remat'} as JAX really saves the tags of one layer of `stack_name`.

    Device residuals carry their tag's name. A host residual is reported as the output of the copy to the host,
    without the name, so host residuals are matched to the emitted tags by shape and dtype; tags with equal
    shapes (key and value in GQA) are interchangeable there, and so are their bytes."""
    x = jax.ShapeDtypeStruct((batch, seq, model.config.dim), dtype_of("dtype", model.config.dtype))
    emitted = model.stacks()[stack_name].tag_shapes(x)
    seen = {t: "remat" for t in emitted}
    host = []
    for r in layer_residuals(model, stack_name, batch, seq):
        if r.tag is not None:
            seen[r.tag] = "offload" if r.host else "device"
        elif r.host:
            host.append((r.shape, jnp.dtype(r.dtype)))
    # Prefer the tags the recipe offloads when shapes tie, so that a faithful recipe reads back as itself.
    order = sorted(emitted, key=lambda t: model.recipe.placement(t) != "offload")
    for shape, dtype in host:
        for t in order:
            if seen[t] == "remat" and emitted[t].shape == shape and jnp.dtype(emitted[t].dtype) == dtype:
                seen[t] = "offload"
                break
        else:
            raise AssertionError(f"host residual {dtype}{list(shape)} matches no tag of {stack_name}")
    return seen


def residual_tags(model, stack_name: str) -> tuple[str, ...]:
    """Tags of `stack_name` that the backward pass needs at all: those JAX saves when every tag may be saved.

    A tag outside this set (e.g. the MLP's down projection, whose value only flows into the residual sum) costs
    nothing under any placement; the planner counts it as zero bytes."""
    from zoo.recipe import Recipe

    x = jax.ShapeDtypeStruct((1, 8, model.config.dim), dtype_of("dtype", model.config.dtype))
    emitted = tuple(model.stacks()[stack_name].tag_shapes(x))
    recipe = model.recipe
    try:
        model.recipe = Recipe("all_saved", device=emitted)
        return tuple(t for t in emitted if t in {r.tag for r in layer_residuals(model, stack_name, 1, 8)})
    finally:
        model.recipe = recipe


def model_residuals(model, tokens: jax.Array) -> list[Residual]:
    """Residuals of the mean-logit loss of the whole model on `tokens`: stacked per scanned stack."""
    graphdef, state = nnx.split(model)
    return residuals(lambda s, t: jnp.mean(nnx.merge(graphdef, s)(t).astype(jnp.float32)), state, tokens)
