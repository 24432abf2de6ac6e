"""The extras install what the docs tell users to run: each program or feature the docs (README.md, docs/*.md)
name comes with the package that provides it, in the extra the docs name for it (pyproject.toml)."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# what the docs say -> (the extra, the distribution that provides it)
NEEDS = {
    "tensorboard --logdir": ("watch", "tensorboard"),     # the viewer (no TensorFlow)
    "--tensorboard DIR": ("watch", "tensorboardX"),       # the event writer
    "--plot FILE.png": ("watch", "matplotlib"),
    "--tokenizer DIR": ("text", "tokenizers"),
    "python -m recipes.train.tokenizer": ("text", "tokenizers"),
}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_every_documented_program_is_in_its_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    text = "\n".join(p.read_text() for p in DOCS) + (ROOT / "recipes" / "train" / "tokenizer.py").read_text()
    said = [phrase for phrase in NEEDS if phrase in text]
    assert "tensorboard --logdir" in said and "python -m recipes.train.tokenizer" in said
    for phrase in said:
        extra, dist = NEEDS[phrase]
        assert dist.lower() in _names(extras[extra]), f"the docs say {phrase!r}: [{extra}] must install {dist}"
