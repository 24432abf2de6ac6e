"""Recipes: validation, patterns, and the policy they compile to."""
import jax
import jax.numpy as jnp
import pytest

import zoo
from tests.helpers import pinned_host_shapes
from zoo import tags
from zoo.plan import measure


def test_vocabulary_is_closed_and_complete():
    expected = {"decoder_layer_input", "query_proj", "key_proj", "value_proj", "attention_out", "out_proj",
                "context", "query_wa_proj", "mla_q", "kv_wa_proj", "mla_kv", "mlpwi_0", "mlpwi_1", "mlpwo",
                "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo", "shared_mlpwi_0", "shared_mlpwi_1", "shared_mlpwo"}
    assert set(tags.NAMES) == expected
    assert all(t.meaning and t.shape for t in tags.TAGS.values())


def test_name_rejects_unknown_tag():
    with pytest.raises(ValueError, match="unknown tag 'qkv'.*query_proj"):
        tags.name(jax.numpy.ones(2), "qkv")


def test_patterns_expand_over_vocabulary():
    r = zoo.Recipe("r", offload=("moe_*",), device=("query_proj",))
    assert r.offload == ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")
    assert r.placement("moe_mlpwo") == "offload" and r.placement("query_proj") == "device"
    assert r.placement("mlpwo") == "remat"


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload=("qurey_proj",)), r"'qurey_proj' matches no tag; the vocabulary is: decoder_layer_input"),
    (dict(device=("nothing_*",)), "matches no tag"),
    (dict(offload=("query_proj",), device=("query_*",)), r"\['query_proj'\] placed both"),
    (dict(offload="query_proj"), "a tuple of tags"),
])
def test_bad_recipes_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        zoo.Recipe("bad", **kwargs)


def _tagged(w, x):
    h = tags.name(jnp.sin(x @ w), "query_proj")
    return jnp.sum(jnp.sin(h) @ w)


W, X = jnp.ones((8, 8)), jnp.ones((4, 8))


@pytest.mark.parametrize("recipe, want", [
    (zoo.Recipe("o", offload=("query_proj",)), [("query_proj", True)]),   # kept, in host memory
    (zoo.Recipe("d", device=("query_proj",)), [("query_proj", False)]),   # kept, on the device
    (zoo.Recipe.full(), []),                                              # nothing kept: recomputed
])
def test_each_placement_is_what_jax_saves(recipe, want):
    """The policy as JAX applies it: saved_residuals of a function with one tag, under each placement."""
    res = measure.residuals(jax.checkpoint(_tagged, policy=recipe.policy()), W, X)
    assert [(r.tag if not r.host else "query_proj", r.host) for r in res] == want
    assert all(r.shape == (4, 8) for r in res)


def test_policy_offloads_to_pinned_host():
    """Offloaded tags are moved to *pinned* host memory in the CUDA lowering (any other memory kind silently keeps
    them on the device); a device placement moves nothing."""
    def lowered(recipe):
        grad = jax.jit(jax.grad(jax.checkpoint(_tagged, policy=recipe.policy())))
        return pinned_host_shapes(grad.trace(W, X).lower(lowering_platforms=("cuda",)).as_text())

    assert lowered(zoo.Recipe("o", offload=("query_proj",))) == {"tensor<4x8xf32>": 1}
    assert lowered(zoo.Recipe("d", device=("query_proj",))) == {}
    assert zoo.Recipe.full().policy() is jax.checkpoint_policies.nothing_saveable
    assert zoo.Recipe.none().policy() is jax.checkpoint_policies.everything_saveable


def test_recipes_are_hashable_values():
    a = zoo.Recipe("a", offload=("query_proj",))
    assert a == zoo.Recipe("a", offload=("query_proj",)) and hash(a) == hash(zoo.Recipe("a", offload=("query_proj",)))
