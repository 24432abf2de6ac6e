"""Text to training data: `--data` as text files and `--tokenizer DIR`, tokenized once into a token file.

    python -m recipes.train --data corpus/ --tokenizer my-tokenizer/ --set vocab_size=32000 --eval-every 50

- Input: a `.txt` file (one document), a `.jsonl` file (a document per line), or a directory of them; strict UTF-8
  unless `--text-encoding` names another; a file that does not decode, holds NUL bytes or no text is refused naming the
  file (and line or byte).
- The tokenizer: a Hugging Face `tokenizer.json` (or its directory), read by `tokenizers`; documents are encoded without
  special tokens and separated by its end-of-text id.
- Output: a token file (`recipes/train/inputs/data.py`'s format) in a cache keyed by the tokenizer, the end-of-text id,
  the encoding and every input's name and bytes (`$ZOO_TOKEN_CACHE`, else `~/.cache/offload-zoo/tokens`), written under
  a temporary name and renamed when complete; a second run tokenizing the same inputs waits for the first
  (`fcntl.flock`).

The cache's files, the end-of-text id's lookup and long documents: docs/internals.md, "Text data".
"""
from __future__ import annotations

import codecs
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

SUFFIXES = (".txt", ".jsonl")
EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]", "<|im_end|>")
PIECE = 1 << 20            # characters per piece handed to the tokenizer
BATCH = 64                 # pieces per call of encode_batch (and per progress update)
FORMAT = "zoo-text-v2"     # part of the cache key: bump when the way tokens are made changes
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")  # hashed into the key


# What a token file is: its dtypes (the ids of a `.bin`, little-endian) and the fingerprint that tells one file's
# contents from another's without reading it all (the training data reader, `recipes.train.inputs.data`, reads them).
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

FINGERPRINT_CHUNKS, FINGERPRINT_BYTES = 64, 1 << 16


def fingerprint(fd: int, size: int) -> str:
    """SHA-256 of a file's size and 64 chunks of 64 KiB spread evenly over it (the whole file up to 4 MiB): a
    token file rewritten, re-tokenized, appended to or cut changes it, and reading it costs milliseconds even
    for terabytes. An edit confined to the bytes between the chunks is not seen."""
    h = hashlib.sha256(str(size).encode())
    n = min(FINGERPRINT_CHUNKS, -(-size // FINGERPRINT_BYTES))
    for k in range(n):
        offset = 0 if n == 1 else k * (size - FINGERPRINT_BYTES) // (n - 1)
        h.update(os.pread(fd, FINGERPRINT_BYTES, max(offset, 0)))
    return h.hexdigest()[:32]


def is_text(path: str | os.PathLike) -> bool:
    """Is `--data` text (a .txt/.jsonl file, or a directory) rather than a token file?"""
    p = Path(path)
    return p.is_dir() or p.suffix.lower() in SUFFIXES


def found(directory: Path) -> tuple[list[Path], list[Path]]:
    """(the text files below `directory`, the other files), each sorted. A suffix is matched in any case."""
    every = sorted(f for f in directory.rglob("*") if f.is_file())
    return [f for f in every if f.suffix.lower() in SUFFIXES], [f for f in every if f.suffix.lower() not in SUFFIXES]


def text_files(path: str | os.PathLike, flag: str = "--data") -> tuple[list[Path], list[Path]]:
    """(the text files `flag` names, sorted; the files of its directory that are skipped); ValueError if there
    are none."""
    p = Path(path)
    if not p.exists():
        raise ValueError(f"{flag} {os.fspath(path)!r}: no such file or directory")
    files, skipped = found(p) if p.is_dir() else ([p], [])
    if not files:
        raise ValueError(f"{flag} {os.fspath(path)!r}: a directory without .txt or .jsonl files"
                         + (f" ({listed(skipped, p)})" if skipped else ""))
    return files, skipped


def listed(files: list[Path], root: Path, most: int = 5) -> str:
    """A few file names (relative to `root`), and how many more."""
    names = [os.fspath(f.relative_to(root)) if root.is_dir() else f.name for f in files[:most]]
    return ", ".join(names) + (f" and {len(files) - most} more" if len(files) > most else "")


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


def check_encoding(encoding: str | None) -> str | None:
    """`--text-encoding`: None (UTF-8, strict) or the name of a text encoding Python knows; ValueError otherwise
    (an unknown name, or a codec that is not a text encoding: rot13, base64, zlib, ...)."""
    if encoding is None:
        return None
    try:
        name = codecs.lookup(encoding).name
    except LookupError:
        raise ValueError(f"--text-encoding {encoding!r} is not an encoding Python knows (e.g. utf-8, latin-1, "
                         f"cp1252)") from None
    try:
        b"a".decode(name)
    except LookupError:   # Python's own refusal of a codec that does not turn bytes into text
        raise ValueError(f"--text-encoding {encoding!r} is a codec Python knows but not a text encoding (it does "
                         f"not decode bytes into text); name the files' text encoding, e.g. utf-8, latin-1, "
                         f"cp1252, utf-16") from None
    except (UnicodeError, ValueError):
        pass
    return name


def is_utf8(encoding: str | None) -> bool:
    return encoding is None or encoding == "utf-8"


def eos_token(config: Path) -> str | None:
    """`eos_token` of tokenizer_config.json: its text, or None when the file or the field is absent (null).
    ValueError naming the field for anything else (a number, an object without a "content" string)."""
    if not config.is_file():
        return None
    try:
        record = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--tokenizer: {os.fspath(config)} is not valid JSON: {e}") from None
    eos = record.get("eos_token") if isinstance(record, dict) else None
    if isinstance(eos, dict):   # an AddedToken: {"content": "</s>", "lstrip": false, ...}
        eos = eos.get("content")
        if not isinstance(eos, str):
            raise ValueError(f"--tokenizer: eos_token of {os.fspath(config)} is an object without a \"content\" "
                             f"string; write the token's text, e.g. \"eos_token\": \"</s>\"")
    if eos is not None and not isinstance(eos, str):
        raise ValueError(f"--tokenizer: eos_token of {os.fspath(config)} is {json.dumps(eos)} (a "
                         f"{type(eos).__name__}); it must be the token's text, e.g. \"eos_token\": \"</s>\" (its id "
                         f"is looked up in tokenizer.json)")
    return eos or None


def eos_id(tok, file: Path) -> int:
    """The end-of-text id that separates documents (see the module docstring); ValueError if none is found."""
    config = file.parent / "tokenizer_config.json"
    named = eos_token(config)
    if named is not None:
        if tok.token_to_id(named) is None:
            raise ValueError(f"--tokenizer: eos_token {named!r} of {os.fspath(config)} is not in the vocabulary of "
                             f"{os.fspath(file)}; correct eos_token (documents are separated by its id)")
        return tok.token_to_id(named)
    for name in EOS_NAMES:
        if tok.token_to_id(name) is not None:
            return tok.token_to_id(name)
    raise ValueError(f"--tokenizer {os.fspath(file)!r}: no end-of-text token found (tried eos_token of "
                     f"tokenizer_config.json and {', '.join(EOS_NAMES)}): documents could not be separated")


def decode(raw: bytes, file: Path, encoding: str | None, offset: int = 0, line: int | None = None) -> str:
    """`raw` (bytes of `file` from byte `offset`) as text: strict UTF-8 (a byte-order mark at the file's start
    dropped), or `encoding`. ValueError naming the file and the byte offset of the first byte that does not decode,
    or, in UTF-8, of a NUL byte (UTF-16 text read as UTF-8 decodes, with a NUL in every other byte)."""
    utf8 = is_utf8(encoding)
    try:
        text = raw.decode("utf-8-sig" if utf8 and offset == 0 else encoding or "utf-8")
    except UnicodeDecodeError as e:
        at = offset + e.start
        where = f"byte {at:,}" + (f" (line {line})" if line is not None else "")
        hint = ("pass --text-encoding ENC with the file's encoding (e.g. latin-1, cp1252) or convert it to UTF-8"
                if encoding is None else "check --text-encoding")
        if utf8 and offset == 0 and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):
            hint = "it starts with a UTF-16 byte-order mark: pass --text-encoding utf-16"
        raise ValueError(f"--data {os.fspath(file)!r} is not {encoding or 'UTF-8'} text: {where} "
                         f"(0x{raw[e.start]:02x}) does not decode; {hint}") from None
    if utf8 and "\0" in text:
        at = offset + raw.index(b"\0")
        where = f"byte {at:,}" + (f" (line {line})" if line is not None else "")
        raise ValueError(f"--data {os.fspath(file)!r} is not UTF-8 text: it holds NUL bytes (the first at {where}); "
                         f"{_nul_hint(file)}")
    return text


def _nul_hint(file: Path) -> str:
    """What a file with NUL bytes probably is: UTF-16 without a byte-order mark when every other byte is NUL."""
    with open(file, "rb") as f:
        head = f.read(1 << 16)
    even, odd = head[0::2].count(0), head[1::2].count(0)
    half = len(head) // 2
    for name, nul, other in (("utf-16-le", odd, even), ("utf-16-be", even, odd)):
        if half and nul > 0.3 * half and other < 0.05 * half:
            return (f"every other byte is NUL, as in {name.upper()} text without a byte-order mark: pass "
                    f"--text-encoding {name}")
    return "pass --text-encoding ENC with the file's encoding (e.g. utf-16-le, utf-32), or remove the NUL bytes"


def _ascii_lines(encoding: str | None) -> bool:
    """Does `encoding` write a newline, braces and letters as ASCII bytes (so a .jsonl file splits on b"\n")?"""
    return is_utf8(encoding) or "\n{}a".encode(encoding) == b"\n{}a"


class _Utf8Note:
    """Says once (per `say`) that a file read with another `--text-encoding` is valid UTF-8 all the same."""

    def __init__(self, encoding: str | None, say: Callable[[str], None] | None):
        self.active = say is not None and not is_utf8(encoding)
        self.encoding, self.say, self.fits, self.wide = encoding, say, True, False

    def see(self, raw: bytes) -> None:
        if self.active and self.fits and not raw.isascii():
            self.wide = True
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                self.fits = False

    def end(self, file: Path) -> None:
        if self.active and self.fits and self.wide:
            self.active = False
            self.say(f"note: --data {os.fspath(file)!r} is valid UTF-8 with non-ASCII characters, read as "
                     f"{self.encoding} as --text-encoding says: if it is UTF-8, drop --text-encoding (its "
                     f"non-ASCII characters come out as other characters)")
        self.fits, self.wide = True, False


SURROGATE = re.compile("[\ud800-\udfff]")


def documents(file: Path, encoding: str | None = None, note: _Utf8Note | None = None) -> Iterator[str]:
    """The documents of one text file: a .txt file is one (none if it holds only whitespace); a .jsonl file has
    one per line (blank lines skipped). `note`: told of each file's bytes (`_Utf8Note`)."""
    note = note or _Utf8Note(encoding, None)
    if file.suffix.lower() != ".jsonl":
        raw = file.read_bytes()
        note.see(raw)
        doc = decode(raw, file, encoding)
        note.end(file)
        _no_surrogate(doc, file)
        if doc.strip():
            yield doc
        return
    if _ascii_lines(encoding):
        lines = _raw_lines(file, encoding, note)
    else:   # UTF-16, UTF-32, ...: a newline is not the byte 0x0a; split the decoded text
        lines = enumerate(decode(file.read_bytes(), file, encoding).split("\n"), 1)
    for n, line in lines:
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
        _no_surrogate(text, file, n)
        yield text
    note.end(file)


def _no_surrogate(text: str, file: Path, line: int | None = None) -> None:
    """ValueError naming the file (and line) if `text` holds a lone surrogate, which no tokenizer encodes."""
    if (bad := SURROGATE.search(text)) is not None:
        where = f" line {line}" if line is not None else ""
        raise ValueError(f"--data {os.fspath(file)!r}{where}: the text holds a lone surrogate "
                         f"{json.dumps(bad.group())} at character {bad.start():,} (half of a UTF-16 pair, as a string "
                         f"cut in the middle of an emoji leaves it), which no tokenizer can encode: mend or drop "
                         f"{'that line' if line is not None else 'it'}")


def _raw_lines(file: Path, encoding: str | None, note: _Utf8Note) -> Iterator[tuple[int, str]]:
    offset = 0
    with open(file, "rb") as f:
        for n, raw in enumerate(f, 1):
            note.see(raw)
            yield n, decode(raw, file, encoding, offset, n)
            offset += len(raw)


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


def content_hash(files: list[Path], tokenizer_file: Path, root: Path, *, eos: int, encoding: str | None) -> str:
    """A hash of what makes the tokens: the format, the tokenizer's files (`TOKENIZER_FILES` beside
    `tokenizer_file`, those present), the end-of-text id, the encoding, and every input file's name (relative to
    `root`) and bytes."""
    h = hashlib.sha256(json.dumps({"format": FORMAT, "eos": eos, "encoding": encoding}).encode())
    beside = [tokenizer_file] + [tokenizer_file.parent / n for n in TOKENIZER_FILES[1:]
                                 if (tokenizer_file.parent / n).is_file()]
    for f in [*beside, *files]:
        name = os.fspath(f.relative_to(root)) if f not in beside and root.is_dir() else f.name
        h.update(f"\0{'tok' if f in beside else 'data'}:{name}\0{f.stat().st_size}\0".encode())
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:24]


def cache_dir() -> Path:
    if os.environ.get("ZOO_TOKEN_CACHE"):
        return Path(os.environ["ZOO_TOKEN_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "offload-zoo" / "tokens"


def cached(out: Path, say: Callable[[str], None]) -> dict | None:
    """The record of the cache entry `out` if the token file is the one it describes (its size and
    fingerprint), else None: absent, or damaged (then said in one line; it is tokenized again)."""
    meta = out.with_suffix(".json")
    if not meta.is_file():
        return None
    try:
        record = json.loads(meta.read_text())
        tokens, dtype, want = int(record["tokens"]), record["dtype"], record["fingerprint"]
        size = tokens * DTYPES[dtype].itemsize
        with open(out, "rb") as f:
            have = os.fstat(f.fileno()).st_size
            ok = have == size and fingerprint(f.fileno(), have) == want
    except FileNotFoundError:
        say(f"the token cache {out} is missing beside its record: tokenizing again")
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        say(f"the token cache record {meta} does not read ({e}): tokenizing again")
        return None
    if not ok:
        say(f"the token cache {out} is damaged ({have:,} bytes where its record says {tokens:,} {dtype} ids, "
            f"{size:,} bytes, or its bytes changed): tokenizing again")
        return None
    return record


def _sweep(cache: Path) -> None:
    """Remove the temporary files of runs that were killed while they wrote a cache entry: those of every entry
    whose lock no run holds (a run that tokenizes holds it until its files are renamed into place)."""
    for tmp in cache.glob("*.tmp"):
        lock = cache / f"{tmp.name.split('.', 1)[0]}.lock"
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except OSError:   # no lock: not a file this module writes under it
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            tmp.unlink(missing_ok=True)
        except OSError:   # held: a run is writing that entry now
            pass
        finally:
            os.close(fd)


@contextlib.contextmanager
def _locked(path: Path, say: Callable[[str], None]) -> Iterator[None]:
    """Hold `path` (an flock) for tokenizing one cache entry; a second run waits, saying for whom."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            say(f"waiting for {holder}, which is tokenizing the same files into this cache entry ...")
            fcntl.flock(fd, fcntl.LOCK_EX)   # released by the kernel when that process ends, however it ends
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}".encode(), 0)
        yield
    finally:
        os.close(fd)


def prepare(data: str | os.PathLike, tokenizer: str | os.PathLike, *, vocab: int,
            say: Callable[[str], None] = print, progress: Callable | None = None,
            encoding: str | None = None) -> tuple[Path, str]:
    """(token file, its dtype) for the text `data` under `tokenizer`: from the cache, else tokenized now.
    ValueError (before anything is tokenized) when the tokenizer's vocabulary exceeds the model's `vocab`.
    `progress(total_bytes)` returns a callable taking the bytes done (a progress bar); default: a line now and
    then. `encoding`: the text's (`--text-encoding`; default strict UTF-8)."""
    encoding = check_encoding(encoding)
    tok, tok_file = load_tokenizer(tokenizer)
    if tok.get_vocab_size() > vocab:
        raise ValueError(f"--tokenizer {os.fspath(tok_file)!r} has {tok.get_vocab_size():,} tokens, more than the "
                         f"model's vocabulary of {vocab:,}: add --set vocab_size={tok.get_vocab_size()}")
    files, skipped = text_files(data)
    eos = eos_id(tok, tok_file)
    dtype = "uint16" if tok.get_vocab_size() <= 2 ** 16 else "uint32"
    key = content_hash(files, tok_file, Path(data), eos=eos, encoding=encoding)
    out = cache_dir() / f"{key}.bin"
    record = cached(out, say)
    if record is None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"the token cache {out.parent} cannot be made ({e.strerror or e}): set "
                             f"ZOO_TOKEN_CACHE to a writable directory") from None
        _sweep(out.parent)
        with _locked(out.with_suffix(".lock"), say):
            record = cached(out, lambda _: None)   # made by the run this one waited for?
            if record is None:
                if skipped:
                    say(f"skipping {len(skipped)} file(s) of {os.fspath(data)} that are not .txt or .jsonl: "
                        f"{listed(skipped, Path(data))}")
                record = _make(tok, tok_file, files, eos, dtype, out, encoding, say, progress, Path(data))
                return out, record["dtype"]
    say(f"tokens of {os.fspath(data)}: {record['tokens']:,} from the cache {out}")
    return out, record["dtype"]


def _make(tok, tok_file: Path, files: list[Path], eos: int, dtype: str, out: Path, encoding: str | None,
          say: Callable[[str], None], progress: Callable | None, root: Path | None = None) -> dict:
    """Tokenize `files` into the cache entry `out` (token file, then its record; each renamed into place).
    ValueError naming the file(s) when none holds a document; a file without one among others is noted."""
    total = sum(f.stat().st_size for f in files)
    say(f"tokenizing {len(files)} file(s), {total / 2 ** 20:.1f} MiB, with {tok_file} (eos id {eos}) "
        f"into {out} ...")
    t0 = time.perf_counter()
    advance = (progress or _lines(say))(total)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    try:
        n, empty = _tokenize(tok, files, eos, dtype, tmp, advance, encoding, say)
        root = root or files[0]
        if len(empty) == len(files):
            raise ValueError(f"--data {os.fspath(root)!r}: " + (
                "no text in it (an empty file, or only blank lines)" if not root.is_dir() else
                f"no text in any of its {len(files)} file(s) ({listed(empty, root)}): each is empty or holds only "
                f"blank lines"))
        if empty:
            say(f"note: {len(empty)} file(s) of {os.fspath(root)} hold no text (empty, or only blank lines): "
                f"{listed(empty, root)}")
        advance(total)   # a .jsonl file's text is shorter than its bytes: close the bar at 100%
        seconds = time.perf_counter() - t0
        with open(tmp, "rb") as f:
            fp = fingerprint(f.fileno(), os.fstat(f.fileno()).st_size)
        record = {"format": FORMAT, "tokens": n, "dtype": dtype, "fingerprint": fp, "eos_id": eos,
                  "vocab_size": tok.get_vocab_size(), "encoding": encoding or "utf-8",
                  "tokenizer": os.fspath(tok_file), "files": [os.fspath(f) for f in files], "bytes": total,
                  "seconds": round(seconds, 3)}
        os.replace(tmp, out)
        meta = out.with_name(f"{out.stem}.json.{os.getpid()}.tmp")
        meta.write_text(json.dumps(record, indent=1))
        os.replace(meta, out.with_suffix(".json"))
    except OSError as e:
        # numpy's short write ("432443 requested and 30720 written") carries no errno: a full disk (or quota)
        if e.errno in (errno.ENOSPC, errno.EDQUOT) or (e.errno is None and "requested and" in str(e)):
            raise OSError(f"no space left for the token cache in {out.parent} ({e}): free space there, or set "
                          f"ZOO_TOKEN_CACHE to a directory with room (nothing half-written is kept)") from None
        raise
    finally:
        for leftover in (tmp, out.with_name(f"{out.stem}.json.{os.getpid()}.tmp")):
            leftover.unlink(missing_ok=True)
    say(f"tokenized {total / 2 ** 20:.1f} MiB into {n:,} tokens in {seconds:.1f} s "
        f"({n / max(seconds, 1e-9):,.0f} tokens/s); cached as {out}")
    return record


def _tokenize(tok, files: list[Path], eos: int, dtype: str, path: Path, advance: Callable[[int], None],
              encoding: str | None = None, say: Callable[[str], None] | None = None) -> tuple[int, list[Path]]:
    """Encode every document of `files` (EOS after each) into the token file `path`: (the number of tokens, the
    files that held no document)."""
    np_dtype = np.dtype("<u2" if dtype == "uint16" else "<u4")   # the token-file format (recipes/train/inputs/data.py)
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

        batch, ends, empty, note = [], [], [], _Utf8Note(encoding, say)
        for file in files:
            docs = 0
            for doc in documents(file, encoding, note):
                docs += 1
                parts = list(pieces(doc)) or [""]
                for i, part in enumerate(parts):
                    batch.append(part)
                    ends.append(i == len(parts) - 1)
                    if len(batch) == BATCH:
                        flush(batch, ends)
                        batch, ends = [], []
            if not docs:
                empty.append(file)
        if batch:
            flush(batch, ends)
    return n, empty


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
