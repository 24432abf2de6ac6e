"""Checkpoints and locks that are not as the run left them, and still resume (or refuse in one line):

- a stray file (`.DS_Store`) in a checkpoint step: noted once and ignored, the step resumed;
- a step whose manifest was deleted: checked by orbax's own record of the step and a full restore, resumed with a
  note that its bytes are unverified; without orbax's record either, it is damage (tests/train/test_resume.py);
- a garbage lock file: refused as unreadable (not "a run on another machine");
- a run killed before its first checkpoint, then the plain command: refused (its metrics file is the killed
  run's), and the killed run's record stays in the lock, so the later `--resume` continues that metrics file;
- a run folder moved (`mv run1 run2`): the same command resumes in the new place, its metrics file and token file
  found where they moved (`recipes.train.checkpoints.resume.same`).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from recipes.train.checkpoints import resume
from recipes.train.checkpoints.checkpoint import Checkpoints
from recipes.train.checkpoints.resume import Session
from recipes.train.processes.lock import LOCK_NAME, DirLock
from recipes.train.settings.config import RunConfig
from recipes.train.settings.job import resolve
from tests.train.cli_runs import RUN, cli, copy_ckpt, main, rows


@pytest.mark.slow
def test_a_stray_file_in_a_step_is_noted_once_and_ignored(base, tmp_path):
    ckpt = copy_ckpt(base, tmp_path)
    (ckpt / "6" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (ckpt / "6" / "state" / "notes.txt").write_text("mine")
    ckpts, said = Checkpoints(ckpt), []
    assert ckpts.newest_intact(say=said.append)[0] == 6
    assert ckpts.newest_intact(say=said.append)[0] == 6   # said once per run, though the walk runs twice
    assert said == [f"checkpoint step 6 in {ckpt}: 2 file(s) not written with the step (not in its manifest), "
                    f"ignored: {ckpt / '6' / '.DS_Store'}, {ckpt / '6' / 'state' / 'notes.txt'}"]
    assert (ckpt / "6" / ".DS_Store").exists() and Checkpoints(ckpt).steps() == [2, 4, 6]   # nothing moved


def test_a_step_without_its_manifest_is_resumed_unverified(base, tmp_path):
    ckpt = copy_ckpt(base, tmp_path)
    (ckpt / "6" / "zoo-manifest.json").unlink()
    said = []
    assert Checkpoints(ckpt).newest_intact(say=said.append)[0] == 6
    assert said == [f"checkpoint step 6 in {ckpt} has no manifest ({ckpt / '6' / 'zoo-manifest.json'}: deleted, or "
                    f"the run was killed before writing it): orbax recorded the step as complete, so it is resumed "
                    f"if it restores, its bytes unverified against checksums"]


@pytest.mark.slow
def test_a_step_without_its_manifest_resumes_through_the_command(base, tmp_path):
    ckpt = copy_ckpt(base, tmp_path)
    (ckpt / "6" / "zoo-manifest.json").unlink()
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 7, "--schedule-steps", 6])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    assert out.stdout.count("has no manifest") == 1 and f"resumed from {ckpt} at step 6" in out.stdout
    assert out.stderr == ""


def test_a_garbage_lock_file_is_refused_as_unreadable(tmp_path):
    (tmp_path / LOCK_NAME).write_bytes(b"PNG garbage")
    with pytest.raises(ValueError) as e:
        DirLock(tmp_path)
    assert str(e.value) == (f"the lock file {tmp_path / LOCK_NAME} is unreadable (not a lock this zoo wrote: "
                            f"'PNG garbage'), so whose it is cannot be told; if no run uses {tmp_path}, delete "
                            f"the file")
    assert (tmp_path / LOCK_NAME).read_bytes() == b"PNG garbage"   # left as it was


def killed_run_lock(ckpt, settings: RunConfig, metrics) -> int:
    """The lock a run of `settings` leaves when killed before its first checkpoint (its pid is gone)."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (ckpt / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "then",
                                              "directory": str(ckpt), "run": settings.identity(),
                                              "metrics": str(metrics)}))
    return dead.pid


def run_settings(**kw) -> RunConfig:
    """The RunConfig of the command `RUN` + `kw` (what its identity is)."""
    return RunConfig(**dict(steps=6, batch=2, seq=16, overrides=(("num_layers", "1"),), log_every=1, **kw))


def test_a_plain_rerun_after_a_kill_leaves_the_killed_runs_record_for_its_resume(tmp_path, capsys):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    ckpt.mkdir()
    pid = killed_run_lock(ckpt, run_settings(), metrics)
    metrics.write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.0}\n')   # the killed run's rows
    left = (ckpt / LOCK_NAME).read_text()
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--metrics", metrics], capsys)   # the plain command again
    assert rc == 2 and f"--metrics {metrics} already exists and is not this run's" in err, err
    assert f"took over the stale lock of a run that ended without releasing it (pid {pid}" in out
    assert (ckpt / LOCK_NAME).read_text() == left   # the killed run's record is back, as it was
    again = DirLock(ckpt)                           # what --resume then finds: the killed run and its metrics file
    settings = run_settings(ckpt_dir=str(ckpt), metrics=str(metrics), resume=True)
    session = Session(stack=None, interrupts=None, previous=again.taken_over)
    assert session.metrics_owner(resolve(settings), None) == str(metrics)
    again.release()


@pytest.mark.slow
def test_the_killed_runs_resume_continues_its_metrics_file_after_a_plain_rerun(tmp_path, capsys):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    ckpt.mkdir()
    args = RUN + ["--ckpt-dir", ckpt, "--metrics", metrics]
    pid = killed_run_lock(ckpt, run_settings(), metrics)
    metrics.write_text('{"step": 1, "loss": 9.0}\n')
    assert main(args, capsys)[0] == 2
    done = cli(args + ["--resume"])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    assert "--resume: no checkpoint in" in done.stdout and f"(pid {pid}" in done.stdout
    assert sorted(rows(metrics)) == [1, 2, 3, 4, 5, 6]   # the killed run's file, continued from step 0
    assert not (ckpt / LOCK_NAME).exists()


def moved_run(base, tmp_path):
    """The base run's folder as `mv` leaves it elsewhere: its records name the old place."""
    run2 = tmp_path / "run2"
    run2.mkdir()
    copy_ckpt(base, run2)
    shutil.copy(base / "m.jsonl", run2 / "m.jsonl")
    assert Checkpoints(run2 / "ckpt").record()["metrics"] == str(base / "m.jsonl")
    return run2


def test_a_moved_run_folder_keeps_its_metrics_file(base, tmp_path):
    run2 = moved_run(base, tmp_path)
    settings = run_settings(ckpt_dir=str(run2 / "ckpt"), metrics=str(run2 / "m.jsonl"), resume=True)
    session = Session(stack=None, interrupts=None)
    assert session.metrics_owner(resolve(settings), Checkpoints(run2 / "ckpt").record()) == str(run2 / "m.jsonl")
    other = run_settings(ckpt_dir=str(run2 / "ckpt"), metrics=str(tmp_path / "other.jsonl"), resume=True)
    assert session.metrics_owner(resolve(other), Checkpoints(run2 / "ckpt").record()) == str(base / "m.jsonl")


@pytest.mark.slow
def test_a_moved_run_folder_resumes_where_it_now_is(base, tmp_path):
    """`mv run1 run2`, then the same command with --resume in the new place: the run continues, its metrics file
    found where it moved (the old one untouched)."""
    run2 = moved_run(base, tmp_path)
    out = cli(RUN + ["--ckpt-dir", run2 / "ckpt", "--metrics", run2 / "m.jsonl", "--resume", "--steps", 7,
                     "--schedule-steps", 6])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    assert f"resumed from {run2 / 'ckpt'} at step 6" in out.stdout
    assert sorted(rows(run2 / "m.jsonl")) == list(range(1, 8)) and sorted(rows(base / "m.jsonl")) == list(range(1, 7))


def test_a_token_file_that_moved_with_the_run_is_the_runs_own(tmp_path):
    old, new = tmp_path / "run1", tmp_path / "run2"
    settings = RunConfig(data="ids.bin")
    record = {"run": settings.identity(), "directory": str(old / "ckpt"),
              "data": {"path": str(old / "ids.bin"), "dtype": "uint16", "bytes": 10, "fingerprint": "f"}}
    here = {**record["data"], "path": str(new / "ids.bin")}
    resume.check_resumable(record, resolve(settings), str(new / "ckpt"), here)   # moved with the checkpoints: same file
    with pytest.raises(ValueError, match="--data ids.bin is not the file the run in .* read .path: checkpoint"):
        resume.check_resumable(record, resolve(settings), str(new / "ckpt"),
                               {**here, "path": str(tmp_path / "elsewhere.bin")})
    assert resume.rebased(str(old / "m.jsonl"), str(old / "ckpt"), new / "ckpt") == str(new / "m.jsonl")
    assert resume.rebased("/logs/m.jsonl", str(old / "ckpt"), old / "ckpt") == "/logs/m.jsonl"
    assert os.path.isabs(resume.rebased(str(old / "m.jsonl"), str(old / "ckpt"), "rel/ckpt"))
