"""Hugging Face interop: `load.from_hf` reads a checkpoint directory as a scanned zoo model, `save.to_hf` writes one
that transformers loads (both exported as `zoo.from_hf`, `zoo.to_hf`); both find a family through the registry.
`files` reads the directory's config.json, index and safetensors headers, `checks` holds a checkpoint against the
model its config describes, `atomic` swaps a written directory in whole. `config` and `keymap` are the vocabulary
the families' own mappings (zoo/models/<family>/hf.py) are written in."""

__all__ = ["load", "save"]   # the public modules (their functions are zoo.from_hf and zoo.to_hf)
