"""Evaluation flags that cannot work are refused before anything is built, and a --tensorboard directory belongs to
one run: a second live run, or a new run over another run's event files, is refused; a resumed run continues its
own curves."""
import os

import pytest

from recipes.train import watch
from recipes.train.config import RunConfig


def test_heldout_needs_eval_every_and_eval_every_needs_a_heldout_share(tmp_path):
    data = str(tmp_path / "ids.bin")
    with pytest.raises(ValueError, match=r"--heldout 0.1 keeps 10% of --data out of training, but nothing evaluates "
                                         r"it without --eval-every: add --eval-every K"):
        RunConfig(data=data, heldout=0.1)
    with pytest.raises(ValueError, match="--eval-every 2 with --heldout 0 has no held-out data to evaluate"):
        RunConfig(data=data, eval_every=2, heldout=0.0)
    with pytest.raises(ValueError, match="--heldout 0.1 is a share of --data, and there is no --data"):
        RunConfig(eval_every=2, heldout=0.1)
    # what works: a share with evaluation, the default share, no share without evaluation
    assert RunConfig(data=data, eval_every=2, heldout=0.1).held_out == 0.1
    assert RunConfig(data=data, eval_every=2).held_out == 0.01
    assert RunConfig(data=data, heldout=0.0).held_out == 0.0


def test_one_run_per_tensorboard_directory(tmp_path):
    pytest.importorskip("tensorboardX")
    tb = tmp_path / "tb"
    run_a, run_b = {"seed": 0}, {"seed": 1}
    first = watch.Board(str(tb), run=run_a)
    with pytest.raises(ValueError, match="is being written by another run .*pid"):
        watch.Board(str(tb), run=run_b)                      # the first is live: refused
    first.write({"step": 1, "loss": 2.0})
    first.close()
    with pytest.raises(ValueError, match="already holds event files .* they are another run's"):
        watch.Board(str(tb), run=run_b)
    with pytest.raises(ValueError, match="already holds event files .* this run is not --resume"):
        watch.Board(str(tb), run=run_a)                      # the same command again, from scratch
    again = watch.Board(str(tb), run=run_a, resume=True)     # its own run, resumed: continues
    again.start_at(1)
    again.write({"step": 2, "loss": 1.0})
    again.close()
    assert sum(f.startswith("events.out.tfevents") for f in os.listdir(tb)) == 2
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "events.out.tfevents.1.host").write_bytes(b"")
    with pytest.raises(ValueError, match="no run of the zoo recorded them"):
        watch.Board(str(foreign), run=run_a, resume=True)
