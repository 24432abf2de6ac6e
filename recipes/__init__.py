"""Per-model offload recipes (data) and the training loop that applies them."""
from recipes import llama3

__all__ = ["llama3"]
