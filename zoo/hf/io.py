"""Read and write Hugging Face checkpoints (config.json + sharded safetensors) as scanned zoo models.

Reading is check-then-stream. Everything about the checkpoint is checked against the model its config.json
describes BEFORE any array is made: the architecture, every config field that changes the math, every tensor's
presence, shape and dtype, and that no tensor is left over; a failure is a ValueError naming the field or key, and
nothing has been loaded. Then each parameter is streamed in: the model is built with `nnx.eval_shape` (no memory),
each parameter is allocated once on its target sharding and filled one HF tensor at a time (one layer, or one
expert of one layer; a donated in-place update), so beyond the model itself at most one HF tensor is held, on host
and on device (the largest is the embedding, which is not stacked). Single-process: the arrays are made by this
process (a multi-host loader would make each host's shards with `jax.make_array_from_callback`).

Writing needs no torch: tensors go through `safetensors.numpy` (bfloat16 via ml_dtypes) one layer at a time, into
shards of at most `max_shard_bytes`, with the index transformers expects.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from flax import nnx
from safetensors import safe_open

from zoo import sharding as zoo_sharding
from zoo.hf import config as hf_config
from zoo.hf import keymap
from zoo.models import registry
from zoo.recipe import Recipe

INDEX = "model.safetensors.index.json"
# safetensors dtype names a parameter may be stored in (quantized or integer tensors are refused).
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def arch_for_config(hf: dict):
    """The model family (zoo.models.registry) whose Hugging Face architecture config.json names."""
    hf_config.check_types(hf)   # `architectures` a list of names: matched exactly
    return registry.family_for_hf(hf)


def arch_for_model(cfg):
    try:
        return registry.family_of(cfg)
    except ValueError:
        raise ValueError(f"to_hf: no Hugging Face architecture for a {type(cfg).__name__}") from None


# -- reading --------------------------------------------------------------------------------------------------

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


def target_shardings(params: nnx.State, mesh, rules) -> dict[tuple, Any]:
    """{path: sharding}: None without a mesh (default device); with one, `zoo.sharding.shardings` of the state:
    each logical axis of a parameter (its `out_sharding` metadata) mapped to mesh axes by `rules` with Flax's
    logical-partitioning rules (the first rule for a name whose mesh axis is still free in that spec wins).
    Default rules: the zoo's for the mesh (`zoo.sharding.rules_for`: axes dp, fsdp, tp, ep; a mesh without them
    replicates everything)."""
    flat = nnx.to_flat_state(params)
    if mesh is None or mesh.empty:
        return {path: None for path, _ in flat}
    rules = tuple(rules) if rules is not None else zoo_sharding.rules_for(mesh)
    for logical_axis, mesh_axis in rules:
        named = () if mesh_axis is None else mesh_axis if isinstance(mesh_axis, tuple) else (mesh_axis,)
        if any(a not in mesh.axis_names for a in named):
            raise ValueError(f"rules map {logical_axis!r} to {mesh_axis!r}, which is not an axis of the mesh "
                             f"{mesh.axis_names}")
    zoo_sharding.check_divisible(params, mesh, rules)   # ValueError naming the parameter, before reading
    out = dict(nnx.to_flat_state(zoo_sharding.shardings(params, mesh, rules)))
    return {path: out[path].get_value() if isinstance(out[path], nnx.Variable) else out[path] for path, _ in flat}


def _allocate(shape, dtype, sharding):
    """Zeros of the whole stacked parameter, made directly on its sharding (no host copy)."""
    return jnp.zeros(shape, dtype, device=sharding)


@functools.partial(jax.jit, donate_argnums=0)
def _set_slice(buf, piece, index):
    """buf[index] = piece for a leading `index` (layer, or layer and expert), in place (buf is donated)."""
    piece = piece.astype(buf.dtype).reshape((1,) * index.shape[0] + piece.shape)
    starts = tuple(index) + (0,) * (buf.ndim - index.shape[0])
    return jax.lax.dynamic_update_slice(buf, piece, starts)


def from_hf(path: str | os.PathLike, recipe: Recipe | None = None, dtype=None, *, mesh=None,
            rules: Sequence[tuple[str, Any]] | None = None, allow_nonfinite: bool = False,
            mtp: bool | None = None) -> nnx.Module:
    """Load a Hugging Face checkpoint directory (an architecture of a registered family, e.g. `LlamaForCausalLM`:
    config.json and one or many *.safetensors, with model.safetensors.index.json when sharded) as a scanned zoo
    model.

    `dtype`: parameter dtype (default: the checkpoint's); float32 parameters compute in float32, others in
    bfloat16. `mesh` (default: the mesh set with `jax.set_mesh`, if any) and `rules` (logical axis -> mesh axis)
    place each parameter on its target sharding as it is read. Raises ValueError, before loading anything, for an
    unknown architecture, an unsupported config field, a config.json or index that is not JSON, a safetensors file
    whose header is damaged or that is shorter than its header says, or a tensor that is missing, mis-shaped or left
    over; and, while streaming, for a tensor holding NaN or infinity (naming tensor and file) unless
    `allow_nonfinite=True`.

    `mtp`: the multi-token-prediction module config.json announces (DeepSeek-V3: `num_nextn_predict_layers`,
    stored as layers num_hidden_layers..). False: build the model without it and skip its tensors (inference does
    not use it); True: load it (a missing tensor is an error); None (default): load it if the checkpoint holds any
    of its tensors (transformers saves none). Its copies of shared tensors are checked equal to the originals.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"from_hf: path must be a str or os.PathLike, got {type(path).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"from_hf: recipe must be a zoo.Recipe or None, got {type(recipe).__name__}")
    if not isinstance(allow_nonfinite, bool):
        raise TypeError(f"from_hf: allow_nonfinite must be a bool, got {type(allow_nonfinite).__name__}")
    if mtp is not None and not isinstance(mtp, bool):
        raise TypeError(f"from_hf: mtp must be a bool or None, got {type(mtp).__name__}")
    path = Path(path)
    hf = read_config(path)
    arch = arch_for_config(hf)
    found = list_tensors(path)
    first = next((found[k] for k in ("model.embed_tokens.weight",) if k in found), None)
    param_dtype = hf_config.param_dtype_of(hf, dtype, FLOAT_DTYPES.get(first.dtype) if first else None)
    cfg = arch.hf.from_hf(hf, param_dtype=param_dtype)
    skip = arch.hf.extra_keys(hf)   # the MTP module's keys
    if mtp is False or (mtp is None and not any(skip(key) for key in found)):
        cfg = cfg.without_mtp()

    if mesh is None:
        mesh = jax.sharding.get_mesh()
    # Parameters carry logical axis names, which nnx.eval_shape would read as mesh axes under an active mesh:
    # build the abstract model outside it, and map logical names to mesh axes ourselves (target_shardings).
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        abstract = nnx.eval_shape(lambda: arch.build(cfg, recipe=recipe, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)   # parameters, and DeepSeek's routing biases: all from the checkpoint
    flat = dict(nnx.to_flat_state(state))
    entries = arch.hf.keys(cfg)
    if set(flat) != {e.path for e in entries}:
        raise RuntimeError(f"zoo bug: the {arch.hf.architecture} key map does not cover the model: "
                           f"{sorted(set(flat) ^ {e.path for e in entries})}")
    tied_head = cfg.tie_embeddings and "lm_head.weight" in found  # checked against the embedding below
    check_tensors(entries, {p: v.shape for p, v in flat.items()}, found,
                  lambda key: skip(key) or (tied_head and key == "lm_head.weight"))
    if cfg.tie_embeddings and "lm_head.weight" in found:
        check_tied(path, found)
    check_copies(path, found, entries)

    loaded = stream(path, found, entries, flat, target_shardings(state, mesh, rules), allow_nonfinite=allow_nonfinite)
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def stream(path: Path, found: dict[str, TensorInfo], entries: list[keymap.Entry], flat: dict[tuple, nnx.Variable],
           shardings: dict[tuple, Any], *, allow_nonfinite: bool = False) -> list[tuple[tuple, nnx.Variable]]:
    """Read every parameter (checked already) onto its sharding, one layer at a time: [(path, filled variable)].
    ValueError naming tensor and file for a tensor that does not read or (unless `allow_nonfinite`) holds NaN or
    infinity."""
    loaded = []
    with contextlib.ExitStack() as stack:
        files = {name: stack.enter_context(open_safetensors(path / name))
                 for name in sorted({found[k].file for e in entries for k in e.keys()})}

        def read(key):
            file = path / found[key].file
            try:
                value = files[found[key].file].get_tensor(key)
            except Exception as e:   # safetensors' own error type
                raise ValueError(f"tensor {key!r} in {file} does not read: {e}") from None
            if not allow_nonfinite:
                bad = int(np.size(value) - np.count_nonzero(np.isfinite(value)))
                if bad:
                    raise ValueError(f"tensor {key!r} in {file} holds {bad} non-finite value(s) (NaN or infinity) "
                                     f"of {np.size(value)}; pass allow_nonfinite=True to load it anyway")
            return value

        for e in entries:
            if e.copy:   # equal to the tensor its parameter is read from (check_copies)
                continue
            var = flat[e.path]
            dt, sharding = var.dtype, shardings[e.path]
            slice_shape = var.shape[e.depth:]
            if e.depth == 0:
                value = jax.device_put(np.asarray(e.to_zoo(read(e.hf), slice_shape), dt), sharding)
            else:
                value = _allocate(var.shape, dt, sharding)
                for index, key in e.tensors():
                    piece = np.asarray(e.to_zoo(read(key), slice_shape), dt)
                    value = _set_slice(value, piece, np.asarray(index, np.int32))
            loaded.append((e.path, var.replace(value)))
    return loaded


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
                                 f"(load with mtp=False to leave the multi-token-prediction module out)")


# -- writing --------------------------------------------------------------------------------------------------

# What a Hugging Face model directory's weights and config are: `to_hf(..., overwrite=True)` replaces these (and
# only these), so no stale shard or a second format's weights stay beside the new ones.
CHECKPOINT_FILES = ("config.json", "*.safetensors", INDEX, "pytorch_model*.bin", "pytorch_model.bin.index.json",
                    "tf_model.h5", "flax_model*.msgpack", "flax_model.msgpack.index.json")


def to_hf(model: nnx.Module, path: str | os.PathLike, *, max_shard_bytes: int = 5 * 2**30,
          overwrite: bool = False) -> None:
    """Write `model` as a Hugging Face checkpoint: config.json and safetensors shards (with
    model.safetensors.index.json when there is more than one) that `transformers.AutoModelForCausalLM`
    loads. `path` is created if needed and must be empty: ValueError otherwise, listing what it holds. With
    `overwrite=True` a non-empty directory is accepted: the files of a previous checkpoint in it (config.json,
    safetensors shards and index, and `.bin`/`.h5`/`.msgpack` weights: `CHECKPOINT_FILES`) are replaced, and
    everything else (tokenizer files, README, generation_config.json) is kept.

    The checkpoint is written into a temporary folder beside `path` (`.<name>.partial-*`) and swapped in only when
    complete (`swap_in`), so a failure (a full disk, an interrupt) leaves `path` as it was: an OSError names the
    path and the cause. TypeError for a `model` that is not a zoo model or arguments of the wrong type."""
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
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    entries = arch.hf.keys(cfg)
    if set(flat) != {e.path for e in entries}:
        raise RuntimeError(f"zoo bug: the {arch.hf.architecture} key map does not cover the model: "
                           f"{sorted(set(flat) ^ {e.path for e in entries})}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.partial-"))
    except OSError as e:
        raise OSError(e.errno, f"to_hf: cannot write beside {path}: {e.strerror or e}") from None
    try:
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o777 & ~_umask())
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


def keep_user_files(old: Path, new: Path) -> None:
    """Hard-link (else copy) into `new` everything in `old` that is not a checkpoint file (`CHECKPOINT_FILES`):
    tokenizer files, README, folders; symlinks stay symlinks."""
    if not old.exists():
        return
    for item in old.iterdir():
        if any(fnmatch.fnmatch(item.name, pattern) for pattern in CHECKPOINT_FILES) and item.is_file():
            continue
        if item.is_symlink():
            os.symlink(os.readlink(item), new / item.name)
        elif item.is_dir():
            shutil.copytree(item, new / item.name, symlinks=True, copy_function=_link_or_copy)
        else:
            _link_or_copy(item, new / item.name)


def _link_or_copy(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def swap_in(new: Path, path: Path) -> None:
    """Put the complete directory `new` at `path`. An absent or empty `path` is replaced in one rename; a full one
    is renamed aside (`.<name>.old-*`), `new` renamed in, and only then the old one removed (were the process
    killed between the two renames, both folders are complete beside `path`)."""
    if not path.exists() or not any(path.iterdir()):
        os.replace(new, path)   # rename(2) replaces an empty directory
        return
    old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.old-"))
    os.replace(path, old)
    try:
        os.replace(new, path)
    except BaseException:
        os.replace(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
