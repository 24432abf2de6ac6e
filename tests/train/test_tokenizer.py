"""`python -m recipes.train.tokenizer`: a byte-level BPE trained offline on a few lines of the user's text, written as a
directory that `--tokenizer DIR` reads (tokenizer.json and the end-of-text token in tokenizer_config.json); any text
round-trips; bad inputs are named and nothing is overwritten."""
import json

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from recipes.train import tokenizer as tokenizer_cli  # noqa: E402
from recipes.train.inputs import data, text  # noqa: E402

LINES = ["the cat sat on the mat.", "the dog sat on the log.", "a bird in the hand is worth two in the bush.",
         "the quick brown fox jumps over the lazy dog."]


def test_a_tokenizer_trained_here_tokenizes_text_for_training(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ZOO_TOKEN_CACHE", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n".join(LINES[:2] * 10) + "\n")
    (corpus / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in LINES[2:] * 10) + "\n")
    out = tmp_path / "tok"
    assert tokenizer_cli.main(["--train", str(corpus), "--vocab-size", "300", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"--tokenizer {out} --set vocab_size=" in said and "<|endoftext|> = id 0" in said
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|endoftext|>"
    tok, file = text.load_tokenizer(out)
    assert file == out / "tokenizer.json" and 257 < tok.get_vocab_size() <= 300
    assert text.eos_id(tok, file) == 0
    for s in ("the cat sat on the log.", "Unseen: ünïcödé ✓ 123\n"):
        ids = tok.encode(s, add_special_tokens=False).ids
        assert tok.decode(ids) == s and 0 not in ids
    assert len(tok.encode(LINES[0]).ids) < len(LINES[0].encode())   # merges learnt: fewer tokens than bytes
    train, _ = data.open_data(corpus, tokenizer=str(out), vocab=300, batch=2, seq=8, seed=0, dtype=None,
                              say=lambda m: None)
    tokens = train.batch(1)["tokens"]
    assert tokens.shape == (2, 9) and np.all(tokens < tok.get_vocab_size())


def test_bad_tokenizer_inputs_are_named_and_nothing_is_overwritten(tmp_path, capsys):
    (tmp_path / "a.txt").write_text(LINES[0])
    out = ["--out", str(tmp_path / "tok")]
    cases = [(["--train", str(tmp_path / "nope"), "--vocab-size", "300"], "nope': no such file or directory"),
             (["--train", str(tmp_path / "a.txt"), "--vocab-size", "100"], "--vocab-size must be at least 257")]
    for argv, msg in cases:
        with pytest.raises(SystemExit) as e:
            tokenizer_cli.main(argv + out)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("mine")
    with pytest.raises(ValueError, match="already holds a tokenizer"):
        tokenizer_cli.train([str(tmp_path / "a.txt")], 300, tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").read_text() == "mine"
