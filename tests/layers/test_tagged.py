"""What every tagged layer offers (zoo.layers.tagged): `tag_shapes` on an abstract layer (built with
`nnx.eval_shape`: nothing allocated) equals the tags read off a concrete one, for [batch, seq] of any size."""
import jax
import jax.numpy as jnp
from flax import nnx

from zoo.emitted import emitted_by
from zoo.layers import MLP


def test_tag_shapes_of_an_abstract_layer():
    abstract = nnx.eval_shape(lambda: MLP(dim=16, hidden=24, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)))
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(nnx.state(abstract)))
    concrete = MLP(dim=16, hidden=24, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    for b, s in ((1, 4), (3, 5)):
        got = abstract.tag_shapes(b, s)
        assert got == emitted_by(concrete, jax.ShapeDtypeStruct((b, s, 16), jnp.bfloat16))
        assert got["mlpwi_0"] == jax.ShapeDtypeStruct((b, s, 24), jnp.bfloat16)
