"""Models: the causal LM and its scanned stacks (shared), and one package per model family (`zoo/models/<family>/`),
registered when its line here imports it. `zoo.models.<family>` is the family's builder; import the package's parts by
name (`from zoo.models.<family> import hf`).
"""
from zoo import renames
from zoo.models import registry  # noqa: F401
from zoo.models.config import LMConfig, MoEConfig  # noqa: F401
from zoo.models.deepseek_v3 import DeepSeekV3, DeepSeekV3Config, deepseek_v3  # noqa: F401
from zoo.models.llama3 import Llama, LlamaConfig, llama3  # noqa: F401
from zoo.models.lm import CausalLM, StackTags, count_params  # noqa: F401
from zoo.models.qwen3 import Qwen3, Qwen3Config, qwen3  # noqa: F401
from zoo.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig, qwen3_moe  # noqa: F401
from zoo.models.stack import Stack  # noqa: F401

__all__ = ["CausalLM", "DeepSeekV3", "DeepSeekV3Config", "LMConfig", "Llama", "LlamaConfig", "MoEConfig", "Qwen3",
           "Qwen3Config", "Qwen3Moe", "Qwen3MoeConfig", "Stack", "StackTags", "count_params", "deepseek_v3", "llama3",
           "qwen3", "qwen3_moe", "registry"]

# the family packages renamed since the last release (docs/changes.md): imports and attributes name the new ones
renames.install_module_finder()
__getattr__ = renames.attributes(__name__)
