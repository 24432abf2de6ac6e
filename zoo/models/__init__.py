"""Models: configs with named presets, builders that apply a recipe to scanned stacks, and the model table
(`registry`: one entry per family, read by every front end)."""
from zoo.models import registry  # noqa: E402  the model table (imports the families above)
from zoo.models.config import LMConfig
from zoo.models.deepseek import DeepSeekV3, DeepSeekV3Config, deepseek_v3
from zoo.models.llama import Llama, LlamaConfig, llama3
from zoo.models.lm import CausalLM, StackTags, count_params
from zoo.models.stack import Stack

__all__ = ["LMConfig", "CausalLM", "StackTags", "count_params", "Llama", "LlamaConfig", "llama3", "Stack"]
__all__ += ["DeepSeekV3", "DeepSeekV3Config", "deepseek_v3", "registry"]
