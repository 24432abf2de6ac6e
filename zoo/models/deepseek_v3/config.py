"""`DeepSeekV3Config` and its sizes: DeepSeek-V3 671B as published (without the multi-token-prediction module:
`mtp_depths=1` adds it as the checkpoint has it), and a tiny one for tests and CPU runs."""
from __future__ import annotations

import dataclasses

from zoo.layers import Rope, YarnScaling
from zoo.layers.moe import check_routing
from zoo.models.config import MoEConfig
from zoo.models.fields import check_non_negative, check_positive, check_positive_float


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSeekV3Config(MoEConfig):
    # from LMConfig: vocab_size, dim, num_layers, tie_embeddings, dtype, param_dtype, attention_impl
    """DeepSeek-V3 (DeepSeek-AI, 2024, arXiv:2412.19437): MLA attention (DeepSeek-V2, arXiv:2405.04434), dense FFNs in
    the first layers and DeepSeekMoE (fine-grained routed experts, shared experts, group-limited sigmoid routing with
    auxiliary-loss-free balancing) in the rest, optionally multi-token prediction. `MoEConfig`'s fields, and:

    Args:
        first_dense_layers: the first layers with a dense FFN (transformers' first_k_dense_replace).
        num_heads: the attention heads.
        q_lora_rank: the query latent's width.
        kv_lora_rank: the key/value latent's width.
        qk_nope_head_dim: the per-head q/k width without position.
        qk_rope_head_dim: the per-head q/k width RoPE rotates.
        v_head_dim: the per-head value width.
        mlp_dim: the dense layers' FFN width.
        num_shared_experts: the shared experts (each of moe_mlp_dim).
        n_group: the groups the routed experts are split into.
        topk_group: the groups each token may choose from.
        routed_scaling_factor: the factor on the routing weights.
        rope_theta: RoPE's base.
        rope_scaling: YaRN (`zoo.layers.YarnScaling`) or None.
        rope_interleave: whether the checkpoint's rope columns are interleaved pairs (as published).
        norm_eps: every RMSNorm's eps.
        mtp_depths: the multi-token prediction depths (0: off; the report's 2.2).
        mtp_lambda: the weight of their mean loss.

    Examples:
        >>> from zoo.models import DeepSeekV3Config
        >>> cfg = DeepSeekV3Config.preset("deepseek_v3_671b")
        >>> cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        (256, 8, 8, 4)
    """
    first_dense_layers: int            # transformers: first_k_dense_replace
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    mlp_dim: int                       # the dense layers' FFN
    num_shared_experts: int = 1        # each of moe_mlp_dim
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    rope_theta: float = 10000.0
    rope_scaling: YarnScaling | None = YarnScaling()
    rope_interleave: bool = True       # rope columns stored in interleaved pairs, as published (see mla.py)
    norm_eps: float = 1e-6
    # Multi-token prediction (the technical report, 2.2): `mtp_depths` extra depths, depth k predicting the token
    # k + 1 positions after the next (0: off; the published checkpoints carry one, transformers'
    # num_nextn_predict_layers). `mtp_lambda` weights their mean loss: 0.3 for the report's first 10T tokens,
    # lowered to 0.1 for the rest of its pre-training.
    mtp_depths: int = 0
    mtp_lambda: float = 0.3
    # from MoEConfig: num_experts, num_experts_per_tok, moe_mlp_dim, norm_topk_prob, moe_backend, capacity_factor,
    # balance_loss_weight (the sequence-wise balance loss's alpha, 1e-4)

    PRESETS = {
        # DeepSeek-V3 / R1: 61 layers (3 dense), 256 experts top-8 in 8 groups (4 kept), 1 shared expert
        "deepseek_v3_671b": dict(max_seq_len=163840,
                                 vocab_size=129280, dim=7168, num_layers=61, first_dense_layers=3, num_heads=128,
                                 q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128, mlp_dim=18432, num_experts=256, num_experts_per_tok=8,
                                 moe_mlp_dim=2048, num_shared_experts=1, n_group=8, topk_group=4),
        # four layers (two dense, so that both stacks scan) in float32 with every DeepSeek-V3 mechanism, for tests
        # and CPU runs; sizes chosen so that no two tags of a layer have the same shape
        "tiny": dict(vocab_size=256, dim=64, num_layers=4, first_dense_layers=2, num_heads=4, q_lora_rank=32,
                     kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, mlp_dim=128,
                     num_experts=8, num_experts_per_tok=2, moe_mlp_dim=40, num_shared_experts=1, n_group=4,
                     topk_group=2, moe_backend="ragged_dot", dtype="float32", param_dtype="float32"),
    }

    def check(self):
        super().check()
        name = type(self).__name__
        check_positive(self, "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                       "v_head_dim", "mlp_dim", "n_group", "topk_group")
        check_positive_float(self, "rope_theta", "routed_scaling_factor")
        check_non_negative(self, "first_dense_layers", "num_shared_experts", "mtp_depths", "mtp_lambda")
        if self.first_dense_layers > self.num_layers:
            raise ValueError(f"{name}.first_dense_layers={self.first_dense_layers} must be at most "
                             f"num_layers={self.num_layers}")
        check_routing(num_experts=self.num_experts, k=self.num_experts_per_tok, n_group=self.n_group,
                      topk_group=self.topk_group, where=name)
        if self.attention_tiles != 1:
            raise ValueError(f"{name}.attention_tiles={self.attention_tiles}: MLA attention has no query tiles "
                             f"(grouped-query attention has, zoo.layers.query_tiles); leave it at 1")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{name}.qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")

    def mtp_loss_weight(self) -> float:
        return self.mtp_lambda if self.mtp_depths else 0.0

    def without_mtp(self) -> DeepSeekV3Config:
        return dataclasses.replace(self, mtp_depths=0)

    def without_extra_heads(self) -> DeepSeekV3Config:
        """Without the multi-token-prediction module (its one extra head)."""
        return self.without_mtp()

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    def attention_head_dim(self) -> int:
        """MLA's q/k head dim and value head dim, padded to the larger (see zoo.layers.mla)."""
        return max(self.qk_nope_head_dim + self.qk_rope_head_dim, self.v_head_dim)

    def mesh_divisors(self) -> tuple[tuple[str, str], ...]:
        return (("tp", "num_heads"), ("tp", "mlp_dim")) + super().mesh_divisors()

    def rope(self) -> Rope:
        return Rope(dim=self.qk_rope_head_dim, theta=self.rope_theta, scaling=self.rope_scaling)
