"""Text to training (recipes/train/inputs/text.py, recipes.train.inputs.data.open_data): a tokenizer trained here (no
downloads), text and JSONL files tokenized once into the token-file format with EOS between documents, cached by
content, a held-out split, and a short run with --eval-every and --tensorboard."""
import json
import os

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")

from recipes.train.inputs import data, text  # noqa: E402
from tests.train.token_files import write_tokens  # noqa: E402

DOCS = ["the cat sat on the mat.\nthe dog sat on the log.\n", "a bird in the hand is worth two in the bush.",
        "the quick brown fox jumps over the lazy dog.", "all that glitters is not gold."]


def make_tokenizer(directory, vocab_size=300):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 20, trainer)
    os.makedirs(directory, exist_ok=True)
    tok.save(os.path.join(directory, "tokenizer.json"))
    return tok


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("ZOO_TOKEN_CACHE", str(tmp_path / "cache"))
    tok = make_tokenizer(tmp_path / "tok")
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text(DOCS[0])
    (root / "sub" / "b.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in DOCS[1:]) + "\n")
    (root / "notes.md").write_text("not read")
    return tok, root, tmp_path / "tok"


def test_tokenized_once_with_eos_between_documents(corpus):
    tok, root, tok_dir = corpus
    said = []
    path, dtype = text.prepare(root, tok_dir, vocab=300, say=said.append)
    assert dtype == "uint16"
    ids = np.fromfile(path, "<u2")
    eos = tok.token_to_id("<|endoftext|>")
    docs = np.split(ids, np.flatnonzero(ids == eos) + 1)[:-1]   # each document ends with EOS
    assert [tok.decode(d[:-1].tolist()) for d in docs] == DOCS   # a.txt first, then b.jsonl's lines in order
    assert any("tokens/s" in s for s in said) and any("tokenized 100%" in s for s in said)

    said.clear()
    again, _ = text.prepare(root, tok_dir, vocab=300, say=said.append)   # cached: nothing tokenized
    assert again == path and len(said) == 1 and "from the cache" in said[0]
    (root / "a.txt").write_text(DOCS[0] + "changed")                    # new content, new cache entry
    changed, _ = text.prepare(root, tok_dir, vocab=300, say=said.append)
    assert changed != path


def test_long_documents_are_cut_after_a_newline(monkeypatch):
    monkeypatch.setattr(text, "PIECE", 10)
    parts = list(text.pieces("line one\nline two\nthree"))
    assert "".join(parts) == "line one\nline two\nthree"
    assert all(p.endswith("\n") for p in parts[:-1])


def test_bad_inputs_are_named(corpus, tmp_path):
    _, root, tok_dir = corpus
    with pytest.raises(ValueError, match="300 tokens, more than the model's vocabulary of 256: add --set "
                                         "vocab_size=300"):
        text.prepare(root, tok_dir, vocab=256)
    with pytest.raises(ValueError, match="needs --tokenizer"):
        data.open_data(root, tokenizer=None, vocab=300, batch=2, seq=8, seed=0, dtype=None)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        text.prepare(root, tmp_path, vocab=300)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"title": 3}\n')
    with pytest.raises(ValueError, match="line 2: expected a JSON string or an object"):
        text.prepare(tmp_path / "bad.jsonl", tok_dir, vocab=300)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="without .txt or .jsonl files"):
        text.prepare(empty, tok_dir, vocab=300)


def test_heldout_split_and_start_up_id_check(tmp_path):
    path = tmp_path / "ids.bin"
    write_tokens(path, np.arange(1000) % 50)
    train, held = data.open_data(path, tokenizer=None, vocab=50, batch=2, seq=8, seed=0, dtype=None, heldout=0.1)
    assert (train.lo, train.n_ids, held.lo, held.n_ids) == (0, 900, 900, 100)
    assert held.eval_batches() == 5
    np.testing.assert_array_equal(held.eval_batch(0)["tokens"][0], (np.arange(900, 909) % 50))
    for step in range(1, 20):   # training windows never reach the held-out tail (ids 900..999 are 0..49 again)
        starts = data._rng(0, step).integers(train.n_ids - train.seq, size=2)
        assert starts.max() + train.seq + 1 <= 900
        np.testing.assert_array_equal(train.batch(step)["tokens"], [(np.arange(9) + s) % 50 for s in starts])
    ids = np.zeros(5000, np.int64)
    ids[4321] = 300
    write_tokens(path, ids)
    # a file this small is read whole by the start-up sample (recipes.train.inputs.data.SAMPLE_CHUNKS x SAMPLE_IDS)
    with pytest.raises(ValueError, match="id 300 at position 4,321 is outside the model's vocabulary of 256"):
        data.TokenFile(path, vocab=256, batch=2, seq=8)


def test_text_run_with_eval_and_tensorboard(corpus, tmp_path):
    pytest.importorskip("tensorboardX")
    from recipes.train import loop
    _, root, tok_dir = corpus
    metrics = tmp_path / "m.jsonl"
    settings = loop.RunConfig(preset="tiny", overrides=(("vocab_size", "300"),), steps=4, batch=2, seq=16,
                              data=str(root), tokenizer=str(tok_dir), eval_every=2, heldout=0.2, log_every=2,
                              metrics=str(metrics), tensorboard=str(tmp_path / "tb"))
    result = loop.run(settings)
    assert result.stopped is None and len(result.losses) == 4
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [r for r in rows if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    assert all(np.isclose(r["eval_perplexity"], np.exp(r["eval_loss"])) for r in evals)
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tb"))


def test_text_that_is_not_utf8_is_refused_naming_file_and_byte_unless_an_encoding_is_given(corpus, tmp_path):
    tok, _, tok_dir = corpus
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\u00e9 cr\u00e8me".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.txt' is not UTF-8 text: byte 3 \(0xe9\) does not decode; pass "
                                         r"--text-encoding ENC"):
        text.prepare(latin, tok_dir, vocab=300)
    lines = tmp_path / "lines.jsonl"
    lines.write_bytes(b'{"text": "ok"}\n' + '{"text": "\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"lines.jsonl' is not UTF-8 text: byte 25 \(line 2\)"):
        text.prepare(lines, tok_dir, vocab=300)
    path, _ = text.prepare(latin, tok_dir, vocab=300, encoding="latin-1")   # decoded as said: no U+FFFD
    ids = np.fromfile(path, "<u2")
    assert tok.decode(ids[:-1].tolist()) == "caf\u00e9 cr\u00e8me"
    with pytest.raises(ValueError, match="--text-encoding 'klingon' is not an encoding Python knows"):
        text.prepare(latin, tok_dir, vocab=300, encoding="klingon")
    with pytest.raises(ValueError, match="--text-encoding needs text --data and --tokenizer"):
        from recipes.train.settings.config import RunConfig
        RunConfig(data=str(latin), text_encoding="latin-1")


def test_a_damaged_cache_or_a_changed_eos_token_is_tokenized_again(corpus):
    tok, root, tok_dir = corpus
    said = []
    path, _ = text.prepare(root, tok_dir, vocab=300, say=said.append)
    whole = path.read_bytes()
    path.write_bytes(whole[: len(whole) // 2])                     # cut short (a full disk, a copy killed)
    said.clear()
    again, _ = text.prepare(root, tok_dir, vocab=300, say=said.append)
    assert again == path and path.read_bytes() == whole
    assert "is damaged" in said[0] and "tokenizing again" in said[0] and any("tokens/s" in s for s in said)
    # a new eos_token in tokenizer_config.json: another cache entry, whose documents end with the new id
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "the", "__type": "x"}}))
    other, _ = text.prepare(root, tok_dir, vocab=300, say=said.append)
    assert other != path and np.fromfile(other, "<u2")[-1] == tok.token_to_id("the")
    for eos, message in ((2, r"eos_token of .*tokenizer_config.json is 2 \(a int\); it must be the token's text"),
                         ({"id": 2}, "is an object without a \"content\" string"),
                         ("<nope>", "eos_token '<nope>' of .* is not in the vocabulary")):
        (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
        with pytest.raises(ValueError, match=message):
            text.prepare(root, tok_dir, vocab=300)
    (tok_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"):
        text.prepare(root, tok_dir, vocab=300)


def test_two_runs_tokenizing_the_same_files_at_once_share_one_cache_entry(corpus):
    """The second run waits on the first's lock (a state, not a clock: the first holds it until released here),
    then reads the entry the first made; no temporary file is left."""
    import threading
    _, root, tok_dir = corpus
    files = text.text_files(root)[0]
    tok, tok_file = text.load_tokenizer(tok_dir)
    key = text.content_hash(files, tok_file, root, eos=text.eos_id(tok, tok_file), encoding=None)
    out = text.cache_dir() / f"{key}.bin"
    out.parent.mkdir(parents=True)
    waiting, said, got = threading.Event(), [], []

    def say(line):
        said.append(line)
        if line.startswith("waiting for"):
            waiting.set()
    with text._locked(out.with_suffix(".lock"), lambda _: None):      # the first run, tokenizing
        second = threading.Thread(target=lambda: got.append(text.prepare(root, tok_dir, vocab=300, say=say)))
        second.start()
        assert waiting.wait(60)
        first = text._make(tok, tok_file, files, text.eos_id(tok, tok_file), "uint16", out, None, lambda _: None,
                           None)
    second.join(60)
    assert got == [(out, "uint16")] and "from the cache" in said[-1] and not any("tokens/s" in s for s in said)
    assert first["tokens"] == np.fromfile(out, "<u2").size
    assert sorted(p.suffix for p in out.parent.iterdir()) == [".bin", ".json", ".lock"]


def test_a_full_disk_under_the_token_cache_says_so_and_names_the_folder(corpus, monkeypatch):
    """The token file written to a full disk: numpy's short write ("432443 requested and 30720 written", no errno)
    and the system's ENOSPC are an error that says no space is left and names the cache folder; no half-written
    entry is left."""
    tok, root, tok_dir = corpus
    cache = text.cache_dir()
    for failure in (OSError("432443 requested and 30720 written"), OSError(28, "No space left on device")):
        def full(*args, failure=failure):
            args[4].write_bytes(b"\0" * 64)   # the part written before the disk filled
            raise failure
        monkeypatch.setattr(text, "_tokenize", full)
        with pytest.raises(OSError, match=f"^no space left for the token cache in {cache} "):
            text.prepare(root, tok_dir, vocab=300, say=lambda _: None)
        assert not [p for p in cache.iterdir() if p.suffix in (".bin", ".tmp")]
