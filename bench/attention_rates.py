"""Causal attention's own rate on this device: the forward, and the forward with its backward, of one attention
call shaped as the 8B's layer (batch 1, 32 query heads, 8 key/value heads, head dim 128, bf16) at each length, for
each kernel that can run here: cuDNN's (`jax.nn.dot_product_attention`, the zoo's GPU kernel) and tokamax's Pallas
kernels (Mosaic GPU and Triton), where tokamax is installed.

    python -m bench.attention_rates [--seq 32768 --seq 131072 ...] [--impl cudnn --impl mosaic ...] [--smoke]

One record per kernel and length (`bench.records`' schema, bench "attention-rates"): `tflops` is the forward and
backward's rate, counting causal attention's FLOPs as the planner does (`causal_attention_flops`, the backward twice
the forward); extras hold the forward's own rate and the seconds each took. A kernel that cannot run a case gives a
record with its error. `--smoke`: 256 positions, 4 heads, on any device (the XLA kernel stands in off the GPU)."""
from __future__ import annotations

import argparse
import time

SEQS = (32768, 131072, 262144, 524288)
IMPLS = ("cudnn", "zoo", "mosaic", "zoo_mosaic_cudnn", "triton")
CHECK_UP_TO = 131072   # lengths up to which each kernel's output is compared with cuDNN's (max |difference|)


def attend_fn(impl: str):
    """attend(q, k, v) -> out, causal, for `impl`: "cudnn" or "xla" through jax.nn, "zoo" and "zoo_mosaic_cudnn"
    (the zoo's kernels "cudnn" and "mosaic_cudnn", their residuals named: `zoo.layers.attention_kernel`), "mosaic" or
    "triton" through tokamax."""
    import jax
    if impl in ("cudnn", "xla"):
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    if impl in ("zoo", "zoo_mosaic_cudnn"):
        from zoo.layers.attention_kernel import causal_attention
        kernel = "cudnn" if impl == "zoo" else "mosaic_cudnn"
        return lambda q, k, v: causal_attention(q, k, v, impl=kernel)
    import tokamax
    return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True, implementation=impl)


def forward_and_backward(attend):
    """jit of (q, k, v, g) -> (attend's output, its (dq, dk, dv) for the output's cotangent g)."""
    import jax

    def run(q, k, v, g):
        out, vjp = jax.vjp(attend, q, k, v)
        return out, vjp(g)
    return jax.jit(run)


def _seconds(fn, args, budget_s: float) -> float:
    """Seconds per call of compiled `fn` on `args`: one call to warm up, then as many as fit in `budget_s` (at least
    one), timed together."""
    import jax
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    reps = max(1, int(budget_s / max(first, 1e-6)))
    if reps == 1:
        return first
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def measure(impl: str, seq: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
            budget_s: float = 3.0) -> dict:
    """The record of `impl` at `seq` positions: forward and forward + backward seconds and TFLOP/s."""
    import jax
    import jax.numpy as jnp

    from zoo.layers.attention_kernel import causal_attention_flops
    flops = causal_attention_flops(1, seq, heads, head_dim, head_dim)
    rec = {"bench": "attention-rates", "impl": "zoo", "backend": impl, "B": 1, "S": seq, "L": 1,
           "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "fwd_tflop": flops / 1e12}
    try:
        attend = attend_fn(impl)
        keys = jax.random.split(jax.random.key(0), 4)
        q = jax.random.normal(keys[0], (1, seq, heads, head_dim), jnp.bfloat16)
        k = jax.random.normal(keys[1], (1, seq, kv_heads, head_dim), jnp.bfloat16)
        v = jax.random.normal(keys[2], (1, seq, kv_heads, head_dim), jnp.bfloat16)
        g = jax.random.normal(keys[3], (1, seq, heads, head_dim), jnp.bfloat16)
        fwd, fwd_bwd = jax.jit(attend), forward_and_backward(attend)
        t_fwd = _seconds(fwd, (q, k, v), budget_s)
        t_all = _seconds(fwd_bwd, (q, k, v, g), budget_s)
        rec.update(step_s=t_all, tflops=round(3 * flops / t_all / 1e12, 1), fwd_s=t_fwd,
                   fwd_tflops=round(flops / t_fwd / 1e12, 1), device=jax.devices()[0].device_kind)
        if seq <= CHECK_UP_TO:
            ref = forward_and_backward(attend_fn("cudnn" if jax.default_backend() == "gpu" else "xla"))(q, k, v, g)
            got = fwd_bwd(q, k, v, g)
            diffs = jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))),
                                 got, ref)
            rec["max_abs_diff_vs_cudnn"] = dict(zip(("out", "dq", "dk", "dv"), jax.tree.leaves(diffs)))
    except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is a record, not a failed bench
        rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return rec


def main():
    ap = argparse.ArgumentParser(description="causal attention's forward and backward rate per kernel and length")
    ap.add_argument("--seq", type=int, action="append", help=f"lengths (default {SEQS})")
    ap.add_argument("--impl", action="append", choices=IMPLS + ("xla",),
                    help=f"kernels (default {IMPLS})")
    ap.add_argument("--budget", type=float, default=3.0, help="seconds of timed calls per case")
    ap.add_argument("--smoke", action="store_true", help="256 positions, 4 heads, XLA's kernel (whatever --impl "
                    "says): any device")
    args = ap.parse_args()
    from bench.common import emit
    if args.smoke:
        emit(measure("xla", 256, heads=4, kv_heads=2, head_dim=64, budget_s=0.1))
        return
    for impl in args.impl or IMPLS:
        for seq in args.seq or SEQS:
            emit(measure(impl, seq, budget_s=args.budget))


if __name__ == "__main__":
    main()
