"""`LlamaConfig` and its sizes: Llama 3.1 8B, 70B and 405B as published, and a tiny one for tests and CPU runs."""
from __future__ import annotations

import dataclasses

from zoo.layers import WavelengthScaling
from zoo.models import gqa
from zoo.models.config import LMConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(gqa.GQAConfig, LMConfig):
    """Llama 3.1 (Grattafiori et al., 2024, "The Llama 3 Herd of Models"): a GQA decoder (`GQAConfig`'s fields) with
    RoPE at theta 500000 and Llama 3.1's wavelength scaling. `PRESETS`: llama3_1_8b, llama3_1_70b, llama3_1_405b as
    published, and tiny (two float32 layers, for tests and CPU runs).

    Args:
        rope_scaling: RoPE's frequency scaling (`zoo.layers.WavelengthScaling`; None: none).

    Examples:
        >>> from zoo.models import LlamaConfig
        >>> cfg = LlamaConfig.preset("llama3_1_8b")
        >>> cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        (32, 8, 128)
    """
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    rope_theta: float = 500000.0
    rope_scaling: WavelengthScaling | None = WavelengthScaling()
    # from LMConfig: vocab_size, dim, num_layers, norm_eps (1e-5), tie_embeddings, dtype, param_dtype, attention_impl

    # the published sizes, one row each (a table: the other families' repeat its shape)
    PRESETS = {
        "llama3_1_8b": dict(max_seq_len=131072,
                            vocab_size=128256, dim=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                            mlp_dim=14336),
        "llama3_1_70b": dict(max_seq_len=131072,
                             vocab_size=128256, dim=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
                             mlp_dim=28672),
        "llama3_1_405b": dict(max_seq_len=131072,
                              vocab_size=128256, dim=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                              head_dim=128, mlp_dim=53248),
        # a few layers in float32, for tests and CPU runs
        "tiny": dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                     dtype="float32", param_dtype="float32"),
    }
