"""Several processes: start-up errors are one-line messages (exit 2; a coordinator port another program holds
among them), a process whose coordinator is not there says it is waiting and gives up after --coordinator-timeout
instead of waiting forever (or aborting with a C++ stack trace), a second process 0 is refused naming the first,
and a SIGTERM that reaches one process of two stops both after the same step, with one checkpoint of it."""
from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest

from recipes import train
from recipes.train.checkpoints.checkpoint import Checkpoints
from recipes.train.processes import coordinator, mesh
from tests.helpers import cpu_env, finish

ROOT = pathlib.Path(__file__).resolve().parents[2]
RUN = ["--batch", 2, "--seq", 16, "--set", "num_layers=1", "--log-every", 1, "--xla-flags", "none"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(process: int, port: int, **extra) -> dict:
    return cpu_env(JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                   JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(process), **extra)


@pytest.mark.parametrize("pid,message", [("abc", "JAX_PROCESS_ID='abc' is not an integer"),
                                         ("2", "JAX_PROCESS_ID=2 must be less than JAX_NUM_PROCESSES=2"),
                                         ("-1", "JAX_PROCESS_ID=-1 must be >= 0")])
def test_bad_process_variables_are_one_line_errors(monkeypatch, capsys, pid, message):
    """A malformed JAX_PROCESS_ID is refused before JAX is asked to start anything: exit 2, one line."""
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", pid)
    assert train.main(["--xla-flags", "none"]) == 2
    assert capsys.readouterr().err == f"error: {message}" + ("\n" if pid != "2" else " (processes count from 0)\n")
    with pytest.raises(ValueError, match="--coordinator-timeout must be a finite number of seconds > 0"):
        mesh.maybe_initialize(True, timeout=0)


def test_a_held_coordinator_port_is_a_one_line_error(monkeypatch, capsys):
    """Process 0 finds the coordinator's port held by another program before JAX starts anything (gRPC would fail
    to add the port and the process crash): exit 2, one line naming the port and what to do."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", f"127.0.0.1:{port}")
        monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
        monkeypatch.setenv("JAX_PROCESS_ID", "0")
        assert train.main(["--xla-flags", "none"]) == 2
    assert capsys.readouterr().err == (
        f"error: process 0 cannot serve the coordinator on port {port} (JAX_COORDINATOR_ADDRESS=127.0.0.1:{port}): "
        f"Address already in use; another program holds it (`ss -ltnp 'sport = :{port}'` names it): stop it, or "
        f"give every process another port in JAX_COORDINATOR_ADDRESS\n")


def test_a_missing_coordinator_times_out_with_a_message():
    """Process 1 of 2 with no process 0: it says it waits, and after --coordinator-timeout exits 2 with one line
    (JAX's own deadline would abort the process with a C++ check-failure stack trace)."""
    out = subprocess.run([sys.executable, "-m", "recipes.train", *map(str, RUN), "--coordinator-timeout", "2"],
                         cwd=ROOT, env=env_for(1, free_port()), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "distributed: process 1 of 2 waiting up to 2 s for 127.0.0.1:" in out.stdout
    assert out.stderr.startswith("error: no coordinator at 127.0.0.1:") and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.slow
@pytest.mark.multidevice   # two processes: scheduled first
def test_sigterm_to_one_process_stops_both_after_the_same_step(tmp_path):
    """Two processes on a loopback coordinator; SIGTERM reaches process 1 only. Both stop after the same step
    (agreed with an all-gather each step), write one checkpoint of it together and exit 143."""
    port = free_port()
    args = [sys.executable, "-m", "recipes.train", *map(str, RUN), "--steps", "100000", "--ckpt-dir",
            str(tmp_path / "ckpt"), "--coordinator-timeout", "60"]
    procs = [subprocess.Popen(args, cwd=ROOT, env=env_for(i, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in (0, 1)]
    try:
        for line in procs[1].stdout:
            if line.startswith("step      3"):
                procs[1].send_signal(signal.SIGTERM)
                break
    finally:
        outs = finish(procs, timeout=120)
    assert [p.returncode for p in procs] == [143, 143], [o[1][-2000:] for o in outs]
    said = [next(ln for ln in o[0].splitlines() if ln.startswith("SIGTERM: stopped after step")) for o in outs]
    assert said[0] == said[1], said
    step = int(said[0].split()[4].rstrip(";"))
    assert Checkpoints(tmp_path / "ckpt").steps() == [step]


def test_the_coordination_service_host_serves_until_told_and_lingers_after_process_0_is_gone():
    """The host of process 0's coordination service (`recipes.train.processes.coordinator`): it holds the port while it
    serves and ends when process 0 says `shutdown` (JAX's shutdown at exit). When process 0 is gone without saying it
    (its stdin closes), it says until when it serves on (`lingering`: a new run on that port waits for it)."""
    port = free_port()
    host = coordinator.start(f"[::]:{port}", 1, heartbeat=5, shutdown=5, grace=600, timeout=60)
    try:
        with pytest.raises(ValueError, match=f"port {port} is already served by the coordination service of another "
                                             f"process 0 "):
            mesh.check_port(f"127.0.0.1:{port}")   # held by a live run's process 0
        host.shutdown()
        assert host.proc.returncode == 0
        mesh.check_port(f"127.0.0.1:{port}")       # free again
        host = coordinator.start(f"[::]:{port}", 1, heartbeat=5, shutdown=5, grace=600, timeout=60)
        assert coordinator.lingering(port) is None
        host.proc.stdin.close()                     # process 0 gone without a word
        deadline = time.monotonic() + 60   # polls for the state; the deadline is against a hang, not a measure
        while coordinator.lingering(port) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert coordinator.lingering(port) is not None, "process 0's host never said it lingers"
        pid, left = coordinator.lingering(port)
        assert pid == host.proc.pid and 0 < left <= 600
    finally:
        host.proc.kill()
        host.proc.wait()


def test_a_second_process_0_is_refused_naming_the_first():
    """Two processes given JAX_PROCESS_ID=0 on one machine: the second cannot claim the port the first's service
    holds, whether it checks before starting (`check_port`) or races the first to start (`coordinator.start`):
    one line naming the first process 0 (their services would share the port and JAX abort in C++)."""
    port = free_port()
    host = coordinator.start(f"[::]:{port}", 2, heartbeat=5, shutdown=5, grace=600, timeout=60)
    try:
        refusal = (f"port {port} is already served by the coordination service of another process 0 (pid "
                   f"{os.getpid()}; the service's pid {host.proc.pid}): were two processes started with "
                   f"JAX_PROCESS_ID=0? Give each process its own JAX_PROCESS_ID (0 to JAX_NUM_PROCESSES-1), or this "
                   f"run another port in JAX_COORDINATOR_ADDRESS")
        assert coordinator.serving(port) == (host.proc.pid, os.getpid())
        with pytest.raises(ValueError) as e:
            mesh.check_port(f"127.0.0.1:{port}")
        assert str(e.value) == refusal
        with pytest.raises(coordinator.Taken) as e:
            coordinator.start(f"[::]:{port}", 2, heartbeat=5, shutdown=5, grace=600, timeout=60)
        assert str(e.value) == refusal
    finally:
        host.shutdown()
    assert coordinator.serving(port) is None


def test_a_second_process_0_racing_the_first_before_it_wrote_its_pid_names_no_pid_0():
    """The first host has claimed the port (its lock) but not yet written its pids, as under load: the second host
    reads on for a moment and names the pids written meanwhile; none written, it says the pid is not yet known
    (it said "pid 0; the service's pid 0")."""
    import fcntl
    import threading
    port = free_port()
    claim = os.open(coordinator._file(port, "pid"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)   # as the first host: locked, nothing written yet
        with pytest.raises(coordinator.Taken, match=r"another process 0 \(its pid not yet known: it is starting\)"):
            coordinator.start(f"[::]:{port}", 2, heartbeat=5, shutdown=5, grace=600, timeout=60)
        later = threading.Timer(0.5, lambda: os.pwrite(claim, b"4321 0 1234", 0))
        later.start()
        with pytest.raises(coordinator.Taken, match=r"another process 0 \(pid 1234; the service's pid 4321\)"):
            coordinator.start(f"[::]:{port}", 2, heartbeat=5, shutdown=5, grace=600, timeout=60)
        later.join()
    finally:
        os.close(claim)
        os.unlink(coordinator._file(port, "pid"))


@pytest.mark.slow
@pytest.mark.multidevice
def test_two_processes_started_as_process_0_each_end_with_one_line(tmp_path):
    """Both processes of a run given JAX_PROCESS_ID=0, started at once: the one whose service could not claim the
    port says so; the other says that not every process connected. Both exit 2; no C++ abort."""
    port = free_port()
    args = [sys.executable, "-m", "recipes.train", *map(str, RUN), "--steps", "2", "--coordinator-timeout", "40"]
    procs = [subprocess.Popen(args, cwd=ROOT, env=env_for(0, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in (0, 1)]
    outs = finish(procs, timeout=180)
    assert [p.returncode for p in procs] == [2, 2], [o[1][-3000:] for o in outs]
    said = sorted(o[1] for o in outs)
    assert all(s.count("\n") == 1 and "Terminating process" not in s for s in said), said
    assert said[0].startswith(f"error: no coordinator at 127.0.0.1:{port} after 40 s, or not every process "
                              f"connected"), said
    assert said[1].startswith(f"error: port {port} is already served by the coordination service of another "
                              f"process 0 (pid "), said
