"""Does offloading change the numbers? 50 steps of the main job (`recipes.train.loop.run`: AdamW, synthetic data, same
seed) under an offload recipe, compiled as the main job compiles it (`zoo.compile_options`: command buffers off
when the recipe offloads on a GPU), against the same run under `full` (JAX's remat).

    python -m bench.loss_curve --recipe minimal_offload [--preset llama3_1_8b --layers 4]

A race between a host copy and its use (reported for XLA's pipelined host offloading) shows as a loss curve that
leaves `full`'s; bf16 rounding alone keeps them within a few 1e-3. Prints one JSON record: both curves, the largest
relative difference, and `same_within_bf16` (every step within 2e-2 relative).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import io

import jax

from bench.common import emit
from recipes.train import loop


def curve(a, recipe: str) -> list[float]:
    overrides = [("num_layers", a.layers)]
    if jax.devices()[0].platform == "gpu":
        overrides.append(("attention_impl", "cudnn"))
    settings = loop.RunConfig(model="llama3", preset=a.preset, recipe=recipe, overrides=tuple(overrides),
                              steps=a.steps, batch=a.batch, seq=a.seq, seed=0, log_every=a.steps)
    with contextlib.redirect_stdout(io.StringIO()):  # the run's own tables: not this record
        result = loop.run(settings)
    return result.losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="minimal_offload")
    ap.add_argument("--preset", default="llama3_1_8b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--smoke", action="store_true", help="tiny preset, few steps (checks the script only)")
    a = ap.parse_args()
    if a.smoke:
        a.preset, a.layers, a.batch, a.seq, a.steps = "tiny", 2, 2, 32, 4
    ident = dict(bench="loss-curve", impl="zoo", recipe=a.recipe, preset=a.preset, L=a.layers,
                 B=a.batch, S=a.seq, steps=a.steps, date=datetime.date.today().isoformat())
    try:
        ref = curve(a, "full")
        got = curve(a, a.recipe)
        rel = [abs(x - y) / max(abs(y), 1e-6) for x, y in zip(got, ref)]
        emit({**ident, "max_rel_diff": round(max(rel), 5), "last_rel_diff": round(rel[-1], 5),
              "same_within_bf16": max(rel) < 2e-2 and len(got) == len(ref) == a.steps,
              "loss_full": [round(x, 4) for x in ref], "loss": [round(x, 4) for x in got]})
    except Exception as e:
        emit({**ident, "error": f"{type(e).__name__}: {str(e)[:300]}"})


if __name__ == "__main__":
    main()
