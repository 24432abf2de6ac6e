"""The SwiGLU MLP (zoo.layers.mlp) as a unit: output shape, its tags and their shapes (with the shared expert's
prefix and in sequence chunks), the output against the formula, gradients against finite differences in float64,
and against transformers' `LlamaMLP` under torch autograd (float32)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from tests.layers import reference as ref
from tests.layers.random_layers import jitted, random_layer
from zoo.emitted import emitted_by
from zoo.hf.keymap import SWIGLU
from zoo.layers import MLP

B, S, D, F = 2, 8, 16, 24


def make_mlp(dtype=jnp.float32, **kw) -> MLP:
    return random_layer(lambda: MLP(dim=D, hidden=F, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0), **kw))


def inputs(dtype=np.float32, seed=1):
    return np.random.default_rng(seed).normal(size=(B, S, D)).astype(dtype)


@pytest.mark.parametrize("prefix", ["", "shared_"])
def test_shape_and_tags(prefix):
    mlp = make_mlp(tag_prefix=prefix)
    assert jax.eval_shape(mlp, jax.ShapeDtypeStruct((B, S, D), jnp.float32)).shape == (B, S, D)
    want = {f"{prefix}mlpwi_0": (B, S, F), f"{prefix}mlpwi_1": (B, S, F), f"{prefix}mlpwo": (B, S, D)}
    tags = emitted_by(mlp, jax.ShapeDtypeStruct((B, S, D), jnp.bfloat16))
    assert {t: s.shape for t, s in tags.items()} == want and list(tags) == list(want)
    assert all(s.dtype == jnp.float32 for s in tags.values())  # the layer's dtype, whatever the input's
    assert mlp.tag_shapes(B, S) == tags


def test_sequence_chunks_same_output_and_tag_shapes():
    x = jnp.asarray(inputs())
    whole, chunked = make_mlp(), make_mlp(seq_chunks=4)
    np.testing.assert_allclose(jitted(chunked)(x), jitted(whole)(x), rtol=1e-6, atol=1e-6)
    assert chunked.tag_shapes(B, S) == whole.tag_shapes(B, S)
    with pytest.raises(ValueError, match="must divide the sequence length"):
        jax.eval_shape(make_mlp(seq_chunks=3), x)


def test_matches_formula_and_gradients_float64():
    with ref.float64():
        mlp, x = make_mlp(jnp.float64), jnp.asarray(inputs(np.float64))
        weights = (mlp.gate_proj.kernel[...], mlp.up_proj.kernel[...], mlp.down_proj.kernel[...])
        assert ref.rel_err(jitted(mlp)(x), jax.jit(ref.swiglu)(x, *weights)) < 1e-13
        graphdef, params = nnx.split(mlp)
        check_grads(jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)), (params, x), order=1, modes=("rev",))


def test_matches_llama_mlp_under_torch_autograd(hf):
    import transformers
    from transformers.models.llama.modeling_llama import LlamaMLP
    mlp, x = make_mlp(), inputs()
    ct = inputs(seed=2)
    rows = hf.unit_rows(SWIGLU, "mlp.", "mlp.")
    theirs = LlamaMLP(transformers.LlamaConfig(hidden_size=D, intermediate_size=F, hidden_act="silu",
                                                         num_attention_heads=2))
    hf.load(theirs, mlp, rows)
    out, dx = hf.torch_vjp(theirs, x, ct)
    got, got_dx, got_params = hf.jax_vjp(mlp, x, ct)
    assert ref.rel_err(got, out) < 1e-5
    assert ref.rel_err(got_dx, dx) < 1e-5
    assert ref.rel_err(got_params, hf.grads(theirs, mlp, rows)) < 1e-5
