"""Llama 3.1 <-> Hugging Face `LlamaForCausalLM`: config.json fields and tensor keys."""
from __future__ import annotations

from typing import Any

from zoo.hf.config import check_types, check_unsupported, context_field, gqa_fields, require, rope_settings
from zoo.hf.keymap import GQA, NORMS, SWIGLU, Entry, embed_and_head, stacked
from zoo.layers import WavelengthScaling
from zoo.models.llama3.config import LlamaConfig

ARCHITECTURE, MODEL_TYPE = "LlamaForCausalLM", "llama"
SUPPORTED = ("max_position_embeddings",
             "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
             "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "architectures", "model_type", "dtype",
             "torch_dtype")
IGNORED = ("attention_dropout", "initializer_range", "bos_token_id", "eos_token_id",
           "pad_token_id", "use_cache", "pretraining_tp", "transformers_version")
UNSUPPORTED: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                               "quantization_config": None, "sliding_window": None}
LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def from_hf(hf: dict, *, param_dtype: str) -> LlamaConfig:
    check_types(hf)
    check_unsupported(hf, UNSUPPORTED, ARCHITECTURE)
    theta, scaling = rope_settings(hf)
    rope_scaling = None
    if scaling is not None:
        if scaling["rope_type"] != "llama3":
            raise ValueError(f"config.json: rope_scaling.rope_type={scaling['rope_type']!r} is not supported for "
                             f"{ARCHITECTURE} (supported: 'llama3', 'default')")
        extra = sorted(set(scaling) - set(LLAMA3_SCALING) - {"rope_type"})
        if extra:
            raise ValueError(f"config.json: rope_scaling fields {extra} are not supported for rope_type 'llama3'")
        rope_scaling = WavelengthScaling(**{f: require(scaling, f) for f in LLAMA3_SCALING})
    return LlamaConfig(**gqa_fields(hf, param_dtype), rope_theta=theta, rope_scaling=rope_scaling)


def to_hf(cfg: LlamaConfig) -> dict:
    s = cfg.rope_scaling
    rope_scaling = None if s is None else dict(
        rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
        original_max_position_embeddings=s.original_max_position_embeddings)
    return dict(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
        intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu", rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, rope_scaling=rope_scaling, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False,
        torch_dtype=cfg.param_dtype, **context_field(cfg))


def keys(cfg: LlamaConfig) -> list[Entry]:
    return embed_and_head(cfg) + stacked(("layers", "layers"), range(cfg.num_layers), GQA + NORMS + SWIGLU)
