"""The Qwen3 family (the dense models): `Qwen3Config` (config.py), the model (model.py), the Hugging Face mapping
(hf.py), and its `Family` record (FLOPs, with training.py's step rates), registered when this package is imported.
Its report publishes no learning-rate schedule (the main job takes the generic defaults)."""
from flax import nnx

from zoo.layers.attention_kernel import causal_attention_flops
from zoo.models import registry
from zoo.models.lm import non_embedding_params
from zoo.models.qwen3 import hf, training
from zoo.models.qwen3.config import Qwen3Config
from zoo.models.qwen3.model import Qwen3, Qwen3DecoderLayer, qwen3

__all__ = ["FAMILY", "Qwen3", "Qwen3Config", "Qwen3DecoderLayer", "flops_per_token", "qwen3"]


def flops_per_token(cfg: Qwen3Config, model: nnx.Module, seq: int) -> float:
    """6 N (forward 2N, backward 4N) plus causal attention: QK^T and PV over half the keys, times 3."""
    # forward and backward (3x) of one sequence of `seq` tokens, per token
    attention = 3 * causal_attention_flops(1, seq, cfg.num_heads, cfg.head_dim, cfg.head_dim) / seq * cfg.num_layers
    return 6 * non_embedding_params(model) + attention


FAMILY = registry.register(registry.Family(
    "qwen3", Qwen3Config, qwen3,
    registry.HFArch(hf.ARCHITECTURE, hf.MODEL_TYPE, hf.from_hf, hf.to_hf, hf.keys),
    flops_per_token, step_rates=training.STEP_RATES))
