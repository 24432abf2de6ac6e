"""`zoo.streamed_update`: the chunking rule; `update` with the optimizer state in pinned host memory gives the numbers
of `optimizer.update` with it in HBM (to a few ulp at each array's scale: tests/rounding.py says why not bit
for bit), keeps the host state on the host, and keeps the parameters and their state exactly where `ok` is False;
`hosted` and `unguarded`; the refusals. A two-layer Llama (tests/tiny_lm.py) on a one-CPU-device mesh: the CPU has
the pinned_host memory kind."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests import tiny_lm
from tests.rounding import assert_same_state
from zoo import sharding
from zoo import streamed_update as su
from zoo.opt_state import HOST, is_master, state_shardings
from zoo.optim import make_optimizer, make_tx
from zoo.train_step import jit_step, train_step

SCHEDULE = optax.constant_schedule(3e-2)


# -- the chunking rule ---------------------------------------------------------------------------------------------
def _param(shape, names, dtype=jnp.float32):
    return nnx.eval_shape(lambda: nnx.Param(jnp.zeros(shape, dtype), out_sharding=names, eager_sharding=False))


def test_a_stacked_parameter_is_streamed_one_layer_per_chunk(monkeypatch):
    """Leading logical axis `layers`: (axis 0, one chunk per layer), whatever its size or CHUNK_BYTES."""
    assert su.chunking(_param((2, 4), ("layers", "embed")), 4) == (0, 2)
    assert su.chunking(_param((32, 4096, 14336), ("layers", "embed", "mlp")), 4) == (0, 32)
    monkeypatch.setattr(su, "CHUNK_BYTES", 1)
    assert su.chunking(_param((3, 64, 64), ("layers", "embed", "mlp")), 4) == (0, 3)


def test_an_unstacked_parameter_takes_the_fewest_chunks_of_at_most_chunk_bytes(monkeypatch):
    """With CHUNK_BYTES 1 KiB: [64, 16] at 4 bytes (4 KiB) in 4 chunks of rows, at 2 bytes in 2, at 1 byte whole;
    [6, 16] at 4 bytes (384 B) with CHUNK_BYTES 100 in 6 (4 does not divide 6), [7, 16] in 7 (7 is prime); a
    small [8, 4] and any 1-d parameter whole: (0, 1)."""
    monkeypatch.setattr(su, "CHUNK_BYTES", 1024)
    assert su.chunking(_param((64, 16), ("vocab", "embed")), 4) == (0, 4)
    assert su.chunking(_param((64, 16), ("vocab", "embed")), 2) == (0, 2)
    assert su.chunking(_param((64, 16), ("vocab", "embed")), 1) == (0, 1)
    assert su.chunking(_param((8, 4), ("embed", "mlp")), 4) == (0, 1)
    assert su.chunking(_param((4096,), ("embed",)), 4) == (0, 1)
    monkeypatch.setattr(su, "CHUNK_BYTES", 100)
    assert su.chunking(_param((6, 16), ("vocab", "embed")), 4) == (0, 6)
    assert su.chunking(_param((7, 16), ("vocab", "embed")), 4) == (0, 7)


def test_chunks_run_along_an_axis_the_sharding_leaves_whole(monkeypatch):
    """Under tp=2 (an abstract mesh: no devices) the vocabulary axis is split: [64, 16] ("vocab", "embed") is cut
    along its embed axis instead (4 chunks of 1 KiB); with both axes split (fsdp=2 x tp=2 splits embed too) it is
    updated whole."""
    monkeypatch.setattr(su, "CHUNK_BYTES", 1024)
    with sharding.use(sharding.abstract_mesh("tp=2", 2)):
        assert su.chunking(_param((64, 16), ("vocab", "embed")), 4) == (1, 4)
    with sharding.use(sharding.abstract_mesh("fsdp=2,tp=2", 4)):
        assert su.chunking(_param((64, 16), ("vocab", "embed")), 4) == (0, 1)


# -- the update ----------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Case:
    opt_state: str            # where the moments live: "host" or "device"
    params: str               # where the float32 master lives ("host": bf16 parameters with a master)
    chunk_bytes: int | None   # CHUNK_BYTES: 512 cuts the [32, 16] embedding and [16, 32] head into 4 chunks

    def __str__(self):
        return f"opt_state_{self.opt_state}-params_{self.params}" + (f"-chunks_{self.chunk_bytes}B" *
                                                                     bool(self.chunk_bytes))


CASES = [Case("host", "device", 512), Case("host", "host", None), Case("device", "host", 512)]


def _make(case: Case):
    """The case's (model, optimizer) maker: AdamW (clip 1, decay 0.1), with bf16 parameters and a float32 master
    when the case puts the master on the host."""
    master = case.params == "host"
    cfg = tiny_lm.config("bfloat16" if master else "float32")

    def make():
        model = tiny_lm.build(cfg)
        return model, make_optimizer(model, SCHEDULE, clip=1.0, weight_decay=0.1, master=master)
    return make


def _build(case: Case, where: str):
    """The case's (model, optimizer), its state placed by `state_shardings` on a one-device mesh: the case's
    placement with `where="host"`, everything in HBM with "device"."""
    opt_state, params = (case.opt_state, case.params) if where == "host" else ("device", "device")
    return sharding.init(_make(case), sharding.make_mesh(None, jax.devices()[:1]),
                         place=lambda s, out: state_shardings(s, out, opt_state=opt_state, params=params))


def _updater(model, optimizer, streamed: bool):
    """(jitted (state, grads, ok) -> state, state): `su.update` (streamed) or `optimizer.update` (in HBM) on the
    merged objects, the state donated and laid out as before (host leaves stay host leaves)."""
    graphdef, state = nnx.split((model, optimizer))

    def update(state, grads, ok):
        model, optimizer = nnx.merge(graphdef, state)
        if streamed:
            su.update(model, optimizer, grads, ok=ok)
        else:
            optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    shardings = jax.tree.map(lambda x: x.sharding, state)
    return jax.jit(update, donate_argnums=0, out_shardings=shardings), graphdef, state


def _grads(model, seed: int):
    """Gradients like the parameters (their dtype), NumPy's normal draws: large enough that the clip scales them."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), nnx.state(model, nnx.Param))


def _host_kinds(state) -> dict[str, set]:
    """{"master" / "moment" / "rest": memory kinds of those leaves} of a (model, optimizer) state."""
    out = {"master": set(), "moment": set(), "rest": set()}
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        kind = ("master" if is_master(path) else "moment" if path[0].key == 1 and x.ndim and
                jnp.issubdtype(x.dtype, jnp.floating) else "rest")
        out[kind].add(x.sharding.memory_kind)
    return out


def _numpy(state) -> list[np.ndarray]:
    return [np.array(x) for x in jax.tree.leaves(state)]   # copies: the state is donated next


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_streamed_update_is_the_update_in_hbm(case, monkeypatch):
    """Two updates with random gradients: with the moments and/or the master in pinned host memory, `su.update`
    gives the parameters, moments, master and step counts of `optimizer.update` with the same state in HBM (step
    counts exactly, float arrays to a few ulp at their scale: `tests.rounding`), and the host leaves are
    pinned-host arrays afterwards (the rest device arrays). A third update with `ok` False leaves the parameters,
    moments and master bit for bit and advances the step counts (unguarded: the caller's guard selects them)."""
    if case.chunk_bytes:
        monkeypatch.setattr(su, "CHUNK_BYTES", case.chunk_bytes)
    results = {}
    for where in ("device", "host"):
        model, opt = _build(case, where)
        assert su.hosted(opt) is (where == "host")
        fn, graphdef, state = _updater(model, opt, streamed=where == "host")
        initial = _numpy(state)
        for seed in (1, 2):
            state = fn(state, _grads(model, seed), jnp.bool_(True))
        results[where] = (initial, _numpy(state), state, fn, graphdef)
    (initial, ref, *_), (_, got, state, fn, graphdef) = results["device"], results["host"]
    assert_same_state(ref, got)
    assert any(not np.array_equal(a, b) for a, b in zip(initial, got))   # the updates moved the state
    kinds = _host_kinds(state)
    if case.params == "host":
        assert kinds["master"] == {HOST if case.params == "host" else "device"}
    assert kinds["moment"] == {HOST if case.opt_state == "host" else "device"} and kinds["rest"] == {"device"}

    model, opt = nnx.merge(graphdef, state)
    unguarded = nnx.state((model, opt), su.unguarded(model, opt))
    counters = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(unguarded)[0]}
    refused = fn(state, _grads(model, 3), jnp.bool_(False))
    flat, new = jax.tree_util.tree_flatten_with_path(refused)[0], _numpy(refused)
    for (path, _), a, b in zip(flat, got, new):
        if jax.tree_util.keystr(path) in counters:
            assert b == a + 1, jax.tree_util.keystr(path)
        else:
            assert a.tobytes() == b.tobytes(), jax.tree_util.keystr(path)
    assert _host_kinds(refused) == kinds


def test_unguarded_is_the_step_counts(monkeypatch):
    """`unguarded(model, optimizer)` selects exactly the state `update` leaves to the caller's guard: AdamW's two
    step counts and the optimizer's step, never a parameter, moment or master."""
    model, opt = nnx.eval_shape(_make(Case("host", "host", None)))
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state((model, opt), su.unguarded(model, opt)))[0]
    assert sorted(jax.tree_util.keystr(p) for p, _ in leaves) == [
        "[1]['opt_state']['inner'][1][0]['count'].value", "[1]['opt_state']['inner'][1][2]['count'].value",
        "[1]['step'].value"]
    assert all(x.ndim == 0 and not jnp.issubdtype(x.dtype, jnp.floating) for _, x in leaves)


# -- refusals ------------------------------------------------------------------------------------------------------
def test_host_state_without_the_schedule_or_a_zoo_optimizer_is_refused():
    """With the moments in pinned host memory, tracing `train_step` without the learning-rate schedule is refused
    (ValueError: the guard must be decided before the update), and so is an optimizer `make_optimizer` did not make
    (no transform's parts), by `train_step` under trace and by `update` and `unguarded` at once."""
    model, opt = _build(Case("host", "device", None), "host")
    batch = tiny_lm.batch()
    no_lr, _, state = jit_step(model, opt, lambda m, o, b: train_step(m, o, b), keep_shardings=True)
    with pytest.raises(ValueError, match="train_step needs the learning-rate schedule"):
        no_lr.trace(state, batch)
    del opt.tx_parts
    plain, _, state = jit_step(model, opt, lambda m, o, b: train_step(m, o, b, lr=SCHEDULE), keep_shardings=True)
    with pytest.raises(ValueError, match="needs an optimizer made by zoo.optim.make_optimizer"):
        plain.trace(state, batch)
    bare = nnx.Optimizer(model, make_tx(SCHEDULE), wrt=nnx.Param)
    with pytest.raises(ValueError, match="needs an optimizer made by zoo.optim.make_optimizer"):
        su.update(model, bare, _grads(model, 0), ok=jnp.bool_(True))
    with pytest.raises(ValueError, match="needs an optimizer made by zoo.optim.make_optimizer"):
        su.unguarded(model, bare)
