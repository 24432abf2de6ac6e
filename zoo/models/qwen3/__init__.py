"""The Qwen3 family (the dense models): `Qwen3Config` (config.py), the model (model.py), the Hugging Face mapping
(hf.py), and its `Family` record (FLOPs, with training.py's step rates), registered when this package is imported.
Its report publishes no learning-rate schedule (the main job takes the generic defaults)."""
from flax import nnx

from zoo.models import gqa, registry
from zoo.models.qwen3 import hf, training
from zoo.models.qwen3.config import Qwen3Config
from zoo.models.qwen3.model import Qwen3, Qwen3DecoderLayer, qwen3

__all__ = ["FAMILY", "Qwen3", "Qwen3Config", "Qwen3DecoderLayer", "flops_per_token", "qwen3"]


# the family's FLOPs and its record: its own, alike in shape to the other families'
def flops_per_token(cfg: Qwen3Config, model: nnx.Module, seq: int) -> float:
    """A dense GQA decoder's training FLOPs per token: 6 N plus causal attention (`zoo.models.gqa`)."""
    return gqa.dense_flops_per_token(cfg, model, seq)


FAMILY = registry.register(registry.Family(
    "qwen3", Qwen3Config, qwen3,
    registry.HFArch(hf.ARCHITECTURE, hf.MODEL_TYPE, hf.from_hf, hf.to_hf, hf.keys),
    flops_per_token, step_rates=training.STEP_RATES))
