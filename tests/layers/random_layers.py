"""Tiny layers for the unit tests, built without compiling: the layer is traced abstractly (`nnx.eval_shape`) and
NumPy draws its parameters (run op by op, the initializers compile one small program each), and applied through one
jitted call."""
from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _std(path: tuple, shape: tuple[int, ...]) -> float:
    """A fan-in scale for a kernel at `path` (inputs first; o_proj's two input axes; experts' [E, D, F])."""
    names = [str(p) for p in path]
    if "embedding" in names:
        return 1.0
    if "experts" in names and names[-1] in ("gate_proj", "up_proj", "down_proj"):
        return shape[1] ** -0.5
    if "o_proj" in names:
        return math.prod(shape[:2]) ** -0.5
    return shape[0] ** -0.5


def random_layer(make: Callable[[], nnx.Module], seed: int = 0) -> nnx.Module:
    """`make()`'s layer with parameters drawn by NumPy: kernels normal with a fan-in scale, norm scales 1 + 0.3 N
    (ones would hide a missing or swapped norm), a routing bias 0.2 N (large enough to change some choices)."""
    graphdef, state = nnx.split(nnx.eval_shape(make))
    rng = np.random.default_rng(seed)

    def draw(path, v):
        shape, name = v.shape, str(path[-1])
        if name == "scale":
            values = 1 + 0.3 * rng.standard_normal(shape)
        elif name == "e_score_correction_bias":
            values = 0.2 * rng.standard_normal(shape)
        else:
            values = _std(path, shape) * rng.standard_normal(shape)
        return path, v.replace(jnp.asarray(values, v.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state([draw(p, v) for p, v in nnx.to_flat_state(state)]))


def jitted(module: nnx.Module) -> Callable:
    """x -> module(x) as one compiled program (the module's state as of now)."""
    graphdef, state = nnx.split(module)
    apply = jax.jit(lambda s, x: nnx.merge(graphdef, s, copy=True)(x))
    return lambda x: apply(state, jnp.asarray(x))
