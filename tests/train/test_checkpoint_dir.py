"""The checkpoint directory: one that cannot be written is refused before anything is built, a write that fails
raises in the caller and the process exits (no hang in orbax's threads), and one run per directory (a lock; a
stale lock of this host is taken over, another machine's never)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from recipes.train.checkpoints import guard
from recipes.train.checkpoints.checkpoint import Checkpoints
from recipes.train.processes.lock import LOCK_NAME, DirLock
from tests.helpers import ROOT, cpu_env
from tests.train.cli_runs import RUN, copy_ckpt, main


def test_a_ckpt_dir_that_cannot_be_written_is_refused_before_building(tmp_path, capsys):
    regular = tmp_path / "file"
    regular.write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        guard.check_ckpt_dir(str(regular))
    with pytest.raises(ValueError, match="cannot be created"):           # its parent is a regular file
        guard.check_ckpt_dir(str(regular / "ckpt"))
    if os.path.isdir("/proc"):                                             # a file system no one writes
        with pytest.raises(ValueError, match="cannot be created|not writable"):
            guard.check_ckpt_dir("/proc/zoo-ckpt")
    if os.geteuid() != 0:                                                  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            guard.check_ckpt_dir(str(locked))
    # The command: exit code 2 and the reason, before building or compiling; the file is untouched.
    rc, out, err = main(RUN + ["--ckpt-dir", regular], capsys)
    assert rc == 2 and f"--ckpt-dir {regular} exists and is not a directory" in err, err
    assert "compiled" not in out and regular.read_text() == "mine"


def test_a_failing_checkpoint_write_raises_and_the_process_exits(tmp_path):
    """The directory disappears under a running manager (replaced by a file): the write fails in the caller, as a
    CheckpointError naming the step and directory, and the process exits (orbax's async threads used to hang)."""
    code = f"""
import os, shutil
from flax import nnx
import optax
from recipes.train.checkpoints.checkpoint import Checkpoints, CheckpointError
d = {str(tmp_path / 'ckpt')!r}
ckpts = Checkpoints(d)
model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
ckpts.save(1, model, opt, {{}})
shutil.rmtree(d); open(d, "w").close()
try:
    ckpts.save(2, model, opt, {{}})
except CheckpointError as e:
    print("CheckpointError:", e)
ckpts.close()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=cpu_env())
    assert out.returncode == 0, out.stderr
    assert f"CheckpointError: writing checkpoint step 2 to {tmp_path / 'ckpt'} failed" in out.stdout, out.stdout


@pytest.mark.slow
def test_one_run_per_checkpoint_directory(base, tmp_path, capsys):
    ckpt = copy_ckpt(base, tmp_path)
    with DirLock(ckpt):                       # this process plays the first run
        rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6], capsys)
        assert rc == 2 and f"{ckpt} is in use by another run (pid {os.getpid()} on {socket.gethostname()}" in err
        assert "compiled" not in out and Checkpoints(ckpt).steps() == [2, 4, 6]
        with pytest.raises(ValueError, match="in use by another run"):
            DirLock(ckpt)
    assert not (ckpt / LOCK_NAME).exists()    # released at exit

    # A lock left by a killed run of this host (its pid is gone) is taken over, and the run says so.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (ckpt / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "then"}))
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume"], capsys)
    assert rc == 0 and f"took over the stale lock of a run that ended without releasing it (pid {dead.pid}" in out
    assert "nothing left to do" in out and not (ckpt / LOCK_NAME).exists()
    # Another machine's lock is never taken over (its run may be alive).
    (ckpt / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
    with pytest.raises(ValueError, match="claimed by a run on another machine .*elsewhere.* delete"):
        DirLock(ckpt)
