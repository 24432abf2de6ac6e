"""`--params host`, which keeps the float32 master copy of 16-bit parameters (`zoo.optim.with_master`) in pinned
host memory between steps: the placement changes no number beyond XLA's rounding (tests/rounding.py), the
planner counts it where it lives, checkpoints resume it exactly. The master's arithmetic, its placement and the
float32 sums it receives are the library's tests (tests/test_optim.py, tests/test_opt_state.py,
tests/test_train_step.py). Tiny Llama with bf16 parameters, a few steps on the CPU."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import zoo
from recipes.registry import default_recipe
from recipes.train import loop
from recipes.train import plan as plan_cli
from recipes.train.inputs import data as data_lib
from recipes.train.processes import mesh as mesh_lib
from recipes.train.settings.cli import family as model_family
from recipes.train.settings.cli import recipe as model_recipe
from recipes.train.step import fit, prepare
from tests.helpers import hlo_type
from tests.rounding import assert_same_metrics, assert_same_state
from tests.train.cli_runs import RUN, main
from zoo.opt_state import HOST, is_master
from zoo.optim import lr_schedule, make_optimizer
from zoo.plan import Training
from zoo.plan.peak import from_compiled
from zoo.train_step import abstract_batch, abstract_step, compile_abstract, family_step, jit_step

SEQ = 8
BF16 = (("param_dtype", "bfloat16"),)
SCHEDULE = lr_schedule(lr=3e-3, steps=12, warmup=0)


def _f32(x):
    return np.asarray(x).astype(np.float32)


@pytest.mark.slow   # test_streamed_update.py compares the same runs
def test_the_master_on_the_host_trains_as_in_hbm():
    """Tiny Llama, bf16 parameters, the master optimizer built with its master in HBM and in pinned host memory
    (--params host): the master's arrays are pinned-host arrays through the steps, the parameters device arrays;
    two steps give the same state and metrics (to a few ulp at each array's scale: `tests.rounding`),
    with the parameters the master rounded bit for bit; a third step on a NaN batch keeps every state exactly as it
    was, the master included."""
    fam = model_family("llama3")
    cfg = dataclasses.replace(fam.config("tiny"), param_dtype="bfloat16")
    mesh = mesh_lib.resolve(None, cfg, 2)
    data = data_lib.Synthetic(vocab=cfg.vocab_size, batch=2, seq=SEQ)
    results = {}
    for where in ("device", "host"):
        model, opt = prepare.build_sharded(fam, cfg, model_recipe(fam, default_recipe(fam)), mesh, seed=0,
                                        params=where, make_opt=lambda m: make_optimizer(
                                            m, SCHEDULE, clip=1.0, weight_decay=0.1, opt_dtype="float32",
                                            master=True))
        step, graphdef, state = jit_step(model, opt, family_step(fam, SCHEDULE), keep_shardings=True)
        for i in (1, 2):
            state, m = step(state, mesh_lib.put_batch(data.batch(i), mesh))
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        assert {x.sharding.memory_kind for p, x in flat if is_master(p)} == {HOST if where == "host" else "device"}
        assert {x.sharding.memory_kind for p, x in flat if not is_master(p)} == {"device"}
        model, opt = nnx.merge(graphdef, state)
        for p, w in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(opt.opt_state.master)):
            assert p.dtype == jnp.bfloat16 and np.array_equal(_f32(p), _f32(jnp.asarray(w).astype(jnp.bfloat16)))
        before = [np.asarray(x) for x in jax.tree.leaves(state)]
        poisoned = dict(data.batch(3), weights=np.full((2, SEQ), np.nan, np.float32))
        state, bad = step(state, mesh_lib.put_batch(poisoned, mesh))
        assert not bad["ok"] and all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(state)))
        results[where] = (jax.device_get(m), before)
    (m_dev, s_dev), (m_host, s_host) = results["device"], results["host"]
    assert m_dev["ok"] and m_host["ok"]
    assert_same_metrics(m_dev, m_host)
    assert_same_state(s_dev, s_host)


# -- the plan and the compiled step -----------------------------------------------------------------------------------
def test_the_plan_counts_the_master_where_it_lives():
    """Training(params="host") adds a float32 master (4 bytes a parameter) to pinned host memory, none to the HBM
    figures; with the moments there too, host state is both; float32 parameters are refused. The refusal of a
    step that does not fit offers bf16 parameters with their master on the host (on a GPU, float32 parameters)."""
    fam = model_family("llama3")
    cfg, recipe = dataclasses.replace(fam.config("tiny"), param_dtype="bfloat16"), model_recipe(fam, "qkv_offload")
    dev = zoo.plan.plan(cfg, recipe, batch=2, seq=SEQ, peak=None)
    host = zoo.plan.plan(cfg, recipe, batch=2, seq=SEQ, peak=None, training=Training(params="host"))
    both = zoo.plan.plan(cfg, recipe, batch=2, seq=SEQ, peak=None, training=Training(params="host", opt_state="host"))
    n = dev.state.num_params
    assert dev.state.master == 0 and host.state.master == 4 * n == 2 * host.state.params
    assert host.state.total == dev.state.total and host.host_total == dev.host_total + 4 * n
    assert host.to_dict()["model_state"]["host"] == 4 * n
    assert both.state.host == both.state.optimizer + 4 * n
    assert both.state.total == dev.state.total - dev.state.optimizer
    with pytest.raises(ValueError, match="--params host .* the parameters are float32"):
        zoo.plan.plan(fam.config("tiny"), recipe, batch=2, seq=SEQ, peak=None, training=Training(params="host"))
    state = zoo.plan.ModelState(num_params=0, params=2**29, grads=0, optimizer=2**30, other=0, optimizer_name="adamw")
    kw = dict(batch=8, seq=64, recipe="full", state=state, gpu=True)
    assert "--set param_dtype=bfloat16 --params host (bf16 parameters and gradients in HBM, saving 512.0 MiB" in \
        fit.advice(Training(), **kw)
    assert "--params host" not in fit.advice(Training(), **kw, param_dtype="bfloat16")
    assert "--params host" not in fit.advice(Training(params="host"), **kw)


@pytest.mark.slow
def test_the_planner_compiles_the_step_with_the_master_on_the_host():
    """Lowered for CUDA (no GPU needed), the step's arguments and results in pinned host memory are exactly the
    master's float32 arrays, one per parameter; the planner's compiled peak with params="host" is that of the
    step the main job compiles (`compile_abstract`, the same program)."""
    fam = model_family("llama3")
    cfg = dataclasses.replace(fam.config("tiny"), param_dtype="bfloat16")
    recipe = model_recipe(fam, "full")
    jitted, _, state = abstract_step(fam, cfg, recipe, training=Training(params="host"))
    text = jitted.trace(state, abstract_batch(2, SEQ)).lower(lowering_platforms=("cuda",)).as_text()
    line = next(ln for ln in text.splitlines() if "func.func public @main" in ln)
    args, _, results = line.partition(") -> (")
    master = sorted(hlo_type(x.shape, jnp.float32) for x in jax.tree.leaves(state[0]))
    assert sorted(re.findall(r'(tensor<[^>]*>) \{mhlo\.memory_kind = "pinned_host"', args)) == master
    assert len(re.findall(r'mhlo\.memory_kind = "pinned_host"', results)) == len(master)
    planned = zoo.plan.plan(cfg, recipe, batch=2, seq=SEQ, peak="compile", training=Training(params="host"))
    compiled = compile_abstract(fam, cfg, recipe, batch=2, seq=SEQ, training=Training(params="host"))[0]
    assert planned.peak.compiled and planned.peak_bytes == from_compiled(compiled).bytes


# -- the main job -----------------------------------------------------------------------------------------------------
def test_params_host_with_float32_parameters_is_refused_before_compiling(capsys):
    """`--params host` with float32 parameters: a message naming both flags (exit 2), before anything compiles;
    the planner's command line says the same; an unknown place is refused by RunConfig."""
    rc, out, err = main(RUN + ["--params", "host"], capsys)
    assert rc == 2 and "--params host" in err and "--set param_dtype=bfloat16" in err
    assert "Traceback" not in err and "compiled" not in out
    with pytest.raises(SystemExit) as e:
        plan_cli.main(["--params", "host", "--seq", "16", "--peak", "none"])
    assert e.value.code == 2 and "the parameters are float32" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--params must be one of device, host, stream, got 'disk'"):
        loop.RunConfig(params="disk")


@pytest.mark.slow   # the full set (-m 'slow or not slow'); see docs/testing.md
def test_a_run_with_the_master_on_the_host_resumes_exactly(tmp_path):
    """The main job with bf16 parameters and --params host, stopped after step 2 and resumed, gives the losses and
    final parameters of the uninterrupted run bit for bit (the checkpoint saves the master from host memory and
    restores it there); resuming it with --params device is refused, naming the flag."""
    kw = dict(steps=4, batch=2, seq=SEQ, log_every=1, lr=1e-2, warmup=0, overrides=BF16, params="host")
    whole = loop.run(loop.RunConfig(**kw))
    ckpt = str(tmp_path / "ckpt")
    first = loop.run(loop.RunConfig(ckpt_dir=ckpt, ckpt_every=1, stop_after=2, **kw))
    assert first.stopped == "stop_after" and first.last_checkpoint == 2
    rest = loop.run(loop.RunConfig(ckpt_dir=ckpt, resume=True, **kw))
    assert rest.steps == [3, 4] and first.losses + rest.losses == whole.losses
    for a, b in zip(jax.tree.leaves(nnx.state(whole.model)), jax.tree.leaves(nnx.state(rest.model))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="written with --params host, this run asks for --params device"):
        loop.run(loop.RunConfig(ckpt_dir=ckpt, resume=True, **{**kw, "params": "device"}))


@pytest.mark.slow   # the full set; tests/test_params_stream.py checks a streamed step against --params host
def test_a_streamed_run_resumes_exactly_and_equals_the_master_on_the_host(tmp_path):
    """--params stream (the stacks' bf16 parameters in pinned host memory too), stopped after step 2 and resumed,
    gives the losses and final parameters of the uninterrupted streamed run bit for bit (the checkpoint saves the
    streamed parameters from host memory and restores them there), and those of --params host to XLA's rounding
    (the clip's norm is summed in another order)."""
    kw = dict(steps=4, batch=2, seq=SEQ, log_every=1, lr=1e-2, warmup=0, overrides=BF16)
    host = loop.run(loop.RunConfig(params="host", **kw))
    whole = loop.run(loop.RunConfig(params="stream", **kw))
    ckpt = str(tmp_path / "ckpt")
    first = loop.run(loop.RunConfig(ckpt_dir=ckpt, ckpt_every=1, stop_after=2, params="stream", **kw))
    rest = loop.run(loop.RunConfig(ckpt_dir=ckpt, resume=True, params="stream", **kw))
    assert rest.steps == [3, 4] and first.losses + rest.losses == whole.losses
    for a, b in zip(jax.tree.leaves(nnx.state(whole.model)), jax.tree.leaves(nnx.state(rest.model))):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_allclose(whole.losses, host.losses, rtol=1e-5)
    assert_same_state(nnx.state(host.model), nnx.state(whole.model))
    stacked = [x for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(rest.model, nnx.Param))[0]
               if "['layers']['layers']" in jax.tree_util.keystr(p)]
    assert stacked and all(x.sharding.memory_kind == HOST for x in stacked)
