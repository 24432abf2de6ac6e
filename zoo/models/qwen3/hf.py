"""Qwen3 (dense) <-> Hugging Face `Qwen3ForCausalLM`: config.json fields and tensor keys."""
from __future__ import annotations

from typing import Any

from zoo.hf.config import check_types, check_unsupported, context_field, gqa_fields, rope_settings
from zoo.hf.keymap import GQA, NORMS, SWIGLU, Entry, embed_and_head, stacked
from zoo.models.qwen3.config import Qwen3Config

ARCHITECTURE, MODEL_TYPE = "Qwen3ForCausalLM", "qwen3"
SUPPORTED = ("max_position_embeddings",
             "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
             "tie_word_embeddings", "hidden_act", "attention_bias", "use_sliding_window", "architectures",
             "model_type", "dtype", "torch_dtype")
IGNORED = ("attention_dropout", "initializer_range", "bos_token_id", "eos_token_id",
           "pad_token_id", "use_cache", "transformers_version", "sliding_window", "max_window_layers", "layer_types")
UNSUPPORTED: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
                               "quantization_config": None}
QK_NORMS = [("attn.q_norm.scale", "self_attn.q_norm.weight", None),
            ("attn.k_norm.scale", "self_attn.k_norm.weight", None)]


def from_hf(hf: dict, *, param_dtype: str) -> Qwen3Config:
    check_types(hf, bools=("use_sliding_window",))
    check_unsupported(hf, UNSUPPORTED, ARCHITECTURE)
    theta, scaling = rope_settings(hf)
    if scaling is not None:
        raise ValueError(f"config.json: rope_scaling.rope_type={scaling['rope_type']!r} is not supported for "
                         f"{ARCHITECTURE} (supported: 'default')")
    return Qwen3Config(**gqa_fields(hf, param_dtype), rope_theta=theta)


def to_hf(cfg: Qwen3Config) -> dict:
    return dict(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
        intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu", attention_bias=False,
        use_sliding_window=False, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, rope_scaling=None,
        tie_word_embeddings=cfg.tie_embeddings,
        torch_dtype=cfg.param_dtype, **context_field(cfg))


def keys(cfg: Qwen3Config) -> list[Entry]:
    return embed_and_head(cfg) + stacked(("layers", "layers"), range(cfg.num_layers), GQA + QK_NORMS + NORMS + SWIGLU)
