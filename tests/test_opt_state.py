"""`zoo.opt_state`: where the optimizer's moments and the float32 master copy live between steps. On the abstract
state of a two-layer Llama with bf16 parameters and clipped AdamW on a float32 master (tests/tiny_lm.py, shapes
only: nothing compiled), with the rules' shardings on a one-CPU-device mesh: each of the four placements moves
exactly the moments and/or the master to pinned host memory and changes nothing else; the refusals name the flag,
the value and the choices; `is_master` finds the master's paths."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.tree_util import DictKey, SequenceKey

from tests import tiny_lm
from zoo import sharding
from zoo.opt_state import (
    HOST,
    OPT_STATE_PLACES,
    PARAMS_PLACES,
    check_params,
    check_places,
    is_master,
    on_host,
    state_shardings,
)
from zoo.optim import make_optimizer


def _abstract(master: bool = True):
    """The abstract state of `nnx.split((model, optimizer))`: bf16 parameters, AdamW (two moments and two step
    counts), with a float32 master if `master`."""
    def build():
        model = tiny_lm.build(tiny_lm.config("bfloat16"))
        return model, make_optimizer(model, optax.constant_schedule(1e-3), clip=1.0, weight_decay=0.1,
                                     master=master)
    return nnx.split(nnx.eval_shape(build))[1]


def _kind(path, x) -> str:
    """What a leaf of the state is, read off its path as `nnx.split((model, optimizer))` lays it out (written out
    here, not by `zoo.opt_state`): a parameter (the model's side, [0]), the master (the optimizer's
    ["opt_state"]["master"]), a moment (another floating array of the optimizer) or a counter (its scalars)."""
    keys = [getattr(k, "key", None) for k in path]
    if keys[0] == 0:
        return "param"
    if keys[1:3] == ["opt_state", "master"]:
        return "master"
    return "moment" if x.ndim and jnp.issubdtype(x.dtype, jnp.floating) else "counter"


@pytest.fixture(scope="module")
def placed():
    """(abstract state, its leaves with paths, the rules' shardings on a one-device mesh)."""
    state = _abstract()
    mesh = sharding.make_mesh(None, jax.devices()[:1])
    return state, jax.tree_util.tree_flatten_with_path(state)[0], sharding.shardings(state, mesh)


def test_the_state_is_what_the_placements_sort(placed):
    """The state the placements act on: per parameter one bf16 parameter, one float32 master and two float32
    moments; the counters are AdamW's two step counts and the optimizer's step."""
    _, flat, _ = placed
    kinds = [_kind(p, x) for p, x in flat]
    n = kinds.count("param")
    assert n > 0 and kinds.count("master") == n and kinds.count("moment") == 2 * n and kinds.count("counter") == 3
    assert {x.dtype for (p, x), k in zip(flat, kinds) if k == "param"} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for (p, x), k in zip(flat, kinds) if k in ("master", "moment")} == {jnp.dtype(jnp.float32)}
    assert all(x.ndim == 0 for (p, x), k in zip(flat, kinds) if k == "counter")


@pytest.mark.parametrize("params", PARAMS_PLACES)
@pytest.mark.parametrize("opt_state", OPT_STATE_PLACES)
def test_the_moments_and_the_master_move_to_pinned_host_memory_independently(placed, opt_state, params):
    """`state_shardings(..., opt_state=, params=)`: the moments are in pinned host memory exactly when opt_state is
    "host", the master exactly when params is "host" or "stream"; the bf16 parameters stay in device memory but
    for the stacks' under "stream", and the step counters whatever both say; every sharding keeps its mesh and spec
    (only the memory kind changes), and "device" for both is the shardings unchanged."""
    state, flat, shardings = placed
    out = state_shardings(state, shardings, opt_state=opt_state, params=params)
    assert jax.tree.structure(out) == jax.tree.structure(shardings)
    want = {"param": "device", "counter": "device", "moment": opt_state,
            "master": "device" if params == "device" else "host"}
    for (path, x), before, after in zip(flat, jax.tree.leaves(shardings), jax.tree.leaves(out)):
        kind = _kind(path, x)
        stacked = kind == "param" and params == "stream" and "['layers']['layers']" in jax.tree_util.keystr(path)
        where = "host" if stacked else want[kind]
        assert after.memory_kind == (HOST if where == "host" else "device"), (jax.tree_util.keystr(path), kind)
        assert on_host(after) is (where == "host")
        assert after.mesh == before.mesh and after.spec == before.spec
    if opt_state == params == "device":
        assert out is shardings


def test_the_master_on_the_host_needs_a_master(placed):
    """`params="host"` for an optimizer without a master copy: ValueError saying what keeps one; the moments alone
    may still go to the host."""
    plain = _abstract(master=False)
    shardings = sharding.shardings(plain, sharding.make_mesh(None, jax.devices()[:1]))
    with pytest.raises(ValueError, match=r"--params host .* this optimizer keeps none .*master=True"):
        state_shardings(plain, shardings, params="host")
    out = state_shardings(plain, shardings, opt_state="host")
    assert any(on_host(s) for s in jax.tree.leaves(out))


def test_places_are_checked_naming_the_flag_the_value_and_the_choices(placed):
    state, _, shardings = placed
    check_places(opt_state="host", params="host")
    with pytest.raises(ValueError, match="--opt-state must be one of device, host, got 'disk'"):
        check_places(opt_state="disk")
    with pytest.raises(ValueError, match="--params must be one of device, host, stream, got 'hbm'"):
        check_places(params="hbm")
    with pytest.raises(ValueError, match="--opt-state must be one of device, host, got 'cpu'"):
        state_shardings(state, shardings, opt_state="cpu")



def test_the_master_on_the_host_needs_16_bit_parameters():
    """`check_params`: "host" with float32 parameters has no separate master (ValueError naming param_dtype and the
    fix); with bf16 parameters, or "device" with any, it passes; a bad place is refused as by `check_places`."""
    check_params("host", "bfloat16")
    check_params("device", "float32")
    with pytest.raises(ValueError, match=r"param_dtype=float32\): there is no separate master"):
        check_params("host", "float32")
    with pytest.raises(ValueError, match="--params must be one of device, host, stream, got 'disk'"):
        check_params("disk", "bfloat16")


def test_is_master_finds_the_master_paths(placed):
    """True exactly on the paths under the optimizer's ["opt_state"]["master"] (as `_kind` reads them), one per
    parameter; False for the same keys on the model's side, for a shorter path and for positional keys."""
    _, flat, _ = placed
    assert [is_master(p) for p, _ in flat] == [_kind(p, x) == "master" for p, x in flat]
    assert sum(is_master(p) for p, _ in flat) == sum(_kind(p, x) == "param" for p, x in flat)
    assert is_master((DictKey(1), DictKey("opt_state"), DictKey("master"), DictKey("w")))
    assert not is_master((DictKey(0), DictKey("opt_state"), DictKey("master"), DictKey("w")))
    assert not is_master((DictKey(1), DictKey("opt_state")))
    assert not is_master((SequenceKey(1), DictKey("opt_state"), DictKey("master")))
