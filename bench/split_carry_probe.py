"""What a stack split into two scans costs XLA in memory: the compiled gradient of a scan over L stacked layers (each
rematerialized) against the same layers run as two scans, over the first m and the last L - m layers' weights
(`slices`: the stacked weights sliced, as a split carry's first and second part would take them; `index`: each scan
reads its layer out of the whole stack by index). Compiles only; nothing runs.

    python -m bench.split_carry_probe [--layers 32] [--dim 4096] [--seq 8192] [--split 24] [--smoke]

One record per form (`bench.records`' schema, bench "split-carry"): XLA's temporaries and the weights' bytes
(docs/long-context.md, "A stack in two parts"). `--smoke`: 4 layers of [64, 64] weights."""
from __future__ import annotations

import argparse

FORMS = ("one", "slices", "index")


def loss_of(form: str, layers: int, split: int):
    """loss(ws, x) for `form`: ws [layers, 2, D, D], x [S, D]; each layer x + tanh(x @ w0) @ w1, rematerialized."""
    import jax
    import jax.numpy as jnp

    def layer(x, w):
        return x + jnp.tanh(x @ w[0]) @ w[1], None

    def scan(x, ws):
        return jax.lax.scan(jax.checkpoint(layer), x, ws)[0]

    def by_index(ws):
        def body(x, i):
            return layer(x, jax.lax.dynamic_index_in_dim(ws, i, keepdims=False))
        return lambda x, idx: jax.lax.scan(jax.checkpoint(body), x, idx)[0]

    def loss(ws, x):
        if form == "one":
            y = scan(x, ws)
        elif form == "slices":
            y = scan(scan(x, ws[:split]), ws[split:])
        else:
            run = by_index(ws)
            y = run(run(x, jnp.arange(split)), jnp.arange(split, layers))
        return jnp.sum(y.astype(jnp.float32) ** 2)
    return loss


def measure(form: str, layers: int, dim: int, seq: int, split: int) -> dict:
    import jax
    import jax.numpy as jnp
    ws = jax.ShapeDtypeStruct((layers, 2, dim, dim), jnp.bfloat16)
    x = jax.ShapeDtypeStruct((seq, dim), jnp.bfloat16)
    compiled = jax.jit(jax.grad(loss_of(form, layers, split))).lower(ws, x).compile()
    return {"bench": "split-carry", "recipe": form, "backend": jax.default_backend(), "L": layers, "S": seq,
            "split": split, "dim": dim, "weights_gib": layers * 2 * dim * dim * 2 / 2**30,
            "temp_gib": compiled.memory_analysis().temp_size_in_bytes / 2**30}


def main():
    ap = argparse.ArgumentParser(description="XLA's temporaries for one scan against a stack split into two scans")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--split", type=int, default=24, help="layers in the first scan")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, to check the bench on any device")
    args = ap.parse_args()
    if args.smoke:
        args.layers, args.dim, args.seq, args.split = 4, 64, 32, 3
    from bench.common import emit
    for form in FORMS:
        emit(measure(form, args.layers, args.dim, args.seq, args.split))


if __name__ == "__main__":
    main()
