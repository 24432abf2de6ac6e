"""Text to training data: `--data` as text files and `--tokenizer DIR`, tokenized once into a token file.

    python -m recipes.train --data corpus/ --tokenizer my-tokenizer/ --set vocab_size=32000 --eval-every 50

- Input: a `.txt` file (one document), a `.jsonl` file (one document per line: a JSON object with a `"text"`
  field, or a JSON string), or a directory of them (every `.txt`/`.jsonl` below it, in sorted order).
- The tokenizer: a Hugging Face `tokenizer.json` (the file, or a directory holding it), read by the `tokenizers`
  package (`pip install -e ".[text]"`). Documents are encoded without the tokenizer's own special tokens and
  separated by its end-of-text id (`eos_token` of `tokenizer_config.json` beside it, else the first of the usual
  names the vocabulary holds: `<|end_of_text|>`, `<|endoftext|>`, `</s>`, `<eos>`, ...).
- Output: the token-file format of `recipes/data.py` (uint16 ids when the vocabulary fits, else uint32) in a
  cache keyed by a hash of the tokenizer file and every input file's name and bytes: a second run with the same
  inputs reads the cache and tokenizes nothing. The cache is `$ZOO_TOKEN_CACHE`, else
  `$XDG_CACHE_HOME/offload-zoo/tokens` (default `~/.cache/offload-zoo/tokens`); a file and a JSON record of what
  it holds (`<hash>.bin`, `<hash>.json`), written under a temporary name and renamed when complete.
- Long documents are encoded in pieces of about 1 MB cut after a newline (the tokenizer runs the pieces of a
  batch on all cores); a token never spans such a cut.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

SUFFIXES = (".txt", ".jsonl")
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]", "<|im_end|>")
PIECE = 1 << 20            # characters per piece handed to the tokenizer
BATCH = 64                 # pieces per call of encode_batch (and per progress update)
FORMAT = "zoo-text-v1"     # part of the cache key: bump when the way tokens are made changes


def is_text(path: str | os.PathLike) -> bool:
    """Is `--data` text (a .txt/.jsonl file, or a directory) rather than a token file?"""
    p = Path(path)
    return p.is_dir() or p.suffix in SUFFIXES


def text_files(path: str | os.PathLike) -> list[Path]:
    """The text files `--data` names, sorted; ValueError if there are none."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"--data {os.fspath(path)!r}: no such file or directory")
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"--data {os.fspath(path)!r}: a directory without .txt or .jsonl files")
    return files


def load_tokenizer(path: str | os.PathLike):
    """(tokenizers.Tokenizer, the tokenizer.json path) from a file or a directory holding tokenizer.json."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError("--tokenizer needs the `tokenizers` package: pip install -e \".[text]\"") from None
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"--tokenizer {os.fspath(path)!r}: no tokenizer.json there (a Hugging Face tokenizer "
                         f"directory or its tokenizer.json)")
    try:
        return Tokenizer.from_file(str(file)), file
    except Exception as e:  # the Rust library raises its own exception type
        raise ValueError(f"--tokenizer {os.fspath(file)!r} is not a readable tokenizer.json: {e}") from None


def eos_id(tok, file: Path) -> int:
    """The end-of-text id that separates documents (see the module docstring); ValueError if none is found."""
    names = list(EOS_NAMES)
    config = file.parent / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        names.insert(0, eos.get("content") if isinstance(eos, dict) else eos)
    for name in names:
        if name and tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    raise ValueError(f"--tokenizer {os.fspath(file)!r}: no end-of-text token found (tried eos_token of "
                     f"tokenizer_config.json and {', '.join(EOS_NAMES)}): documents could not be separated")


def documents(file: Path) -> Iterator[str]:
    """The documents of one text file: a .txt file is one; a .jsonl file has one per line."""
    if file.suffix == ".txt":
        yield file.read_text(encoding="utf-8", errors="replace")
        return
    with open(file, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--data {os.fspath(file)!r} line {n} is not JSON: {e}") from None
            text = record.get("text") if isinstance(record, dict) else record
            if not isinstance(text, str):
                raise ValueError(f"--data {os.fspath(file)!r} line {n}: expected a JSON string or an object with "
                                 f"a \"text\" string")
            yield text


def pieces(text: str) -> Iterator[str]:
    """`text` in pieces of about PIECE characters, each cut after a newline where there is one."""
    start = 0
    while start < len(text):
        end = min(start + PIECE, len(text))
        if end < len(text):
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end
        yield text[start:end]
        start = end


def content_hash(files: list[Path], tokenizer_file: Path, root: Path) -> str:
    """A hash of the tokenizer file and every input file's name (relative to `root`) and bytes."""
    h = hashlib.sha256(FORMAT.encode())
    for f in [tokenizer_file, *files]:
        h.update(os.fspath(f.relative_to(root) if f != tokenizer_file and root.is_dir() else f.name).encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    if os.environ.get("ZOO_TOKEN_CACHE"):
        return Path(os.environ["ZOO_TOKEN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "offload-zoo" / "tokens"


def prepare(data: str | os.PathLike, tokenizer: str | os.PathLike, *, vocab: int,
            say: Callable[[str], None] = print, progress: Callable | None = None) -> tuple[Path, str]:
    """(token file, its dtype) for the text `data` under `tokenizer`: from the cache, else tokenized now.
    ValueError (before anything is tokenized) when the tokenizer's vocabulary exceeds the model's `vocab`.
    `progress(total_bytes)` returns a callable taking the bytes done (a progress bar); default: a line now and
    then."""
    tok, tok_file = load_tokenizer(tokenizer)
    if tok.get_vocab_size() > vocab:
        raise ValueError(f"--tokenizer {os.fspath(tok_file)!r} has {tok.get_vocab_size():,} tokens, more than the "
                         f"model's vocabulary of {vocab:,}: add --set vocab_size={tok.get_vocab_size()}")
    files = text_files(data)
    eos = eos_id(tok, tok_file)
    dtype = "uint16" if tok.get_vocab_size() <= 2 ** 16 else "uint32"
    key = content_hash(files, tok_file, Path(data))
    out = cache_dir() / f"{key}.bin"
    if out.is_file() and out.with_suffix(".json").is_file():
        record = json.loads(out.with_suffix(".json").read_text())
        say(f"tokens of {os.fspath(data)}: {record['tokens']:,} from the cache {out}")
        return out, record["dtype"]
    out.parent.mkdir(parents=True, exist_ok=True)
    total = sum(f.stat().st_size for f in files)
    say(f"tokenizing {len(files)} file(s), {total / 2 ** 20:.1f} MiB, with {tok_file} (eos id {eos}) "
        f"into {out} ...")
    t0 = time.perf_counter()
    advance = (progress or _lines(say))(total)
    n = _tokenize(tok, files, eos, dtype, out.with_suffix(".tmp"), advance)
    advance(total)   # a .jsonl file's text is shorter than its bytes: close the bar at 100%
    seconds = time.perf_counter() - t0
    record = {"format": FORMAT, "tokens": n, "dtype": dtype, "eos_id": eos, "vocab_size": tok.get_vocab_size(),
              "tokenizer": os.fspath(tok_file), "files": [os.fspath(f) for f in files], "bytes": total,
              "seconds": round(seconds, 3)}
    out.with_suffix(".tmp").replace(out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    say(f"tokenized {total / 2 ** 20:.1f} MiB into {n:,} tokens in {seconds:.1f} s "
        f"({n / max(seconds, 1e-9):,.0f} tokens/s); cached as {out}")
    return out, dtype


def _tokenize(tok, files: list[Path], eos: int, dtype: str, path: Path, advance: Callable[[int], None]) -> int:
    """Encode every document of `files` (EOS after each) into the token file `path`; the number of tokens."""
    np_dtype = np.dtype("<u2" if dtype == "uint16" else "<u4")   # the token-file format (recipes/data.py)
    n, done = 0, 0
    with open(path, "wb") as out:
        def flush(batch: list[str], ends: list[bool]) -> None:
            nonlocal n, done
            for enc, end, text in zip(tok.encode_batch(batch, add_special_tokens=False), ends, batch):
                ids = np.asarray(enc.ids + ([eos] if end else []), np_dtype)
                ids.tofile(out)
                n += len(ids)
                done += len(text.encode("utf-8", errors="replace"))
            advance(done)

        batch, ends = [], []
        for file in files:
            for doc in documents(file):
                parts = list(pieces(doc)) or [""]
                for i, part in enumerate(parts):
                    batch.append(part)
                    ends.append(i == len(parts) - 1)
                    if len(batch) == BATCH:
                        flush(batch, ends)
                        batch, ends = [], []
        if batch:
            flush(batch, ends)
    return n


def _lines(say: Callable[[str], None]) -> Callable[[int], Callable[[int], None]]:
    """Progress as a line every 10% (for a log file; the main job shows a bar on a terminal)."""
    def start(total: int) -> Callable[[int], None]:
        marks = iter(range(10, 101, 10))
        mark = next(marks)

        def advance(done: int) -> None:
            nonlocal mark
            while mark is not None and total and 100 * done >= mark * total:
                say(f"  tokenized {mark}%")
                mark = next(marks, None)
        return advance
    return start
