"""Hugging Face interop: `io.from_hf` reads a checkpoint directory as a scanned zoo model, `io.to_hf` writes one that
transformers loads (both exported as `zoo.from_hf`, `zoo.to_hf`). `config` and `keymap` are the vocabulary the
families' own mappings (zoo/models/<family>/hf.py) are written in; `io` finds a family through the registry."""
