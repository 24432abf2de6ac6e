"""The data a run reads is part of its identity: a token file's dtype, size and fingerprint are
recorded and `--resume` on another file is refused unless --allow-data-change; uint32 ids read as uint16 (and the
reverse) are caught before training; a file that shrinks under a run stops it with a message, not SIGBUS."""
from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

from recipes.train import loop
from recipes.train.checkpoints import resume
from recipes.train.inputs import data as data_lib
from recipes.train.settings.job import resolve
from tests.train.token_files import write_tokens


def tokens(path, n=20_000, vocab=256, dtype="uint16", seed=0):
    write_tokens(path, np.random.default_rng(seed).integers(vocab, size=n), dtype)
    return path


def test_uint_width_mismatches_are_caught_at_start(tmp_path):
    """uint32 ids read as uint16 (every second value 0: the high halves) and uint16 ids read as uint32 (ids far
    outside the vocabulary) are refused when the file is opened, naming the flag to fix."""
    wide = tokens(tmp_path / "wide.bin", dtype="uint32")
    with pytest.raises(ValueError, match="looks like uint32 ids read as uint16: 100% of the odd-numbered"):
        data_lib.TokenFile(wide, vocab=256, batch=2, seq=16)
    narrow = tokens(tmp_path / "narrow.bin", dtype="uint16")
    with pytest.raises(ValueError, match=r"is outside the model's vocabulary of 256 \(read as uint32: wrong "
                                         r"--data-dtype\?\)"):
        data_lib.TokenFile(narrow, vocab=256, batch=2, seq=16, dtype="uint32")
    assert data_lib.TokenFile(wide, vocab=256, batch=2, seq=16, dtype="uint32").batch(1)["tokens"].max() < 256


def test_a_file_shrinking_under_the_run_stops_it_with_a_message(tmp_path):
    """Truncating the token file while a run reads it raises DataError (an OSError: exit 1) naming the file and both
    sizes, instead of killing the process with SIGBUS."""
    path = tokens(tmp_path / "t.bin")
    src = data_lib.TokenFile(path, vocab=256, batch=2, seq=16)
    src.batch(1)
    os.truncate(path, 1000)
    with pytest.raises(data_lib.DataError, match=r"--data '.*t.bin' shrank from 40,000 to 1,000 bytes while the run "
                                                 r"read it"):
        src.batch(2)


def test_resume_on_another_token_file_is_refused(tmp_path):
    """The checkpoint's record holds the file's path, dtype, size and fingerprint; a file rewritten in place (same
    path and size, other ids) is refused on --resume, and accepted with --allow-data-change."""
    path = tokens(tmp_path / "t.bin")
    settings = loop.RunConfig(steps=4, batch=2, seq=16, data=str(path), ckpt_dir=str(tmp_path / "c"), resume=True)
    before = data_lib.TokenFile(path, vocab=256, batch=2, seq=16).identity()
    assert set(before) == {"path", "dtype", "bytes", "fingerprint"} and before["bytes"] == 40_000
    record = {"run": settings.identity(), "data": before}
    resume.check_resumable(record, resolve(settings), "c", before)                 # the same file: resumable
    tokens(path, seed=1)
    after = data_lib.TokenFile(path, vocab=256, batch=2, seq=16).identity()
    assert after["fingerprint"] != before["fingerprint"] and after["bytes"] == before["bytes"]
    with pytest.raises(ValueError, match=r"--resume: --data .*t.bin is not the file the run in c read \(fingerprint: "
                                         r"checkpoint .*--allow-data-change"):
        resume.check_resumable(record, resolve(settings), "c", after)
    moved = loop.RunConfig(**{**settings.__dict__, "data": str(tmp_path / "other.bin"), "allow_data_change": True})
    resume.check_resumable(record, resolve(moved), "c", after)              # allowed: another path and content


def test_token_ids_out_of_range_are_refused(tiny_model, tmp_path):
    path = tmp_path / "tokens.bin"
    ids = np.arange(100) % 30
    ids[57] = 300
    write_tokens(path, ids, "uint16")
    # Found in the sample read at start (recipes.train.inputs.data.TokenFile), before training; else by the batch that
    # reads it.
    with pytest.raises(ValueError, match=f"TokenFile '{path}': id 300 at position 57 is outside the model's vocab"):
        data_lib.TokenFile(path, vocab=32, batch=4, seq=90, seed=0, dtype="uint16")
    good = jnp.zeros((1, 4), jnp.int32)
    for bad in (32, -1):
        with pytest.raises(ValueError, match=rf"token id {bad} at \[0, 2\] is outside the vocabulary \[0, 32\)"):
            tiny_model(good.at[0, 2].set(bad))
