"""zoo.tags: the closed vocabulary, and `name` (checkpoint_name restricted to it, with its sharding constraint)."""
import jax
import jax.numpy as jnp
import pytest

from zoo import tags


def test_vocabulary_is_closed_and_complete():
    expected = {"decoder_layer_input", "query_proj", "key_proj", "value_proj", "attention_out", "out_proj",
                "context", "query_wa_proj", "mla_q", "kv_wa_proj", "mla_kv", "mlpwi_0", "mlpwi_1", "mlpwo",
                "moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo", "shared_mlpwi_0", "shared_mlpwi_1", "shared_mlpwo"}
    assert set(tags.NAMES) == expected
    assert all(t.meaning and t.shape for t in tags.TAGS.values())
    assert tags.vocabulary() == ", ".join(tags.NAMES) and tags.vocabulary().startswith("decoder_layer_input, ")


def test_name_rejects_unknown_tag():
    with pytest.raises(ValueError, match="unknown tag 'qkv'.*query_proj"):
        tags.name(jax.numpy.ones(2), "qkv")


def test_name_is_checkpoint_name_and_leaves_the_value():
    x = jnp.arange(6.0).reshape(2, 3)
    eqns = jax.make_jaxpr(lambda x: tags.name(x, "mlpwo", ("batch", "embed")))(x).jaxpr.eqns
    assert [(e.primitive.name, e.params["name"]) for e in eqns] == [("name", "mlpwo")]   # no mesh: no constraint
    assert (tags.name(x, "mlpwo") == x).all()
