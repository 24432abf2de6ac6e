"""offload-zoo: Flax NNX models whose every offloadable intermediate is named, and recipes that place them."""
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
