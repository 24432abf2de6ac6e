"""Qwen3, the dense models (Qwen Team, 2025, "Qwen3 Technical Report"): a pre-norm decoder with grouped-query attention,
an RMSNorm over each query and key head before RoPE (theta 1e6), no attention biases, and a SwiGLU; the embedding and
the LM head untied in the published 8B and 32B (`tie_embeddings`).
"""
from __future__ import annotations

from flax import nnx

from zoo.layers import MLP, RMSNorm
from zoo.layers.block import PreNormBlock
from zoo.models import gqa
from zoo.models.lm import CausalLM
from zoo.models.qwen3.config import Qwen3Config
from zoo.recipe import Recipe


class Qwen3DecoderLayer(PreNormBlock):
    """One Qwen3 decoder layer (Qwen Team, 2025): x += GQA(RMSNorm(x)) with an RMSNorm over each query and key
    head before RoPE; x += SwiGLU(RMSNorm(x)).

    Args:
        cfg: the model's `Qwen3Config`.
        rngs: the random generators of the parameters' initialization.

    Emits:
        `query_proj`, `key_proj`, `value_proj`, `attention_out`, `context`, `out_proj` (`zoo.layers.Attention`),
        `mlpwi_0`, `mlpwi_1`, `mlpwo` (`zoo.layers.MLP`).

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.models.qwen3 import Qwen3DecoderLayer, Qwen3Config
        >>> layer = Qwen3DecoderLayer(Qwen3Config.preset("tiny"), rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((1, 8, layer.dim))).shape == (1, 8, layer.dim)
        True
    """
    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        self.dim, self.dtype = cfg.dim, cfg.compute_dtype
        common = dict(dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, **common)
        self.attn = gqa.attention(cfg, qk_norm_eps=cfg.norm_eps, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, **common)
        self.mlp = MLP(dim=cfg.dim, hidden=cfg.mlp_dim, seq_chunks=cfg.mlp_seq_chunks, rngs=rngs, **common)


# the family's model and builder: its own, alike in shape to the others' (a family reads whole in its package)
class Qwen3(CausalLM):
    """The dense Qwen3 (Qwen Team, 2025, "Qwen3 Technical Report"): the embedding, `num_layers` scanned
    `Qwen3DecoderLayer`s (the stack `layers`), a final RMSNorm and the LM head (untied unless `tie_embeddings`).
    Build it with `zoo.models.qwen3`; call it on int tokens [B, S] for logits [B, S, vocab].

    Args:
        cfg: the model's `Qwen3Config` (a preset: `Qwen3Config.preset(name)`).
        recipe: the placement of each tag (a `zoo.Recipe`; default `Recipe.none()`: everything kept in HBM).
        rngs: the random generators of the parameters' initialization.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models import Qwen3, Qwen3Config
        >>> model = nnx.eval_shape(lambda: Qwen3(Qwen3Config.preset("tiny"), rngs=nnx.Rngs(0)))
        >>> type(model).__name__, list(model.stack_names)
        ('Qwen3', ['layers'])
    """
    def __init__(self, cfg: Qwen3Config, *, recipe: Recipe | None = None, rngs: nnx.Rngs):
        if not isinstance(cfg, Qwen3Config):
            raise ValueError(f"Qwen3 needs a Qwen3Config, got {type(cfg).__name__}")
        super().__init__(cfg, stacks={"layers": (lambda r: Qwen3DecoderLayer(cfg, rngs=r), cfg.num_layers)},
                         recipe=recipe, rngs=rngs)


def qwen3(cfg: Qwen3Config, *, recipe: Recipe | None = None, rngs: nnx.Rngs) -> Qwen3:
    """Build a dense Qwen3 model: `Qwen3(cfg, recipe=recipe, rngs=rngs)`, the family's builder (`zoo.models.qwen3`).

    Args:
        cfg: the model's `Qwen3Config`.
        recipe: the placement of each tag (a `zoo.Recipe`; default `Recipe.none()`).
        rngs: the random generators of the parameters' initialization.

    Returns:
        the `Qwen3`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> model = zoo.models.qwen3(zoo.models.Qwen3Config.preset("tiny"), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((1, 8), jnp.int32)).shape[:2]
        (1, 8)
    """
    return Qwen3(cfg, recipe=recipe, rngs=rngs)
