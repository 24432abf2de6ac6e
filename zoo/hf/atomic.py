"""Replacing a checkpoint directory all at once: the new checkpoint is written into a folder beside it, the user's
own files (tokenizer, README) are linked in, and the folder is swapped in by rename, so a failure leaves the old
directory as it was."""
from __future__ import annotations

import fnmatch
import os
import shutil
import stat
import tempfile
from pathlib import Path

from zoo.hf.files import CHECKPOINT_FILES


def give_mode_of(path: Path, new: Path) -> None:
    """Give the folder `new` the permissions of `path` (a fresh directory's, under the umask, if it does not exist)."""
    os.chmod(new, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o777 & ~_umask())


def keep_user_files(old: Path, new: Path) -> None:
    """Hard-link (else copy) into `new` everything in `old` that is not a checkpoint file (`CHECKPOINT_FILES`):
    tokenizer files, README, folders; symlinks stay symlinks."""
    if not old.exists():
        return
    for item in old.iterdir():
        if any(fnmatch.fnmatch(item.name, pattern) for pattern in CHECKPOINT_FILES) and item.is_file():
            continue
        if item.is_symlink():
            os.symlink(os.readlink(item), new / item.name)
        elif item.is_dir():
            shutil.copytree(item, new / item.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(item, new / item.name)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def swap_in(new: Path, path: Path) -> None:
    """Put the complete directory `new` at `path`. An absent or empty `path` is replaced in one rename; a full one
    is renamed aside (`.<name>.old-*`), `new` renamed in, and only then the old one removed (were the process
    killed between the two renames, both folders are complete beside `path`)."""
    if not path.exists() or not any(path.iterdir()):
        os.replace(new, path)   # rename(2) replaces an empty directory
        return
    old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
    os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
