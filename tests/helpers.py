"""Shared test helpers: gradients under a recipe, relative errors, CUDA lowering text, subprocess environments."""
from __future__ import annotations

import collections
import contextlib
import os
import pathlib
import subprocess
import types

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import zoo

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiered(values, fast) -> list:
    """`values` as pytest params for a test of one concern over many cases: those in `fast` run by default, the
    others are marked `slow` (the full set: `-m "slow or not slow"`, which CI runs). The default run checks the
    concern on the cases that differ in kind; the slow set adds every remaining case."""
    import pytest
    return [pytest.param(v, marks=() if v in fast else (pytest.mark.slow,)) for v in values]


def plain(recipe) -> bool:
    """A recipe of tags alone (one sequence tile, one layer per group): the per-recipe checks of each family's tests
    read its residuals per layer; the recipes with tiles or groups are checked in tests/models/test_stack.py."""
    return recipe.seq_tiles == 1 and recipe.group == 1


def cpu_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """The environment of a test's subprocess: this process's (with the run's XLA flags and compilation cache, set
    in conftest.py), the repository on PYTHONPATH, JAX on the CPU and, given `devices`, that many fake CPU devices
    (the count is fixed when JAX starts, so a multi-device check runs in a process of its own)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu", **extra}
    if devices is not None:
        count = "--xla_force_host_platform_device_count"
        flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(count)]
        env["XLA_FLAGS"] = " ".join(flags + [f"{count}={devices}"])
    return env


def assert_unbroken(text: str, *lines: str) -> None:
    """`text`, output sent to a file or a pipe, as a log keeps it: no table cell cut (`…`), no table row wrapped
    onto a further line (a row's first cell is never blank), and each of `lines` within one line (one that
    begins and ends as given where " ... " joins the two)."""
    assert "…" not in text, text
    for row in (line for line in text.splitlines() if line.startswith("│")):
        assert row.split("│")[1].strip(), f"a table row wrapped onto a further line:\n{text}"
    for want in lines:
        start, elided, end = want.partition(" ... ")
        assert any(line.startswith(start) and line.rstrip().endswith(end) if elided else want in line
                   for line in text.splitlines()), f"{want!r} is not within one line of:\n{text}"


def loss_fn(graphdef, state, tokens):
    # copy=True: variables that are not differentiated (DeepSeek-V3's routing biases) must be made afresh at this
    # trace level, or nnx.scan refuses them ("different trace level").
    logits = nnx.merge(graphdef, state, copy=True)(tokens).astype(jnp.float32)
    targets = jnp.roll(tokens, -1, axis=1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def grads_under(model, recipe, tokens):
    """(loss, grads) of a next-token loss with `recipe` set on `model` (same parameters)."""
    model.set_recipe(recipe)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    f = jax.jit(jax.value_and_grad(lambda p: loss_fn(graphdef, nnx.merge_state(p, rest), tokens)))
    return f(params)


def max_rel_err(a, b) -> float:
    errs = [np.linalg.norm(np.asarray(x, np.float64) - np.asarray(y, np.float64)) /
            max(np.linalg.norm(np.asarray(y, np.float64)), 1e-30)
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]
    return max(errs)


def cuda_lowering(model, tokens) -> str:
    """StableHLO text of the training gradient lowered for CUDA (no GPU needed)."""
    graphdef, state = nnx.split(model)
    grad = jax.jit(jax.grad(lambda s: loss_fn(graphdef, s, tokens)))
    return grad.trace(state).lower(lowering_platforms=("cuda",)).as_text()


def placed_shapes(hlo_text: str, marker: str) -> collections.Counter:
    """Counter of tensor types that lowered text annotates with a placement whose text holds `marker`."""
    out = collections.Counter()
    for line in hlo_text.splitlines():
        if "annotate_device_placement" in line and marker in line:
            out[line.rsplit("->", 1)[-1].strip()] += 1
    return out


def pinned_host_shapes(hlo_text: str) -> collections.Counter:
    """Counter of tensor types moved to pinned host memory in lowered text."""
    return placed_shapes(hlo_text, '"pinned_host"')


def hlo_type(shape, dtype) -> str:
    names = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
    return "tensor<" + "x".join(str(d) for d in shape) + "x" + names[jnp.dtype(dtype).name] + ">"


def random_tiny_llama(scale: float = 1.0):
    """A one-layer Llama whose parameters NumPy draws (normal, times `scale`) into its abstract state: no compile."""
    cfg = zoo.models.LlamaConfig.preset("tiny", vocab_size=32, dim=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                        head_dim=8, mlp_dim=32)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: zoo.models.llama3(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(0)
    leaves = [(p, v.replace(jnp.asarray(scale * rng.standard_normal(v.shape), v.dtype)))
              for p, v in nnx.to_flat_state(state)]
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def fake_gpu(cc="9.0", kind="NVIDIA H200"):
    """A stand-in for an NVIDIA jax.Device (what the per-device choices read), for checking them on the CPU."""
    return types.SimpleNamespace(platform="gpu", device_kind=kind, compute_capability=cc,
                                 client=types.SimpleNamespace(platform_version="PJRT C API\ncuda 13000"))


COMPILED = "/jax/core/compile/backend_compile_duration"
CACHE_HIT = "/jax/compilation_cache/cache_hits"


@contextlib.contextmanager
def executables():
    """A list that gets one entry per executable XLA builds (or takes from the persistent cache) while open."""
    seen: list[str] = []

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == COMPILED:
            seen.append(event)

    def on_event(event: str, **kwargs) -> None:
        if event == CACHE_HIT:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)


def finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr); every process still running at the deadline is killed (the test fails)."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
