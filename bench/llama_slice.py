"""llama405b-slice: the Llama 3.1 405B preset cut to a few layers, batch 2, seq 8192, SGD step, bf16.

    XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true python -m bench.llama_slice qkv_offload --batch 2

Same shapes as bench.baselines.plain_jax_llama (SHAPE=405b NL=3), plus the zoo model's embedding and
untied LM head (counted in its FLOPs). Prints one JSON line.

With `--mesh fsdp=2` the model is created sharded (`zoo.sharding`), `--batch` is the GLOBAL batch (4 on two GPUs
is 2 per GPU, as bench.baselines.plain_jax_llama_fsdp's `2`), and the record carries gpus, mesh, tflops per
GPU, peak_gib (the largest device's) and the planner's per-device figures under the mesh (its peak compiled for the
mesh's GPUs: `planned_peak_source` "compiled for 2 x ... (mesh fsdp=2), per device").
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from bench.common import guarded, llama_step_flops, measure, planned, sharded_inputs
from recipes.registry import recipes_of
from zoo.models.registry import family

FAMILY = family("llama3")
RECIPES = recipes_of(FAMILY)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe", choices=sorted(RECIPES))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--mesh", default=None, help="e.g. fsdp=2 (zoo.sharding); --batch is then global")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script only)")
    a = ap.parse_args()
    if a.smoke:
        cfg = FAMILY.config("tiny", num_layers=a.layers, param_dtype="bfloat16", dtype="bfloat16")
    else:
        cfg = FAMILY.config("llama3_1_405b", num_layers=a.layers, param_dtype="bfloat16", dtype="bfloat16",
                            attention_impl="cudnn")
    recipe = RECIPES[a.recipe]

    def run():
        tokens = jax.random.randint(jax.random.key(1), (a.batch, a.seq), 0, cfg.vocab_size, jnp.int32)
        model, tokens, mesh = sharded_inputs(FAMILY.build, cfg, recipe, tokens, a.mesh)
        flops = llama_step_flops(cfg, model, a.batch, a.seq)
        plan = planned(cfg, recipe, batch=a.batch, seq=a.seq, optimizer="sgd", mesh=a.mesh)
        return dict(measure(model, tokens, flops_per_step=flops, steps=a.steps, warmup=1 if a.mesh else 2, mesh=mesh,
                            recipe=recipe),
                    **plan)

    n = jax.device_count()
    extra = {} if a.mesh is None else dict(mesh=a.mesh, gpus=n, B_per_gpu=a.batch // n)
    guarded(run, bench="llama405b-slice", impl="zoo", recipe=a.recipe, B=a.batch, S=a.seq, L=a.layers, **extra)


if __name__ == "__main__":
    main()
