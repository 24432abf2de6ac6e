"""Models: the causal LM and its scanned stacks (shared), and one package per model family, named as the family
(`zoo/models/<family>/`), each registering its `Family` record into `registry` when imported.

A family's registration is its line here: importing its package registers it and exports its model and config
classes and its builder, under the family's name:

    model = zoo.models.<family>(cfg, recipe=..., rngs=nnx.Rngs(0))   # the builder, under the family's name
    from zoo.models.<family> import hf                                 # the package's parts: import them by name

`zoo.models.<family>` is the builder, so reach the package's modules with `from zoo.models.<family> import ...`
(or `importlib.import_module`, or `registry.family(name)` for its record), not by attribute
(`zoo.models.<family>.hf` would look for `hf` on the function).
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
