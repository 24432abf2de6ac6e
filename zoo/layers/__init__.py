"""Offload-first layers: they compute and name their intermediates; they never decide where those live."""
from zoo import renames
from zoo.layers.attention import Attention
from zoo.layers.attention_kernel import causal_attention
from zoo.layers.embed import Embed, LMHead
from zoo.layers.mla import MLA
from zoo.layers.mlp import MLP
from zoo.layers.moe import GroupLimitedRouter, MoE, MoEAux, RoutingBias, SoftmaxRouter
from zoo.layers.norm import RMSNorm
from zoo.layers.rope import Rope, WavelengthScaling, YarnScaling
from zoo.layers.tile_attention import prefix_attention

__all__ = ["Attention", "causal_attention", "prefix_attention", "Embed", "LMHead", "MLP", "RMSNorm", "Rope",
           "WavelengthScaling", "YarnScaling"]
__all__ += ["MLA", "MoE", "MoEAux", "GroupLimitedRouter", "SoftmaxRouter", "RoutingBias"]

__getattr__ = renames.attributes(__name__)   # renamed classes (docs/changes.md)
