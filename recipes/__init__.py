"""Per-model offload recipes (data) and the training loop that applies them.

Submodules load on first use (`recipes.llama3`), so `python -m recipes.train` can set `XLA_FLAGS` before
anything imports JAX.
"""
import importlib

__all__ = ["deepseek_v3", "llama3"]


def __getattr__(name):
    if name in __all__:
        return importlib.import_module(f"recipes.{name}")
    raise AttributeError(f"module 'recipes' has no attribute {name!r}")
