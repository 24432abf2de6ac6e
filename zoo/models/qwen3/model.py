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
    def __init__(self, cfg: Qwen3Config, *, rngs: nnx.Rngs):
        self.dim, self.dtype = cfg.dim, cfg.compute_dtype
        common = dict(dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, **common)
        self.attn = gqa.attention(cfg, qk_norm_eps=cfg.norm_eps, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, **common)
        self.mlp = MLP(dim=cfg.dim, hidden=cfg.mlp_dim, seq_chunks=cfg.mlp_seq_chunks, rngs=rngs, **common)


# the family's model and builder: its own, alike in shape to the others' (a family reads whole in its package)
class Qwen3(CausalLM):
    def __init__(self, cfg: Qwen3Config, *, recipe: Recipe | None = None, rngs: nnx.Rngs):
        if not isinstance(cfg, Qwen3Config):
            raise ValueError(f"Qwen3 needs a Qwen3Config, got {type(cfg).__name__}")
        super().__init__(cfg, stacks={"layers": (lambda r: Qwen3DecoderLayer(cfg, rngs=r), cfg.num_layers)},
                         recipe=recipe, rngs=rngs)


def qwen3(cfg: Qwen3Config, *, recipe: Recipe | None = None, rngs: nnx.Rngs) -> Qwen3:
    """Build a dense Qwen3 model. `recipe` (default: `Recipe.none()`) decides each tag's placement."""
    return Qwen3(cfg, recipe=recipe, rngs=rngs)
