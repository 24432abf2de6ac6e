"""The main job as the tests below drive it: in this process (`main`, for runs that stop before building anything)
or as `python -m recipes.train` in a subprocess (`cli`) sharing the run's compilation cache; every run with the
same step (model, batch, sequence and learning-rate schedule), so only the first compiles."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys

from recipes import train
from tests.helpers import ROOT, cpu_env

# One compiled step for every run: a 6-step schedule (resumed runs may go past it with --schedule-steps 6).
RUN = ["--steps", 6, "--batch", 2, "--seq", 16, "--set", "num_layers=1", "--log-every", 1, "--xla-flags", "none"]


def cli(args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes.train", *map(str, args)], env=cpu_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def main(args, capsys) -> tuple[int, str, str]:
    """The command in this process, for cases that stop before building anything."""
    rc = train.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def rows(metrics) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, open(metrics))}


def copy_ckpt(base, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(base / "ckpt", tmp_path / "ckpt"))
