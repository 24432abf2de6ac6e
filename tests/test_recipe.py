"""Recipes: validation, patterns, and the policy they compile to."""
import importlib

import jax
import jax.numpy as jnp
import pytest

import zoo
from recipes.table import UnknownRecipe
from tests.helpers import pinned_host_shapes
from zoo import tags
from zoo.plan import measure


def test_patterns_expand_over_vocabulary():
    r = zoo.Recipe("r", offload=("moe_*",), device=("query_proj",))
    assert r.offload == ("moe_*",)   # what was written
    assert r.resolve().offload == ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo") and r.resolve().device == ("query_proj",)
    assert r.placement("moe_mlpwo") == "offload" and r.placement("query_proj") == "device"
    assert r.placement("mlpwo") == "remat"


@pytest.mark.parametrize("kwargs, match", [
    (dict(offload=("qurey_proj",)), r"'qurey_proj' matches no tag; the vocabulary is: decoder_layer_input"),
    (dict(device=("nothing_*",)), "matches no tag"),
    (dict(offload=("query_proj",), device=("query_*",)), r"\['query_proj'\] placed both"),
    (dict(offload="query_proj"), "a tuple of tags"),
    (dict(device=["query_proj"]), r"device takes a tuple of tags, got \['query_proj'\]"),
])
def test_bad_recipes_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        zoo.Recipe("bad", **kwargs)


PAIR = ("attention_out", "context")


@pytest.mark.parametrize("kwargs, match", [
    (dict(lead_device=PAIR), r"need layer groups of two levels .*; got group=1, subgroup=1"),
    (dict(lead_offload=PAIR, group=4, subgroup=2), r"got group=4, subgroup=2"),
    (dict(lead_device=PAIR, group=2, special="full"), r"got special='full'"),
    (dict(lead_device=("attention_out",), group=2), r"the lead layer keeps \['attention_out'\] but not \['context'\]"),
    (dict(lead_device=PAIR, lead_offload=("context",), group=2), r"\['context'\] are placed both in HBM and offloaded"),
    (dict(lead_offload=PAIR, device=PAIR, group=2), r"kept by every layer already"),
    (dict(lead_device=("attn_*",), group=2), r"lead_device: 'attn_\*' matches no tag"),
])
def test_bad_lead_tags_raise(kwargs, match):
    """What a group's first layer keeps between the passes (`lead_device`, `lead_offload`) needs two-level groups,
    tags no layer keeps already, one placement each, and the attention kernel's pair whole."""
    with pytest.raises(ValueError, match=match):
        zoo.Recipe("bad", **kwargs)


def test_a_groups_first_layer_names_its_tags_apart_and_the_policies_keep_them():
    """Inside `zoo.tags.role(LEAD)` a tag is named `tag@lead`; the group's policy keeps the lead's tags where the
    recipe says and every tag the recipe keeps, named either way; the first layer's own policy saves its names only."""
    r = zoo.Recipe("lead", offload=("decoder_layer_input",), device=("key_proj",), group=4, group_keep=PAIR,
                   lead_offload=PAIR)
    assert r.resolve().lead == PAIR
    assert "the first layer of each group offloading ['attention_out', 'context']" in str(r)
    with tags.role(tags.LEAD):
        assert tags.current_role() == "lead"
        jaxpr = jax.make_jaxpr(lambda x: tags.name(x, "context"))(jnp.ones(3))
    assert tags.current_role() == "" and "name=context@lead" in str(jaxpr)
    assert tags.split_name("context@lead") == ("context", "lead") and tags.split_name("context") == ("context", "")

    def first_layer(x):
        with tags.role(tags.LEAD):
            k = tags.name(jnp.sin(x @ W), "key_proj")
            return jnp.sum(jnp.sin(tags.name(jnp.sin(k), "query_proj")))

    res = measure.residuals(jax.checkpoint(first_layer, policy=r.lead_policy()), X)
    assert [(res.tag, res.host) for res in res if res.tag] == [("key_proj@lead", False)]
    assert zoo.Recipe("g", offload=("decoder_layer_input",), group=4).lead_policy() is None


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


def test_a_recipe_is_the_value_it_was_made_as():
    """Fields hold what was written; `dataclasses.replace` and `==` see only them, and a replaced recipe still
    matches the model the original matched (its patterns are not swapped for one expansion of them)."""
    import dataclasses

    from flax import nnx

    written = zoo.Recipe("x", offload=("*_proj",), description="every projection")
    assert written.offload == ("*_proj",) and not hasattr(written, "patterns")
    assert {f.name: getattr(written, f.name) for f in dataclasses.fields(written)} == dict(
        name="x", offload=("*_proj",), device=(), special=None, description="every projection", seq_tiles=1, group=1,
        group_keep=(), subgroup=1, lead_device=(), lead_offload=())
    renamed = dataclasses.replace(written, name="y")
    assert renamed.offload == written.offload and renamed.resolve().offload == written.resolve().offload
    assert renamed != written and dataclasses.replace(renamed, name="x") == written
    assert hash(dataclasses.replace(renamed, name="x")) == hash(written)
    # a pattern and the names it expands to are different values with the same placements
    spelled = zoo.Recipe("x", offload=written.resolve().offload, description="every projection")
    assert spelled != written and spelled.resolve().offload == written.resolve().offload
    model = zoo.models.registry.family("llama3").build(zoo.models.registry.config("llama3", "tiny"),
                                                       rngs=nnx.Rngs(0))
    emitted = {t for st in model.tag_shapes(1, 8).values() for t in st.tags}
    for r in (written, renamed):
        r.check_emitted(emitted, where="Llama")
        model.check_recipe(r)
    # against a model, the expansion keeps only what it emits (the MLA projections are not a Llama's)
    assert written.resolve(emitted).offload == ("query_proj", "key_proj", "value_proj", "out_proj")
    with pytest.raises(ValueError, match="offload entry 'moe_\\*' matches no tag that Llama emits"):
        zoo.Recipe("m", offload=("moe_*",)).resolve(emitted, where="Llama")


def test_a_sequence_longer_than_the_models_context_is_refused_before_anything_compiles():
    """`max_seq_len` (a preset's published context) bounds the planner (and the main job: tests/train); a user
    raises it."""
    cfg = zoo.models.LlamaConfig.preset("llama3_1_8b", num_layers=1)
    assert cfg.max_seq_len == 131072
    with pytest.raises(ValueError, match="sequence length 262144 is longer than LlamaConfig.max_seq_len=131072"):
        zoo.plan.plan(cfg, zoo.Recipe.full(), batch=1, seq=262144, peak=None)
    with pytest.raises(ValueError, match="max_seq_len must be a positive int"):
        zoo.models.LlamaConfig.preset("tiny", max_seq_len=0)


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3", "qwen3", "qwen3_moe"])
def test_a_recipe_name_a_family_lacks_is_named_with_the_families_recipes(family):
    """`RECIPES[typo]`: an error listing the family's recipes and the closest name; a KeyError (so `in` and `.get`
    are a dict's) and a ValueError (bad input, as the zoo refuses it everywhere)."""
    table = importlib.import_module(f"recipes.{family}").RECIPES
    with pytest.raises(UnknownRecipe) as e:
        table["fulll"]
    assert isinstance(e.value, KeyError) and isinstance(e.value, ValueError)
    assert str(e.value) == (f"'fulll' is not a {family} recipe (did you mean 'full'?); the {family} recipes: "
                            f"{', '.join(table)}")
    assert "fulll" not in table and table.get("fulll") is None and table["full"].name == "full"
    with pytest.raises(KeyError, match="no such"):
        table["no such"]
