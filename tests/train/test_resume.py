"""Resuming: from the newest intact checkpoint when the latest is damaged (kept aside, not deleted): each step's
manifest of checksums finds bytes flipped, a state copied from another step, a file or folder deleted, before
orbax reads anything; nothing renamed when no checkpoint restores; the metrics file continued (and another run's
never truncated); past the planned steps only with the schedule kept (--schedule-steps). Each recovered run is
compared with the uninterrupted one (the `base` fixture, tests/train/conftest.py)."""
from __future__ import annotations

import json
import os
import shutil
import types

import optax
import pytest
from flax import nnx

from recipes.train import loop
from recipes.train.checkpoints import resume
from recipes.train.checkpoints.checkpoint import Checkpoints
from recipes.train.settings.job import Cadence, Data, Storage
from tests.helpers import tiered
from tests.train.cli_runs import RUN, cli, copy_ckpt, main, rows


def biggest_file(folder):
    return max((f for f in folder.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def flip_bytes(file) -> None:
    """Some bytes in the middle of `file` inverted, its size kept."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2:len(data) // 2 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 2:len(data) // 2 + 8])
    file.write_bytes(bytes(data))


def damage(ckpt, how: str, step: int = 6) -> str:
    """Damage checkpoint `step` in `ckpt` as `how` says; the start of the reason the resume gives."""
    folder, state = ckpt / str(step), ckpt / str(step) / "state"
    if how == "flipped_bytes":        # inside the step's biggest data file, size kept
        file = biggest_file(state)
        flip_bytes(file)
        return f"{file} does not hold the bytes written (its sha256 differs from the manifest's)"
    if how == "earlier_state":        # the state of step 4 in step 6's place
        shutil.rmtree(state)
        shutil.copytree(ckpt / "4" / "state", state)
        return "its files are not the ones written with the step ("
    if how == "earlier_step":         # the whole of step 4, record and manifest too, in step 6's place
        shutil.rmtree(folder)
        shutil.copytree(ckpt / "4", folder)
        return f"checkpoint record {folder / 'record' / 'metadata'} is not a record of step {step}"
    if how == "deleted_orbax_manifest":
        (state / "manifest.ocdbt").unlink()
        return f"{state / 'manifest.ocdbt'} is missing"
    if how == "deleted_small_arrays":
        shutil.rmtree(state / "d")
        return f"{state / 'd'}/"
    if how == "deleted_manifest_and_commit":   # ours, and orbax's record that the step was committed
        (folder / "zoo-manifest.json").unlink()
        (folder / "_CHECKPOINT_METADATA").unlink()
        return f"its manifest {folder / 'zoo-manifest.json'} is missing"
    if how == "truncated_array_file":
        file = biggest_file(state)
        os.truncate(file, 64)
        return f"{file} has 64 bytes, its manifest says"
    if how == "missing_state":
        shutil.rmtree(state)
        return f"{state} is missing"
    if how == "before_manifests":     # checkpoints written before manifests: orbax's failed read finds it
        for record in ckpt.glob("*/record/metadata"):
            body = json.loads(record.read_text())
            body.pop("manifest")
            record.write_text(json.dumps(body))
        for manifest in ckpt.glob("*/zoo-manifest.json"):
            manifest.unlink()
        (state / "manifest.ocdbt").unlink()
        return "restoring it failed: NOT_FOUND"
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["flipped_bytes", "earlier_state", "earlier_step", "deleted_orbax_manifest",
                                 "deleted_small_arrays", "deleted_manifest_and_commit", "truncated_array_file"])
def test_a_step_whose_files_are_not_its_manifests_is_set_aside(base, tmp_path, capfd, how):
    """Each step's manifest (written last: the step and each file's size and sha256) is checked before orbax reads
    anything: a damaged step is named in one line with what differs and set aside as it is; the step before is
    the one to resume. Nothing else is printed (no library log, no traceback)."""
    ckpt = copy_ckpt(base, tmp_path)
    reason = damage(ckpt, how)
    files_before = sorted(str(p.relative_to(ckpt / "6")) for p in (ckpt / "6").rglob("*"))
    said = []
    assert Checkpoints(ckpt).newest_intact(say=said.append)[0] == 4
    assert len(said) == 1 and said[0].startswith(f"checkpoint step 6 in {ckpt} is damaged ({reason}"), said
    assert said[0].endswith(f"moved to {ckpt / '6.damaged'} (kept, not deleted); step 4 is intact")
    assert sorted(str(p.relative_to(ckpt / "6.damaged")) for p in (ckpt / "6.damaged").rglob("*")) == files_before
    assert Checkpoints(ckpt).steps() == [2, 4]
    out = capfd.readouterr()
    assert out.out == "" and out.err == "", out


def test_every_step_damaged_is_one_line_and_nothing_is_renamed(base, tmp_path):
    ckpt = copy_ckpt(base, tmp_path)
    reasons = [damage(ckpt, how, step) for how, step in (("flipped_bytes", 6), ("deleted_orbax_manifest", 4),
                                                         ("deleted_manifest_and_commit", 2))]
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6])
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr
    assert out.stderr.startswith(f"error: no checkpoint in {ckpt} can be resumed (nothing was changed): step 6: "
                                 f"{reasons[0]}; step 4: {reasons[1]}") and reasons[2] in out.stderr, out.stderr
    assert out.stderr.count("\n") == 1 and "compiled" not in out.stdout, out.stderr
    assert sorted(p.name for p in ckpt.iterdir() if p.is_dir()) == ["2", "4", "6"]


@pytest.mark.parametrize("how", tiered(["flipped_bytes", "earlier_state", "truncated_array_file", "missing_state",
                                        "before_manifests"], fast=("flipped_bytes",)))
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_intact(base, tmp_path, how):
    ckpt = copy_ckpt(base, tmp_path)
    reason = damage(ckpt, how)
    files_before = sorted(str(p.relative_to(ckpt / "6")) for p in (ckpt / "6").rglob("*"))
    # (A finished run resumed has nothing to do, whatever its arrays hold: train on past it, so it restores.)
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6, "--ckpt-every", 2,
                     "--metrics", tmp_path / "m.jsonl"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"checkpoint step 6 in {ckpt} is damaged ({reason}" in out.stdout, out.stdout
    assert f"moved to {ckpt / '6.damaged'} (kept, not deleted); step 4 is intact" in out.stdout
    assert f"resumed from {ckpt} at step 4" in out.stdout
    assert out.stderr == "", out.stderr   # no library log, no traceback
    # The damaged checkpoint is kept as it was, out of the keep-3 rotation, which saw 2, 4 and the new 6 and 8.
    assert sorted(str(p.relative_to(ckpt / "6.damaged")) for p in (ckpt / "6.damaged").rglob("*")) == files_before
    assert Checkpoints(ckpt).steps() == [4, 6, 8]
    # The recovered run is the uninterrupted one: steps 5 and 6 have its losses exactly.
    want, got = rows(base / "m.jsonl"), rows(tmp_path / "m.jsonl")
    assert sorted(got) == [5, 6, 7, 8] and {k: got[k]["loss"] for k in (5, 6)} == {k: want[k]["loss"] for k in (5, 6)}


@pytest.mark.slow
def test_nothing_is_renamed_when_no_checkpoint_restores(tmp_path):
    """A failure every checkpoint shares (here: a model that no longer matches them) is not damage: the error lists
    each step's reason and no folder is renamed."""
    ckpts = Checkpoints(tmp_path / "ckpt")
    small = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    for step in (1, 2):
        ckpts.save(step, small, nnx.Optimizer(small, optax.sgd(0.1), wrt=nnx.Param), {"run": {}})
    other = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="can be resumed .nothing was changed.: step 2: restoring it failed.*step 1"):
        ckpts.newest_intact(model=other, optimizer=nnx.Optimizer(other, optax.sgd(0.1), wrt=nnx.Param))
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["1", "2"]


@pytest.mark.slow
def test_a_resumed_run_continues_its_metrics_file_and_never_truncates_another(base, tmp_path, capsys):
    other = tmp_path / "other.jsonl"
    shutil.copy(base / "m.jsonl", other)
    text = other.read_text()
    rc, out, err = main(RUN + ["--metrics", other], capsys)                      # a fresh run onto another's file
    assert rc == 2 and f"--metrics {other} already exists and is not this run's" in err and "compiled" not in out
    ckpt = copy_ckpt(base, tmp_path)                                             # resuming, with another's file
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6,
                               "--metrics", other], capsys)
    assert rc == 2 and "already exists and is not this run's" in err and other.read_text() == text
    rc, out, err = main(RUN + ["--metrics", tmp_path / "no" / "m.jsonl"], capsys)  # a missing directory
    assert rc == 2 and f"the directory {tmp_path / 'no'} does not exist" in err and "compiled" not in out

    # The same run resumed: its file is continued, keeping the lines up to the checkpoint (step 2).
    run = RUN + ["--ckpt-dir", tmp_path / "c2", "--ckpt-every", 2, "--metrics", tmp_path / "m.jsonl"]
    assert cli(run + ["--stop-after", 3]).returncode == 0
    assert sorted(rows(tmp_path / "m.jsonl")) == [1, 2, 3]
    out = cli(run + ["--resume"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert [json.loads(line)["step"] for line in open(tmp_path / "m.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert {k: r["loss"] for k, r in rows(tmp_path / "m.jsonl").items()} == \
        {k: r["loss"] for k, r in rows(base / "m.jsonl").items()}


@pytest.mark.slow
def test_resume_past_the_planned_steps_keeps_the_schedule(base, tmp_path, capsys):
    ckpt = copy_ckpt(base, tmp_path)
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume"], capsys)          # finished: nothing to do
    assert rc == 0 and f"nothing left to do: the checkpoint in {ckpt} is at step 6 and --steps is 6" in out
    assert "--schedule-steps 6" in out and "compiled" not in out
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8], capsys)   # --steps alone: a hint
    assert rc == 2 and "was planned for 6 steps" in err and "add --schedule-steps 6" in err
    # The principled way: the schedule keeps its 6 steps; steps 7 and 8 run at its final learning rate, lr/10.
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6,
                     "--metrics", tmp_path / "m.jsonl"])
    assert out.returncode == 0 and f"resumed from {ckpt} at step 6" in out.stdout, out.stdout + out.stderr
    got = rows(tmp_path / "m.jsonl")
    assert sorted(got) == [7, 8] and all(got[k]["lr"] == pytest.approx(3e-4) for k in (7, 8))
    assert Checkpoints(ckpt).latest_step() == 8


@pytest.mark.parametrize("key, written, now", [("opt_dtype", "bfloat16", "float32"),
                                               ("opt_dtype", "float32", "bfloat16"),
                                               ("grad_accum", 2, 1), ("grad_accum", 1, 2)])
def test_resume_across_opt_dtype_or_grad_accum_is_refused_either_way_naming_the_recorded_value(key, written, now):
    """One rule each way for --opt-dtype and --grad-accum (part of the run's identity): refused, naming the value the
    checkpoint was written with (before, a bfloat16 checkpoint resumed under float32 without a word, and --grad-accum 2
    under 1)."""
    flag = "--" + key.replace("_", "-")
    settings = loop.RunConfig(batch=4, **{key: now})
    job = types.SimpleNamespace(storage=Storage.of(settings), data=Data.of(settings), cadence=Cadence.of(settings),
                                identity=settings.identity())
    record = {"run": loop.RunConfig(batch=4, **{key: written}).identity()}
    with pytest.raises(ValueError, match=rf"written with {flag} {written}, this run asks for {flag} {now}: .*; "
                                         rf"resume with {flag} {written}$"):
        resume.check_resumable(record, job, "/runs/ckpt")
