"""How to update state that lives in pinned host memory without holding it in HBM whole: AdamW-like moments m, v
[L, N] (float32, on the host, donated) and gradients [L, N] (bf16, in HBM), updated three ways:

- `whole`: `device_put` both into HBM, update, back (what the main job's step did before `zoo.streamed_update`);
- `scanned`: a `lax.scan` over the host arrays as xs, each slice brought in, updated and sent back as ys;
- `carried`: a `lax.fori_loop` whose carry is the host arrays: slice i brought in, updated, sent back and written in
  place (the mechanism `zoo.streamed_update` uses).

Prints each one's device and host temporaries from XLA's memory analysis, and its time for the last of 4 calls.

    python -m bench.stream_state_probe [--layers 32 --columns 67108864 --variants whole,scanned,carried]
"""
from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp

DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])
HOST = DEVICE.with_memory_kind("pinned_host")
_jit = functools.partial(jax.jit, donate_argnums=(0, 1), out_shardings=(HOST, HOST))


def adam_like(m, v, g):
    g = g.astype(jnp.float32)
    return 0.9 * m + 0.1 * g, 0.95 * v + 0.05 * g * g


@_jit
def whole(m, v, g):
    return adam_like(jax.device_put(m, DEVICE), jax.device_put(v, DEVICE), g)


@_jit
def scanned(m, v, g):
    def body(carry, xs):
        mi, vi = adam_like(jax.device_put(xs[0], DEVICE), jax.device_put(xs[1], DEVICE), xs[2])
        return carry, (jax.device_put(mi, HOST), jax.device_put(vi, HOST))
    return jax.lax.scan(body, None, (m, v, g))[1]


@_jit
def carried(m, v, g):
    def body(i, carry):
        m, v = carry
        take = functools.partial(jax.lax.dynamic_index_in_dim, index=i, keepdims=False)
        mi, vi = adam_like(jax.device_put(take(m), DEVICE), jax.device_put(take(v), DEVICE), take(g))
        return (jax.lax.dynamic_update_index_in_dim(m, jax.device_put(mi, HOST), i, 0),
                jax.lax.dynamic_update_index_in_dim(v, jax.device_put(vi, HOST), i, 0))
    return jax.lax.fori_loop(0, m.shape[0], body, (m, v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--columns", type=int, default=64 * 2**20, help="elements of one layer's slice of m and v")
    ap.add_argument("--variants", default="whole,scanned,carried")
    a = ap.parse_args()
    for name in a.variants.split(","):
        f = {"whole": whole, "scanned": scanned, "carried": carried}[name]
        m, v = (jax.device_put(jnp.zeros((a.layers, a.columns), jnp.float32), HOST) for _ in range(2))
        g = jax.device_put(jnp.ones((a.layers, a.columns), jnp.bfloat16), DEVICE)
        ma = f.lower(m, v, g).compile().memory_analysis()
        for _ in range(4):
            t = time.perf_counter()
            m, v = jax.block_until_ready(f(m, v, g))
            seconds = time.perf_counter() - t
        print(f"{name}: device temporaries {ma.temp_size_in_bytes / 2**30:.3f} GiB, host temporaries "
              f"{getattr(ma, 'host_temp_size_in_bytes', 0) / 2**30:.3f} GiB, {seconds:.4f} s for "
              f"{2 * a.layers * a.columns * 4 / 2**30:.2f} GiB each way; m[0, 0] = {float(m[0, 0]):.6f}", flush=True)


if __name__ == "__main__":
    main()
