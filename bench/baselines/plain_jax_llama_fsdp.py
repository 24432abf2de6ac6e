"""Plain-JAX baseline, FSDP over every local device: `plain_jax_llama`'s stack with each weight sharded on its
input dimension over a one-axis mesh ("fsdp"), the batch sharded the same way, and each weight all-gathered inside
the layer, as FSDP does (so full remat gathers it again in the backward pass).

    SHAPE=405b NL=3 XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true \
        python -m bench.baselines.plain_jax_llama_fsdp offload_qkv 2

The batch is per device. SMALL=1 for a CPU smoke test (with XLA_FLAGS=--xla_force_host_platform_device_count=2).
Prints one JSON line; `tflops_per_device` is model FLOPs per device, `all_gathers` the compiled step's count.
"""
from __future__ import annotations

import argparse

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bench.baselines.common import measure, report
from bench.baselines.plain_jax_llama import DT, POLICIES, init, loss_fn, model_flops, sgd_step, shape_from_env

FSDP_POLICIES = ("full", "save_qkv", "offload_qkv")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("policy", choices=FSDP_POLICIES)
    ap.add_argument("batch", type=int, nargs="?", default=2, help="sequences per device")
    a = ap.parse_args(argv)
    name, s, layers, impl = shape_from_env()
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("fsdp",))
    replicated = NamedSharding(mesh, P())
    weights, batch = NamedSharding(mesh, P(None, "fsdp", None)), NamedSharding(mesh, P("fsdp", None, None))

    def gather(w):   # FSDP: the whole weight exists only inside the layer
        return jax.lax.with_sharding_constraint(w, replicated)

    def run():
        params = jax.jit(lambda k: init(k, s, layers), out_shardings=weights)(jax.random.key(0))
        x = jax.jit(lambda k: jax.random.normal(k, (a.batch * n, s.seq, s.dim)).astype(DT),
                    out_shardings=batch)(jax.random.key(1))
        step = jax.jit(sgd_step(loss_fn(POLICIES[a.policy], s, impl, gather)), in_shardings=(weights, batch),
                       out_shardings=(replicated, weights), donate_argnums=(0,))
        got = measure(step, params, x)
        hlo = got.pop("hlo")
        got.pop("temp_gib")
        return dict(tflops_per_device=round(model_flops(s, a.batch, layers) / got["step_s"] / 1e12, 1), **got,
                    all_gathers=hlo.count("all-gather-start") + hlo.count(" all-gather("))

    report(dict(anchor="plain_jax_llama_fsdp", shape=name, policy=a.policy, gpus=n, batch_per_device=a.batch,
                L=layers), run)


if __name__ == "__main__":
    main()
