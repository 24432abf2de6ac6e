"""Several processes on one machine, as CI can run them: `python -m recipes.train` started 2 or 4 times on a
loopback coordinator (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), the 4 fake CPU devices split
among them, CPU collectives over gloo, under `--mesh fsdp=4`; compared with one process over 4 fake devices.

- 2 and 4 processes log the losses of the one-process run; process 0
  alone writes --metrics (each step once) and its checkpoints are the run's.
- SIGKILL to process 1 mid-run (the checkpoint lock then is process 0's): process 0 exits 1 within
  --heartbeat-timeout with one line, the PeerWatch's naming the silent process or, when gloo notices the reset
  first, the failed collective's, instead of waiting in the collective. The same command in one process on another
  mesh (fsdp=2,tp=2) with --resume takes over the lock if it was left, continues from the checkpoint the two
  processes wrote, and logs the uninterrupted run's losses into the same --metrics file, each step once.
- The PeerWatch itself, on a stand-in for the coordination service's key-value store: a process that stops
  publishing is named once --heartbeat-timeout has passed, one that finished is not, a coordinator that stops
  answering is said to be gone.

Losses are compared with a relative error < 1e-5: the sums over devices reduce in another order across processes
(gloo) and meshes. Every subprocess has a deadline, so a hang fails the test instead of hanging CI.
"""
from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from recipes import mesh
from recipes.checkpoint import Checkpoints
from recipes.lock import LOCK_NAME
from tests.helpers import cpu_env, tiered
from tests.recipes.test_distributed_startup import free_port

pytestmark = pytest.mark.multidevice   # processes of their own with fake CPU devices: scheduled first

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN = ["-m", "recipes.train", "--model", "llama3", "--preset", "tiny", "--batch", "4", "--seq", "16", "--set",
       "num_layers=1", "--schedule-steps", "6", "--log-every", "1", "--xla-flags", "none"]
STEPS = 8          # the reference run's; the others stop earlier or resume into it
HEARTBEAT = 10     # --heartbeat-timeout of the run whose process 1 is killed
DEADLINE = 240     # seconds any one process may take
STOPS = "; process 0 stops too. Start every process again with --resume to continue from the last checkpoint"
TOL = 1e-5         # relative: sums over devices reduce in another order across processes or meshes


def env_for(devices: int, process: int | None = None, port: int | None = None, count: int = 2) -> dict:
    env = cpu_env(devices)
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(var, None)
    if process is not None:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(count),
                   JAX_PROCESS_ID=str(process), JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo")
    return env


def one_process(args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *RUN, *map(str, args)], cwd=ROOT, env=env_for(4),
                          capture_output=True, text=True, timeout=DEADLINE)


def processes(args, count: int = 2) -> list[subprocess.Popen]:
    """`count` processes sharing the 4 devices of the one-process run, 4 // count each."""
    port = free_port()
    return [subprocess.Popen([sys.executable, *RUN, *map(str, args)], cwd=ROOT, env=env_for(4 // count, i, port, count),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(count)]


def finish(procs: list[subprocess.Popen], timeout: float = DEADLINE) -> list[tuple[str, str]]:
    """Each process's (stdout, stderr); every process still running at the deadline is killed (the test fails)."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def rows(metrics: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in metrics.read_text().splitlines()]


class Store:
    """The coordination service's key-value store as the processes of one test share it (`up`: answering)."""

    def __init__(self):
        self.data, self.up = {}, True

    def key_value_set(self, key, value, allow_overwrite=False):
        if not self.up:
            raise RuntimeError("UNAVAILABLE: failed to connect")
        self.data[key] = value

    def key_value_dir_get(self, prefix):
        if not self.up:
            raise RuntimeError("UNAVAILABLE: failed to connect")
        return [(k, v) for k, v in list(self.data.items()) if k.startswith(prefix)]


class Watch(mesh.PeerWatch):
    """A PeerWatch that records why it would end the process instead of ending it."""

    def __init__(self, *args, **kwargs):
        self.fired = []
        super().__init__(*args, **kwargs)

    def _fire(self, why):
        self.fired.append(why)
        self.stop.set()


def wait_for(cond, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return cond()


def test_the_peer_watch_names_a_silent_process_and_not_a_finished_one():
    """Three processes on one store: process 2 finishes (`done`), process 1 stops publishing (an error, or killed);
    process 0 says so for process 1 alone, once --heartbeat-timeout has passed, and not before."""
    store, timeout = Store(), 1.0
    w = [Watch(timeout, client=store, process=i, count=3, where="127.0.0.1:1") for i in range(3)]
    time.sleep(2 * timeout)
    assert [x.fired for x in w] == [[], [], []]   # all alive: nothing said
    w[2].close(done=True)
    w[1].close(done=False)
    stopped = time.monotonic()
    assert wait_for(lambda: w[0].fired, 10 * timeout)
    assert time.monotonic() - stopped >= timeout * 0.9
    assert w[0].fired == ["process 1 of 3 sent no heartbeat for 1 s (--heartbeat-timeout): it exited or was killed "
                          "(see its log)"]
    w[0].close(done=True)


def test_the_peer_watch_says_when_the_coordinator_is_gone():
    store = Store()
    w = [Watch(1.0, client=store, process=i, count=2, where="127.0.0.1:1") for i in range(2)]
    store.up = False   # process 0, which holds the service, was killed
    assert wait_for(lambda: w[1].fired, 10.0)
    assert w[1].fired[0] == ("the coordinator at 127.0.0.1:1 (process 0) has not answered for 1 s: it exited or was "
                             "killed (see its log), or the network failed")
    assert mesh.peer_lost(w[1].fired[0], 1).endswith(STOPS.replace("process 0", "process 1"))
    for x in w:
        x.close(done=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The losses of steps 1..STEPS of one process over 4 fake devices, uninterrupted."""
    metrics = tmp_path_factory.mktemp("reference") / "m.jsonl"
    out = one_process(["--mesh", "fsdp=4", "--steps", STEPS, "--metrics", metrics])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = rows(metrics)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    return [r["loss"] for r in got]


@pytest.mark.parametrize("count", tiered([2, 4], fast=(2,)))
def test_several_processes_log_the_losses_of_one(tmp_path, reference, count):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    procs = processes(["--mesh", "fsdp=4", "--steps", 4, "--ckpt-dir", ckpt, "--ckpt-every", 2,
                       "--metrics", metrics], count)
    outs = finish(procs)
    assert [p.returncode for p in procs] == [0] * count, [o[0][-2000:] + o[1][-2000:] for o in outs]
    for i, (stdout, _) in enumerate(outs):
        assert f"distributed: process {i} of {count}, {4 // count} local of 4 devices" in stdout
        assert f"mesh dp=1,fsdp=4,tp=1,ep=1 over 4 device(s), {count} process(es)" in stdout
    got = rows(metrics)   # both processes were given the path; only process 0 writes it
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [r["loss"] for r in got] == pytest.approx(reference[:4], rel=TOL)   # gloo sums in another order
    assert Checkpoints(ckpt).steps() == [2, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "m.jsonl"]
    assert not (ckpt / LOCK_NAME).exists()   # released by process 0 at the end


def test_a_killed_process_stops_the_other_and_resume_continues(tmp_path, reference):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    procs = processes(["--mesh", "fsdp=4", "--steps", 1000, "--ckpt-dir", ckpt, "--ckpt-every", 2,
                       "--metrics", metrics, "--heartbeat-timeout", HEARTBEAT])
    try:
        deadline, seen = time.monotonic() + DEADLINE, []
        for line in procs[1].stdout:
            seen.append(line)
            if line.startswith("step      3") or time.monotonic() > deadline:
                break
        assert seen and seen[-1].startswith("step      3"), "".join(seen)[-3000:] + procs[1].stderr.read()[-3000:]
        if not (ckpt / LOCK_NAME).exists():
            pytest.fail("no lock while both processes train:\n" + "\n".join(
                o[0][-2000:] + o[1][-3000:] for o in finish(procs, timeout=HEARTBEAT + 60)))
        holder = json.loads((ckpt / LOCK_NAME).read_text())   # the run's checkpoint lock is process 0's
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        outs = finish(procs[:1], timeout=HEARTBEAT + 60)
        waited = time.monotonic() - killed
    finally:
        finish(procs, timeout=10)
    stdout, stderr = outs[0]
    assert procs[0].returncode == 1, stdout[-2000:] + stderr[-3000:]
    assert waited < HEARTBEAT + 30, waited
    said = stderr.splitlines()[-1]   # the watch's line, or gloo's error if the collective saw the reset first
    assert said in (f"error: process 1 of 2 sent no heartbeat for {HEARTBEAT} s (--heartbeat-timeout): it exited "
                    f"or was killed (see its log){STOPS}",) or (
        said.startswith("error: a collective with the other processes failed (") and said.endswith(STOPS)), said
    assert holder["pid"] == procs[0].pid
    left = (ckpt / LOCK_NAME).exists()   # the watch's exit leaves it; gloo's error releases it on the way out
    last = Checkpoints(ckpt).latest_step()
    assert 2 <= last <= STEPS - 2, last

    out = one_process(["--mesh", "fsdp=2,tp=2", "--steps", STEPS, "--ckpt-dir", ckpt, "--ckpt-every", 2,
                       "--metrics", metrics, "--resume"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (f"took over the stale lock of a run that ended without releasing it (pid {procs[0].pid},"
            in out.stdout) == left
    assert f"resumed from {ckpt} at step {last}" in out.stdout
    got = rows(metrics)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))   # each step once: rows past `last` were cut
    assert [r["loss"] for r in got[:last]] == pytest.approx(reference[:last], rel=TOL)   # the two processes
    assert [r["loss"] for r in got[last:]] == pytest.approx(reference[last:], rel=TOL)
