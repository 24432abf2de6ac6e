"""What a token file is: its dtypes (the ids of a `.bin`, little-endian) and the fingerprint that tells one file's
contents from another's without reading it all. The training data reader (`recipes.train.inputs.data`) and the text
cache (`recipes.train.inputs.text`) both use them."""
from __future__ import annotations

import hashlib
import os

import numpy as np

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
