"""The recipe sets (data), one per model family: `recipes/<family name>.py` exporting `RECIPES` ({name: Recipe})
and `DEFAULT` (the study's recipe), looked up by name through `recipes.registry`; `recipes.context` holds the
long-context recipes every family shares. The training application that runs them is the package `recipes.train`.

Submodules load on first use (`recipes.<family name>`, `recipes.train`), so `python -m recipes.train` can set
`XLA_FLAGS` before anything imports JAX.
"""
import importlib
import importlib.util

from zoo import renames  # imports nothing of JAX

# The training application's modules as they were named before it became the package `recipes.train` (in
# `recipes/`), and before `recipes.train` was in rooms (flat): an import of one fails naming its module now, for one
# release (docs/changes.md).
_NOW = {"agree": "processes.agree", "auto": "step.fit", "checkpoint": "checkpoints.checkpoint",
        "cli": "settings.cli", "config": "settings.config", "coordinator": "processes.coordinator",
        "data": "inputs.data", "defaults": "settings.config", "fit": "step.fit", "flags": "settings.flags",
        "guard": "checkpoints.guard", "interrupt": "processes.interrupt", "jaxlib": "processes.jaxlib",
        "job": "settings.job", "lock": "processes.lock", "manifest": "checkpoints.manifest", "mesh": "processes.mesh",
        "meter": "watching.meter", "moved": "checkpoints.resume", "plot": "watching.plot", "prepare": "step.prepare",
        "quiet": "checkpoints.checkpoint", "relay": "processes.relay", "resume": "checkpoints.resume",
        "text": "inputs.text", "token_file": "inputs.text", "watch": "watching.watch"}
_BEFORE_TRAIN = ("agree", "auto", "checkpoint", "cli", "config", "coordinator", "data", "defaults", "fit", "flags",
                 "guard", "interrupt", "lock", "loop", "manifest", "mesh", "meter", "moved", "plot", "prepare", "quiet",
                 "resume", "text", "token_file", "watch")
# Modules of `recipes.train`'s rooms folded into another module of the same room (their names unchanged): an import
# of one fails naming the module that holds its names now, for one release (docs/changes.md).
_FOLDED = {"checkpoints.quiet": "checkpoints.checkpoint", "settings.defaults": "settings.config",
           "step.auto": "step.fit"}
renames.MODULES.update({f"recipes.train.{old}": f"recipes.train.{new}" for old, new in _NOW.items()})
renames.MODULES.update({f"recipes.train.{old}": f"recipes.train.{new}" for old, new in _FOLDED.items()})
renames.MODULES.update({f"recipes.{old}": f"recipes.train.{_NOW.get(old, old)}" for old in _BEFORE_TRAIN})
renames.install_module_finder()


def __getattr__(name):
    if f"{__name__}.{name}" in renames.MODULES:   # a moved module, reached as an attribute: recipes.cli
        raise AttributeError(f"{__name__}.{name} is now {renames.MODULES[f'{__name__}.{name}']}")
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
