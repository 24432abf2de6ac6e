"""offload-zoo: Flax NNX models whose every offloadable intermediate is named, and recipes that place them.

The subpackages load when first used (PEP 562): `import zoo.layers.mlp` loads the layers it needs, not the planner,
the models or the checkpoint converters; `zoo.plan`, `zoo.Recipe` and the rest load on first access.
"""
from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # what the lazy names are, for readers and type checkers
    from zoo import (
        emitted,  # reading tags and their shapes off a trace: zoo.emitted.emitted_by(layer, x)
        layers,
        models,
        plan,  # the planner package: zoo.plan.plan(cfg, recipe, ...)
        tags,
    )
    from zoo.hf.load import from_hf
    from zoo.hf.save import to_hf
    from zoo.plan import Plan
    from zoo.recipe import Recipe

__all__ = ["Plan", "Recipe", "emitted", "from_hf", "layers", "models", "plan", "tags", "to_hf"]
__version__ = "0.1.0"

_NAMES = {"Plan": "zoo.plan", "Recipe": "zoo.recipe", "from_hf": "zoo.hf.load", "to_hf": "zoo.hf.save"}


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(importlib.import_module(_NAMES[name]), name)
        globals()[name] = value   # loaded once
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"zoo.{name}") is not None:
        return importlib.import_module(f"zoo.{name}")   # a subpackage or module: zoo.plan, zoo.layers, ...
    raise AttributeError(f"module 'zoo' has no attribute {name!r}")

