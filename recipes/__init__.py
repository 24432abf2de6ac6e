"""The training application: the command lines, the training loop, and the recipe sets (data), one per model
family: `recipes/<family name>.py` exporting `RECIPES` and `DEFAULT` (`recipes.registry`).

Submodules load on first use (`recipes.<family name>`, `recipes.loop`), so `python -m recipes.train` can set
`XLA_FLAGS` before anything imports JAX.
"""
import importlib
import importlib.util

DEFAULT_MODEL = "llama3"  # --model's default: the family of the README's main job


def __getattr__(name):
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
