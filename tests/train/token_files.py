"""Token files for the tests: ids written in the format `recipes.train.inputs.data.TokenFile` reads (flat little-endian
uint16 or uint32, no header)."""
from __future__ import annotations

import os

import numpy as np

from recipes.train.inputs.text import DTYPES


def write_tokens(path: str | os.PathLike, ids, dtype: str = "uint16") -> None:
    """Write token ids in the token-file format."""
    ids = np.asarray(ids)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(DTYPES[dtype]).max):
        raise ValueError(f"token ids out of range for {dtype}")
    ids.astype(DTYPES[dtype]).tofile(path)
