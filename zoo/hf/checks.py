"""The checks that a Hugging Face checkpoint matches the model its config.json describes, made before any array is
loaded: every tensor present, of the right shape and a float dtype, none left over, and the tensors the zoo's model
shares (a tied head, the multi-token-prediction module's copies) equal. Each failure is a ValueError naming the
tensor."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from zoo.hf import keymap
from zoo.hf.files import FLOAT_DTYPES, TensorInfo, open_safetensors


def check_keymap_covers(arch, flat: dict, entries: list[keymap.Entry]) -> None:
    """RuntimeError (a zoo bug, not bad input) unless the family's key map names exactly the model's variables."""
    if set(flat) != {e.path for e in entries}:
        raise RuntimeError(f"zoo bug: the {arch.hf.architecture} key map does not cover the model: "
                           f"{sorted(set(flat) ^ {e.path for e in entries})}")


def check_tensors(entries: list[keymap.Entry], shapes: dict[tuple, tuple], found: dict[str, TensorInfo],
                  allowed_extra: Callable[[str], bool]) -> None:
    """ValueError naming the first missing, mis-shaped, non-float or unexpected tensor."""
    expected = {}
    for e in entries:
        want = e.hf_shape(shapes[e.path])
        for key in e.keys():
            expected[key] = want
    for key, want in expected.items():
        if key not in found:
            raise ValueError(f"checkpoint is missing tensor {key!r} (expected shape {list(want)})")
        info = found[key]
        if info.shape != want:
            raise ValueError(f"tensor {key!r} has shape {list(info.shape)} in {info.file}, but config.json implies "
                             f"{list(want)}")
        if info.dtype not in FLOAT_DTYPES:
            raise ValueError(f"tensor {key!r} has dtype {info.dtype}; zoo reads {sorted(FLOAT_DTYPES)}")
    unexpected = sorted(k for k in found if k not in expected and not keymap.is_buffer(k) and not allowed_extra(k))
    if unexpected:
        raise ValueError(f"checkpoint has tensors the model config.json describes has no place for (does config.json "
                         f"match the tensors?): {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")


def check_tied(path: Path, found: dict[str, TensorInfo]) -> None:
    """A tied checkpoint may still carry lm_head.weight; it must then equal the embedding."""
    a, b = "model.embed_tokens.weight", "lm_head.weight"
    with open_safetensors(path / found[a].file) as fa, open_safetensors(path / found[b].file) as fb:
        if found[a].shape != found[b].shape or not np.array_equal(fa.get_tensor(a), fb.get_tensor(b)):
            raise ValueError(f"config.json: tie_word_embeddings=true, but tensor {b!r} differs from {a!r}")


def check_copies(path: Path, found: dict[str, TensorInfo], entries: list[keymap.Entry]) -> None:
    """ValueError unless each `copy` entry's tensor equals the tensor its parameter is read from."""
    originals = {e.path: e.hf for e in entries if not e.copy}
    for e in entries:
        if not e.copy:
            continue
        a, b = originals[e.path], e.hf
        with open_safetensors(path / found[a].file) as fa, open_safetensors(path / found[b].file) as fb:
            if not np.array_equal(fa.get_tensor(a), fb.get_tensor(b)):
                raise ValueError(f"tensor {b!r} differs from {a!r}; the zoo's model shares one tensor for both "
                                 f"(load with extra_heads=False to leave the model's extra heads, e.g. "
                                 f"multi-token prediction, out)")
