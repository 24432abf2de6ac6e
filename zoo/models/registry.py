"""The model table: one `Family` per model family, read by every front end (training, planning, `from_hf`/`to_hf`,
the benchmarks). A new family is one entry here (plus its config, layers, recipes and tests); no front end changes.

    family("llama3").config("llama3_1_405b", num_layers=4)   # a preset (a config classmethod) with overrides
    family_of(cfg).build(cfg, recipe=..., rngs=...)
    family_of(cfg).recipes                                   # "recipes.llama3": a module name, never imported here

The recipes are named, not imported: `zoo` never imports `recipes` (the application). A front end imports
`family.recipes` and reads its `RECIPES`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.hf import config as hf_config
from zoo.hf import keymap
from zoo.layers.moe import update_routing_bias
from zoo.models.config import LMConfig
from zoo.models.deepseek import DeepSeekV3Config, deepseek_v3, total_balance_loss
from zoo.models.llama import LlamaConfig, llama3
from zoo.models.lm import count_params

# DeepSeek-V3's bias update speed (gamma): 0.001 for most of its pre-training (the technical report, 4.2).
ROUTING_BIAS_RATE = 1e-3


def no_aux_loss(cfg: LMConfig, aux: dict) -> jax.Array:
    return jnp.zeros((), jnp.float32)


def no_update(model: nnx.Module, aux: dict) -> None:
    return None


def no_extra_keys(hf: dict) -> Callable[[str], bool]:
    return lambda key: False


@dataclasses.dataclass(frozen=True)
class HFArch:
    """How a family maps to a Hugging Face architecture (see zoo.hf)."""
    architecture: str                                       # config.json "architectures"
    model_type: str                                         # config.json "model_type"
    from_hf: Callable[..., LMConfig]                        # (hf config dict, param_dtype=) -> config
    to_hf: Callable[[LMConfig], dict]                       # config -> hf config dict
    keys: Callable[[LMConfig], list]                        # config -> [keymap.Entry]
    extra_keys: Callable[[dict], Callable[[str], bool]] = no_extra_keys  # checkpoint keys the zoo skips


@dataclasses.dataclass(frozen=True)
class Family:
    name: str                                               # --model
    config_cls: type[LMConfig]                              # its classmethods are the presets (--preset)
    build: Callable[..., nnx.Module]                        # build(cfg, recipe=, rngs=)
    hf: HFArch
    flops_per_token: Callable[[Any, nnx.Module, int], float]  # (cfg, model, seq) -> training FLOPs per token
    recipes: str                                            # module whose RECIPES are this family's recipes
    default_recipe: str                                     # the study's recipe
    aux_loss: Callable[[Any, dict], jax.Array] = no_aux_loss      # (cfg, aux) -> scalar added to the loss
    after_update: Callable[[nnx.Module, dict], None] = no_update  # (model, aux): state updates after the step

    def presets(self) -> tuple[str, ...]:
        return self.config_cls.presets()

    def config(self, preset: str, **overrides) -> LMConfig:
        """The preset `preset` with `overrides` replacing fields (values of the fields' types)."""
        if preset not in self.presets():
            raise ValueError(f"preset {preset!r} is not a {self.name} preset; choose one of: "
                             f"{', '.join(self.presets())}")
        fields = {f.name for f in dataclasses.fields(self.config_cls)}
        bad = sorted(set(overrides) - fields)
        if bad:
            raise ValueError(f"{bad} not fields of {self.config_cls.__name__}; its fields: {', '.join(sorted(fields))}")
        return getattr(self.config_cls, preset)(**overrides)


# -- FLOPs per token ----------------------------------------------------------------------------------------------
def _embedding_params(cfg) -> int:
    # An embedding lookup is a gather, not a matmul: its table counts only when it is also the LM head (tied).
    return 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim


def llama_flops_per_token(cfg: LlamaConfig, model: nnx.Module, seq: int) -> float:
    """6 N (forward 2N, backward 4N) plus causal attention: QK^T and PV over half the keys, times 3."""
    n = count_params(model) - _embedding_params(cfg)
    attention = 3 * 2 * 2 * seq * cfg.num_heads * cfg.head_dim / 2 * cfg.num_layers
    return 6 * n + attention


def deepseek_flops_per_token(cfg: DeepSeekV3Config, model: nnx.Module, seq: int) -> float:
    """6 N_active (the routed experts a token does not visit excluded) plus causal MLA attention."""
    idle_experts = cfg.num_experts - cfg.num_experts_per_tok
    n = count_params(model) - _embedding_params(cfg) - cfg.num_moe_layers * idle_experts * 3 * cfg.dim * cfg.moe_mlp_dim
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attention = 3 * 2 * seq * cfg.num_heads * (qk + cfg.v_head_dim) / 2 * cfg.num_layers
    return 6 * n + attention


# -- aux handling -------------------------------------------------------------------------------------------------
def deepseek_aux_loss(cfg: DeepSeekV3Config, aux: dict) -> jax.Array:
    """The sequence-wise balance loss of every MoE layer (already times cfg.balance_loss_weight)."""
    return total_balance_loss(aux)


def deepseek_after_update(model: nnx.Module, aux: dict) -> None:
    """The auxiliary-loss-free balance: move each routing bias towards the under-loaded experts."""
    update_routing_bias(model, aux, ROUTING_BIAS_RATE)


def _deepseek_extra_keys(hf: dict) -> Callable[[str], bool]:
    return keymap.deepseek_mtp_key(hf.get("num_hidden_layers", 0), hf.get("num_nextn_predict_layers") or 0)


# -- the table ----------------------------------------------------------------------------------------------------
FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama3", LlamaConfig, llama3,
           HFArch("LlamaForCausalLM", "llama", hf_config.llama_from_hf, hf_config.llama_to_hf, keymap.llama),
           llama_flops_per_token, recipes="recipes.llama3", default_recipe="qkv_offload"),
    Family("deepseek_v3", DeepSeekV3Config, deepseek_v3,
           HFArch("DeepseekV3ForCausalLM", "deepseek_v3", hf_config.deepseek_from_hf, hf_config.deepseek_to_hf,
                  keymap.deepseek_v3, _deepseek_extra_keys),
           deepseek_flops_per_token, recipes="recipes.deepseek_v3", default_recipe="mla_moe_offload",
           aux_loss=deepseek_aux_loss, after_update=deepseek_after_update),
)}


def family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"model {name!r} is not in the zoo; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_of(cfg: Any) -> Family:
    """The family of a config (or of a model, through its `config`)."""
    cfg = getattr(cfg, "config", cfg)
    for f in FAMILIES.values():
        if isinstance(cfg, f.config_cls):
            return f
    raise ValueError(f"no model family for a {type(cfg).__name__}; the zoo has: "
                     f"{', '.join(f.config_cls.__name__ for f in FAMILIES.values())}")


def family_for_hf(hf: dict) -> Family:
    """The family of a Hugging Face config.json (by `architectures`, else `model_type`)."""
    names = hf.get("architectures") or []
    by_type = {f.hf.model_type: f.hf.architecture for f in FAMILIES.values()}
    if not names and hf.get("model_type") in by_type:
        names = [by_type[hf["model_type"]]]
    for f in FAMILIES.values():
        if f.hf.architecture in names:
            return f
    raise ValueError(f"config.json: architectures={names!r} (model_type={hf.get('model_type')!r}) is not supported; "
                     f"zoo reads {sorted(f.hf.architecture for f in FAMILIES.values())}")


def config(name: str, preset: str, **overrides) -> LMConfig:
    """`family(name).config(preset, **overrides)`."""
    return family(name).config(preset, **overrides)
