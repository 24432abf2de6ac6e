"""The float32 master copy of 16-bit parameters (`zoo.optim.with_master`) and `--params host`, which keeps it in
pinned host memory between steps: the parameters are the master rounded, updates too small for bf16 add up in
the master, the placement changes no number beyond XLA's rounding (tests/train/rounding.py), the planner counts it
where it lives, checkpoints resume it exactly. Tiny Llama with bf16 parameters (or a one-matrix module), a few
steps on the CPU."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zoo
from recipes.registry import default_recipe
from recipes.train import data as data_lib
from recipes.train import fit, loop
from recipes.train import plan as plan_cli
from recipes.train.cli import family as model_family
from recipes.train.cli import recipe as model_recipe
from tests.helpers import hlo_type
from tests.train.cli_runs import RUN, main
from tests.train.rounding import assert_same_metrics, assert_same_state
from zoo.opt_state import HOST, is_master, state_shardings
from zoo.optim import MasterOptimizer, MasterState, make_optimizer, with_master
from zoo.plan import Training
from zoo.plan.peak import from_compiled
from zoo.train_step import abstract_batch, abstract_step, compile_abstract, family_step, jit_step, train_step

SEQ = 8
BF16 = (("param_dtype", "bfloat16"),)
SCHEDULE = loop.lr_schedule(lr=3e-3, steps=12, warmup=0)


class _Matrix(nnx.Module):
    """One bf16 [4, 3] parameter, all ones."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones((4, 3), jnp.bfloat16))


def _f32(x):
    return np.asarray(x).astype(np.float32)


def test_the_parameters_are_the_master_rounded_after_every_update():
    """Clipped AdamW on a float32 master: after each of five updates with random gradients, the master is float32
    and the bf16 parameter equals the master cast to bf16 bit for bit (not bf16 p + u, rounded twice)."""
    model = _Matrix()
    opt = make_optimizer(model, optax.constant_schedule(3e-2), clip=1.0, weight_decay=0.1, master=True)
    assert isinstance(opt, MasterOptimizer) and isinstance(opt.opt_state, MasterState)
    update = nnx.jit(lambda m, o, g: o.update(m, g))
    for i in range(5):
        key = jax.random.key(i)
        grads = jax.tree.map(lambda p, k=key: jax.random.normal(k, p.shape, jnp.bfloat16), nnx.state(model, nnx.Param))
        update(model, opt, grads)
        master = opt.opt_state.master["w"][...]
        assert master.dtype == jnp.float32 and model.w[...].dtype == jnp.bfloat16
        assert np.array_equal(_f32(model.w[...]), _f32(master.astype(jnp.bfloat16)))
    assert not np.array_equal(_f32(model.w[...]), np.ones((4, 3)))   # the updates moved it


def test_updates_too_small_for_bf16_add_up_in_the_master():
    """SGD at lr 1e-4 on gradients of 1, 100 steps: each step's -1e-4 is under half a bf16 ulp at 1.0 (2**-9), so bf16
    parameters without a master never move, while the master moves by 0.01 and the parameters, its rounding,
    with it."""
    out = {}
    for master in (False, True):
        model = _Matrix()
        opt = make_optimizer(model, optax.constant_schedule(1e-4), clip=1e9, weight_decay=0.0, optimizer="sgd",
                             master=master)
        update = nnx.jit(lambda m, o: o.update(m, jax.tree.map(jnp.ones_like, nnx.state(m, nnx.Param))))
        for _ in range(100):
            update(model, opt)
        out[master] = (_f32(model.w[...]), opt)
    assert np.array_equal(out[False][0], np.ones((4, 3)))
    moved, opt = out[True]
    master = np.asarray(opt.opt_state.master["w"][...])
    np.testing.assert_allclose(master, 0.99, rtol=1e-5)
    assert np.array_equal(moved, _f32(jnp.asarray(master).astype(jnp.bfloat16))) and (moved < 1).all()


def test_with_master_alone_gives_the_float32_update_against_the_parameters():
    """`with_master` in a plain optax loop: its update is new master - params in float32, so `optax.apply_updates`
    lands on the master's rounding (here exactly: the two are within a factor of two)."""
    params = {"w": jnp.ones((4, 3), jnp.bfloat16)}
    tx = with_master(optax.sgd(0.25))
    state = tx.init(params)
    updates, state = tx.update({"w": jnp.ones((4, 3), jnp.bfloat16)}, state, params)
    assert updates["w"].dtype == jnp.float32 and state.master["w"].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(state.master["w"]), 0.75)
    np.testing.assert_array_equal(_f32(optax.apply_updates(params, updates)["w"]), 0.75)


# -- placement --------------------------------------------------------------------------------------------------------
def _abstract(fam, master=True):
    cfg = dataclasses.replace(fam.config("tiny"), param_dtype="bfloat16")

    def build():
        model = fam.build(cfg, recipe=model_recipe(fam, "full"), rngs=nnx.Rngs(0))
        return model, make_optimizer(model, SCHEDULE, clip=1.0, weight_decay=0.1, master=master)
    return nnx.split(nnx.eval_shape(build))[1]


def test_the_master_is_placed_independently_of_the_moments():
    """On shapes alone: `--params host` moves exactly the master's arrays to pinned host memory, `--opt-state host`
    exactly the moments; the bf16 parameters and the step counters stay in HBM whatever both say. `--params host`
    for an optimizer without a master is a ValueError."""
    fam = model_family("llama3")
    state = _abstract(fam)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    kinds = {"master": set(), "param": set(), "moment": set(), "counter": set()}
    for path, x in flat:
        kinds["master" if is_master(path) else "param" if path[0].key == 0 else
              "moment" if x.ndim and jnp.issubdtype(x.dtype, jnp.floating) else "counter"].add(path)
    assert len(kinds["master"]) == len(kinds["param"]) > 0 and len(kinds["moment"]) == 2 * len(kinds["param"])
    assert all(x.dtype == jnp.float32 for p, x in flat if is_master(p))
    for params in ("device", "host"):
        for opt_state in ("device", "host"):
            placed = state_shardings(state, jax.tree.map(lambda _: device, state), opt_state=opt_state,
                                     params=params)
            where = {path: s.memory_kind for (path, _), s in zip(flat, jax.tree.leaves(placed))}
            want = {"master": params, "moment": opt_state, "param": "device", "counter": "device"}
            for kind, paths in kinds.items():
                assert {where[p] for p in paths} == {HOST if want[kind] == "host" else "device"}, (kind, params)
    plain = _abstract(fam, master=False)
    with pytest.raises(ValueError, match="--params host .* keeps none"):
        state_shardings(plain, jax.tree.map(lambda _: device, plain), params="host")


@pytest.mark.slow   # test_streamed_update.py compares the same runs
def test_the_master_on_the_host_trains_as_in_hbm():
    """Tiny Llama, bf16 parameters, the master optimizer built with its master in HBM and in pinned host memory
    (--params host): the master's arrays are pinned-host arrays through the steps, the parameters device arrays;
    two steps give the same state and metrics (to a few ulp at each array's scale: `tests.train.rounding`),
    with the parameters the master rounded bit for bit; a third step on a NaN batch keeps every state exactly as it
    was, the master included."""
    fam = model_family("llama3")
    cfg = dataclasses.replace(fam.config("tiny"), param_dtype="bfloat16")
    mesh = loop.mesh_lib.resolve(None, cfg, 2)
    data = data_lib.Synthetic(vocab=cfg.vocab_size, batch=2, seq=SEQ)
    results = {}
    for where in ("device", "host"):
        model, opt = loop.build_sharded(fam, cfg, model_recipe(fam, default_recipe(fam)), mesh, seed=0,
                                        params=where, make_opt=lambda m: make_optimizer(
                                            m, SCHEDULE, clip=1.0, weight_decay=0.1, opt_dtype="float32",
                                            master=True))
        step, graphdef, state = jit_step(model, opt, family_step(fam, SCHEDULE), keep_shardings=True)
        for i in (1, 2):
            state, m = step(state, loop.mesh_lib.put_batch(data.batch(i), mesh))
        flat = jax.tree_util.tree_flatten_with_path(state)[0]
        assert {x.sharding.memory_kind for p, x in flat if is_master(p)} == {HOST if where == "host" else "device"}
        assert {x.sharding.memory_kind for p, x in flat if not is_master(p)} == {"device"}
        model, opt = nnx.merge(graphdef, state)
        for p, w in zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(opt.opt_state.master)):
            assert p.dtype == jnp.bfloat16 and np.array_equal(_f32(p), _f32(jnp.asarray(w).astype(jnp.bfloat16)))
        before = [np.asarray(x) for x in jax.tree.leaves(state)]
        poisoned = dict(data.batch(3), weights=np.full((2, SEQ), np.nan, np.float32))
        state, bad = step(state, loop.mesh_lib.put_batch(poisoned, mesh))
        assert not bad["ok"] and all(np.array_equal(a, np.asarray(b)) for a, b in zip(before, jax.tree.leaves(state)))
        results[where] = (jax.device_get(m), before)
    (m_dev, s_dev), (m_host, s_host) = results["device"], results["host"]
    assert m_dev["ok"] and m_host["ok"]
    assert_same_metrics(m_dev, m_host)
    assert_same_state(s_dev, s_host)


def test_accumulated_gradients_reach_the_master_in_float32():
    """With --grad-accum 2 the float32 sums of the micro-batches' gradients reach a master optimizer unrounded;
    without accumulation the gradients are the bf16 parameters' own (traced on shapes alone)."""
    fam = model_family("llama3")
    cfg = dataclasses.replace(fam.config("tiny"), param_dtype="bfloat16")
    seen = []

    def spy(tx):
        def update(updates, state, params=None):
            seen.append({x.dtype for x in jax.tree.leaves(updates)})
            return tx.update(updates, state, params)
        return optax.GradientTransformation(tx.init, update)

    for k in (2, 1):
        def build_and_step():
            model = fam.build(cfg, recipe=model_recipe(fam, "full"), rngs=nnx.Rngs(0))
            opt = MasterOptimizer(model, spy(zoo.optim.make_tx(SCHEDULE, master=True)), wrt=nnx.Param)
            batch = {"tokens": jnp.zeros((4, SEQ + 1), jnp.int32), "weights": jnp.ones((4, SEQ), jnp.float32)}
            return train_step(model, opt, batch, lr=SCHEDULE, grad_accum=k)   # noqa: B023 (called in this pass)
        jax.eval_shape(build_and_step)
    assert seen == [{jnp.dtype(jnp.float32)}, {jnp.dtype(jnp.bfloat16)}]


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
    kw = dict(batch=8, seq=64, recipe="full", opt_dtype="float32", optimizer_bytes=2**30, gpu=True)
    assert "--set param_dtype=bfloat16 --params host (bf16 parameters and gradients in HBM, saving 512.0 MiB" in \
        fit.advice(**kw, param_bytes=2**29)
    assert "--params host" not in fit.advice(**kw, param_bytes=2**29, param_dtype="bfloat16")
    assert "--params host" not in fit.advice(**kw, param_bytes=2**29, params="host")


def test_the_planner_compiles_the_step_with_the_master_on_the_host():
    """Lowered for CUDA (no GPU needed), the step's arguments and results in pinned host memory are exactly the
    master's float32 arrays, one per parameter; the planner's compiled peak with params="host" is that of the
    step the main job compiles (`compile_abstract`, the same program)."""
    fam = model_family("llama3")
    cfg = dataclasses.replace(fam.config("tiny"), param_dtype="bfloat16")
    recipe = model_recipe(fam, "full")
    jitted, _, state = abstract_step(fam, cfg, recipe, params="host", opt_dtype="float32")
    text = jitted.trace(state, abstract_batch(2, SEQ)).lower(lowering_platforms=("cuda",)).as_text()
    line = next(ln for ln in text.splitlines() if "func.func public @main" in ln)
    args, _, results = line.partition(") -> (")
    master = sorted(hlo_type(x.shape, jnp.float32) for x in jax.tree.leaves(state[0]))
    assert sorted(re.findall(r'(tensor<[^>]*>) \{mhlo\.memory_kind = "pinned_host"', args)) == master
    assert len(re.findall(r'mhlo\.memory_kind = "pinned_host"', results)) == len(master)
    planned = zoo.plan.plan(cfg, recipe, batch=2, seq=SEQ, peak="compile", training=Training(params="host"))
    compiled = compile_abstract(fam, cfg, recipe, batch=2, seq=SEQ, params="host", opt_dtype="float32")[0]
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
    with pytest.raises(ValueError, match="--params must be one of device, host, got 'disk'"):
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
