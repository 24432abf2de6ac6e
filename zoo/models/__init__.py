"""Models: configs with named presets, and builders that apply a recipe to scanned stacks."""
from zoo.models.lm import CausalLM, StackTags, count_params
from zoo.models.llama import Llama, LlamaConfig, llama3
from zoo.models.stack import Stack

__all__ = ["CausalLM", "StackTags", "count_params", "Llama", "LlamaConfig", "llama3", "Stack"]
