"""Checkpoint folders: rotation deletes only this run's checkpoints (one it cannot delete is a warning, and the run
goes on), a --ckpt-dir holding step-numbered folders that are not zoo checkpoints is refused before training (naming
them), and a failed write (a full disk) is one message naming the directory, with the partial checkpoint removed and
the earlier ones intact."""
from __future__ import annotations

import os
import subprocess
import sys

import optax
import pytest
from flax import nnx

from recipes.train import loop
from recipes.train.checkpoints.checkpoint import Checkpoints
from tests.helpers import ROOT, cpu_env


def small():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)


@pytest.mark.slow
def test_rotation_keeps_other_runs_checkpoints(tmp_path):
    """keep-2 rotation deletes this run's older steps only: a checkpoint of another run in the same directory (its
    record names another run) survives every save."""
    model, opt = small()
    theirs = Checkpoints(tmp_path, max_to_keep=2)
    theirs.save(1, model, opt, {"run": {"seed": 1}})
    theirs.close()
    ours = Checkpoints(tmp_path, max_to_keep=2)
    for step in (2, 3, 4, 5):
        ours.save(step, model, opt, {"run": {"seed": 0}})
    assert ours.steps() == [1, 4, 5]
    ours.close()


def test_rotation_that_cannot_delete_a_step_is_a_warning_and_the_saves_go_on(tmp_path, monkeypatch):
    """An old step that cannot be deleted (read-only; the tests run as root, so deleting is made to fail) is kept
    with one warning naming the folder (once); the new checkpoint is written and later saves rotate the rest."""
    model, opt = small()
    ckpts = Checkpoints(tmp_path, max_to_keep=2)
    delete = ckpts.manager.delete

    def read_only(step):
        if step == 1:
            raise PermissionError(13, "Permission denied", str(tmp_path / "1"))
        delete(step)
    monkeypatch.setattr(ckpts.manager, "delete", read_only)
    said = []
    for step in (1, 2, 3, 4):
        ckpts.save(step, model, opt, {"run": {"seed": 0}}, say=said.append)
    assert ckpts.steps() == [1, 3, 4]
    assert said == [f"warning: checkpoint rotation could not delete step 1 in {tmp_path} (Permission denied); it is "
                    f"kept (delete it by hand to free its space) and the run goes on"]
    ckpts.close()


def test_foreign_step_folders_are_refused_before_training(tmp_path, capsys):
    """A user's own folder named like a step ("5") is not a checkpoint: the run refuses the directory, naming it,
    before compiling anything, and the folder is neither renamed nor deleted."""
    (tmp_path / "ckpt" / "5").mkdir(parents=True)
    (tmp_path / "ckpt" / "5" / "notes.txt").write_text("mine")
    assert Checkpoints(tmp_path / "ckpt").foreign() == ["5"]
    settings = loop.RunConfig(steps=2, batch=2, seq=16, ckpt_dir=str(tmp_path / "ckpt"), resume=True)
    with pytest.raises(ValueError, match=r"holds step-numbered folders that are not checkpoints of this zoo: 5 "):
        loop.run(settings)
    assert "compiled" not in capsys.readouterr().out
    assert (tmp_path / "ckpt" / "5" / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["5"]   # and the lock was given back


def test_a_failed_write_is_one_message_and_leaves_no_partial_checkpoint(tmp_path):
    """A file-size limit (as a full disk does) makes the write of step 2 fail: one CheckpointError naming the
    directory and the cause, no traceback from the library's threads on stderr, no temporary folder left, step 1
    intact and restorable."""
    code = f"""
import resource, signal
from flax import nnx
import optax
from recipes.train.checkpoints.checkpoint import Checkpoints, CheckpointError
d = {str(tmp_path / 'ckpt')!r}
model = nnx.Linear(64, 64, rngs=nnx.Rngs(0))
opt = nnx.Optimizer(model, optax.adam(0.1), wrt=nnx.Param)
ckpts = Checkpoints(d)
ckpts.save(1, model, opt, {{}})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    ckpts.save(2, model, opt, {{}})
except CheckpointError as e:
    print("CheckpointError:", e)
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
ckpts.restore(model, opt, 1)
print("restored", ckpts.steps())
ckpts.close()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=cpu_env())
    assert out.returncode == 0, out.stderr
    assert f"CheckpointError: writing checkpoint step 2 to {tmp_path / 'ckpt'} failed: File too large (the " \
           f"partial checkpoint is removed; the earlier ones are intact: steps [1]; the library's log: " \
           f"{tmp_path / 'ckpt' / 'zoo-library.log'})" in out.stdout, out.stdout
    assert "restored [1]" in out.stdout and "Traceback" not in out.stderr, out.stderr
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "zoo-library.log"]   # the library's noise: kept there
    assert out.stderr == "", out.stderr
