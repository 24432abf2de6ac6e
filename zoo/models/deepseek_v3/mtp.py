"""DeepSeek-V3's multi-token prediction (the technical report, section 2.2): depth k (1..D) predicts t_(i+k+1) from the
representation the depth before it made and the embedding of t_(i+k).

    h'_i^k = eh_proj([enorm(Emb(t_(i+k))); hnorm(h_i^(k-1))])    2*dim -> dim
    h^k    = norm(TRM_k(h'^k))                                   one full decoder layer (MLA + MoE)
    P^k    = OutHead(h^k)                                         the main model's LM head (shared)

An extra head of the model (`zoo.models.lm`), held as `model.mtp`, its layers the stack "mtp" (docs/internals.md,
"Multi-token prediction").
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import RMSNorm
from zoo.layers.linear import projection
from zoo.loss import next_token_loss
from zoo.models.deepseek_v3.config import DeepSeekV3Config
from zoo.models.lm import shift_left
from zoo.models.stack import Stack, module_at, stacked_modules


class MTPDepth(nnx.Module):
    """One multi-token prediction depth's own parts around its decoder layer (DeepSeek-V3, arXiv:2412.19437, 2.2):
    RMSNorms of the previous depth's hidden states and of the next tokens' embeddings, their concatenation projected
    back to `dim` (checkpoint names: enorm, hnorm, eh_proj, shared_head.norm).

    Args:
        cfg: the model's `DeepSeekV3Config`.
        rngs: the random generators of the parameters' initialization.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models.deepseek_v3 import DeepSeekV3Config
        >>> from zoo.models.deepseek_v3.mtp import MTPDepth
        >>> depth = MTPDepth(DeepSeekV3Config.preset("tiny"), rngs=nnx.Rngs(0))
        >>> type(depth.eh_proj).__name__
        'Einsum'
    """

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
    """DeepSeek-V3's multi-token prediction (arXiv:2412.19437, 2.2): `cfg.mtp_depths` sequential depths, depth k
    predicting the token k + 1 positions after the next from the previous depth's hidden states and the embeddings.

    Args:
        cfg: the model's `DeepSeekV3Config` (with `mtp_depths` > 0).
        make_layer: make_layer(rngs) builds one decoder layer (the main MoE stack's kind).
        rngs: the random generators of the parameters' initialization.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models import DeepSeekV3Config, deepseek_v3
        >>> model = nnx.eval_shape(lambda: deepseek_v3(DeepSeekV3Config.preset("tiny", mtp_depths=1), rngs=nnx.Rngs(0)))
        >>> model.mtp.depths
        1
    """

    def __init__(self, cfg: DeepSeekV3Config, make_layer: Callable[[nnx.Rngs], nnx.Module], *, rngs: nnx.Rngs):
        if cfg.mtp_depths <= 0:
            raise ValueError(f"MultiTokenPrediction needs DeepSeekV3Config.mtp_depths > 0, got {cfg.mtp_depths}")
        self.depths = cfg.mtp_depths
        self.loss_weight = cfg.mtp_loss_weight()
        self.heads = stacked_modules(lambda r: MTPDepth(cfg, rngs=r), cfg.mtp_depths, rngs)
        self.layers = Stack(make_layer, num_layers=cfg.mtp_depths, rngs=rngs)

    def __call__(self, h: jax.Array, embeddings: jax.Array, policy, *, tiles: int = 1) -> tuple[jax.Array, Any]:
        """Run the depths.

        Args:
            h: the main model's normed final hidden states [B, S, dim].
            embeddings: its input embeddings [B, S, dim].
            policy: the remat policy of the depths' decoder layers (the recipe's).
            tiles: sequence tiles of the per-position parts (`zoo.layers.tiles`).

        Returns:
            (each depth's normed hidden states [D, B, S, dim], the layers' aux stacked over D).
        """
        hidden, auxes = [], []
        for k in range(1, self.depths + 1):
            depth = module_at(self.heads, k - 1)
            x, aux = self.layers.apply_layer(k - 1, depth.combine(h, shift_left(embeddings, k)), policy, tiles=tiles)
            h = depth.norm(x)
            hidden.append(h)
            auxes.append(aux)
        return jnp.stack(hidden), jax.tree.map(lambda *a: jnp.stack(a), *auxes)

    def loss(self, hidden: jax.Array, targets: jax.Array, weights: jax.Array, batch_weights: jax.Array,
             cross_entropy: Callable[..., jax.Array]) -> jax.Array:
        """The mean over depths of each depth's cross-entropy (`mtp_loss`), `cross_entropy(h, targets, weights,
        total_weight)` running the LM head on depth k's hidden states `hidden[k - 1]`."""
        return depth_mean(lambda k, t, w, total: cross_entropy(hidden[k - 1], t, w, total), hidden.shape[0],
                          targets, weights, batch_weights)


def mtp_loss(logits: jax.Array, targets: jax.Array, weights: jax.Array,
             batch_weights: jax.Array | None = None) -> jax.Array:
    """The multi-token-prediction loss: the mean over depths of each depth's weighted cross-entropy, in float32.

    `logits` [D, B, S, V] (`aux["mtp_logits"]`); `targets` and `weights` [B, S] are the next-token loss's (target i
    is token i + 1). Depth k (1..D) at position i predicts token i + k + 1, targets[:, i + k], with that target's
    weight; the last k positions have none and are left out (weight 0). `batch_weights` (default `weights`): the
    whole batch's weights, whose shifted sums are the denominators (a micro-batch's share of the batch's loss)."""
    return depth_mean(lambda k, t, w, total: next_token_loss(logits[k - 1], t, w, total), logits.shape[0],
                      targets, weights, batch_weights)


def depth_mean(depth_loss: Callable[..., jax.Array], depths: int, targets: jax.Array, weights: jax.Array,
               batch_weights: jax.Array | None = None) -> jax.Array:
    """The mean over k = 1..depths of `depth_loss(k, targets, weights, total_weight)` on the targets and weights
    shifted k further (`shift_left`), over the shifted sum of `batch_weights` (default `weights`)."""
    batch_weights = weights if batch_weights is None else batch_weights
    losses = [depth_loss(k, shift_left(targets, k), shift_left(weights, k), jnp.sum(shift_left(batch_weights, k)))
              for k in range(1, depths + 1)]
    return jnp.mean(jnp.stack(losses))
