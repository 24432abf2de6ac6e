"""DeepSeek-V3 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report").

A pre-norm decoder with multi-head latent attention (YaRN RoPE): `first_dense_layers` dense SwiGLU layers (the stack
`dense_layers`), then a mixture of experts (`moe_layers`: group-limited routing with the auxiliary-loss-free bias, one
shared expert), and its multi-token prediction as an extra head when `mtp_depths` > 0. A training step adds
`total_balance_loss(aux)` and calls `update_routing_bias(model, aux, rate)` after the step. The presets' parameter
counts: docs/internals.md, "DeepSeek-V3's parameters".
"""
from __future__ import annotations

from flax import nnx

from zoo.layers import MLP, RMSNorm
from zoo.layers.block import PreNormBlock
from zoo.layers.mla import MLA
from zoo.layers.moe import Experts, GroupLimitedRouter, MoE
from zoo.models.deepseek_v3.config import DeepSeekV3Config
from zoo.models.deepseek_v3.mtp import MultiTokenPrediction
from zoo.models.lm import CausalLM
from zoo.recipe import Recipe


class DeepSeekDecoderLayer(PreNormBlock):
    """One decoder layer; `moe=True` for the mixture-of-experts FFN, which also returns its aux."""

    def __init__(self, cfg: DeepSeekV3Config, *, moe: bool, rngs: nnx.Rngs):
        self.dim, self.dtype = cfg.dim, cfg.compute_dtype
        dtype, param_dtype = cfg.compute_dtype, cfg.weight_dtype
        common = dict(dtype=dtype, param_dtype=param_dtype)
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, **common)
        self.attn = MLA(dim=cfg.dim, num_heads=cfg.num_heads, q_lora_rank=cfg.q_lora_rank,
                        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
                        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, rope=cfg.rope(),
                        rope_interleave=cfg.rope_interleave, norm_eps=cfg.norm_eps,
                        implementation=cfg.attention_impl, rngs=rngs, **common)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, **common)
        if moe:
            self.mlp = deepseek_moe(cfg, rngs=rngs)
        else:
            self.mlp = MLP(dim=cfg.dim, hidden=cfg.mlp_dim, seq_chunks=cfg.mlp_seq_chunks, rngs=rngs, **common)
        self.moe = moe


def deepseek_moe(cfg: DeepSeekV3Config, *, rngs: nnx.Rngs) -> MoE:
    """DeepSeek-V3's MoE: the group-limited sigmoid router with its bias, the routed experts, the shared expert."""
    common = dict(dtype=cfg.compute_dtype, param_dtype=cfg.weight_dtype)
    router = GroupLimitedRouter(dim=cfg.dim, num_experts=cfg.num_experts, k=cfg.num_experts_per_tok,
                                n_group=cfg.n_group, topk_group=cfg.topk_group,
                                routed_scaling_factor=cfg.routed_scaling_factor, norm_topk_prob=cfg.norm_topk_prob,
                                balance_loss_weight=cfg.balance_loss_weight, param_dtype=cfg.weight_dtype, rngs=rngs)
    experts = Experts(num_experts=cfg.num_experts, dim=cfg.dim, hidden=cfg.moe_mlp_dim, rngs=rngs, **common)
    shared = MLP(dim=cfg.dim, hidden=cfg.moe_mlp_dim * cfg.num_shared_experts, tag_prefix="shared_", rngs=rngs,
                 **common) if cfg.num_shared_experts else None
    return MoE(dim=cfg.dim, router=router, experts=experts, shared=shared, backend=cfg.moe_backend,
               capacity_factor=cfg.capacity_factor, ep_dispatch=cfg.ep_dispatch, dtype=cfg.compute_dtype)


class DeepSeekV3(CausalLM):
    def __init__(self, cfg: DeepSeekV3Config, *, recipe: Recipe | None = None, rngs: nnx.Rngs):
        if not isinstance(cfg, DeepSeekV3Config):
            raise ValueError(f"DeepSeekV3 needs a DeepSeekV3Config, got {type(cfg).__name__}")
        stacks = {}
        if cfg.first_dense_layers:
            stacks["dense_layers"] = (lambda r: DeepSeekDecoderLayer(cfg, moe=False, rngs=r), cfg.first_dense_layers)
        if cfg.num_moe_layers:
            stacks["moe_layers"] = (lambda r: DeepSeekDecoderLayer(cfg, moe=True, rngs=r), cfg.num_moe_layers)
        mtp = None
        if cfg.mtp_depths:
            def mtp(r):
                return MultiTokenPrediction(cfg, lambda r: DeepSeekDecoderLayer(cfg, moe=True, rngs=r), rngs=r)
        # multi-token prediction is the model's one extra head, `model.mtp` (None without it)
        super().__init__(cfg, stacks=stacks, recipe=recipe, rngs=rngs, extra_heads={"mtp": mtp})


def deepseek_v3(cfg: DeepSeekV3Config, *, recipe: Recipe | None = None, rngs: nnx.Rngs) -> DeepSeekV3:
    """Build DeepSeek-V3. `recipe` (default: `Recipe.none()`) decides each tag's placement in every stack (the MTP
    module's too)."""
    return DeepSeekV3(cfg, recipe=recipe, rngs=rngs)
