"""Paths a run recorded, found again after its folder moved (`mv run1 run2`, then the same command in run2).

A checkpoint's record and the checkpoint directory's lock hold the directory they were written in (`directory`)
beside the absolute paths of the run's files (its --metrics file, its token file). When the checkpoint directory
is elsewhere now, a recorded path is also looked for at the same place relative to it (`rebased`): a file inside
the folder that moved moved with it, and one outside it stayed where it was. Either place is the run's own.
"""
from __future__ import annotations

import os


def rebased(path: str | None, then: str | None, now: str | os.PathLike) -> str | None:
    """`path`, recorded when the checkpoint directory was `then`, where it is if it moved with the directory (now
    `now`); `path` itself when the directory did not move or its old place is not recorded."""
    if not path or not then or os.path.abspath(then) == os.path.abspath(now):
        return path
    return os.path.normpath(os.path.join(os.path.abspath(now), os.path.relpath(path, then)))


def same(recorded: str | None, path: str | os.PathLike | None, then: str | None, now: str | os.PathLike) -> bool:
    """Is `path` the file recorded as `recorded`, where it was or where it moved with the checkpoint directory?"""
    if recorded is None or path is None:
        return False
    return os.path.abspath(path) in {recorded, rebased(recorded, then, now)}
