"""Training data as a pure function of (seed, step): `source.batch(k)` is the batch of step `k` (1-based) in every run,
so a resumed run sees exactly the batches an uninterrupted one would.

A batch is a dict of NumPy arrays: `tokens` int32 [batch, seq + 1] (the model reads `tokens[:, :-1]` and predicts
`tokens[:, 1:]`) and `weights` float32 [batch, seq] (each predicted token's loss weight). Two sources: `Synthetic`
(sequences from a fixed random Markov chain a model can learn) and `TokenFile` (a file of token ids, read with
`os.pread`; text files with a tokenizer become one, `open_data`). `source.eval_batch(i)` is the i-th held-out batch
(`--eval-every`): a token file's last `heldout` fraction of ids, or synthetic streams no training step uses.
`sources(job.data, ...)` opens what a run reads, as its resolved settings say.

Token-file format: a flat array of token ids, little-endian `uint16` or `uint32`, no header (NumPy's
`ids.astype("<u2").tofile(path)`); documents are concatenated (put an end-of-text id between them), and each batch row
is a window of `seq + 1` ids at an offset drawn from (seed, step).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
from rich.console import Console

from recipes.train.inputs import text
from recipes.train.inputs.text import DTYPES, fingerprint  # noqa: F401  (the token file's own facts)
from recipes.train.settings.job import Data
from recipes.train.watching import watch


class Source(Protocol):
    def batch(self, step: int) -> dict[str, np.ndarray]: ...

    def identity(self) -> dict | None: ...   # what a checkpoint records of the data (None: nothing beyond the seed)


def _rng(seed: int, step: int) -> np.random.Generator:
    # A distinct stream per (seed, step); steps count from 1, apart from the seed-only stream of the Markov table.
    return np.random.default_rng([seed, step])


class Synthetic:
    """Sequences of a fixed random Markov chain over `vocab` tokens, `branching` successors per token."""

    def identity(self) -> None:   # a pure function of the seed: the run's identity covers it
        return None

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


class DataError(OSError):
    """The token file changed under the run (it shrank, or a read came back short): the run stops."""


class TokenFile:
    """Windows of `seq + 1` token ids from a file (format in the module docstring), drawn from the ids in `span`
    (fractions of the file: (0, 0.99) trains on all but the last 1%), read with `os.pread` from a descriptor held
    for the run: a file that shrinks under the run stops it with a `DataError` naming the file (a memory map would
    kill the process with SIGBUS), and a file replaced by a rename is not seen (the run reads the one it started
    with).

    At start it reads a sample of ids (`SAMPLE_CHUNKS` chunks spread over the split) and refuses, before training,
    a sample holding ids outside the vocabulary, or one whose every second uint16 is 0 while the others are not
    (uint32 ids read as uint16: the high halves); every batch is checked as it is read. `identity()` is what a
    checkpoint records of the file: path, dtype, size and a fingerprint (`fingerprint`)."""

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
        self.path, self.vocab, self.batch_size, self.seq, self.seed = path, vocab, batch, seq, seed
        self.dtype, self.item = dtype, DTYPES[dtype]
        self.file = open(path, "rb")  # noqa: SIM115  (held for the run: see the class docstring)
        self.size = os.fstat(self.file.fileno()).st_size
        if self.size % self.item.itemsize:
            raise ValueError(f"TokenFile: {os.fspath(path)!r} has {self.size} bytes, not a whole number of {dtype} "
                             f"ids (wrong --data-dtype?)")
        total = self.size // self.item.itemsize
        self.lo, hi = (round(f * total) for f in span)
        self.n_ids = hi - self.lo
        if self.n_ids < seq + 1:
            raise ValueError(f"TokenFile: {os.fspath(path)!r} holds {self.n_ids} ids"
                             + (f" in its split {span} of {total}" if span != (0.0, 1.0) else "")
                             + f", fewer than seq + 1 = {seq + 1}")
        self._check_sample()

    def _read(self, start: int, n: int) -> np.ndarray:
        """The split's ids[start:start + n]; DataError if the file is no longer as long as it was at start."""
        now = os.fstat(self.file.fileno()).st_size
        raw = (os.pread(self.file.fileno(), n * self.item.itemsize, (self.lo + start) * self.item.itemsize)
               if now >= self.size else b"")
        if len(raw) < n * self.item.itemsize:
            raise DataError(f"--data {os.fspath(self.path)!r} shrank from {self.size:,} to {now:,} bytes while the "
                            f"run read it: the run stops (its checkpoints are intact; restore the file, or resume on "
                            f"the new one with --allow-data-change)")
        return np.frombuffer(raw, self.item)

    def _check_sample(self) -> None:
        chunk = min(SAMPLE_IDS, self.n_ids) & ~1   # even: a uint32 id is two uint16 ids, low half first
        starts = sorted({(k * (self.n_ids - chunk) // max(SAMPLE_CHUNKS - 1, 1)) & ~1 for k in range(SAMPLE_CHUNKS)})
        chunks = {start: self._read(start, chunk) for start in starts}
        for start, ids in chunks.items():
            if ids.size and int(ids.max()) >= self.vocab:
                at = self.lo + start + int(np.argmax(ids >= self.vocab))
                raise ValueError(f"TokenFile {os.fspath(self.path)!r}: id {int(ids.max())} at position {at:,} "
                                 f"is outside the model's vocabulary of {self.vocab} (read as {self.dtype}: wrong "
                                 f"--data-dtype?)")
        sample = np.concatenate(list(chunks.values()))
        if self.dtype == "uint16" and sample.size >= 512:
            odd, even = np.mean(sample[1::2] == 0), np.mean(sample[0::2] == 0)
            if odd > 0.95 and even < 0.5:
                raise ValueError(f"TokenFile {os.fspath(self.path)!r} looks like uint32 ids read as uint16: "
                                 f"{100 * odd:.0f}% of the odd-numbered uint16 values are 0 (the high halves), "
                                 f"{100 * even:.0f}% of the others; pass --data-dtype uint32")

    def identity(self) -> dict:
        return {"path": os.path.abspath(self.path), "dtype": self.dtype, "bytes": self.size,
                "fingerprint": fingerprint(self.file.fileno(), self.size)}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        starts = _rng(self.seed, step).integers(self.n_ids - self.seq, size=self.batch_size)
        return self._windows(starts, f"at step {step}")

    def eval_batch(self, i: int) -> dict[str, np.ndarray]:
        """The i-th batch of consecutive, non-overlapping windows (wrapping around the split)."""
        rows = np.arange(i * self.batch_size, (i + 1) * self.batch_size)
        return self._windows(rows * (self.seq + 1) % (self.n_ids - self.seq), f"in held-out batch {i}")

    def eval_batches(self) -> int:
        """How many eval batches cover the split once."""
        return max(1, self.n_ids // ((self.seq + 1) * self.batch_size))

    def _windows(self, starts, where: str) -> dict[str, np.ndarray]:
        tokens = np.stack([self._read(int(s), self.seq + 1) for s in starts]).astype(np.int32)
        if tokens.max() >= self.vocab:
            raise ValueError(f"TokenFile {os.fspath(self.path)!r}: id {int(tokens.max())} {where} is outside "
                             f"the model's vocabulary of {self.vocab} (wrong --data-dtype?)")
        return {"tokens": tokens, "weights": np.ones((self.batch_size, self.seq), np.float32)}


SAMPLE_CHUNKS, SAMPLE_IDS = 16, 4096      # the start-up sample: 16 chunks of 4096 ids spread over the file
def open_data(path: str | os.PathLike, *, tokenizer: str | None, vocab: int, batch: int, seq: int, seed: int,
              dtype: str | None, heldout: float = 0.0, say: Callable[[str], None] = print,
              progress: Callable | None = None, encoding: str | None = None) -> tuple[TokenFile, TokenFile | None]:
    """(training source, held-out source or None) for `--data PATH`: a token file, or text files tokenized
    with `--tokenizer` (`recipes.train.inputs.text.prepare`: once, cached by content; `encoding`: `--text-encoding`).
    `heldout`: the fraction of ids kept out of training, at the end of the file."""
    if not 0 <= heldout < 1:
        raise ValueError(f"--heldout must be a fraction in [0, 1), got {heldout}")
    if not os.path.exists(path):
        raise ValueError(f"--data {os.fspath(path)!r}: no such file or directory (a token file, a .txt or .jsonl "
                         f"file, or a directory of them)")
    given = path
    if text.is_text(path):
        if tokenizer is None:
            raise ValueError(f"--data {os.fspath(path)!r} is text: it needs --tokenizer DIR (a Hugging Face "
                             f"tokenizer.json)")
        if dtype is not None:
            raise ValueError("--data-dtype is for token files; text is tokenized into the tokenizer's dtype")
        path, dtype = text.prepare(path, tokenizer, vocab=vocab, say=say, progress=progress, encoding=encoding)
    elif tokenizer is not None:
        raise ValueError(f"--tokenizer is for text data (.txt, .jsonl or a directory of them); --data "
                         f"{os.fspath(path)!r} is read as a token file")
    elif encoding is not None:
        raise ValueError(f"--text-encoding is for text data (.txt, .jsonl or a directory of them); --data "
                         f"{os.fspath(path)!r} is read as a token file")
    split = 1.0 - heldout
    kwargs = dict(vocab=vocab, batch=batch, seq=seq, seed=seed, dtype=dtype)
    try:
        train = TokenFile(path, span=(0.0, split), **kwargs)
        return train, TokenFile(path, span=(split, 1.0), **kwargs) if heldout else None
    except ValueError as e:
        if given == path:
            raise
        raise ValueError(f"--data {os.fspath(given)!r}, tokenized: {e}") from None   # named as the user gave it


class Poisoned:
    """`source` with the loss weights of one step set to NaN: a corrupted record, for testing the NaN guard."""

    def __init__(self, source: Source, step: int):
        self.source, self.step = source, step

    def identity(self) -> dict | None:
        return self.source.identity()

    def batch(self, step: int) -> dict[str, np.ndarray]:
        b = self.source.batch(step)
        if step == self.step:
            b = {**b, "weights": np.full_like(b["weights"], np.nan)}
        return b


def sources(data: Data, vocab: int, batch: int, seq: int, console: Console) -> tuple[Source, Any]:
    """(training source, held-out source or None: without --eval-every) of a run's resolved data settings (`Data`):
    its token file or text (`open_data`, with a progress bar on a terminal), else the synthetic source; poisoned at
    --poison-step."""
    if data.path:
        src, held = open_data(data.path, tokenizer=data.tokenizer, vocab=vocab, batch=batch, seq=seq, seed=data.seed,
                              dtype=data.dtype, heldout=data.held_out, encoding=data.encoding,
                              say=lambda m: console.print(m, soft_wrap=True, markup=False),
                              progress=watch.bytes_bar(console) if console.is_terminal else None)
    else:
        src = held = Synthetic(vocab=vocab, batch=batch, seq=seq, seed=data.seed)
    src = Poisoned(src, data.poison_step) if data.poison_step is not None else src
    return src, held if data.evaluate else None
