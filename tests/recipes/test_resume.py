"""Resuming: from the newest intact checkpoint when the latest is damaged (kept aside, not deleted), with nothing
renamed when no checkpoint restores; the metrics file continued (and another run's never truncated); past the
planned steps only with the schedule kept (--schedule-steps). Each recovered run is compared with the
uninterrupted one (the `base` fixture, tests/recipes/conftest.py)."""
from __future__ import annotations

import json
import os
import shutil

import optax
import pytest
from flax import nnx

from recipes.checkpoint import Checkpoints
from tests.recipes.cli_runs import RUN, cli, copy_ckpt, main, rows


@pytest.mark.parametrize("damage", ["truncated_array_file", "missing_state"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact(base, tmp_path, damage):
    ckpt = copy_ckpt(base, tmp_path)
    if damage == "truncated_array_file":
        for f in (ckpt / "6" / "state").rglob("d/*"):
            if f.is_file() and f.stat().st_size > 64:
                os.truncate(f, 64)
        reason = "restoring it failed"
    else:
        shutil.rmtree(ckpt / "6" / "state")
        reason = f"{ckpt / '6' / 'state'} is missing"
    files_before = sorted(str(p.relative_to(ckpt / "6")) for p in (ckpt / "6").rglob("*"))
    # (A finished run resumed has nothing to do, whatever its arrays hold: train on past it, so it restores.)
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6, "--ckpt-every", 2,
                     "--metrics", tmp_path / "m.jsonl"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"checkpoint step 6 in {ckpt} is damaged ({reason}" in out.stdout, out.stdout
    assert f"moved to {ckpt / '6.damaged'} (kept, not deleted); step 4 is intact" in out.stdout
    assert f"resumed from {ckpt} at step 4" in out.stdout
    # The damaged checkpoint is kept as it was, out of the keep-3 rotation, which saw 2, 4 and the new 6 and 8.
    assert sorted(str(p.relative_to(ckpt / "6.damaged")) for p in (ckpt / "6.damaged").rglob("*")) == files_before
    assert Checkpoints(ckpt).steps() == [4, 6, 8]
    # The recovered run is the uninterrupted one: steps 5 and 6 have its losses exactly.
    want, got = rows(base / "m.jsonl"), rows(tmp_path / "m.jsonl")
    assert sorted(got) == [5, 6, 7, 8] and {k: got[k]["loss"] for k in (5, 6)} == {k: want[k]["loss"] for k in (5, 6)}


def test_nothing_is_renamed_when_no_checkpoint_restores(tmp_path):
    """A failure every checkpoint shares (here: a model that no longer matches them) is not damage: the error lists
    each step's reason and no folder is renamed."""
    ckpts = Checkpoints(tmp_path / "ckpt")
    small = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    for step in (1, 2):
        ckpts.save(step, small, nnx.Optimizer(small, optax.sgd(0.1), wrt=nnx.Param), {"run": {}})
    other = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="can be resumed .nothing was changed.: step 2: restoring it failed.*step 1"):
        ckpts.newest_intact(model=other, optimizer=nnx.Optimizer(other, optax.sgd(0.1), wrt=nnx.Param))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]


def test_a_resumed_run_continues_its_metrics_file_and_never_truncates_another(base, tmp_path, capsys):
    other = tmp_path / "other.jsonl"
    shutil.copy(base / "m.jsonl", other)
    text = other.read_text()
    rc, out, err = main(RUN + ["--metrics", other], capsys)                      # a fresh run onto another's file
    assert rc == 2 and f"--metrics {other} already exists and is not this run's" in err and "compiled" not in out
    ckpt = copy_ckpt(base, tmp_path)                                             # resuming, with another's file
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6,
                               "--metrics", other], capsys)
    assert rc == 2 and "already exists and is not this run's" in err and other.read_text() == text
    rc, out, err = main(RUN + ["--metrics", tmp_path / "no" / "m.jsonl"], capsys)  # a missing directory
    assert rc == 2 and f"the directory {tmp_path / 'no'} does not exist" in err and "compiled" not in out

    # The same run resumed: its file is continued, keeping the lines up to the checkpoint (step 2).
    run = RUN + ["--ckpt-dir", tmp_path / "c2", "--ckpt-every", 2, "--metrics", tmp_path / "m.jsonl"]
    assert cli(run + ["--stop-after", 3]).returncode == 0
    assert sorted(rows(tmp_path / "m.jsonl")) == [1, 2, 3]
    out = cli(run + ["--resume"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert [json.loads(line)["step"] for line in open(tmp_path / "m.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert {k: r["loss"] for k, r in rows(tmp_path / "m.jsonl").items()} == \
        {k: r["loss"] for k, r in rows(base / "m.jsonl").items()}


def test_resume_past_the_planned_steps_keeps_the_schedule(base, tmp_path, capsys):
    ckpt = copy_ckpt(base, tmp_path)
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume"], capsys)          # finished: nothing to do
    assert rc == 0 and f"nothing left to do: the checkpoint in {ckpt} is at step 6 and --steps is 6" in out
    assert "--schedule-steps 6" in out and "compiled" not in out
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8], capsys)   # --steps alone: a hint
    assert rc == 2 and "was planned for 6 steps" in err and "add --schedule-steps 6" in err
    # The principled way: the schedule keeps its 6 steps; steps 7 and 8 run at its final learning rate, lr/10.
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6,
                     "--metrics", tmp_path / "m.jsonl"])
    assert out.returncode == 0 and f"resumed from {ckpt} at step 6" in out.stdout, out.stdout + out.stderr
    got = rows(tmp_path / "m.jsonl")
    assert sorted(got) == [7, 8] and all(got[k]["lr"] == pytest.approx(3e-4) for k in (7, 8))
    assert Checkpoints(ckpt).latest_step() == 8
