"""capacity-sweep: the largest batch a deepseek-slice recipe fits, planned and measured.

    XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true python3 -m bench.capacity_sweep mla_moe_offload --start 8
    JAX_PLATFORMS=cpu python -m bench.capacity_sweep mla_moe_offload --smoke --hbm 0.05   # checks the script only

The model is bench/deepseek_slice.py's, the step the main job's (`zoo.train_step`) with SGD. First the planner
(`zoo.plan.largest_batch(..., peak="compile")`) finds B*, the largest power-of-two batch whose compiled peak fits the
allocator's limit; then the same step really runs at B* and at 2 B* (an out-of-memory error there is data, `fits:
false`). Every phase runs in a process of its own, sharing a compilation cache. One record per (recipe, batch): the
planned peak, the budget, predicted_fits, fits, the measured peak, step_s, error.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

GiB = 1 << 30
RESULT = "CAPACITY-SWEEP-RESULT "
T0 = time.monotonic()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.capacity_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="a key of recipes.deepseek_v3.RECIPES")
    ap.add_argument("--start", type=int, default=None, help="the first batch planned (a power of two; default 1)")
    ap.add_argument("--cap", type=int, default=1024, help="the largest batch planned")
    ap.add_argument("--seq", type=int, default=None, help="default 4096 (64 with --smoke)")
    ap.add_argument("--backend", default="capacity", choices=["auto", "ragged_dot", "capacity", "tokamax"])
    ap.add_argument("--hbm", type=float, default=None,
                    help="budget, GiB (default: the allocator's bytes_limit of the GPU; required on the CPU)")
    ap.add_argument("--steps", type=int, default=2, help="steps run at each measured batch")
    ap.add_argument("--child-timeout", type=int, default=300, help="seconds for each child process")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole sweep: each child's timeout is cut to what is left, and a batch "
                         "left without time gets a record saying so")
    ap.add_argument("--cache-dir", default=None, help="persistent compilation cache shared by the children "
                    "(default: a fresh temporary directory)")
    ap.add_argument("--smoke", action="store_true", help="tiny preset on any device (checks the script only)")
    ap.add_argument("--role", choices=["parent", "plan", "run"], default="parent", help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ident", default=None, help=argparse.SUPPRESS)
    return ap


def config(a):
    from zoo.models.registry import family
    fam = family("deepseek_v3")
    common = dict(param_dtype="bfloat16", dtype="bfloat16", moe_backend=a.backend, capacity_factor=1.25)
    if a.smoke:
        return fam, fam.config("tiny", **common)
    return fam, fam.config("deepseek_v3_671b", num_layers=4, first_dense_layers=1, num_experts=16, **common)


def recipe_of(fam, name):
    from recipes.registry import recipes_of
    named = recipes_of(fam)
    if name not in named:
        raise SystemExit(f"recipe {name!r} is not a deepseek_v3 recipe: {', '.join(named)}")
    return named[name]


# -- the children ---------------------------------------------------------------------------------------------------
def plan_child(a) -> dict:
    """The planner's walk (compiling for the device present), and its peak at 2 B* if the walk skipped it."""
    import jax
    import jax.numpy as jnp

    import zoo
    from zoo.layers.moe import backend_choice
    fam, cfg = config(a)
    recipe = recipe_of(fam, a.recipe)
    try:
        backend, why = backend_choice(a.backend, dtype=jnp.bfloat16)
    except ValueError as e:
        backend, why = a.backend, str(e)
    c = zoo.plan.largest_batch(cfg, recipe, seq=a.seq, hardware=zoo.plan.Hardware(hbm_gib=a.hbm),
                               training=zoo.plan.Training(optimizer="sgd"), peak="compile", start=a.start, cap=a.cap)
    planned = {t.batch: (t.peak_bytes, t.peak_source) for t in c.tried}
    measure = [c.batch, 2 * c.batch] if c.batch else [min(planned)]
    for b in measure:
        if b not in planned:  # 2 B* past the cap
            p = zoo.plan.plan(cfg, recipe, batch=b, seq=a.seq, training=zoo.plan.Training(optimizer="sgd"),
                              peak="compile")
            planned[b] = (p.peak_bytes, p.peak_source)
    return dict(capacity=c.to_dict(), measure=measure, backend=backend, backend_why=why,
                planned={str(b): v for b, v in planned.items()}, L=cfg.num_layers, E=cfg.num_experts,
                device=jax.devices()[0].device_kind)


def is_oom(e: BaseException) -> bool:
    text = f"{type(e).__name__}: {e}"
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Out of memory" in text


def run_child(a) -> None:
    """Build the real state for --batch, run the planner's jitted step --steps times, emit the record."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bench.common import emit
    from zoo.optim import lr_schedule, make_optimizer
    from zoo.plan import Training
    from zoo.plan.peak import from_compiled
    from zoo.train_step import abstract_step

    ident = json.loads(a.ident)
    fam, cfg = config(a)
    recipe = recipe_of(fam, a.recipe)
    out = dict(fits=None, peak_gib=None, step_s=None, error=None)
    try:
        schedule = lr_schedule(lr=1e-4, steps=100, warmup=10)   # abstract_step's default: the planner's program
        jitted, _, abstract = abstract_step(fam, cfg, recipe, schedule=schedule,
                                              training=Training(optimizer="sgd"))
        model = fam.build(cfg, recipe=recipe, rngs=nnx.Rngs(0))
        opt = make_optimizer(model, schedule, clip=1.0, weight_decay=0.1, optimizer="sgd", opt_dtype="float32")
        _, state = nnx.split((model, opt))
        del model, opt
        if jax.tree.structure(state) != jax.tree.structure(abstract):
            raise RuntimeError("the real state's tree differs from the planner's abstract state")
        tokens = jax.random.randint(jax.random.key(1), (a.batch, a.seq + 1), 0, cfg.vocab_size, jnp.int32)
        batch = {"tokens": tokens, "weights": jnp.ones((a.batch, a.seq), jnp.float32)}
        t0 = time.perf_counter()
        compiled = jitted.lower(state, batch).compile()
        out["compile_s"] = round(time.perf_counter() - t0, 1)
        cp = from_compiled(compiled)
        out["compiled_peak_gib"] = round(cp.bytes / GiB, 2)
        out["host_temp_gib"] = round(cp.detail["host_temp"] / GiB, 2)
        times = []
        for _ in range(a.steps):
            t = time.perf_counter()
            state, metrics = compiled(state, batch)
            loss = float(metrics["loss"])
            times.append(time.perf_counter() - t)
        out.update(fits=True, step_s=round(times[-1], 4), loss=loss, dropped=int(metrics["dropped"]))
    except Exception as e:  # out of memory is the answer at 2 B*; anything else is an error with fits unknown
        out["fits"] = False if is_oom(e) else None
        out["error"] = f"{type(e).__name__}: {str(e)[:400]}"
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("peak_bytes_in_use"):
        out["peak_gib"] = round(stats["peak_bytes_in_use"] / GiB, 2)
    if stats.get("bytes_limit"):
        out["device_limit_gib"] = round(stats["bytes_limit"] / GiB, 2)
    emit({**ident, **out, "date": datetime.date.today().isoformat()})


# -- the parent (never touches the accelerator) ---------------------------------------------------------------------
def child(a, role: str, *extra: str) -> tuple[int, str, str]:
    """Run a child process of `role`; (exit status, stdout, stderr); 124 when it ran out of time."""
    limit = a.child_timeout if a.deadline is None else min(a.child_timeout, a.deadline - (time.monotonic() - T0))
    if limit < 20:
        return 124, "", "skipped: the sweep's --deadline was spent"
    argv = [sys.executable, "-m", "bench.capacity_sweep", a.recipe, "--role", role, "--seq", str(a.seq),
            "--backend", a.backend, "--cap", str(a.cap), "--steps", str(a.steps), *extra]
    argv += ["--start", str(a.start)] if a.start else []
    argv += ["--hbm", str(a.hbm)] if a.hbm is not None else []
    argv += ["--smoke"] if a.smoke else []
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=limit)  # kills the child on timeout
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return 124, stdout, f"timeout after {limit:.0f} s"
    return r.returncode, r.stdout, r.stderr


def write(record: dict) -> None:
    """A record the parent writes itself (a child that died before emitting): bench.common.emit's format, without
    importing JAX's backend here."""
    import jax  # the version only: no backend is started
    record.update(jax=jax.__version__, flags=os.environ.get("XLA_FLAGS", ""),
                  date=datetime.date.today().isoformat())
    record.setdefault("mesh", None)
    line = json.dumps(record)
    print(line, flush=True)
    if os.environ.get("BENCH_OUT"):
        with open(os.environ["BENCH_OUT"], "a") as f:
            f.write(line + "\n")


def parent(a) -> int:
    ident = dict(bench="capacity-sweep", impl="zoo", recipe=a.recipe, backend_asked=a.backend, S=a.seq,
                 start=a.start, smoke=a.smoke)
    rc, out, err = child(a, "plan")
    lines = [line for line in out.splitlines() if line.startswith(RESULT)]
    if rc != 0 or not lines:
        why = (err.strip().splitlines() or [f"exit {rc}"])[-1][:400]
        write({**ident, "backend": a.backend, "B": None, "fits": None, "error": f"planner: {why}"})
        return 0   # the record says why
    p = json.loads(lines[-1][len(RESULT):])
    c = p["capacity"]
    print(f"planner: largest batch {c['batch']} of {c['budget_bytes'] / GiB:.2f} GiB ({c['budget_source']}); "
          + ", ".join(f"B={t['batch']}: {t['peak_bytes'] / GiB:.2f} GiB" for t in c["tried"]), flush=True)
    for b in p["measure"]:
        peak, source = p["planned"][str(b)]
        rec = dict(ident, backend=p["backend"], backend_why=p["backend_why"], B=b, L=p["L"], E=p["E"],
                   planned_largest=c["batch"], planned_peak_gib=round(peak / GiB, 3), planned_peak_source=source,
                   limit_gib=round(c["budget_bytes"] / GiB, 2), limit_source=c["budget_source"],
                   predicted_fits=peak <= c["budget_bytes"],
                   planned_tried=[[t["batch"], round(t["peak_bytes"] / GiB, 3)] for t in c["tried"]])
        rc, out, err = child(a, "run", "--batch", str(b), "--ident", json.dumps(rec))
        sys.stdout.write("".join(line + "\n" for line in out.splitlines() if line.startswith("{")))
        if not any(line.startswith("{") for line in out.splitlines()):  # died before emitting
            why = (err.strip().splitlines() or [f"exit {rc}"])[-1][:400]
            oom = rc != 124 and ("RESOURCE_EXHAUSTED" in err or "out of memory" in err.lower())
            write({**rec, "fits": False if oom else None, "peak_gib": None, "step_s": None,
                   "error": f"run: {why} (exit {rc})"})
    return 0


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    a.seq = a.seq or (64 if a.smoke else 4096)
    if a.role == "plan":
        print(RESULT + json.dumps(plan_child(a)), flush=True)
        return 0
    if a.role == "run":
        run_child(a)
        return 0
    # `timeout` (the runner's) sends SIGTERM: raise, so that subprocess.run kills the running child with us instead
    # of leaving it holding the GPU for the next configuration.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    if a.cache_dir or not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        os.environ["JAX_COMPILATION_CACHE_DIR"] = a.cache_dir or tempfile.mkdtemp(prefix="capacity-jit-")
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
