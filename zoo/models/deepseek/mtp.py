"""DeepSeek-V3's multi-token prediction (the technical report, section 2.2).

Depth k (1..D) sees, at position i, the representation h_i^(k-1) the depth before it made (the main model's for
k = 1) and the embedding of the token k positions ahead, t_(i+k); it predicts t_(i+k+1):

    h'_i^k = eh_proj([enorm(Emb(t_(i+k))); hnorm(h_i^(k-1))])    2*dim -> dim
    h^k    = norm(TRM_k(h'^k))                                   one full decoder layer (MLA + MoE)
    P^k    = OutHead(h^k)                                         the main model's LM head (shared)

The embedding and the output head are the main model's, not copies. The concatenation puts the embedding first:
the published checkpoints' `eh_proj` columns are in that order (the report writes the pair the other way round).
The representation handed on is the normed one the head reads: the main model's after its final norm (as the
published MTP layer is used for speculative decoding), then each depth's after its own `norm` (`shared_head.norm`).

Positions whose embedded token t_(i+k) lies past the input are fed zeros; their targets lie past the sequence too,
so the loss excludes them (`zoo.train_step.mtp_loss`), and causal attention keeps them from every kept position.

The decoder layers are a `Stack` of the main MoE stack's layer class (the same tags: a recipe places them here too;
the planner plans them as the stack "mtp"); each depth's layer runs alone, rematerialized under the recipe, because
depth k + 1 needs depth k's output and a new embedding in between. The parameters of the D depths' own parts (the
two input norms, the projection, the final norm) are stacked on a leading `layers` axis like a stack's.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import RMSNorm
from zoo.layers.linear import projection
from zoo.models.deepseek.config import DeepSeekV3Config
from zoo.models.lm import shift_left
from zoo.models.stack import Stack, module_at, stacked_modules


class MTPDepth(nnx.Module):
    """One depth's own parts around its decoder layer (checkpoint names: enorm, hnorm, eh_proj, shared_head.norm)."""

    def __init__(self, cfg: DeepSeekV3Config, *, rngs: nnx.Rngs):
        common = dict(eps=cfg.norm_eps, dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)
        self.enorm = RMSNorm(cfg.dim, **common)
        self.hnorm = RMSNorm(cfg.dim, **common)
        # the concatenated axis has no logical name: the output axis (`embed`) is the one the rules may shard
        self.eh_proj = projection("bsc,cd->bsd", (2 * cfg.dim, cfg.dim), (None, "embed"), n_in=1,
                                  dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype, rngs=rngs)
        self.norm = RMSNorm(cfg.dim, **common)

    def combine(self, h: jax.Array, embedded: jax.Array) -> jax.Array:
        return self.eh_proj(jnp.concatenate([self.enorm(embedded), self.hnorm(h)], axis=-1))


class MultiTokenPrediction(nnx.Module):
    """`cfg.mtp_depths` depths; `make_layer(rngs)` builds one decoder layer (the main MoE stack's kind)."""

    def __init__(self, cfg: DeepSeekV3Config, make_layer: Callable[[nnx.Rngs], nnx.Module], *, rngs: nnx.Rngs):
        if cfg.mtp_depths <= 0:
            raise ValueError(f"MultiTokenPrediction needs DeepSeekV3Config.mtp_depths > 0, got {cfg.mtp_depths}")
        self.depths = cfg.mtp_depths
        self.heads = stacked_modules(lambda r: MTPDepth(cfg, rngs=r), cfg.mtp_depths, rngs)
        self.layers = Stack(make_layer, num_layers=cfg.mtp_depths, rngs=rngs)

    def __call__(self, h: jax.Array, embeddings: jax.Array, head: Callable[[jax.Array], jax.Array],
                 policy) -> tuple[jax.Array, Any]:
        """h: the main model's normed final hidden states [B, S, dim]; embeddings: its input embeddings [B, S, dim];
        head: normed hidden states -> logits. Returns (logits [D, B, S, vocab], the layers' aux stacked over D)."""
        logits, auxes = [], []
        for k in range(1, self.depths + 1):
            depth = module_at(self.heads, k - 1)
            x, aux = self.layers.apply_layer(k - 1, depth.combine(h, shift_left(embeddings, k)), policy)
            h = depth.norm(x)
            logits.append(head(h))
            auxes.append(aux)
        return jnp.stack(logits), jax.tree.map(lambda *a: jnp.stack(a), *auxes)
