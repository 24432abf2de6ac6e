"""The Llama 3.1 family: `LlamaConfig` (config.py), the model (model.py), the Hugging Face mapping (hf.py), and
its `Family` record (with training.py's step rates and training defaults), registered when this package is imported."""
from flax import nnx

from zoo.models import gqa, registry
from zoo.models.llama3 import hf, training
from zoo.models.llama3.config import LlamaConfig
from zoo.models.llama3.model import Llama, LlamaDecoderLayer, llama3

__all__ = ["FAMILY", "Llama", "LlamaConfig", "LlamaDecoderLayer", "flops_per_token", "llama3"]


# the family's FLOPs and its record: its own, alike in shape to the other families'
def flops_per_token(cfg: LlamaConfig, model: nnx.Module, seq: int) -> float:
    """A dense GQA decoder's training FLOPs per token: 6 N plus causal attention (`zoo.models.gqa`)."""
    return gqa.dense_flops_per_token(cfg, model, seq)


FAMILY = registry.register(registry.Family(
    "llama3", LlamaConfig, llama3,
    registry.HFArch(hf.ARCHITECTURE, hf.MODEL_TYPE, hf.from_hf, hf.to_hf, hf.keys),
    flops_per_token, step_rates=training.STEP_RATES, train_defaults=training.TRAIN_DEFAULTS))
