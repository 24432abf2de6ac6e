"""Which forms of a scan over parameters that live in pinned host memory XLA compiles and runs on this device: the
stacked weights as the scan's operand (`xs`), each layer's slice copied
into HBM (`jax.device_put`) inside a rematerialized body or a plain one, the gradient left to land where jax puts it
or asked for on the host. Each variant runs in its own process (a crash is a result: its return code).
`python -m bench.param_stream_probe [--dump DIR]` (one JSON line per variant)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

VARIANTS = ("xs_remat", "xs_remat_norm", "zoo_grads", "zoo_grads_norm", "zoo_tiny")


def run_variant(name: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
    dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
    if name.startswith("zoo_grads"):
        from flax import nnx

        import zoo
        from zoo import streamed_update
        from zoo.models.registry import family
        from zoo.optim import lr_schedule, make_optimizer
        from zoo.train_step import abstract_step, loss_and_grads
        from zoo.training import Training
        fam = family("llama3")
        cfg = zoo.models.LlamaConfig.preset("tiny", param_dtype="bfloat16", dtype="bfloat16")
        t = Training(opt_state="host", params="stream", opt_dtype="bfloat16")
        _, graphdef, state = abstract_step(fam, cfg, zoo.Recipe.full(), training=t)
        model = fam.build(cfg, recipe=zoo.Recipe.full(), rngs=nnx.Rngs(0))
        opt = make_optimizer(model, lr_schedule(lr=1e-4, steps=100, warmup=10), clip=1.0, weight_decay=0.1,
                             opt_dtype="bfloat16", master=True)
        concrete = jax.tree.map(lambda c, a: jax.device_put(c, a.sharding), nnx.split((model, opt))[1], state)
        batch = {"tokens": jnp.zeros((2, 17), jnp.int32), "weights": jnp.ones((2, 16))}

        def f(state, batch):
            m, _ = nnx.merge(graphdef, state)
            loss, _, _, _, grads = loss_and_grads(m, batch, aux_loss=lambda c, a: 0.0)
            return (loss, streamed_update.global_norm(grads)) if name.endswith("norm") else (loss, grads)
        out = jax.jit(f)(concrete, batch)
        return dict(loss=float(out[0]))
    if name == "zoo_tiny":
        from flax import nnx

        import zoo
        from zoo.models.registry import family
        from zoo.optim import lr_schedule, make_optimizer
        from zoo.train_step import abstract_step
        from zoo.training import Training
        fam, cfg = family("llama3"), zoo.models.LlamaConfig.preset("tiny", param_dtype="bfloat16")
        t = Training(opt_state="host", params="stream", opt_dtype="bfloat16")
        step, _, state = abstract_step(fam, cfg, zoo.Recipe.full(), training=t)
        model = fam.build(cfg, recipe=zoo.Recipe.full(), rngs=nnx.Rngs(0))
        opt = make_optimizer(model, lr_schedule(lr=1e-4, steps=100, warmup=10), clip=1.0, weight_decay=0.1,
                             opt_dtype="bfloat16", master=True)
        concrete = jax.tree.map(lambda c, a: jax.device_put(c, a.sharding), nnx.split((model, opt))[1], state)
        batch = {"tokens": jnp.zeros((2, 17), jnp.int32), "weights": jnp.ones((2, 16))}
        _, metrics = step(concrete, batch)
        return dict(loss=float(metrics["loss"]))
    layers, dim = 4, 256
    w = jax.device_put(jnp.full((layers, dim, dim), 0.01, jnp.bfloat16), host)
    x = jax.device_put(jnp.ones((8, dim), jnp.bfloat16), dev)

    def layer(wl, c):
        return jnp.tanh(c @ jax.device_put(wl, jax.memory.Space.Device))

    def model(ws, c):
        f = layer if name == "xs_plain" else jax.checkpoint(layer)
        c, _ = jax.lax.scan(lambda c, wl: (f(wl, c), None), c, ws)
        return jnp.sum(c.astype(jnp.float32) ** 2)

    if name.endswith("norm"):   # the host gradient made in the program, read back a slice at a time
        from zoo.streamed_update import global_norm
        return dict(norm=float(jax.jit(lambda w, x: global_norm(jax.grad(model)(w, x)))(w, x)))
    g = jax.jit(jax.grad(model))(w, x)
    return dict(grad_memory=str(g.sharding.memory_kind), grad_sum=float(jnp.sum(jax.device_put(g, dev)
                                                                              .astype(jnp.float32))))


def main():
    ap = argparse.ArgumentParser(description="which forms of a host-resident parameter scan compile and run")
    ap.add_argument("--variant", help="run one variant in this process")
    ap.add_argument("--dump", help="XLA dump folder for each variant (--xla_dump_to DIR/VARIANT)")
    ap.add_argument("--smoke", action="store_true", help="the same on any device")
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(dict(variant=a.variant, **run_variant(a.variant))), flush=True)
        return
    import os
    for v in VARIANTS:
        env = dict(os.environ)
        if a.dump:
            env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + f" --xla_dump_to={a.dump}/{v} --xla_dump_hlo_as_text"
        p = subprocess.run([sys.executable, "-m", "bench.param_stream_probe", "--variant", v], env=env,
                           capture_output=True, text=True, timeout=300)
        out = p.stdout.strip().splitlines()
        print(json.dumps(dict(variant=v, rc=p.returncode, out=out[-1] if out else None,
                              err=p.stderr.strip().splitlines()[-3:] if p.returncode else None)), flush=True)


if __name__ == "__main__":
    main()
