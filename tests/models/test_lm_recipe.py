"""`CausalLM`'s recipe: the model's one copy of it, a value changed only through `set_recipe`, which checks it against
the tags the stacks emit before taking it."""
import pytest
from flax import nnx

import recipes
import zoo


@pytest.fixture(scope="module")
def model():
    cfg = zoo.models.LlamaConfig.preset("tiny", num_layers=2)
    return nnx.eval_shape(lambda: zoo.models.llama3(cfg, recipe=recipes.llama3.RECIPES["qkv_offload"],
                                                    rngs=nnx.Rngs(0)))


def test_a_refused_recipe_leaves_the_model_as_it_was(model):
    with pytest.raises(ValueError, match="mla_q"):
        model.set_recipe(zoo.Recipe("not_emitted", offload=("mla_q",)))   # MLA's tag: GQA emits none
    assert model.recipe == recipes.llama3.RECIPES["qkv_offload"]


def test_the_recipe_is_not_assigned_past_its_check(model):
    with pytest.raises(AttributeError):
        model.recipe = zoo.Recipe("unchecked", offload=("mla_q",))   # a tag no stack of this model emits
    assert model.recipe.name == "qkv_offload"


def test_the_recipe_travels_with_the_graph_of_a_functional_step(model):
    """`nnx.split` keeps the recipe in the graph definition (static), so a user's jitted step sees it."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert nnx.merge(graphdef, params, rest).recipe == model.recipe
    other = nnx.merge(graphdef, params, rest)
    other.set_recipe(recipes.llama3.RECIPES["full"])
    assert nnx.split(other, nnx.Param, ...)[0] != graphdef and model.recipe.name == "qkv_offload"
