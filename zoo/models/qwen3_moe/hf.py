"""Qwen3-MoE <-> Hugging Face `Qwen3MoeForCausalLM`: config.json fields and tensor keys."""
from __future__ import annotations

from typing import Any

from zoo.hf.config import check_types, check_unsupported, context_field, gqa_fields, require, rope_settings
from zoo.hf.keymap import GQA, NORMS, ROUTED_EXPERTS, SWIGLU, Entry, embed_and_head, stacked
from zoo.models.qwen3_moe.config import Qwen3MoeConfig
from zoo.models.qwen3_moe.model import stack_names

ARCHITECTURE, MODEL_TYPE = "Qwen3MoeForCausalLM", "qwen3_moe"
INT_FIELDS = ("moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
              "decoder_sparse_step")
FLOAT_FIELDS = ("router_aux_loss_coef",)
BOOL_FIELDS = ("norm_topk_prob", "use_sliding_window")
SUPPORTED = ("max_position_embeddings",
             "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "num_experts", "num_local_experts",
             "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef",
             "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "tie_word_embeddings", "hidden_act",
             "attention_bias", "use_sliding_window", "architectures", "model_type", "dtype", "torch_dtype")
IGNORED = ("attention_dropout", "initializer_range", "bos_token_id", "eos_token_id",
           "pad_token_id", "use_cache", "transformers_version", "output_router_logits", "sliding_window",
           "max_window_layers")
UNSUPPORTED: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
                               "quantization_config": None}
QK_NORMS = [("attn.q_norm.scale", "self_attn.q_norm.weight", None),
            ("attn.k_norm.scale", "self_attn.k_norm.weight", None)]


def from_hf(hf: dict, *, param_dtype: str) -> Qwen3MoeConfig:
    check_types(hf, ints=INT_FIELDS, floats=FLOAT_FIELDS, bools=BOOL_FIELDS)
    check_unsupported(hf, UNSUPPORTED, ARCHITECTURE)
    theta, scaling = rope_settings(hf)
    if scaling is not None:
        raise ValueError(f"config.json: rope_scaling.rope_type={scaling['rope_type']!r} is not supported for "
                         f"{ARCHITECTURE} (supported: 'default')")
    only = hf.get("mlp_only_layers") or []
    if not (isinstance(only, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in only)):
        raise ValueError(f"config.json: mlp_only_layers={only!r} must be a list of layer indices")
    # transformers 5 writes num_experts as num_local_experts
    experts = hf.get("num_experts") if hf.get("num_experts") is not None else require(hf, "num_local_experts")
    return Qwen3MoeConfig(
        **gqa_fields(hf, param_dtype), num_experts=experts, num_experts_per_tok=require(hf, "num_experts_per_tok"),
        moe_mlp_dim=require(hf, "moe_intermediate_size"), norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=hf.get("decoder_sparse_step") or 1, mlp_only_layers=tuple(sorted(set(only))),
        balance_loss_weight=float(hf.get("router_aux_loss_coef", 1e-3)), rope_theta=theta)


def to_hf(cfg: Qwen3MoeConfig) -> dict:
    return dict(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
        intermediate_size=cfg.mlp_dim, moe_intermediate_size=cfg.moe_mlp_dim, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers),
        router_aux_loss_coef=cfg.balance_loss_weight, hidden_act="silu", attention_bias=False,
        use_sliding_window=False, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, rope_scaling=None,
        tie_word_embeddings=cfg.tie_embeddings,
        torch_dtype=cfg.param_dtype, **context_field(cfg))


def keys(cfg: Qwen3MoeConfig) -> list[Entry]:
    out = embed_and_head(cfg)
    for name, (moe, layers) in zip(stack_names(cfg), cfg.layer_runs()):
        rows = GQA + QK_NORMS + NORMS + (ROUTED_EXPERTS if moe else SWIGLU)
        out += stacked((name, "layers"), layers, rows, cfg.num_experts if moe else None)
    return out
