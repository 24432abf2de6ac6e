"""Validation shared by the model configs: every bad value is a ValueError naming its field."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
ATTENTION_IMPLEMENTATIONS = (None, "xla", "cudnn")
# How a stack moves its offloaded residuals (zoo/models/offload_scan.py): "xla" = JAX's checkpoint-policy offload;
# "explicit" = the stack's own custom VJP, stores one layer late and prefetches one layer early;
# "explicit_prefetch" = the same, storing in the layer that makes them; "explicit_stream" = "explicit" with each
# layer's compute on a second GPU stream (XLA flag --xla_gpu_experimental_stream_annotation=true), copies on the first;
# "explicit_unrolled" = no scan, one host array per layer and tag (whole-array copies; a diagnostic for few layers).
OFFLOAD_IMPLS = ("xla", "explicit", "explicit_prefetch", "explicit_stream", "explicit_unrolled")


def dtype_of(field: str, value: str):
    if value not in DTYPES:
        raise ValueError(f"{field}={value!r} is not a supported dtype; choose one of {sorted(DTYPES)}")
    return DTYPES[value]


def check_positive(cfg, *fields: str) -> None:
    for f in fields:
        v = getattr(cfg, f)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{type(cfg).__name__}.{f} must be a positive int, got {v!r}")


def check_positive_float(cfg, *fields: str) -> None:
    for f in fields:
        v = getattr(cfg, f)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{type(cfg).__name__}.{f} must be a positive number, got {v!r}")


def check_divides(cfg, small: str, big: str) -> None:
    a, b = getattr(cfg, small), getattr(cfg, big)
    if b % a:
        raise ValueError(f"{type(cfg).__name__}.{small}={a} must divide {big}={b}")


def check_common(cfg) -> None:
    """dtype, attention- and offload-implementation fields every model config has."""
    dtype_of(f"{type(cfg).__name__}.dtype", cfg.dtype)
    dtype_of(f"{type(cfg).__name__}.param_dtype", cfg.param_dtype)
    if cfg.attention_impl not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"{type(cfg).__name__}.attention_impl must be one of {ATTENTION_IMPLEMENTATIONS}, "
                         f"got {cfg.attention_impl!r}")
    if getattr(cfg, "offload_impl", "xla") not in OFFLOAD_IMPLS:
        raise ValueError(f"{type(cfg).__name__}.offload_impl must be one of {OFFLOAD_IMPLS}, "
                         f"got {cfg.offload_impl!r}")


def replace(cfg, **changes):
    """`dataclasses.replace` (validates again)."""
    return dataclasses.replace(cfg, **changes)
