"""The Llama 3.1 family: `LlamaConfig` (config.py), the model (model.py), the Hugging Face mapping (hf.py), and
its `Family` record (with training.py's step rates and training defaults), registered when this package is imported."""
from zoo.models import gqa, registry
from zoo.models.llama3 import hf, training
from zoo.models.llama3.config import LlamaConfig
from zoo.models.llama3.model import Llama, LlamaDecoderLayer, llama3

__all__ = ["FAMILY", "Llama", "LlamaConfig", "LlamaDecoderLayer", "flops_per_token", "llama3"]


flops_per_token = gqa.dense_flops_per_token   # 6 N plus causal attention (zoo.models.gqa)

FAMILY = registry.register(registry.Family(
    "llama3", LlamaConfig, llama3,
    registry.HFArch(hf.ARCHITECTURE, hf.MODEL_TYPE, hf.from_hf, hf.to_hf, hf.keys),
    flops_per_token, step_rates=training.STEP_RATES, train_defaults=training.TRAIN_DEFAULTS))
