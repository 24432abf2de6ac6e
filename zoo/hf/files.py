"""The files of a Hugging Face checkpoint directory: config.json, the safetensors shards and their index, read as JSON
and safetensors headers (no tensor), each checked (ValueError naming the file). The directory is untrusted input: an
index entry reaching outside it is refused (the hub cache's snapshot links excepted).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from safetensors import safe_open

INDEX = "model.safetensors.index.json"
# safetensors dtype names a parameter may be stored in (quantized or integer tensors are refused).
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# What a Hugging Face model directory's weights and config are: `to_hf(..., overwrite=True)` replaces these (and
# only these), so no stale shard or a second format's weights stay beside the new ones.
# The names `to_hf` writes ("model.safetensors", "model-00001-of-00002.safetensors") and transformers' other
# formats; another *.safetensors (a PEFT adapter_model.safetensors) is the user's and kept.
CHECKPOINT_FILES = ("config.json", "model.safetensors", "model-*-of-*.safetensors", INDEX, "pytorch_model*.bin",
                    "pytorch_model.bin.index.json", "tf_model.h5", "flax_model*.msgpack",
                    "flax_model.msgpack.index.json")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: str  # safetensors name: F32, BF16, ...


def read_json(file: Path) -> dict:
    """A JSON object from `file`; ValueError naming the file if it is not one."""
    try:
        with open(file) as f:
            out = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(out, dict):
        raise ValueError(f"{file} holds a JSON {type(out).__name__}, not an object")
    return out


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.is_file():
        raise ValueError(f"{path}: no config.json; from_hf reads a Hugging Face checkpoint directory")
    return read_json(inside(path, "config.json", f"{path}: config.json"))


def open_safetensors(file: Path):
    """`safe_open(file)`; ValueError naming the file if its header is damaged or it is shorter than the header
    says (a truncated download)."""
    try:
        return safe_open(file, framework="numpy")
    except Exception as e:   # safetensors' own error type, not a ValueError
        raise ValueError(f"{file} is not a readable safetensors file (truncated or damaged?): {e}") from None


def _roots(path: Path) -> list[Path]:
    """Where the checkpoint's files may resolve to: its directory, and for a hub cache snapshot
    (`<repo>/snapshots/<revision>`) the repository's `blobs` folder."""
    root = path.resolve()
    return [root, root.parent.parent / "blobs"] if root.parent.name == "snapshots" else [root]


def inside(path: Path, name, where: str) -> Path:
    """The file `name` of the checkpoint directory `path`; ValueError naming `where` (the entry) if `name` is not a
    string, is absolute or climbs out with `..`, or resolves outside the directory (a symlink escaping it)."""
    if not isinstance(name, str):
        raise ValueError(f"{where}: the file name must be a string, got {type(name).__name__} {name!r}")
    if not name or Path(name).is_absolute() or ".." in Path(name).parts or "\0" in name:
        raise ValueError(f"{where} names {name!r}, which is not a file inside {path}: a checkpoint reads only its "
                         f"own directory")
    file = path / name
    target = file.resolve()
    if not any(target == r or r in target.parents for r in _roots(path)):
        raise ValueError(f"{where} names {name!r}, a symlink to {target}, outside {path}: a checkpoint reads only "
                         f"its own directory")
    return file


def weight_files(path: Path) -> list[str]:
    """The safetensors files that hold the weights (see the module docstring), each checked to lie inside `path`."""
    if (path / INDEX).is_file():
        weight_map = read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / INDEX} has no weight_map object")
        for key, name in weight_map.items():
            inside(path, name, f"{path / INDEX}: weight_map entry {key!r}")
            if not (path / name).is_file():
                raise ValueError(f"{path}: {INDEX} entry {key!r} names {name!r}, which is not a file")
        return sorted(set(weight_map.values()))
    if (path / "model.safetensors").exists():
        names = ["model.safetensors"]
    else:
        names = sorted(p.name for p in path.glob("*.safetensors"))
    for name in names:
        inside(path, name, f"{path}: the weights file")
        if not (path / name).is_file():
            raise ValueError(f"{path}: {name} is not a file (a directory, or a link to nothing)")
    return names


def list_tensors(path: Path) -> dict[str, TensorInfo]:
    """{key: file, shape, dtype} of every tensor in the checkpoint, read from the headers only."""
    files = weight_files(path)
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    out: dict[str, TensorInfo] = {}
    for name in files:
        with open_safetensors(path / name) as f:
            for key in f.keys():
                if key in out:
                    raise ValueError(f"{path}: tensor {key!r} is in both {out[key].file} and {name}")
                s = f.get_slice(key)
                out[key] = TensorInfo(name, tuple(s.get_shape()), s.get_dtype())
    return out
