"""Projections with logical axes (zoo.layers.linear) as units: the shape/axes check, the logical axes a kernel
carries, the fan-in initializer's scale over one or more input axes, the output and gradients against the einsum
written out (`jax.test_util.check_grads` in float64), and `Stored` variables left out of `nnx.Param` (what
optimizers train)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.test_util import check_grads

from tests.layers import reference
from zoo.layers.linear import Stored, logical, projection


def test_shape_and_axes_must_agree():
    with pytest.raises(ValueError, match=r"shape \(4, 2, 3\) and axes \('embed', 'heads'\) differ in length"):
        projection("bsd,dhk->bshk", (4, 2, 3), ("embed", "heads"), n_in=1, dtype=jnp.float32,
                   param_dtype=jnp.float32, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("shape, axes, n_in", [((512, 8, 32), ("embed", "heads", "head_dim"), 1),
                                               ((16, 32, 256), ("heads", "head_dim", "embed"), 2)])
def test_kernel_axes_and_fan_in_scale(shape, axes, n_in):
    eq = "bsd,dhk->bshk" if n_in == 1 else "bshk,hkd->bsd"
    proj = projection(eq, shape, axes, n_in=n_in, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    kernel = proj.kernel
    assert kernel.shape == shape and kernel.dtype == jnp.float32 and proj.bias is None
    assert kernel.get_metadata()["out_sharding"] == axes
    fan_in = int(np.prod(shape[:n_in]))
    assert np.std(np.asarray(kernel[...])) == pytest.approx(fan_in ** -0.5, rel=0.03)
    x = jnp.ones((1, 2) + shape[:n_in], jnp.bfloat16)
    assert proj(x).dtype == jnp.bfloat16 and proj(x).shape == (1, 2) + shape[n_in:]


@pytest.mark.parametrize("eq, shape, axes, n_in, x_shape", [
    ("bsd,dhk->bshk", (6, 2, 3), ("embed", "heads", "head_dim"), 1, (2, 4, 6)),     # into heads (q's)
    ("bshk,hkd->bsd", (2, 3, 6), ("heads", "head_dim", "embed"), 2, (2, 4, 2, 3)),  # out of them (the output's)
])
def test_a_projection_is_its_einsum_with_reference_gradients(eq, shape, axes, n_in, x_shape):
    """The layer's output is the plain einsum of its own kernel, and its gradients (input and kernel) match finite
    differences in float64."""
    with reference.float64():
        proj = projection(eq, shape, axes, n_in=n_in, dtype=jnp.float64, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        x = jax.random.normal(jax.random.key(1), x_shape, jnp.float64)
        assert reference.rel_err(proj(x), jnp.einsum(eq, x, proj.kernel[...])) < 1e-12
        graphdef, state = nnx.split(proj)
        check_grads(lambda x, state: nnx.merge(graphdef, state)(x), (x, state), order=1, modes=["rev"], atol=1e-6,
                    rtol=1e-6)


def test_stored_variables_are_not_params():
    class Layer(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3), **logical(("embed",)))
            self.bias = Stored(jnp.zeros(3), **logical(("experts",)))
    layer = Layer()
    assert list(nnx.to_pure_dict(nnx.state(layer, nnx.Param))) == ["w"]
    assert list(nnx.to_pure_dict(nnx.state(layer, Stored))) == ["bias"]
    assert logical(("a", None)) == dict(out_sharding=("a", None), eager_sharding=False)
