"""zoo.layers.xla_attention, the memory-efficient causal attention in plain JAX, as a unit: the forward's two results
(out [B, S, H, dv] in q's dtype, lse [B, H, S] in float32) against a naive masked softmax attention and a NumPy
log-sum-exp (`tests/layers/reference.py`, float32, relative 1e-5); the FlashAttention-2 style backward, from out and
lse alone, against the reference's autodiff gradients (float32, 1e-5) and against finite differences
(`jax.test_util.check_grads` in float64); grouped-query heads, and MLA's shape (a head per query, a value head dim
unlike q's and k's). How the attention kernel wraps it (custom VJP, tags, cuDNN): test_attention_kernel.py."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from tests.layers import reference
from zoo.layers import xla_attention

B, S = 2, 8
# (query heads, key/value heads, q/k head dim, value head dim)
CASES = {"gqa": (4, 2, 6, 6), "mla": (4, 4, 10, 6)}


def inputs(case, dtype=jnp.float32, seed=0):
    h, kv, d, dv = CASES[case]
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (B, S, h, d), dtype)
    k = jax.random.normal(ks[1], (B, S, kv, d), dtype)
    v = jax.random.normal(ks[2], (B, S, kv, dv), dtype)
    g = jax.random.normal(ks[3], (B, S, h, dv), dtype)
    return q, k, v, g, d ** -0.5


def naive(q, k, v, scale):
    """The reference's masked softmax attention, each query head reading key/value head h // (H / Hkv)."""
    group = q.shape[2] // k.shape[2]
    return reference.causal_softmax_attention(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2), scale)


def naive_lse(q, k, scale) -> np.ndarray:
    """log sum_{j <= i} exp(scale q_i . k_j) per batch, query head and position, in NumPy float64: [B, H, S]."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    logits = np.where(np.tril(np.ones((S, S), bool)), logits, -np.inf)
    top = logits.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))[..., 0]


def kernel():
    """forward and backward as one differentiable function: the backward reads only q, k, v, out and lse."""
    @jax.custom_vjp
    def attend(q, k, v, scale):
        return xla_attention.forward(q, k, v, scale)[0]

    def fwd(q, k, v, scale):
        out, lse = xla_attention.forward(q, k, v, scale)
        return out, (q, k, v, out, lse, scale)

    def bwd(res, g):
        q, k, v, out, lse, scale = res
        return (*xla_attention.backward(q, k, v, out, lse, g, scale), None)

    attend.defvjp(fwd, bwd)
    return attend


@pytest.mark.parametrize("case", CASES)
def test_the_forward_equals_a_naive_softmax_attention(case):
    h, _, _, dv = CASES[case]
    q, k, v, _, scale = inputs(case)
    out, lse = xla_attention.forward(q, k, v, scale)
    assert (out.shape, out.dtype) == ((B, S, h, dv), jnp.float32)
    assert (lse.shape, lse.dtype) == ((B, h, S), jnp.float32)
    assert reference.rel_err(out, naive(q, k, v, scale)) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), naive_lse(q, k, scale), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_the_backward_equals_the_gradients_of_the_naive_attention(case):
    q, k, v, g, scale = inputs(case)
    out, lse = xla_attention.forward(q, k, v, scale)
    got = xla_attention.backward(q, k, v, out, lse, g, scale)
    _, vjp = jax.vjp(lambda q, k, v: naive(q, k, v, scale), q, k, v)
    want = vjp(g)
    assert [x.shape for x in got] == [q.shape, k.shape, v.shape]
    for name, a, b in zip("qkv", got, want):
        assert reference.rel_err(a, b) < 1e-5, name


@pytest.mark.parametrize("case", CASES)
def test_the_backward_matches_finite_differences_in_float64(case):
    with reference.float64():
        q, k, v, _, scale = inputs(case, jnp.float64)
        attend = kernel()
        check_grads(lambda q, k, v: attend(q, k, v, scale), (q, k, v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_bf16_inputs_give_a_bf16_output_and_float32_statistics(case):
    h, _, _, dv = CASES[case]
    q, k, v, _, scale = inputs(case, jnp.bfloat16)
    out, lse = xla_attention.forward(q, k, v, scale)
    assert (out.shape, out.dtype) == ((B, S, h, dv), jnp.bfloat16)
    assert (lse.shape, lse.dtype) == ((B, h, S), jnp.float32)
    assert reference.rel_err(out, naive(*(x.astype(jnp.float32) for x in (q, k, v)), scale)) < 2e-2


def test_a_later_key_changes_no_earlier_output():
    q, k, v, _, scale = inputs("gqa")
    out, lse = xla_attention.forward(q, k, v, scale)
    later, later_lse = xla_attention.forward(q, k.at[:, -1].set(3.0), v.at[:, -1].set(100.0), scale)
    np.testing.assert_array_equal(np.asarray(later[:, :-1]), np.asarray(out[:, :-1]))
    np.testing.assert_array_equal(np.asarray(later_lse[..., :-1]), np.asarray(lse[..., :-1]))
