"""Recipes: validation, patterns, and the policy they compile to."""
import jax
import pytest

import zoo
from zoo import tags


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


def test_policy_offloads_to_pinned_host():
    # any other destination string silently keeps the value on the device
    from zoo.recipe import OFFLOAD_DST
    assert OFFLOAD_DST == "pinned_host"
    assert zoo.Recipe.full().policy() is jax.checkpoint_policies.nothing_saveable
    assert zoo.Recipe.none().policy() is jax.checkpoint_policies.everything_saveable


def test_recipes_are_hashable_values():
    a = zoo.Recipe("a", offload=("query_proj",))
    assert a == zoo.Recipe("a", offload=("query_proj",)) and hash(a) == hash(zoo.Recipe("a", offload=("query_proj",)))
