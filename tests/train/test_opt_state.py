"""Where the optimizer works: gradient accumulation (K micro-batches per update) and the optimizer state held in
pinned host memory between steps. Tiny Llama, a few steps on the CPU."""
from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recipes.registry import default_recipe
from recipes.train import loop
from recipes.train.inputs import data as data_lib
from recipes.train.processes import mesh as mesh_lib
from recipes.train.settings.cli import family as model_family
from recipes.train.settings.cli import recipe as model_recipe
from recipes.train.step import prepare
from tests.helpers import hlo_type, pinned_host_shapes
from tests.rounding import assert_same_metrics, assert_same_state
from zoo.opt_state import OPT_STATE_PLACES, PARAMS_PLACES
from zoo.optim import lr_schedule, make_optimizer
from zoo.plan import ModelState, Training
from zoo.train_step import abstract_batch, abstract_step, check_grad_accum, family_step, jit_step

SEQ = 8
SCHEDULE = lr_schedule(lr=3e-3, steps=12, warmup=0)   # the first step moves the parameters


def _setup(fam, batch=4, seq=SEQ):
    model = fam.build(fam.config("tiny"), recipe=model_recipe(fam, default_recipe(fam)), rngs=nnx.Rngs(0))
    opt = make_optimizer(model, SCHEDULE, clip=1.0, weight_decay=0.1)
    data = data_lib.Synthetic(vocab=fam.config("tiny").vocab_size, batch=batch, seq=seq)
    return model, opt, {k: jnp.asarray(v) for k, v in data.batch(1).items()}


def _one_step(fam, grad_accum, weights=None):
    model, opt, batch = _setup(fam)
    if weights is not None:
        batch["weights"] = weights
    step, _, state = jit_step(model, opt, family_step(fam, SCHEDULE,
                                                      grad_accum))
    state, m = step(state, batch)
    return state, jax.device_get(m)


@pytest.mark.slow   # the library's tests/test_train_step.py checks grad_accum=2 against the whole batch
def test_two_micro_batches_make_the_update_of_the_whole_batch():
    """K=2 on batch 4 (two micro-batches of 2) gives the parameters, optimizer state, loss and gradient norm of
    K=1 on batch 4, within float32 rounding, with uneven token weights (each micro-batch's loss is its share of
    the whole batch's weighted mean, not a plain mean of micro-batch means)."""
    fam = model_family("llama3")
    # micro-batch 0 holds rows 0 and 2: they count a quarter of their tokens, rows 1 and 3 all of them
    weights = jnp.ones((4, SEQ)).at[::2, SEQ // 4:].set(0.0)
    whole, m1 = _one_step(fam, 1, weights)
    accum, m2 = _one_step(fam, 2, weights)
    assert m1["ok"] and m2["ok"]
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(m2["grad_norm"], m1["grad_norm"], rtol=1e-4)
    # float32 sums in another order: a gradient element that cancels can differ by ~1e-4 of itself, which Adam's
    # first step carries into the moments and the parameter (atol: 1e-5 of values of order 0.1)
    for a, b in zip(jax.tree.leaves(accum), jax.tree.leaves(whole)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    # the update moved the parameters (the comparison is not of two untouched states)
    model, _, _ = _setup(fam)
    moved = [not np.allclose(np.asarray(a), np.asarray(b)) for a, b in
             zip(jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(whole[0]))]
    assert any(moved)


def test_grad_accum_must_divide_the_batch():
    with pytest.raises(ValueError, match="--grad-accum 3 must divide --batch 4"):
        check_grad_accum(4, 3)
    with pytest.raises(ValueError, match="--grad-accum must be a positive int"):
        check_grad_accum(4, 0)
    with pytest.raises(ValueError, match="--grad-accum 3 must divide --batch 8"):
        loop.RunConfig(batch=8, grad_accum=3)


# -- the optimizer state in pinned host memory ---------------------------------------------------------------------
def _kinds(tree) -> set[tuple[str | None, str]]:
    return {(getattr(x.sharding, "memory_kind", None), x.dtype.name) for x in jax.tree.leaves(tree)}


def test_host_state_lives_in_pinned_host_memory_and_trains_as_in_hbm():
    """Built with opt_state="host", the optimizer's moments are pinned-host arrays (its step counters stay in
    device memory), stay there through steps, and the steps give the state and metrics of the in-HBM run (the
    streamed update: to a few ulp at each array's scale, `tests.rounding`)."""
    fam = model_family("llama3")
    cfg = fam.config("tiny")
    mesh = mesh_lib.resolve(None, cfg, 2)
    results = {}
    for where in OPT_STATE_PLACES:
        model, opt = prepare.build_sharded(fam, cfg, model_recipe(fam, default_recipe(fam)), mesh, seed=0,
                                        opt_state=where, make_opt=lambda m: make_optimizer(
                                            m, SCHEDULE, clip=1.0, weight_decay=0.1))
        moments = {kind for kind, dtype in _kinds(nnx.state(opt)) if dtype == "float32"}
        assert moments == {"pinned_host" if where == "host" else "device"}
        assert _kinds(nnx.state(model)) == {("device", "float32")}
        step, _, state = jit_step(model, opt, family_step(fam, SCHEDULE), keep_shardings=True)
        data = data_lib.Synthetic(vocab=cfg.vocab_size, batch=2, seq=SEQ)
        for i in (1, 2):
            state, m = step(state, mesh_lib.put_batch(data.batch(i), mesh))
        assert _kinds(state[1]) == _kinds(nnx.state(opt))   # the step gives the moments back where they were
        results[where] = (jax.device_get(m), state)
    (m_dev, s_dev), (m_host, s_host) = results["device"], results["host"]
    assert_same_metrics(m_dev, m_host)
    assert_same_state(s_dev, s_host)


def _main_signature(text: str) -> tuple[str, str]:
    """(arguments, results) of the lowered module's main function."""
    line = next(ln for ln in text.splitlines() if "func.func public @main" in ln)
    args, _, results = line.partition(") -> (")
    return args, results


def test_cuda_lowering_takes_and_gives_the_moments_in_pinned_host_memory():
    """Lowered for CUDA (no GPU needed), the step's arguments and results in pinned host memory are exactly the
    optimizer's moments (AdamW: two per parameter), and each comes to the device and goes back inside (a chunk at a
    time: tests/train/test_streamed_update.py)."""
    fam = model_family("llama3")
    cfg = fam.config("tiny")
    jitted, _, state = abstract_step(fam, cfg, model_recipe(fam, "full"), training=Training(opt_state="host"))
    text = jitted.trace(state, abstract_batch(2, SEQ)).lower(lowering_platforms=("cuda",)).as_text()
    args, results = _main_signature(text)
    n_params = len(jax.tree.leaves(state[0]))
    moments = sorted(f"{hlo_type(x.shape, x.dtype)}" for x in jax.tree.leaves(state[0])) * 2
    hosted = re.findall(r'(tensor<[^>]*>) \{mhlo\.memory_kind = "pinned_host"', args)
    assert sorted(hosted) == sorted(moments) and len(hosted) == 2 * n_params
    assert len(re.findall(r'mhlo\.memory_kind = "pinned_host"', results)) == 2 * n_params
    assert sum(pinned_host_shapes(text).values()) >= 2 * n_params   # each moment sent back to the host


@pytest.mark.slow
def test_a_run_with_the_state_on_the_host_resumes_exactly(tmp_path):
    """The main job with --opt-state host, stopped after step 2 and resumed, gives the losses of the same run
    uninterrupted bit for bit (the same program): the checkpoint saves the moments from host memory and restores
    them there."""
    kw = dict(steps=4, batch=2, seq=SEQ, log_every=1, lr=1e-2, warmup=0)
    whole = loop.run(loop.RunConfig(opt_state="host", **kw))
    ckpt = str(tmp_path / "ckpt")
    first = loop.run(loop.RunConfig(opt_state="host", ckpt_dir=ckpt, ckpt_every=1, stop_after=2, **kw))
    assert first.stopped == "stop_after" and first.last_checkpoint == 2
    rest = loop.run(loop.RunConfig(opt_state="host", ckpt_dir=ckpt, resume=True, **kw))
    assert rest.steps == [3, 4]
    assert first.losses + rest.losses == whole.losses


# -- the plan ------------------------------------------------------------------------------------------------------
def test_the_plan_counts_a_micro_batch_and_the_state_where_it_lives():
    """grad_accum K plans the activations of batch / K (those of a plan at that batch), the FLOPs of the whole
    batch and float32 gradient sums; opt_state="host" moves the moments from the HBM figures to host memory."""
    import zoo
    fam = model_family("llama3")
    cfg, recipe = fam.config("tiny"), model_recipe(fam, "qkv_offload")
    whole = zoo.plan.plan(cfg, recipe, batch=4, seq=SEQ, peak=None)
    accum = zoo.plan.plan(cfg, recipe, batch=4, seq=SEQ, peak=None, training=Training(grad_accum=2))
    half = zoo.plan.plan(cfg, recipe, batch=2, seq=SEQ, peak=None)
    assert accum.activation_bytes == half.activation_bytes < whole.activation_bytes
    assert accum.host_bytes == half.host_bytes < whole.host_bytes
    assert accum.forward_flops == whole.forward_flops and accum.model_flops == whole.model_flops
    assert whole.state.accum == 0 and accum.state.accum == 4 * whole.state.num_params   # float32 sums
    assert accum.state.total == whole.state.total + accum.state.accum
    hosted = zoo.plan.plan(cfg, recipe, batch=4, seq=SEQ, peak=None, training=Training(opt_state="host"))
    assert hosted.state.optimizer == whole.state.optimizer > 0
    assert hosted.state.total == whole.state.total - whole.state.optimizer
    assert hosted.host_total == whole.host_bytes + whole.state.optimizer
    assert hosted.to_dict()["model_state"]["host"] == whole.state.optimizer
    with pytest.raises(ValueError, match="grad_accum=3 must divide batch=4"):
        zoo.plan.plan(cfg, recipe, batch=4, seq=SEQ, peak=None, training=Training(grad_accum=3))
    with pytest.raises(ValueError, match="opt_state='disk'"):
        zoo.plan.plan(cfg, recipe, batch=4, seq=SEQ, peak=None, training=Training(opt_state="disk"))


def test_a_step_that_does_not_fit_is_told_about_the_host_state_and_accumulation():
    """The refusal lists --grad-accum (micro-batches) and, on a GPU, --opt-state host with the bytes it moves."""
    from recipes.train.step import fit
    with pytest.raises(ValueError, match=r"to fit: --grad-accum 2 \(.*now 2 sequences"):
        loop.run(loop.RunConfig(steps=1, batch=2, seq=SEQ, hbm_limit=0.0017))   # over the state
    state = ModelState(num_params=0, params=0, grads=0, optimizer=2**30, other=0, optimizer_name="adamw")
    tips = fit.advice(Training(grad_accum=2), batch=8, seq=64, recipe="full", state=state, gpu=True)
    assert "--opt-state host (the 1.0 GiB of optimizer state in pinned host memory" in tips
    assert "--grad-accum 4 (" in tips
    assert "--opt-state" not in fit.advice(Training(opt_state="host"), batch=8, seq=64, recipe="full", state=state,
                                           gpu=True)


@pytest.mark.slow   # micro-batches of a MoE model: test_mtp.py's add up to the batch
def test_deepseek_micro_batches_route_and_balance_as_the_whole_batch():
    """DeepSeek-V3 tiny, K=2 against K=1 on batch 4: the next-token loss, the token copies routed and dropped (summed
    over the micro-batches) and the routing biases after the update (moved by the summed expert loads) are the
    whole batch's; only the balance loss, a per-micro-batch statistic, may differ."""
    from zoo.layers.moe import RoutingBias
    fam = model_family("deepseek_v3")
    (s1, m1), (s2, m2) = _one_step(fam, 1), _one_step(fam, 2)
    assert m1["ok"] and m2["ok"] and m1["routed"] > 0
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
    assert (m2["routed"], m2["dropped"]) == (m1["routed"], m1["dropped"])
    graphdef = _graphdef(fam)
    biases = [[np.asarray(v[...]) for _, v in nnx.iter_graph(nnx.merge(graphdef, s)[0]) if isinstance(v, RoutingBias)]
              for s in (s1, s2)]
    assert biases[0] and all(np.array_equal(a, b) for a, b in zip(*biases))
    assert any(np.abs(b).max() > 0 for b in biases[0])


def _graphdef(fam):
    # abstract: only the structure is needed to read a step's state
    return nnx.split(nnx.eval_shape(lambda: _setup(fam)[:2]))[0]


def test_the_training_commands_flags_offer_exactly_the_librarys_places():
    """--opt-state and --params (written out in the settings, which import no JAX) offer zoo.opt_state's places, no
    more and no fewer."""
    from recipes.train.settings.config import RunConfig
    choices = {f.name: f.metadata["choices"] for f in dataclasses.fields(RunConfig) if "choices" in f.metadata}
    assert choices["opt_state"] == OPT_STATE_PLACES and choices["params"] == PARAMS_PLACES
