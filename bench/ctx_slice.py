"""Long context: the zoo's decoder stack alone (no embedding, head or loss over the vocabulary), as the plain-JAX
baseline `bench/baselines/plain_jax_llama_ctx.py` runs its own, one process per configuration.

    python -m bench.ctx_slice context_offload --family llama3 --seq 32768 --layers 8 [--batch 1]

Shapes: Llama 3.1 8B's layers (`--family llama3`), Qwen3-32B's (`--family qwen3`) or DeepSeek-V3's (`--family
deepseek_v3`: the 671B preset's hidden sizes with `--experts` routed experts, capacity dispatch, one dense layer
first), cut to `--layers`; bf16
parameters and activations, cuDNN attention on a GPU. The step: the stack on a random bf16 input [B, S, D], loss
mean(y^2) in float32, SGD: the baseline's step, so the two are compared like with like (the same FLOPs: the
stack's matmuls, 6 x parameters x tokens, and causal attention, half of 2 x 2 x B x S^2 x H x d, forward and
backward). Compiled with the library's options for the recipe (`zoo.compile_options`: command buffers off where it
offloads). 2 warm-up steps, the median of --steps timed steps.

The record carries the attention forward count of the compiled program (`fmha_fwd_calls`: cuDNN's forward kernel,
`__cudnn$fmhaSoftmax`, per layer body: 1 when the recipe keeps the kernel's residuals, 2 when the backward pass
runs it again) and the planner's prediction for the same stacks (`planned_step_s`, `zoo.plan.plan(...).step_time(
stacks_only=True)`: the stacks' work, recompute and exposed copies at the family's measured rate).
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

import zoo
from bench.common import guarded, matmul_params, step_options
from recipes.registry import recipes_of
from zoo.layers.attention_kernel import attention_flops
from zoo.models.registry import family
from zoo.plan import peak as peak_lib

PRESETS = {"llama3": "llama3_1_8b", "deepseek_v3": "deepseek_v3_671b", "qwen3": "qwen3_32b"}
FWD_CALL = 'custom_call_target="__cudnn$fmhaSoftmax"'


def config(fam: str, layers: int, experts: int, smoke: bool):
    kw = dict(param_dtype="bfloat16", dtype="bfloat16")
    if jax.devices()[0].platform == "gpu":
        kw["attention_impl"] = "cudnn"
    fam = family(fam)
    if smoke:
        return fam.config("tiny", num_layers=layers, **{k: v for k, v in kw.items() if k != "attention_impl"})
    if fam.name == "deepseek_v3":
        kw.update(num_experts=experts, first_dense_layers=1, moe_backend="capacity")
    return fam.config(PRESETS[fam.name], num_layers=layers, **kw)


def stack_flops(model, batch: int, seq: int) -> float:
    """Model FLOPs of one step of the stacks: 3 x (2 x matmul parameters x tokens + causal attention)."""
    total = 0.0
    for stack in model.stacks().values():
        tags = stack.tag_shapes(stack.abstract_input(batch, seq))
        attention = attention_flops(tags["query_proj"], tags["value_proj"])
        total += 3 * (2 * batch * seq * matmul_params(stack) + stack.num_layers * attention)
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--family", choices=sorted(PRESETS), default="llama3")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script only)")
    a = ap.parse_args()
    seq = 64 if a.smoke else a.seq
    cfg = config(a.family, a.layers, a.experts, a.smoke)
    recipe = recipes_of(family(a.family))[a.recipe] if a.recipe != "auto" else "auto"

    def run():
        # one plan: for "auto" it is the plan of the recipe it chose
        p = zoo.plan.plan(cfg, recipe, batch=a.batch, seq=seq, peak=None, training=zoo.plan.Training(optimizer="sgd"))
        chosen = p.recipe
        model = family(a.family).build(cfg, recipe=chosen, rngs=nnx.Rngs(0))
        flops = stack_flops(model, a.batch, seq)
        est = p.step_time(stacks_only=True)
        stacks = dict(model.stacks())
        graphdef, params, rest = nnx.split(nnx.Dict(stacks), nnx.Param, ...)
        del model
        policy = chosen.policy()
        x = jax.random.normal(jax.random.key(1), (a.batch, seq, cfg.dim), jnp.float32).astype(cfg.compute_dtype)

        def loss_fn(params, rest, x):
            modules = nnx.merge(graphdef, params, rest, copy=True)
            for n in stacks:
                x, _ = modules[n](x, policy)
            return jnp.mean(jnp.square(x.astype(jnp.float32)))

        def step(params, rest, x):
            loss, grads = jax.value_and_grad(loss_fn)(params, rest, x)
            return loss, jax.tree.map(lambda p, g: (p - 1e-4 * g.astype(p.dtype)).astype(p.dtype), params, grads)

        options = step_options(chosen)
        t0 = time.perf_counter()
        compiled = jax.jit(step, donate_argnums=(0,)).lower(params, rest, x).compile(compiler_options=options)
        compile_s = time.perf_counter() - t0
        ma, text = compiled.memory_analysis(), compiled.as_text()
        for _ in range(a.warmup):
            loss, params = compiled(params, rest, x)
        loss.block_until_ready()
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            loss, params = compiled(params, rest, x)
            loss.block_until_ready()
            times.append(time.perf_counter() - t)
        step_s = statistics.median(times)
        stats = jax.devices()[0].memory_stats() or {}
        return dict(recipe_chosen=str(chosen), step_s=round(step_s, 4),
                    step_s_spread=round(max(times) - min(times), 4), tflops=round(flops / step_s / 1e12, 1),
                    peak_gib=round(stats.get("peak_bytes_in_use", 0) / 2**30, 2),
                    planned_peak_gib=round(peak_lib.from_compiled(compiled).bytes / 2**30, 2),
                    temp_gib=round(ma.temp_size_in_bytes / 2**30, 2),
                    host_temp_gib=round(getattr(ma, "host_temp_size_in_bytes", 0) / 2**30, 2),
                    planned_host_gib=round(p.host_bytes / 2**30, 3),
                    planned_step_s=None if est is None else round(est["total_s"], 4),
                    fmha_fwd_calls=text.count(FWD_CALL), has_S5="S(5)" in text, compile_s=round(compile_s, 1),
                    loss=float(loss), dropped=0, compile_options=options)

    guarded(run, bench=f"{a.family}-ctx-slice", impl="zoo", recipe=a.recipe, backend=None, gpus=1, mesh=None,
            B=a.batch, S=seq, L=a.layers, date=datetime.date.today().isoformat(),
            device=str(jax.devices()[0].device_kind))


if __name__ == "__main__":
    main()
