"""DeepSeek-V3 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report").

A pre-norm decoder: x += MLA(RMSNorm(x)); x += FFN(RMSNorm(x)). The first `first_dense_layers` layers have a
dense SwiGLU FFN, the rest a mixture of experts (256 routed experts, 8 active per token, group-limited routing
with the auxiliary-loss-free bias, one shared expert). Two scanned stacks under one recipe: `dense_layers`, then
`moe_layers`. Multi-head latent attention with YaRN RoPE. The embedding and the LM head are untied.

The MoE stack returns per-layer aux (see `zoo.layers.moe`): `model(tokens, return_aux=True)` gives
`(logits, {"dense_layers": {}, "moe_layers": MoEAux(load=[L, E], balance_loss=[L], dropped=[L])})`. A training
step adds `total_balance_loss(aux)` to its loss and calls `update_routing_bias(model, aux, rate)` after the step.

The multi-token-prediction module (one extra layer predicting token t+2) is not built: the model is the 61-layer
main model, and the 671B preset counts 671,026,419,200 parameters (the routing biases included), as published
without MTP.
"""
from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from zoo.layers import MLP, RMSNorm, Rope, YarnScaling
from zoo.layers.mla import MLA
from zoo.layers.moe import (
    BACKENDS,
    EP_DISPATCHES,
    Experts,
    GroupLimitedRouter,
    MoE,
    backend_choice,
    check_routing,
    resolve_backend,
    total_balance_loss,
    update_routing_bias,
)
from zoo.layers.tagged import TaggedLayer
from zoo.models.config import LMConfig, check_non_negative, check_positive, check_positive_float
from zoo.models.lm import CausalLM
from zoo.recipe import Recipe

__all__ = ["DeepSeekV3Config", "DeepSeekV3", "deepseek_v3", "total_balance_loss", "update_routing_bias"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSeekV3Config(LMConfig):
    # from LMConfig: vocab_size, dim, num_layers, tie_embeddings, dtype, param_dtype, attention_impl
    first_dense_layers: int            # transformers: first_k_dense_replace
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mlp_dim: int                       # the dense layers' FFN
    num_experts: int                   # routed experts
    num_experts_per_tok: int
    moe_mlp_dim: int                   # each routed (and shared) expert's hidden size
    num_shared_experts: int = 1
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = YarnScaling()
    rope_interleave: bool = True       # rope columns stored in interleaved pairs, as published (see mla.py)
    norm_eps: float = 1e-6
    moe_backend: str = "auto"          # "ragged_dot" | "tokamax" | "capacity" | "auto" (see zoo.layers.moe)
    capacity_factor: float = 1.25      # capacity dispatch only
    ep_dispatch: str = "gather"        # dropless backends under a mesh: "gather" | "ragged_a2a" (expert parallelism)
    balance_loss_weight: float = 1e-4  # the sequence-wise balance loss's alpha

    def check(self):
        name = type(self).__name__
        check_positive(self, "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                       "v_head_dim", "mlp_dim", "num_experts", "num_experts_per_tok", "moe_mlp_dim", "n_group",
                       "topk_group")
        check_positive_float(self, "rope_theta", "routed_scaling_factor", "capacity_factor")
        check_non_negative(self, "first_dense_layers", "num_shared_experts", "balance_loss_weight")
        if self.first_dense_layers > self.num_layers:
            raise ValueError(f"{name}.first_dense_layers={self.first_dense_layers} must be at most "
                             f"num_layers={self.num_layers}")
        check_routing(num_experts=self.num_experts, k=self.num_experts_per_tok, n_group=self.n_group,
                      topk_group=self.topk_group, where=name)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{name}.qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.moe_backend not in BACKENDS:
            raise ValueError(f"{name}.moe_backend must be one of {BACKENDS}, got {self.moe_backend!r}")
        if self.ep_dispatch not in EP_DISPATCHES:
            raise ValueError(f"{name}.ep_dispatch must be one of {EP_DISPATCHES}, got {self.ep_dispatch!r}")
        try:
            resolve_backend(self.moe_backend, ep_dispatch=self.ep_dispatch)
        except ValueError as e:
            raise ValueError(f"{name}.moe_backend: {e}") from None

    # -- presets (published sizes) ------------------------------------------------------------------------
    @classmethod
    def deepseek_v3_671b(cls, **overrides) -> DeepSeekV3Config:
        """DeepSeek-V3 / R1: 61 layers (3 dense), 256 experts top-8 in 8 groups (4 kept), 1 shared expert."""
        return cls(**{**dict(vocab_size=129280, dim=7168, num_layers=61, first_dense_layers=3, num_heads=128,
                             q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, mlp_dim=18432, num_experts=256, num_experts_per_tok=8,
                             moe_mlp_dim=2048, num_shared_experts=1, n_group=8, topk_group=4), **overrides})

    @classmethod
    def tiny(cls, **overrides) -> DeepSeekV3Config:
        """Four layers (two dense, so that both stacks scan) in float32 with every DeepSeek-V3 mechanism, for
        tests and CPU runs. Sizes are chosen so that no two tags of a layer have the same shape."""
        return cls(**{**dict(vocab_size=256, dim=64, num_layers=4, first_dense_layers=2, num_heads=4,
                             q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                             v_head_dim=16, mlp_dim=128, num_experts=8, num_experts_per_tok=2, moe_mlp_dim=40,
                             num_shared_experts=1, n_group=4, topk_group=2, moe_backend="ragged_dot",
                             dtype="float32", param_dtype="float32"), **overrides})

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    def attention_head_dim(self) -> int:
        """MLA's q/k head dim and value head dim, padded to the larger (see zoo.layers.mla)."""
        return max(self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim)

    def kernel_choices(self, device) -> dict[str, str]:
        name, why = backend_choice(self.moe_backend, dtype=self.compute_dtype, device=device,
                                   ep_dispatch=self.ep_dispatch)
        out = {"moe backend": f"{name} ({why})"}
        if self.ep_dispatch != "gather":
            out["ep dispatch"] = f"{self.ep_dispatch} (asked for)"
        return out

    def mesh_divisors(self) -> tuple[tuple[str, str], ...]:
        return ((("tp", "num_heads"), ("tp", "mlp_dim"), ("tp", "moe_mlp_dim"), ("ep", "num_experts"))
                + super().mesh_divisors())

    def rope(self) -> Rope:
        return Rope(dim=self.qk_rope_head_dim, theta=self.rope_theta, scaling=self.rope_scaling)


class DeepSeekDecoderLayer(TaggedLayer):
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
            self.mlp = MLP(dim=cfg.dim, hidden=cfg.mlp_dim, rngs=rngs, **common)
        self.moe = moe

    def __call__(self, x: jax.Array):
        x = x + self.attn(self.attn_norm(x))
        if not self.moe:
            return x + self.mlp(self.mlp_norm(x))
        y, aux = self.mlp(self.mlp_norm(x))
        return x + y, aux


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
        super().__init__(cfg, stacks=stacks, recipe=recipe, rngs=rngs)


def deepseek_v3(cfg: DeepSeekV3Config, *, recipe: Recipe | None = None, rngs: nnx.Rngs) -> DeepSeekV3:
    """Build DeepSeek-V3. `recipe` (default: `Recipe.none()`) decides each tag's placement in both stacks."""
    return DeepSeekV3(cfg, recipe=recipe, rngs=rngs)
