"""Make a tokenizer from your own text, offline: a byte-level BPE trained with the `tokenizers` package.

    python -m recipes.train.tokenizer --train corpus/ --vocab-size 8000 --out my-tokenizer/
    python -m recipes.train --data corpus/ --tokenizer my-tokenizer/ --set vocab_size=8000

`--train` takes .txt and .jsonl files and directories of them (the documents `--data` reads:
recipes/train/inputs/text.py). The output directory holds `tokenizer.json` (what `--tokenizer DIR` reads;
`transformers`' AutoTokenizer reads it too) and `tokenizer_config.json` naming the end-of-text token that separates
documents (`<|endoftext|>`, id 0). Byte level: every byte is in the vocabulary, so any text encodes and decodes back
exactly. An existing tokenizer in `--out` is never overwritten.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from recipes.train.inputs import text

EOS = "<|endoftext|>"
MIN_VOCAB = 257   # the 256 bytes and the end-of-text token


def _files(paths: Sequence[str]) -> list[Path]:
    """The text files `--train` names (directories searched as `--data` is); ValueError naming the flag."""
    out = []
    for path in paths:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"--train {path!r}: no such file or directory")
        if p.is_dir():
            out += text.text_files(p, "--train")[0]
        elif p.suffix.lower() in text.SUFFIXES:
            out.append(p)
        else:
            raise ValueError(f"--train {path!r}: not a {' or '.join(text.SUFFIXES)} file")
    return out


def _pieces(files: list[Path]) -> Iterator[str]:
    for file in files:
        for doc in text.documents(file):
            yield from text.pieces(doc)


def train(paths: Sequence[str], vocab_size: int, out: str | os.PathLike, *, min_frequency: int = 2,
          progress: bool = False):
    """Train a byte-level BPE of `vocab_size` tokens on the documents of `paths` and write it to the directory
    `out` (tokenizer.json, tokenizer_config.json); the `tokenizers.Tokenizer`. ValueError, before training, for a
    missing input, a vocabulary below `MIN_VOCAB` or an `out` that already holds a tokenizer."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"--vocab-size must be at least {MIN_VOCAB} (the 256 bytes and {EOS}), got {vocab_size}")
    files = _files(paths)
    out = Path(out)
    if (out / "tokenizer.json").exists() or (out / "tokenizer_config.json").exists():
        raise ValueError(f"--out {os.fspath(out)!r} already holds a tokenizer: give another directory (nothing "
                         f"was overwritten)")
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {os.fspath(out)!r} is a file, not a directory")
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError("recipes.train.tokenizer needs the `tokenizers` package: pip install -e \".[text]\"") from None
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=progress)
    tok.train_from_iterator(_pieces(files), trainer)
    out.mkdir(parents=True, exist_ok=True)
    config = {"eos_token": EOS, "bos_token": None, "unk_token": None, "tokenizer_class": "PreTrainedTokenizerFast",
              "model_max_length": 1 << 30}
    for name, write in (("tokenizer.json", lambda f: tok.save(os.fspath(f))),
                        ("tokenizer_config.json", lambda f: f.write_text(json.dumps(config, indent=1) + "\n"))):
        tmp = out / (name + ".tmp")
        write(tmp)
        os.replace(tmp, out / name)   # whole files only
    return tok


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m recipes.train.tokenizer", description=__doc__.split("\n\n")[0])
    p.add_argument("--train", nargs="+", required=True, metavar="PATH",
                   help="text to train on: .txt and .jsonl files, or directories of them")
    p.add_argument("--vocab-size", type=int, required=True, metavar="N",
                   help=f"tokens in the vocabulary, at least {MIN_VOCAB}; train the model with --set vocab_size=N")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (--tokenizer DIR reads it)")
    p.add_argument("--min-frequency", type=int, default=2, metavar="K",
                   help="merge only pairs seen at least K times (default: 2)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    try:
        tok = train(args.train, args.vocab_size, args.out, min_frequency=args.min_frequency,
                    progress=sys.stderr.isatty())
    except ValueError as e:
        ap.error(str(e))
    size = tok.get_vocab_size()
    data = " ".join(args.train)
    fewer = f"; the text had merges for {size:,} of the {args.vocab_size:,} asked" if size < args.vocab_size else ""
    print(f"wrote {os.path.join(args.out, 'tokenizer.json')}: a byte-level BPE of {size:,} tokens ({EOS} = id "
          f"{tok.token_to_id(EOS)}{fewer})")
    print(f"train with: python -m recipes.train --data {data} --tokenizer {args.out} --set vocab_size={size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
