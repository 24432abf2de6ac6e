"""The dtypes a config may name (parameters, activations, optimizer state), by name."""
from __future__ import annotations

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_of(field: str, value: str):
    """The jnp dtype named `value`; ValueError naming `field` for another name."""
    if value not in DTYPES:
        raise ValueError(f"{field}={value!r} is not a supported dtype; choose one of {sorted(DTYPES)}")
    return DTYPES[value]
