"""Logits parity with transformers (float32, relative error < 1e-4): tiny random checkpoints built offline by
transformers load with `zoo.from_hf`, and zoo models written by `zoo.to_hf` load in transformers. Needs torch and
transformers (the Python 3.11 environment); skipped where they are absent."""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from tests.helpers import max_rel_err  # noqa: E402
from tests.hf.test_hf import assert_identical, llama  # noqa: E402

TOL = 1e-4
torch.set_num_threads(1)  # two pytest workers on two cores
forward = nnx.jit(lambda model, tokens: model(tokens))


def tokens(vocab, batch=2, seq=11, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq)).astype(np.int32)


def hf_logits(model, toks):
    with torch.no_grad():
        return model(torch.tensor(toks, dtype=torch.long)).logits.float().numpy()


def save_hf(cfg, path, seed=0, shard="6KB"):
    """A random transformers model of `cfg`, saved as safetensors (several shards + index unless `shard` is big).
    Norm weights are randomised too (transformers initialises them to ones, which would hide a swap)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    model.save_pretrained(path, max_shard_size=shard)
    return model


LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)
LLAMA_CONFIGS = {
    # odd head counts: 3 query heads sharing 1 kv head; Llama 3 RoPE scaling; untied; several shards
    "3h-1kv-llama3rope": dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=1, head_dim=8,
                              rope_scaling=LLAMA3_ROPE, rope_theta=500000.0, rms_norm_eps=1e-5),
    # 6 heads / 3 kv heads, head_dim from hidden_size (36 / 6), tied embeddings, plain RoPE, one file
    "6h-3kv-tied": dict(hidden_size=36, num_attention_heads=6, num_key_value_heads=3, tie_word_embeddings=True,
                        rope_theta=10000.0, rms_norm_eps=1e-6),
    # head_dim independent of hidden_size/heads, 5 heads (MHA), 3 layers, Llama 3 scaling with other factors
    "5h-mha-headdim": dict(hidden_size=20, num_attention_heads=5, num_key_value_heads=5, head_dim=6,
                           num_hidden_layers=3, rope_theta=50000.0,
                           rope_scaling=dict(LLAMA3_ROPE, factor=4.0, high_freq_factor=2.0)),
}


def llama_hf_config(**kw):
    # initializer_range 0.3, not 0.02: attention scores of order one, so that RoPE (and its scaling) matter.
    base = dict(vocab_size=61, intermediate_size=40, num_hidden_layers=2, hidden_act="silu",
                max_position_embeddings=64, tie_word_embeddings=False, initializer_range=0.3)
    return transformers.LlamaConfig(**{**base, **kw})


@pytest.mark.parametrize("name", sorted(LLAMA_CONFIGS))
def test_llama_from_transformers(tmp_path, name):
    cfg = llama_hf_config(**LLAMA_CONFIGS[name])
    ref_model = save_hf(cfg, tmp_path, shard="2GB" if cfg.tie_word_embeddings else "6KB")
    toks = tokens(cfg.vocab_size)
    ref = hf_logits(ref_model, toks)
    model = zoo.from_hf(tmp_path)
    assert (model.lm_head is None) == cfg.tie_word_embeddings
    assert max_rel_err(forward(model, jnp.asarray(toks)), ref) < TOL
    # The test would notice an ignored scaling: without it, transformers' logits move.
    if LLAMA_CONFIGS[name].get("rope_scaling"):
        plain = transformers.AutoModelForCausalLM.from_config(
            llama_hf_config(**{**LLAMA_CONFIGS[name], "rope_scaling": None}), dtype=torch.float32).eval()
        plain.load_state_dict(ref_model.state_dict())
        assert max_rel_err(hf_logits(plain, toks), ref) > 10 * TOL


@pytest.mark.parametrize("overrides", [{}, dict(tie_embeddings=True, num_heads=6, num_kv_heads=3, head_dim=4)],
                         ids=["llama3rope", "tied"])
def test_llama_to_transformers(tmp_path, overrides):
    model = llama(seed=3, **overrides)
    zoo.to_hf(model, tmp_path, max_shard_bytes=5000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    toks = tokens(model.config.vocab_size, seed=1)
    assert max_rel_err(forward(model, jnp.asarray(toks)), hf_logits(hf, toks)) < TOL
    assert_identical(zoo.from_hf(tmp_path), model)


def test_bfloat16_checkpoint_loads_bit_exact(tmp_path):
    """A bf16 checkpoint written by torch loads as bf16 parameters, bit for bit; `dtype` widens it exactly."""
    cfg = llama_hf_config(**LLAMA_CONFIGS["3h-1kv-llama3rope"])
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    ref.save_pretrained(tmp_path)
    for dtype, want in ((None, jnp.bfloat16), (jnp.float32, jnp.float32)):
        model = zoo.from_hf(tmp_path, dtype=dtype)
        assert model.config.param_dtype == jnp.dtype(want).name
        q = model.layers.layers.attn.q_proj.kernel[...]                     # [L, D, H, hd]
        assert q.dtype == want
        w = ref.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()   # [H*hd, D]
        np.testing.assert_array_equal(np.asarray(q[1].astype(jnp.float32)).reshape(24, 24).T, w)


# -- DeepSeek-V3 --------------------------------------------------------------------------------------------

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32, beta_slow=1,
            mscale=1.0, mscale_all_dim=1.0)
DEEPSEEK_CONFIGS = {
    # one dense layer then two MoE layers; YaRN with DeepSeek-V3's mscale; 4 groups, 2 kept; interleaved rope
    "yarn-groups-1dense": dict(num_attention_heads=4, first_k_dense_replace=1, num_hidden_layers=3,
                               n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                               rope_scaling=YARN),
    # odd heads, all layers MoE, cos/sin attention factor != 1 (mscale != mscale_all_dim), unnormalised top-k
    "3h-allmoe-mscale": dict(num_attention_heads=3, first_k_dense_replace=0, num_hidden_layers=2,
                             n_routed_experts=6, num_experts_per_tok=3, n_group=2, topk_group=1,
                             norm_topk_prob=False, routed_scaling_factor=1.5, n_shared_experts=2,
                             rope_scaling=dict(YARN, factor=8.0, mscale=0.707, mscale_all_dim=1.0, beta_fast=16)),
    # 5 heads, two dense layers, YaRN without mscale fields (the paper's cos/sin factor, softmax scale as is),
    # rope stored in rotate-half order, tied embeddings
    "5h-2dense-yarnpaper-tied": dict(num_attention_heads=5, first_k_dense_replace=2, num_hidden_layers=3,
                                     n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=2,
                                     rope_interleave=False, tie_word_embeddings=True,
                                     rope_scaling=dict(rope_type="yarn", factor=2.0, beta_fast=8, beta_slow=2,
                                                       original_max_position_embeddings=8)),
}


def deepseek_hf_config(**kw):
    base = dict(vocab_size=61, hidden_size=32, intermediate_size=48, moe_intermediate_size=12, n_shared_experts=1,
                q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=64, initializer_range=0.3,
                tie_word_embeddings=False, rope_interleave=True)
    cfg = {**base, **kw}
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    return transformers.DeepseekV3Config(**cfg)


def randomise_bias(model, seed=1):
    """A non-zero score-correction bias, large enough to change which experts are chosen."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.copy_(0.2 * torch.randn(m.e_score_correction_bias.shape, generator=g))


@pytest.mark.parametrize("name", sorted(DEEPSEEK_CONFIGS))
def test_deepseek_from_transformers(tmp_path, name):
    cfg = deepseek_hf_config(**DEEPSEEK_CONFIGS[name])
    torch.manual_seed(0)
    ref_model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomise_bias(ref_model)
    with torch.no_grad():
        for n, p in ref_model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
    ref_model.save_pretrained(tmp_path, max_shard_size="2GB" if cfg.tie_word_embeddings else "20KB")
    toks = tokens(cfg.vocab_size)
    ref = hf_logits(ref_model, toks)
    model = zoo.from_hf(tmp_path)
    assert model.config.first_dense_layers == cfg.first_k_dense_replace
    assert max_rel_err(forward(model, jnp.asarray(toks)), ref) < TOL
    # The test would notice an ignored bias or scaling: without them, transformers' logits move.
    state = ref_model.state_dict()
    variants = {"e_score_correction_bias": (cfg, {k: torch.zeros_like(v) if k.endswith("e_score_correction_bias")
                                                  else v for k, v in state.items()})}
    if DEEPSEEK_CONFIGS[name].get("rope_scaling"):
        variants["rope_scaling"] = (deepseek_hf_config(**{**DEEPSEEK_CONFIGS[name], "rope_scaling": None}), state)
    for what, (variant_cfg, variant_state) in variants.items():
        variant = transformers.AutoModelForCausalLM.from_config(variant_cfg, dtype=torch.float32).eval()
        variant.load_state_dict(variant_state)
        assert max_rel_err(hf_logits(variant, toks), ref) > 10 * TOL, what


@pytest.mark.parametrize("mtp_depths", [0, 1], ids=["main", "with-mtp"])
def test_deepseek_to_transformers(tmp_path, mtp_depths):
    """With an MTP layer too: transformers skips it (unexpected keys) and the main logits still match."""
    from tests.hf.test_hf import deepseek
    model = deepseek(seed=5, mtp_depths=mtp_depths)
    zoo.to_hf(model, tmp_path, max_shard_bytes=20000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    toks = tokens(model.config.vocab_size, seed=2)
    assert max_rel_err(forward(model, jnp.asarray(toks)), hf_logits(hf, toks)) < TOL
    assert_identical(zoo.from_hf(tmp_path), model)
