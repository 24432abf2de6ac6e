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
    """The training FLOPs per token of a dense GQA decoder: 6 N for the N non-embedding parameters (forward 2 N,
    backward 4 N; Kaplan et al., 2020, "Scaling Laws for Neural Language Models"), plus causal attention's QK^T and PV
    over half the keys, forward and backward (`zoo.models.gqa`). The family's `Family` record reads it for the MFU and
    the planner's step time.

    Args:
        cfg: the model's `LlamaConfig`.
        model: the `Llama` built from `cfg` (an `nnx.eval_shape` one will do: only its parameters' shapes count).
        seq: the sequence length the attention term is taken at.

    Returns:
        the FLOPs of one token's forward and backward pass, as a float.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models import LlamaConfig
        >>> from zoo.models.lm import non_embedding_params
        >>> from zoo.models.llama3 import flops_per_token, llama3
        >>> cfg = LlamaConfig.preset("tiny")
        >>> model = nnx.eval_shape(lambda: llama3(cfg, rngs=nnx.Rngs(0)))
        >>> flops_per_token(cfg, model, 8) > 6 * non_embedding_params(model)   # 6 N, plus attention
        True
    """
    return gqa.dense_flops_per_token(cfg, model, seq)


FAMILY = registry.register(registry.Family(
    "llama3", LlamaConfig, llama3,
    registry.HFArch(hf.ARCHITECTURE, hf.MODEL_TYPE, hf.from_hf, hf.to_hf, hf.keys),
    flops_per_token, step_rates=training.STEP_RATES, train_defaults=training.TRAIN_DEFAULTS))
