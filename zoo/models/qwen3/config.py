"""`Qwen3Config` and its sizes: Qwen3-8B and Qwen3-32B as published, and a tiny one for tests and CPU runs. The
presets count the published checkpoints' parameters: 8,190,735,360 and 32,762,123,264."""
from __future__ import annotations

import dataclasses

from zoo.models import gqa
from zoo.models.config import LMConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config(gqa.GQAConfig, LMConfig):
    # from LMConfig: vocab_size, dim, num_layers, tie_embeddings, dtype, param_dtype, attention_impl, mlp_seq_chunks
    """The dense Qwen3 models (Qwen Team, 2025, "Qwen3 Technical Report"): a GQA decoder (`GQAConfig`'s fields) with an
    RMSNorm over each query and key head, RoPE at theta 1e6, `head_dim` independent of `dim`. `PRESETS`: qwen3_8b,
    qwen3_32b as published, and tiny.

    Args:
        norm_eps: every RMSNorm's eps, the per-head q/k norms' included.

    Examples:
        >>> from zoo.models import Qwen3Config
        >>> Qwen3Config.preset("qwen3_32b").head_dim * Qwen3Config.preset("qwen3_32b").num_heads
        8192
    """
    num_heads: int
    num_kv_heads: int
    head_dim: int                      # independent of dim (Qwen3-32B: 64 x 128 = 8192 against dim 5120)
    mlp_dim: int                       # the SwiGLU's hidden size (transformers: intermediate_size)
    rope_theta: float = 1000000.0
    norm_eps: float = 1e-6             # every RMSNorm's, the per-head q/k norms' included

    # the published sizes, one row each (a table: the other families' repeat its shape)
    PRESETS = {
        "qwen3_8b": dict(max_seq_len=40960,
                         vocab_size=151936, dim=4096, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                         mlp_dim=12288),
        "qwen3_32b": dict(max_seq_len=40960,
                          vocab_size=151936, dim=5120, num_layers=64, num_heads=64, num_kv_heads=8, head_dim=128,
                          mlp_dim=25600),
        # two layers in float32, for tests and CPU runs; head_dim x heads (64) differs from neither dim nor the
        # kv width, so that a mixed-up projection shape fails
        "tiny": dict(vocab_size=256, dim=48, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96,
                     dtype="float32", param_dtype="float32"),
    }
