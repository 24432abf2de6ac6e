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


def is_checkpoint_file(name: str) -> bool:
    """Is `name` one `to_hf` owns (`CHECKPOINT_FILES`: the weights and config of a checkpoint)?"""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_FILES)


def check_replaceable(path: Path) -> None:
    """ValueError naming the folder in `path` that bears a checkpoint file's name: `to_hf` replaces files and links
    of those names (a link, never what it points to), and never removes a folder a user made."""
    if not path.is_dir():
        return
    for item in sorted(path.iterdir()):
        if is_checkpoint_file(item.name) and item.is_dir() and not item.is_symlink():
            raise ValueError(f"to_hf: {item} is a folder named like a checkpoint file, which overwrite=True would "
                             f"have to remove; move or rename it")


def keep_user_files(old: Path, new: Path) -> None:
    """Hard-link (else copy) into `new` everything in `old` that is not a checkpoint file (`CHECKPOINT_FILES`, be it
    a file or a link, even a dangling one): tokenizer files, README, other safetensors files (an adapter), folders;
    symlinks stay symlinks."""
    if not old.exists():
        return
    for item in old.iterdir():
        if is_checkpoint_file(item.name) and (item.is_symlink() or not item.is_dir()):
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
