"""Qwen3-MoE, the third family: published parameter counts (abstract models, nothing allocated), the dense/MoE
layer pattern transformers uses, the q/k norm's effect, its recipes landing as planned on the CUDA lowering, and
the planner planning it (the application's command lines on it: tests/train/)."""
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from recipes.qwen3_moe import RECIPES
from recipes.registry import default_recipe, recipes_of
from tests.helpers import cuda_lowering, grads_under, hlo_type, max_rel_err, pinned_host_shapes, plain, tiered
from zoo.models import count_params, registry
from zoo.models.qwen3_moe import Qwen3MoeConfig, hf, qwen3_moe
from zoo.plan import measure

FAMILY = registry.family("qwen3_moe")
TINY = Qwen3MoeConfig.preset("tiny")
B, S = 2, 8


# the recipes of tags alone (tiles and groups: tests/models/test_stack.py)
PLAIN = [n for n in RECIPES if plain(RECIPES[n])]


@pytest.mark.parametrize("preset,published", [("qwen3_30b_a3b", 30_532_122_624),
                                               ("qwen3_235b_a22b", 235_093_634_560)])
def test_presets_count_the_published_parameters(preset, published):
    cfg = FAMILY.config(preset)
    model = nnx.eval_shape(lambda: qwen3_moe(cfg, rngs=nnx.Rngs(0)))
    assert count_params(model) == published
    assert model.stack_names == ("moe_layers",) and model.moe_layers.num_layers == cfg.num_layers


def test_the_family_is_registered_with_its_recipes():
    assert registry.family_of(TINY) is FAMILY and registry.family_for_hf({"model_type": "qwen3_moe"}) is FAMILY
    assert recipes_of(FAMILY) is RECIPES and default_recipe(FAMILY) in RECIPES
    assert FAMILY.presets() == ("qwen3_30b_a3b", "qwen3_235b_a22b", "tiny")


# Qwen/Qwen3-30B-A3B's config.json as published
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}


def test_published_config_maps_to_the_preset_and_back():
    cfg = hf.from_hf(QWEN3_30B_A3B, param_dtype="bfloat16")
    assert cfg == FAMILY.config("qwen3_30b_a3b", param_dtype="bfloat16", dtype="bfloat16")
    back = hf.to_hf(cfg)
    assert {k: back[k] for k in back if k in QWEN3_30B_A3B} == {k: QWEN3_30B_A3B[k] for k in back
                                                                 if k in QWEN3_30B_A3B}
    assert set(QWEN3_30B_A3B) <= set(hf.SUPPORTED) | set(hf.IGNORED) | set(hf.UNSUPPORTED)
    with pytest.raises(ValueError, match="use_sliding_window"):
        hf.from_hf({**QWEN3_30B_A3B, "use_sliding_window": True}, param_dtype="bfloat16")


def test_dense_layers_where_transformers_puts_them():
    cfg = dataclasses.replace(TINY, num_layers=6, decoder_sparse_step=2, mlp_only_layers=(3,))
    # layer i has experts when (i + 1) % 2 == 0 and i != 3: layers 1 and 5
    assert [i for i in range(6) if cfg.has_experts(i)] == [1, 5]
    assert [(moe, list(r)) for moe, r in cfg.layer_runs()] == [
        (False, [0]), (True, [1]), (False, [2, 3, 4]), (True, [5])]
    model = nnx.eval_shape(lambda: qwen3_moe(cfg, rngs=nnx.Rngs(0)))
    assert model.stack_names == ("dense_layers_0", "moe_layers_1", "dense_layers_2", "moe_layers_5")
    keys = [k for e in FAMILY.hf.keys(cfg) for k in e.keys()]
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in keys and "model.layers.3.mlp.up_proj.weight" in keys
    assert not any(k.startswith(("model.layers.3.mlp.gate.weight", "model.layers.1.mlp.up_proj")) for k in keys)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="mlp_only_layers"):
        dataclasses.replace(TINY, mlp_only_layers=(4,))
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be at most num_experts=8"):
        dataclasses.replace(TINY, num_experts_per_tok=9)
    with pytest.raises(ValueError, match="num_kv_heads=3 must divide num_heads=4"):
        dataclasses.replace(TINY, num_kv_heads=3)


def test_forward_aux_and_the_qk_norm():
    model = qwen3_moe(TINY, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(0), (B, S), 0, TINY.vocab_size)
    logits, aux = model(tokens, return_aux=True)
    assert logits.shape == (B, S, TINY.vocab_size) and aux["dense_layers"] == {}
    assert aux["moe_layers"].load.shape == (2, TINY.num_experts)
    np.testing.assert_allclose(np.asarray(aux["moe_layers"].load.sum(-1)), B * S * TINY.num_experts_per_tok)
    assert float(FAMILY.aux_loss(TINY, aux)) > 0
    # the per-head q norm is applied: scaling its scale changes the logits
    q_norm = model.moe_layers.layers.attn.q_norm.scale
    q_norm[...] = q_norm[...] * 2.0
    assert not np.allclose(np.asarray(model(tokens)), np.asarray(logits))


def test_flops_per_token_counts_the_active_experts():
    cfg = FAMILY.config("qwen3_30b_a3b")
    model = nnx.eval_shape(lambda: qwen3_moe(cfg, rngs=nnx.Rngs(0)))
    active = FAMILY.flops_per_token(cfg, model, 1) / 6   # attention over one key is negligible
    assert 3.0e9 < active < 3.5e9   # "A3B": about 3.3B active parameters with the embedding excluded


# the default set keeps the offload recipe naming the most tags; the other recipes are further cases of the same
# check (slow set, docs/testing.md)
@pytest.mark.parametrize("name", tiered(["full"] + [n for n in PLAIN if RECIPES[n].special is None],
                                        fast=("qkv_context_moe_offload",)))
def test_recipes_land_as_planned(name):
    """Each needed residual is placed as the recipe says, and exactly the offloaded tags' tensors move to pinned
    host memory in the CUDA lowering of the training gradient."""
    recipe = RECIPES[name]
    model = qwen3_moe(TINY, recipe=recipe, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, TINY.vocab_size, dtype=jnp.int32)
    want_host, want_hlo = collections.Counter(), collections.Counter()
    for stack in model.stack_names:
        needed = measure.residual_tags(model, stack)
        seen = measure.placements_seen(model, stack, B, S)
        assert {t: seen[t] for t in needed} == {t: recipe.placement(t) for t in needed}, stack
        st = model.tag_shapes(B, S)[stack]
        offloaded = [t for t in recipe.offload if t in needed]
        want_host.update((st.num_layers,) + st.tags[t].shape for t in offloaded)
        want_hlo.update(hlo_type(st.tags[t].shape, st.tags[t].dtype) for t in offloaded)
    assert (not recipe.offload) == (not want_hlo)
    res = measure.model_residuals(model, tokens)
    assert collections.Counter(r.shape for r in res if r.host) == want_host
    assert pinned_host_shapes(cuda_lowering(model, tokens)) == want_hlo


@pytest.fixture(scope="module")
def float32_grads():
    """(model, tokens, loss and gradients under `none`, nothing recomputed) of the tiny model in float32."""
    model = qwen3_moe(dataclasses.replace(TINY, dtype="float32"), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (B, S), 0, TINY.vocab_size, dtype=jnp.int32)
    return model, tokens, grads_under(model, RECIPES["none"], tokens)


@pytest.mark.parametrize("name", tiered([n for n in PLAIN if n != "none"], fast=("full", "qkv_moe_offload")))
def test_gradients_equal_under_every_recipe(float32_grads, name):
    model, tokens, (ref_loss, ref) = float32_grads
    loss, got = grads_under(model, RECIPES[name], tokens)
    assert abs(float(loss) - float(ref_loss)) < 1e-6
    assert max_rel_err(got, ref) < 1e-5


def test_the_planner_plans_it():
    """zoo.plan.plan on the tiny model: the MoE experts' up-projections and the queries are planned tags (the
    planner's command line on it: tests/train/test_plan_cli.py)."""
    p = zoo.plan.plan(TINY, RECIPES["qkv_moe_offload"], batch=2, seq=64)
    tags = {t.tag for s in p.stacks for t in s.tags}
    assert {"moe_mlpwi_0", "query_proj"} <= tags and p.host_bytes > 0


def test_the_moe_backend_is_chosen_when_the_model_is_built(monkeypatch):
    """The MoE layer asks which backend runs once, when it is built for the device, and says which; tracing and
    calling the model asks nothing (a model built for one device keeps its choice)."""
    from zoo.layers.moe import backend as backends
    asked = []
    choose = backends.backend_choice
    monkeypatch.setattr(backends, "backend_choice", lambda *a, **kw: asked.append(kw) or choose(*a, **kw))
    model = qwen3_moe(dataclasses.replace(TINY, moe_backend="auto"), rngs=nnx.Rngs(0))
    moe = model.moe_layers.layers.mlp
    assert (moe.backend, moe.runs) == ("auto", "ragged_dot") and "auto on cpu" in moe.choice
    built = len(asked)
    assert built >= 1
    tokens = jax.random.randint(jax.random.key(0), (B, S), 0, TINY.vocab_size)
    nnx.jit(lambda m: m(tokens))(model)
    assert len(asked) == built
