"""The Llama 3.1 family: `LlamaConfig` (config.py), the model (model.py), the Hugging Face mapping (hf.py), and
its `Family` record (with training.py's step rates and training defaults), registered when this package is imported."""
from flax import nnx

from zoo.layers.attention_kernel import causal_attention_flops
from zoo.models import registry
from zoo.models.llama3 import hf, training
from zoo.models.llama3.config import LlamaConfig
from zoo.models.llama3.model import Llama, LlamaDecoderLayer, llama3
from zoo.models.lm import non_embedding_params

__all__ = ["FAMILY", "Llama", "LlamaConfig", "LlamaDecoderLayer", "flops_per_token", "llama3"]


def flops_per_token(cfg: LlamaConfig, model: nnx.Module, seq: int) -> float:
    """6 N (forward 2N, backward 4N) plus causal attention: QK^T and PV over half the keys, times 3."""
    # forward and backward (3x) of one sequence of `seq` tokens, per token
    attention = 3 * causal_attention_flops(1, seq, cfg.num_heads, cfg.head_dim, cfg.head_dim) / seq * cfg.num_layers
    return 6 * non_embedding_params(model) + attention


FAMILY = registry.register(registry.Family(
    "llama3", LlamaConfig, llama3,
    registry.HFArch(hf.ARCHITECTURE, hf.MODEL_TYPE, hf.from_hf, hf.to_hf, hf.keys),
    flops_per_token, step_rates=training.STEP_RATES, train_defaults=training.TRAIN_DEFAULTS))
