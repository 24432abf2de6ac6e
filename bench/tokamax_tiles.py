"""tokamax-tiles: tile configurations of tokamax's Mosaic GPU grouped matmul for the deepseek-slice's MoE problems.

    python -m bench.tokamax_tiles --out tiles.json          # on an H100/H200, tokamax installed

tokamax 0.0.17 has no autotuning entry for the H200, so its `ragged_dot` runs a heuristic configuration
(64 x 64 x 128 tiles, 2 stages) that leaves most of the tensor cores idle. The zoo's grouped matmul
(`zoo.layers.grouped_matmul`) runs each of its three problems with an explicit configuration instead:

- ``fwd``:  rows [M, K] x experts [E, K, N] -> [M, N]                 (the forward pass)
- ``dlhs``: d_out [M, N] x experts^T [E, N, K] -> [M, K]              (the rows' gradient: the same kernel)
- ``drhs``: rows^T [K, M] x d_out [M, N] per group -> [E, K, N]       (the experts' gradient: ragged contraction)

For the deepseek-slice's shapes (M = batch 4 x seq 4096 x top-8 = 131072 copies, E = 16 experts, D = 7168,
F = 2048), each problem at each of its two shapes (gate/up: K=7168, N=2048; down: K=2048, N=7168) is timed
under a set of candidate configurations (tokamax's heuristic, the H100 autotuning cache's winners for DeepSeek
shapes, and a small grid around them): median of 10 calls after 3, useful FLOPs 2*M*K*N. The batched einsum that
capacity dispatch runs (C = 1.25 M / E rows per expert) is timed beside them for scale. One JSON line per
(problem, shape, config); `--out` writes the fastest configuration per problem (the form
`zoo.layers.grouped_matmul` reads from `ZOO_TOKAMAX_TILES`).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import jax
import jax.numpy as jnp

from bench.common import emit


def _time(fn, *args, calls: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def candidates(problem: str) -> list[dict | None]:
    """None is tokamax's own choice (its heuristic on a cache miss); the rest are explicit configurations."""
    out: list[dict | None] = [None]
    seen = set()
    grid = itertools.product([128, 64], [64, 128], [128, 256], [4, 2], [True, False], [(1, 8), (0, 1), (1, 4)])
    for bm, bn, bk, stages, persistent, (minor, width) in grid:
        c = dict(block_m=bm, block_n=bn, block_k=bk, num_stages=stages, split_k=1, persistent=persistent,
                 grid_minor_dim=minor, grid_tile_width=width)
        # Keep the grid small: the H100 cache's winners (block_m 128, block_n 64, block_k 128) and one change at
        # a time from them.
        changes = sum([bm != 128, bn != 64, bk != 128, stages != 4, not persistent, (minor, width) != (1, 8)])
        if changes <= 1 or (bm, bn, bk, stages, persistent, minor, width) == (128, 64, 128, 2, False, 0, 1):
            key = tuple(sorted(c.items()))
            if key not in seen:
                seen.add(key)
                out.append(c)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--k", type=int, default=8, help="experts per token")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--dim", type=int, default=7168)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--out", default=None, help="write the fastest configuration per problem here (JSON)")
    ap.add_argument("--problems", default="fwd,dlhs,drhs")
    a = ap.parse_args()

    from zoo.layers.grouped_matmul import RAGGED_CONTRACTING, mosaic_op

    PallasMosaicRaggedDot, PallasMosaicRaggedDotConfig = mosaic_op()

    m, e, d, f = a.batch * a.seq * a.k, a.experts, a.dim, a.hidden
    key = jax.random.key(0)
    ks = jax.random.split(key, 6)
    group_sizes = jnp.bincount(jax.random.randint(ks[0], (m,), 0, e), length=e).astype(jnp.int32)
    # (problem, shape name) -> (arguments, extra keyword arguments, flops)
    shapes = {"gate_up": (d, f), "down": (f, d)}
    problems = {}
    for shape, (kk, nn) in shapes.items():
        rows = jax.random.normal(ks[1], (m, kk), jnp.bfloat16)
        w = jax.random.normal(ks[2], (e, kk, nn), jnp.bfloat16) * 0.02
        dout = jax.random.normal(ks[3], (m, nn), jnp.bfloat16)
        flops = 2 * m * kk * nn
        problems[("fwd", shape)] = ((rows, w, group_sizes), {}, flops)
        problems[("dlhs", shape)] = ((dout, jnp.swapaxes(w, 1, 2), group_sizes), {}, flops)
        problems[("drhs", shape)] = ((rows, dout, group_sizes),
                                     {"ragged_dot_dimension_numbers": RAGGED_CONTRACTING}, flops)
    wanted = a.problems.split(",")
    best: dict[str, dict] = {}
    times: dict[str, dict[str, dict]] = {}   # problem -> config (JSON) -> {shape: seconds}
    for (problem, shape), (args, kw, flops) in problems.items():
        if problem not in wanted:
            continue
        rows_tried = []
        for c in candidates(problem):
            op = PallasMosaicRaggedDot() if c is None else PallasMosaicRaggedDot(
                config=PallasMosaicRaggedDotConfig(**c))
            fn = jax.jit(lambda lhs, rhs, gs, op=op, kw=kw: op(lhs, rhs, group_sizes=gs, **kw))
            rec = dict(bench="tokamax-tiles", impl="zoo", backend="tokamax", problem=problem, shape=shape, M=m, E=e,
                       config=c or "tokamax default")
            try:
                t0 = time.perf_counter()
                fn.lower(*args).compile()
                rec["compile_s"] = round(time.perf_counter() - t0, 2)
                s = _time(fn, *args)
                rec.update(ms=round(s * 1e3, 3), tflops=round(flops / s / 1e12, 1))
                rows_tried.append((s, c))
                if c is not None:
                    times.setdefault(problem, {}).setdefault(json.dumps(c, sort_keys=True), {})[shape] = s
            except Exception as ex:  # a configuration the kernel refuses is a record, not a crash
                rec["error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
            emit(rec)
        if rows_tried:
            s, c = min(rows_tried, key=lambda r: r[0])
            default = next((r[0] for r in rows_tried if r[1] is None), None)
            summary = dict(bench="tokamax-tiles", impl="zoo", backend="tokamax", problem=problem, shape=shape, M=m, E=e,
                           best=c or "tokamax default", best_ms=round(s * 1e3, 3),
                           best_tflops=round(flops / s / 1e12, 1),
                           default_ms=None if default is None else round(default * 1e3, 3))
            emit(summary)
            if c is not None:
                best.setdefault(problem, {})[f"{shape}"] = (s, c)

    # The capacity dispatch's batched einsum at the same shapes, for scale.
    c_rows = -(-int(1.25 * m) // e)
    for shape, (kk, nn) in shapes.items():
        buf = jax.random.normal(ks[4], (e, c_rows, kk), jnp.bfloat16)
        w = jax.random.normal(ks[5], (e, kk, nn), jnp.bfloat16) * 0.02
        s = _time(jax.jit(lambda x, y: jnp.einsum("ecd,edf->ecf", x, y)), buf, w)
        emit(dict(bench="tokamax-tiles", impl="zoo", backend="capacity", problem="fwd", shape=shape, M=m, E=e,
                  C=c_rows, ms=round(s * 1e3, 3), tflops_useful=round(2 * m * kk * nn / s / 1e12, 1),
                  tflops_padded=round(2 * e * c_rows * kk * nn / s / 1e12, 1)))

    if a.out:
        # Per problem: the configuration with the least time over both shapes (among those that ran on both), and
        # each shape's own winner under "problem:KxN".
        chosen = {}
        for problem, by_config in times.items():
            full = {c: sum(t.values()) for c, t in by_config.items() if len(t) == len(shapes)}
            if full:
                chosen[problem] = json.loads(min(full, key=full.get))
            for shape, (_s, c) in best.get(problem, {}).items():
                chosen[f"{problem}:{shapes[shape][0]}x{shapes[shape][1]}"] = c
        with open(a.out, "w") as fh:
            json.dump(chosen, fh, indent=1)
        print("tiles:", json.dumps(chosen))


if __name__ == "__main__":
    main()
