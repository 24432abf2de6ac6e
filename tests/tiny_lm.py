"""What the library's training-step tests share (tests/test_train_step.py, tests/test_streamed_update.py): a two-layer
Llama small enough to compile in a second or two, its parameters drawn by NumPy into its abstract state (no
compilation to build it), and a batch of tokens with uneven weights."""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

import zoo

VOCAB = 32
SEQ = 8
BATCH = 4
CONFIG = zoo.models.LlamaConfig.preset("tiny", vocab_size=VOCAB, dim=16, num_layers=2, num_heads=2, num_kv_heads=1,
                                       head_dim=8, mlp_dim=32)


def config(param_dtype: str = "float32"):
    """The two-layer config, its parameters in `param_dtype` (compute in float32)."""
    return dataclasses.replace(CONFIG, param_dtype=param_dtype)


def build(cfg=CONFIG, *, seed: int = 0) -> nnx.Module:
    """The model of `cfg`, each parameter NumPy's normal draw (`seed`) times 0.3, in its dtype."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: zoo.models.llama3(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    leaves = [(p, v.replace(jnp.asarray(0.3 * rng.standard_normal(v.shape), v.dtype)))
              for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def batch(seed: int = 1, rows: int = BATCH, seq: int = SEQ) -> dict[str, jnp.ndarray]:
    """{"tokens": [rows, seq + 1] int32, "weights": [rows, seq] float32}: random tokens; the even rows' first
    quarter weighs 0 and every other weight is between 0.5 and 1.5 (a weighted mean differs from a plain one)."""
    rng = np.random.default_rng(seed)
    weights = rng.uniform(0.5, 1.5, (rows, seq)).astype(np.float32)
    weights[::2, : seq // 4] = 0.0
    return {"tokens": jnp.asarray(rng.integers(0, VOCAB, (rows, seq + 1)), jnp.int32),
            "weights": jnp.asarray(weights)}
