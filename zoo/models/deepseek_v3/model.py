"""DeepSeek-V3 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report").

A pre-norm decoder: x += MLA(RMSNorm(x)); x += FFN(RMSNorm(x)). The first `first_dense_layers` layers have a
dense SwiGLU FFN, the rest a mixture of experts (256 routed experts, 8 active per token, group-limited routing
with the auxiliary-loss-free bias, one shared expert). Two scanned stacks under one recipe: `dense_layers`, then
`moe_layers`. Multi-head latent attention with YaRN RoPE. The embedding and the LM head are untied.

The MoE stack returns per-layer aux (see `zoo.layers.moe`): `model(tokens, return_aux=True)` gives
`(logits, {"dense_layers": {}, "moe_layers": MoEAux(load=[L, E], balance_loss=[L], dropped=[L])})`. A training
step adds `total_balance_loss(aux)` to its loss and calls `update_routing_bias(model, aux, rate)` after the step.

Multi-token prediction (`mtp_depths` > 0; zoo.models.deepseek_v3.mtp) adds `model.mtp`: per depth an MoE decoder
layer (the stack "mtp", tagged like `moe_layers`), two input norms, a 2*dim -> dim projection and a final norm,
sharing the embedding and the LM head: an extra head of the model (`zoo.models.lm`). `model(tokens,
return_aux=True)` then also gives its logits (`aux["mtp_logits"]`, [D, B, S, vocab]) and its layers' `MoEAux`
(`aux["mtp"]`); the training step adds `mtp_lambda` times its loss and reports it as "mtp_loss". The 671B preset counts
671,026,419,200 parameters (the routing biases included) without MTP, as published; its one depth adds
11,610,068,224 (the MoE decoder layer's 11,507,286,272 with its routing bias, the projection's 102,760,448 and three
norms' 21,504): 682,636,487,424 in all. The checkpoint also stores layer 61's copies of the embedding and the head
(926,679,040 each; 684,489,845,504 tensors' elements in all, the published "685B"), which the model shares.
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
