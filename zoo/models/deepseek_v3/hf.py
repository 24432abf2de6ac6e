"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM`: config.json fields and tensor keys."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from zoo.hf.config import activation_dtype, check_types, check_unsupported, context_field, require, rope_settings
from zoo.hf.keymap import NORMS, ROUTED_EXPERTS, SWIGLU, Entry, embed_and_head, stacked
from zoo.layers import YarnScaling
from zoo.models.deepseek_v3.config import DeepSeekV3Config

ARCHITECTURE, MODEL_TYPE = "DeepseekV3ForCausalLM", "deepseek_v3"
INT_FIELDS = ("moe_intermediate_size", "first_k_dense_replace", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
              "n_group", "topk_group", "num_nextn_predict_layers")
FLOAT_FIELDS = ("routed_scaling_factor",)
BOOL_FIELDS = ("norm_topk_prob", "rope_interleave")
SUPPORTED = ("max_position_embeddings",
             "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                      "first_k_dense_replace", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
                      "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                      "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                      "norm_topk_prob", "rope_theta", "rope_scaling", "rope_parameters", "rope_interleave",
                      "rms_norm_eps", "tie_word_embeddings", "hidden_act", "attention_bias", "topk_method",
                      "scoring_func", "moe_layer_freq", "num_nextn_predict_layers", "architectures", "model_type",
                      "dtype", "torch_dtype")
IGNORED = ("attention_dropout", "initializer_range", "bos_token_id",
                    "eos_token_id", "pad_token_id", "use_cache", "pretraining_tp", "transformers_version", "ep_size",
                    "aux_loss_alpha", "seq_aux", "head_dim", "qk_head_dim", "output_router_logits", "auto_map")
UNSUPPORTED: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False, "topk_method": "noaux_tc",
                                        "scoring_func": "sigmoid", "moe_layer_freq": 1, "quantization_config": None}
YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def yarn_from_hf(scaling: dict):
    if scaling["rope_type"] != "yarn":
        raise ValueError(f"config.json: rope_scaling.rope_type={scaling['rope_type']!r} is not supported for "
                         "DeepseekV3ForCausalLM (supported: 'yarn', 'default')")
    for field, neutral in (("attention_factor", None), ("truncate", True), ("partial_rotary_factor", 1.0)):
        if scaling.get(field, neutral) not in (neutral, None):
            raise ValueError(f"config.json: rope_scaling.{field}={scaling[field]!r} is not supported by zoo "
                             f"(supported: {neutral!r})")
    extra = sorted(set(scaling) - set(YARN_FIELDS) - {"rope_type", "attention_factor", "truncate",
                                                       "partial_rotary_factor"})
    if extra:
        raise ValueError(f"config.json: rope_scaling fields {extra} are not supported for rope_type 'yarn'")
    # transformers: an absent (or zero) mscale / mscale_all_dim means "not set" (cos/sin then take the paper's
    # 0.1 ln(factor) + 1, and the softmax scale is left alone); YarnScaling reads 0 the same way.
    return YarnScaling(factor=float(require(scaling, "factor")),
                       original_max_position_embeddings=int(require(scaling, "original_max_position_embeddings")),
                       beta_fast=float(scaling.get("beta_fast") or 32.0),
                       beta_slow=float(scaling.get("beta_slow") or 1.0),
                       mscale=float(scaling.get("mscale") or 0.0),
                       mscale_all_dim=float(scaling.get("mscale_all_dim") or 0.0))


def from_hf(hf: dict, *, param_dtype: str) -> DeepSeekV3Config:
    check_types(hf, ints=INT_FIELDS, floats=FLOAT_FIELDS, bools=BOOL_FIELDS)
    check_unsupported(hf, UNSUPPORTED, ARCHITECTURE)
    if hf.get("q_lora_rank") is None:
        raise ValueError("config.json: DeepseekV3ForCausalLM field q_lora_rank=None (queries without a low-rank "
                         "latent) is not supported by zoo")
    heads = require(hf, "num_attention_heads")
    if hf.get("num_key_value_heads") not in (None, heads):
        raise ValueError(f"config.json: num_key_value_heads={hf['num_key_value_heads']} differs from "
                         f"num_attention_heads={heads}; MLA in zoo has one key/value head per query head")
    theta, scaling = rope_settings(hf)
    num_layers = require(hf, "num_hidden_layers")
    return DeepSeekV3Config(
        vocab_size=require(hf, "vocab_size"), dim=require(hf, "hidden_size"), num_layers=num_layers,
        first_dense_layers=min(require(hf, "first_k_dense_replace"), num_layers), num_heads=heads,
        q_lora_rank=hf["q_lora_rank"], kv_lora_rank=require(hf, "kv_lora_rank"),
        qk_nope_head_dim=require(hf, "qk_nope_head_dim"), qk_rope_head_dim=require(hf, "qk_rope_head_dim"),
        v_head_dim=require(hf, "v_head_dim"), mlp_dim=require(hf, "intermediate_size"),
        num_experts=require(hf, "n_routed_experts"), num_experts_per_tok=require(hf, "num_experts_per_tok"),
        moe_mlp_dim=require(hf, "moe_intermediate_size"), num_shared_experts=require(hf, "n_shared_experts"),
        n_group=require(hf, "n_group"), topk_group=require(hf, "topk_group"),
        routed_scaling_factor=float(require(hf, "routed_scaling_factor")),
        norm_topk_prob=bool(require(hf, "norm_topk_prob")), rope_theta=theta,
        rope_scaling=None if scaling is None else yarn_from_hf(scaling),
        rope_interleave=bool(hf.get("rope_interleave", True)), norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        mtp_depths=hf.get("num_nextn_predict_layers") or 0, tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings"), dtype=activation_dtype(param_dtype), param_dtype=param_dtype)


def to_hf(cfg: DeepSeekV3Config) -> dict:
    s = cfg.rope_scaling
    rope_scaling = None if s is None else dict(
        type="yarn", rope_type="yarn", factor=s.factor,
        original_max_position_embeddings=s.original_max_position_embeddings, beta_fast=s.beta_fast,
        beta_slow=s.beta_slow, mscale=s.mscale or None, mscale_all_dim=s.mscale_all_dim or None)
    return dict(
        architectures=[ARCHITECTURE], model_type=MODEL_TYPE, vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim, intermediate_size=cfg.mlp_dim, moe_intermediate_size=cfg.moe_mlp_dim,
        num_hidden_layers=cfg.num_layers, first_k_dense_replace=cfg.first_dense_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.num_shared_experts, n_group=cfg.n_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob, topk_method="noaux_tc",
        scoring_func="sigmoid", moe_layer_freq=1, num_nextn_predict_layers=cfg.mtp_depths, hidden_act="silu",
        attention_bias=False, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, rope_scaling=rope_scaling,
        rope_interleave=cfg.rope_interleave, tie_word_embeddings=cfg.tie_embeddings,
        torch_dtype=cfg.param_dtype, **context_field(cfg))


# -- tensor keys ------------------------------------------------------------------------------------------

MLA = [("attn.q_a_proj.kernel", "self_attn.q_a_proj.weight", 1),
       ("attn.q_a_layernorm.scale", "self_attn.q_a_layernorm.weight", None),
       ("attn.q_b_proj.kernel", "self_attn.q_b_proj.weight", 1),
       ("attn.kv_a_proj_with_mqa.kernel", "self_attn.kv_a_proj_with_mqa.weight", 1),
       ("attn.kv_a_layernorm.scale", "self_attn.kv_a_layernorm.weight", None),
       ("attn.kv_b_proj.kernel", "self_attn.kv_b_proj.weight", 1),
       ("attn.o_proj.kernel", "self_attn.o_proj.weight", 2)]
MOE = ROUTED_EXPERTS + [
       ("mlp.gate.e_score_correction_bias", "mlp.gate.e_score_correction_bias", None),
       ("mlp.shared_experts.gate_proj.kernel", "mlp.shared_experts.gate_proj.weight", 1),
       ("mlp.shared_experts.up_proj.kernel", "mlp.shared_experts.up_proj.weight", 1),
       ("mlp.shared_experts.down_proj.kernel", "mlp.shared_experts.down_proj.weight", 1)]


# A multi-token-prediction depth's own parts (zoo.models.deepseek_v3.mtp), below `model.layers.{i}.`
MTP = [("enorm.scale", "enorm.weight", None),
       ("hnorm.scale", "hnorm.weight", None),
       ("eh_proj.kernel", "eh_proj.weight", 1),
       ("norm.scale", "shared_head.norm.weight", None)]


def keys(cfg: DeepSeekV3Config) -> list[Entry]:
    k = cfg.first_dense_layers
    out = embed_and_head(cfg)
    if k:
        out += stacked(("dense_layers", "layers"), range(k), MLA + NORMS + SWIGLU)
    if cfg.num_layers > k:
        out += stacked(("moe_layers", "layers"), range(k, cfg.num_layers), MLA + NORMS + MOE, cfg.num_experts)
    return out + mtp_entries(cfg)


def mtp_entries(cfg: DeepSeekV3Config) -> list[Entry]:
    """The MTP depths as layers num_layers.. of the checkpoint: each depth's own parts, its MoE decoder layer, and
    its copies of the shared embedding and LM head (`copy` entries: checked on reading, written on saving)."""
    if not cfg.mtp_depths:
        return []
    depths = range(cfg.num_layers, cfg.num_layers + cfg.mtp_depths)
    out = stacked(("mtp", "heads"), depths, MTP)
    out += stacked(("mtp", "layers", "layers"), depths, MLA + NORMS + MOE, cfg.num_experts)
    head = (Entry(("embed", "embedding"), "", copy=True) if cfg.tie_embeddings else
            Entry(("lm_head", "proj", "kernel"), "", n_in=1, copy=True))
    for i in depths:
        out += [Entry(("embed", "embedding"), f"model.layers.{i}.embed_tokens.weight", copy=True),
                dataclasses.replace(head, hf=f"model.layers.{i}.shared_head.head.weight")]
    return out


def mtp_keys(hf: dict) -> Callable[[str], bool]:
    """The published checkpoints carry the multi-token-prediction module as layers num_layers..: the keys a model
    built without it (`from_hf(..., extra_heads=False)`, or a checkpoint holding none of them) skips."""
    num_layers, mtp_layers = hf.get("num_hidden_layers", 0), hf.get("num_nextn_predict_layers") or 0
    pattern = re.compile(r"model\.layers\.(\d+)\.")

    def skip(key: str) -> bool:
        m = pattern.match(key)
        return bool(m) and num_layers <= int(m.group(1)) < num_layers + mtp_layers
    return skip
