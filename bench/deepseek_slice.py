"""deepseek-slice: the DeepSeek-V3 671B preset cut to 1 dense + 3 MoE layers and 16 experts (top-8 kept, the study's
hidden sizes), batch 4, seq 4096, SGD step, bf16.

    XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true python -m bench.deepseek_slice mla_moe_offload

Its plain-JAX baseline is `bench.baselines.plain_jax_deepseek` (E=16 NL=3). Prints one record of `bench.records`: the
backend that ran, the attention kernel, the copies dropped, the planner's figures beside XLA's. Expert parallelism:
`--mesh ep=2 --experts 32 --batch 8` keeps each GPU's share as on one (`--ep-dispatch ragged_a2a` for the dropless
backends). `auto`: the recipe `zoo.plan.plan(cfg, "auto", ...)` chooses for the SGD step, its inputs taken from the
device as the main job's `--recipe auto` takes them (`--auto-hbm`, `--auto-tflops` override); the record says what it
chose (`auto_device`, `auto_offload`, the inputs).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import zoo
from bench.common import guarded, measure, planned, sharded_inputs
from recipes.registry import recipes_of
from zoo.layers.attention_kernel import resolve_impl
from zoo.layers.moe import EP_DISPATCHES, backend_choice
from zoo.models.registry import family

FAMILY = family("deepseek_v3")
RECIPES = recipes_of(FAMILY)
GiB = 1 << 30


def resolve_auto(cfg, *, batch: int, seq: int, mesh: str | None, hbm_gib: float | None, tflops: float | None,
                 smoke: bool):
    """(the Recipe `zoo.plan.plan(cfg, "auto", ...)` chooses for the SGD step's model state, the record's auto_*
    fields), its inputs from the device as the main job's `--recipe auto` takes them (recipes.train.step.fit)."""
    import dataclasses

    from recipes.train.step import fit

    device = jax.devices()[0]
    link = None
    if smoke and device.platform == "cpu":   # the CPU has no memory limit, no measured link and no FLOP table
        hbm_gib, link, tflops = hbm_gib or 1.0, 10.0, tflops or 1.0
    ins = fit.inputs(device, hbm_gib=hbm_gib, link_gbps=link, tflops=tflops)
    recipe = fit.choose(cfg, ins, batch=batch, seq=seq, training=zoo.plan.Training(optimizer="sgd"),
                        parallel=zoo.plan.Parallelism(mesh=mesh))
    return recipe, dict(auto_device=list(recipe.device), auto_offload=list(recipe.offload),
                        **{f"auto_{k}": v for k, v in dataclasses.asdict(ins).items()})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("recipe", choices=sorted(RECIPES) + ["auto"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="default 4096 (64 with --smoke)")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--moe-layers", type=int, default=3)
    ap.add_argument("--backend", default="auto", choices=["auto", "ragged_dot", "capacity", "tokamax"])
    ap.add_argument("--ep-dispatch", default="gather", choices=list(EP_DISPATCHES),
                    help="dropless backends under --mesh: ragged_a2a is expert parallelism (ragged all-to-all)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--mtp", type=int, default=0, help="multi-token-prediction depths (DeepSeekV3Config.mtp_depths; "
                    "the published checkpoint has 1), with its loss in the step")
    ap.add_argument("--mesh", default=None, help="e.g. ep=2 (zoo.sharding); --batch and --experts are then global")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script only)")
    ap.add_argument("--auto-hbm", type=float, default=None,
                    help="recipe auto: HBM budget, GiB (default: the device's bytes_limit; 1 with --smoke on the CPU)")
    ap.add_argument("--auto-tflops", type=float, default=None,
                    help="recipe auto: FLOP rate, TFLOP/s (default: recipes.train.watching.meter's table for "
                         "the device)")
    a = ap.parse_args()
    a.seq = a.seq or (64 if a.smoke else 4096)
    common = dict(param_dtype="bfloat16", dtype="bfloat16", moe_backend=a.backend, capacity_factor=1.25,
                  ep_dispatch=a.ep_dispatch, mtp_depths=a.mtp)
    try:
        backend, backend_why = backend_choice(a.backend, dtype=jnp.bfloat16, ep_dispatch=a.ep_dispatch)
    except ValueError as e:  # tokamax asked for and missing: a record, not a crash
        backend, backend_why = a.backend, str(e)

    if a.smoke:
        cfg = FAMILY.config("tiny", **common, **({"num_experts": a.experts} if a.mesh else {}))
    else:
        cfg = FAMILY.config("deepseek_v3_671b", num_layers=1 + a.moe_layers, first_dense_layers=1,
                            num_experts=a.experts, **common)
    n = jax.device_count()
    extra = {} if a.mesh is None else dict(mesh=a.mesh, gpus=n, B_per_gpu=a.batch // n, ep_dispatch=a.ep_dispatch)
    ident = dict(bench="deepseek-slice", impl="zoo", mechanism="xla", backend=backend, backend_asked=a.backend,
                 backend_why=backend_why, recipe=a.recipe, B=a.batch, S=a.seq, E=a.experts, L=1 + a.moe_layers,
                 mtp_depths=a.mtp, **extra)
    if a.recipe == "auto":
        try:
            recipe, chosen = resolve_auto(cfg, batch=a.batch, seq=a.seq, mesh=a.mesh, hbm_gib=a.auto_hbm,
                                          tflops=a.auto_tflops, smoke=a.smoke)
        except ValueError as e:
            def fail(e=e):
                raise e
            guarded(fail, **ident)
            return
        ident.update(chosen)
    else:
        recipe = RECIPES[a.recipe]

    def run():
        attention = str(resolve_impl(cfg))  # auto: cuDNN flash attention on the GPU (head dim 192)
        tokens = jax.random.randint(jax.random.key(1), (a.batch, a.seq), 0, cfg.vocab_size, jnp.int32)
        model, tokens, mesh = sharded_inputs(FAMILY.build, cfg, recipe, tokens, a.mesh)
        flops = FAMILY.flops_per_token(cfg, model, a.seq) * a.batch * a.seq
        return dict(measure(model, tokens, flops_per_step=flops, steps=a.steps, warmup=1, mesh=mesh, recipe=recipe),
                    attention=attention, E=cfg.num_experts, L=cfg.num_layers,
                    **planned(cfg, recipe, batch=a.batch, seq=a.seq, optimizer="sgd", mesh=a.mesh))

    guarded(run, **ident)


if __name__ == "__main__":
    main()
