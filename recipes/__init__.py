"""The recipe sets (data), one per model family: `recipes/<family name>.py` exporting `RECIPES` ({name: Recipe})
and `DEFAULT` (the study's recipe), looked up by name through `recipes.registry`; `recipes.context` holds the
long-context recipes every family shares. The training application that runs them is the package `recipes.train`.

Submodules load on first use (`recipes.<family name>`, `recipes.train`), so `python -m recipes.train` can set
`XLA_FLAGS` before anything imports JAX.
"""
import importlib
import importlib.util


def __getattr__(name):
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
