"""The models `python -m recipes.train` knows: config presets, builder, recipes, and what the loop needs to know
about each (model FLOPs per token, an auxiliary loss, a state update after the optimizer step).
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax.numpy as jnp
from flax import nnx

import zoo
from zoo.models import count_params


def _no_aux_loss(cfg, aux) -> jnp.ndarray:
    return jnp.zeros((), jnp.float32)


def _no_update(model, aux) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class ModelEntry:
    name: str
    config_cls: type
    build: Callable[..., nnx.Module]            # build(cfg, recipe=, rngs=)
    recipes_module: str                         # module exporting RECIPES
    default_recipe: str
    flops_per_token: Callable[[Any, nnx.Module, int], float]   # (cfg, model, seq) -> training FLOPs per token
    aux_loss: Callable[[Any, dict], jnp.ndarray] = _no_aux_loss  # (cfg, aux) -> scalar added to the loss
    after_update: Callable[[nnx.Module, dict], None] = _no_update  # (model, aux): non-gradient state updates

    def presets(self) -> tuple[str, ...]:
        return tuple(n for n, v in vars(self.config_cls).items() if isinstance(v, classmethod))

    def config(self, preset: str, **overrides):
        if preset not in self.presets():
            raise ValueError(f"--preset {preset!r} is not a {self.name} preset; choose one of: "
                             f"{', '.join(self.presets())}")
        fields = {f.name for f in dataclasses.fields(self.config_cls)}
        bad = sorted(set(overrides) - fields)
        if bad:
            raise ValueError(f"--set: {bad} not fields of {self.config_cls.__name__}; its fields: {', '.join(sorted(fields))}")
        return getattr(self.config_cls, preset)(**overrides)

    def recipes(self) -> dict[str, zoo.Recipe]:
        return importlib.import_module(self.recipes_module).RECIPES

    def recipe(self, name: str) -> zoo.Recipe:
        recipes = self.recipes()
        if name not in recipes:
            raise ValueError(f"--recipe {name!r} is not a {self.name} recipe; choose one of: {', '.join(recipes)}")
        return recipes[name]


def _embedding_params(cfg) -> int:
    # An embedding lookup is a gather, not a matmul: its table counts only when it is also the LM head (tied).
    return 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim


def llama_flops_per_token(cfg, model: nnx.Module, seq: int) -> float:
    """6 N (forward 2N, backward 4N) plus causal attention: QK^T and PV over half the keys, times 3."""
    n = count_params(model) - _embedding_params(cfg)
    attention = 3 * 2 * 2 * seq * cfg.num_heads * cfg.head_dim / 2 * cfg.num_layers
    return 6 * n + attention


MODELS: dict[str, ModelEntry] = {
    "llama3": ModelEntry("llama3", zoo.models.LlamaConfig, zoo.models.llama3, "recipes.llama3", "qkv_offload",
                         llama_flops_per_token),
}

# DeepSeek-V3's bias update speed (gamma): 0.001 for most of its pre-training (the technical report, 4.2).
ROUTING_BIAS_RATE = 1e-3


def deepseek_flops_per_token(cfg, model: nnx.Module, seq: int) -> float:
    """6 N_active (the routed experts a token does not visit excluded) plus causal MLA attention."""
    idle_experts = cfg.num_experts - cfg.num_experts_per_tok
    n = count_params(model) - _embedding_params(cfg) - cfg.num_moe_layers * idle_experts * 3 * cfg.dim * cfg.moe_mlp_dim
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attention = 3 * 2 * seq * cfg.num_heads * (qk + cfg.v_head_dim) / 2 * cfg.num_layers
    return 6 * n + attention


def deepseek_aux_loss(cfg, aux) -> jnp.ndarray:
    """The sequence-wise balance loss of every MoE layer (already times cfg.balance_loss_weight)."""
    from zoo.models.deepseek import balance_loss
    return balance_loss(aux)


def deepseek_after_update(model, aux) -> None:
    """The auxiliary-loss-free balance: move each routing bias towards the under-loaded experts."""
    from zoo.layers.moe import update_routing_bias
    update_routing_bias(model, aux, ROUTING_BIAS_RATE)


if hasattr(zoo.models, "DeepSeekV3Config"):
    MODELS["deepseek_v3"] = ModelEntry("deepseek_v3", zoo.models.DeepSeekV3Config, zoo.models.deepseek_v3,
                                       "recipes.deepseek_v3", "mla_moe_offload", deepseek_flops_per_token,
                                       deepseek_aux_loss, deepseek_after_update)


def entry(name: str) -> ModelEntry:
    if name not in MODELS:
        raise ValueError(f"--model {name!r} is not available; choose one of: {', '.join(MODELS)}")
    return MODELS[name]
