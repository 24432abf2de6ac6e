"""Hugging Face `config.json` <-> zoo configs: the helpers every family's mapping uses (zoo/models/<family>/hf.py). A
family lists the HF fields it reads (SUPPORTED), ignores (IGNORED) and does not implement (UNSUPPORTED, with their
neutral value: any other is a ValueError); both spellings of RoPE settings are read, the published one written.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from zoo.checks import check_positive
from zoo.dtypes import DTYPES

# -- shared helpers ---------------------------------------------------------------------------------------


def require(hf: dict, field: str) -> Any:
    if field not in hf or hf[field] is None:
        raise ValueError(f"config.json: missing required field {field!r}")
    return hf[field]


# The JSON types of the config.json fields every family reads (an int field is not a bool; a float field may be an
# int); a family adds its own (`check_types(hf, ints=..., ...)` in its from_hf).
INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings")   # each at least 1
FLOAT_FIELDS = ("rms_norm_eps", "rope_theta")
BOOL_FIELDS = ("tie_word_embeddings", "attention_bias", "mlp_bias")
STR_FIELDS = ("model_type", "hidden_act", "dtype", "torch_dtype")


def check_types(hf: dict, *, ints: tuple[str, ...] = (), floats: tuple[str, ...] = (),
                bools: tuple[str, ...] = ()) -> None:
    """ValueError naming the first field (the common ones, and `ints`, `floats`, `bools`) whose value has the wrong
    JSON type (null is "not set"), a common integer field below 1 (named as config.json's field, not as the zoo
    config's it becomes), and `architectures` that is not a list of names (a string would be matched by
    substring)."""
    kinds = [(INT_FIELDS + ints, "an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
             (FLOAT_FIELDS + floats, "a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
             (BOOL_FIELDS + bools, "true or false", lambda v: isinstance(v, bool)),
             (STR_FIELDS, "a string", lambda v: isinstance(v, str)),
             (("rope_scaling", "rope_parameters"), "an object", lambda v: isinstance(v, dict))]
    for fields, what, ok in kinds:
        for field in fields:
            if hf.get(field) is not None and not ok(hf[field]):
                raise ValueError(f"config.json: {field}={hf[field]!r} must be {what}")
    for field in INT_FIELDS:
        check_positive(f"config.json: {field}", hf.get(field))
    names = hf.get("architectures")
    if names is not None and not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
        raise ValueError(f"config.json: architectures={names!r} must be a list of names (architectures)")


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


def context_field(cfg) -> dict:
    """config.json's `max_position_embeddings` from the config's `max_seq_len` (the context its positions were made
    for), left out where the config sets none (a slice or a tiny model: transformers then takes its default)."""
    return {} if cfg.max_seq_len is None else {"max_position_embeddings": cfg.max_seq_len}


def gqa_fields(hf: dict, param_dtype: str) -> dict[str, Any]:
    """The config fields a grouped-query attention decoder's config.json gives alike: sizes, heads, MLP, norm, tied
    embedding, context and dtypes (`param_dtype`'s parameters, `activation_dtype`'s activations)."""
    heads, dim = require(hf, "num_attention_heads"), require(hf, "hidden_size")
    return dict(vocab_size=require(hf, "vocab_size"), dim=dim, num_layers=require(hf, "num_hidden_layers"),
                num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or dim // heads, mlp_dim=require(hf, "intermediate_size"),
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_seq_len=hf.get("max_position_embeddings"), dtype=activation_dtype(param_dtype),
                param_dtype=param_dtype)
