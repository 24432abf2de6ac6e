"""zoo.emitted: the tags a function or a module emits, with shapes and dtypes read off an abstract trace (found
inside jits and conds, in the order made), a tag made in sequence chunks read as their concatenation
(`join_chunks`), and two tensors under one name refused."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from zoo import tags
from zoo.emitted import emitted, emitted_by, join_chunks

B, S, D = 2, 8, 4
X = jax.ShapeDtypeStruct((B, S, D), jnp.bfloat16)


def _sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_join_chunks_concatenates_the_sequence_axis():
    got = join_chunks("mlpwi_0", _sds(B, 3, D), _sds(B, 5, D), 1)
    assert (got.shape, got.dtype) == ((B, 8, D), jnp.float32)


@pytest.mark.parametrize("b", [_sds(B, 3, D + 1), _sds(B + 1, 3, D), _sds(B, 3, D, dtype=jnp.bfloat16), _sds(B, 3)],
                         ids=["another feature dim", "another batch", "another dtype", "another rank"])
def test_join_chunks_refuses_two_tensors_under_one_name(b):
    with pytest.raises(ValueError, match="tag 'mlpwi_0' is emitted twice in one layer with shapes"):
        join_chunks("mlpwi_0", _sds(B, 3, D), b, 1)


def test_tags_in_order_with_their_shapes_and_dtypes_inside_jit_and_cond():
    def f(x):
        q = tags.name(x, "query_proj")
        h = jax.jit(lambda v: tags.name(v.astype(jnp.float32) @ jnp.ones((D, 6)), "mlpwi_0"))(q)
        return jax.lax.cond(True, lambda v: checkpoint_name(v, "mlpwo"), lambda v: v, h)
    got = emitted(f, X)
    assert list(got) == ["query_proj", "mlpwi_0", "mlpwo"]
    assert [(s.shape, s.dtype) for s in got.values()] == [((B, S, D), jnp.bfloat16), ((B, S, 6), jnp.float32),
                                                          ((B, S, 6), jnp.float32)]


def test_a_tag_made_in_sequence_chunks_is_one_tensor_and_two_tensors_are_refused():
    def chunks(x):
        return [tags.name(p, "mlpwi_0") for p in jnp.split(x, [3], axis=1)]
    assert emitted(chunks, X)["mlpwi_0"].shape == (B, S, D)
    with pytest.raises(ValueError, match="tag 'mlpwi_0' is emitted twice"):
        emitted(lambda x: (tags.name(x, "mlpwi_0"), tags.name(x[..., :2], "mlpwi_0")), X)


def test_nothing_is_computed():
    ran = []
    def f(x):
        jax.debug.callback(lambda v: ran.append(v), x)   # would run on any computation
        return tags.name(x, "mlpwo")
    assert list(emitted(f, X)) == ["mlpwo"] and ran == []


class _Tiny(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(D, 6, rngs=rngs)

    def __call__(self, x):
        return tags.name(self.proj(x), "mlpwi_1")


def test_emitted_by_a_module_on_an_abstract_one_too():
    concrete = emitted_by(_Tiny(nnx.Rngs(0)), _sds(B, S, D))
    abstract = emitted_by(nnx.eval_shape(lambda: _Tiny(nnx.Rngs(0))), _sds(B, S, D))
    assert concrete == abstract == {"mlpwi_1": _sds(B, S, 6)}
