"""Llama 3.1: layer and model shapes, gradients under every recipe, residual placement, configs."""
import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from recipes.llama3 import RECIPES
from tests.helpers import cuda_lowering, grads_under, hlo_type, max_rel_err, pinned_host_shapes, plain, tiered
from zoo.layers import MLP, Attention, Embed, LMHead, RMSNorm, Rope, WavelengthScaling
from zoo.models.llama3 import LlamaDecoderLayer
from zoo.plan import measure

CFG = zoo.models.LlamaConfig.preset("tiny")
B, S = 2, 8


# the recipes of tags alone (tiles and groups: tests/models/test_stack.py)
PLAIN = [n for n in RECIPES if plain(RECIPES[n])]


@pytest.fixture(scope="module")
def model():
    return zoo.models.llama3(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (B, S), 0, CFG.vocab_size, dtype=jnp.int32)


def test_layer_shapes():
    rngs = nnx.Rngs(0)
    x = jax.random.normal(jax.random.key(0), (B, S, CFG.dim))
    attn = Attention(dim=64, num_heads=4, num_kv_heads=2, head_dim=16, rope=CFG.rope(), rngs=rngs)
    assert attn(x).shape == (B, S, 64)
    assert MLP(dim=64, hidden=128, rngs=rngs)(x).shape == (B, S, 64)
    assert RMSNorm(64)(x).shape == (B, S, 64)
    assert LlamaDecoderLayer(CFG, rngs=rngs)(x).shape == (B, S, 64)
    assert Embed(vocab=10, dim=64, rngs=rngs)(jnp.zeros((B, S), jnp.int32)).shape == (B, S, 64)
    assert LMHead(dim=64, vocab=10, rngs=rngs)(x).shape == (B, S, 10)
    assert Rope(dim=16)(jnp.ones((B, S, 4, 16)), jnp.arange(S)).shape == (B, S, 4, 16)


def test_layers_report_the_tags_they_emit():
    rngs = nnx.Rngs(0)
    x = jax.ShapeDtypeStruct((B, S, 64), jnp.float32)
    attn = Attention(dim=64, num_heads=4, num_kv_heads=2, head_dim=16, rope=CFG.rope(), rngs=rngs)
    got = {t: s.shape for t, s in zoo.emitted.emitted_by(attn, x).items()}
    assert got == {"query_proj": (B, S, 4, 16), "key_proj": (B, S, 2, 16), "value_proj": (B, S, 2, 16),
                   "attention_out": (B, S, 4, 16), "context": (B, 4, S), "out_proj": (B, S, 64)}
    got = {t: s.shape for t, s in zoo.emitted.emitted_by(MLP(dim=64, hidden=128, rngs=rngs), x).items()}
    assert got == {"mlpwi_0": (B, S, 128), "mlpwi_1": (B, S, 128), "mlpwo": (B, S, 64)}
    shared = MLP(dim=64, hidden=32, tag_prefix="shared_", rngs=rngs)
    assert list(zoo.emitted.emitted_by(shared, x)) == ["shared_mlpwi_0", "shared_mlpwi_1", "shared_mlpwo"]


def test_model_shapes_and_finite_gradients(model, tokens):
    logits = model(tokens)
    assert logits.shape == (B, S, CFG.vocab_size) and logits.dtype == jnp.float32
    loss, grads = grads_under(model, RECIPES["qkv_offload"], tokens)
    assert np.isfinite(float(loss))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert any(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


def test_stack_tags_first_name_is_the_layer_input(model):
    tags = model.tag_shapes(B, S)["layers"].tags
    assert list(tags)[0] == "decoder_layer_input" and tags["decoder_layer_input"].shape == (B, S, CFG.dim)


def test_causality(model, tokens):
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % CFG.vocab_size)
    np.testing.assert_array_equal(np.asarray(model(tokens)[:, :-1]), np.asarray(model(changed)[:, :-1]))


@pytest.fixture(scope="module")
def reference(model, tokens):
    """The loss and gradients under `none` (nothing recomputed), computed once for every recipe's comparison."""
    return grads_under(model, RECIPES["none"], tokens)


# the default set keeps `full` and the offload recipe naming the most tags (as the other families' tests do); the
# other recipes' gradients are further cases of the same check (slow set)
@pytest.mark.parametrize("name", tiered([n for n in PLAIN if n != "none"], fast=("full", "minimal_offload")))
def test_gradients_equal_under_every_recipe(model, tokens, reference, name):
    ref_loss, ref = reference
    loss, got = grads_under(model, RECIPES[name], tokens)
    assert abs(float(loss) - float(ref_loss)) < 1e-6
    assert max_rel_err(got, ref) < 1e-5


# the placement tests: the default set keeps the offload recipe naming the most tags and one that saves in HBM; the
# other recipes are further cases of the same check (slow set; docs/testing.md)
@pytest.mark.parametrize("name", tiered([n for n in PLAIN if RECIPES[n].special is None],
                                        fast=("minimal_offload", "minimal")))
def test_residuals_are_placed_as_the_recipe_says(model, tokens, name):
    recipe = RECIPES[name]
    model.set_recipe(recipe)
    needed = measure.residual_tags(model, "layers")
    # one layer: each tag the backward pass needs is where the recipe puts it
    seen = measure.placements_seen(model, "layers", B, S)
    assert {t: seen[t] for t in needed} == {t: recipe.placement(t) for t in needed}
    # the whole model: exactly one stacked host residual [L, ...] per offloaded tag, nothing else on the host
    shapes = model.tag_shapes(B, S)["layers"].tags
    res = measure.model_residuals(model, tokens)
    host = collections.Counter(r.shape for r in res if r.host)
    assert host == collections.Counter((CFG.num_layers,) + shapes[t].shape for t in recipe.offload if t in needed)
    device = collections.Counter(r.shape for r in res if not r.host)
    for t in recipe.device:
        if t in needed:
            assert device[(CFG.num_layers,) + shapes[t].shape] >= 1, t


@pytest.mark.parametrize("name", tiered([n for n in PLAIN if RECIPES[n].offload] + ["save_qkv"],   # every offload
                                        fast=("minimal_offload", "save_qkv")))
def test_cuda_lowering_places_offloaded_tags_in_pinned_host(model, tokens, name):
    recipe = RECIPES[name]
    model.set_recipe(recipe)
    shapes = model.tag_shapes(B, S)["layers"].tags
    needed = measure.residual_tags(model, "layers")
    pinned = pinned_host_shapes(cuda_lowering(model, tokens))
    want = collections.Counter(hlo_type(shapes[t].shape, shapes[t].dtype) for t in recipe.offload if t in needed)
    assert pinned == want  # save_qkv: nothing goes to the host


def test_every_emitted_tag_is_really_emitted(model):
    """A recipe that offloads only tag t produces a host residual, for every tag the backward pass needs."""
    emitted = model.tag_shapes(1, 8)["layers"].tags
    needed = measure.residual_tags(model, "layers")
    assert set(needed) == set(emitted) - {"mlpwo"}  # mlpwo only flows into the residual sum: never saved
    for t in needed:   # attention_out and context only go together (zoo.recipe.TOGETHER)
        group = next((g for g in zoo.recipe.TOGETHER if t in g), (t,))
        model.set_recipe(zoo.Recipe(f"only_{t}", offload=group))
        assert measure.placements_seen(model, "layers")[t] == "offload", t


def test_offloading_the_layer_input_really_offloads(model, tokens):
    """The trap of jax#23869: naming the carry outside the remat body would leave it on the device."""
    model.set_recipe(zoo.Recipe("carry", offload=("decoder_layer_input",)))
    res = measure.model_residuals(model, tokens)
    stacked = (CFG.num_layers, B, S, CFG.dim)
    assert [r.shape for r in res if r.host] == [stacked]
    assert stacked not in [r.shape for r in res if not r.host]


def test_recipe_naming_a_tag_the_model_never_emits_fails_at_build():
    with pytest.raises(ValueError, match="'moe_\\*' matches no tag that Llama emits"):
        zoo.models.llama3(CFG, recipe=zoo.Recipe("moe", offload=("moe_*",)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="'query_wa_proj' matches no tag"):
        zoo.models.llama3(CFG, recipe=zoo.Recipe("mla", device=("query_wa_proj",)), rngs=nnx.Rngs(0))


def test_param_counts_of_presets():
    def count(cfg):
        return zoo.models.count_params(nnx.eval_shape(lambda: zoo.models.llama3(cfg, rngs=nnx.Rngs(0))))
    assert count(zoo.models.LlamaConfig.preset("llama3_1_405b")) == 405_853_388_800
    assert count(zoo.models.LlamaConfig.preset("llama3_1_8b")) == 8_030_261_248


def test_parameters_carry_logical_axes(model):
    def axes(v):
        return v.get_metadata()["out_sharding"]
    layer = model.layers.layers
    assert axes(layer.attn.q_proj.kernel) == ("layers", "embed", "heads", "head_dim")
    assert axes(layer.attn.k_proj.kernel) == ("layers", "embed", "kv_heads", "head_dim")
    assert axes(layer.mlp.down_proj.kernel) == ("layers", "mlp", "embed")
    assert axes(model.embed.embedding) == ("vocab", "embed")
    params = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert all(axes(p) for p in params)


def test_rope_llama3_scaling_matches_published_formula():
    inv = Rope(dim=128, theta=500000.0, scaling=WavelengthScaling()).inv_freq()
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    wavelen = 2 * np.pi / base
    assert np.allclose(inv[wavelen < 8192 / 4], base[wavelen < 8192 / 4])       # high frequencies kept
    assert np.allclose(inv[wavelen > 8192], base[wavelen > 8192] / 8)          # low frequencies divided by 8


@pytest.mark.parametrize("change, field", [
    (dict(num_heads=5), "num_kv_heads=2 must divide num_heads=5"),
    (dict(num_kv_heads=3), "num_kv_heads=3 must divide num_heads=4"),
    (dict(dim=-1), "LlamaConfig.dim must be a positive int"),
    (dict(num_layers=0), "LlamaConfig.num_layers"),
    (dict(dtype="float8"), "dtype='float8' is not a supported dtype"),
    (dict(param_dtype="int8"), "param_dtype='int8'"),
    (dict(head_dim=15), "head_dim must be even"),
    (dict(attention_impl="flash"), "attention_impl"),
    (dict(norm_eps=0.0), "norm_eps"),
    # every field against its type
    (dict(tie_embeddings="no"), "LlamaConfig.tie_embeddings must be a bool, got 'no'"),
    (dict(num_layers=2.0), "LlamaConfig.num_layers must be an int, got 2.0"),
    (dict(rope_theta=float("nan")), "LlamaConfig.rope_theta must be a finite number, got nan"),
    (dict(attention_impl=3), "attention_impl must be a string or None"),
])
def test_bad_configs_raise_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CFG, **change)


def test_bad_tokens_raise(model):
    with pytest.raises(ValueError, match="integer array"):
        model(jnp.zeros((2, 8), jnp.float32))


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CFG.dim = 3


def test_every_layer_reports_its_tags_for_a_config():
    """`layer.tag_shapes(batch, seq)` on an abstract layer built from a full-size config: no memory."""
    cfg = zoo.models.LlamaConfig.preset("llama3_1_405b")
    layer = nnx.eval_shape(lambda: LlamaDecoderLayer(cfg, rngs=nnx.Rngs(0)))
    tags = layer.tag_shapes(2, 8192)
    assert tags["query_proj"].shape == (2, 8192, 128, 128) and tags["query_proj"].dtype == jnp.bfloat16
    assert tags["key_proj"].shape == tags["value_proj"].shape == (2, 8192, 8, 128)
    assert tags["mlpwi_0"].shape == (2, 8192, 53248)
    assert list(layer.attn.tag_shapes(2, 8192)) == ["query_proj", "key_proj", "value_proj", "attention_out", "context",
                                                 "out_proj"]
    assert list(layer.mlp.tag_shapes(2, 8192)) == ["mlpwi_0", "mlpwi_1", "mlpwo"]


def test_a_one_layer_stack_offloads_too():
    """XLA drops a while loop that runs once, and the offloads in it (measured on the H200, jax 0.11.2: 0 host
    bytes). A one-layer stack is applied without a scan: its offloaded tags are host residuals, its gradients
    equal those of `none`, and the planner counts what JAX saves."""
    cfg = dataclasses.replace(CFG, num_layers=1)
    model = zoo.models.llama3(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (B, S), 0, cfg.vocab_size, dtype=jnp.int32)
    _, ref = grads_under(model, RECIPES["none"], tokens)
    _, got = grads_under(model, RECIPES["qkv_offload"], tokens)
    assert max_rel_err(got, ref) < 1e-5
    shapes = model.tag_shapes(B, S)["layers"].tags
    host = collections.Counter(r.shape for r in measure.model_residuals(model, tokens) if r.host)
    assert host == collections.Counter(shapes[t].shape for t in RECIPES["qkv_offload"].offload)
    plan = zoo.plan.plan(cfg, RECIPES["qkv_offload"], batch=B, seq=S)
    assert plan.host_bytes == sum(math.prod(shapes[t].shape) * 4 for t in RECIPES["qkv_offload"].offload)
