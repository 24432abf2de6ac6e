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
    """The training FLOPs per token of a dense GQA decoder: 6 N for the N non-embedding parameters (forward 2 N,
    backward 4 N; Kaplan et al., 2020, "Scaling Laws for Neural Language Models"), plus causal attention's QK^T and PV
    over half the keys, forward and backward (`zoo.models.gqa`). The family's `Family` record reads it for the MFU and
    the planner's step time.

    Args:
        cfg: the model's `Qwen3Config`.
        model: the `Qwen3` built from `cfg` (an `nnx.eval_shape` one will do: only its parameters' shapes count).
        seq: the sequence length the attention term is taken at.

    Returns:
        the FLOPs of one token's forward and backward pass, as a float.

    Examples:
        >>> from flax import nnx
        >>> from zoo.models import Qwen3Config
        >>> from zoo.models.lm import non_embedding_params
        >>> from zoo.models.qwen3 import flops_per_token, qwen3
        >>> cfg = Qwen3Config.preset("tiny")
        >>> model = nnx.eval_shape(lambda: qwen3(cfg, rngs=nnx.Rngs(0)))
        >>> flops_per_token(cfg, model, 8) > 6 * non_embedding_params(model)   # 6 N, plus attention
        True
    """
    return gqa.dense_flops_per_token(cfg, model, seq)


FAMILY = registry.register(registry.Family(
    "qwen3", Qwen3Config, qwen3,
    registry.HFArch(hf.ARCHITECTURE, hf.MODEL_TYPE, hf.from_hf, hf.to_hf, hf.keys),
    flops_per_token, step_rates=training.STEP_RATES))
