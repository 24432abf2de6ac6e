"""Qwen3-MoE (Qwen Team, 2025, "Qwen3 Technical Report").

A pre-norm decoder with grouped-query attention (an RMSNorm over each query and key head before RoPE, theta 1e6)
and a mixture of experts (softmax top-k, no shared expert) except in the layers `mlp_only_layers` and
`decoder_sparse_step` make dense. Each run of layers of one kind is one scanned stack (the published sizes:
`moe_layers` alone; tiny: `dense_layers`, then `moe_layers`). The embedding and the LM head are untied.
"""
from __future__ import annotations

from flax import nnx

from zoo.layers import MLP, RMSNorm
from zoo.layers.block import PreNormBlock
from zoo.layers.moe import Experts, MoE, SoftmaxRouter
from zoo.models import gqa
from zoo.models.lm import CausalLM
from zoo.models.qwen3_moe.config import Qwen3MoeConfig
from zoo.recipe import Recipe


class Qwen3MoeDecoderLayer(PreNormBlock):
    """One Qwen3-MoE decoder layer (Qwen Team, 2025): Qwen3's GQA attention, then a dense SwiGLU or, with
    `moe=True`, a mixture of experts with softmax top-k routing (`zoo.layers.MoE`, `SoftmaxRouter`).

    Args:
        cfg: the model's `Qwen3MoeConfig`.
        moe: whether the FFN is the mixture of experts (which also returns its aux).
        rngs: the random generators of the parameters' initialization.

    Emits:
        `query_proj`, `key_proj`, `value_proj`, `attention_out`, `context`, `out_proj` (`zoo.layers.Attention`),
        `mlpwi_0`, `mlpwi_1`, `mlpwo` (`zoo.layers.MLP`).
        With `moe=True`: `moe_mlpwi_0`, `moe_mlpwi_1`, `moe_mlpwo` instead of the dense MLP's.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.models.qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeConfig
        >>> layer = Qwen3MoeDecoderLayer(Qwen3MoeConfig.preset("tiny"), moe=False, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((1, 8, layer.dim))).shape == (1, 8, layer.dim)
        True
    """

    def __init__(self, cfg: Qwen3MoeConfig, *, moe: bool, rngs: nnx.Rngs):
        self.dim, self.dtype, self.moe = cfg.dim, cfg.compute_dtype, moe
        common = dict(dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, **common)
        self.attn = gqa.attention(cfg, qk_norm_eps=cfg.norm_eps, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, **common)
        self.mlp = (qwen3_moe_ffn(cfg, rngs=rngs) if moe else
                    MLP(dim=cfg.dim, hidden=cfg.mlp_dim, seq_chunks=cfg.mlp_seq_chunks, rngs=rngs, **common))


def qwen3_moe_ffn(cfg: Qwen3MoeConfig, *, rngs: nnx.Rngs) -> MoE:
    """Qwen3-MoE's FFN: the softmax top-k router and the routed experts; no shared expert."""
    router = SoftmaxRouter(dim=cfg.dim, num_experts=cfg.num_experts, k=cfg.num_experts_per_tok,
                           norm_topk_prob=cfg.norm_topk_prob, balance_loss_weight=cfg.balance_loss_weight,
                           param_dtype=cfg.weight_dtype, rngs=rngs)
    experts = Experts(num_experts=cfg.num_experts, dim=cfg.dim, hidden=cfg.moe_mlp_dim, dtype=cfg.compute_dtype,
                      param_dtype=cfg.weight_dtype, rngs=rngs)
    return MoE(dim=cfg.dim, router=router, experts=experts, backend=cfg.moe_backend,
               capacity_factor=cfg.capacity_factor, ep_dispatch=cfg.ep_dispatch, dtype=cfg.compute_dtype)


def stack_names(cfg: Qwen3MoeConfig) -> list[str]:
    """One name per run of `cfg.layer_runs()`: `moe_layers` / `dense_layers` where a kind has one run, else
    suffixed by the run's first layer (`dense_layers_1`)."""
    runs = cfg.layer_runs()
    kinds = [moe for moe, _ in runs]
    return [f"{'moe' if moe else 'dense'}_layers" + ("" if kinds.count(moe) == 1 else f"_{layers.start}")
            for moe, layers in runs]


class Qwen3Moe(CausalLM):
    """Qwen3's mixture-of-experts models (Qwen Team, 2025): the embedding, scanned runs of dense and MoE
    `Qwen3MoeDecoderLayer`s (as `decoder_sparse_step` and `mlp_only_layers` lay them out), a final RMSNorm and the
    LM head. Build it with `zoo.models.qwen3_moe`; call it with `return_aux=True` for the balance loss's records.

    Args:
        cfg: the model's `Qwen3MoeConfig` (a preset: `Qwen3MoeConfig.preset(name)`).
        recipe: the placement of each tag (a `zoo.Recipe`; default `Recipe.none()`: everything kept in HBM).
        rngs: the random generators of the parameters' initialization.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models import Qwen3Moe, Qwen3MoeConfig
        >>> model = nnx.eval_shape(lambda: Qwen3Moe(Qwen3MoeConfig.preset("tiny"), rngs=nnx.Rngs(0)))
        >>> type(model).__name__, list(model.stack_names)
        ('Qwen3Moe', ['dense_layers', 'moe_layers'])
    """
    def __init__(self, cfg: Qwen3MoeConfig, *, recipe: Recipe | None = None, rngs: nnx.Rngs):
        if not isinstance(cfg, Qwen3MoeConfig):
            raise ValueError(f"Qwen3Moe needs a Qwen3MoeConfig, got {type(cfg).__name__}")

        def make(moe: bool):
            return lambda r: Qwen3MoeDecoderLayer(cfg, moe=moe, rngs=r)
        stacks = {name: (make(moe), len(layers)) for name, (moe, layers) in zip(stack_names(cfg), cfg.layer_runs())}
        super().__init__(cfg, stacks=stacks, recipe=recipe, rngs=rngs)


def qwen3_moe(cfg: Qwen3MoeConfig, *, recipe: Recipe | None = None, rngs: nnx.Rngs) -> Qwen3Moe:
    """Build a Qwen3-MoE model: `Qwen3Moe(cfg, recipe=recipe, rngs=rngs)` (`zoo.models.qwen3_moe`).

    Args:
        cfg: the model's `Qwen3MoeConfig`.
        recipe: the placement of each tag (a `zoo.Recipe`; default `Recipe.none()`).
        rngs: the random generators of the parameters' initialization.

    Returns:
        the `Qwen3Moe`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> model = zoo.models.qwen3_moe(zoo.models.Qwen3MoeConfig.preset("tiny"), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((1, 8), jnp.int32)).shape[:2]
        (1, 8)
    """
    return Qwen3Moe(cfg, recipe=recipe, rngs=rngs)
