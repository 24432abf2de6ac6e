"""The training application: `python -m recipes.train` (the main job), `python -m recipes.train.plan` (what a
recipe costs, before launching) and `python -m recipes.train.tokenizer` (a tokenizer trained on your text).

One idea a module: the command line (`command`, its flags from `config` through `cli`), the checks before anything
compiles (`guard`), building and compiling the step (`prepare`, `fit`, `auto`), the loop (`loop`: `meter`, `watch`,
`interrupt`), checkpoints (`checkpoint`, `manifest`, `resume`, `lock`), data (`data`, `text`, `token_file`,
`tokenizer`), several processes (`mesh`, `coordinator`, `agree`), the XLA flag sets (`flags`), the plan's command
line and plots (`plan`, `plot`). The recipe sets it runs are the package above (`recipes.<family>`).

This package imports nothing of JAX until a command's arguments are parsed, so the XLA flag set (`--xla-flags`) is
applied before JAX starts.
"""
from recipes.train.command import main, parser

__all__ = ["main", "parser"]
