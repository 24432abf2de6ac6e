"""Training data as a pure function of (seed, step): `source.batch(k)` is the batch of step `k` (1-based) in every
run, so a resumed run sees exactly the batches an uninterrupted one would.

A batch is a dict of NumPy arrays:
- `tokens`  int32   [batch, seq + 1]: the model reads `tokens[:, :-1]` and predicts `tokens[:, 1:]`;
- `weights` float32 [batch, seq]: the loss weight of each predicted token (1 here; 0 masks a token out).

Two sources:
- `Synthetic`: sequences from a fixed random Markov chain (each token has `branching` equally likely
  successors), so a model can learn it: the loss falls from log(vocab) towards log(branching).
- `TokenFile`: real data from a file of token ids, memory-mapped.

Token-file format: a flat array of token ids, little-endian `uint16` or `uint32`, no header (NumPy's
`ids.astype("<u2").tofile(path)`; the format nanoGPT and many tokenizer scripts write). Documents are simply
concatenated (put your tokenizer's end-of-text id between them). Each batch row is a window of `seq + 1`
consecutive ids at an offset drawn from (seed, step). `write_tokens` writes such a file.
"""
from __future__ import annotations

import os
from typing import Protocol

import numpy as np

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
        rng = _rng(self.seed, step)
        tokens = np.empty((self.batch_size, self.seq + 1), np.int32)
        tokens[:, 0] = rng.integers(self.vocab, size=self.batch_size)
        choice = rng.integers(self.branching, size=(self.batch_size, self.seq))
        for t in range(self.seq):
            tokens[:, t + 1] = self.table[tokens[:, t], choice[:, t]]
        return {"tokens": tokens, "weights": np.ones((self.batch_size, self.seq), np.float32)}


class TokenFile:
    """Windows of `seq + 1` token ids from a memory-mapped file (format in the module docstring)."""

    def __init__(self, path: str | os.PathLike, *, vocab: int, batch: int, seq: int, seed: int = 0,
                 dtype: str | None = None):
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
        self.ids = np.memmap(path, dtype=DTYPES[dtype], mode="r")
        if len(self.ids) < seq + 1:
            raise ValueError(f"TokenFile: {os.fspath(path)!r} holds {len(self.ids)} ids, "
                             f"fewer than seq + 1 = {seq + 1}")
        self.path, self.vocab, self.batch_size, self.seq, self.seed = path, vocab, batch, seq, seed

    def batch(self, step: int) -> dict[str, np.ndarray]:
        starts = _rng(self.seed, step).integers(len(self.ids) - self.seq, size=self.batch_size)
        tokens = np.stack([self.ids[s:s + self.seq + 1] for s in starts]).astype(np.int32)
        if tokens.max() >= self.vocab:
            raise ValueError(f"TokenFile {os.fspath(self.path)!r}: id {int(tokens.max())} at step {step} is outside "
                             f"the model's vocabulary of {self.vocab} (wrong --data-dtype?)")
        return {"tokens": tokens, "weights": np.ones((self.batch_size, self.seq), np.float32)}


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
