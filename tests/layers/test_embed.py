"""The token embedding and the LM head (zoo.layers.embed) as units: shapes and dtypes, no tags, the lookup and the
projection against one-hot matmuls, and gradients (the lookup's scatter-add, with repeated tokens) against finite
differences in float64 and against the one-hot reference's own."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.test_util import check_grads

from tests.layers import reference as ref
from zoo.emitted import emitted, emitted_by
from zoo.layers import Embed, LMHead

B, S, D, V = 2, 8, 16, 11


def tokens(seed=0):
    """Tokens with repeats (the gradient of a repeated row is a sum)."""
    t = np.random.default_rng(seed).integers(0, V, (B, S)).astype(np.int32)
    t[1, :3] = t[0, 0]
    return t


def test_embed_shape_dtype_and_no_tags():
    embed = Embed(vocab=V, dim=D, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    toks = jnp.asarray(tokens())
    out = embed(toks)
    assert out.shape == (B, S, D) and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(out, embed.embedding[...][toks].astype(jnp.bfloat16))
    assert emitted(lambda t: embed(t), toks) == {}


def test_embed_gradient_float64():
    with ref.float64():
        embed = Embed(vocab=V, dim=D, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        toks = jnp.asarray(tokens())
        table = embed.embedding[...]
        one_hot = jax.nn.one_hot(toks, V, dtype=jnp.float64)
        assert ref.rel_err(embed(toks), one_hot @ table) < 1e-15
        graphdef, params = nnx.split(embed)
        apply = jax.jit(lambda p: nnx.merge(graphdef, p)(toks))
        check_grads(apply, (params,), order=1, modes=("rev",))
        ct = jnp.asarray(np.random.default_rng(1).normal(size=(B, S, D)))
        got = jax.jit(jax.grad(lambda p: jnp.sum(apply(p) * ct)))(params)["embedding"][...]
        want = jax.jit(jax.grad(lambda w: jnp.sum((one_hot @ w) * ct)))(table)
        assert ref.rel_err(got, want) < 1e-14
        assert np.abs(np.asarray(got)[np.setdiff1d(np.arange(V), np.asarray(toks))]).max(initial=0) == 0


def test_lm_head_shape_gradient_and_no_tags():
    head = LMHead(dim=D, vocab=V, rngs=nnx.Rngs(0))
    x = np.random.default_rng(2).normal(size=(B, S, D)).astype(np.float32)
    assert head(jnp.asarray(x)).shape == (B, S, V)
    assert emitted_by(head, jax.ShapeDtypeStruct((B, S, D), jnp.float32)) == {}
    with ref.float64():
        head = LMHead(dim=D, vocab=V, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        x = jnp.asarray(x, jnp.float64)
        assert ref.rel_err(head(x), x @ head.proj.kernel[...]) < 1e-14
        graphdef, params = nnx.split(head)
        check_grads(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)), (params, x), order=1, modes=("rev",))
