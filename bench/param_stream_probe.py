"""Which parts of a training step over parameters that live in pinned host memory (`--params stream`) XLA compiles and
runs on this device: plain-JAX forms (`xs_*`: a scan over host-resident stacked weights, each slice copied into HBM
in a rematerialized body, the gradient landing on the host, its norm; `u_*`: then an update of host weights from that
gradient a layer at a time) and the zoo's own pieces on a tiny Llama (`zoo_*`: gradients, their norm, finiteness,
the streamed update, the whole step). Each variant runs in its own process: a crash is a result (its return code).
`python -m bench.param_stream_probe [--only REGEX] [--dump DIR]` (one JSON line per variant; docs/long-context.md,
"Parameters streamed from the host", has the H200's answers)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

VARIANTS = ("xs_remat", "xs_remat_norm", "u_host_grads", "u_grads_hbm", "u_params_to_hbm", "u_grads_given",
            "zoo_grads", "zoo_grads_norm", "zoo_finite", "zoo_update_out", "zoo_update_out_sgd",
            "zoo_update_out_devmoments", "zoo_update_donate", "zoo_update_finite", "zoo_step_nofinite", "zoo_step",
            "zoo_update_out_noguard", "zoo_update_out_stacked", "zoo_update_out_unstacked", "zoo_update_out_unrolled",
            "zoo_update_out_params", "zoo_update_out_noclip", "zoo_update_given", "zoo_update_given_sgd",
            "zoo_update_out_oneleaf", "zoo_update_out_onechunk", "zoo_update_out_barrier", "zoo_step_barrier",
            "u_host_grads_4d", "u_host_grads_adam")
# XLA flag sets each variant can also run under (--flags NAME,...): which compiler or runtime feature a crash needs
FLAG_SETS = {"none": "", "nocmdbuf": "--xla_gpu_enable_command_buffer=", "nolhs":
             "--xla_gpu_enable_latency_hiding_scheduler=false", "noautotune": "--xla_gpu_autotune_level=0",
             "nodoublebuf": "--xla_gpu_enable_while_loop_double_buffering=false",
             "nolegalize": "--xla_disable_hlo_passes=host-offload-legalize"}


def _host_scan(host, dev, remat: bool = True, heads: bool = False):
    """(w, x, loss): 4 bf16 [256, 256] weights in host memory (`host`; `heads`: [256, 4, 64], read by an einsum over
    heads as an attention projection is), an [8, 256] input in HBM (`dev`), and loss(ws, x): a scan over the weights
    whose layer (rematerialized unless `remat` is False) copies its slice into HBM, then the float32 sum of squares
    of the output."""
    import jax
    import jax.numpy as jnp
    w = jax.device_put(jnp.full((4, 256, 4, 64) if heads else (4, 256, 256), 0.01, jnp.bfloat16), host)
    x = jax.device_put(jnp.ones((8, 256), jnp.bfloat16), dev)

    def layer(wl, c):
        wl = jax.device_put(wl, jax.memory.Space.Device)
        if heads:
            return jnp.tanh(jnp.einsum("sd,dhk->shk", c, wl).reshape(c.shape))
        return jnp.tanh(c @ wl)

    def loss(ws, c):
        f = jax.checkpoint(layer) if remat else layer
        c, _ = jax.lax.scan(lambda c, wl: (f(wl, c), None), c, ws)
        return jnp.sum(c.astype(jnp.float32) ** 2)
    return w, x, loss


def _update_variant(name: str, host, dev) -> dict:
    """A scan over host-resident weights (each layer's slice copied into HBM), its gradient, then an SGD update of a
    float32 master and the bf16 weights a layer at a time in a `fori_loop` (each slice into HBM and back), all in
    pinned host memory: `u_host_grads` as the zoo's step does it (the gradient made on the host by the scan);
    `u_grads_hbm` with the gradient moved into HBM whole first; `u_params_to_hbm` writing the new weights to HBM
    instead; `u_grads_given` with the gradient an argument (made by another program); `u_host_grads_4d` with
    weights [256, 4, 64] read by an einsum over heads; `u_host_grads_adam` with two moments on the host beside the
    master (an Adam-like update)."""
    import jax
    import jax.numpy as jnp
    w, x, loss = _host_scan(host, dev, heads=name.endswith("_4d"))
    layers = w.shape[0]
    master = jax.device_put(jnp.full(w.shape, 0.01, jnp.float32), host)
    moments = [jax.device_put(jnp.zeros(w.shape, jnp.bfloat16), host) for _ in range(2)]
    adam = name.endswith("_adam")
    to_dev, to_host = jax.memory.Space.Device, jax.memory.Space.Host

    def take(a, i):
        return jax.device_put(jax.lax.dynamic_slice_in_dim(a, i, 1, 0), to_dev)

    def give(a, v, i):
        return jax.lax.dynamic_update_slice_in_dim(a, jax.device_put(v.astype(a.dtype), to_host), i, 0)

    def update(w, master, g):
        if name == "u_grads_hbm":
            g = jax.device_put(g, to_dev)
        out_w = jnp.zeros(w.shape, w.dtype) if name == "u_params_to_hbm" else w

        def body(i, carry):
            w, m, (mu, nu) = carry
            gi = jax.lax.dynamic_slice_in_dim(g, i, 1, 0)
            gi = jax.device_put(gi, to_dev) if gi.aval.memory_space == jax.memory.Space.Host else gi
            gi = gi.astype(jnp.float32)
            if adam:
                mui, nui = 0.9 * take(mu, i) + 0.1 * gi, 0.99 * take(nu, i) + 0.01 * gi * gi
                mu, nu = give(mu, mui, i), give(nu, nui, i)
                gi = mui / (jnp.sqrt(nui) + 1e-8)
            mi = take(m, i) - 0.1 * gi
            wi = mi.astype(jnp.bfloat16)
            if name != "u_params_to_hbm":
                wi = jax.device_put(wi, to_host)
            return (jax.lax.dynamic_update_slice_in_dim(w, wi, i, 0),
                    jax.lax.dynamic_update_slice_in_dim(m, jax.device_put(mi, to_host), i, 0), (mu, nu))
        return jax.lax.fori_loop(0, layers, body, (out_w, master, tuple(moments)))[:2]

    if name == "u_grads_given":
        g = jax.jit(jax.grad(loss))(w, x)
        new_w, _ = jax.jit(update)(w, master, g)
    else:
        new_w, _ = jax.jit(lambda w, m, x: update(w, m, jax.grad(loss)(w, x)))(w, master, x)
    total = float(jnp.sum(jax.device_put(new_w, dev).astype(jnp.float32)))
    return dict(w=total, w_memory=str(new_w.sharding.memory_kind))


def _zoo_variant(name: str) -> dict:
    """A part of the zoo's training step on a tiny Llama (bf16 parameters and activations) with --params stream:
    the loss and gradients (`zoo_grads`), with their norm (`zoo_grads_norm`), the parameters' finiteness
    (`zoo_finite`), the gradients and the streamed update with its new state returned (`zoo_update_out`; `_sgd`,
    `_devmoments`: SGD, AdamW's moments in HBM; `_donate`: the state donated; `_finite`: the new parameters'
    finiteness too), the whole step (`zoo_step`; `_nofinite`: without that check). Bisecting `zoo_update_out`:
    `_noguard` without the NaN guard's select, `_stacked` / `_unstacked` updating only the parameters in host memory
    / in HBM, `_oneleaf` only the first parameter in host memory, `_onechunk` every parameter in one chunk (no chunk
    loop), `_unrolled` with the chunk loops unrolled in Python, `_params` returning the parameters alone (not the
    optimizer's state), `_noclip` without the clip, `_barrier` (and `zoo_step_barrier`) with every copy between
    memories inside the program followed by an optimization barrier. `zoo_update_given` (`_sgd`): the gradients made
    by one program and the streamed update run by another, the gradients its argument."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import zoo
    from zoo import streamed_update
    from zoo.models.registry import family
    from zoo.optim import lr_schedule, make_optimizer
    from zoo.train_step import abstract_step, all_finite, loss_and_grads
    from zoo.training import Training
    fam = family("llama3")
    cfg = zoo.models.LlamaConfig.preset("tiny", param_dtype="bfloat16", dtype="bfloat16")
    schedule = lr_schedule(lr=1e-4, steps=100, warmup=10)
    optimizer = "sgd" if name.endswith("sgd") else "adamw"
    t = Training(opt_state="device" if name.endswith("devmoments") else "host", params="stream",
                 opt_dtype="bfloat16", optimizer=optimizer)
    step, graphdef, state = abstract_step(fam, cfg, zoo.Recipe.full(), training=t, schedule=schedule)
    model = fam.build(cfg, recipe=zoo.Recipe.full(), rngs=nnx.Rngs(0))
    opt = make_optimizer(model, schedule, clip=1.0, weight_decay=0.1, opt_dtype="bfloat16", master=True,
                         optimizer=optimizer)
    concrete = jax.tree.map(lambda c, a: jax.device_put(c, a.sharding), nnx.split((model, opt))[1], state)
    batch = {"tokens": jnp.zeros((2, 17), jnp.int32), "weights": jnp.ones((2, 16))}
    if name in ("zoo_step", "zoo_step_barrier"):
        _bisect(name, streamed_update)
        return dict(loss=float(step(concrete, batch)[1]["loss"]))
    if name == "zoo_step_nofinite":   # the step with the parameters' finiteness after the update not checked
        import zoo.train_step as ts
        ts.all_finite = lambda tree: jnp.bool_(True)
        step, _, _ = abstract_step(fam, cfg, zoo.Recipe.full(), training=t, schedule=schedule)
        return dict(loss=float(step(concrete, batch)[1]["loss"]))
    shardings = jax.tree.map(lambda x: x.sharding, concrete)
    _bisect(name, streamed_update)

    def g(state, batch):
        m, o = nnx.merge(graphdef, state)
        _, _, _, _, grads = loss_and_grads(m, batch, aux_loss=lambda c, a: 0.0)
        streamed_update.update(m, o, grads, ok=jnp.bool_(True))
        finite = all_finite(nnx.state(m)) if name == "zoo_update_finite" else jnp.bool_(True)
        return (nnx.state(m) if name.endswith("_params") else nnx.state((m, o))), finite
    if name.startswith("zoo_update_given"):
        def grads_of(state, batch):
            m, _ = nnx.merge(graphdef, state)
            return loss_and_grads(m, batch, aux_loss=lambda c, a: 0.0)[-1]

        def update(state, grads):
            m, o = nnx.merge(graphdef, state)
            streamed_update.update(m, o, grads, ok=jnp.bool_(True))
            return nnx.state((m, o))
        grads = jax.jit(grads_of)(concrete, batch)
        print("gradients made", flush=True)
        compiled = jax.jit(update, out_shardings=shardings).lower(concrete, grads).compile()
        print("compiled", flush=True)
        return dict(leaves=len(jax.tree.leaves(compiled(concrete, grads))))
    if name.startswith("zoo_update_"):
        donate = (0,) if name in ("zoo_update_donate", "zoo_update_finite") else ()
        out = (nnx.state(nnx.merge(graphdef, shardings)[0]) if name.endswith("_params") else shardings, None)
        compiled = jax.jit(g, donate_argnums=donate, out_shardings=out).lower(concrete, batch).compile()
        print("compiled", flush=True)
        new, finite = compiled(concrete, batch)
        return dict(finite=bool(finite), leaves=len(jax.tree.leaves(new)))

    def f(state, batch):
        m, o = nnx.merge(graphdef, state)
        if name == "zoo_finite":
            return all_finite(nnx.state(m))
        loss, _, _, _, grads = loss_and_grads(m, batch, aux_loss=lambda c, a: 0.0)
        return streamed_update.global_norm(grads) if name.endswith("norm") else loss
    return dict(out=float(jax.jit(f)(concrete, batch)))


def _bisect(name: str, su) -> None:
    """Patch `zoo.streamed_update` (module `su`) in this process as variant `name` asks (`_zoo_variant`)."""
    import jax
    import jax.numpy as jnp
    if name.endswith("_noguard"):
        chunks = su._update_chunks
        su._update_chunks = lambda u, *a: chunks(u._replace(ok=jnp.bool_(True)), *a)
    if name.endswith("_noclip"):
        su._clip = lambda g, norm, max_norm: g
    if name.endswith("_barrier"):   # every copy between memories inside the program behind an optimization barrier
        put = jax.device_put

        def barrier_put(x, device=None, **kw):
            y = put(x, device, **kw)
            return jax.lax.optimization_barrier(y) if isinstance(device, jax.memory.Space) else y
        jax.device_put = barrier_put
    if name.endswith("_onechunk"):
        su.chunking = lambda param, itemsize: (0, 1)
    if name.endswith("_oneleaf"):
        groups = su._groups

        def first(per_param, grads):
            leaf = next(leaf for leaves in groups(per_param, grads).values() for leaf in leaves
                        if su.on_host(leaf.param[...]))
            return {leaf.chunks: [leaf]}
        su._groups = first
    if name.endswith(("_stacked", "_unstacked")):
        groups, host = su._groups, name.endswith("_stacked") and not name.endswith("_unstacked")
        def kept(per_param, grads):
            chosen = {n: [leaf for leaf in leaves if su.on_host(leaf.param[...]) == host]
                      for n, leaves in groups(per_param, grads).items()}
            return {n: leaves for n, leaves in chosen.items() if leaves}
        su._groups = kept
    if name.endswith("_unrolled"):
        def fori_loop(lo, hi, body, carry):
            for i in range(lo, hi):
                carry = body(i, carry)
            return carry
        jax.lax.fori_loop = fori_loop


def run_variant(name: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    host = NamedSharding(mesh, PartitionSpec(), memory_kind="pinned_host")
    dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
    if name.startswith("zoo"):
        return _zoo_variant(name)
    if name.startswith("u_"):
        return _update_variant(name, host, dev)
    w, x, model = _host_scan(host, dev, remat=name != "xs_plain")

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
    ap.add_argument("--only", help="a regex over the variants' names")
    ap.add_argument("--smoke", action="store_true", help="the same on any device")
    ap.add_argument("--flags", default="none", help=f"comma-separated XLA flag sets to run each variant under "
                    f"({', '.join(FLAG_SETS)})")
    ap.add_argument("--gdb", action="store_true", help="run a crashing variant again under cuda-gdb for the native "
                    "stack of the crash")
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(dict(variant=a.variant, **run_variant(a.variant))), flush=True)
        return
    import os
    import re

    from bench.common import emit
    for fs in a.flags.split(","):
        for v in [v for v in VARIANTS if a.only is None or re.search(a.only, v)]:
            env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {FLAG_SETS[fs]}".strip()
            if a.dump:
                env["XLA_FLAGS"] += (f" --xla_dump_to={a.dump}/{v}-{fs} --xla_dump_hlo_as_text "
                                     "--xla_dump_hlo_pass_re=.*")
            cmd = [sys.executable, "-X", "faulthandler", "-m", "bench.param_stream_probe", "--variant", v]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            out = p.stdout.strip().splitlines()
            rec = dict(bench="param-stream-probe", variant=v, flag_set=fs, rc=p.returncode,
                       out=out[-1] if out else None, err=p.stderr.strip().splitlines()[-12:] if p.returncode else None)
            if p.returncode and a.dump:   # the passes dumped last: the crash came in or after the newest
                files = sorted(os.scandir(f"{a.dump}/{v}-{fs}"), key=lambda e: e.stat().st_mtime_ns)
                rec["last_passes"] = [e.name for e in files[-6:]]
            if p.returncode and a.gdb:
                try:
                    g = subprocess.run(["cuda-gdb", "-batch", "-ex", "run", "-ex", "bt 40", "--args", *cmd], env=env,
                                       capture_output=True, text=True, timeout=300)
                    rec["native_stack"] = [ln for ln in g.stdout.splitlines() if ln.startswith("#")][:40]
                except (OSError, subprocess.TimeoutExpired) as e:
                    rec["native_stack"] = [f"cuda-gdb: {e}"]
            emit(rec)


if __name__ == "__main__":
    main()
