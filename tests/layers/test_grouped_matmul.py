"""zoo.layers.grouped_matmul: the custom VJP that gives each grouped-matmul problem its own kernel configuration.

On the CPU tokamax's Mosaic kernel cannot run, so the three problems run `jax.lax.ragged_dot_general` with the
same dimension numbers the kernel gets; the gradients must equal JAX's own differentiation of
`jax.lax.ragged_dot`, and every problem must be asked for with the forward's expert shape."""
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from zoo.layers import grouped_matmul as gm


def _inputs(m=48, k=8, n=12, g=4, seed=0):
    ks = jax.random.split(jax.random.key(seed), 3)
    lhs = jax.random.normal(ks[0], (m, k), jnp.float32)
    rhs = jax.random.normal(ks[1], (g, k, n), jnp.float32)
    sizes = jnp.array([5, 0, 30, 13], jnp.int32)  # an empty group, uneven sizes; sum = m
    return lhs, rhs, sizes


def _reference_op_for(calls):
    def op_for(problem, k, n):
        calls.append((problem, k, n))

        def op(lhs, rhs, *, group_sizes, ragged_dot_dimension_numbers=None):
            dims = ragged_dot_dimension_numbers or jax.lax.RaggedDotDimensionNumbers(
                dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
            return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, dims)
        return op
    return op_for


def test_forward_and_gradients_equal_jax_ragged_dot():
    lhs, rhs, sizes = _inputs()
    calls = []
    grouped = gm.make(_reference_op_for(calls))
    probe = jax.random.normal(jax.random.key(3), (lhs.shape[0], rhs.shape[2]))

    def loss(f):
        return lambda a, b: jnp.sum(jnp.sin(f(a, b, sizes)) * probe)

    chex.assert_trees_all_close(grouped(lhs, rhs, sizes), jax.lax.ragged_dot(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    got = jax.grad(loss(grouped), argnums=(0, 1))(lhs, rhs)
    want = jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(lhs, rhs)
    chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-5)
    # The empty group's expert gets a zero gradient; each problem was asked for with the forward's K x N.
    assert np.all(np.asarray(got[1][1]) == 0)
    assert {c for c in calls} == {("fwd", 8, 12), ("dlhs", 8, 12), ("drhs", 8, 12)}


def test_gradients_match_finite_differences_in_float64():
    """The custom VJP's backward (the dlhs and drhs problems) against `jax.test_util.check_grads`, an independent
    reference: finite differences of the forward, in float64."""
    with jax.enable_x64(True):
        lhs, rhs, sizes = _inputs(m=12, k=3, n=4)
        sizes = jnp.array([2, 0, 7, 3], jnp.int32)
        lhs, rhs = lhs.astype(jnp.float64), rhs.astype(jnp.float64)
        grouped = gm.make(_reference_op_for([]))
        check_grads(lambda a, b: grouped(a, b, sizes), (lhs, rhs), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


def test_gradients_under_jit_and_remat():
    lhs, rhs, sizes = _inputs(seed=1)
    grouped = gm.make(_reference_op_for([]))
    f = jax.jit(jax.grad(lambda a, b: jnp.sum(jax.checkpoint(grouped)(a, b, sizes) ** 2), argnums=(0, 1)))
    want = jax.grad(lambda a, b: jnp.sum(jax.lax.ragged_dot(a, b, sizes) ** 2), argnums=(0, 1))(lhs, rhs)
    chex.assert_trees_all_close(f(lhs, rhs), want, rtol=1e-5, atol=1e-5)


def test_pick_prefers_the_shape_specific_entry():
    tiles = {"fwd": {"block_m": 64}, "fwd:7168x2048": {"block_m": 128}}
    assert gm.pick(tiles, "fwd", 7168, 2048) == {"block_m": 128}
    assert gm.pick(tiles, "fwd", 2048, 7168) == {"block_m": 64}
    assert gm.pick(tiles, "drhs", 2048, 7168) is None


def test_tile_table_from_the_environment(tmp_path, monkeypatch):
    good = tmp_path / "tiles.json"
    good.write_text(json.dumps({"fwd": {"block_m": 128, "block_n": 64, "block_k": 128, "num_stages": 4,
                                        "split_k": 1}}))
    monkeypatch.setenv("ZOO_TOKAMAX_TILES", str(good))
    tiles, why = gm.tiles_for("NVIDIA H200")
    assert tiles["fwd"]["block_m"] == 128 and str(good) in why
    for text, match in ((json.dumps({"forward": {}}), "unknown problem 'forward'"),
                        (json.dumps({"fwd": {"block_q": 1}}), "configuration fields"),
                        ("{not json", "cannot read a tile table")):
        good.write_text(text)
        with pytest.raises(ValueError, match=match):
            gm.tiles_for("NVIDIA H200")
    good.write_text("{}")                                   # an empty table: tokamax chooses
    assert gm.tiles_for("NVIDIA H200") == (None, f"tokamax's own configuration (ZOO_TOKAMAX_TILES={good} is empty)")
    monkeypatch.delenv("ZOO_TOKAMAX_TILES")
    tiles, why = gm.tiles_for("NVIDIA H200")                 # the measured table
    assert tiles["fwd"]["block_m"] == 128 and tiles["drhs"]["num_stages"] == 2 and "measured tiles" in why
    assert gm.tiles_for("a device nobody measured") == (None, "tokamax's own configuration (no measured tiles for "
                                                               "a device nobody measured)")
