"""One run per checkpoint directory: a lock file that a run takes before its first step and gives back at exit.

Two runs writing checkpoints into one directory delete each other's (orbax keeps the newest N of whatever it
finds). `DirLock(directory)` holds `directory/.zoo-run.lock`: an exclusive `fcntl.flock` on the file (the kernel
drops it when the process ends, even on `kill -9`) and, inside, who holds it (pid, host, start time, the directory)
for the message a second run prints. A lock file whose flock is free is stale: its run ended without giving it back
(killed); it is taken over, and `taken_over` says whose it was. A run that took over a stale lock and leaves the
directory without a checkpoint step gives the stale record back instead of removing it: it still says which run was
killed there and its metrics file, which that run's `--resume` continues. A lock written by another host is never
taken over (its run may be alive: flock is not reliable across machines on network file systems), nor one that
does not read as a lock (no one can say whose it is): delete the file by hand.
Several processes: process 0 takes the lock and tells the others what it decided
(`recipes.train.processes.agree.decided_by_0`), so that a refusal stops every process with the same line.
"""
from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket

LOCK_NAME = ".zoo-run.lock"


class DirLock:
    """An exclusive claim on `directory` (which must exist). ValueError if another live run holds it. `info` (JSON)
    is written into the lock beside the holder's pid, host and start time (a stale lock's is `taken_over`)."""

    def __init__(self, directory: str | os.PathLike, *, info: dict | None = None):
        self.path = os.path.join(os.fspath(directory), LOCK_NAME)
        self.taken_over: dict | None = None   # the stale holder's record, when its lock was taken over
        self.fd: int | None = None
        while self.fd is None:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                os.close(fd)
                raise ValueError(f"{os.path.dirname(self.path)} is in use by another run ({_describe(holder)}); "
                                 f"two runs in one --ckpt-dir delete each other's checkpoints: wait for it to end, "
                                 f"or choose another --ckpt-dir") from None
            # The file may have been removed (released) between our open and flock: then lock the new one.
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            holder = _read(fd)
            if "unreadable" in holder:
                os.close(fd)
                raise ValueError(f"the lock file {self.path} is unreadable (not a lock this zoo wrote: "
                                 f"{holder['unreadable']!r}), so whose it is cannot be told; if no run uses "
                                 f"{os.path.dirname(self.path)}, delete the file")
            if holder:
                if holder.get("host") != socket.gethostname():
                    os.close(fd)
                    raise ValueError(f"{os.path.dirname(self.path)} is claimed by a run on another machine "
                                     f"({_describe(holder)}); if that run has ended, delete {self.path}")
                self.taken_over = holder   # flock was free: that process is gone (or ended without cleaning up)
            self.fd = fd
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "directory": os.path.abspath(directory), **(info or {})}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, json.dumps(me).encode(), 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent); a stale record taken over is written back instead
        when the directory holds no checkpoint step (see the module docstring)."""
        if self.fd is None:
            return
        if self.taken_over and not _has_steps(os.path.dirname(self.path)):
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, json.dumps(self.taken_over).encode(), 0)
            os.fsync(self.fd)
        else:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> DirLock:
        return self

    def __exit__(self, *_exc) -> None:
        self.release()


def _has_steps(directory: str) -> bool:
    """Does `directory` hold a checkpoint step (a step-numbered folder)?"""
    try:
        return any(e.name.isdigit() and e.is_dir() for e in os.scandir(directory))
    except OSError:
        return False


def _read(fd: int) -> dict:
    raw = os.pread(fd, 1 << 16, 0)
    try:
        holder = json.loads(raw) if raw.strip() else {}
    except ValueError:
        holder = {"unreadable": raw[:80].decode(errors="replace")}
    return holder if isinstance(holder, dict) else {"unreadable": str(holder)[:80]}


def _describe(holder: dict) -> str:
    if not holder or "pid" not in holder:
        return "holder unknown"
    return f"pid {holder['pid']} on {holder.get('host', '?')}, started {holder.get('started', '?')}"
