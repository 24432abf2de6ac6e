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
    """The training FLOPs per token of DeepSeek-V3 (DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report"): 6 N_active,
    for the non-embedding parameters a token uses (every MoE layer's routed experts less the `num_experts -
    num_experts_per_tok` it is not routed to; Kaplan et al., 2020's 6 N), plus causal multi-head latent attention's
    QK^T and PV over half the keys, forward and backward; with multi-token prediction, each depth's layer, its
    projection and the shared LM head once more. The family's `Family` record reads it for the MFU and the planner.

    Args:
        cfg: the model's `DeepSeekV3Config`.
        model: the `DeepSeekV3` built from `cfg` (an `nnx.eval_shape` one will do: only its parameters' shapes count).
        seq: the sequence length the attention term is taken at.

    Returns:
        the FLOPs of one token's forward and backward pass, as a float.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models import DeepSeekV3Config
        >>> from zoo.models.lm import non_embedding_params
        >>> from zoo.models.deepseek_v3 import deepseek_v3, flops_per_token
        >>> cfg = DeepSeekV3Config.preset("tiny")
        >>> model = nnx.eval_shape(lambda: deepseek_v3(cfg, rngs=nnx.Rngs(0)))
        >>> flops_per_token(cfg, model, 8) < 6 * non_embedding_params(model)   # the idle experts do no work
        True
    """
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
