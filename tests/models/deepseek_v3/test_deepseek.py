"""DeepSeek-V3: shapes, gradients under every recipe, residual placement per stack, configs, the 671B count."""
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from recipes.deepseek_v3 import RECIPES
from tests.helpers import cuda_lowering, grads_under, hlo_type, max_rel_err, pinned_host_shapes, plain, tiered
from zoo.layers import MLA, Rope, RoutingBias, YarnScaling
from zoo.layers.moe import update_routing_bias
from zoo.models.deepseek_v3 import total_balance_loss
from zoo.plan import measure

CFG = zoo.models.DeepSeekV3Config.preset("tiny")
B, S = 2, 8
STACKS = ("dense_layers", "moe_layers")


# the recipes of tags alone (tiles and groups: tests/models/test_stack.py)
PLAIN = [n for n in RECIPES if plain(RECIPES[n])]


@pytest.fixture(scope="module")
def model():
    return zoo.models.deepseek_v3(CFG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def forward():
    """The model's forward pass with aux, compiled once for the module."""
    return nnx.jit(lambda m, t: m(t, return_aux=True))


@pytest.fixture(scope="module")
def tokens():
    return jax.random.randint(jax.random.key(1), (B, S), 0, CFG.vocab_size, dtype=jnp.int32)


def test_stacks_and_their_tags(model):
    assert model.stack_names == STACKS
    assert model.dense_layers.num_layers == 2 and model.moe_layers.num_layers == 2
    shapes = model.tag_shapes(B, S)
    mla = {"decoder_layer_input": (B, S, 64), "query_wa_proj": (B, S, 32), "mla_q": (B, S, 32),
           "query_proj": (B, S, 4, 24), "kv_wa_proj": (B, S, 24), "mla_kv": (B, S, 16), "key_proj": (B, S, 4, 24),
           "value_proj": (B, S, 4, 16), "attention_out": (B, S, 4, 16), "context": (B, 4, S),
           "out_proj": (B, S, 64)}
    assert {t: s.shape for t, s in shapes["dense_layers"].tags.items()} == {
        **mla, "mlpwi_0": (B, S, 128), "mlpwi_1": (B, S, 128), "mlpwo": (B, S, 64)}
    assert {t: s.shape for t, s in shapes["moe_layers"].tags.items()} == {
        **mla, "moe_mlpwi_0": (B * S * 2, 40), "moe_mlpwi_1": (B * S * 2, 40), "moe_mlpwo": (B * S * 2, 64),
        "shared_mlpwi_0": (B, S, 40), "shared_mlpwi_1": (B, S, 40), "shared_mlpwo": (B, S, 64)}
    assert list(shapes["moe_layers"].tags)[0] == "decoder_layer_input"


def test_model_shapes_aux_and_finite_gradients(model, tokens, forward):
    logits, aux = forward(model, tokens)
    assert logits.shape == (B, S, CFG.vocab_size) and logits.dtype == jnp.float32
    assert aux["dense_layers"] == {}
    moe = aux["moe_layers"]
    assert moe.load.shape == (2, CFG.num_experts) and moe.balance_loss.shape == (2,)
    assert moe.dropped.shape == (2,) and int(moe.dropped.sum()) == 0
    np.testing.assert_array_equal(np.asarray(moe.load.sum(-1)), B * S * CFG.num_experts_per_tok)
    assert float(total_balance_loss(aux)) == pytest.approx(float(moe.balance_loss.sum()))
    loss, grads = grads_under(model, RECIPES["mla_moe_offload"], tokens)
    assert np.isfinite(float(loss))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    for stack in STACKS:
        assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads[stack])), stack


def test_causality(model, tokens, forward):
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % CFG.vocab_size)
    np.testing.assert_allclose(np.asarray(forward(model, tokens)[0][:, :-1]),
                               np.asarray(forward(model, changed)[0][:, :-1]), atol=1e-6)


@pytest.fixture(scope="module")
def reference(model, tokens):
    return grads_under(model, RECIPES["none"], tokens)


@pytest.mark.parametrize("name", tiered([n for n in PLAIN if n != "none"], fast=("full", "save_mla_moe",
                                                                                     "mla_moe_offload")))
def test_gradients_equal_under_every_recipe(model, tokens, reference, name):
    ref_loss, ref = reference
    loss, got = grads_under(model, RECIPES[name], tokens)
    assert abs(float(loss) - float(ref_loss)) < 1e-6
    assert max_rel_err(got, ref) < 1e-5


# the placement tests: the default set keeps the study's offload recipe (docs/testing.md: the others are slow)
@pytest.mark.parametrize("name", tiered([n for n in PLAIN if RECIPES[n].special is None], fast=("mla_moe_offload",)))
def test_residuals_are_placed_as_the_recipe_says_in_each_stack(model, tokens, name):
    recipe = RECIPES[name]
    model.set_recipe(recipe)
    want_host = collections.Counter()
    for stack in STACKS:
        needed = measure.residual_tags(model, stack)
        seen = measure.placements_seen(model, stack, B, S)
        assert {t: seen[t] for t in needed} == {t: recipe.placement(t) for t in needed}, stack
        st = model.tag_shapes(B, S)[stack]
        want_host.update((st.num_layers,) + st.tags[t].shape for t in recipe.offload if t in needed)
    # the whole model: one stacked host residual [L, ...] per offloaded tag and stack, nothing else on the host
    res = measure.model_residuals(model, tokens)
    assert collections.Counter(r.shape for r in res if r.host) == want_host


@pytest.mark.parametrize("name", tiered([n for n in PLAIN if RECIPES[n].offload] + ["save_mla_moe"],  # every offload
                                        fast=("mla_moe_offload",)))
def test_cuda_lowering_places_offloaded_tags_in_pinned_host(model, tokens, name):
    recipe = RECIPES[name]
    model.set_recipe(recipe)
    want = collections.Counter()
    for stack in STACKS:
        shapes = model.tag_shapes(B, S)[stack].tags
        needed = measure.residual_tags(model, stack)
        want.update(hlo_type(shapes[t].shape, shapes[t].dtype) for t in recipe.offload if t in needed)
    assert pinned_host_shapes(cuda_lowering(model, tokens)) == want  # save_mla_moe: nothing goes to the host


@pytest.mark.parametrize("stack", STACKS)
def test_every_needed_tag_is_really_emitted(model, stack):
    """A recipe that offloads every tag the backward pass needs puts each of them on the host."""
    emitted = model.tag_shapes(1, 8)[stack].tags
    needed = measure.residual_tags(model, stack)
    # mlpwo and shared_mlpwo only flow into the residual sum; moe_mlpwo is needed: the routing weights' gradient
    # is moe_mlpwo . dy
    summed_only = {"mlpwo"} if stack == "dense_layers" else {"shared_mlpwo"}
    assert set(needed) == set(emitted) - summed_only
    model.set_recipe(zoo.Recipe("all_needed", offload=needed))
    seen = measure.placements_seen(model, stack)
    assert {t: seen[t] for t in needed} == {t: "offload" for t in needed}


def test_bias_update_through_the_model(model, tokens, forward):
    _, aux = forward(model, tokens)
    load = np.asarray(aux["moe_layers"].load)
    bias = model.moe_layers.layers.mlp.gate.e_score_correction_bias
    before = bias[...]
    try:
        update_routing_bias(model, aux, rate=1e-3)
        np.testing.assert_allclose(np.asarray(bias[...]), 1e-3 * np.sign(load.mean(-1, keepdims=True) - load))
    finally:
        bias[...] = before
    # optimizers over nnx.Param never see it
    assert not any(isinstance(v, RoutingBias) for v in jax.tree.leaves(
        nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)))


def test_capacity_backend_model_matches_dropless(model, tokens, forward):
    cfg = dataclasses.replace(CFG, moe_backend="capacity", capacity_factor=float(CFG.num_experts))
    capacity_model = zoo.models.deepseek_v3(cfg, rngs=nnx.Rngs(0))  # the same parameters
    logits, aux = forward(capacity_model, tokens)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(forward(model, tokens)[0]), rtol=1e-5, atol=1e-5)
    assert int(aux["moe_layers"].dropped.sum()) == 0


def test_param_count_of_the_671b_preset():
    cfg = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b")
    model = nnx.eval_shape(lambda: zoo.models.deepseek_v3(cfg, rngs=nnx.Rngs(0)))  # nothing allocated
    assert zoo.models.count_params(model) == 671_026_419_200
    assert model.dense_layers.num_layers == 3 and model.moe_layers.num_layers == 58
    assert model.moe_layers.layers.mlp.experts.gate_proj.shape == (58, 256, 7168, 2048)


def test_parameters_carry_logical_axes(model):
    def axes(v):
        return v.get_metadata()["out_sharding"]
    moe = model.moe_layers.layers
    assert axes(moe.attn.q_b_proj.kernel) == ("layers", "q_lora", "heads", "head_dim")
    assert axes(moe.attn.kv_b_proj.kernel) == ("layers", "kv_lora", "heads", "head_dim")
    assert axes(moe.mlp.experts.gate_proj) == ("layers", "experts", "embed", "moe_mlp")
    assert axes(moe.mlp.gate.e_score_correction_bias) == ("layers", "experts")
    assert all(axes(p) for p in jax.tree.leaves(nnx.state(model, nnx.Param),
                                                is_leaf=lambda x: isinstance(x, nnx.Variable)))


def test_a_recipe_naming_moe_tags_fails_on_a_dense_only_model():
    cfg = dataclasses.replace(CFG, first_dense_layers=CFG.num_layers)
    with pytest.raises(ValueError,
                       match="'moe_mlpwi_0' matches no tag that DeepSeekV3 emits; DeepSeekV3 emits: .*mla_kv"):
        # abstract build: the check is the constructor's, and initialising four layers eagerly is the slow part
        nnx.eval_shape(lambda: zoo.models.deepseek_v3(cfg, recipe=RECIPES["mla_moe_offload"], rngs=nnx.Rngs(0)))


# -- MLA and YaRN --------------------------------------------------------------------------------------------
def test_mla_rope_interleave_is_a_fixed_permutation_of_the_rope_weights():
    """Interleaved weights in, or the same weights with their rope columns de-interleaved and no permutation:
    the same layer output (what a loader relies on)."""
    common = dict(dim=64, num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, rope=CFG.rope())
    a = MLA(**common, rope_interleave=True, rngs=nnx.Rngs(0))
    b = MLA(**common, rope_interleave=False, rngs=nnx.Rngs(0))
    perm = np.concatenate([np.arange(0, 8, 2), np.arange(1, 8, 2)])
    b.q_b_proj.kernel[...] = a.q_b_proj.kernel[...][..., np.concatenate([np.arange(16), 16 + perm])]
    b.kv_a_proj_with_mqa.kernel[...] = a.kv_a_proj_with_mqa.kernel[...][:, np.concatenate([np.arange(16), 16 + perm])]
    x = jax.random.normal(jax.random.key(0), (B, S, 64))
    apply = nnx.jit(lambda m, x: m(x))
    np.testing.assert_allclose(np.asarray(apply(a, x)), np.asarray(apply(b, x)), rtol=1e-5, atol=1e-6)


def test_yarn_softmax_scale_of_deepseek_v3():
    attn = MLA(dim=64, num_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=128, qk_rope_head_dim=64,
               v_head_dim=128, rope=Rope(dim=64, scaling=YarnScaling()), rngs=nnx.Rngs(0))
    mscale = 0.1 * np.log(40) + 1
    assert attn.scale == pytest.approx(192 ** -0.5 * mscale ** 2)
    assert YarnScaling().attention_factor() == 1.0


def test_yarn_matches_transformers():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import _compute_yarn_parameters
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    rope_parameters = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                           beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
    hf_cfg = transformers.DeepseekV3Config(rope_parameters=rope_parameters, max_position_embeddings=163840)
    inv_freq, attention_factor = _compute_yarn_parameters(hf_cfg)
    ours = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b").rope()
    np.testing.assert_allclose(ours.inv_freq(), inv_freq.numpy(), rtol=1e-6)
    assert ours.scaling.attention_factor() == pytest.approx(attention_factor)
    expected = hf.yarn_apply_mscale(rope_parameters, 192 ** -0.5)
    assert 192 ** -0.5 * ours.scaling.softmax_mscale() == pytest.approx(expected)


@pytest.mark.parametrize("change, field", [
    (dict(kv_lora_rank=0), "DeepSeekV3Config.kv_lora_rank must be a positive int"),
    (dict(q_lora_rank=-1), "DeepSeekV3Config.q_lora_rank"),
    (dict(num_experts_per_tok=5), r"num_experts_per_tok=5 must be in \[1, 4\]"),
    (dict(n_group=3), "n_group=3 must divide num_experts=8"),
    (dict(topk_group=5), r"topk_group=5 must be in \[1, n_group=4\]"),
    (dict(first_dense_layers=5), "first_dense_layers=5 must be at most num_layers=4"),
    (dict(first_dense_layers=-1), "first_dense_layers must be non-negative"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim must be even"),
    (dict(moe_backend="megablox"), "moe_backend must be one of"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(balance_loss_weight=-1.0), "balance_loss_weight"),
    (dict(rope_scaling=zoo.layers.WavelengthScaling()), "rope_scaling must be a YarnScaling"),
    (dict(dtype="float8"), "dtype='float8'"),
    # every field against its type
    (dict(tie_embeddings="no"), "tie_embeddings must be a bool, got 'no'"),
    (dict(balance_loss_weight=float("nan")), "balance_loss_weight must be a finite number, got nan"),
    (dict(routed_scaling_factor=float("inf")), "routed_scaling_factor must be a finite number, got inf"),
    (dict(num_layers=True), "num_layers must be an int, got True"),
    (dict(norm_topk_prob=1), "norm_topk_prob must be a bool"),
])
def test_bad_configs_raise_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(CFG, **change)


def test_configs_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CFG.dim = 3


# -- parity with transformers' DeepseekV3ForCausalLM (Python 3.11 CI env: torch CPU + transformers) -----------
def _to_hf_state_dict(model, cfg):
    """Our parameters under transformers' names and layouts (torch Linear weights are [out, in])."""
    import torch

    def t(a):
        return torch.from_numpy(np.array(a, np.float32))

    def linear(kernel, n_in=1):  # ours [in..., out...] -> torch [out, in]
        k = np.asarray(kernel)
        return t(k.reshape(int(np.prod(k.shape[:n_in])), -1).T)

    sd = {"model.embed_tokens.weight": t(model.embed.embedding[...]), "model.norm.weight": t(model.norm.scale[...]),
          "lm_head.weight": linear(model.lm_head.proj.kernel[...])}
    for i in range(cfg.num_layers):
        stack, j = ("dense_layers", i) if i < cfg.first_dense_layers else ("moe_layers", i - cfg.first_dense_layers)
        layer = jax.tree.map(lambda v, j=j: v[j], nnx.state(getattr(model, stack).layers))
        p, a = f"model.layers.{i}.", layer["attn"]
        sd[p + "input_layernorm.weight"] = t(layer["attn_norm"]["scale"][...])
        sd[p + "post_attention_layernorm.weight"] = t(layer["mlp_norm"]["scale"][...])
        for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"):
            sd[p + f"self_attn.{n}.weight"] = linear(a[n]["kernel"][...])
        sd[p + "self_attn.o_proj.weight"] = linear(a["o_proj"]["kernel"][...], n_in=2)
        sd[p + "self_attn.q_a_layernorm.weight"] = t(a["q_a_layernorm"]["scale"][...])
        sd[p + "self_attn.kv_a_layernorm.weight"] = t(a["kv_a_layernorm"]["scale"][...])
        m = layer["mlp"]
        mlp = m["shared_experts"] if stack == "moe_layers" else m
        q = p + ("mlp.shared_experts." if stack == "moe_layers" else "mlp.")
        for n in ("gate_proj", "up_proj", "down_proj"):
            sd[q + f"{n}.weight"] = linear(mlp[n]["kernel"][...])
        if stack == "moe_layers":
            e = m["experts"]
            gate_up = np.concatenate([np.asarray(e["gate_proj"][...]), np.asarray(e["up_proj"][...])], axis=-1)
            sd[p + "mlp.experts.gate_up_proj"] = t(gate_up.transpose(0, 2, 1))
            sd[p + "mlp.experts.down_proj"] = t(np.asarray(e["down_proj"][...]).transpose(0, 2, 1))
            sd[p + "mlp.gate.weight"] = linear(m["gate"]["kernel"][...])
            sd[p + "mlp.gate.e_score_correction_bias"] = t(m["gate"]["e_score_correction_bias"][...])
    return sd


def test_logits_match_transformers(tokens):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = CFG
    model = zoo.models.deepseek_v3(cfg, rngs=nnx.Rngs(3))
    bias = model.moe_layers.layers.mlp.gate.e_score_correction_bias  # a bias that changes the routing
    bias[...] = 0.05 * jax.random.normal(jax.random.key(4), bias.shape)
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.mlp_dim,
        moe_intermediate_size=cfg.moe_mlp_dim, num_hidden_layers=cfg.num_layers,
        first_k_dense_replace=cfg.first_dense_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
        n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, n_group=cfg.n_group,
        topk_group=cfg.topk_group, n_shared_experts=cfg.num_shared_experts,
        routed_scaling_factor=cfg.routed_scaling_factor, rms_norm_eps=cfg.norm_eps, rope_interleave=True,
        max_position_embeddings=163840, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0))
    hf_cfg._attn_implementation = "eager"
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(_to_hf_state_dict(model, cfg), strict=False)
    assert not unexpected and not [k for k in missing if "layers." in k or "embed" in k or "lm_head" in k], missing
    with torch.no_grad():
        want = hf(torch.from_numpy(np.asarray(tokens, np.int64))).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(tokens)), want, rtol=1e-4, atol=1e-4)


def test_every_layer_reports_its_tags_for_a_config():
    from zoo.models.deepseek_v3 import DeepSeekDecoderLayer
    cfg = zoo.models.DeepSeekV3Config.preset("deepseek_v3_671b")
    layer = nnx.eval_shape(lambda: DeepSeekDecoderLayer(cfg, moe=True, rngs=nnx.Rngs(0)))
    tags = layer.tag_shapes(1, 4096)
    assert tags["query_wa_proj"].shape == (1, 4096, 1536) and tags["mla_kv"].shape == (1, 4096, 512)
    assert tags["query_proj"].shape == (1, 4096, 128, 192) and tags["value_proj"].shape == (1, 4096, 128, 128)
    assert tags["moe_mlpwi_0"].shape == (4096 * 8, 2048)
    assert set(layer.attn.tag_shapes(1, 16)) == {"query_wa_proj", "mla_q", "kv_wa_proj", "mla_kv", "query_proj",
                                                 "key_proj", "value_proj", "attention_out", "context", "out_proj"}
    assert {"moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo", "shared_mlpwi_0"} <= set(layer.mlp.tag_shapes(1, 16))
