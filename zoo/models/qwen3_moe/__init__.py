"""The Qwen3-MoE family: `Qwen3MoeConfig` (config.py), the model (model.py), the Hugging Face mapping (hf.py), and
its `Family` record (FLOPs, the balance loss), registered when this package is imported."""
import jax
from flax import nnx

from zoo.layers.attention_kernel import causal_attention_flops
from zoo.layers.moe import total_balance_loss
from zoo.models import registry
from zoo.models.lm import non_embedding_params
from zoo.models.qwen3_moe import hf
from zoo.models.qwen3_moe.config import Qwen3MoeConfig
from zoo.models.qwen3_moe.model import Qwen3Moe, Qwen3MoeDecoderLayer, qwen3_moe

__all__ = ["FAMILY", "Qwen3Moe", "Qwen3MoeConfig", "Qwen3MoeDecoderLayer", "flops_per_token", "qwen3_moe"]


def flops_per_token(cfg: Qwen3MoeConfig, model: nnx.Module, seq: int) -> float:
    """The training FLOPs per token of a Qwen3-MoE decoder: 6 N_active, for the non-embedding parameters a token
    uses (every MoE layer's routed experts less the `num_experts - num_experts_per_tok` it is not routed to; Kaplan
    et al., 2020's 6 N, forward 2 N and backward 4 N), plus causal attention's QK^T and PV over half the keys, forward
    and backward. The family's `Family` record reads it for the MFU and the planner's step time.

    Args:
        cfg: the model's `Qwen3MoeConfig`.
        model: the `Qwen3Moe` built from `cfg` (an `nnx.eval_shape` one will do: only its parameters' shapes count).
        seq: the sequence length the attention term is taken at.

    Returns:
        the FLOPs of one token's forward and backward pass, as a float.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models import Qwen3MoeConfig
        >>> from zoo.models.lm import non_embedding_params
        >>> from zoo.models.qwen3_moe import flops_per_token, qwen3_moe
        >>> cfg = Qwen3MoeConfig.preset("tiny")
        >>> model = nnx.eval_shape(lambda: qwen3_moe(cfg, rngs=nnx.Rngs(0)))
        >>> flops_per_token(cfg, model, 8) < 6 * non_embedding_params(model)   # the idle experts do no work
        True
    """
    moe_layers = sum(len(layers) for moe, layers in cfg.layer_runs() if moe)
    idle = moe_layers * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.dim * cfg.moe_mlp_dim
    # forward and backward (3x) of one sequence of `seq` tokens, per token
    attention = 3 * causal_attention_flops(1, seq, cfg.num_heads, cfg.head_dim, cfg.head_dim) / seq * cfg.num_layers
    return 6 * (non_embedding_params(model) - idle) + attention


def aux_loss(cfg: Qwen3MoeConfig, aux: dict) -> jax.Array:
    """Every MoE layer's Switch balance loss (already times cfg.balance_loss_weight, router_aux_loss_coef), of the
    tokens of one forward pass: with `--grad-accum K` the mean of the K micro-batches' losses, not the whole
    batch's (`zoo.layers.moe.router.switch_balance_loss` says why)."""
    return total_balance_loss(aux)


FAMILY = registry.register(registry.Family(
    "qwen3_moe", Qwen3MoeConfig, qwen3_moe,
    registry.HFArch(hf.ARCHITECTURE, hf.MODEL_TYPE, hf.from_hf, hf.to_hf, hf.keys),
    flops_per_token, aux_loss=aux_loss))
