"""A checkpoint step's manifest: what the step wrote, so that a restore can tell that it reads the same bytes.

`write_manifest(folder, step)`, once a step is complete (every process's files written and the step folder
renamed into place by orbax), writes `zoo-manifest.json` into it: the step number and each file's size and
sha256, atomically (a temporary file renamed) and last, so a step with a manifest was complete when written.
`check_manifest(folder, step)` says why a folder is not what its manifest recorded (bytes flipped with the size
kept, a file or folder deleted, a state copied from another step, a manifest of another step, none at all), or
None. A file the manifest does not list (a `.DS_Store`, a note) is not damage: nothing reads it; `unlisted(folder)`
names those files. Hashing reads every byte once: several files at a time (hashlib releases the GIL).
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os

MANIFEST = "zoo-manifest.json"   # in a step folder, written last: the step and each file's size and sha256


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(folder: str) -> list[str]:
    """Every file under `folder` (relative paths, sorted) but the manifest."""
    out = []
    for root, _, names in os.walk(folder):
        out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(f for f in out if f != MANIFEST and not f.startswith(MANIFEST + "."))


def _digests(folder: str, files: list[str]) -> list[str]:
    """The files' sha256, read in parallel (hashlib releases the GIL while it hashes)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(lambda f: _sha256(os.path.join(folder, f)), files))


def write_manifest(folder: str, step: int) -> None:
    """The manifest of a complete step folder: its step and each file's size and sha256; written atomically (a
    temporary file renamed), after everything else, so that a step with a manifest was complete when it was
    written."""
    files = _files(folder)
    body = {"step": step, "files": {f: [os.path.getsize(os.path.join(folder, f)), d]
                                    for f, d in zip(files, _digests(folder, files))}}
    tmp = os.path.join(folder, f"{MANIFEST}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, MANIFEST))
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlisted(folder: str) -> list[str]:
    """The files of the step folder that its manifest does not list (relative paths; none without a manifest)."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            listed = set(json.load(f)["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [f for f in _files(folder) if f not in listed]


def check_manifest(folder: str, step: int) -> str | None:
    """Why the step folder is not what its manifest says it wrote (a file missing, of another size or with other
    bytes; files missing and others in their place; the manifest of another step), or None. Files it does not list
    are no damage (`unlisted`)."""
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            body = json.load(f)
        files = {str(k): (int(v[0]), str(v[1])) for k, v in body["files"].items()}
        written = body["step"]
    except FileNotFoundError:
        return f"its manifest {path} is missing (written last: the step was not completed, or it was deleted)"
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        return f"its manifest {path} is unreadable: {e}"
    if written != step:
        return f"its manifest {path} is of step {written}: its files were copied from another step"
    have = _files(folder)
    missing, extra = sorted(set(files) - set(have)), sorted(set(have) - set(files))
    if missing and extra:
        return (f"its files are not the ones written with the step ({len(missing)} missing, {len(extra)} not in its "
                f"manifest, e.g. {os.path.join(folder, extra[0])}): replaced by another step's?")
    if missing:
        return f"{os.path.join(folder, missing[0])} is missing" + (f" (and {len(missing) - 1} more files)"
                                                                     if len(missing) > 1 else "")
    try:   # (several processes: process 0 may be setting the step aside while another reads it)
        for f in files:
            size = os.path.getsize(os.path.join(folder, f))
            if size != files[f][0]:
                return f"{os.path.join(folder, f)} has {size:,} bytes, its manifest says {files[f][0]:,}"
        names = sorted(files)
        digests = _digests(folder, names)
    except OSError as e:
        return f"{e.filename or folder} cannot be read: {e.strerror or e}"
    for f, d in zip(names, digests):
        if d != files[f][1]:
            return f"{os.path.join(folder, f)} does not hold the bytes written (its sha256 differs from the manifest's)"
    return None
