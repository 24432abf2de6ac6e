"""step-cost: what the main job's training step costs beyond the model, by variant (main-job-8b's shapes).

    python -m bench.step_cost --recipe qkv_offload            # on the GPU
    python -m bench.step_cost --smoke                         # tiny preset, any device (checks the script)

The main job's step (`zoo.train_step`) is the model's forward and backward pass plus AdamW over float32
parameters and the NaN guard. Each variant below is the same step with one part changed, compiled and timed in
this process (median of 6 after 2), with XLA's compiled peak and the measured one:

- ``guard_lr``: the step as the main job runs it: the guard decided before the update from the loss, the gradient
  norm and the learning rate, so the select fuses into the update (zoo.train_step, `lr=` the schedule);
- ``guard_exact``: the guard decided after the update from the updated parameters (`lr=None`): the old state is
  kept beside the new one and selected in a second pass;
- ``no_guard``: gradients and `optimizer.update` only (no guard, no metrics beyond the loss): the floor.

Model FLOPs are the benches' count (6 x matmul parameters x tokens + causal attention), so TFLOP/s compare with
main-job-8b's records. One JSON line per variant.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bench.common import emit, peak_bytes
from recipes.registry import recipes_of
from zoo.models.llama3 import flops_per_token as llama_flops_per_token
from zoo.models.registry import family
from zoo.optim import lr_schedule, make_optimizer
from zoo.plan.peak import from_compiled
from zoo.train_step import family_step, jit_step, next_token_loss

FAMILY = family("llama3")
RECIPES = recipes_of(FAMILY)


def no_guard_step(model, optimizer, batch):
    tokens = batch["tokens"]

    def loss_fn(model):
        logits = model(tokens[:, :-1])
        return next_token_loss(logits, tokens[:, 1:], batch["weights"])

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {"loss": loss}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="qkv_offload", choices=sorted(RECIPES))
    ap.add_argument("--variants", default="guard_lr,guard_exact,no_guard")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    preset, layers, seq = ("tiny", 2, 64) if a.smoke else ("llama3_1_8b", a.layers, a.seq)
    cfg = FAMILY.config(preset, num_layers=layers)   # the main job's dtypes: float32 parameters, bf16 compute
    recipe = RECIPES[a.recipe]
    schedule = lr_schedule(lr=3e-4, steps=100, warmup=10)
    key = jax.random.key(1)
    tokens = jax.random.randint(key, (a.batch, seq + 1), 0, cfg.vocab_size, jnp.int32)
    batch = {"tokens": tokens, "weights": jnp.ones((a.batch, seq), jnp.float32)}
    steps = {"guard_lr": family_step(FAMILY, schedule), "guard_exact": family_step(FAMILY, None),
             "no_guard": no_guard_step}
    for variant in a.variants.split(","):
        ident = dict(bench="step-cost", impl="zoo", variant=variant, recipe=a.recipe, optimizer="adamw",
                     param_dtype=cfg.param_dtype, B=a.batch, S=seq, L=layers)
        try:
            model = FAMILY.build(cfg, recipe=recipe, rngs=nnx.Rngs(0))
            flops = llama_flops_per_token(cfg, model, seq) * a.batch * seq
            opt = make_optimizer(model, schedule, clip=1.0, weight_decay=0.1)
            jitted, _, state = jit_step(model, opt, steps[variant])
            del model, opt
            t0 = time.perf_counter()
            compiled = jitted.lower(state, batch).compile()
            compile_s = time.perf_counter() - t0
            for _ in range(2):
                state, m = compiled(state, batch)
            jax.block_until_ready(m)
            times = []
            for _ in range(6):
                t = time.perf_counter()
                state, m = compiled(state, batch)
                jax.block_until_ready(m)
                times.append(time.perf_counter() - t)
            step_s = statistics.median(times)
            pk = from_compiled(compiled)
            emit({**ident, "step_s": round(step_s, 4), "step_s_spread": round(max(times) - min(times), 4),
                  "tflops": round(flops / step_s / 1e12, 1), "peak_gib": round(peak_bytes() / 2**30, 2),
                  "planned_peak_gib": round(pk.bytes / 2**30, 2), "compile_s": round(compile_s, 1),
                  "loss": float(m["loss"])})
            del state, compiled
        except Exception as e:  # report and go on with the next variant
            emit({**ident, "error": f"{type(e).__name__}: {str(e)[:300]}"})


if __name__ == "__main__":
    main()
