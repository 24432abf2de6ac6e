"""`Qwen3MoeConfig` and its sizes: Qwen3-30B-A3B and Qwen3-235B-A22B as published, and a tiny one for tests and CPU
runs. The presets count the published checkpoints' parameters: 30,532,122,624 and 235,093,634,560."""
from __future__ import annotations

import dataclasses

from zoo.models import gqa
from zoo.models.config import MoEConfig
from zoo.models.fields import check_positive


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(gqa.GQAConfig, MoEConfig):
    # from LMConfig: vocab_size, dim, num_layers, tie_embeddings, dtype, param_dtype, attention_impl
    # from MoEConfig: num_experts, num_experts_per_tok, moe_mlp_dim, norm_topk_prob, moe_backend, capacity_factor
    """Qwen3's mixture-of-experts models (Qwen Team, 2025): Qwen3's GQA attention (`GQAConfig`'s fields) and, in the
    layers `decoder_sparse_step` and `mlp_only_layers` choose, routed experts with softmax top-k routing and the
    Switch Transformer's balance loss (`MoEConfig`'s fields). `PRESETS`: qwen3_30b_a3b, qwen3_235b_a22b, and tiny.

    Args:
        decoder_sparse_step: layer i has experts when (i + 1) % decoder_sparse_step == 0 ...
        mlp_only_layers: ... and i is not listed here.
        norm_eps: every RMSNorm's eps.
        balance_loss_weight: the balance loss's weight (transformers' router_aux_loss_coef).

    Examples:
        >>> from zoo.models import Qwen3MoeConfig
        >>> cfg = Qwen3MoeConfig.preset("qwen3_30b_a3b")
        >>> cfg.num_experts, cfg.num_experts_per_tok
        (128, 8)
    """
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int                       # the dense layers' FFN (transformers: intermediate_size)
    decoder_sparse_step: int = 1       # layer i has experts when (i + 1) % decoder_sparse_step == 0 ...
    mlp_only_layers: tuple = ()        # ... and i is not listed here
    rope_theta: float = 1000000.0
    norm_eps: float = 1e-6
    balance_loss_weight: float = 1e-3  # transformers: router_aux_loss_coef (Switch Transformer's balance loss)

    PRESETS = {
        "qwen3_30b_a3b": dict(max_seq_len=40960,
                              vocab_size=151936, dim=2048, num_layers=48, num_heads=32, num_kv_heads=4,
                              head_dim=128, mlp_dim=6144, num_experts=128, num_experts_per_tok=8, moe_mlp_dim=768),
        "qwen3_235b_a22b": dict(max_seq_len=40960,
                                vocab_size=151936, dim=4096, num_layers=94, num_heads=64, num_kv_heads=4,
                                head_dim=128, mlp_dim=12288, num_experts=128, num_experts_per_tok=8,
                                moe_mlp_dim=1536),
        # four layers in float32, the first two dense (both kinds of layer, each stack scanning); sizes chosen so
        # that no two tags of a layer have the same shape
        "tiny": dict(vocab_size=256, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=96,
                     num_experts=8, num_experts_per_tok=2, moe_mlp_dim=40, mlp_only_layers=(0, 1),
                     moe_backend="ragged_dot", dtype="float32", param_dtype="float32"),
    }

    def check(self):
        super().check()   # the experts' and the attention's (gqa.GQAConfig)
        name = type(self).__name__
        check_positive(self, "decoder_sparse_step")
        bad = [i for i in self.mlp_only_layers if isinstance(i, bool) or not isinstance(i, int)
               or not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"{name}.mlp_only_layers must hold layer indices in [0, {self.num_layers}), got {bad}")

    def has_experts(self, layer: int) -> bool:
        """Whether layer `layer` (0-based) is a mixture of experts (else a dense SwiGLU), as transformers decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def layer_runs(self) -> list[tuple[bool, range]]:
        """The layers as runs of one kind, in order: [(has experts, layer indices)]; each run is one scanned stack."""
        runs: list[tuple[bool, range]] = []
        for i in range(self.num_layers):
            if runs and runs[-1][0] == self.has_experts(i):
                runs[-1] = (runs[-1][0], range(runs[-1][1].start, i + 1))
            else:
                runs.append((self.has_experts(i), range(i, i + 1)))
        return runs
