"""Hugging Face `config.json` <-> zoo configs, one pair of functions per architecture.

Each architecture lists the HF fields it reads (SUPPORTED), the ones that cannot change the logits and are
ignored (IGNORED: token ids, init ranges, dropout at inference, cache flags, ...), and the ones that would change
the math but that the zoo does not implement (UNSUPPORTED, with their neutral value): a checkpoint that sets one
of those to anything else is refused with a ValueError naming the field. Fields in none of the lists are ignored,
as transformers ignores them.

Both spellings of RoPE settings are read: the published one (`rope_theta` and `rope_scaling` at the top level)
and transformers 5's (`rope_parameters` holding `rope_theta`, `rope_type` and the scaling fields). The published
spelling is written, which every transformers version reads.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from zoo.layers import Llama3Scaling
from zoo.models.config import DTYPES

# -- shared helpers ---------------------------------------------------------------------------------------


def require(hf: dict, field: str) -> Any:
    if field not in hf or hf[field] is None:
        raise ValueError(f"config.json: missing required field {field!r}")
    return hf[field]


# The JSON types of the config.json fields zoo reads (an int field is not a bool; a float field may be an int).
INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "head_dim", "first_k_dense_replace", "q_lora_rank",
              "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
              "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "num_nextn_predict_layers")
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor")
BOOL_FIELDS = ("tie_word_embeddings", "norm_topk_prob", "rope_interleave", "attention_bias", "mlp_bias")
STR_FIELDS = ("model_type", "hidden_act", "dtype", "torch_dtype")


def check_types(hf: dict) -> None:
    """ValueError naming the first field zoo reads whose value has the wrong JSON type (null is "not set"), and
    `architectures` that is not a list of names (a string would be matched by substring)."""
    kinds = [(INT_FIELDS, "an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
             (FLOAT_FIELDS, "a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
             (BOOL_FIELDS, "true or false", lambda v: isinstance(v, bool)),
             (STR_FIELDS, "a string", lambda v: isinstance(v, str)),
             (("rope_scaling", "rope_parameters"), "an object", lambda v: isinstance(v, dict))]
    for fields, what, ok in kinds:
        for field in fields:
            if hf.get(field) is not None and not ok(hf[field]):
                raise ValueError(f"config.json: {field}={hf[field]!r} must be {what}")
    names = hf.get("architectures")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"config.json: architectures={names!r} must be a list of names, e.g. [\"LlamaForCausalLM\"]")


def check_unsupported(hf: dict, unsupported: dict[str, Any], arch: str) -> None:
    """ValueError naming the first field set to a value other than its neutral one (absent or null is neutral)."""
    for field, neutral in unsupported.items():
        value = hf.get(field)
        if value is not None and value != neutral:
            raise ValueError(f"config.json: {arch} field {field}={value!r} changes the math and is not supported "
                             f"by zoo (supported: {neutral!r})")


def rope_settings(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from either spelling; scaling 'default' -> None."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    theta = hf.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    theta = 10000.0 if theta is None else theta
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = kind
        scaling.pop("type", None)
        if kind == "default":
            extra = sorted(k for k in scaling if k not in ("rope_type",))
            if extra:
                raise ValueError(f"config.json: rope_scaling of type 'default' with fields {extra} is not supported")
            scaling = None
    return float(theta), scaling


def param_dtype_of(hf: dict, dtype, tensor_dtype: str | None) -> str:
    """The parameter dtype: `dtype` if given, else the checkpoint's (config `dtype`/`torch_dtype`, else the
    tensors'), else float32."""
    if dtype is not None:
        name = jnp.dtype(dtype).name
        if name not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is not a supported parameter dtype; choose one of {sorted(DTYPES)}")
        return name
    for field in ("dtype", "torch_dtype"):
        if isinstance(hf.get(field), str) and hf[field] in DTYPES:
            return hf[field]
    return tensor_dtype if tensor_dtype in DTYPES else "float32"


def activation_dtype(param_dtype: str) -> str:
    """float32 parameters compute in float32 (exact parity); bf16/fp16 parameters compute in bfloat16."""
    return "float32" if param_dtype == "float32" else "bfloat16"


# -- Llama --------------------------------------------------------------------------------------------------

LLAMA_SUPPORTED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
                   "rope_parameters", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias",
                   "architectures", "model_type", "dtype", "torch_dtype")
LLAMA_IGNORED = ("max_position_embeddings", "attention_dropout", "initializer_range", "bos_token_id",
                 "eos_token_id", "pad_token_id", "use_cache", "pretraining_tp", "transformers_version")
LLAMA_UNSUPPORTED: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                                     "quantization_config": None, "sliding_window": None}


def llama_from_hf(hf: dict, *, param_dtype: str):
    from zoo.models.llama import LlamaConfig
    check_unsupported(hf, LLAMA_UNSUPPORTED, "LlamaForCausalLM")
    theta, scaling = rope_settings(hf)
    rope_scaling = None
    if scaling is not None:
        if scaling["rope_type"] != "llama3":
            raise ValueError(f"config.json: rope_scaling.rope_type={scaling['rope_type']!r} is not supported for "
                             "LlamaForCausalLM (supported: 'llama3', 'default')")
        fields = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        extra = sorted(set(scaling) - set(fields) - {"rope_type"})
        if extra:
            raise ValueError(f"config.json: rope_scaling fields {extra} are not supported for rope_type 'llama3'")
        rope_scaling = Llama3Scaling(**{f: require(scaling, f) for f in fields})
    heads = require(hf, "num_attention_heads")
    dim = require(hf, "hidden_size")
    head_dim = hf.get("head_dim") or dim // heads
    return LlamaConfig(
        vocab_size=require(hf, "vocab_size"), dim=dim, num_layers=require(hf, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
        mlp_dim=require(hf, "intermediate_size"), rope_theta=theta, rope_scaling=rope_scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=activation_dtype(param_dtype), param_dtype=param_dtype)


def llama_to_hf(cfg) -> dict:
    s = cfg.rope_scaling
    rope_scaling = None if s is None else dict(
        rope_type="llama3", factor=s.factor, low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
        original_max_position_embeddings=s.original_max_position_embeddings)
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=cfg.vocab_size, hidden_size=cfg.dim,
        intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act="silu", rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, rope_scaling=rope_scaling, tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False, mlp_bias=False,
        max_position_embeddings=131072,  # Llama 3.1's context; metadata only (RoPE needs no maximum)
        torch_dtype=cfg.param_dtype)


# -- DeepSeek-V3 --------------------------------------------------------------------------------------------

DEEPSEEK_SUPPORTED = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                      "first_k_dense_replace", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
                      "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_routed_experts",
                      "num_experts_per_tok", "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor",
                      "norm_topk_prob", "rope_theta", "rope_scaling", "rope_parameters", "rope_interleave",
                      "rms_norm_eps", "tie_word_embeddings", "hidden_act", "attention_bias", "topk_method",
                      "scoring_func", "moe_layer_freq", "num_nextn_predict_layers", "architectures", "model_type",
                      "dtype", "torch_dtype")
DEEPSEEK_IGNORED = ("max_position_embeddings", "attention_dropout", "initializer_range", "bos_token_id",
                    "eos_token_id", "pad_token_id", "use_cache", "pretraining_tp", "transformers_version", "ep_size",
                    "aux_loss_alpha", "seq_aux", "head_dim", "qk_head_dim", "output_router_logits", "auto_map")
DEEPSEEK_UNSUPPORTED: dict[str, Any] = {"hidden_act": "silu", "attention_bias": False, "topk_method": "noaux_tc",
                                        "scoring_func": "sigmoid", "moe_layer_freq": 1, "quantization_config": None}
YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def yarn_from_hf(scaling: dict):
    from zoo.layers import YarnScaling
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


def deepseek_from_hf(hf: dict, *, param_dtype: str):
    from zoo.models.deepseek import DeepSeekV3Config
    check_unsupported(hf, DEEPSEEK_UNSUPPORTED, "DeepseekV3ForCausalLM")
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
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        dtype=activation_dtype(param_dtype), param_dtype=param_dtype)


def deepseek_to_hf(cfg) -> dict:
    s = cfg.rope_scaling
    rope_scaling = None if s is None else dict(
        type="yarn", rope_type="yarn", factor=s.factor,
        original_max_position_embeddings=s.original_max_position_embeddings, beta_fast=s.beta_fast,
        beta_slow=s.beta_slow, mscale=s.mscale or None, mscale_all_dim=s.mscale_all_dim or None)
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim, intermediate_size=cfg.mlp_dim, moe_intermediate_size=cfg.moe_mlp_dim,
        num_hidden_layers=cfg.num_layers, first_k_dense_replace=cfg.first_dense_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        n_shared_experts=cfg.num_shared_experts, n_group=cfg.n_group, topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob, topk_method="noaux_tc",
        scoring_func="sigmoid", moe_layer_freq=1, num_nextn_predict_layers=0, hidden_act="silu",
        attention_bias=False, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, rope_scaling=rope_scaling,
        rope_interleave=cfg.rope_interleave, tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=4096 if s is None else int(s.original_max_position_embeddings * s.factor),
        torch_dtype=cfg.param_dtype)
