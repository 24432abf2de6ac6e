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
    """One decoder layer; `moe=True` for the mixture-of-experts FFN, which also returns its aux."""

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
    def __init__(self, cfg: Qwen3MoeConfig, *, recipe: Recipe | None = None, rngs: nnx.Rngs):
        if not isinstance(cfg, Qwen3MoeConfig):
            raise ValueError(f"Qwen3Moe needs a Qwen3MoeConfig, got {type(cfg).__name__}")

        def make(moe: bool):
            return lambda r: Qwen3MoeDecoderLayer(cfg, moe=moe, rngs=r)
        stacks = {name: (make(moe), len(layers)) for name, (moe, layers) in zip(stack_names(cfg), cfg.layer_runs())}
        super().__init__(cfg, stacks=stacks, recipe=recipe, rngs=rngs)


def qwen3_moe(cfg: Qwen3MoeConfig, *, recipe: Recipe | None = None, rngs: nnx.Rngs) -> Qwen3Moe:
    """Build Qwen3-MoE. `recipe` (default: `Recipe.none()`) decides each tag's placement in every stack."""
    return Qwen3Moe(cfg, recipe=recipe, rngs=rngs)
