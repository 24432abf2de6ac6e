"""Qwen3 (dense) logits parity with transformers' Qwen3ForCausalLM (float32, relative error < 1e-4): tiny random
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
from zoo.models.qwen3 import qwen3  # noqa: E402

CONFIGS = {
    # 4 query heads over 2 kv heads, head_dim independent of hidden_size (4 x 8 = 32 against 24), several shards
    "4h-2kv-headdim": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=2),
    # 3 heads (MHA), 3 layers, tied embeddings, one file
    "3h-mha-tied": dict(num_attention_heads=3, num_key_value_heads=3, head_dim=6, num_hidden_layers=3,
                        tie_word_embeddings=True),
}


def qwen3_hf_config(**kw):
    # initializer_range 0.3, not 0.02: attention scores of order one, so that RoPE and the q/k norms matter.
    base = dict(vocab_size=61, hidden_size=24, intermediate_size=40, hidden_act="silu", max_position_embeddings=64,
                rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.3, tie_word_embeddings=False)
    return transformers.Qwen3Config(**{**base, **kw})


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_qwen3_from_transformers(tmp_path, name):
    cfg = qwen3_hf_config(**CONFIGS[name])
    ref_model = save_hf(cfg, tmp_path, shard="2GB" if cfg.tie_word_embeddings else "20KB")
    assert type(ref_model).__name__ == "Qwen3ForCausalLM"
    toks = tokens(cfg.vocab_size)
    ref = hf_logits(ref_model, toks)
    model = zoo.from_hf(tmp_path)
    assert type(model).__name__ == "Qwen3" and (model.lm_head is None) == cfg.tie_word_embeddings
    assert max_rel_err(forward(model, jnp.asarray(toks)), ref) < TOL
    # The test would notice a skipped q or k norm: with it set to ones, transformers' logits move.
    for which in ("q_norm", "k_norm"):
        variant = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        variant.load_state_dict({k: torch.ones_like(v) if k.endswith(f"{which}.weight") else v
                                 for k, v in ref_model.state_dict().items()})
        assert max_rel_err(hf_logits(variant, toks), ref) > 10 * TOL, which


@pytest.mark.parametrize("overrides", [{}, dict(tie_embeddings=True, num_layers=3, num_kv_heads=4)],
                         ids=["tiny", "tied-mha"])
def test_qwen3_to_transformers(tmp_path, overrides):
    cfg = zoo.models.registry.config("qwen3", "tiny", **overrides)
    model = random_params(cfg, qwen3, seed=4)
    zoo.to_hf(model, tmp_path, max_shard_bytes=50000)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    toks = tokens(cfg.vocab_size, seed=2)
    assert max_rel_err(forward(model, jnp.asarray(toks)), hf_logits(hf, toks)) < TOL
    assert_identical(zoo.from_hf(tmp_path), model)
