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
    def __init__(self, cfg: LlamaConfig, *, recipe: Recipe | None = None, rngs: nnx.Rngs):
        if not isinstance(cfg, LlamaConfig):
            raise ValueError(f"Llama needs a LlamaConfig, got {type(cfg).__name__}")
        super().__init__(cfg, stacks={"layers": (lambda r: LlamaDecoderLayer(cfg, rngs=r), cfg.num_layers)},
                         recipe=recipe, rngs=rngs)


def llama3(cfg: LlamaConfig, *, recipe: Recipe | None = None, rngs: nnx.Rngs) -> Llama:
    """Build a Llama 3.1 model. `recipe` (default: `Recipe.none()`) decides each tag's placement."""
    return Llama(cfg, recipe=recipe, rngs=rngs)
