"""Llama 3.1 (Grattafiori et al., 2024, "The Llama 3 Herd of Models").

A pre-norm decoder: x += attention(RMSNorm(x)); x += SwiGLU(RMSNorm(x)). Grouped-query attention with
RoPE (theta 500000) and Llama 3.1's frequency scaling. The embedding and the LM head are untied.
"""
from __future__ import annotations

from flax import nnx

from zoo.layers import MLP, RMSNorm
from zoo.layers.block import PreNormBlock
from zoo.models import gqa
from zoo.models.llama3.config import LlamaConfig
from zoo.models.lm import CausalLM
from zoo.recipe import Recipe


class LlamaDecoderLayer(PreNormBlock):
    """One Llama 3.1 decoder layer (Grattafiori et al., 2024): x += GQA(RMSNorm(x)); x += SwiGLU(RMSNorm(x)).

    Args:
        cfg: the model's `LlamaConfig`.
        rngs: the random generators of the parameters' initialization.

    Emits:
        `query_proj`, `key_proj`, `value_proj`, `attention_out`, `context`, `out_proj` (`zoo.layers.Attention`),
        `mlpwi_0`, `mlpwi_1`, `mlpwo` (`zoo.layers.MLP`).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.models.llama3 import LlamaDecoderLayer, LlamaConfig
        >>> layer = LlamaDecoderLayer(LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((1, 8, layer.dim))).shape == (1, 8, layer.dim)
        True
    """
    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.dim, self.dtype = cfg.dim, cfg.compute_dtype
        dtype, param_dtype = cfg.compute_dtype, cfg.weight_dtype
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.attn = gqa.attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype)
        self.mlp = MLP(dim=cfg.dim, hidden=cfg.mlp_dim, dtype=dtype, param_dtype=param_dtype,
                       seq_chunks=cfg.mlp_seq_chunks, rngs=rngs)


# the family's model and builder: its own, alike in shape to the others' (a family reads whole in its package)
class Llama(CausalLM):
    """Llama 3.1 (Grattafiori et al., 2024, "The Llama 3 Herd of Models"): the embedding, `num_layers`
    scanned `LlamaDecoderLayer`s (the stack `layers`), a final RMSNorm and an untied LM head. Build it with
    `zoo.models.llama3`; call it on int tokens [B, S] for logits [B, S, vocab] (`CausalLM.__call__`).

    Args:
        cfg: the model's `LlamaConfig` (a preset: `LlamaConfig.preset(name)`).
        recipe: the placement of each tag (a `zoo.Recipe`; default `Recipe.none()`: everything kept in HBM).
        rngs: the random generators of the parameters' initialization.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models import Llama, LlamaConfig
        >>> model = nnx.eval_shape(lambda: Llama(LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0)))
        >>> type(model).__name__, list(model.stack_names)
        ('Llama', ['layers'])
    """
    def __init__(self, cfg: LlamaConfig, *, recipe: Recipe | None = None, rngs: nnx.Rngs):
        if not isinstance(cfg, LlamaConfig):
            raise ValueError(f"Llama needs a LlamaConfig, got {type(cfg).__name__}")
        super().__init__(cfg, stacks={"layers": (lambda r: LlamaDecoderLayer(cfg, rngs=r), cfg.num_layers)},
                         recipe=recipe, rngs=rngs)


def llama3(cfg: LlamaConfig, *, recipe: Recipe | None = None, rngs: nnx.Rngs) -> Llama:
    """Build a Llama 3.1 model: `Llama(cfg, recipe=recipe, rngs=rngs)`, the family's builder (`zoo.models.llama3`).

    Args:
        cfg: the model's `LlamaConfig`.
        recipe: the placement of each tag (a `zoo.Recipe`; default `Recipe.none()`).
        rngs: the random generators of the parameters' initialization.

    Returns:
        the `Llama`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> model = zoo.models.llama3(zoo.models.LlamaConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((1, 8), jnp.int32)).shape[:2]
        (1, 8)
    """
    return Llama(cfg, recipe=recipe, rngs=rngs)
