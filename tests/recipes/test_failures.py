"""Issue 12, "nothing lost, nothing hangs, no silent wrong run": one test per numbered failure case.

Runs that compile drive `python -m recipes.train` in subprocesses sharing a JAX compilation cache, all with the
same step (the same model, batch, sequence and learning-rate schedule), so only the first compiles. Cases that
must fail before anything is built call the command's `main` in this process (no JAX start-up per case) and
check that nothing was compiled."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zoo
from recipes import data as data_lib
from recipes import guard, loop, train
from recipes.checkpoint import Checkpoints
from recipes.lock import LOCK_NAME, DirLock
from tests.helpers import random_tiny_llama

ROOT = pathlib.Path(__file__).resolve().parents[2]
# One compiled step for every run below: a 6-step schedule (resumed runs may go past it with --schedule-steps 6).
RUN = ["--steps", 6, "--batch", 2, "--seq", 16, "--set", "num_layers=1", "--log-every", 1, "--xla-flags", "none"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


def cli(args, cache, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(cache),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    return subprocess.run([sys.executable, "-m", "recipes.train", *map(str, args)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def main(args, capsys) -> tuple[int, str, str]:
    """The command in this process, for cases that stop before building anything."""
    rc = train.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def rows(metrics) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, open(metrics))}


@pytest.fixture(scope="module")
def base(tmp_path_factory, cache):
    """A finished 6-step run checkpointed every 2 steps (2, 4, 6) with its metrics: the reference every recovered
    run is compared with. Tests copy its checkpoint directory; none changes it."""
    d = tmp_path_factory.mktemp("base")
    out = cli(RUN + ["--ckpt-dir", d / "ckpt", "--ckpt-every", 2, "--metrics", d / "m.jsonl"], cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert Checkpoints(d / "ckpt").steps() == [2, 4, 6]
    return d


def copy_ckpt(base, tmp_path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(base / "ckpt", tmp_path / "ckpt"))


@pytest.fixture(scope="module")
def tiny_model():
    """A one-layer Llama with random parameters drawn by NumPy into its abstract state (no compilation)."""
    return random_tiny_llama(0.3)


# -- 1: a checkpoint directory that cannot be written fails at once; a failing write cannot hang ----------------
def test_case01_ckpt_dir_not_writable(tmp_path, capsys):
    regular = tmp_path / "file"
    regular.write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a directory"):
        guard.check_ckpt_dir(str(regular))
    with pytest.raises(ValueError, match="cannot be created"):           # its parent is a regular file
        guard.check_ckpt_dir(str(regular / "ckpt"))
    if os.path.isdir("/proc"):                                             # a file system no one writes
        with pytest.raises(ValueError, match="cannot be created|not writable"):
            guard.check_ckpt_dir("/proc/zoo-ckpt")
    if os.geteuid() != 0:                                                  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            guard.check_ckpt_dir(str(locked))
    # The command: exit code 2 and the reason, before building or compiling; the file is untouched.
    rc, out, err = main(RUN + ["--ckpt-dir", regular], capsys)
    assert rc == 2 and f"--ckpt-dir {regular} exists and is not a directory" in err, err
    assert "compiled" not in out and regular.read_text() == "mine"


def test_case01_a_failing_checkpoint_write_raises_and_the_process_exits(tmp_path):
    """The directory disappears under a running manager (replaced by a file): the write fails in the caller, as a
    CheckpointError naming the step and directory, and the process exits (orbax's async threads used to hang)."""
    code = f"""
import os, shutil
from flax import nnx
import optax
from recipes.checkpoint import Checkpoints, CheckpointError
d = {str(tmp_path / 'ckpt')!r}
ckpts = Checkpoints(d)
model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
opt = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
ckpts.save(1, model, opt, {{}})
shutil.rmtree(d); open(d, "w").close()
try:
    ckpts.save(2, model, opt, {{}})
except CheckpointError as e:
    print("CheckpointError:", e)
ckpts.close()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert f"CheckpointError: writing checkpoint step 2 to {tmp_path / 'ckpt'} failed" in out.stdout, out.stdout


# -- 2: a step that makes parameters non-finite is not applied; no non-finite checkpoint; flags validated -------
@pytest.mark.parametrize("flag,value", [("lr", float("nan")), ("lr", float("inf")), ("lr", 0.0), ("clip", -1.0),
                                        ("clip", 0.0), ("weight_decay", -0.1), ("weight_decay", float("nan")),
                                        ("warmup", -1), ("warmup", 60)])
def test_case02_optimizer_flags_are_validated(flag, value):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be"):
        loop.RunConfig(**{flag: value})


def test_case02_nan_guard_checks_the_updated_parameters(tiny_model, tmp_path, capsys, monkeypatch):
    """From step 4 the learning rate is NaN while the loss and gradient stay finite: the guard sees the updated
    parameters, does not apply the step, says why, and the last good checkpoint (step 3) is written and finite.
    Then a checkpoint of non-finite values is refused outright."""
    monkeypatch.setattr(loop, "lr_schedule", lambda **kw: (lambda count: jnp.where(count < 3, 1e-3, jnp.nan)))
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


def test_case02_an_update_that_overflows_past_the_guard_is_never_saved(tmp_path, capsys, monkeypatch):
    """The guard is decided before the update (finite loss, gradient norm and learning rate); an update that still
    makes parameters non-finite (here an optimizer that multiplies its updates by infinity from step 4) has been
    applied in place: the run says so, stops, and does not save that state (the last checkpoint is step 2)."""
    from zoo import train_step as ts
    make_tx = ts.make_tx
    blow_up = optax.scale_by_schedule(lambda count: jnp.where(count < 3, 1.0, jnp.inf))
    monkeypatch.setattr(ts, "make_tx", lambda *a, **kw: optax.chain(make_tx(*a, **kw), blow_up))
    ckpt = tmp_path / "run"
    result = loop.run(loop.RunConfig(steps=6, batch=2, seq=16, overrides=(("num_layers", 1),), ckpt_dir=str(ckpt),
                                     ckpt_every=2))
    out = capsys.readouterr().out
    assert result.stopped == "nonfinite" and result.steps == [1, 2, 3], out
    assert "step 4: the update made parameters non-finite (the loss" in out
    assert "the update was applied (an overflow the guard cannot foresee) and is not saved" in out
    assert "The last good checkpoint is step 2" in out and Checkpoints(ckpt).steps() == [2]


# -- 3: one run per checkpoint directory -------------------------------------------------------------------------
def test_case03_two_runs_one_ckpt_dir(base, tmp_path, capsys):
    ckpt = copy_ckpt(base, tmp_path)
    with DirLock(ckpt):                       # this process plays the first run
        rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6], capsys)
        assert rc == 2 and f"{ckpt} is in use by another run (pid {os.getpid()} on {socket.gethostname()}" in err
        assert "compiled" not in out and Checkpoints(ckpt).steps() == [2, 4, 6]
        with pytest.raises(ValueError, match="in use by another run"):
            DirLock(ckpt)
    assert not (ckpt / LOCK_NAME).exists()    # released at exit

    # A lock left by a killed run of this host (its pid is gone) is taken over, and the run says so.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (ckpt / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "then"}))
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume"], capsys)
    assert rc == 0 and f"took over the stale lock of a run that ended without releasing it (pid {dead.pid}" in out
    assert "nothing left to do" in out and not (ckpt / LOCK_NAME).exists()
    # Another machine's lock is never taken over (its run may be alive).
    (ckpt / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
    with pytest.raises(ValueError, match="claimed by a run on another machine .*elsewhere.* delete"):
        DirLock(ckpt)


# -- 4: --set values by the field's type -------------------------------------------------------------------------
def test_case04_set_values_are_converted_by_field_type(tmp_path, capsys, cache):
    from recipes import cli as recipes_cli
    fam = zoo.models.registry.family("llama3")

    def convert(field, text):
        return getattr(recipes_cli.model_config(fam, "tiny", [(field, text)]), field)

    assert convert("tie_embeddings", "false") is False
    assert convert("tie_embeddings", "True") is True
    assert convert("num_layers", "3") == 3
    assert convert("rope_theta", "1e4") == 10000.0
    assert convert("attention_impl", "none") is None
    assert convert("attention_impl", "xla") == "xla"
    assert convert("rope_scaling", "None") is None
    for field, text, message in [("tie_embeddings", "maybe", "bool"), ("num_layers", "3.5", "int"),
                                 ("rope_theta", "nan", "rope_theta"), ("rope_scaling", "{}", "rope_scaling"),
                                 ("num_layer", "3", "not a field of LlamaConfig")]:
        with pytest.raises(ValueError, match=f"--set {field}=.*{message}"):
            convert(field, text)
    rc, out, err = main(RUN + ["--set", "tie_embeddings=maybe"], capsys)
    assert rc == 2 and "--set tie_embeddings=maybe" in err and "bool" in err and "compiled" not in out
    # End to end: false unties (the LM head's parameters exist); 'false' as a string used to tie them.
    def n_params(tie):
        cfg = zoo.models.LlamaConfig.preset("tiny", num_layers=1, tie_embeddings=tie)
        return zoo.models.count_params(nnx.eval_shape(lambda: zoo.models.llama3(cfg, rngs=nnx.Rngs(0))))
    assert n_params(False) == n_params(True) + 256 * 64
    out = cli(RUN + ["--set", "tie_embeddings=false", "--stop-after", 1], cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"model llama3 tiny: {n_params(False):,} parameters" in out.stdout, out.stdout


# -- 5: a damaged latest checkpoint: resume from the newest intact one, keep the damaged one ---------------------
@pytest.mark.parametrize("damage", ["truncated_array_file", "missing_state"])
def test_case05_damaged_latest_checkpoint_falls_back(base, tmp_path, cache, damage):
    ckpt = copy_ckpt(base, tmp_path)
    if damage == "truncated_array_file":
        for f in (ckpt / "6" / "state").rglob("d/*"):
            if f.is_file() and f.stat().st_size > 64:
                os.truncate(f, 64)
        reason = "restoring it failed"
    else:
        shutil.rmtree(ckpt / "6" / "state")
        reason = f"{ckpt / '6' / 'state'} is missing"
    files_before = sorted(str(p.relative_to(ckpt / "6")) for p in (ckpt / "6").rglob("*"))
    # (A finished run resumed has nothing to do, whatever its arrays hold: train on past it, so it restores.)
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6, "--ckpt-every", 2,
                     "--metrics", tmp_path / "m.jsonl"], cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"checkpoint step 6 in {ckpt} is damaged ({reason}" in out.stdout, out.stdout
    assert f"moved to {ckpt / '6.damaged'} (kept, not deleted); step 4 is intact" in out.stdout
    assert f"resumed from {ckpt} at step 4" in out.stdout
    # The damaged checkpoint is kept as it was, out of the keep-3 rotation, which saw 2, 4 and the new 6 and 8.
    assert sorted(str(p.relative_to(ckpt / "6.damaged")) for p in (ckpt / "6.damaged").rglob("*")) == files_before
    assert Checkpoints(ckpt).steps() == [4, 6, 8]
    # The recovered run is the uninterrupted one: steps 5 and 6 have its losses exactly.
    want, got = rows(base / "m.jsonl"), rows(tmp_path / "m.jsonl")
    assert sorted(got) == [5, 6, 7, 8] and {k: got[k]["loss"] for k in (5, 6)} == {k: want[k]["loss"] for k in (5, 6)}


def test_case05_nothing_is_renamed_when_no_checkpoint_restores(tmp_path):
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


# -- 6: --metrics never destroys a file ---------------------------------------------------------------------------
def test_case06_metrics_file_is_never_truncated(base, tmp_path, capsys, cache):
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
    assert cli(run + ["--stop-after", 3], cache).returncode == 0
    assert sorted(rows(tmp_path / "m.jsonl")) == [1, 2, 3]
    out = cli(run + ["--resume"], cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert [json.loads(line)["step"] for line in open(tmp_path / "m.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert {k: r["loss"] for k, r in rows(tmp_path / "m.jsonl").items()} == \
        {k: r["loss"] for k, r in rows(base / "m.jsonl").items()}


# -- 7: to_hf never overwrites silently, and never leaves a mixed directory ---------------------------------------
def test_case07_to_hf_refuses_a_non_empty_directory(tiny_model, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    with pytest.raises(ValueError, match=r"is not empty \(config.json\).*overwrite=True"):
        zoo.to_hf(tiny_model, out)
    assert (out / "config.json").read_text() == '{"mine": true}'
    # overwrite=True replaces the checkpoint files (old .bin shards, stale safetensors shards), keeps the rest.
    for name in ("pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json", "model-00001-of-00003.safetensors",
                 "tokenizer.json"):
        (out / name).write_text("old")
    zoo.to_hf(tiny_model, out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert (out / "tokenizer.json").read_text() == "old"
    back = zoo.from_hf(out)
    np.testing.assert_array_equal(back.embed.embedding[...], tiny_model.embed.embedding[...])


# -- 8: damaged Hugging Face files are named; non-finite weights are refused --------------------------------------
def test_case08_bad_hf_files_are_named(tiny_model, tmp_path):
    d = tmp_path / "hf"
    zoo.to_hf(tiny_model, d)
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])                                  # a truncated download
    with pytest.raises(ValueError, match=f"{weights} is not a readable safetensors file"):
        zoo.from_hf(d)
    weights.write_bytes(data[:-64] + b"\xff" * 64)                              # 64 bytes of 0xff: NaNs
    with pytest.raises(ValueError, match=f"tensor 'model.norm.weight' in {weights} holds 16 non-finite"):
        zoo.from_hf(d)
    loaded = zoo.from_hf(d, allow_nonfinite=True)                               # asked for: loads
    assert np.isnan(np.asarray(loaded.norm.scale[...])).sum() == 16
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=f"{d / 'config.json'} is not valid JSON"):
        zoo.from_hf(d)


# -- 9: token ids out of range ------------------------------------------------------------------------------------
def test_case09_token_ids_out_of_range(tiny_model, tmp_path):
    path = tmp_path / "tokens.bin"
    ids = np.arange(100) % 30
    ids[57] = 300
    data_lib.write_tokens(path, ids, "uint16")
    # Found in the sample read at start (recipes.data.TokenFile), before training; else by the batch that reads it.
    with pytest.raises(ValueError, match=f"TokenFile '{path}': id 300 at position 57 is outside the model's vocab"):
        data_lib.TokenFile(path, vocab=32, batch=4, seq=90, seed=0, dtype="uint16")
    good = jnp.zeros((1, 4), jnp.int32)
    for bad in (32, -1):
        with pytest.raises(ValueError, match=rf"token id {bad} at \[0, 2\] is outside the vocabulary \[0, 32\)"):
            tiny_model(good.at[0, 2].set(bad))


# -- 10: resuming past the planned steps, and a finished run -----------------------------------------------------
def test_case10_resume_past_the_planned_steps(base, tmp_path, capsys, cache):
    ckpt = copy_ckpt(base, tmp_path)
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume"], capsys)          # finished: nothing to do
    assert rc == 0 and f"nothing left to do: the checkpoint in {ckpt} is at step 6 and --steps is 6" in out
    assert "--schedule-steps 6" in out and "compiled" not in out
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8], capsys)   # --steps alone: a hint
    assert rc == 2 and "was planned for 6 steps" in err and "add --schedule-steps 6" in err
    # The principled way: the schedule keeps its 6 steps; steps 7 and 8 run at its final learning rate, lr/10.
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume", "--steps", 8, "--schedule-steps", 6,
                     "--metrics", tmp_path / "m.jsonl"], cache)
    assert out.returncode == 0 and f"resumed from {ckpt} at step 6" in out.stdout, out.stdout + out.stderr
    got = rows(tmp_path / "m.jsonl")
    assert sorted(got) == [7, 8] and all(got[k]["lr"] == pytest.approx(3e-4) for k in (7, 8))
    assert Checkpoints(ckpt).latest_step() == 8


# -- 11: messages, not tracebacks ---------------------------------------------------------------------------------
def test_case11_clear_messages_instead_of_tracebacks(base, tmp_path, capsys, cache, tiny_model):
    if jax.devices()[0].platform != "gpu":
        rc, out, err = main(RUN + ["--set", "attention_impl=cudnn"], capsys)
        assert rc == 2 and "attention_impl='cudnn' cannot run here: cuDNN runs only on NVIDIA GPUs" in err
        assert "Traceback" not in err and "compiled" not in out
    # A Python list as tokens is accepted: converted to an int32 array.
    tokens = [[1, 2, 3], [4, 5, 6]]
    np.testing.assert_array_equal(tiny_model(tokens), tiny_model(jnp.asarray(tokens, jnp.int32)))
    with pytest.raises(ValueError, match=r"tokens must be an integer array \[batch, seq\], got float"):
        tiny_model([[1.5, 2.0]])
    # Resume with --lr nan: the flag is named.
    ckpt = copy_ckpt(base, tmp_path)
    rc, out, err = main(RUN + ["--ckpt-dir", ckpt, "--resume", "--lr", "nan"], capsys)
    assert rc == 2 and "--lr must be a finite number > 0, got nan" in err
    # A checkpoint record that is not JSON: the file is named, and the run resumes from the step before.
    record = ckpt / "6" / "record" / "metadata"
    record.write_text('{"step": 6, "run"')
    with pytest.raises(ValueError, match=f"checkpoint record {record} is unreadable"):
        Checkpoints(ckpt).record(6)
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume"], cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"checkpoint step 6 in {ckpt} is damaged (checkpoint record {record} is unreadable" in out.stdout
    assert f"resumed from {ckpt} at step 4" in out.stdout
