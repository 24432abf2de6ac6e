"""Text that is not what it says (recipes/train/inputs/text.py): each case is refused before training with one line
naming the file (and the line or byte), or read as it is and said once.

- `--text-encoding rot13`: a codec Python knows that is not a text encoding, refused up front.
- A `.jsonl` line holding a lone surrogate (`"\\ud83d"`): refused naming the file and the line.
- UTF-16-LE without a byte-order mark and no flag (it decodes as UTF-8, with a NUL in every other byte): refused,
  naming the encoding to pass; with it, the text is read as it is.
- Valid UTF-8 read with `--text-encoding latin-1`: it trains as asked, and says once that the file is UTF-8.
- A directory of `a.txt`, `B.TXT`, `C.JSONL` and `notes.md`: the three text files tokenized, `notes.md` named as
  skipped.
- A valid UTF-16 `.jsonl` (`--text-encoding utf-16`): its lines are split after decoding.
- An empty `.jsonl`: named by its own file name (alone: refused; in a directory among others: noted).
- A tokenizer run killed while writing the cache: its temporary file is removed by the next run; one that a run
  writes now is kept.
"""
import fcntl
import json
import os

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from recipes.train.inputs import data, text  # noqa: E402
from tests.train.test_text import make_tokenizer  # noqa: E402


@pytest.fixture
def tok(tmp_path, monkeypatch):
    """(the tokenizer, its directory), with a token cache of this test's own."""
    monkeypatch.setenv("ZOO_TOKEN_CACHE", str(tmp_path / "cache"))
    return make_tokenizer(tmp_path / "tok"), tmp_path / "tok"


def documents_of(path, tokenizer) -> list[str]:
    ids = np.fromfile(path, "<u2")
    eos = tokenizer.token_to_id("<|endoftext|>")
    return [tokenizer.decode(d[:-1].tolist()) for d in np.split(ids, np.flatnonzero(ids == eos) + 1)[:-1]]


def test_a_codec_that_is_not_a_text_encoding_is_refused_up_front(tok, tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    for codec in ("rot13", "base64", "zlib"):
        with pytest.raises(ValueError, match=f"--text-encoding '{codec}' is a codec Python knows but not a text "
                                             f"encoding"):
            text.check_encoding(codec)
    from recipes.train.settings.config import RunConfig
    with pytest.raises(ValueError, match="'rot13' is a codec Python knows but not a text encoding"):
        RunConfig(data=str(tmp_path / "a.txt"), tokenizer=str(tok[1]), text_encoding="rot13")
    assert text.check_encoding("UTF16") == "utf-16"


def test_a_lone_surrogate_is_refused_naming_the_file_and_line(tok, tmp_path):
    f = tmp_path / "cut.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": "half an emoji: \ud83d"}) + "\n")
    with pytest.raises(ValueError) as e:
        text.prepare(f, tok[1], vocab=300)
    assert str(e.value) == (f"--data {os.fspath(f)!r} line 2: the text holds a lone surrogate \"\\ud83d\" at "
                            f"character 15 (half of a UTF-16 pair, as a string cut in the middle of an emoji leaves "
                            f"it), which no tokenizer can encode: mend or drop that line")


def test_utf16_without_a_byte_order_mark_is_refused_unless_named(tok, tmp_path):
    tokenizer, tok_dir = tok
    f = tmp_path / "wide.txt"
    f.write_bytes("the cat sat on the mat.".encode("utf-16-le"))
    with pytest.raises(ValueError) as e:
        text.prepare(f, tok_dir, vocab=300)
    assert str(e.value) == (f"--data {os.fspath(f)!r} is not UTF-8 text: it holds NUL bytes (the first at byte 1); "
                            f"every other byte is NUL, as in UTF-16-LE text without a byte-order mark: pass "
                            f"--text-encoding utf-16-le")
    path, _ = text.prepare(f, tok_dir, vocab=300, encoding="utf-16-le")
    assert documents_of(path, tokenizer) == ["the cat sat on the mat."]
    f.write_bytes("\ufeffthe cat".encode("utf-16-le"))   # with a byte-order mark: UTF-8 does not decode it
    with pytest.raises(ValueError, match="it starts with a UTF-16 byte-order mark: pass --text-encoding utf-16"):
        text.prepare(f, tok_dir, vocab=300)


def test_valid_utf8_read_as_latin1_trains_and_is_said_once(tok, tmp_path):
    root = tmp_path / "c"
    root.mkdir()
    for name in ("a.txt", "b.jsonl"):
        (root / name).write_text("caf\u00e9" if name == "a.txt" else json.dumps({"text": "cr\u00e8me"},
                                                                                  ensure_ascii=False) + "\n")
    said = []
    text.prepare(root, tok[1], vocab=300, say=said.append, encoding="latin-1")
    notes = [s for s in said if "is valid UTF-8" in s]
    assert notes == [f"note: --data {os.fspath(root / 'a.txt')!r} is valid UTF-8 with non-ASCII characters, read "
                     f"as iso8859-1 as --text-encoding says: if it is UTF-8, drop --text-encoding (its non-ASCII "
                     f"characters come out as other characters)"]


def test_a_directory_of_text_files_in_any_case_is_read_whole_and_skips_are_said(tok, tmp_path):
    tokenizer, tok_dir = tok
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.txt").write_text("one")
    (root / "B.TXT").write_text("two")
    (root / "C.JSONL").write_text(json.dumps({"text": "three"}) + "\n")
    (root / "notes.md").write_text("not text data")
    said = []
    path, _ = text.prepare(root, tok_dir, vocab=300, say=said.append)
    assert sorted(documents_of(path, tokenizer)) == ["one", "three", "two"]
    assert f"skipping 1 file(s) of {root} that are not .txt or .jsonl: notes.md" in said
    assert any(s.startswith("tokenizing 3 file(s)") for s in said), said
    assert text.is_text(root / "C.JSONL")


def test_a_utf16_jsonl_file_is_split_into_lines_after_decoding(tok, tmp_path):
    tokenizer, tok_dir = tok
    f = tmp_path / "wide.jsonl"
    lines = [json.dumps({"text": t}, ensure_ascii=False) for t in ("the cat", "the d\u00f6g", "a bird")]
    f.write_bytes("\n".join(lines).encode("utf-16"))
    path, _ = text.prepare(f, tok_dir, vocab=300, encoding="utf-16")
    assert documents_of(path, tokenizer) == ["the cat", "the d\u00f6g", "a bird"]


def test_an_empty_jsonl_file_is_named_by_its_own_name(tok, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError) as e:
        data.open_data(empty, tokenizer=str(tok[1]), vocab=300, batch=2, seq=8, seed=0, dtype=None)
    assert str(e.value) == f"--data {os.fspath(empty)!r}: no text in it (an empty file, or only blank lines)"
    root = tmp_path / "c"
    root.mkdir()
    (root / "a.txt").write_text("the cat sat on the mat. " * 10)
    (root / "b.jsonl").write_text("")
    said = []
    data.open_data(root, tokenizer=str(tok[1]), vocab=300, batch=2, seq=8, seed=0, dtype=None, say=said.append)
    assert f"note: 1 file(s) of {root} hold no text (empty, or only blank lines): b.jsonl" in said
    (root / "a.txt").write_text("")
    with pytest.raises(ValueError, match=f"--data '{root}': no text in any of its 2 file"):
        text.prepare(root, tok[1], vocab=300)


def test_a_killed_runs_temporary_cache_files_are_removed_by_the_next_run(tok, tmp_path):
    """A run killed while it wrote a cache entry left `<hash>.bin.<pid>.tmp` (its lock no longer held): the next
    run removes it. An entry whose lock a run holds (it is writing it now) keeps its temporary file."""
    cache = text.cache_dir()
    cache.mkdir(parents=True)
    for key in ("dead", "busy"):
        (cache / f"{key}.lock").write_text("pid 1")
        (cache / f"{key}.bin.12345.tmp").write_bytes(b"\0" * 10)
    (tmp_path / "a.txt").write_text("the cat")
    fd = os.open(cache / "busy.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)   # a run writing the entry "busy" now
        text.prepare(tmp_path / "a.txt", tok[1], vocab=300)
    finally:
        os.close(fd)
    assert sorted(p.name for p in cache.glob("*.tmp")) == ["busy.bin.12345.tmp"]


def test_text_too_short_for_one_window_is_named_as_given(tok, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("the cat")
    with pytest.raises(ValueError, match=f"--data '{f}', tokenized: TokenFile: .* holds 4 ids, fewer than seq \\+ 1 "
                                         f"= 65"):
        data.open_data(f, tokenizer=str(tok[1]), vocab=300, batch=2, seq=64, seed=0, dtype=None)


def test_a_lone_surrogate_a_codec_makes_in_a_txt_file_is_refused(tok, tmp_path):
    f = tmp_path / "escaped.txt"
    f.write_text("half an emoji: \\ud83d")   # decoded by unicode_escape into a lone surrogate
    with pytest.raises(ValueError) as e:
        text.prepare(f, tok[1], vocab=300, encoding="unicode_escape")
    assert str(e.value).startswith(f"--data {os.fspath(f)!r}: the text holds a lone surrogate \"\\ud83d\" at "
                                   f"character 15 ") and str(e.value).endswith("mend or drop it")
