"""Hugging Face interop: `from_hf` reads a checkpoint directory as a scanned zoo model, `to_hf` writes one that
transformers loads. `config` maps config.json fields, `keymap` maps tensor names and layouts, `io` reads/writes."""
from zoo.hf.io import from_hf, to_hf

__all__ = ["from_hf", "to_hf"]
