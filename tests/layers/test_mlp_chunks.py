"""The MLP in sequence chunks (`LMConfig.mlp_seq_chunks`, `zoo.layers.mlp.MLP(seq_chunks=n)`): the same function and
gradients, the same tags with the same shapes (a tag made in chunks is their concatenation), and the offloaded
chunks land in pinned host memory, each chunk its own copy, as the recipe and the planner say."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import zoo
from tests.helpers import cuda_lowering, grads_under, hlo_type, max_rel_err, pinned_host_shapes
from zoo.layers import MLP
from zoo.plan import measure

B, S, CHUNKS = 2, 16, 4
CFG = zoo.models.LlamaConfig.preset("tiny", dtype="float32")
CHUNKED = dataclasses.replace(CFG, mlp_seq_chunks=CHUNKS)
# The recipes these tests place tensors by (the library's tests build their own values, not the application's sets).
QKV = ("query_proj", "key_proj", "value_proj")
MATMULS = QKV + ("attention_out", "context", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwo")
RECIPES = {"none": zoo.Recipe.none(), "full": zoo.Recipe.full(), "qkv_offload": zoo.Recipe("qkv_offload", offload=QKV),
           "minimal_offload": zoo.Recipe("minimal_offload", offload=MATMULS)}


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (B, S), 0, CFG.vocab_size, dtype=jnp.int32)


@pytest.fixture(scope="module")
def reference(tokens):
    """Loss and gradients of the unchunked model under `none` (everything saved)."""
    return grads_under(zoo.models.llama3(CFG, rngs=nnx.Rngs(0)), RECIPES["none"], tokens)


def test_the_chunked_mlp_is_the_same_function():
    x = jax.random.normal(jax.random.key(0), (B, S, 64))
    whole = MLP(dim=64, hidden=128, rngs=nnx.Rngs(0))
    chunked = MLP(dim=64, hidden=128, seq_chunks=CHUNKS, rngs=nnx.Rngs(0))
    assert jnp.allclose(whole(x), chunked(x), rtol=1e-6, atol=1e-6)
    # the tags of a chunked layer are one tensor each, of the unchunked shape
    sds = jax.ShapeDtypeStruct((B, S, 64), jnp.float32)
    assert ({t: s.shape for t, s in zoo.emitted.emitted_by(chunked, sds).items()}
            == {t: s.shape for t, s in zoo.emitted.emitted_by(whole, sds).items()})


@pytest.mark.parametrize("name", ["full", "minimal_offload", "qkv_offload"])
def test_gradients_equal_the_unchunked_model(tokens, reference, name):
    loss, grads = grads_under(zoo.models.llama3(CHUNKED, rngs=nnx.Rngs(0)), RECIPES[name], tokens)
    assert abs(float(loss) - float(reference[0])) < 1e-6
    assert max_rel_err(grads, reference[1]) < 1e-5


def test_offloaded_chunks_land_in_pinned_host_as_planned(tokens):
    recipe = RECIPES["minimal_offload"]
    model = zoo.models.llama3(CHUNKED, recipe=recipe, rngs=nnx.Rngs(0))
    # JAX saves each chunk of mlpwi_0/mlpwi_1 as a host residual; read back, the placement is the recipe's
    seen = measure.placements_seen(model, "layers", B, S)
    assert seen == measure.placements_seen(zoo.models.llama3(CFG, recipe=recipe, rngs=nnx.Rngs(0)), "layers", B, S)
    assert seen["mlpwi_0"] == seen["mlpwi_1"] == "offload"
    # on the CUDA lowering, each chunk is its own copy to pinned host memory: CHUNKS of [B, S/CHUNKS, F] per tag
    pinned = pinned_host_shapes(cuda_lowering(model, tokens))
    chunk = hlo_type((B, S // CHUNKS, CFG.mlp_dim), jnp.float32)
    assert pinned[chunk] == 2 * CHUNKS
    # the planner counts the same bytes as unchunked
    plans = [zoo.plan.plan(c, recipe, batch=B, seq=S, peak=None) for c in (CFG, CHUNKED)]
    assert plans[0].host_bytes == plans[1].host_bytes > 0
    assert plans[1].host_bytes == measure.stack_residuals(model, "layers", B, S, recipe.policy())[1]


def test_bad_chunking_is_refused():
    with pytest.raises(ValueError, match="mlp_seq_chunks must be a positive int"):
        dataclasses.replace(CFG, mlp_seq_chunks=0)
    mlp = MLP(dim=64, hidden=128, seq_chunks=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="MLP seq_chunks=3 must divide the sequence length 16"):
        mlp(jnp.zeros((B, S, 64)))


def test_a_tag_emitted_twice_with_other_shapes_is_refused():
    def two_tensors(x):
        a = zoo.tags.name(x, "mlpwi_0", ("batch", "seq", "mlp"))
        return zoo.tags.name(a[:, :, :3], "mlpwi_0", ("batch", "seq", "mlp"))
    with pytest.raises(ValueError, match="'mlpwi_0' is emitted twice in one layer with shapes"):
        zoo.emitted.emitted(two_tensors, jax.ShapeDtypeStruct((B, S, 8), jnp.float32))
    got = zoo.emitted.emitted(
        lambda x: [zoo.tags.name(p, "mlpwi_0", ("batch", "seq", "mlp")) for p in jnp.split(x, 2, axis=1)],
        jax.ShapeDtypeStruct((B, S, 8), jnp.float32))
    assert {t: s.shape for t, s in got.items()} == {"mlpwi_0": (B, S, 8)}
