"""Does offload survive every stack depth? Compile a small Llama under `qkv_offload` with 1, 2 and 3 layers on
the GPU and report XLA's host bytes against the plan. `python -m bench.stack_depth --variant LABEL` (one JSON
line per depth; LABEL names the version of the stack being measured, e.g. "one layer without a scan (after)")."""
from __future__ import annotations

import argparse
import math

import jax.numpy as jnp
from flax import nnx

from bench.common import emit, sgd_step_fn
from recipes.registry import recipes_of
from zoo.models.registry import family

FAMILY = family("llama3")


def main():
    ap = argparse.ArgumentParser(description="host bytes against the plan at 1, 2 and 3 layers")
    ap.add_argument("--variant", required=True, help="a label for the version of the stack being measured")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on any device (checks the script only)")
    a = ap.parse_args()
    variant = a.variant
    dim, seq = (64, 32) if a.smoke else (1024, 2048)
    recipe = recipes_of(FAMILY)["qkv_offload"]
    for layers in (1, 2, 3):
        cfg = FAMILY.config("tiny", num_layers=layers, dim=dim, num_heads=8, num_kv_heads=8, head_dim=dim // 8,
                            mlp_dim=2 * dim, dtype="bfloat16", param_dtype="bfloat16")
        model = FAMILY.build(cfg, recipe=recipe, rngs=nnx.Rngs(0))
        tokens = jnp.zeros((2, seq), jnp.int32)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        compiled = sgd_step_fn(graphdef).lower(params, rest, tokens).compile()
        tags = model.tag_shapes(2, seq)["layers"].tags
        planned = layers * sum(math.prod(tags[t].shape) * tags[t].dtype.itemsize for t in recipe.offload)
        emit(dict(bench="stack-depth", variant=variant, layers=layers, planned_host_bytes=planned,
                  host_temp_bytes=int(getattr(compiled.memory_analysis(), "host_temp_size_in_bytes", 0)),
                  has_S5="S(5)" in compiled.as_text()))


if __name__ == "__main__":
    main()
