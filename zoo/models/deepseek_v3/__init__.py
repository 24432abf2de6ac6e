"""The DeepSeek-V3 family: `DeepSeekV3Config` (config.py), the model (model.py), the Hugging Face mapping (hf.py),
and its `Family` record (FLOPs, the balance loss, the routing-bias update; training.py's step rates and training
defaults), registered when this package is imported."""
import jax
from flax import nnx

from zoo.layers.attention_kernel import causal_attention_flops
from zoo.layers.moe import total_balance_loss, update_routing_bias
from zoo.models import registry
from zoo.models.deepseek_v3 import hf, training
from zoo.models.deepseek_v3.config import DeepSeekV3Config
from zoo.models.deepseek_v3.model import DeepSeekDecoderLayer, DeepSeekV3, deepseek_moe, deepseek_v3
from zoo.models.lm import non_embedding_params

__all__ = ["FAMILY", "ROUTING_BIAS_RATE", "DeepSeekDecoderLayer", "DeepSeekV3", "DeepSeekV3Config", "deepseek_moe",
           "deepseek_v3", "flops_per_token", "total_balance_loss", "update_routing_bias"]

# DeepSeek-V3's bias update speed (gamma): 0.001 for most of its pre-training (the technical report, 4.2).
ROUTING_BIAS_RATE = 1e-3


def flops_per_token(cfg: DeepSeekV3Config, model: nnx.Module, seq: int) -> float:
    """6 N_active (the routed experts a token does not visit excluded) plus causal MLA attention; with multi-token
    prediction, its MoE layers and projections, and the shared head once more per depth."""
    idle_experts = cfg.num_experts - cfg.num_experts_per_tok
    moe_layers = cfg.num_moe_layers + cfg.mtp_depths
    n = non_embedding_params(model) - moe_layers * idle_experts * 3 * cfg.dim * cfg.moe_mlp_dim
    n += cfg.mtp_depths * cfg.vocab_size * cfg.dim
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    per_layer = 3 * causal_attention_flops(1, seq, cfg.num_heads, qk, cfg.v_head_dim) / seq   # fwd + bwd, per token
    attention = per_layer * (cfg.num_layers + cfg.mtp_depths)
    return 6 * n + attention


def aux_loss(cfg: DeepSeekV3Config, aux: dict) -> jax.Array:
    """The sequence-wise balance loss of every MoE layer (already times cfg.balance_loss_weight)."""
    return total_balance_loss(aux)


def after_update(model: nnx.Module, aux: dict) -> None:
    """The auxiliary-loss-free balance: move each routing bias towards the under-loaded experts."""
    update_routing_bias(model, aux, ROUTING_BIAS_RATE)


FAMILY = registry.register(registry.Family(
    "deepseek_v3", DeepSeekV3Config, deepseek_v3,
    registry.HFArch(hf.ARCHITECTURE, hf.MODEL_TYPE, hf.from_hf, hf.to_hf, hf.keys, hf.mtp_keys),
    flops_per_token, aux_loss=aux_loss, after_update=after_update, step_rates=training.STEP_RATES,
    train_defaults=training.TRAIN_DEFAULTS))
