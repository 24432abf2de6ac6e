"""Models: configs with named presets, and builders that apply a recipe to scanned stacks."""
from zoo.models.config import LMConfig
from zoo.models.deepseek import DeepSeekV3, DeepSeekV3Config, deepseek_v3
from zoo.models.lm import CausalLM, StackTags, count_params
from zoo.models.llama import Llama, LlamaConfig, llama3
from zoo.models.stack import Stack

__all__ = ["LMConfig", "CausalLM", "StackTags", "count_params", "Llama", "LlamaConfig", "llama3", "Stack"]
__all__ += ["DeepSeekV3", "DeepSeekV3Config", "deepseek_v3"]
