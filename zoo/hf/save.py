"""Write a zoo model as a Hugging Face checkpoint (config.json + sharded safetensors) that transformers loads.

Writing needs no torch: tensors go through `safetensors.numpy` (bfloat16 via ml_dtypes) one layer at a time, into
shards of at most `max_shard_bytes`, with the index transformers expects; the directory is replaced all at once
(`zoo.hf.atomic`).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx

from zoo.hf import keymap
from zoo.hf.atomic import check_replaceable, give_mode_of, keep_user_files, swap_in
from zoo.hf.checks import check_keymap_covers
from zoo.hf.files import INDEX
from zoo.models import registry

__all__ = ["to_hf"]


def arch_for_model(cfg):
    try:
        return registry.family_of(cfg)
    except ValueError:
        raise ValueError(f"to_hf: no Hugging Face architecture for a {type(cfg).__name__}") from None


def to_hf(model: nnx.Module, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
          overwrite: bool = False) -> None:
    """Write `model` as a Hugging Face checkpoint `transformers.AutoModelForCausalLM` loads (config.json, safetensors
    shards and their index) into `path`, which must be empty unless `overwrite=True` (then a previous checkpoint's
    files, `zoo.hf.files.CHECKPOINT_FILES`, are replaced and everything else kept). Written beside `path` and swapped in
    when complete (`swap_in`): a failure leaves `path` as it was (an OSError naming it). TypeError for a `model` that is
    not a zoo model."""
    check_to_hf_args(model, path, max_shard_bytes, overwrite)
    cfg = model.config
    arch = arch_for_model(cfg)
    path = Path(path)
    if path.is_symlink():   # a link to the export folder: write where it points, keep the link
        path = path.resolve()
    if path.exists() and not path.is_dir():
        raise ValueError(f"to_hf: {path} exists and is not a directory")
    held = sorted(p.name for p in path.iterdir()) if path.exists() else []
    if held and not overwrite:
        raise ValueError(f"to_hf: {path} is not empty ({', '.join(held[:5])}{' ...' if len(held) > 5 else ''}); "
                         f"write to an empty directory, or pass overwrite=True to replace the checkpoint files in it")
    check_replaceable(path)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    entries = arch.hf.keys(cfg)
    check_keymap_covers(arch, flat, entries)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.partial-"))
    except OSError as e:
        raise OSError(e.errno, f"to_hf: cannot write beside {path}: {e.strerror or e}") from None
    try:
        give_mode_of(path, tmp)
        write_checkpoint(tmp, arch.hf.to_hf(cfg), flat, entries, max_shard_bytes)
        keep_user_files(path, tmp)
        swap_in(tmp, path)
    except OSError as e:
        raise OSError(e.errno, f"to_hf: writing {path} failed: {e.strerror or e}; {path} is as it was") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)   # gone already when swapped in


def check_to_hf_args(model, path, max_shard_bytes, overwrite) -> None:
    """TypeError (ValueError for a value out of range) naming the argument, before anything is written."""
    if not isinstance(model, nnx.Module) or not hasattr(model, "config"):
        raise TypeError(f"to_hf: model must be a zoo model (built by zoo.models or zoo.from_hf), got "
                        f"{type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"to_hf: path must be a str or os.PathLike, got {type(path).__name__}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int):
        raise TypeError(f"to_hf: max_shard_bytes must be an int, got {type(max_shard_bytes).__name__}")
    if max_shard_bytes <= 0:
        raise ValueError(f"to_hf: max_shard_bytes must be > 0, got {max_shard_bytes}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"to_hf: overwrite must be a bool, got {type(overwrite).__name__}")


def write_checkpoint(path: Path, config: dict, flat: dict, entries: list[keymap.Entry], max_shard_bytes: int) -> None:
    """config.json and the safetensors shards (and their index) into the directory `path`."""
    # Plan shards from shapes alone, then materialize one shard's tensors at a time.
    tensors = []  # (key, entry, index of its slice in the zoo array, nbytes)
    for e in entries:
        var = flat[e.path]
        nbytes = int(np.prod(e.hf_shape(var.shape))) * jnp.dtype(var.dtype).itemsize
        tensors += [(key, e, index, nbytes) for index, key in e.tensors()]
    shards, size = [[]], 0
    for t in tensors:
        if shards[-1] and size + t[3] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t[3]
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    weight_map = {}
    for name, shard in zip(names, shards):
        out = {}
        for key, e, index, _ in shard:
            out[key] = e.to_hf(np.asarray(jax.device_get(flat[e.path][...][index])))
            weight_map[key] = name
        safetensors.numpy.save_file(out, path / name, metadata={"format": "pt"})
    if len(shards) > 1:
        with open(path / INDEX, "w") as f:
            json.dump({"metadata": {"total_size": sum(t[3] for t in tensors)}, "weight_map": weight_map}, f, indent=2)
    with open(path / "config.json", "w") as f:
        json.dump(config, f, indent=2)
