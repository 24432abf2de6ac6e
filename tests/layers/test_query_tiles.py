"""A model over query tiles (zoo.layers.query_tiles, a config's attention_tiles): the untiled model's logits and
gradients (float32, 1e-5) and the same tag shapes, its per-tile tags marked as such; what a layer's recompute keeps
for its backward holds no whole-sequence queries; the loop makes no stacked copy of the sequence; the refusals (a
tile count that does not divide the sequence, MLA, a recipe keeping a per-tile tag)."""
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import zoo
from zoo.plan import measure


@pytest.fixture(autouse=True)
def exact_float32_matmuls():
    with jax.default_matmul_precision("highest"):
        yield


def rel(a, b):
    return float(jnp.linalg.norm((a - b).astype(jnp.float32)) / jnp.linalg.norm(b.astype(jnp.float32)))


def tiny(**overrides):
    return zoo.models.LlamaConfig.preset("tiny", **overrides)


def query_tiled_families():
    """The families whose attention runs over query tiles (each but those whose config refuses attention_tiles): the
    first in the default set, the others under `slow`."""
    from zoo.models import registry
    out = []
    for name, fam in sorted(registry.FAMILIES.items()):
        try:
            fam.config_cls.preset("tiny", attention_tiles=2)
        except ValueError:
            continue
        out.append(name if not out else pytest.param(name, marks=pytest.mark.slow))
    return out


@pytest.mark.parametrize("family", query_tiled_families())
def test_a_model_over_query_tiles_has_the_whole_models_logits_and_gradients(family):
    from zoo.models import registry
    fam = registry.family(family)
    whole, tiled = (fam.build(fam.config_cls.preset("tiny", attention_tiles=n), rngs=nnx.Rngs(0)) for n in (1, 4))
    tokens = jax.random.randint(jax.random.key(1), (2, 32), 0, whole.config.vocab_size)

    @nnx.jit
    def logits_and_grads(m):
        return m(tokens), nnx.grad(lambda m: jnp.mean(m(tokens) ** 2))(m)

    (got, got_grads), (want, want_grads) = logits_and_grads(tiled), logits_and_grads(whole)
    assert rel(got, want) < 1e-5
    assert all(rel(a, b) < 1e-5 for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)))


def test_tags_keep_their_whole_shapes_and_the_per_tile_ones_are_marked():
    whole = zoo.models.llama3(tiny(), rngs=nnx.Rngs(0)).tag_shapes(1, 32)["layers"]
    tiled = zoo.models.llama3(tiny(attention_tiles=4), rngs=nnx.Rngs(0)).tag_shapes(1, 32)["layers"]
    assert {t: s.shape for t, s in tiled.tags.items()} == {t: s.shape for t, s in whole.tags.items()}
    assert tiled.query_tiled == {"query_proj", "attention_out", "context", "out_proj"}
    assert whole.query_tiled == frozenset()


def test_a_layers_backward_keeps_one_tiles_queries_not_the_sequences():
    """What one layer's recompute keeps for its backward pass (JAX's list of residuals): whole, the sequence's
    queries and attention output; over query tiles, nothing of that shape (each tile remakes its own), and fewer
    bytes in all."""
    whole_q = (1, 64, 4, 16)
    kept = {}
    for n in (1, 4):
        model = zoo.models.llama3(tiny(attention_tiles=n, num_layers=1), rngs=nnx.Rngs(0))
        fn, state = model.layers.layer_fn()
        kept[n] = measure.residuals(lambda s, x, fn=fn: measure.sum_outputs(fn(s, x)), state,
                                    model.layers.abstract_input(1, 64))
    assert any(r.shape == whole_q for r in kept[1])
    assert not any(r.shape == whole_q for r in kept[4])
    assert sum(r.nbytes for r in kept[4]) < sum(r.nbytes for r in kept[1])


def test_the_loop_makes_no_stacked_copy_of_the_sequence():
    """Forward and backward of a model over 4 query tiles under `full`: no value is shaped as the layer input,
    queries or keys stacked by tile ([4, B, S / 4, ...]): each tile slices its rows inside the loop and writes its
    output in place, and its backward remakes the tile. (Under `none`, which saves every residual, the loop keeps
    each tile's.)"""
    from tests.layers.test_tiles import shapes_in
    model = zoo.models.llama3(tiny(attention_tiles=4, num_layers=1), rngs=nnx.Rngs(0))
    model.set_recipe(zoo.Recipe.full())
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.zeros((2, 64), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(tokens) ** 2)))(params).jaxpr
    stacked = [s for s in shapes_in(jaxpr) if s[:3] == (4, 2, 16)]
    assert stacked == []


def test_the_refusals_name_the_field():
    with pytest.raises(ValueError, match="attention_tiles=4 does not divide the sequence length 30"):
        tiny(attention_tiles=4).check_seq(30)
    with pytest.raises(ValueError, match="attention_tiles must be a positive int"):
        tiny(attention_tiles=0)
    with pytest.raises(ValueError, match="MLA attention has no query tiles"):
        zoo.models.DeepSeekV3Config.preset("tiny", attention_tiles=2)
    model = zoo.models.llama3(tiny(attention_tiles=2), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"keeps or offloads \['attention_out', 'context'\].*attention_tiles=2"):
        model.set_recipe(zoo.Recipe("pair", device=("attention_out", "context")))
    model.set_recipe(zoo.Recipe("kv", offload=("key_proj", "value_proj")))   # made whole: may be offloaded


def test_auto_recomputes_the_tags_made_in_query_tiles_and_says_why():
    """With room for everything, auto keeps the keys and values in HBM, but never a tag made in a query tile (JAX
    saves none of them: each tile remakes its own), whose note says so; and no structure auto tries keeps the
    kernel's pair while a group's backward runs."""
    from zoo.plan import Hardware
    from zoo.plan.auto import structures
    cfg = tiny(attention_tiles=2)
    p = zoo.plan.plan(cfg, "auto", batch=1, seq=64, hardware=Hardware(hbm_gib=1000, link_gbps=55, tflops=100))
    tags = {t.tag: t for s in p.stacks for t in s.tags}
    for name in ("query_proj", "attention_out", "context", "out_proj"):
        assert tags[name].placement == "remat" and "tile by tile" in tags[name].note, tags[name]
    assert tags["key_proj"].placement == "device"
    model = zoo.models.llama3(cfg, rngs=nnx.Rngs(0))
    assert all(keep == () for _, _, keep, _ in structures(model, 65536))


def test_a_users_functional_step_over_query_tiles_has_recipe_nones_gradients():
    """A user's own step (parameters split from the rest around `jax.jit`) with query tiles, under a recipe that
    recomputes (the layer input offloaded, groups of 2, sequence tiles), has the gradients of the untiled model
    under `none` (float32, 1e-5)."""
    tokens = jax.random.randint(jax.random.key(2), (2, 32), 0, 256)

    def grads(cfg, recipe):
        model = zoo.models.llama3(cfg, rngs=nnx.Rngs(0))
        model.set_recipe(recipe)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        @jax.jit
        def step(params, rest):
            return jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p, rest)(tokens) ** 2))(params)
        return jax.tree.leaves(step(params, rest))

    structured = zoo.Recipe("carry", offload=("decoder_layer_input",), seq_tiles=2, group=2)
    got = grads(tiny(attention_tiles=4), structured)
    want = grads(tiny(), zoo.Recipe.none())
    assert all(rel(a, b) < 1e-5 for a, b in zip(got, want))
