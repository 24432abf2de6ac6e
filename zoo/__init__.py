"""offload-zoo: Flax NNX models whose every offloadable intermediate is named, and recipes that place them."""
from zoo import layers, models, tags
from zoo.recipe import Recipe
from zoo.planner import Plan, plan

__all__ = ["Plan", "Recipe", "layers", "models", "plan", "tags"]
__version__ = "0.1.0"
