"""Models: the causal LM and its scanned stacks (shared), and one package per model family, each registering its
`Family` record into `registry` when imported (the line below imports them all)."""
from zoo.models import deepseek, llama, qwen3_moe, registry  # noqa: F401  the families: importing one registers it
from zoo.models.config import LMConfig, MoEConfig
from zoo.models.deepseek import DeepSeekV3, DeepSeekV3Config, deepseek_v3
from zoo.models.llama import Llama, LlamaConfig, llama3
from zoo.models.lm import CausalLM, StackTags, count_params
from zoo.models.stack import Stack

__all__ = ["LMConfig", "MoEConfig", "CausalLM", "StackTags", "count_params", "Llama", "LlamaConfig", "llama3",
           "Stack", "DeepSeekV3", "DeepSeekV3Config", "deepseek_v3", "registry"]
