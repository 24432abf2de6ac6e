"""Shared pieces of the GPU benchmarks: an SGD training step on a zoo model, timing, memory figures.

Each benchmark process measures ONE configuration (XLA reads its flags at start and `peak_bytes_in_use`
never resets), and prints one JSON line. Figures follow DESIGN section 8: median of several steps after
warm-up; model FLOPs = 6 * matmul parameters * tokens + causal attention (counted as half).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.layers import moe


def matmul_params(model) -> int:
    """Parameters that take part in matmuls: all but the embedding table and the norm scales."""
    total = 0
    for path, p in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path[-1] == "kernel":
            total += math.prod(p.shape)
    return total


def llama_step_flops(cfg, model, batch: int, seq: int) -> float:
    """Model FLOPs of one training step of a Llama slice: 6 x matmul parameters x tokens plus causal attention
    (QK^T and PV over half the keys), forward and backward (x3)."""
    attention = 2 * 2 * batch * seq * seq * cfg.num_heads * cfg.head_dim / 2 * cfg.num_layers
    return 3 * (2 * batch * seq * matmul_params(model) + attention)


def sgd_step_fn(graphdef, lr: float = 1e-4, param_shardings=None):
    """A plain SGD step (as the plain-JAX anchors do): memory is params + grads + activations. With
    `param_shardings`, the updated parameters keep them (a sharded step is called again on its own output)."""

    def loss_fn(params, rest, tokens):
        model = nnx.merge(graphdef, params, rest, copy=True)  # copy: non-Param variables (routing bias) under scan
        logits, aux = model(tokens, return_aux=True)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        targets = jnp.roll(tokens, -1, axis=1)
        return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1)), dropped_copies(aux)

    def step(params, rest, tokens):
        (loss, dropped), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, tokens)
        params = jax.tree.map(lambda p, g: (p - lr * g.astype(p.dtype)).astype(p.dtype), params, grads)
        return (loss, dropped), params

    kwargs = {} if param_shardings is None else {"out_shardings": ((None, None), param_shardings)}
    return jax.jit(step, donate_argnums=(0,), **kwargs)


def dropped_copies(aux) -> jax.Array:
    """Token copies MoE capacity dispatch dropped in a step (0 for dropless backends and dense models)."""
    return moe.drops(aux)[0]


def sharded_inputs(build, cfg, recipe, tokens, mesh_spec: str | None):
    """(model, tokens, mesh): with `mesh_spec`, the model created sharded on `zoo.sharding.make_mesh(mesh_spec)`
    (checked against the config and the global batch first) and the tokens split over the data axes; without,
    the plain build on the default device."""
    from flax import nnx as _nnx

    from zoo import sharding
    if mesh_spec is None:
        return build(cfg, recipe=recipe, rngs=_nnx.Rngs(0)), tokens, None
    mesh = sharding.make_mesh(mesh_spec)
    sharding.check_mesh(cfg, mesh, batch=tokens.shape[0])
    model = sharding.create(build, cfg, recipe=recipe, mesh=mesh, seed=0)
    return model, jax.device_put(tokens, sharding.batch_sharding(mesh)), mesh


def peak_bytes() -> int:
    """The largest `peak_bytes_in_use` over this process's devices (0 where the backend keeps no statistics)."""
    return max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices())


def measure(model, tokens, *, flops_per_step: float, steps: int = 6, warmup: int = 2, mesh=None) -> dict:
    """Time the SGD step. `flops_per_step` is global; `tflops` is per device of `mesh` (one without), `peak_gib`
    the largest of the devices'. Under a mesh the step is traced inside `zoo.sharding.use(mesh)`."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    shardings = None if mesh is None else jax.tree.map(lambda x: x.sharding, params)
    step = sgd_step_fn(graphdef, param_shardings=shardings)
    t0 = time.perf_counter()
    if mesh is None:
        context = contextlib.nullcontext()
    else:
        from zoo import sharding
        context = sharding.use(mesh)
    with context:
        compiled = step.lower(params, rest, tokens).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    text = compiled.as_text()
    for _ in range(warmup):
        (loss, dropped), params = compiled(params, rest, tokens)
        loss.block_until_ready()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        (loss, dropped), params = compiled(params, rest, tokens)
        loss.block_until_ready()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    devices = 1 if mesh is None else mesh.devices.size
    return dict(
        step_s=round(step_s, 4), step_s_spread=round(max(times) - min(times), 4),
        tflops=round(flops_per_step / step_s / 1e12 / devices, 1),
        peak_gib=round(peak_bytes() / 2**30, 2),
        temp_gib=round(ma.temp_size_in_bytes / 2**30, 2),
        host_temp_gib=round(getattr(ma, "host_temp_size_in_bytes", 0) / 2**30, 2),
        has_S5="S(5)" in text, compile_s=round(compile_s, 1), loss=float(loss), dropped=int(dropped))


def planned(cfg, recipe, *, batch: int, seq: int, optimizer: str = "adamw", peak: str = "auto",
            mesh=None) -> dict:
    """The planner's host bytes and peak-HBM prediction for the record: on a GPU the main job's training step
    (zoo.train_step, with `optimizer`) compiled on abstract inputs for the device present (`planned_peak_source`
    says "compiled for ..."); under a `mesh` (a spec such as "fsdp=2", or a Mesh; `batch` is then the global batch)
    every figure is per device and, on the GPUs of the mesh, the peak is the sharded step's compiled per-device
    figure ("compiled for 2 x NVIDIA H200 (gpu) (mesh fsdp=2), per device"). Elsewhere (the CPU, too few devices)
    the planner's labelled estimate. `planned_floor_gib` is the floor (saved activations + model state)."""
    import zoo

    p = zoo.plan(cfg, recipe, batch=batch, seq=seq, optimizer=optimizer, peak=peak,
                 **({} if mesh is None else {"mesh": mesh}))
    peak_bytes = p.peak_bytes
    return dict(planned_host_gib=round(p.host_bytes / 2**30, 3),
                planned_peak_gib=None if peak_bytes is None else round(peak_bytes / 2**30, 2),
                planned_peak_source=getattr(p, "peak_source", None),
                planned_floor_gib=round(p.hbm_bytes / 2**30, 2))


def emit(record: dict) -> None:
    record.update(jax=jax.__version__, flags=os.environ.get("XLA_FLAGS", ""))
    record.setdefault("gpus", jax.device_count())
    record.setdefault("mesh", None)
    record.setdefault("date", datetime.date.today().isoformat())
    line = json.dumps(record)
    print(line, flush=True)
    out = os.environ.get("BENCH_OUT")
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def guarded(fn, **ident):
    try:
        emit({**ident, **fn()})
    except Exception as e:  # report OOM and friends as data, not as a crash of the whole sweep
        emit({**ident, "error": f"{type(e).__name__}: {str(e)[:300]}"})
        sys.exit(0)
