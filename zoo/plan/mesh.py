"""Per-device figures under a mesh, no devices needed: model state and each tag's bytes per device by the sharding rules
(`zoo.sharding.shard_shape`, `tag_shard_shapes`) on an `AbstractMesh`; FLOPs and untagged residuals divided by the
device count.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from zoo import sharding
from zoo.dtypes import dtype_of
from zoo.plan.types import OPTIMIZERS, ModelState


def as_abstract(mesh) -> jax.sharding.AbstractMesh:
    """A spec ("fsdp=4,tp=2"), a {axis: size} dict, a Mesh or an AbstractMesh -> an AbstractMesh of the four
    axes (ValueError for an unknown axis or a bad size). A spec's device count is the product of its sizes."""
    if isinstance(mesh, jax.sharding.AbstractMesh):
        return mesh
    if isinstance(mesh, jax.sharding.Mesh):
        return sharding.abstract_mesh(sharding.mesh_sizes(mesh), mesh.devices.size)
    if isinstance(mesh, str):
        sizes = sharding.parse_mesh(mesh, _product_of_spec(mesh))
    elif isinstance(mesh, Mapping):
        sizes = sharding.parse_mesh(mesh, math.prod(v for v in mesh.values() if isinstance(v, int) and v > 0))
    else:
        raise ValueError(f"mesh must be a spec like 'fsdp=4,tp=2', a dict, or a jax Mesh, got {type(mesh).__name__}")
    return sharding.abstract_mesh(sizes, math.prod(sizes.values()))


def _product_of_spec(spec: str) -> int:
    n = 1
    for part in spec.split(","):
        value = part.partition("=")[2].strip()
        if value.isdigit() and int(value) > 0:
            n *= int(value)
    return n


def devices(mesh: jax.sharding.AbstractMesh) -> int:
    return math.prod(sharding.mesh_sizes(mesh).values())


def _per_device_bytes(sds, logical, mesh) -> int:
    shape = sharding.shard_shape(sds.shape, logical, mesh) if logical else tuple(sds.shape)
    return math.prod(shape) * jnp.dtype(sds.dtype).itemsize


def model_state(model, mesh, optimizer: str, opt_dtype: str) -> ModelState:
    """Per-device model state of the abstract `model` under `mesh` and its rules."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {', '.join(OPTIMIZERS)}")
    opt_itemsize = jnp.dtype(dtype_of("opt_dtype", opt_dtype)).itemsize
    state = nnx.state(model)
    specs = dict(nnx.to_flat_state(sharding.logical_specs(state)))
    n = params = opt = other = 0
    for path, var in nnx.to_flat_state(state):
        if not (hasattr(var, "shape") and hasattr(var, "dtype")):
            continue
        spec = specs[path]
        logical = tuple(spec.get_value() if isinstance(spec, nnx.Variable) else spec or ())
        nbytes = _per_device_bytes(var, logical, mesh)
        if isinstance(var, nnx.Param):
            n += math.prod(var.shape)
            params += nbytes
            opt += OPTIMIZERS[optimizer] * nbytes // jnp.dtype(var.dtype).itemsize * opt_itemsize
        else:
            other += nbytes
    return ModelState(num_params=n, params=params, grads=params, optimizer=opt, other=other,
                      optimizer_name=optimizer)


def tag_bytes(shapes, device_shapes) -> dict[str, dict[str, int]]:
    """{stack: {tag: per-device bytes of one layer's tensor}} from the model's tag shapes (`model.tag_shapes`) and
    their per-device shapes (`zoo.sharding.tag_shard_shapes`); a tag with no sharding constraint is whole on every
    device."""
    return {s: {t: math.prod(device_shapes[s].get(t, sds.shape)) * jnp.dtype(sds.dtype).itemsize
                for t, sds in st.tags.items()} for s, st in shapes.items()}
