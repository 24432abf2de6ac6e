"""Several processes on one machine, as CI can run them: `python -m recipes.train` started 2 or 4 times on a
loopback coordinator (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), the 4 fake CPU devices split
among them, CPU collectives over gloo, under `--mesh fsdp=4`; compared with one process over 4 fake devices.

- 2 and 4 processes log the losses of the one-process run; process 0
  alone writes --metrics (each step once) and its checkpoints are the run's.
- Processes given different numbers (--seed, --steps, --ckpt-dir) all stop at start with the same line naming
  each differing flag; a second run in a --ckpt-dir another run holds is refused by every process.
- SIGKILL to process 0 (the coordinator: its service lives on in a host process of its own) or to process 1
  mid-run: the other exits 1 within --heartbeat-timeout with one line, the PeerWatch's naming the silent process
  or, when gloo notices the reset first, the failed collective's, instead of waiting in the collective or
  aborting in C++. The same command in one process on another mesh (fsdp=2,tp=2) with --resume takes over the
  lock if it was left, continues from the checkpoint the two processes wrote, and logs the uninterrupted run's
  losses into the same --metrics file, each step once.
- SIGKILL to the coordination service's own process (process 0's child): both processes exit 1 with one line
  (the relay's), no C++ abort.
- The PeerWatch itself, on a stand-in for the coordination service's key-value store and a clock the test moves
  (no sleeps): a process that stops publishing is named once --heartbeat-timeout has passed and not before, one
  that failed after one more round, one that finished alone after the timeout; a coordinator that stops answering
  is said to be gone.

Losses are compared with a relative error < 1e-5: the sums over devices reduce in another order across processes
(gloo) and meshes. Every subprocess has a deadline, so a hang fails the test instead of hanging CI.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from recipes.train.checkpoints.checkpoint import Checkpoints
from recipes.train.processes import coordinator, mesh
from recipes.train.processes.lock import LOCK_NAME, DirLock
from tests import helpers
from tests.helpers import cpu_env, tiered
from tests.train.test_distributed_startup import free_port

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


def processes(args, count: int = 2, per_process=None, port: int | None = None) -> list[subprocess.Popen]:
    """`count` processes sharing the 4 devices of the one-process run, 4 // count each; `per_process(i)`: flags
    added to process i's command."""
    port = port or free_port()
    return [subprocess.Popen([sys.executable, *RUN, *map(str, args), *map(str, per_process(i) if per_process else [])],
                             cwd=ROOT, env=env_for(4 // count, i, port, count), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for i in range(count)]


def finish(procs: list[subprocess.Popen], timeout: float = DEADLINE) -> list[tuple[str, str]]:
    """`tests.helpers.finish` with this file's deadline."""
    return helpers.finish(procs, timeout)


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


class Clock:
    """A clock the test moves by hand: the watch's verdicts depend on it and on nothing else."""

    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def watches(store, clock, count: int, timeout: float = 1.0) -> list[mesh.PeerWatch]:
    """`count` PeerWatches on one store, without their threads: the test runs their rounds (`beat`) itself."""
    return [mesh.PeerWatch(timeout, client=store, process=i, count=count, where="127.0.0.1:1", clock=clock,
                           start=False) for i in range(count)]


def rounds(ws, clock, seconds: float, step: float = 0.1) -> None:
    """The clock moves `seconds` on, each of `ws` beating every `step`."""
    for _ in range(round(seconds / step)):
        clock.t += step
        for w in ws:
            w.beat()


def test_the_peer_watch_names_a_silent_process_a_failed_one_and_one_that_finished_alone():
    """Three processes on one store, --heartbeat-timeout 1 s: while all beat, nothing is said. Process 1 stops
    beating (killed): named once 1 s has passed with no beat, not before. A process that says it failed is named
    after one more round. One that finished (`done`) while this one runs on is named after the timeout (the
    processes disagree on where the run ends)."""
    store, clock = Store(), Clock()
    w = watches(store, clock, 3)
    rounds(w, clock, 3.0)
    assert [x.verdict() for x in w] == [None, None, None]   # all alive, for 3 timeouts
    rounds([w[0], w[2]], clock, 0.9)                        # process 1 is silent for 0.9 s: not yet
    assert w[0].verdict() is None and w[2].verdict() is None
    rounds([w[0], w[2]], clock, 0.3)
    assert w[0].verdict() == ("process 1 of 3 sent no heartbeat for 1 s (--heartbeat-timeout): it exited or was "
                              "killed (see its log)") == w[2].verdict()

    store, clock = Store(), Clock()
    w = watches(store, clock, 3)
    rounds(w, clock, 0.5)
    w[1].close(done=False)   # an error on process 1
    w[0].beat()
    assert w[0].verdict() is None   # said just now: process 0 may be stopping on the same error
    rounds([w[0], w[2]], clock, 0.2)
    assert w[0].verdict() == "process 1 of 3 stopped with an error (see its log)"

    store, clock = Store(), Clock()
    w = watches(store, clock, 2)
    rounds(w, clock, 0.5)
    w[1].close(done=True)    # process 1 finished; process 0 runs on (another --steps)
    rounds([w[0]], clock, 0.9)
    assert w[0].verdict() is None
    rounds([w[0]], clock, 0.2)
    assert w[0].verdict() == ("process 1 of 2 finished the run more than 1 s ago (--heartbeat-timeout) and this one "
                              "has not: were all processes given the same command?")


def test_a_finished_process_watches_the_others_until_it_exits():
    """A process that finished waits in JAX's shutdown at exit for the others: one that goes silent meanwhile is
    named (no wait until JAX's shutdown deadline); the coordinator going away then is not (it ends too), nor are
    the others finishing."""
    store, clock = Store(), Clock()
    w = watches(store, clock, 3)
    rounds(w, clock, 0.5)
    w[0].close(done=True)
    w[2].close(done=True)
    rounds(w, clock, 0.5)
    assert w[0].beats and store.data[f"{mesh.PeerWatch.PREFIX}0"] == "done"   # its counter no longer moves
    rounds([w[0]], clock, 1.2)                                               # process 1 silent
    assert w[0].verdict() == ("process 1 of 3 sent no heartbeat for 1 s (--heartbeat-timeout): it exited or was "
                              "killed (see its log)")
    w[1].close(done=True)
    rounds([w[0]], clock, 0.2)
    assert w[0].verdict() is None                                            # all finished
    store.up = False
    rounds([w[0]], clock, 2.0)
    assert w[0].verdict() is None                                            # the service ends with JAX's shutdown


def test_the_peer_watch_says_when_the_coordinator_is_gone():
    store, clock = Store(), Clock()
    w = watches(store, clock, 2)
    rounds(w, clock, 0.5)
    store.up = False   # process 0, which holds the service, was killed
    rounds(w[1:], clock, 0.9)
    assert w[1].verdict() is None
    rounds(w[1:], clock, 0.2)
    assert w[1].verdict() == ("the coordinator at 127.0.0.1:1 (process 0) has not answered for 1 s: it exited or "
                              "was killed (see its log), or the network failed")
    assert mesh.peer_lost(w[1].verdict(), 1).endswith(STOPS.replace("process 0", "process 1"))


def wait_for(cond, seconds: float) -> bool:
    """Poll `cond` until it holds or `seconds` have passed (a deadline against a hang, not a measured time)."""
    end = time.monotonic() + seconds
    while not cond() and time.monotonic() < end:
        time.sleep(0.02)
    return bool(cond())


def test_the_peer_watch_ends_the_process_with_one_line(monkeypatch):
    """Its threads: a verdict ends the process (exit 1) with the line `peer_lost` makes; a process that is ending
    of its own accord (closed after an error) says nothing more."""
    ended = []
    monkeypatch.setattr(mesh, "end", lambda line, code: ended.append((line, code)))
    store = Store()
    w = mesh.PeerWatch(0.5, client=store, process=0, count=2, where="127.0.0.1:1")
    assert wait_for(lambda: ended, 30.0)   # process 1 never beats
    w.close(done=False)
    assert ended[0] == (f"error: process 1 of 2 sent no heartbeat for 0.5 s (--heartbeat-timeout): it exited or "
                        f"was killed (see its log){STOPS}", 1)
    count = len(ended)
    w._fire("anything")   # failed here: ending of its own accord, with its own message
    assert len(ended) == count


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


def test_the_processes_agree_on_the_command_and_on_the_checkpoint_lock(tmp_path):
    """Processes given different numbers (--seed, --steps, --ckpt-dir) all stop at start (exit 2) with the same line
    naming each differing flag and its value on each process. A second run in a --ckpt-dir another run holds: every
    process refuses with process 0's line (the lock is decided once, by process 0, and shared)."""
    procs = processes(["--steps", 4], per_process=lambda i: ["--seed", i, "--steps", 4 + i, "--ckpt-dir",
                                                             tmp_path / f"c{i}", "--metrics", tmp_path / f"m{i}"])
    outs = finish(procs)
    assert [p.returncode for p in procs] == [2, 2], [o[1][-3000:] for o in outs]
    said = {o[1] for o in outs}
    assert said == {f"error: the 2 processes were not started with the same command (--ckpt-dir: process 0 "
                    f'"{tmp_path / "c0"}", process 1 "{tmp_path / "c1"}"; --seed: process 0 0, process 1 1; --steps: '
                    f"process 0 4, process 1 5): every process must run the same command (only "
                    f"--coordinator-timeout, --distributed, --force, --heartbeat-timeout, --log-every, "
                    f"--max-drop-warn, --metrics, --tensorboard may differ)\n"}, said   # --metrics may differ

    ckpt = tmp_path / "held"
    ckpt.mkdir()
    with DirLock(ckpt):   # another run (this test) holds the directory
        procs = processes(["--steps", 4, "--ckpt-dir", ckpt])
        outs = finish(procs)
    assert [p.returncode for p in procs] == [2, 2], [o[1][-3000:] for o in outs]
    for _, stderr in outs:
        assert stderr.startswith(f"error: {ckpt} is in use by another run (pid {os.getpid()} on ") and \
            stderr.count("\n") == 1, stderr


@pytest.mark.slow
@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_process_stops_the_other_and_resume_continues(tmp_path, reference, killed):
    """SIGKILL to one process mid-run (0: the coordinator, whose service lives on in its host process) ends the
    other with one line and exit 1, no C++ abort; one process on another mesh resumes what the two wrote."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    procs = processes(["--mesh", "fsdp=4", "--steps", 1000, "--ckpt-dir", ckpt, "--ckpt-every", 2,
                       "--metrics", metrics, "--heartbeat-timeout", HEARTBEAT])
    survivor = procs[1 - killed]
    try:
        deadline, seen = time.monotonic() + DEADLINE, []
        for line in procs[killed].stdout:
            seen.append(line)
            if line.startswith("step      3") or time.monotonic() > deadline:
                break
        assert seen and seen[-1].startswith("step      3"), "".join(seen)[-3000:] + procs[1].stderr.read()[-3000:]
        if not (ckpt / LOCK_NAME).exists():
            pytest.fail("no lock while both processes train:\n" + "\n".join(
                o[0][-2000:] + o[1][-3000:] for o in finish(procs, timeout=HEARTBEAT + 60)))
        holder = json.loads((ckpt / LOCK_NAME).read_text())   # the run's checkpoint lock is process 0's
        procs[killed].send_signal(signal.SIGKILL)
        stdout, stderr = finish([survivor], timeout=HEARTBEAT + 60)[0]   # a deadline: a hang fails here
    finally:
        finish(procs, timeout=10)
    assert survivor.returncode == 1, stdout[-2000:] + stderr[-3000:]
    stops = STOPS.replace("process 0", f"process {1 - killed}")
    said = stderr.splitlines()[-1]   # the watch's line, or gloo's error if the collective saw the reset first
    assert said in (f"error: process {killed} of 2 sent no heartbeat for {HEARTBEAT} s (--heartbeat-timeout): it "
                    f"exited or was killed (see its log){stops}",) or (
        said.startswith("error: a collective with the other processes failed (") and said.endswith(stops)), said
    assert "Terminating process" not in stderr and "Traceback" not in stderr, stderr[-3000:]
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


def test_a_killed_coordination_service_ends_every_process_with_one_line(tmp_path):
    """SIGKILL to the coordination service's own process (process 0's child) mid-run: JAX's clients would abort
    both processes from C++ at once; each exits 1 with one line instead, the relay's (`recipes.train.processes.relay`)
    or, when the other process's exit reset the collective first, the failed collective's."""
    port = free_port()
    procs = processes(["--mesh", "fsdp=4", "--steps", 1000, "--heartbeat-timeout", HEARTBEAT], port=port)
    try:
        seen = []
        for line in procs[0].stdout:
            seen.append(line)
            if line.startswith("step      2"):
                break
        host = coordinator.serving(port)
        assert host is not None and host[1] == procs[0].pid, "".join(seen)[-3000:]
        os.kill(host[0], signal.SIGKILL)
        outs = finish(procs, timeout=HEARTBEAT + 60)
    finally:
        finish(procs, timeout=10)
    assert [p.returncode for p in procs] == [1, 1], [o[1][-3000:] for o in outs]
    for i, (_, stderr) in enumerate(outs):
        assert "Terminating process" not in stderr and "Traceback" not in stderr, stderr[-3000:]
        said = stderr.splitlines()[-1]   # the relay's line, or gloo's if the other process's exit came first
        assert said.startswith((f"error: the coordination service at 127.0.0.1:{port} (process 0's) closed its "
                                f"connection and answers no new one (",
                                "error: a collective with the other processes failed (")) and said.endswith(
            STOPS.replace("process 0", f"process {i}")), said
    assert any("coordination service" in o[1] for o in outs)
