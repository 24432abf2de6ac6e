"""`zoo.optim`: the learning-rate schedule against its formula; each optimizer `make_tx` builds against the same
optimizer written out in NumPy (float64) after a global-norm clip; the refusal of an unknown optimizer; moments
held in another dtype (`state_in`); the float32 master copy (`with_master`, `MasterOptimizer`); the transform in
parts (`TxParts`, `tx_parts`, `parts_of`). Small pytrees and one-matrix modules, eager, on the CPU."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from zoo.optim import (
    MASTER,
    OPTIMIZER_NAMES,
    MasterOptimizer,
    MasterState,
    TxParts,
    has_master,
    lr_schedule,
    make_optimizer,
    make_tx,
    parts_of,
    state_in,
    tx_parts,
    with_master,
)

CLIP = 1.0
WD = 0.1


# -- the schedule --------------------------------------------------------------------------------------------------
def test_the_schedule_warms_up_linearly_then_decays_by_a_cosine_to_a_tenth():
    """lr 2, warm-up 2, steps 10: 0 at step 0, lr/2 at step 1, lr at step 2, then lr/10 + (lr - lr/10) (1 + cos(pi
    (t - 2) / 8)) / 2 (the cosine formula, float64) to lr/10 at step 10, and lr/10 at every step after it."""
    lr, warmup, steps = 2.0, 2, 10
    s = lr_schedule(lr=lr, steps=steps, warmup=warmup)

    def want(t):
        if t < warmup:
            return lr * t / warmup
        t = min(t, steps)
        return lr / 10 + (lr - lr / 10) * (1 + math.cos(math.pi * (t - warmup) / (steps - warmup))) / 2

    got = [float(s(t)) for t in range(steps + 5)]
    np.testing.assert_allclose(got, [want(t) for t in range(steps + 5)], rtol=1e-6, atol=1e-7)
    assert got[0] == 0.0 and got[warmup] == lr
    assert all(g == np.float32(lr / 10) for g in got[steps:])


def test_without_warm_up_the_schedule_starts_at_lr():
    s = lr_schedule(lr=0.5, steps=4, warmup=0)
    assert float(s(0)) == 0.5 and float(s(4)) == np.float32(0.05)


# -- the optimizers against NumPy ----------------------------------------------------------------------------------
def _schedule(t):
    """A rate that changes every step (the transforms read it at their own step count)."""
    return 0.1 / (1.0 + t)


def _clip(grads: dict, max_norm: float) -> dict:
    norm = math.sqrt(sum(float(np.sum(g ** 2)) for g in grads.values()))
    return grads if norm < max_norm else {k: g / norm * max_norm for k, g in grads.items()}


def _reference(name: str, params: dict, grads_seq: list[dict]) -> list[dict]:
    """The parameters after each update of optimizer `name` after a global-norm clip to CLIP, in float64 NumPy,
    from the published update rules (AdamW and Adam: b1 0.9, b2 0.95, eps 1e-8, bias-corrected, AdamW's decay
    decoupled and scaled by the rate; Lion: b1 0.9, b2 0.99, sign of the interpolation; momentum: heavy ball 0.9)."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    out = []
    for t, grads in enumerate(grads_seq):
        g = _clip({k: v.astype(np.float64) for k, v in grads.items()}, CLIP)
        lr = _schedule(t)
        for k in p:
            if name in ("adamw", "adam"):
                mu[k] = 0.9 * mu[k] + 0.1 * g[k]
                nu[k] = 0.95 * nu[k] + 0.05 * g[k] ** 2
                u = (mu[k] / (1 - 0.9 ** (t + 1))) / (np.sqrt(nu[k] / (1 - 0.95 ** (t + 1))) + 1e-8)
                if name == "adamw":
                    u = u + WD * p[k]
            elif name == "lion":
                u = np.sign(0.1 * g[k] + 0.9 * mu[k]) + WD * p[k]
                mu[k] = 0.99 * mu[k] + 0.01 * g[k]
            elif name == "momentum":
                mu[k] = g[k] + 0.9 * mu[k]
                u = mu[k]
            else:
                u = g[k]
            p[k] = p[k] - lr * u
        out.append(dict(p))
    return out


def _tree_and_grads(steps: int = 3):
    """A two-leaf float32 pytree and `steps` gradients: the first two with global norm above CLIP (clipped), the
    last below it (passed as they are)."""
    rng = np.random.default_rng(0)
    params = {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5).astype(np.float32)}
    grads = []
    for scale in (3.0, 2.0, 0.05)[:steps]:
        g = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()}
        norm = math.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in g.values()))
        grads.append({k: (x * scale / norm).astype(np.float32) for k, x in g.items()})
    return params, grads


def _run(tx, params: dict, grads_seq: list[dict]) -> tuple[list[dict], object]:
    p = jax.tree.map(jnp.asarray, params)
    state = tx.init(p)
    out = []
    for g in grads_seq:
        updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, p)
        p = optax.apply_updates(p, updates)
        out.append(p)
    return out, state


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_each_optimizer_is_its_update_rule_after_the_clip(name):
    """`make_tx(schedule, optimizer=name, clip=1, weight_decay=0.1)`, three updates of a small float32 pytree (two
    with gradients whose global norm the clip scales down to 1, one below it): the parameters after each update are
    the NumPy float64 reference's (`_reference`: the clip, then the optimizer's published rule with b1 0.9 and
    b2 0.95 for AdamW/Adam) within float32 rounding."""
    params, grads = _tree_and_grads()
    got, _ = _run(make_tx(_schedule, optimizer=name, clip=CLIP, weight_decay=WD), params, grads)
    for t, (g, want) in enumerate(zip(got, _reference(name, params, grads))):
        for k in params:
            np.testing.assert_allclose(np.asarray(g[k]), want[k], rtol=2e-5, atol=2e-6, err_msg=f"{name} {k} {t}")
    assert not np.allclose(np.asarray(got[-1]["a"]), params["a"])   # the updates moved the parameters


def test_an_unknown_optimizer_is_refused_naming_the_choices():
    """ValueError naming the bad name and every choice, from `make_tx`, `tx_parts` and `make_optimizer` alike."""
    msg = "optimizer='rmsprop': choose one of adamw, adam, lion, momentum, sgd"
    with pytest.raises(ValueError, match=msg):
        make_tx(_schedule, optimizer="rmsprop")
    with pytest.raises(ValueError, match=msg):
        tx_parts(_schedule, optimizer="rmsprop")
    with pytest.raises(ValueError, match=msg):
        make_optimizer(_Matrix(jnp.float32), _schedule, clip=1.0, weight_decay=0.0, optimizer="rmsprop")


# -- moments in another dtype --------------------------------------------------------------------------------------
@pytest.mark.parametrize("state_dtype,param_dtype", [("bfloat16", jnp.float32), ("float32", jnp.bfloat16)])
def test_state_in_holds_the_moments_in_its_dtype_across_updates(state_dtype, param_dtype):
    """`state_in(adam, dtype)`: the moments are `dtype` after init and after each of three updates, whatever the
    parameters' dtype (bf16 moments of float32 parameters, float32 moments of bf16 ones); the step count stays
    int32; the parameters keep their dtype and follow the update with float32 moments within bf16 rounding."""
    params, grads = _tree_and_grads()
    params = {k: v.astype(param_dtype) for k, v in params.items()}
    grads = [{k: v.astype(param_dtype) for k, v in g.items()} for g in grads]
    adam = make_tx(_schedule, optimizer="adam", clip=CLIP)
    got, state = _run(state_in(adam, state_dtype), params, grads)
    dtypes = {x.dtype for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert dtypes == {jnp.dtype(state_dtype)}
    assert {x.dtype for x in jax.tree.leaves(state) if not jnp.issubdtype(x.dtype, jnp.floating)} == {np.dtype("int32")}
    assert {x.dtype for x in jax.tree.leaves(got[-1])} == {jnp.dtype(param_dtype)}
    want, _ = _run(state_in(adam, "float32"), {k: v.astype(np.float32) for k, v in params.items()},
                   [{k: v.astype(np.float32) for k, v in g.items()} for g in grads])
    for k in params:
        np.testing.assert_allclose(np.asarray(got[-1][k], np.float32), np.asarray(want[-1][k]), rtol=2e-2, atol=2e-2)


# -- the float32 master --------------------------------------------------------------------------------------------
class _Matrix(nnx.Module):
    """One [4, 3] parameter, all ones."""

    def __init__(self, dtype):
        self.w = nnx.Param(jnp.ones((4, 3), dtype))


def _f32(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def test_updates_too_small_for_bf16_add_up_in_the_master_and_the_parameters_are_its_rounding():
    """SGD at rate 1e-3 on gradients of 1, ten updates of a bf16 parameter at 1.0: each -1e-3 is below half a bf16
    ulp under 1.0 (2**-9), so without a master the parameter never moves; with one (`make_optimizer(master=True)`:
    a `MasterOptimizer`) the float32 master reaches 1 - 10 * 1e-3 (float32 rounding) and after every update the
    parameter is the master cast to bf16, bit for bit."""
    results = {}
    for master in (False, True):
        model = _Matrix(jnp.bfloat16)
        opt = make_optimizer(model, optax.constant_schedule(1e-3), clip=1e9, weight_decay=0.0, optimizer="sgd",
                             master=master)
        assert has_master(opt) is master and isinstance(opt, MasterOptimizer) is master
        for _ in range(10):
            opt.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
            if master:
                m = opt.opt_state.master["w"][...]
                assert m.dtype == jnp.float32 and model.w[...].dtype == jnp.bfloat16
                assert np.array_equal(_f32(model.w[...]), _f32(m.astype(jnp.bfloat16)))
        results[master] = (model, opt)
    assert np.array_equal(_f32(results[False][0].w[...]), np.ones((4, 3)))
    model, opt = results[True]
    assert isinstance(opt.opt_state, MasterState) and MASTER == "master"
    np.testing.assert_allclose(np.asarray(opt.opt_state.master["w"][...]), 1 - 10 * 1e-3, rtol=1e-6)
    assert (_f32(model.w[...]) < 1).all()


def test_the_parameters_are_the_master_rounded_after_every_update():
    """Clipped AdamW on a float32 master (`make_optimizer(master=True)`), five updates with random bf16 gradients
    under `nnx.jit`: the master stays float32 and the bf16 parameter equals the master cast to bf16 bit for bit
    after each (not bf16 p + u, rounded twice)."""
    model = _Matrix(jnp.bfloat16)
    opt = make_optimizer(model, optax.constant_schedule(3e-2), clip=1.0, weight_decay=0.1, master=True)
    update = nnx.jit(lambda m, o, g: o.update(m, g))
    for i in range(5):
        key = jax.random.key(i)
        update(model, opt, jax.tree.map(lambda p, k=key: jax.random.normal(k, p.shape, jnp.bfloat16),
                                        nnx.state(model, nnx.Param)))
        master = opt.opt_state.master["w"][...]
        assert master.dtype == jnp.float32 and model.w[...].dtype == jnp.bfloat16
        assert np.array_equal(_f32(model.w[...]), _f32(master.astype(jnp.bfloat16)))
    assert not np.array_equal(_f32(model.w[...]), np.ones((4, 3)))   # the updates moved it


def test_with_master_updates_against_the_master_and_returns_the_float32_step_to_it():
    """`with_master(adamw)` in a plain optax loop over a bf16 parameter: the master is float32 and equals, after each
    of three updates, the same AdamW run on float32 parameters started at the bf16 values (weight decay reads the
    master, not the rounded parameter); the update it returns is float32 `new master - params`."""
    params, grads = _tree_and_grads()
    bf16 = {k: jnp.asarray(v, jnp.bfloat16) for k, v in params.items()}
    tx = with_master(make_tx(_schedule, optimizer="adamw", clip=CLIP, weight_decay=WD))
    state = tx.init(bf16)
    p = bf16
    ref, _ = _run(make_tx(_schedule, optimizer="adamw", clip=CLIP, weight_decay=WD),
                  {k: _f32(v) for k, v in bf16.items()}, grads)
    for g, want in zip(grads, ref):
        updates, state = tx.update({k: jnp.asarray(v, jnp.bfloat16) for k, v in g.items()}, state, p)
        for k in p:
            assert updates[k].dtype == jnp.float32 and state.master[k].dtype == jnp.float32
            np.testing.assert_array_equal(np.asarray(updates[k]), np.asarray(state.master[k] - _f32(p[k])))
        p = {k: state.master[k].astype(jnp.bfloat16) for k in p}
        # the gradients differ by their bf16 rounding only: the masters follow the float32 run to bf16 precision
        for k in p:
            np.testing.assert_allclose(np.asarray(state.master[k]), np.asarray(want[k]), rtol=1e-2, atol=1e-2)


# -- the transform in parts ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("master", [False, True], ids=["plain", "master"])
def test_the_parts_make_the_transform(master):
    """`tx_parts(...).transform()` is `make_tx(...)` with the same arguments: the same state structure and, over
    three updates, the same parameters bit for bit (the same ops). `states(opt_state)` finds the master (None
    without one) and the elementwise transform's state: the state after the clip's (empty) one."""
    params, grads = _tree_and_grads()
    kw = dict(optimizer="adamw", clip=CLIP, weight_decay=WD, opt_dtype="bfloat16", master=master)
    parts = tx_parts(_schedule, **kw)
    assert isinstance(parts, TxParts) and parts.clip == CLIP and parts.master is master
    dtype = jnp.bfloat16 if master else jnp.float32
    params = {k: v.astype(dtype) for k, v in params.items()}
    got, state = _run(parts.transform(), params, grads)
    want, want_state = _run(make_tx(_schedule, **kw), params, grads)
    assert jax.tree.structure(state) == jax.tree.structure(want_state)
    for a, b in zip(jax.tree.leaves((got, state)), jax.tree.leaves((want, want_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    masters, inner = parts.states(state)
    if master:
        assert masters is state.master and inner is state.inner[1]
    else:
        assert masters is None and inner is state[1]
    assert (state.inner if master else state)[0] == ()   # the clip keeps no state
    # the elementwise part alone is the optimizer: its state is the moments (bf16) and a step count
    assert {x.dtype for x in jax.tree.leaves(inner) if x.ndim} == {jnp.dtype(jnp.bfloat16)}


def test_parts_of_reads_what_make_optimizer_made():
    """`make_optimizer` attaches its transform's parts (the clip, the master flag, the elementwise transform of the
    same optimizer); a plain `nnx.Optimizer` has none: `parts_of` is None."""
    model = _Matrix(jnp.float32)
    opt = make_optimizer(model, _schedule, clip=0.5, weight_decay=WD, optimizer="lion")
    parts = parts_of(opt)
    assert isinstance(parts, TxParts) and parts.clip == 0.5 and parts.master is False
    g = {"w": jnp.full((4, 3), 0.3)}
    want, _ = optax.lion(_schedule, weight_decay=WD).update(g, optax.lion(_schedule).init(g), g)
    got, _ = parts.elementwise.update(g, parts.elementwise.init(g), g)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
    plain = nnx.Optimizer(model, make_tx(_schedule), wrt=nnx.Param)
    assert parts_of(plain) is None and not has_master(plain)


def test_a_warm_up_as_long_as_the_schedule_runs_its_course_then_drops_to_a_tenth():
    """`warmup >= steps`: 0, lr/4, lr/2, 3lr/4, lr over the warm-up of 4, then lr/10 (as the docstring says)."""
    sched = lr_schedule(lr=1.0, steps=2, warmup=4)
    np.testing.assert_allclose([float(sched(i)) for i in range(7)], [0, .25, .5, .75, 1.0, .1, .1], rtol=1e-6)
