"""Models: the causal LM and its scanned stacks (shared), and one package per model family, each registering its
`Family` record into `registry` when imported.

A family's registration is its line here: importing its package registers it and exports its model and config
classes (its builder and the rest are the package's, `zoo.models.<package>`, or its record's,
`registry.family(name)`).
"""
from zoo.models import registry  # noqa: F401
from zoo.models.config import LMConfig, MoEConfig  # noqa: F401
from zoo.models.deepseek import DeepSeekV3, DeepSeekV3Config, deepseek_v3  # noqa: F401
from zoo.models.llama import Llama, LlamaConfig, llama3  # noqa: F401
from zoo.models.lm import CausalLM, StackTags, count_params  # noqa: F401
from zoo.models.qwen3 import Qwen3, Qwen3Config  # noqa: F401
from zoo.models.qwen3_moe import Qwen3Moe, Qwen3MoeConfig  # noqa: F401
from zoo.models.stack import Stack  # noqa: F401
