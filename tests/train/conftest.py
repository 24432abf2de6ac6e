"""Fixtures of the main job's tests."""
from __future__ import annotations

import pytest

from recipes.train.checkpoints.checkpoint import Checkpoints
from tests.train.cli_runs import RUN, cli


@pytest.fixture(scope="session")
def base(tmp_path_factory):
    """A finished 6-step run checkpointed every 2 steps (2, 4, 6) with its metrics: the reference every recovered
    run is compared with. Tests copy its checkpoint directory; none changes it."""
    d = tmp_path_factory.mktemp("base")
    out = cli(RUN + ["--ckpt-dir", d / "ckpt", "--ckpt-every", 2, "--metrics", d / "m.jsonl"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert Checkpoints(d / "ckpt").steps() == [2, 4, 6]
    return d
