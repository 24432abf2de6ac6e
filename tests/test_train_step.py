"""`zoo.train_step`: one step of plain SGD moves every parameter by -lr times the gradient of an independent loss
(optax's cross-entropy of the model's logits, differentiated by `jax.grad`), unchunked, with the loss in chunks and
with two micro-batches alike; the functional step (`jit_step`: split, merge inside, donate) gives the numbers of the
in-place step; the NaN guard keeps every state bit for bit; `eval_loss`; the refusals of bad settings; the
micro-batch split. A two-layer Llama (tests/tiny_lm.py), a step or two on the CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests import tiny_lm
from zoo.optim import MasterOptimizer, make_optimizer, make_tx
from zoo.train_step import (
    abstract_batch,
    all_finite,
    check_grad_accum,
    check_loss_chunk,
    eval_loss,
    jit_step,
    micro_batches,
    train_step,
)

LR = 0.5
SCHEDULE = optax.constant_schedule(LR)
EPS = float(jnp.finfo(jnp.float32).eps)


@pytest.fixture(scope="module")
def model():
    """The shared model: tests take copies (`_fresh`), never step it."""
    return tiny_lm.build()


def _fresh(model) -> nnx.Module:
    """A model of its own with `model`'s values (new Variables over copies of the arrays: a donated or updated copy
    leaves `model` as it is)."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.tree.map(jnp.copy, state))


def _reference_loss(params, rest, graphdef, tokens, weights):
    """The weighted mean next-token cross-entropy of the model's logits, by optax (no zoo.loss)."""
    logits = nnx.merge(graphdef, params, rest)(tokens[:, :-1]).astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(nll * weights) / jnp.sum(weights)


@pytest.fixture(scope="module")
def reference(model):
    """(params, loss, gradients) of the batch by `_reference_loss` and `jax.value_and_grad`, float32."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = tiny_lm.batch()
    fn = jax.jit(jax.value_and_grad(_reference_loss), static_argnums=2)
    loss, grads = fn(params, rest, graphdef, batch["tokens"], batch["weights"])
    return params, loss, grads


def _sgd(model):
    return make_optimizer(model, SCHEDULE, clip=1e9, weight_decay=0.0, optimizer="sgd")


def _adamw(model):
    return make_optimizer(model, SCHEDULE, clip=1.0, weight_decay=0.1)


def _bits(tree) -> list[bytes]:
    return [np.asarray(x).tobytes() for x in jax.tree.leaves(tree)]


# -- the numbers ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("grad_accum,loss_chunk", [(1, "auto"), (1, 4), (2, None)],
                         ids=["whole", "loss_chunk_4", "grad_accum_2"])
def test_an_sgd_step_moves_each_parameter_by_lr_times_the_reference_gradient(model, reference, grad_accum,
                                                                            loss_chunk):
    """Plain SGD (no clip, no decay) at rate 0.5, one jitted step on a batch with uneven token weights: every
    parameter moves by -0.5 times its gradient of `_reference_loss` (optax's cross-entropy of the logits,
    `jax.grad`) to float32 rounding (rtol 1e-5 of the move, plus an ulp of the array's scale), and the metrics are
    that loss and that gradient's global norm (rtol 1e-5), with ok/params_ok/kept True, the rate 0.5, no auxiliary
    loss, one step counted. The same with the head and its cross-entropy over chunks of 4 of the 8 positions, and
    with two micro-batches of 2 (each micro-batch's loss its share of the whole batch's weighted mean)."""
    params, loss, grads = reference
    m = _fresh(model)
    step, _, state = jit_step(m, _sgd(m), lambda m, o, b: train_step(m, o, b, lr=SCHEDULE, grad_accum=grad_accum,
                                                                     loss_chunk=loss_chunk))
    new, metrics = step(state, tiny_lm.batch())
    new_params = new[0]
    for (path, p), q, g in zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(new_params),
                               jax.tree.leaves(grads)):
        p, q, g = np.asarray(p), np.asarray(q), np.asarray(g)
        assert np.abs(g).max() > 0, path
        np.testing.assert_allclose(q - p, -LR * g, rtol=1e-5, atol=EPS * np.abs(p).max(), err_msg=str(path))
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["total_loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], optax.global_norm(grads), rtol=1e-5)
    assert metrics["ok"] and metrics["params_ok"] and metrics["kept"]
    assert metrics["lr"] == LR and metrics["aux_loss"] == 0 and metrics["dropped"] == metrics["routed"] == 0
    assert new[1]["step"][...] == 1


def test_the_functional_step_is_the_in_place_step_and_donates_its_state(model):
    """AdamW (clip 1, decay 0.1), two steps: `jit_step`'s (state, batch) -> (state, metrics) gives the model and
    optimizer state (moments and step counts included) and the metrics of `train_step` run in place on NNX objects
    under `nnx.jit`, to float32 rounding, and the state passed in is donated (its arrays deleted)."""
    a = _fresh(model)
    opt_a = _adamw(a)
    in_place = nnx.jit(lambda m, o, b: train_step(m, o, b, lr=SCHEDULE))
    ref = [in_place(a, opt_a, tiny_lm.batch(seed)) for seed in (1, 2)]
    b = _fresh(model)
    step, graphdef, state = jit_step(b, _adamw(b), lambda m, o, b: train_step(m, o, b, lr=SCHEDULE))
    got = []
    for seed in (1, 2):
        old = state
        state, metrics = step(state, tiny_lm.batch(seed))
        assert all(x.is_deleted() for x in jax.tree.leaves(old))
        got.append(metrics)
    for r, g in zip(ref, got):
        assert set(r) == set(g)
        for k in r:
            np.testing.assert_allclose(np.asarray(g[k]), np.asarray(r[k]), rtol=1e-6, err_msg=k)
    want = nnx.state((a, opt_a))
    assert jax.tree.structure(want) == jax.tree.structure(state)
    for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(state)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-6, atol=1e-7)
    assert int(opt_a.step[...]) == 2


def test_accumulated_gradients_reach_a_master_in_float32():
    """bf16 parameters, an optimizer on a float32 master: with grad_accum 2 the transform receives the float32 sums
    of the micro-batches' gradients (unrounded), without accumulation the bf16 parameters' own gradients (a spy on
    the transform's update; traced on shapes alone)."""
    seen = []

    def spy(tx):
        def update(updates, state, params=None):
            seen.append({x.dtype for x in jax.tree.leaves(updates)})
            return tx.update(updates, state, params)
        return optax.GradientTransformation(tx.init, update)

    for k in (2, 1):
        def build_and_step():
            model = tiny_lm.build(tiny_lm.config("bfloat16"))
            opt = MasterOptimizer(model, spy(make_tx(SCHEDULE, master=True)), wrt=nnx.Param)
            return train_step(model, opt, tiny_lm.batch(), lr=SCHEDULE, grad_accum=k)   # noqa: B023 (called here)
        jax.eval_shape(build_and_step)
    assert seen == [{jnp.dtype(jnp.float32)}, {jnp.dtype(jnp.bfloat16)}]


# -- the NaN guard -------------------------------------------------------------------------------------------------
_GUARDED = nnx.jit(lambda m, o, b: train_step(m, o, b, lr=SCHEDULE))
_UNSCHEDULED = nnx.jit(lambda m, o, b: train_step(m, o, b))   # the guard decided after the update


@pytest.mark.parametrize("schedule,cause", [(True, "nan_weights"), (True, "nan_parameter"), (False, "nan_weights"),
                                            pytest.param(False, "nan_parameter", marks=pytest.mark.slow)],
                         ids=["lr-nan_weights", "lr-nan_parameter", "no_lr-nan_weights", "no_lr-nan_parameter"])
def test_a_non_finite_step_leaves_every_state_bit_for_bit(model, cause, schedule):
    """After one good AdamW step (the moments non-zero), a step whose loss is NaN (every token weight NaN, or one
    element of the final norm's scale NaN) reports ok False and leaves the parameters, moments and step counts
    exactly as they were (bit for bit: NaN stays the same NaN). With the schedule the guard is decided before the
    update, without it after, from every updated parameter; either way a NaN weight is no fault of the parameters
    (params_ok and kept True) while a NaN parameter is (both False: the state must not be saved)."""
    step = _GUARDED if schedule else _UNSCHEDULED
    m = _fresh(model)
    opt = _adamw(m)
    first = step(m, opt, tiny_lm.batch(1))
    assert first["ok"]
    batch = tiny_lm.batch(2)
    if cause == "nan_weights":
        batch["weights"] = jnp.full_like(batch["weights"], jnp.nan)
    else:
        m.norm.scale[...] = m.norm.scale[...].at[0].set(jnp.nan)
    before = _bits(nnx.state((m, opt)))
    metrics = step(m, opt, batch)
    assert not metrics["ok"] and not np.isfinite(metrics["loss"])
    assert bool(metrics["params_ok"]) is bool(metrics["kept"]) is (cause == "nan_weights")
    assert _bits(nnx.state((m, opt))) == before
    assert int(opt.step[...]) == 1


# -- evaluation ----------------------------------------------------------------------------------------------------
def test_eval_loss_is_the_reference_loss_and_changes_nothing(model, reference):
    """`eval_loss` is `_reference_loss` (rtol 1e-5), unchunked and in chunks of 2 positions, and leaves the model's
    state as it was; a chunk that does not divide the sequence is refused before anything runs."""
    _, loss, _ = reference
    m = _fresh(model)
    before = _bits(nnx.state(m))
    for chunk in ("auto", 2):
        np.testing.assert_allclose(eval_loss(m, tiny_lm.batch(), loss_chunk=chunk), loss, rtol=1e-5)
    assert _bits(nnx.state(m)) == before
    with pytest.raises(ValueError, match="--loss-chunk 3 does not divide the sequence length 8"):
        eval_loss(m, tiny_lm.batch(), loss_chunk=3)


# -- settings ------------------------------------------------------------------------------------------------------
def test_grad_accum_must_be_a_positive_divisor_of_the_batch():
    """ValueError naming the numbers: 3 does not divide 4; 0, -1, 1.5 and True are not positive integers."""
    check_grad_accum(4, 2)
    check_grad_accum(4, 4)
    with pytest.raises(ValueError, match="--grad-accum 3 must divide --batch 4"):
        check_grad_accum(4, 3)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"--grad-accum must be a positive int, got {bad!r}"):
            check_grad_accum(4, bad)


@pytest.mark.parametrize("bad", [3, 0, -1])
def test_train_step_refuses_a_grad_accum_that_does_not_divide_the_batch(model, bad):
    """As `check_grad_accum` says, before any computation: ValueError naming the numbers."""
    m = _fresh(model)
    with pytest.raises(ValueError, match="--grad-accum"):
        train_step(m, _sgd(m), tiny_lm.batch(), lr=SCHEDULE, grad_accum=bad)


def test_the_loss_chunk_must_divide_the_sequence(model):
    """"auto", None, 0 (unchunked) and divisors pass; 3 of 8 and non-integers are refused with the numbers, by the
    check and by `train_step` before any computation."""
    for ok in ("auto", None, 0, 1, 4, 8):
        check_loss_chunk(8, ok)
    with pytest.raises(ValueError, match="--loss-chunk 3 does not divide the sequence length 8"):
        check_loss_chunk(8, 3)
    for bad in (-2, 2.0, True, "4"):
        with pytest.raises(ValueError, match="--loss-chunk must be a positive int"):
            check_loss_chunk(8, bad)
    m = _fresh(model)
    with pytest.raises(ValueError, match="--loss-chunk 3 does not divide the sequence length 8"):
        train_step(m, _sgd(m), tiny_lm.batch(), lr=SCHEDULE, loss_chunk=3)


def test_micro_batches_interleave_the_rows():
    """[B, ...] -> [k, B/k, ...] with micro-batch i holding rows i, i + k, ...: a device's contiguous block of rows
    then feeds every micro-batch."""
    x = jnp.arange(12).reshape(6, 2)
    got = micro_batches({"x": x, "y": jnp.arange(6)}, 2)
    np.testing.assert_array_equal(got["x"], np.stack([x[0::2], x[1::2]]))
    np.testing.assert_array_equal(got["y"], [[0, 2, 4], [1, 3, 5]])


def test_all_finite_and_the_batch_shapes():
    """`all_finite` reads floating leaves only (an int leaf cannot be NaN) and is True for a tree without any;
    `abstract_batch(B, S)` is tokens [B, S + 1] int32 and weights [B, S] float32."""
    assert all_finite({"a": jnp.ones(3), "n": jnp.arange(3)}) and all_finite({"n": jnp.arange(3)})
    assert not all_finite({"a": jnp.ones(3).at[1].set(jnp.inf), "n": jnp.arange(3)})
    assert not all_finite([jnp.ones(2, jnp.bfloat16).at[0].set(jnp.nan)])
    shapes = abstract_batch(2, 8)
    assert (shapes["tokens"].shape, shapes["tokens"].dtype) == ((2, 9), jnp.int32)
    assert (shapes["weights"].shape, shapes["weights"].dtype) == ((2, 8), jnp.float32)
