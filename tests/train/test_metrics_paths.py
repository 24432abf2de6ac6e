"""--metrics is opened as a user expects and never replaced: regular files created with the
umask's mode and appended in place, symlinks followed, FIFOs and devices written as streams, ownership taken with
the open (a lock), strict JSON lines. No JAX compile: `recipes.train.checkpoints.guard.MetricsFile` directly."""
from __future__ import annotations

import json
import os
import stat
import threading
import time

import pytest

from recipes.train.checkpoints import guard
from recipes.train.checkpoints.resume import Session
from recipes.train.loop import RunConfig
from recipes.train.processes.lock import DirLock
from recipes.train.settings.job import resolve


def lines(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_a_new_file_gets_the_umask_mode_and_a_symlink_is_written_through(tmp_path):
    """A fresh file is created with 0666 & ~umask (not mkstemp's 0600); a symlink stays a symlink and its target
    receives the lines."""
    old = os.umask(0o022)
    try:
        with guard.check_metrics(str(tmp_path / "m.jsonl"), owner=None) as m:
            m.write({"step": 1, "loss": 1.0})
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "m.jsonl").st_mode) == 0o644
    target = tmp_path / "target.jsonl"
    (tmp_path / "link.jsonl").symlink_to(target)
    with guard.check_metrics(str(tmp_path / "link.jsonl"), owner=None) as m:
        m.write({"step": 1, "loss": 2.0})
    assert (tmp_path / "link.jsonl").is_symlink() and lines(target) == [{"step": 1, "loss": 2.0}]


def test_two_runs_cannot_own_one_metrics_file(tmp_path):
    """Ownership is taken when the file is opened (before compiling): a second run is refused while the first holds
    it, and a finished run's file is refused to a new run; the first run's lines are never lost."""
    path = str(tmp_path / "m.jsonl")
    first = guard.check_metrics(path, owner=None)
    with pytest.raises(ValueError, match="is being written by another run"):
        guard.check_metrics(path, owner=None)
    first.write({"step": 1, "loss": 1.0})
    first.close()
    with pytest.raises(ValueError, match="already exists and is not this run's"):
        guard.check_metrics(path, owner=None)
    assert lines(path) == [{"step": 1, "loss": 1.0}]


def test_a_resumed_run_cuts_its_own_file_in_place(tmp_path):
    """Resuming at step 3 keeps the lines up to step 3 by truncating the same file (inode and hard links kept); a
    last line cut by a kill is dropped, not glued to the next one."""
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": k}) + "\n" for k in (1, 2)) + '{"step": 3, "lo')
    os.link(path, tmp_path / "hardlink.jsonl")
    inode = os.stat(path).st_ino
    with guard.check_metrics(str(path), owner=str(path)) as m:
        m.start_at(3)
        m.write({"step": 3, "loss": 0.5})
    assert os.stat(path).st_ino == inode and os.stat(path).st_nlink == 2
    assert [r["step"] for r in lines(path)] == [1, 2, 3] and lines(path)[-1]["loss"] == 0.5


def test_fifo_and_device_are_streams(tmp_path):
    """A FIFO with a reader gets the lines; one without a reader is refused at once (no hang); /dev/null is written,
    not replaced or truncated, and takes no lock (two runs may share it)."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="is a FIFO with no reader"):
        guard.check_metrics(str(fifo), owner=None)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()))
    reader.start()
    deadline = time.monotonic() + 10   # a deadline against a hang, not a measured time
    while True:   # polls for the state: the reader's open may come a moment later
        try:
            m = guard.check_metrics(str(fifo), owner=None)
            break
        except ValueError:
            assert time.monotonic() < deadline, "the FIFO's reader never opened it"
            time.sleep(0.01)
    m.write({"step": 1, "loss": 3.0})
    m.close()
    reader.join(10)   # a deadline against a hang
    assert json.loads(got[0]) == {"step": 1, "loss": 3.0} and stat.S_ISFIFO(os.stat(fifo).st_mode)
    if os.path.exists("/dev/null"):
        a, b = guard.check_metrics("/dev/null", owner=None), guard.check_metrics("/dev/null", owner=None)
        a.write({"step": 1})
        a.close(), b.close()
        assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_json_lines_hold_null_for_nan_and_unused_files_are_removed(tmp_path):
    """NaN and infinity are written as null (strict JSON); a file this run created but never wrote to is removed
    (a run refused before its first step leaves nothing behind)."""
    path = tmp_path / "m.jsonl"
    with guard.check_metrics(str(path), owner=None) as m:
        m.write({"step": 1, "mfu": float("nan"), "x": [float("inf"), 1.0]})
    assert open(path).read() == '{"step": 1, "mfu": null, "x": [null, 1.0]}\n'
    guard.check_metrics(str(tmp_path / "unused.jsonl"), owner=None).close()
    assert not (tmp_path / "unused.jsonl").exists()


def test_a_run_killed_before_its_first_checkpoint_owns_its_metrics_file(tmp_path):
    """The lock file names the run and its metrics path; after a kill (stale lock) the same run with --resume is
    given its metrics file back, a different run is not."""
    ckpt, metrics = tmp_path / "ckpt", str(tmp_path / "m.jsonl")
    ckpt.mkdir()
    settings = RunConfig(steps=6, ckpt_dir=str(ckpt), metrics=metrics, resume=True)
    lock = DirLock(ckpt, info={"run": settings.identity(), "metrics": metrics})
    os.close(lock.fd)          # as if killed: the file stays, its flock is gone
    lock.fd = None
    again = DirLock(ckpt)
    session = Session(stack=None, interrupts=None, previous=again.taken_over)
    assert session.metrics_owner(resolve(settings), None) == metrics
    other = RunConfig(steps=6, ckpt_dir=str(ckpt), metrics=metrics, resume=True, seed=1)
    assert session.metrics_owner(resolve(other), None) is None
    again.release()
