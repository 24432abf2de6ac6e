"""RMSNorm (zoo.layers.norm) as a unit: shape and dtype, no tags, the output against the formula, gradients against
finite differences in float64 and against transformers' `LlamaRMSNorm` under torch autograd (float32)."""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.test_util import check_grads

from tests.layers import reference as ref
from zoo.emitted import emitted_by
from zoo.hf.keymap import NORMS
from zoo.layers import RMSNorm

B, S, D, EPS = 2, 8, 16, 1e-5


def make_norm(dtype=jnp.float32, seed=0) -> RMSNorm:
    """A norm whose scale is random (ones would hide a missing or misplaced scale)."""
    norm = RMSNorm(D, eps=EPS, dtype=dtype, param_dtype=dtype)
    norm.scale[...] = jnp.asarray(1 + 0.3 * np.random.default_rng(seed).normal(size=D), dtype)
    return norm


def inputs(dtype=jnp.float32, seed=1):
    return jnp.asarray(np.random.default_rng(seed).normal(size=(B, S, D)) * 2, dtype)


def test_shape_dtype_and_no_tags():
    norm = make_norm()
    assert norm(inputs()).shape == (B, S, D)
    assert emitted_by(norm, jax.ShapeDtypeStruct((B, S, D), jnp.float32)) == {}
    # bf16 activations: the statistics in float32, the output in the activation dtype
    bf = RMSNorm(D, dtype=jnp.bfloat16)
    x = inputs(jnp.bfloat16)
    assert bf(x).dtype == jnp.bfloat16
    want = (x.astype(jnp.float32) * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True)
                                                   + 1e-5)).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf(x), np.float32), np.asarray(want, np.float32))


def test_matches_formula_and_gradients_float64():
    with ref.float64():
        norm, x = make_norm(jnp.float64), inputs(jnp.float64)
        assert norm(x).dtype == jnp.float64
        assert ref.rel_err(norm(x), ref.rms_norm(x, norm.scale[...], EPS)) < 1e-13
        graphdef, params = nnx.split(norm)
        apply = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x))
        check_grads(apply, (params, x), order=1, modes=("rev",))
        # and against the reference's own gradient
        ct = inputs(jnp.float64, seed=2)
        got = jax.jit(jax.grad(lambda p, x: jnp.sum(apply(p, x) * ct), argnums=(0, 1)))(params, x)
        want = jax.jit(jax.grad(lambda s, x: jnp.sum(ref.rms_norm(x, s, EPS) * ct), argnums=(0, 1)))(norm.scale[...], x)
        assert ref.rel_err((got[0]["scale"][...], got[1]), want) < 1e-12


def test_matches_llama_rmsnorm_under_torch_autograd(hf):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    norm, x = make_norm(), np.asarray(inputs())
    ct = np.random.default_rng(3).normal(size=x.shape).astype(np.float32)
    rows = hf.unit_rows(NORMS, "attn_norm.", "input_layernorm.")
    theirs = LlamaRMSNorm(D, eps=EPS)
    hf.load(theirs, norm, rows)
    out, dx = hf.torch_vjp(theirs, x, ct)
    got, got_dx, got_params = hf.jax_vjp(norm, x, ct)
    assert ref.rel_err(got, out) < 1e-6
    assert ref.rel_err(got_dx, dx) < 1e-5
    assert ref.rel_err(got_params, hf.grads(theirs, norm, rows)) < 1e-5
