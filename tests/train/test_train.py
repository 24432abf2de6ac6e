"""The main job: `python -m recipes.train` trains (every family), resumes exactly, stops on NaN keeping a good
checkpoint, and the README's command runs as printed. Small batch and sequence so the file runs in well under a
minute per worker."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys
import warnings

import jax
import numpy as np
import pytest
from flax import nnx

from recipes.train import loop
from recipes.train.checkpoints.checkpoint import Checkpoints
from recipes.train.inputs import data as data_lib
from recipes.train.settings import flags
from recipes.train.settings.cli import family as model_family
from recipes.train.settings.cli import recipe as model_recipe
from tests.helpers import assert_unbroken, cpu_env
from tests.train.token_files import write_tokens
from zoo.optim import lr_schedule, make_optimizer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "JAX_PLATFORMS": "cpu"}


# -- training works (the tiny Llama's 60 steps: the README test below) -----------------------------------------
@pytest.mark.slow   # the full set (-m 'slow or not slow'); see docs/testing.md
def test_tiny_deepseek_v3_learns_in_60_steps_under_the_study_recipe():
    result = loop.run(loop.RunConfig(model="deepseek_v3", preset="tiny", recipe="mla_moe_offload", steps=60,
                                     batch=4, seq=32))
    assert result.stopped is None and len(result.losses) == 60
    assert np.all(np.isfinite(result.losses))
    assert result.losses[-1] < 0.9 * result.losses[0], (result.losses[0], result.losses[-1])
    # The routing-bias update ran: every MoE layer's bias moved off zero, by multiples of the update rate.
    from zoo.layers.moe import RoutingBias
    biases = [np.asarray(v[...]) for _, v in nnx.iter_graph(result.model) if isinstance(v, RoutingBias)]
    assert biases and all(np.abs(b).max() > 0 for b in biases)


@pytest.mark.slow   # the README's main job on the families added as packages (a minute or two each: compiles)
@pytest.mark.parametrize("args, last", [
    (("--model", "qwen3", "--preset", "tiny", "--recipe", "qkv_offload", "--steps", "5"), 5),
    (("--model", "qwen3_moe", "--preset", "tiny", "--steps", "6"), 6),
])
def test_the_main_job_trains_the_qwen3_families(args, last):
    """`python -m recipes.train --model qwen3` (qkv_offload) and `--model qwen3_moe` (its default recipe): the last
    step's loss is below the first's."""
    r = subprocess.run([sys.executable, "-m", "recipes.train", *args], cwd=ROOT, env=cpu_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    first, final = (float(line.split("loss")[1].split()[0]) for line in r.stdout.splitlines()
                    if line.startswith("step") and line.split()[1] in ("1", str(last)))
    assert final < first, r.stdout


def test_bad_names_are_clear_errors():
    with pytest.raises(ValueError, match="choose one of: .*qkv_offload"):
        loop.run(loop.RunConfig(recipe="qkv_offlaod"))
    with pytest.raises(ValueError, match="choose one of: .*tiny"):
        loop.run(loop.RunConfig(preset="llama3_405b"))
    with pytest.raises(ValueError, match="num_layer"):
        loop.run(loop.RunConfig(overrides=(("num_layer", 3),)))
    with pytest.raises(ValueError, match="--resume needs --ckpt-dir"):
        loop.RunConfig(resume=True)


# -- checkpoints: resume equals the uninterrupted run; the NaN guard keeps the last good one ----------------------
# These drive the command itself, in subprocesses sharing a JAX compilation cache: every run compiles the same
# step, so only the first pays for it.
RUN = ["--steps", "12", "--batch", "4", "--seq", "32", "--log-every", "1"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("jax_cache")


def cli(args, cache, **kw) -> subprocess.CompletedProcess:
    env = {**_env(), "JAX_COMPILATION_CACHE_DIR": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    return subprocess.run([sys.executable, "-m", "recipes.train", *map(str, args)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600, **kw)


def losses(metrics) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(metrics))}


@pytest.fixture(scope="module")
def full(tmp_path_factory, cache):
    """The uninterrupted 12-step run every interrupted one is compared with (checkpointed at its end)."""
    d = tmp_path_factory.mktemp("full")
    out = cli(RUN + ["--ckpt-dir", d / "ckpt", "--metrics", d / "m.jsonl"], cache)
    assert out.returncode == 0, out.stdout + out.stderr
    return losses(d / "m.jsonl"), d / "ckpt"


def test_resume_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path, full, cache):
    full, _ = full
    run = RUN + ["--ckpt-dir", tmp_path / "ckpt", "--ckpt-every", 3, "--metrics", tmp_path / "m.jsonl"]
    out = cli(run + ["--stop-after", 7], cache)                  # killed after step 7: the checkpoint is step 6
    assert out.returncode == 0 and "stopping as if preempted (last checkpoint: 6)" in out.stdout, out.stdout
    assert Checkpoints(tmp_path / "ckpt").latest_step() == 6
    assert losses(tmp_path / "m.jsonl") == {k: full[k] for k in range(1, 8)}
    out = cli(run + ["--resume"], cache)
    assert out.returncode == 0 and "resumed from" in out.stdout and "at step 6" in out.stdout, out.stdout + out.stderr
    assert losses(tmp_path / "m.jsonl") == full                   # steps 7..12 exactly equal, step 7 logged once
    assert len(open(tmp_path / "m.jsonl").readlines()) == 12


def test_resume_refuses_a_different_run_and_a_fresh_run_refuses_a_used_directory(full):
    _, ckpt = full
    with pytest.raises(ValueError, match="different run .*batch"):
        loop.run(loop.RunConfig(steps=12, ckpt_dir=str(ckpt), resume=True, batch=2, seq=32))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        loop.run(loop.RunConfig(steps=12, ckpt_dir=str(ckpt), batch=4, seq=32))


def test_nan_guard_stops_and_keeps_the_last_good_checkpoint(tmp_path, full, cache):
    """Step 8's batch has NaN loss weights (a corrupted record): the step is not applied, the run stops with a
    clear message, and the checkpoint on disk is the state after step 7, the one the uninterrupted run had."""
    full, _ = full
    ckpt = tmp_path / "ckpt"
    out = cli(RUN + ["--ckpt-dir", ckpt, "--ckpt-every", 3, "--poison-step", 8, "--metrics", tmp_path / "m.jsonl"],
              cache)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "step 8: the loss (nan) or the gradient norm (nan) is not finite" in out.stdout
    assert "The last good checkpoint is step 7" in out.stdout
    assert losses(tmp_path / "m.jsonl") == {k: full[k] for k in range(1, 8)}
    assert Checkpoints(ckpt).latest_step() == 7

    # It loads (into an abstract model: no initialisation), and every parameter and moment is finite...
    model, optimizer = nnx.eval_shape(lambda: _model_and_optimizer(model_family("llama3")))
    record = Checkpoints(ckpt).restore(model, optimizer)
    assert record["step"] == 7 and int(optimizer.step[...]) == 7
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state((model, optimizer))))
    # ...and it is the uninterrupted run's state after step 7: resuming from it gives the same losses.
    out = cli(RUN + ["--ckpt-dir", ckpt, "--resume", "--metrics", tmp_path / "m.jsonl"], cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert losses(tmp_path / "m.jsonl") == full


def _model_and_optimizer(family, **overrides):
    model = family.build(family.config("tiny", **overrides), recipe=model_recipe(family, "qkv_offload"),
                         rngs=nnx.Rngs(0))
    return model, make_optimizer(model, lr_schedule(lr=3e-3, steps=12, warmup=1), clip=1.0,
                                      weight_decay=0.1)


@pytest.mark.slow
def test_the_guard_decided_before_the_update_changes_no_number():
    """`lr=` (the schedule) decides the NaN guard before the update so that the select fuses into it; on finite
    steps the state and metrics must equal those of the guard decided after the update, bit for bit."""
    from zoo.train_step import family_step, jit_step
    fam = model_family("llama3")
    schedule = lr_schedule(lr=3e-3, steps=12, warmup=1)
    batch = {k: jax.numpy.asarray(v) for k, v in data_lib.Synthetic(vocab=fam.config("tiny").vocab_size, batch=2,
                                                                      seq=16).batch(1).items()}
    states = []
    for lr in (schedule, None):
        model, opt = _model_and_optimizer(fam, num_layers=1)   # one layer: where the guard is decided is per step
        step, _, state = jit_step(model, opt, family_step(fam, lr))
        for _ in range(2):
            state, m = step(state, batch)
        assert bool(m["ok"]) and bool(m["kept"])
        states.append((state, float(m["loss"])))
    (a, loss_a), (b, loss_b) = states
    assert loss_a == loss_b
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# -- data ---------------------------------------------------------------------------------------------------------
def test_data_is_a_pure_function_of_seed_and_step():
    a, b = (data_lib.Synthetic(vocab=50, batch=3, seq=20, seed=1) for _ in range(2))
    np.testing.assert_array_equal(a.batch(5)["tokens"], b.batch(5)["tokens"])
    assert not np.array_equal(a.batch(5)["tokens"], a.batch(6)["tokens"])
    t = a.batch(1)["tokens"]   # every transition is one of the token's `branching` successors
    assert all(t[i, j + 1] in a.table[t[i, j]] for i in range(3) for j in range(20))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_round_trip(tmp_path, dtype):
    ids = np.arange(1000) % 256
    path = tmp_path / f"tokens.{dtype}.bin"
    write_tokens(path, ids, dtype)
    src = data_lib.TokenFile(path, vocab=256, batch=4, seq=16, seed=0, dtype=dtype)
    tok = src.batch(3)["tokens"]
    assert tok.dtype == np.int32 and tok.shape == (4, 17)
    assert ((np.diff(tok, axis=1) % 256) == 1).all()           # windows of consecutive ids
    again = data_lib.TokenFile(path, vocab=256, batch=4, seq=16, dtype=dtype).batch(3)["tokens"]
    np.testing.assert_array_equal(tok, again)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        data_lib.TokenFile(path, vocab=100, batch=4, seq=16, dtype=dtype).batch(1)


def test_training_on_a_token_file(tmp_path, cache):
    path = tmp_path / "tokens.bin"
    write_tokens(path, np.random.default_rng(0).integers(256, size=5000), "uint16")
    out = cli(RUN + ["--data", path, "--data-dtype", "uint16", "--metrics", tmp_path / "m.jsonl"], cache)
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(losses(tmp_path / "m.jsonl")) == 12 and np.all(np.isfinite(list(losses(tmp_path / "m.jsonl").values())))


# -- XLA flags, the README command, the custom-loop example -------------------------------------------------------
def test_flag_sets_add_to_xla_flags_and_user_flags_win():
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    assert flags.apply("overlap", env) == flags.FLAG_SETS["overlap"]
    assert env["XLA_FLAGS"] == ("--xla_gpu_enable_latency_hiding_scheduler=false "
                                "--xla_gpu_enable_pipelined_host_offloading=true")
    with pytest.raises(ValueError, match="choose one of: none, lhs, overlap"):
        flags.apply("fast", {})


def test_the_cli_applies_its_flag_set_before_jax_is_imported():
    code = ("import sys; import recipes.train as t; assert 'jax' not in sys.modules, 'jax imported too early'; "
            "from recipes.train.settings import flags; flags.apply('overlap'); import os; "
            "print(os.environ['XLA_FLAGS'])")
    out = subprocess.run([sys.executable, "-c", code], env={**_env(), "XLA_FLAGS": ""}, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == list(flags.FLAG_SETS["overlap"])


def _readme_command() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if ln.startswith("pip install -e . && python -m recipes.train"))
    args = shlex.split(line.split("&&", 1)[1])
    assert args[:3] == ["python", "-m", "recipes.train"]
    return [sys.executable] + args[1:]


def test_readme_main_job_command_runs_as_printed_and_tiny_llama_learns_in_60_steps(tmp_path):
    cmd = _readme_command() + ["--metrics", str(tmp_path / "m.jsonl")]
    out = subprocess.run(cmd, env={**_env(), "XLA_FLAGS": ""}, cwd=tmp_path, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    # The flag set (GPU flags) is printed only off the CPU: on the CPU they parse and do nothing.
    assert "XLA flag set" not in out.stdout
    assert "recipe qkv_offload" in out.stdout and "query_proj" in out.stdout   # the recipe and its plan
    rows = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    assert rows[-1]["step"] == 60 and rows[-1]["loss"] < 0.9 * rows[0]["loss"]
    assert {"tokens_per_s", "model_tflops", "mfu", "peak_hbm_bytes"} <= set(rows[0])


def test_the_main_jobs_output_to_a_pipe_keeps_every_line_whole(tmp_path):
    """Its output piped (a cluster job's log): the plan's tables at their natural width and each line whole, the
    longest (--recipe auto's choice, over 160 columns) too, whatever COLUMNS says."""
    args = ["--recipe", "auto", "--hbm-limit", "1", "--link", "10", "--peak-tflops", "1", "--steps", 1, "--batch", 2,
            "--seq", 16, "--xla-flags", "none", "--ckpt-dir", tmp_path / "ckpt"]
    out = subprocess.run([sys.executable, "-m", "recipes.train", *map(str, args)], env=cpu_env(COLUMNS="80"),
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert_unbroken(out.stdout, "recipe auto for HBM 1.0 GiB ... recomputes every other tag",
                    "recipe auto: device=['decoder_layer_input', ... every other tag recomputed",
                    "chosen: auto: device=[ ... every other tag recomputed", "│ decoder_layer_input │",
                    "│ peak HBM of the step, compiled for cpu")


def test_custom_loop_example_trains_with_the_recipe_policy(capsys):
    spec = importlib.util.spec_from_file_location("custom_loop", ROOT / "docs/examples/custom_loop.py")
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    losses = ex.main(steps=15)
    assert losses[-1] < 0.5 * losses[0]
    # On the CPU it does not claim pinned host memory: nothing moves there.
    assert "offloaded by the recipe (on the CPU nothing moves" in capsys.readouterr().out
    from zoo.plan import measure
    host = [r for r in measure.residuals(ex.loss_fn, ex.init(jax.random.key(0)), ex.batch(0)) if r.host]
    assert len(host) == 3 and all(r.shape[0] == ex.LAYERS for r in host)   # q, k, v, stacked over the layers


def test_the_main_job_refuses_a_sequence_beyond_the_models_context(capsys):
    from recipes import train
    with warnings.catch_warnings():   # in this process JAX is imported: no flag set is applied late (--xla-flags none)
        warnings.simplefilter("error")
        assert train.main(["--preset", "tiny", "--set", "max_seq_len=32", "--seq", "64", "--steps", "1",
                           "--xla-flags", "none"]) == 2
    assert "--seq 64: sequence length 64 is longer than LlamaConfig.max_seq_len=32" in capsys.readouterr().err


def test_loss_chunk_flag(capsys):
    """--loss-chunk N runs the loss N positions at a time (0 or none: unchunked); a length that is not a positive
    divisor of --seq is refused by the config, before anything is built."""
    import argparse

    from recipes import train
    from recipes.train.settings.config import loss_chunk_arg
    assert [loss_chunk_arg(t) for t in ("8", "0", "none", "auto")] == [8, None, None, "auto"]
    with pytest.raises(argparse.ArgumentTypeError, match="--loss-chunk takes a number of positions"):
        loss_chunk_arg("half")
    with pytest.raises(ValueError, match="--loss-chunk 5 does not divide the sequence length 64"):
        loop.RunConfig(loss_chunk=5)
    with pytest.raises(ValueError, match="--loss-chunk must be a positive int.*got -2"):
        loop.RunConfig(loss_chunk=-2)
    assert train.main(["--xla-flags", "none", "--steps", "2", "--batch", "2", "--seq", "16", "--log-every", "1",
                       "--loss-chunk", "4"]) == 0
    assert "step      2" in capsys.readouterr().out
