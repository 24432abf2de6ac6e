"""Sequence tiles (zoo.layers.tiles) as a unit: a tiled per-position part computes the untiled function and its
gradients (float32, relative 1e-5; float64 against finite differences), its tags keep their full shapes and are
reported as tiled, 16-bit parameters enter the loop in float32 (their gradient summed in float32), a tile's
intermediates exist one at a time (the compiled backward holds less), the loop makes no stacked copy of the sequence
(each tile is sliced and written in place) nor, compiled, a copy of one at each step, and a tile count that does not
divide the sequence is a ValueError."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from tests.helpers import max_rel_err
from tests.layers.random_layers import random_layer
from zoo.emitted import read_tags
from zoo.jaxprs import sub_jaxprs
from zoo.layers import MLP, RMSNorm
from zoo.layers.tiles import check_tiles, tiled

B, S, D, F, TILES = 2, 16, 16, 24, 4


def ffn(parts, x):
    norm, mlp = parts
    return mlp(norm(x))


def parts(dtype=jnp.float32):
    return random_layer(lambda: (RMSNorm(D, dtype=dtype, param_dtype=dtype),
                                 MLP(dim=D, hidden=F, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))))


def inputs(dtype=np.float32, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, S, D)).astype(dtype))


def loss(tiles):
    def f(params, rest, graphdef, x):
        return jnp.sum(tiled(ffn, nnx.merge(graphdef, params, rest), x, tiles) ** 2)
    return f


def grads(module, x, tiles):
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    return jax.grad(loss(tiles), argnums=(0, 3))(params, rest, graphdef, x)


def test_a_tiled_part_is_the_same_function_with_the_same_gradients():
    module, x = parts(), inputs()
    assert max_rel_err(tiled(ffn, module, x, TILES), ffn(module, x)) < 1e-6
    assert max_rel_err(grads(module, x, TILES), grads(module, x, 1)) < 1e-5


def test_gradients_against_finite_differences_in_float64():
    with jax.enable_x64(True):
        module, x = parts(jnp.float64), inputs(np.float64)
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        check_grads(lambda p, x: loss(TILES)(p, rest, graphdef, x), (params, x), order=1, modes=("rev",),
                    atol=1e-6, rtol=1e-6)


def test_tags_keep_their_full_shapes_and_are_reported_tiled():
    module, x = parts(), jax.ShapeDtypeStruct((B, S, D), jnp.float32)
    graphdef, state = nnx.split(module)

    def f(s, x, tiles):
        return tiled(ffn, nnx.merge(graphdef, s), x, tiles)
    whole, none_tiled = read_tags(lambda s, x: f(s, x, 1), state, x)
    shapes, tiled_tags = read_tags(lambda s, x: f(s, x, TILES), state, x)
    assert {t: v.shape for t, v in shapes.items()} == {t: v.shape for t, v in whole.items()} == {
        "mlpwi_0": (B, S, F), "mlpwi_1": (B, S, F), "mlpwo": (B, S, D)}
    assert none_tiled == frozenset() and tiled_tags == {"mlpwi_0", "mlpwi_1", "mlpwo"}


def test_16_bit_parameters_enter_the_loop_in_float32():
    """The loop's constants are the float32 copies: the transposed loop sums their cotangents in float32."""
    module, x = parts(jnp.bfloat16), inputs().astype(jnp.bfloat16)
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    jaxpr = jax.make_jaxpr(lambda p, x: tiled(ffn, nnx.merge(graphdef, p, rest), x, TILES))(params, x).jaxpr
    (scan,) = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    weights = [v.aval for v in scan.invars   # the kernels and the norm's scale (not the tile starts)
               if v.aval.ndim in (1, 2) and jnp.issubdtype(v.aval.dtype, jnp.floating)]
    assert len(weights) == 4 and all(a.dtype == jnp.float32 for a in weights)
    g = grads(module, x, TILES)[0]
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(g))   # handed back in the parameters' dtype


def test_a_tile_holds_less_than_the_whole_in_the_compiled_backward():
    """Compiled on the CPU, the gradient of a rematerialized tiled part holds fewer temporary bytes: one tile's
    gate, up and their cotangents at a time."""
    d, f, s = 64, 512, 2048
    module = random_layer(lambda: (RMSNorm(d), MLP(dim=d, hidden=f, rngs=nnx.Rngs(0))))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    x = jax.ShapeDtypeStruct((1, s, d), jnp.float32)

    def temp(tiles):
        fn = jax.checkpoint(lambda p, x: jnp.sum(tiled(ffn, nnx.merge(graphdef, p, rest), x, tiles) ** 2),
                            policy=jax.checkpoint_policies.nothing_saveable)
        compiled = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(params, x).compile()
        return compiled.memory_analysis().temp_size_in_bytes
    assert temp(8) < 0.6 * temp(1)


def shapes_in(jaxpr) -> set[tuple[int, ...]]:
    """Every value's shape in a jaxpr and the jaxprs inside it (loop bodies, checkpoints)."""
    out = {tuple(v.aval.shape) for e in jaxpr.eqns for v in e.outvars}
    for e in jaxpr.eqns:
        for sub in sub_jaxprs(e.params):
            out |= shapes_in(sub)
    return out


def test_the_loop_makes_no_stacked_copy_of_the_sequence():
    """Forward and backward: the loop scans the tiles' starts and hands back the whole output, and no value is shaped
    as the sequence stacked by tile ([tiles, B, S / tiles, D]): each tile's rows are sliced inside the loop and its
    output written into the whole one in place, and the backward adds each tile's cotangent in place."""
    module, x = parts(), inputs()
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    forward = jax.make_jaxpr(lambda p, x: tiled(ffn, nnx.merge(graphdef, p, rest), x, TILES))(params, x).jaxpr
    (scan,) = [e for e in forward.eqns if e.primitive.name == "scan"]
    assert (TILES,) in [v.aval.shape for v in scan.invars if v.aval.dtype == jnp.int32]   # the starts
    assert [v.aval.shape for v in scan.outvars] == [(B, S, D)]
    backward = jax.make_jaxpr(lambda p, x: grads(nnx.merge(graphdef, p, rest), x, TILES))(params, x).jaxpr
    assert (TILES, B, S // TILES, D) not in shapes_in(forward) | shapes_in(backward)


def copies_in_loops(hlo: str, shape: str) -> int:
    """How many `copy` instructions of `shape` (HLO text, e.g. f32[1,4096,64]) the while loops' bodies of a compiled
    module hold: each runs once per loop step."""
    bodies = set(re.findall(r"\bbody=%?([\w.\-]+)", hlo))
    count, inside = 0, False
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            inside = line.split()[0].lstrip("%") in bodies
        elif inside and f"= {shape}" in line and " copy(" in line:
            count += 1
    return count


def test_the_backward_loop_copies_no_sequence_sized_array_per_step():
    """Compiled on the CPU, the gradient's loops make no copy of a whole-sequence array at each step: the outputs are
    written by `write_tile`, whose backward leaves the carried cotangent as it is (JAX's transpose of the write
    zeroes the tile's rows in it, and XLA copied the cotangent twice a step to do so)."""
    d, s = 64, 4096
    module = random_layer(lambda: (RMSNorm(d), MLP(dim=d, hidden=128, rngs=nnx.Rngs(0))))
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    fn = jax.checkpoint(lambda p, x: jnp.sum(tiled(ffn, nnx.merge(graphdef, p, rest), x, 8) ** 2),
                        policy=jax.checkpoint_policies.nothing_saveable)
    hlo = jax.jit(jax.grad(fn, argnums=(0, 1))).lower(params, jax.ShapeDtypeStruct((1, s, d), jnp.float32)
                                                      ).compile().as_text()
    assert "while(" in hlo
    assert copies_in_loops(hlo, f"f32[1,{s},{d}]") == 0


def test_a_tile_count_that_does_not_divide_the_sequence_is_refused():
    with pytest.raises(ValueError, match="seq_tiles=3 does not divide the sequence length 16"):
        tiled(ffn, parts(), inputs(), 3)
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="seq_tiles must be a positive int"):
            check_tiles(bad)
