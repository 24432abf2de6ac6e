"""Shared pieces of the GPU benchmarks: an SGD training step on a zoo model, timing, memory figures.

Each benchmark process measures ONE configuration (XLA reads its flags at start and `peak_bytes_in_use`
never resets), and prints one JSON line (a record of `bench.records`). Figures: median of several steps after
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

from bench import records
from zoo.layers import moe
from zoo.models.lm import extra_logits_key
from zoo.train_step import eval_loss, next_token_loss


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


def sgd_step_fn(graphdef, lr: float = 1e-4, param_shardings=None, loss_chunk=None):
    """A plain SGD step (as the plain-JAX anchors do): memory is params + grads + activations. With
    `param_shardings`, the updated parameters keep them (a sharded step is called again on its own output). With
    `loss_chunk`, the step takes the training step's batch ({"tokens": [B, S+1], "weights": [B, S]}) and its loss
    (`zoo.train_step.eval_loss`: the head and the cross-entropy in chunks of that many positions, or "auto"), which
    long sequences need; its second output is then 0."""

    def chunked_loss_fn(params, rest, batch):
        return eval_loss(nnx.merge(graphdef, params, rest, copy=True), batch, loss_chunk), jnp.zeros((), jnp.int32)

    def loss_fn(params, rest, tokens):
        model = nnx.merge(graphdef, params, rest, copy=True)  # copy: non-Param variables (routing bias) under scan
        logits, aux = model(tokens, return_aux=True)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        targets = jnp.roll(tokens, -1, axis=1)
        loss = -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))
        for name, head in model.extra_heads().items():   # e.g. multi-token prediction, as the main job weighs it
            weights = jnp.ones(targets.shape, jnp.float32)   # its loss from its logits, the head's own loss function
            logits = aux.pop(extra_logits_key(name))
            loss = loss + head.loss_weight * head.loss(logits, targets, weights, weights, next_token_loss)
        return loss, dropped_copies(aux)

    def step(params, rest, tokens):
        (loss, dropped), grads = jax.value_and_grad(chunked_loss_fn if loss_chunk else loss_fn, has_aux=True)(
            params, rest, tokens)
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


def step_options(recipe) -> dict[str, str]:
    """The XLA options a bench compiles its step with: the library's for `recipe` on this device
    (`zoo.compile_options.for_step`, what the main job uses), unless `BENCH_OPTIONS` (a JSON object of XLA debug
    options, `{}` for XLA's defaults) sets them for a sweep over settings."""
    from zoo import compile_options

    if os.environ.get("BENCH_OPTIONS") is not None:
        return json.loads(os.environ["BENCH_OPTIONS"])
    return compile_options.for_step(recipe, jax.devices()[0].platform).options


def options_label(options: dict[str, str]) -> str:
    """Compile options as the flags they equal ("--name=value ..."), for a record's `flags`."""
    return " ".join(f"--{k}={v}" for k, v in options.items())


def peak_bytes() -> int:
    """The largest `peak_bytes_in_use` over this process's devices (0 where the backend keeps no statistics)."""
    return max((d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices())


def measure(model, tokens, *, flops_per_step: float, steps: int = 6, warmup: int = 2, mesh=None,
            recipe=None) -> dict:
    """Time the SGD step, compiled with `step_options(recipe)`. `flops_per_step` is global; `tflops` is per device
    of `mesh` (one without), `peak_gib` the largest of the devices'. Under a mesh the step is traced inside
    `zoo.sharding.use(mesh)`."""
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
        options = step_options(recipe)
        compiled = step.lower(params, rest, tokens).compile(compiler_options=options)
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
        has_S5="S(5)" in text, compile_s=round(compile_s, 1), loss=float(loss), dropped=int(dropped),
        compile_options=options)


def planned(cfg, recipe, *, batch: int, seq: int, optimizer: str = "adamw", peak: str = "auto",
            mesh=None, grad_accum: int = 1, opt_state: str = "device", opt_dtype: str = "float32",
            params: str = "device") -> dict:
    """The planner's host bytes and peak-HBM prediction for the record: on a GPU the main job's training step
    (zoo.train_step, with `optimizer`) compiled on abstract inputs for the device present (`planned_peak_source`
    says "compiled for ..."); under a `mesh` (a spec such as "fsdp=2", or a Mesh; `batch` is then the global batch)
    every figure is per device and, on the GPUs of the mesh, the peak is the sharded step's compiled per-device
    figure ("compiled for 2 x NVIDIA H200 (gpu) (mesh fsdp=2), per device"). Elsewhere (the CPU, too few devices)
    the planner's labelled estimate. `planned_floor_gib` is the floor (saved activations + model state in HBM);
    `planned_host_gib` the offloaded activations, `planned_state_host_gib` the state kept in pinned host memory
    (`opt_state="host"`); `grad_accum`: micro-batches per update and `opt_dtype`: the moments' dtype, as the main
    job's flags, like `params` (where the float32 master copy of bf16 parameters lives)."""
    import zoo

    peak = {"none": None}.get(os.environ.get("BENCH_PLAN_PEAK", ""), peak)   # "none": skip the peak's compile
    p = zoo.plan.plan(cfg, recipe, batch=batch, seq=seq, peak=peak, parallel=zoo.plan.Parallelism(mesh=mesh),
                      training=zoo.plan.Training(optimizer=optimizer, grad_accum=grad_accum, opt_state=opt_state,
                                            opt_dtype=opt_dtype, params=params))
    peak_bytes = p.peak_bytes
    est = p.step_time()
    return dict(planned_host_gib=round(p.host_bytes / 2**30, 3),
                planned_state_host_gib=round(p.state.host / 2**30, 3),
                planned_step_s=None if est is None else round(est["total_s"], 4),
                planned_peak_gib=None if peak_bytes is None else round(peak_bytes / 2**30, 2),
                planned_peak_source=getattr(p, "peak_source", None),
                planned_floor_gib=round(p.hbm_bytes / 2**30, 2))


def emit(record: dict) -> None:
    options = options_label(record.get("compile_options") or {})
    record.update(jax=jax.__version__, flags=" ".join(x for x in (os.environ.get("XLA_FLAGS", ""), options) if x))
    record.setdefault("gpus", jax.device_count())
    record.setdefault("mesh", None)
    record.setdefault("date", datetime.date.today().isoformat())
    try:
        line = json.dumps(records.normalize(record, impl="zoo"))   # the one schema (bench/records.py)
    except ValueError as e:   # a measurement is never lost: written as it is, and the records' test names it
        line = json.dumps({**record, "schema_error": str(e)})
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


PGLE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"


def profile_guided(lowered, options: dict[str, str], run, *, steps: int = 2, workdir: str | None = None):
    """(`lowered` compiled again with XLA's latency-hiding scheduler fed by measured costs, the profile's path).

    XLA's latency-hiding scheduler places each host copy's start and the wait for it from estimated latencies.
    The profile of the offloading step shows the compute stream waiting on single copies inside every layer (on
    the H200: ~36 ms per layer in the forward pass before a memset, 50-60 ms per layer in the backward pass; the
    copy's wait comes before the compute it could have run beside). Profile-guided latency estimation (PGLE)
    replaces the estimates with what a profile measured.
    `run(compiled)` runs one step of the program already compiled (the caller threads its state and blocks until
    the step is done); it is called `steps` times under `jax.profiler.trace`, and the profile of those steps
    (`jax.experimental.profiler.get_profiled_instructions_proto`) is passed to a second compilation of the same
    program. GPU only: elsewhere the profile is empty and the program is returned compiled as before.

    Measured on the H200 (bench/results/offload-pays_2026-12-01.jsonl): mixed (qkv_offload 2.184 -> 2.162 s,
    the 6-layer minimal_offload 2.026 -> 1.993 s, the 3-layer minimal_offload 2.016 -> 2.219 s), so the zoo does
    not apply it by default; it stays here for the benches."""
    import glob
    import tempfile

    from jax.experimental.profiler import get_profiled_instructions_proto

    first = lowered.compile(compiler_options=options)
    workdir = workdir or tempfile.mkdtemp(prefix="zoo-pgle-")
    with jax.profiler.trace(workdir):
        for _ in range(steps):
            run(first)
    runs = sorted(glob.glob(os.path.join(workdir, "plugins", "profile", "*")), key=os.path.getmtime)
    proto = get_profiled_instructions_proto(runs[-1]) if runs else b""
    if not proto:
        return first, None
    path = os.path.join(workdir, "profile.pb")
    with open(path, "wb") as f:
        f.write(proto)
    return lowered.compile(compiler_options={**options, PGLE_OPTION: path}), path
