"""The non-finite guard: a step that would make the parameters non-finite is not applied (decided before the update
from the loss, the gradient norm and the learning rate), one that overflows anyway is never saved, no checkpoint
holds non-finite values, and the optimizer flags it relies on are validated."""
from __future__ import annotations

import os

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from recipes.train import loop
from recipes.train.checkpoints import guard
from recipes.train.checkpoints.checkpoint import Checkpoints
from recipes.train.step import prepare
from tests.train.cli_runs import RUN, main


@pytest.mark.parametrize("flag,value", [("lr", float("nan")), ("lr", float("inf")), ("lr", 0.0), ("clip", -1.0),
                                        ("clip", 0.0), ("weight_decay", -0.1), ("weight_decay", float("nan")),
                                        ("warmup", -1), ("warmup", 60)])
def test_optimizer_flags_are_validated(flag, value):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be"):
        loop.RunConfig(**{flag: value})


def test_the_nan_guard_checks_the_updated_parameters(tiny_model, tmp_path, capsys, monkeypatch):
    """From step 4 the learning rate is NaN while the loss and gradient stay finite: the guard sees the updated
    parameters, does not apply the step, says why, and the last good checkpoint (step 3) is written and finite.
    Then a checkpoint of non-finite values is refused outright."""
    monkeypatch.setattr(prepare, "lr_schedule", lambda **kw: (lambda count: jnp.where(count < 3, 1e-3, jnp.nan)))
    ckpt = tmp_path / "run"
    result = loop.run(loop.RunConfig(steps=6, batch=2, seq=16, overrides=(("num_layers", 1),), ckpt_dir=str(ckpt),
                                     ckpt_every=2))
    out = capsys.readouterr().out
    assert result.stopped == "nonfinite" and result.steps == [1, 2, 3], out
    assert "step 4: the learning rate (nan) is not finite (the loss" in out and "check --lr" in out
    assert "the update was not applied" in out
    assert "The last good checkpoint is step 3" in out and Checkpoints(ckpt).steps() == [2, 3]
    assert not guard.nonfinite_leaves(nnx.state(result.model))      # the state after step 3, as returned

    model = nnx.clone(tiny_model)
    model.norm.scale[...] = model.norm.scale[...].at[0].set(jnp.nan)
    ckpts = Checkpoints(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="refusing to write checkpoint step 1 .* non-finite .*norm"):
        ckpts.save(1, model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param), {})
    assert ckpts.steps() == [] and os.listdir(tmp_path / "ckpt") == []
    # --lr nan on the command line: refused before anything is built.
    rc, out, err = main(RUN + ["--lr", "nan"], capsys)
    assert rc == 2 and "--lr must be a finite number > 0, got nan" in err and "compiled" not in out


@pytest.mark.slow
def test_an_update_that_overflows_past_the_guard_is_never_saved(tmp_path, capsys, monkeypatch):
    """The guard is decided before the update (finite loss, gradient norm and learning rate); an update that still
    makes parameters non-finite (here an optimizer that multiplies its updates by infinity from step 4) has been
    applied in place: the run says so, stops, and does not save that state (the last checkpoint is step 2)."""
    from zoo import optim
    make_tx = optim.make_tx
    blow_up = optax.scale_by_schedule(lambda count: jnp.where(count < 3, 1.0, jnp.inf))
    monkeypatch.setattr(optim, "make_tx", lambda *a, **kw: optax.chain(make_tx(*a, **kw), blow_up))
    ckpt = tmp_path / "run"
    result = loop.run(loop.RunConfig(steps=6, batch=2, seq=16, overrides=(("num_layers", 1),), ckpt_dir=str(ckpt),
                                     ckpt_every=2))
    out = capsys.readouterr().out
    assert result.stopped == "nonfinite" and result.steps == [1, 2, 3], out
    assert "step 4: the update made parameters non-finite (the loss" in out
    assert "the update was applied (an overflow the guard cannot foresee) and is not saved" in out
    assert "The last good checkpoint is step 2" in out and Checkpoints(ckpt).steps() == [2]
