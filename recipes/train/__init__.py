"""The training application: `python -m recipes.train` (the main job), `python -m recipes.train.plan` (what a
recipe costs, before launching) and `python -m recipes.train.tokenizer` (a tokenizer trained on your text).

The commands stand here (`command`, `plan`, `tokenizer`) with the run in phases (`loop`); each phase calls into one
room: the run's settings, resolved once into a `Job` (`settings`), what it reads (`inputs`), what it keeps and takes
up again (`checkpoints`), the step compiled, checked and built (`step`), its processes (`processes`) and what
watches it (`watching`). The recipe sets it runs are the package above (`recipes.<family>`).

This package imports nothing of JAX until a command's arguments are parsed, so the XLA flag set (`--xla-flags`) is
applied before JAX starts.
"""
from recipes.train.command import main, parser

__all__ = ["main", "parser"]
