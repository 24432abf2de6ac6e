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
    """One DeepSeek-V3 decoder layer (arXiv:2412.19437): x += MLA(RMSNorm(x)); x += FFN(RMSNorm(x)), the FFN a
    dense SwiGLU or, with `moe=True`, DeepSeekMoE (`deepseek_moe`), which also returns its aux.

    Args:
        cfg: the model's `DeepSeekV3Config`.
        moe: whether the FFN is the mixture of experts (which also returns its aux).
        rngs: the random generators of the parameters' initialization.

    Emits:
        `query_wa_proj`, `mla_q`, `kv_wa_proj`, `mla_kv`, `query_proj`, `key_proj`, `value_proj`, `attention_out`,
        `context`, `out_proj` (`zoo.layers.MLA`); `mlpwi_0`, `mlpwi_1`, `mlpwo`, or with `moe=True` `moe_mlpwi_0`,
        `moe_mlpwi_1`, `moe_mlpwo`, `shared_mlpwi_0`, `shared_mlpwi_1`, `shared_mlpwo`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from zoo.models.deepseek_v3 import DeepSeekDecoderLayer, DeepSeekV3Config
        >>> layer = DeepSeekDecoderLayer(DeepSeekV3Config.preset("tiny"), moe=False, rngs=nnx.Rngs(0))
        >>> layer(jnp.ones((1, 8, layer.dim))).shape == (1, 8, layer.dim)
        True
    """

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
    """DeepSeekMoE as DeepSeek-V3 configures it (arXiv:2412.19437, 2.1.2): `GroupLimitedRouter` (sigmoid affinities,
    group-limited top-k, the routing bias), the routed `Experts`, and `num_shared_experts` shared experts as one
    `MLP(tag_prefix="shared_")` of num_shared_experts * moe_mlp_dim.

    Args:
        cfg: the model's `DeepSeekV3Config`.
        rngs: the random generators of the parameters' initialization.

    Returns:
        the `zoo.layers.MoE`.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models.deepseek_v3 import DeepSeekV3Config, deepseek_moe
        >>> moe = deepseek_moe(DeepSeekV3Config.preset("tiny"), rngs=nnx.Rngs(0))
        >>> type(moe.gate).__name__, moe.experts.num_experts
        ('GroupLimitedRouter', 8)
    """
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
    """DeepSeek-V3 (DeepSeek-AI, 2024, arXiv:2412.19437): the embedding, `first_dense_layers` dense layers (the stack
    `dense_layers`), the DeepSeekMoE layers (`moe_layers`), a final RMSNorm, the LM head, and with `mtp_depths` > 0
    the multi-token prediction head (`mtp`). Training adds `total_balance_loss(aux)` and calls
    `update_routing_bias(model, aux, rate)` after each step.

    Args:
        cfg: the model's `DeepSeekV3Config` (a preset: `DeepSeekV3Config.preset(name)`).
        recipe: the placement of each tag (a `zoo.Recipe`; default `Recipe.none()`: everything kept in HBM).
        rngs: the random generators of the parameters' initialization.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models import DeepSeekV3, DeepSeekV3Config
        >>> model = nnx.eval_shape(lambda: DeepSeekV3(DeepSeekV3Config.preset("tiny"), rngs=nnx.Rngs(0)))
        >>> type(model).__name__, list(model.stack_names)
        ('DeepSeekV3', ['dense_layers', 'moe_layers'])
    """
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
    """Build a DeepSeek-V3 model: `DeepSeekV3(cfg, recipe=recipe, rngs=rngs)` (`zoo.models.deepseek_v3`).

    Args:
        cfg: the model's `DeepSeekV3Config`.
        recipe: the placement of each tag (a `zoo.Recipe`; default `Recipe.none()`).
        rngs: the random generators of the parameters' initialization.

    Returns:
        the `DeepSeekV3`.

    Examples:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import zoo
        >>> model = zoo.models.deepseek_v3(zoo.models.DeepSeekV3Config.preset("tiny"), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((1, 8), jnp.int32)).shape[:2]
        (1, 8)
    """
    return DeepSeekV3(cfg, recipe=recipe, rngs=rngs)
