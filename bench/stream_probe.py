"""Do host copies overlap compute? A microbenchmark of the ways to move a value to pinned host memory inside jit.

    XLA_FLAGS=--xla_gpu_experimental_stream_annotation=true python -m bench.stream_probe stream

A chain of `--n` blocks, each three [M, K] x [K, K] bf16 matmuls; after each block its output goes to pinned host
memory (the forward pass of an offload recipe) and, in the second half, comes back from the host and joins the
chain (the backward pass's reload). Variants (argv[1]):
- `device`: nothing moves (the compute alone);
- `plain`: `jax.device_put(x, jax.memory.Space.Host)` and back, as the offload policies lower;
- `stream`: the same copies inside `jax.experimental.compute_on.compute_on(compute_type="gpu_stream:1")`, which
  annotates them with an XLA stream (needs `--xla_gpu_experimental_stream_annotation=true`).
Prints one JSON line: step time, the copies' time and stream, and their overlap with compute, from a profile.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from bench import trace_summary
from bench.common import emit


def mover(variant: str, space):
    def put(x):
        return jax.device_put(x, space)

    if variant == "stream":
        from jax.experimental.compute_on import compute_on
        return compute_on(compute_type="gpu_stream:1", out_memory_spaces=space)(put)
    return put


def program(variant: str, n: int):
    to_host, to_device = mover(variant, jax.memory.Space.Host), mover(variant, jax.memory.Space.Device)

    def block(x, w):
        for _ in range(3):
            x = jnp.tanh(x @ w)
        return x

    def f(x, w):
        saved = []
        for _ in range(n):                       # forward: compute, then send the block's output away
            x = block(x, w)
            saved.append(x if variant == "device" else to_host(x))
        for s in reversed(saved):                # backward: bring each back while the next block computes
            s = s if variant == "device" else to_device(s)
            x = block(x + s, w)
        return x

    return jax.jit(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", choices=("device", "plain", "stream"))
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--m", type=int, default=16384)
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--out", default="/tmp/stream-probe")
    a = ap.parse_args()
    x = jax.random.normal(jax.random.key(0), (a.m, a.k), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (a.k, a.k), jnp.float32) / a.k ** 0.5).astype(jnp.bfloat16)

    def run():
        f = program(a.variant, a.n)
        text = f.lower(x, w).compile().as_text()
        for _ in range(2):
            f(x, w).block_until_ready()
        times = []
        for _ in range(5):
            t = time.perf_counter()
            f(x, w).block_until_ready()
            times.append(time.perf_counter() - t)
        with jax.profiler.trace(a.out):
            f(x, w).block_until_ready()
        p = trace_summary.summarise(trace_summary.load(a.out), 1)
        return dict(step_s=round(statistics.median(times), 5), copy_start_in_hlo="copy-start" in text,
                    S5_in_hlo="S(5)" in text, profile={k: p.get(k) for k in (
                        "window_ms_per_step", "compute_stream", "compute_busy_ms_per_step",
                        "compute_idle_ms_per_step", "copies")},
                    streams=[(s["stream"], s["busy_ms"]) for s in p["streams"]])

    try:
        emit(dict(bench="stream-probe", variant=a.variant, n=a.n, M=a.m, K=a.k, **run()))
    except Exception as e:  # a variant XLA refuses is a result too
        emit(dict(bench="stream-probe", variant=a.variant, error=f"{type(e).__name__}: {str(e)[:400]}"))


if __name__ == "__main__":
    main()
