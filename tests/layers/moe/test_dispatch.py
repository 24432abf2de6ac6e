"""Moving token copies to their experts (zoo.layers.moe.dispatch) as a unit: the sort by expert (stable, its group
sizes, its inverse), the capacity formula, and capacity dispatch (each expert's first C copies in token order kept,
the rest dropped and counted) against NumPy, with its gradient w.r.t. the copies."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.layers import reference as ref
from zoo.layers.moe.dispatch import capacity, capacity_dispatch, sort_by_expert, unsort

G, T, D, K, E = 2, 6, 3, 2, 4


def case(seed=0):
    rng = np.random.default_rng(seed)
    flat = rng.normal(size=(G, T, D)).astype(np.float32)
    idx = np.stack([np.stack([rng.choice(E, K, replace=False) for _ in range(T)]) for _ in range(G)]).astype(np.int32)
    return flat, idx


def test_capacity():
    assert capacity(24, 4, 1.25) == 8 and capacity(3, 8, 1.0) == 1 and capacity(10, 4, 1.0) == 3


def test_sort_by_expert_against_numpy():
    flat, idx = case()
    s = sort_by_expert(jnp.asarray(flat), jnp.asarray(idx), E)
    for g in range(G):
        copies = np.repeat(flat[g], K, axis=0)                    # token-copy order: token t's k copies together
        experts = idx[g].reshape(-1)
        order = np.argsort(experts, kind="stable")
        np.testing.assert_array_equal(s.rows[g], copies[order])
        np.testing.assert_array_equal(s.expert[g], experts[order])
        np.testing.assert_array_equal(s.group_sizes[g], np.bincount(experts, minlength=E))
    np.testing.assert_array_equal(unsort(s.rows, s), np.repeat(flat, K, axis=1))


@pytest.mark.parametrize("factor", [0.5, 2.0])
def test_capacity_dispatch_against_numpy(factor):
    flat, idx = case(1)
    s = sort_by_expert(jnp.asarray(flat), jnp.asarray(idx), E)
    c = capacity(T * K, E, factor)
    out, dropped = jax.jit(lambda r: capacity_dispatch(s.__class__(r, s.expert, s.group_sizes, s.inverse),
                                                       lambda buf: 2 * buf, factor))(s.rows)
    want, want_dropped = np.zeros_like(np.asarray(s.rows)), 0
    for g in range(G):
        seen = np.zeros(E, int)
        for n, e in enumerate(np.asarray(s.expert[g])):
            if seen[e] < c:
                want[g, n] = 2 * np.asarray(s.rows[g, n])
            else:
                want_dropped += 1
            seen[e] += 1
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert int(dropped) == want_dropped and (want_dropped > 0) == (factor < 1)
    # the gradient w.r.t. the copies: 2 where kept, 0 where dropped
    grad = jax.jit(jax.grad(lambda r: jnp.sum(capacity_dispatch(s.__class__(r, s.expert, s.group_sizes, s.inverse),
                                                        lambda buf: 2 * buf, factor)[0])))(s.rows)
    assert ref.rel_err(grad, 2.0 * (np.abs(want).sum(-1, keepdims=True) > 0) * np.ones_like(want)) < 1e-6
