"""Training data as a pure function of (seed, step): `source.batch(k)` is the batch of step `k` (1-based) in every
run, so a resumed run sees exactly the batches an uninterrupted one would.

A batch is a dict of NumPy arrays:
- `tokens`  int32   [batch, seq + 1]: the model reads `tokens[:, :-1]` and predicts `tokens[:, 1:]`;
- `weights` float32 [batch, seq]: the loss weight of each predicted token (1 here; 0 masks a token out).

Two sources:
- `Synthetic`: sequences from a fixed random Markov chain (each token has `branching` equally likely
  successors), so a model can learn it: the loss falls from log(vocab) towards log(branching).
- `TokenFile`: real data from a file of token ids, memory-mapped; text files with a tokenizer become one
  (`recipes/text.py`, through `open_data`).

Held-out data (`--eval-every`): `source.eval_batch(i)` is the i-th held-out batch. A token file's held-out split
is its last `heldout` fraction of ids (training windows never reach into it); the synthetic source draws held-out
sequences from streams no training step uses.

Token-file format: a flat array of token ids, little-endian `uint16` or `uint32`, no header (NumPy's
`ids.astype("<u2").tofile(path)`; the format nanoGPT and many tokenizer scripts write). Documents are simply
concatenated (put your tokenizer's end-of-text id between them). Each batch row is a window of `seq + 1`
consecutive ids at an offset drawn from (seed, step). `write_tokens` writes such a file.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

import numpy as np

from recipes import text

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


class Source(Protocol):
    def batch(self, step: int) -> dict[str, np.ndarray]: ...


def _rng(seed: int, step: int) -> np.random.Generator:
    # A distinct stream per (seed, step); steps count from 1, apart from the seed-only stream of the Markov table.
    return np.random.default_rng([seed, step])


class Synthetic:
    """Sequences of a fixed random Markov chain over `vocab` tokens, `branching` successors per token."""

    def __init__(self, *, vocab: int, batch: int, seq: int, seed: int = 0, branching: int = 4):
        for field, v in (("vocab", vocab), ("batch", batch), ("seq", seq), ("branching", branching)):
            if v <= 0:
                raise ValueError(f"Synthetic.{field} must be positive, got {v}")
        if branching > vocab:
            raise ValueError(f"Synthetic.branching ({branching}) must be at most vocab ({vocab})")
        self.vocab, self.batch_size, self.seq, self.seed, self.branching = vocab, batch, seq, seed, branching
        self.table = np.random.default_rng([seed]).integers(vocab, size=(vocab, branching), dtype=np.int32)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self._sample(_rng(self.seed, step))

    def eval_batch(self, i: int) -> dict[str, np.ndarray]:
        return self._sample(np.random.default_rng([self.seed, 0, i]))   # step 0 is never a training step

    def _sample(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        tokens = np.empty((self.batch_size, self.seq + 1), np.int32)
        tokens[:, 0] = rng.integers(self.vocab, size=self.batch_size)
        choice = rng.integers(self.branching, size=(self.batch_size, self.seq))
        for t in range(self.seq):
            tokens[:, t + 1] = self.table[tokens[:, t], choice[:, t]]
        return {"tokens": tokens, "weights": np.ones((self.batch_size, self.seq), np.float32)}


class TokenFile:
    """Windows of `seq + 1` token ids from a memory-mapped file (format in the module docstring), drawn from the
    ids in `span` (fractions of the file: (0, 0.99) trains on all but the last 1%)."""

    def __init__(self, path: str | os.PathLike, *, vocab: int, batch: int, seq: int, seed: int = 0,
                 dtype: str | None = None, span: tuple[float, float] = (0.0, 1.0)):
        if dtype is None:
            dtype = "uint16" if vocab <= 2 ** 16 else "uint32"
        if dtype not in DTYPES:
            raise ValueError(f"TokenFile.dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if dtype == "uint16" and vocab > 2 ** 16:
            raise ValueError(f"TokenFile.dtype uint16 cannot hold ids of a {vocab}-token vocabulary; use uint32")
        if not os.path.isfile(path):
            raise ValueError(f"TokenFile.path: no such file {os.fspath(path)!r}")
        size = os.path.getsize(path)
        if size % DTYPES[dtype].itemsize:
            raise ValueError(f"TokenFile: {os.fspath(path)!r} has {size} bytes, not a whole number of {dtype} ids")
        ids = np.memmap(path, dtype=DTYPES[dtype], mode="r")
        lo, hi = (round(f * len(ids)) for f in span)
        self.ids = ids[lo:hi]
        if len(self.ids) < seq + 1:
            raise ValueError(f"TokenFile: {os.fspath(path)!r} holds {len(self.ids)} ids"
                             + (f" in its {hi - lo}-id split {span}" if span != (0.0, 1.0) else "")
                             + f", fewer than seq + 1 = {seq + 1}")
        self.path, self.vocab, self.batch_size, self.seq, self.seed = path, vocab, batch, seq, seed
        self._check_ids(lo)

    def _check_ids(self, offset: int) -> None:
        """Every id of the split is checked once, here (a chunk at a time), not batch by batch: a bad id fails
        the run before it compiles, wherever it is."""
        chunk = 1 << 24
        for start in range(0, len(self.ids), chunk):
            part = self.ids[start:start + chunk]
            if int(part.max()) >= self.vocab:
                at = offset + start + int(np.argmax(part >= self.vocab))
                raise ValueError(f"TokenFile {os.fspath(self.path)!r}: id {int(part.max())} at position {at:,} is "
                                 f"outside the model's vocabulary of {self.vocab} (wrong --data-dtype?)")

    def batch(self, step: int) -> dict[str, np.ndarray]:
        starts = _rng(self.seed, step).integers(len(self.ids) - self.seq, size=self.batch_size)
        return self._windows(starts)

    def eval_batch(self, i: int) -> dict[str, np.ndarray]:
        """The i-th batch of consecutive, non-overlapping windows (wrapping around the split)."""
        rows = np.arange(i * self.batch_size, (i + 1) * self.batch_size)
        return self._windows(rows * (self.seq + 1) % (len(self.ids) - self.seq))

    def eval_batches(self) -> int:
        """How many eval batches cover the split once."""
        return max(1, len(self.ids) // ((self.seq + 1) * self.batch_size))

    def _windows(self, starts) -> dict[str, np.ndarray]:
        tokens = np.stack([self.ids[s:s + self.seq + 1] for s in starts]).astype(np.int32)
        return {"tokens": tokens, "weights": np.ones((self.batch_size, self.seq), np.float32)}


def open_data(path: str | os.PathLike, *, tokenizer: str | None, vocab: int, batch: int, seq: int, seed: int,
              dtype: str | None, heldout: float = 0.0, say: Callable[[str], None] = print,
              progress: Callable | None = None) -> tuple[TokenFile, TokenFile | None]:
    """(training source, held-out source or None) for `--data PATH`: a token file, or text files tokenized
    with `--tokenizer` (`recipes.text.prepare`: once, cached by content). `heldout`: the fraction of ids kept
    out of training, at the end of the file."""
    if not 0 <= heldout < 1:
        raise ValueError(f"--heldout must be a fraction in [0, 1), got {heldout}")
    if text.is_text(path):
        if tokenizer is None:
            raise ValueError(f"--data {os.fspath(path)!r} is text: it needs --tokenizer DIR (a Hugging Face "
                             f"tokenizer.json)")
        if dtype is not None:
            raise ValueError("--data-dtype is for token files; text is tokenized into the tokenizer's dtype")
        path, dtype = text.prepare(path, tokenizer, vocab=vocab, say=say, progress=progress)
    elif tokenizer is not None:
        raise ValueError(f"--tokenizer is for text data (.txt, .jsonl or a directory of them); --data "
                         f"{os.fspath(path)!r} is read as a token file")
    split = 1.0 - heldout
    kwargs = dict(vocab=vocab, batch=batch, seq=seq, seed=seed, dtype=dtype)
    train = TokenFile(path, span=(0.0, split), **kwargs)
    return train, TokenFile(path, span=(split, 1.0), **kwargs) if heldout else None


def write_tokens(path: str | os.PathLike, ids, dtype: str = "uint16") -> None:
    """Write token ids in the token-file format."""
    ids = np.asarray(ids)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(DTYPES[dtype]).max):
        raise ValueError(f"token ids out of range for {dtype}")
    ids.astype(DTYPES[dtype]).tofile(path)


class Poisoned:
    """`source` with the loss weights of one step set to NaN: a corrupted record, for testing the NaN guard."""

    def __init__(self, source: Source, step: int):
        self.source, self.step = source, step

    def batch(self, step: int) -> dict[str, np.ndarray]:
        b = self.source.batch(step)
        if step == self.step:
            b = {**b, "weights": np.full_like(b["weights"], np.nan)}
        return b
