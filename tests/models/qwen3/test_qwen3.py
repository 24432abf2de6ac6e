"""Qwen3 (dense), the fourth family, added as its package and one registration line: the published parameter
counts (abstract models, nothing allocated), the published config.json, the q/k norm's effect, its recipes landing
as planned on the CUDA lowering with the gradients unchanged, and the planner planning it (the application's
command lines on it: tests/train/)."""
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from recipes.qwen3 import RECIPES
from recipes.registry import default_recipe, recipes_of
from tests.helpers import cuda_lowering, grads_under, hlo_type, max_rel_err, pinned_host_shapes, plain, tiered
from zoo.models import count_params, registry
from zoo.models.qwen3 import Qwen3Config, hf, qwen3
from zoo.plan import measure

FAMILY = registry.family("qwen3")
TINY = Qwen3Config.preset("tiny")
B, S = 2, 8


# the recipes of tags alone (tiles and groups: tests/models/test_stack.py)
PLAIN = [n for n in RECIPES if plain(RECIPES[n])]


@pytest.mark.parametrize("preset,published", [("qwen3_8b", 8_190_735_360), ("qwen3_32b", 32_762_123_264)])
def test_presets_count_the_published_parameters(preset, published):
    cfg = FAMILY.config(preset)
    model = nnx.eval_shape(lambda: qwen3(cfg, rngs=nnx.Rngs(0)))
    assert count_params(model) == published
    assert model.stack_names == ("layers",) and model.layers.num_layers == cfg.num_layers
    assert (cfg.vocab_size, cfg.head_dim, cfg.rope_theta, cfg.tie_embeddings) == (151936, 128, 1e6, False)


def test_the_family_is_registered_with_its_recipes():
    assert registry.family_of(TINY) is FAMILY and registry.family_for_hf({"model_type": "qwen3"}) is FAMILY
    assert registry.family_for_hf({"architectures": ["Qwen3ForCausalLM"]}) is FAMILY
    assert recipes_of(FAMILY) is RECIPES and default_recipe(FAMILY) == "qkv_offload"
    assert set(RECIPES) >= {"none", "full", "save_qkv", "qkv_offload", "minimal"}
    assert FAMILY.presets() == ("qwen3_8b", "qwen3_32b", "tiny")


# Qwen/Qwen3-8B's config.json as published
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
    "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


def test_published_config_maps_to_the_preset_and_back():
    cfg = hf.from_hf(QWEN3_8B, param_dtype="bfloat16")
    assert cfg == FAMILY.config("qwen3_8b", param_dtype="bfloat16", dtype="bfloat16")
    back = hf.to_hf(cfg)
    assert {k: back[k] for k in back if k in QWEN3_8B} == {k: QWEN3_8B[k] for k in back if k in QWEN3_8B}
    assert set(QWEN3_8B) <= set(hf.SUPPORTED) | set(hf.IGNORED) | set(hf.UNSUPPORTED)
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf.from_hf({**QWEN3_8B, "use_sliding_window": True}, param_dtype="bfloat16")
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported for Qwen3ForCausalLM"):
        hf.from_hf({**QWEN3_8B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, param_dtype="bfloat16")


def test_the_key_map_covers_the_published_tensors():
    """Qwen3-8B's checkpoint: 36 layers of 11 tensors (q/k norms among them), the embedding, the norm, the head."""
    keys = [k for e in FAMILY.hf.keys(FAMILY.config("qwen3_8b")) for k in e.keys()]
    assert len(keys) == len(set(keys)) == 36 * 11 + 3
    assert {"model.layers.35.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
            "lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"} <= set(keys)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        dataclasses.replace(TINY, num_kv_heads=3)
    with pytest.raises(ValueError, match="head_dim must be even"):
        dataclasses.replace(TINY, head_dim=15)
    with pytest.raises(ValueError, match="Qwen3 needs a Qwen3Config"):
        qwen3(registry.config("llama3", "tiny"), rngs=nnx.Rngs(0))


def test_forward_and_the_qk_norm():
    model = qwen3(TINY, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (B, S), 0, TINY.vocab_size)
    forward = nnx.jit(lambda m: m(tokens))   # compiled: op-by-op dispatch through the scan is the slow part
    logits = forward(model)
    assert logits.shape == (B, S, TINY.vocab_size) and model.lm_head is not None
    attn = model.layers.layers.attn
    assert attn.q_norm.scale.shape == (TINY.num_layers, TINY.head_dim) == attn.k_norm.scale.shape
    # the per-head q norm is applied: scaling its scale changes the logits
    attn.q_norm.scale[...] = attn.q_norm.scale[...] * 2.0
    assert not np.allclose(np.asarray(forward(model)), np.asarray(logits))


def test_flops_per_token_is_six_n_plus_attention():
    cfg = FAMILY.config("qwen3_8b")
    model = nnx.eval_shape(lambda: qwen3(cfg, rngs=nnx.Rngs(0)))
    n = 8_190_735_360 - 151936 * 4096   # the embedding is a gather, the untied head a matmul
    assert FAMILY.flops_per_token(cfg, model, 1) == 6 * n + 3 * 2 * 32 * 128 * 36


# the default set keeps `full` and the offload recipe naming the most tags; the other recipes are further cases of
# the same check (slow set, docs/testing.md)
@pytest.mark.parametrize("name", tiered(["full"] + [n for n in PLAIN if RECIPES[n].special is None],
                                        fast=("full", "minimal_offload")))
def test_recipes_land_as_planned(name):
    """Each needed residual is placed as the recipe says, and exactly the offloaded tags' tensors move to pinned
    host memory in the CUDA lowering of the training gradient."""
    recipe = RECIPES[name]
    model = qwen3(TINY, recipe=recipe, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, TINY.vocab_size, dtype=jnp.int32)
    needed = measure.residual_tags(model, "layers")
    seen = measure.placements_seen(model, "layers", B, S)
    assert {t: seen[t] for t in needed} == {t: recipe.placement(t) for t in needed}
    st = model.tag_shapes(B, S)["layers"]
    offloaded = [t for t in recipe.resolve().offload if t in needed]
    want_host = collections.Counter((st.num_layers,) + st.tags[t].shape for t in offloaded)
    want_hlo = collections.Counter(hlo_type(st.tags[t].shape, st.tags[t].dtype) for t in offloaded)
    assert (not recipe.offload) == (not want_hlo)
    res = measure.model_residuals(model, tokens)
    assert collections.Counter(r.shape for r in res if r.host) == want_host
    assert pinned_host_shapes(cuda_lowering(model, tokens)) == want_hlo


@pytest.fixture(scope="module")
def float32_grads():
    """(model, tokens, loss and gradients under `none`, nothing recomputed) of the tiny model in float32."""
    model = qwen3(TINY, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, TINY.vocab_size, dtype=jnp.int32)
    return model, tokens, grads_under(model, RECIPES["none"], tokens)


@pytest.mark.parametrize("name", tiered([n for n in PLAIN if n != "none"], fast=("full", "qkv_offload")))
def test_gradients_equal_under_every_recipe(float32_grads, name):
    model, tokens, (ref_loss, ref) = float32_grads
    loss, got = grads_under(model, RECIPES[name], tokens)
    assert abs(float(loss) - float(ref_loss)) < 1e-6
    assert max_rel_err(got, ref) < 1e-5


def test_the_planner_plans_the_8b():
    """zoo.plan.plan on the published 8B: its parameters, one layer's queries [1, 8192, 32, 128] offloaded, 36 layers
    (the planner's command line on it: tests/train/test_plan_cli.py)."""
    p = zoo.plan.plan(FAMILY.config("qwen3_8b"), RECIPES["qkv_offload"], batch=1, seq=8192)
    (stack,) = p.stacks
    assert p.state.num_params == 8_190_735_360
    tags = {t.tag: t for t in stack.tags}
    assert tags["query_proj"].shape == (1, 8192, 32, 128) and tags["query_proj"].host_bytes > 0
    assert stack.num_layers == 36
