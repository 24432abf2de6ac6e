"""SIGINT and SIGTERM: the step running finishes, a checkpoint of it is written with --ckpt-dir,
one line says so, the exit code is 128 + the signal; the same command with --resume continues; a second Ctrl-C exits
at once; no KeyboardInterrupt traceback anywhere. Two subprocess runs share one compilation cache."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from recipes.train.checkpoints.checkpoint import Checkpoints
from recipes.train.processes.interrupt import Interrupted, Interrupts
from tests.helpers import ROOT, cpu_env

# The step of tests/train/cli_runs.py (its 6-step schedule; the runs here go on past it until signalled), so
# that the run's compilation cache holds it once for all of them.
RUN = ["--batch", 2, "--seq", 16, "--set", "num_layers=1", "--log-every", 1, "--xla-flags", "none",
       "--schedule-steps", 6]


@pytest.fixture(scope="module")
def env():
    return cpu_env()


def signalled(args, env, signals, after_step=3) -> tuple[int, str, str]:
    """Run the command, send `signals` once it has logged `after_step`; (exit code, stdout, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "recipes.train", *map(str, args)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = []
    for line in proc.stdout:
        out.append(line)
        if line.startswith(f"step {after_step:>6}"):
            for s in signals:
                proc.send_signal(s)
            break
    rest, err = proc.communicate(timeout=120)
    return proc.returncode, "".join(out) + rest, err


def test_sigterm_saves_the_step_and_resume_continues(tmp_path, env):
    """SIGTERM mid-run: exit 143, one line naming the saved step, a checkpoint of exactly that step, the metrics
    file up to it; the same command plus --resume continues from it (its metrics file is its own)."""
    run = RUN + ["--steps", 100_000, "--ckpt-dir", tmp_path / "ckpt", "--metrics", tmp_path / "m.jsonl"]
    rc, out, err = signalled(run, env, [signal.SIGTERM])
    assert rc == 143, out[-2000:] + err
    line = next(ln for ln in out.splitlines() if ln.startswith("SIGTERM: stopped after step "))
    step = int(line.split()[4].rstrip(";"))
    assert line == (f"SIGTERM: stopped after step {step}; checkpoint step {step} is saved: the same command with "
                    f"--resume continues (exit 143)")
    assert Checkpoints(tmp_path / "ckpt").steps() == [step] and "Traceback" not in err
    assert [json.loads(x)["step"] for x in open(tmp_path / "m.jsonl")][-1] == step
    resumed = subprocess.run([sys.executable, "-m", "recipes.train", *map(str, run[:-2] + ["--steps", step + 2]),
                              "--metrics", str(tmp_path / "m.jsonl"), "--resume"], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr
    assert f"resumed from {tmp_path / 'ckpt'} at step {step}" in resumed.stdout
    assert [json.loads(x)["step"] for x in open(tmp_path / "m.jsonl")][-3:] == [step, step + 1, step + 2]


def test_ctrl_c_without_ckpt_dir_says_nothing_was_saved(env):
    """Ctrl-C mid-run without --ckpt-dir: exit 130 and one line saying nothing was saved; no traceback."""
    rc, out, err = signalled(RUN + ["--steps", 100_000], env, [signal.SIGINT])
    assert rc == 130, out[-2000:] + err
    assert [ln for ln in out.splitlines() if ln.startswith("SIGINT")] == [
        ln for ln in out.splitlines() if ln.startswith("SIGINT: stopped after step ")
        and ln.endswith("; no --ckpt-dir, nothing saved (exit 130)")]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_a_second_ctrl_c_exits_at_once_without_a_traceback():
    """While a first Ctrl-C waits for the step, a second one exits at once with exit code 130 and one line on stderr
    (the signal handlers of `recipes.train.processes.interrupt`, in a process of their own). No clock: a signal a
    process sends itself is handled before `os.kill` returns (CPython checks for signals there), so the first is noted
    by the next line and the second has exited before the line after it, which would fail loudly."""
    code = """
import os, signal, sys
from recipes.train.processes.interrupt import Interrupts
with Interrupts() as interrupts:
    interrupts.training = True
    os.kill(os.getpid(), signal.SIGINT)
    assert interrupts.signum == signal.SIGINT, "the first SIGINT was not noted"
    os.kill(os.getpid(), signal.SIGINT)
    sys.exit("the second SIGINT did not exit the process")
"""
    # the timeout is a deadline against a hang, not a measured time
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env=cpu_env())
    assert out.returncode == 130, out.stderr
    assert out.stderr == ("second SIGINT: exiting at once without saving (the checkpoints already written are "
                          "intact)\n")


def test_before_training_a_signal_stops_the_run_at_once():
    """Before the training loop (checks, compile, restore) there is nothing to save: the signal raises Interrupted
    (a BaseException, so no `except Exception` swallows it) with the exit code 128 + signal; in the loop it is only
    noted, and `requested()` says so after the step. The previous handlers are back afterwards."""
    before = signal.getsignal(signal.SIGINT)
    with Interrupts() as interrupts:
        with pytest.raises(Interrupted) as e:
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):   # the handler runs at the next bytecode boundary
                pass
        assert e.value.exit_code == 130 and not isinstance(e.value, Exception)
        interrupts.signum, interrupts.training = None, True
        assert not interrupts.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert interrupts.requested() and interrupts.exit_code == 143 and interrupts.name == "SIGTERM"
    assert signal.getsignal(signal.SIGINT) is before
