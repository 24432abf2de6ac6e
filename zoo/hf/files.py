"""The files of a Hugging Face checkpoint directory: config.json, the safetensors shards and their index, read as
JSON and safetensors headers (no tensor is read here). A file that is not what it should be is a ValueError naming
it."""
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
CHECKPOINT_FILES = ("config.json", "*.safetensors", INDEX, "pytorch_model*.bin", "pytorch_model.bin.index.json",
                    "tf_model.h5", "flax_model*.msgpack", "flax_model.msgpack.index.json")


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
    return read_json(file)


def open_safetensors(file: Path):
    """`safe_open(file)`; ValueError naming the file if its header is damaged or it is shorter than the header
    says (a truncated download)."""
    try:
        return safe_open(file, framework="numpy")
    except Exception as e:   # safetensors' own error type, not a ValueError
        raise ValueError(f"{file} is not a readable safetensors file (truncated or damaged?): {e}") from None


def list_tensors(path: Path) -> dict[str, TensorInfo]:
    """{key: file, shape, dtype} of every tensor in the checkpoint, read from the headers only."""
    if (path / INDEX).is_file():
        weight_map = read_json(path / INDEX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / INDEX} has no weight_map object")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    out: dict[str, TensorInfo] = {}
    for name in files:
        if not (path / name).is_file():
            raise ValueError(f"{path}: {INDEX} names {name!r}, which does not exist")
        with open_safetensors(path / name) as f:
            for key in f.keys():
                if key in out:
                    raise ValueError(f"{path}: tensor {key!r} is in both {out[key].file} and {name}")
                s = f.get_slice(key)
                out[key] = TensorInfo(name, tuple(s.get_shape()), s.get_dtype())
    return out
