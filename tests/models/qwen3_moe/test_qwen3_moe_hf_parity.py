"""Qwen3-MoE logits parity with transformers' Qwen3MoeForCausalLM (float32, relative error < 1e-4): tiny random
checkpoints built offline by transformers load with `zoo.from_hf`, and zoo models written by `zoo.to_hf` load in
transformers. Needs torch and transformers (the Python 3.11 environment); skipped where they are absent."""
import jax.numpy as jnp
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from tests.helpers import max_rel_err  # noqa: E402
from tests.hf.test_hf import assert_identical, random_params  # noqa: E402
from tests.hf.test_hf_parity import TOL, forward, hf_logits, save_hf, tokens  # noqa: E402

CONFIGS = {
    # every layer MoE, 4 query heads over 2 kv heads, head_dim independent of hidden_size, renormalised top-k
    "4h-2kv-allmoe-norm": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=6, num_hidden_layers=2,
                               num_experts=6, num_experts_per_tok=2, norm_topk_prob=True),
    # dense layers where decoder_sparse_step and mlp_only_layers say (MoE at 1 and 5 only: four stacks), raw top-k
    # weights, 3 heads (MHA), tied embeddings
    "3h-sparse-step-tied": dict(num_attention_heads=3, num_key_value_heads=3, head_dim=8, num_hidden_layers=6,
                                decoder_sparse_step=2, mlp_only_layers=[3], num_experts=5, num_experts_per_tok=3,
                                norm_topk_prob=False, tie_word_embeddings=True),
}


def qwen3_moe_hf_config(**kw):
    # initializer_range 0.3, not 0.02: attention scores and router logits of order one, so that RoPE, the q/k norms
    # and the expert choice matter.
    base = dict(vocab_size=61, hidden_size=24, intermediate_size=40, moe_intermediate_size=12, hidden_act="silu",
                max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.3,
                tie_word_embeddings=False)
    return transformers.Qwen3MoeConfig(**{**base, **kw})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_qwen3_moe_from_transformers(tmp_path, name):
    cfg = qwen3_moe_hf_config(**CONFIGS[name])
    ref_model = save_hf(cfg, tmp_path, shard="2GB" if cfg.tie_word_embeddings else "20KB")
    toks = tokens(cfg.vocab_size)
    ref = hf_logits(ref_model, toks)
    model = zoo.from_hf(tmp_path)
    assert (model.lm_head is None) == cfg.tie_word_embeddings
    assert sum(model.config.has_experts(i) for i in range(model.config.num_layers)) == sum(
        type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in ref_model.model.layers)
    assert max_rel_err(forward(model, jnp.asarray(toks)), ref) < TOL
    # The test would notice a skipped q/k norm or a changed renormalisation: transformers' logits move with them.
    state = ref_model.state_dict()
    variants = {"q_norm": (cfg, {k: torch.ones_like(v) if k.endswith("q_norm.weight") else v
                                 for k, v in state.items()}),
                "norm_topk_prob": (qwen3_moe_hf_config(**{**CONFIGS[name],
                                                          "norm_topk_prob": not cfg.norm_topk_prob}), state)}
    for what, (variant_cfg, variant_state) in variants.items():
        variant = transformers.AutoModelForCausalLM.from_config(variant_cfg, dtype=torch.float32).eval()
        variant.load_state_dict(variant_state)
        assert max_rel_err(hf_logits(variant, toks), ref) > 10 * TOL, what


@pytest.mark.parametrize("overrides", [{}, dict(tie_embeddings=True, num_layers=3, mlp_only_layers=(1,),
                                                num_experts_per_tok=3, norm_topk_prob=False)],
                         ids=["tiny", "tied-dense-middle"])
def test_qwen3_moe_to_transformers(tmp_path, overrides):
    cfg = zoo.models.registry.config("qwen3_moe", "tiny", **overrides)
    model = random_params(cfg, zoo.models.qwen3_moe, seed=4)
    zoo.to_hf(model, tmp_path, max_shard_bytes=50000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    toks = tokens(cfg.vocab_size, seed=2)
    assert max_rel_err(forward(model, jnp.asarray(toks)), hf_logits(hf, toks)) < TOL
    assert_identical(zoo.from_hf(tmp_path), model)
