"""Evaluation flags that cannot work are refused before anything is built, and a --tensorboard directory belongs to
one run: a second live run, or a new run over another run's event files, is refused; a resumed run continues its
own curves."""
import os

import pytest

from recipes.train.settings.config import RunConfig
from recipes.train.watching import watch


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


def points(directory, tag="train/loss", purge=True) -> list[tuple[int, float]]:
    """The (step, value) points of `tag` in the event files of `directory`, read in order; `purge`: as TensorBoard
    applies a purge (a session start at step N drops the points read so far at steps >= N)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.compat.proto.event_pb2 import SessionLog
    out = []
    for name in sorted(f for f in os.listdir(directory) if f.startswith("events.out.tfevents")):
        for event in EventFileLoader(os.path.join(directory, name)).Load():
            if purge and event.HasField("session_log") and event.session_log.status == SessionLog.START:
                out = [p for p in out if p[0] < event.step]
            for value in event.summary.value:
                if value.tag == tag:   # (the loader hands scalars over as tensors)
                    out.append((event.step, value.tensor.float_val[0]))
    return out


@pytest.mark.parametrize("resumed_at", [0, 2])
def test_a_resumed_run_has_one_point_per_step(tmp_path, resumed_at):
    """A run killed after logging steps 1-4, resumed from its checkpoint at `resumed_at` (0: killed before its first
    checkpoint): TensorBoard shows steps 1-6 once each, those past `resumed_at` from the resumed run."""
    pytest.importorskip("tensorboardX")
    pytest.importorskip("tensorboard")
    tb, run = tmp_path / "tb", {"seed": 0}
    killed = watch.Board(str(tb), run=run)
    for step in range(1, 5):
        killed.write({"step": step, "loss": 10.0 + step})
    killed.close()   # (what a killed run leaves: every row is flushed as it is written)
    for name in os.listdir(tb):   # written a second before the resumed run's (whose name would be the same here)
        if name.startswith("events.out.tfevents."):
            stamp, rest = name[len("events.out.tfevents."):].split(".", 1)
            os.rename(tb / name, tb / f"events.out.tfevents.{int(stamp) - 1}.{rest}")
    again = watch.Board(str(tb), run=run, resume=True)
    again.start_at(resumed_at)
    for step in range(resumed_at + 1, 7):
        again.write({"step": step, "loss": 20.0 + step})
    again.close()
    assert len(points(tb, purge=False)) == 4 + 6 - resumed_at   # both runs' points are in the files
    assert points(tb) == [(s, (10.0 if s <= resumed_at else 20.0) + s) for s in range(1, 7)]
