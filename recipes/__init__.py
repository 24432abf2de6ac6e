"""Per-model offload recipes (data) and the training loop that applies them."""
from recipes import deepseek_v3, llama3

__all__ = ["deepseek_v3", "llama3"]
