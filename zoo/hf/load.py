"""Read a Hugging Face checkpoint (config.json + sharded safetensors) as a scanned zoo model: checked against the model
its config.json describes before any array is made (`zoo.hf.checks`), then each parameter allocated once on its sharding
and filled one HF tensor at a time. Single-process.
"""
from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo import renames
from zoo import sharding as zoo_sharding
from zoo.hf import config as hf_config
from zoo.hf import keymap
from zoo.hf.checks import check_copies, check_keymap_covers, check_tensors, check_tied
from zoo.hf.files import FLOAT_DTYPES, TensorInfo, list_tensors, open_safetensors, read_config
from zoo.models import registry
from zoo.recipe import Recipe

__all__ = ["from_hf"]


def arch_for_config(hf: dict):
    """The model family (zoo.models.registry) whose Hugging Face architecture config.json names."""
    hf_config.check_types(hf)   # `architectures` a list of names: matched exactly
    return registry.family_for_hf(hf)


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


@renames.keywords(mtp="extra_heads= (the model's extra heads, e.g. multi-token prediction)")
def from_hf(path: str | os.PathLike, recipe: Recipe | None = None, dtype=None, *, mesh=None,
            rules: Sequence[tuple[str, Any]] | None = None, allow_nonfinite: bool = False,
            extra_heads: bool | None = None) -> nnx.Module:
    """Load a Hugging Face checkpoint directory (config.json and its safetensors, of a registered family's architecture)
    as a scanned zoo model, each parameter placed on its sharding (`mesh`, `rules`) as it is read; `dtype`: the
    parameters' (default: the checkpoint's).

    ValueError, before anything is loaded, for a checkpoint that does not describe the model (`zoo.hf.checks`; the
    directory is untrusted input, `zoo.hf.files`), and while streaming for a tensor holding NaN or infinity unless
    `allow_nonfinite`. `extra_heads`: False skips them, True loads them, None loads them if the checkpoint holds
    them."""
    check_from_hf_args(path, recipe, allow_nonfinite, extra_heads)
    path = Path(path)
    hf = read_config(path)
    arch = arch_for_config(hf)
    found = list_tensors(path)
    first = next((found[k] for k in ("model.embed_tokens.weight",) if k in found), None)
    param_dtype = hf_config.param_dtype_of(hf, dtype, FLOAT_DTYPES.get(first.dtype) if first else None)
    cfg = arch.hf.from_hf(hf, param_dtype=param_dtype)
    skip = arch.hf.extra_keys(hf)   # the extra heads' keys
    if extra_heads is False or (extra_heads is None and not any(skip(key) for key in found)):
        cfg = cfg.without_extra_heads()

    if mesh is None:
        mesh = jax.sharding.get_mesh()
    # Parameters carry logical axis names, which nnx.eval_shape would read as mesh axes under an active mesh:
    # build the abstract model outside it, and map logical names to mesh axes ourselves (target_shardings).
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
        abstract = nnx.eval_shape(lambda: arch.build(cfg, recipe=recipe, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)   # parameters, and stored variables (routing biases): all read
    flat = dict(nnx.to_flat_state(state))
    entries = arch.hf.keys(cfg)
    check_keymap_covers(arch, flat, entries)
    tied_head = cfg.tie_embeddings and "lm_head.weight" in found  # checked against the embedding below
    check_tensors(entries, {p: v.shape for p, v in flat.items()}, found,
                  lambda key: skip(key) or (tied_head and key == "lm_head.weight"))
    if cfg.tie_embeddings and "lm_head.weight" in found:
        check_tied(path, found)
    check_copies(path, found, entries)

    loaded = stream(path, found, entries, flat, target_shardings(state, mesh, rules), allow_nonfinite=allow_nonfinite)
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def check_from_hf_args(path, recipe, allow_nonfinite, extra_heads) -> None:
    """TypeError naming the argument of the wrong type, before anything is read."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"from_hf: path must be a str or os.PathLike, got {type(path).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"from_hf: recipe must be a zoo.Recipe or None, got {type(recipe).__name__}")
    if not isinstance(allow_nonfinite, bool):
        raise TypeError(f"from_hf: allow_nonfinite must be a bool, got {type(allow_nonfinite).__name__}")
    if extra_heads is not None and not isinstance(extra_heads, bool):
        raise TypeError(f"from_hf: extra_heads must be a bool or None, got {type(extra_heads).__name__}")


def check_finite(key: str, file: Path, stored: np.ndarray, loaded: np.ndarray) -> None:
    """ValueError naming the tensor if `loaded` (the tensor in the parameter's dtype) holds NaN or infinity: ones
    stored so, or finite values the cast overflowed."""
    bad = int(np.size(loaded) - np.count_nonzero(np.isfinite(loaded)))
    if not bad:
        return
    was = int(np.size(stored) - np.count_nonzero(np.isfinite(stored)))
    if was:
        raise ValueError(f"tensor {key!r} in {file} holds {was} non-finite value(s) (NaN or infinity) of "
                         f"{np.size(stored)}; pass allow_nonfinite=True to load it anyway")
    dt = np.dtype(loaded.dtype)
    raise ValueError(f"tensor {key!r} in {file}: {bad} of its {np.size(stored)} {np.dtype(stored.dtype).name} "
                     f"values overflow {dt.name} (largest magnitude {float(np.max(np.abs(stored))):.4g}, beyond "
                     f"{dt.name}'s {float(jnp.finfo(dt).max):.4g}) and would load as infinity; load with a wider "
                     f"dtype= (e.g. bfloat16 or float32), or pass allow_nonfinite=True")


def stream(path: Path, found: dict[str, TensorInfo], entries: list[keymap.Entry], flat: dict[tuple, nnx.Variable],
           shardings: dict[tuple, Any], *, allow_nonfinite: bool = False) -> list[tuple[tuple, nnx.Variable]]:
    """Read every parameter (checked already) onto its sharding, one layer at a time: [(path, filled variable)].
    ValueError naming tensor and file for a tensor that does not read or (unless `allow_nonfinite`) holds NaN or
    infinity, checked in the parameter's dtype (a float32 value float16 cannot hold is an error too)."""
    loaded = []
    with contextlib.ExitStack() as stack:
        files = {name: stack.enter_context(open_safetensors(path / name))
                 for name in sorted({found[k].file for e in entries for k in e.keys()})}

        def read(key):
            try:
                return files[found[key].file].get_tensor(key)
            except Exception as e:   # safetensors' own error type
                raise ValueError(f"tensor {key!r} in {path / found[key].file} does not read: {e}") from None

        def cast(e, key, value, slice_shape, dt):
            """The tensor as the parameter's slice in its dtype; its finiteness checked AFTER the cast (float32
            values beyond float16's range become infinity there)."""
            with np.errstate(over="ignore"):   # an overflow is refused below, naming the tensor
                out = np.asarray(e.to_zoo(value, slice_shape), dt)
            if not allow_nonfinite:
                check_finite(key, path / found[key].file, value, out)
            return out

        for e in entries:
            if e.copy:   # equal to the tensor its parameter is read from (check_copies)
                continue
            var = flat[e.path]
            dt, sharding = var.dtype, shardings[e.path]
            slice_shape = var.shape[e.depth:]
            if e.depth == 0:
                value = jax.device_put(cast(e, e.hf, read(e.hf), slice_shape, dt), sharding)
            else:
                value = _allocate(var.shape, dt, sharding)
                for index, key in e.tensors():
                    piece = cast(e, key, read(key), slice_shape, dt)
                    value = _set_slice(value, piece, np.asarray(index, np.int32))
            loaded.append((e.path, var.replace(value)))
    return loaded
