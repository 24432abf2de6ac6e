"""Peak HBM with XLA's temporaries: the training step compiled on abstract inputs (`compile_step`, `from_compiled`:
arguments + outputs - aliased + temporaries, per device under a mesh), or, for another device, a mesh larger than the
devices present or a `shard=N` split, an estimate labelled so (`estimate`: the planner's floor, the loss's logits and
one group's backward beyond the floor). What each figure holds: docs/internals.md, "The peak".
"""
from __future__ import annotations

import dataclasses
import math

import jax

from zoo.loss import CHUNK_BYTES, MIN_DEFAULT_CHUNK, chunk_under, divisors, resolve_chunk
from zoo.models.registry import family_of
from zoo.plan.types import ceil_div
from zoo.train_step import DEFAULT_LOSS_CHUNK, compile_abstract
from zoo.training import STEP, Training
from zoo.two_programs import peak_bytes


@dataclasses.dataclass(frozen=True)
class Peak:
    """Peak device bytes of one training step, and where the figure comes from."""
    bytes: int
    source: str                      # "compiled for <device>", "compiled for N x <device> (mesh ...), per
                                     # device" or "estimate (...)"
    compiled: bool
    detail: dict                     # the memory analysis' fields, or the estimate's terms

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def allocator_limit(device: jax.Device) -> int | None:
    """The bytes XLA's allocator may use on `device` (`memory_stats()["bytes_limit"]`: 75% of the HBM under JAX's
    default preallocation), or None where the backend keeps no such limit (the CPU).

    Args:
        device: a `jax.Device`.

    Returns:
        The allocator's limit in bytes, or None.

    Examples:
        >>> import jax, zoo
        >>> limit = zoo.plan.allocator_limit(jax.devices()[0])   # None on the CPU, ~105 GB on an H200 by default
        >>> limit is None or limit > 0
        True
    """
    return (device.memory_stats() or {}).get("bytes_limit") or None


def device_label(device: jax.Device) -> str:
    return f"{device.device_kind} ({device.platform})" if device.device_kind != device.platform else device.platform


def mesh_label(mesh) -> str:
    """"fsdp=4,tp=2": the axes of a Mesh or AbstractMesh that split (all of them when none does)."""
    sizes = {str(a): int(n) for a, n in dict(mesh.shape).items()}
    return ",".join(f"{a}={n}" for a, n in sizes.items() if n > 1) or ",".join(f"{a}={n}" for a, n in sizes.items())


def compile_step(cfg, recipe, *, batch: int, seq: int, training: Training = STEP,
                 mesh: jax.sharding.Mesh | None = None):
    """The main job's training step (`zoo.train_step.compile_abstract`) for `cfg` under `recipe` at global
    [batch, seq], the step `training` describes, lowered on abstract inputs and compiled (nothing allocated); with a
    (concrete) `mesh`, sharded as the main job compiles it."""
    return compile_abstract(family_of(cfg), cfg, recipe, batch=batch, seq=seq, training=training, mesh=mesh)[0]


def from_compiled(compiled, device: jax.Device | None = None, mesh=None) -> Peak:
    """The peak of a compiled step: arguments + outputs - aliased + temporaries (XLA's memory analysis). With the
    `mesh` it was compiled for (a Mesh or an AbstractMesh), the figures are one device's and the source says so:
    "compiled for 2 x NVIDIA H200 (gpu) (mesh fsdp=2), per device"."""
    ma = compiled.memory_analysis()
    if ma is None:
        raise ValueError("this backend's compiled program has no memory analysis")
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes", "temp_size_in_bytes",
              "host_temp_size_in_bytes", "host_argument_size_in_bytes", "host_output_size_in_bytes",
              "host_alias_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes")
    detail = {f.removesuffix("_size_in_bytes").removesuffix("_in_bytes"): int(getattr(ma, f, 0) or 0)
              for f in fields}
    peak = peak_bytes(ma)
    if device is None:
        device = (mesh.devices.flat[0] if isinstance(mesh, jax.sharding.Mesh) else jax.devices()[0])
    where = device_label(device)
    if mesh is not None:
        n = math.prod(dict(mesh.shape).values())
        where = f"{n} x {where} (mesh {mesh_label(mesh)}), per device"
    return Peak(bytes=peak, source=f"compiled for {where}", compiled=True, detail=detail)


def loss_bytes(cfg, loss_chunk, rows: int, seq: int, shard: int) -> int:
    """The loss's share of the peak for `rows` sequences per device: the float32 logits and their gradient of one
    chunk (`loss_chunk` as `zoo.train_step` takes it; the whole sequence unchunked), and, chunked with 16-bit
    parameters, the float32 sum of the head's [dim, vocab] gradient beyond the gradient's own bytes."""
    chunk = resolve_chunk(loss_chunk, rows, seq, cfg.vocab_size)
    param_bytes = jax.numpy.dtype(cfg.weight_dtype).itemsize
    head_sum = max(0, 4 - param_bytes) * ceil_div(cfg.dim * cfg.vocab_size, shard) if chunk else 0
    return 2 * 4 * rows * (chunk or seq) * cfg.vocab_size + head_sum


def chunk_to_fit(cfg, *, peak: int, limit: int, chunk: int | None, rows: int, seq: int, shard: int = 1
                 ) -> int | None:
    """The longest chunk of the loss (the fewest chunks: a divisor of `seq`, shorter than `chunk`; None: the whole
    sequence) whose float32 logits fit beside the rest of the step: `peak` (the step's at `chunk`) less the logits it
    holds, plus the shorter chunk's, within `limit`. Where no chunk fits, the logits are not what is over: the longest
    chunk whose logits take at most `zoo.loss.CHUNK_BYTES` (more, smaller chunks would only run smaller matmuls), or
    `chunk` itself when it is already that short."""
    held = loss_bytes(cfg, chunk, rows, seq, shard)
    shorter = [d for d in _chunks(seq) if d < (chunk or seq)]
    for c in shorter:
        if peak - held + loss_bytes(cfg, c, rows, seq, shard) <= limit:
            return c
    small = chunk_under(CHUNK_BYTES, rows, seq, cfg.vocab_size)
    if small is None or (chunk is not None and chunk <= small):
        return chunk
    return next((c for c in shorter if c <= small), chunk)


def _chunks(seq: int) -> list[int]:
    """The chunk lengths the loss may take, longest first: divisors of `seq` shorter than it, down to
    `MIN_DEFAULT_CHUNK`."""
    return [d for d in sorted(divisors(seq), reverse=True) if d < seq and d >= min(MIN_DEFAULT_CHUNK, seq)]


def estimate(floor: int, *, cfg, batch: int, seq: int, shard: int, working: int, why: str,
             loss_chunk=DEFAULT_LOSS_CHUNK) -> Peak:
    """The floor (saved activations and model state) plus the loss's logits and gradient (`loss_bytes`) and what one
    group's backward pass holds beyond the floor (`working`: `zoo.plan.measure.working_bytes`).
    `detail["loss_chunk"]`: the chunk length (None: unchunked)."""
    rows = ceil_div(batch, shard)
    chunk = resolve_chunk(loss_chunk, rows, seq, cfg.vocab_size)
    loss = loss_bytes(cfg, loss_chunk, rows, seq, shard)
    return Peak(bytes=floor + loss + working, source=f"estimate ({why})", compiled=False,
                detail=dict(floor=floor, loss_f32_logits_and_grads=loss, loss_chunk=chunk,
                            one_group_backward=working))
