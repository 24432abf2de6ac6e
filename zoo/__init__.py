"""offload-zoo: Flax NNX models whose every offloadable intermediate is named, and recipes that place them."""
from zoo import layers, models, tags
from zoo.recipe import Recipe
from zoo.hf import from_hf, to_hf

__all__ = ["Recipe", "from_hf", "to_hf", "layers", "models", "tags"]
__version__ = "0.1.0"
