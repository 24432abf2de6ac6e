"""Projections with logical axes (zoo.layers.linear) as units: the shape/axes check, the logical axes a kernel
carries, the fan-in initializer's scale over one or more input axes, and `Stored` variables left out of `nnx.Param`
(what optimizers train)."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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


def test_stored_variables_are_not_params():
    class Layer(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(3), **logical(("embed",)))
            self.bias = Stored(jnp.zeros(3), **logical(("experts",)))
    layer = Layer()
    assert list(nnx.to_pure_dict(nnx.state(layer, nnx.Param))) == ["w"]
    assert list(nnx.to_pure_dict(nnx.state(layer, Stored))) == ["bias"]
    assert logical(("a", None)) == dict(out_sharding=("a", None), eager_sharding=False)
