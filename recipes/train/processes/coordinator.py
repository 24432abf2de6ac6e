"""Several processes: JAX's coordination service hosted in a small process of its own, beside process 0.

`jax.distributed.initialize()` runs the coordination service inside process 0; when process 0 dies, every other
process's JAX client aborts from C++ with no message. Hosted in a process of its own (`start`: `python -m
recipes.train.processes.coordinator`), the service outlives process 0, so the others end with one line
(`recipes.train.processes.mesh.PeerWatch`). The host claims its port (`flock` on a pid file: a second process 0 is
refused naming the first, `serving`), serves until process 0 says `shutdown` or `grace` seconds after it is gone
(`lingering`), and ignores SIGINT and SIGTERM. `use_hosted` lets `initialize` run with JAX's own service constructor
replaced (`recipes.train.processes.jaxlib`); with mTLS or recoverability asked for, the service stays in process 0.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from recipes.train.processes import jaxlib


class Taken(ValueError):
    """Another process 0 serves the port (`taken`)."""


class Hosted:
    """The service's host process, as `jax.distributed`'s `global_state.service` (its `shutdown()` is called by JAX's
    shutdown at exit)."""

    def __init__(self, proc: subprocess.Popen, log: str):
        self.proc, self.log = proc, log

    def shutdown(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write(b"shutdown\n")
            self.proc.stdin.flush()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _file(port: int | str, ext: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"offload-zoo-coordinator-{port}.{ext}")


def _host(port: int | str) -> tuple[int, float, int] | None:
    """(pid, until, its process 0's pid) of the live host that claimed `port` (`until`: 0 while its process 0
    runs, else the time it stops serving), or None."""
    try:
        with open(_file(port, "pid")) as f:
            pid, until, parent = f.read().split()
        os.kill(int(pid), 0)
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            if b"recipes.train.processes.coordinator" not in f.read():
                return None
    except (OSError, ValueError):
        return None
    return int(pid), float(until), int(parent)


def lingering(port: int) -> tuple[int, float] | None:
    """(pid, seconds left) of a host of an earlier run still serving `port` after its process 0 ended (it serves
    `grace` seconds more), or None."""
    host = _host(port)
    if host is None or not host[1]:
        return None
    return host[0], max(0.0, host[1] - time.time())


def serving(port: int) -> tuple[int, int] | None:
    """(host pid, its process 0's pid) of a host serving `port` for a process 0 that runs, or None."""
    host = _host(port)
    return None if host is None or host[1] else (host[0], host[2])


def taken(port: int | str, pid: int | None, parent: int | None) -> str:
    """The refusal of a second process 0 for a port another one serves (`pid`, `parent`: None while the other's host
    has not yet written them)."""
    who = f"pid {parent}; the service's pid {pid}" if pid else "its pid not yet known: it is starting"
    return (f"port {port} is already served by the coordination service of another process 0 ({who}): were two "
            f"processes started with JAX_PROCESS_ID=0? Give each process its own "
            f"JAX_PROCESS_ID (0 to JAX_NUM_PROCESSES-1), or this run another port in JAX_COORDINATOR_ADDRESS")


def start(bind: str, count: int, *, heartbeat: int, shutdown: int, grace: float, timeout: float) -> Hosted:
    """Start the host and wait (up to `timeout` seconds) until its service is bound. ValueError in one line if it
    could not start (the port taken since it was checked, ...)."""
    log = _file(bind.rsplit(':', 1)[-1], "log")
    with open(log, "ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "recipes.train.processes.coordinator", bind, str(count),
                                 str(heartbeat), str(shutdown), str(grace)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    os.environ.get("PYTHONPATH")]))})
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
    if line != "ready":
        proc.kill()
        proc.wait()
        if line.split()[:1] == ["taken"]:   # "taken PID PARENT" (or no pids yet): another process 0 claimed the port
            pids = [int(w) for w in line.split()[1:3]]
            raise Taken(taken(bind.rsplit(":", 1)[-1], *(pids if len(pids) == 2 else (None, None))))
        raise ValueError(f"the coordination service for {bind} did not start ({line or 'no answer'}; its log: {log})")
    return Hosted(proc, log)


def use_hosted(**options):
    """Within the block, `jax.distributed.initialize()` on process 0 starts the service in a host process (`start`
    with `options`) instead of in this one."""
    def hosted(original: Callable) -> Callable:
        def get_distributed_runtime_service(address, num_nodes, **kwargs):
            if any(v for k, v in kwargs.items() if k not in ("heartbeat_timeout", "shutdown_timeout")):
                # mTLS credentials, recoverability: JAX's own service in this process, as configured
                return original(address, num_nodes, **kwargs)
            return start(address, num_nodes, heartbeat=kwargs.get("heartbeat_timeout") or 100,
                         shutdown=kwargs.get("shutdown_timeout") or 300, **options)
        return get_distributed_runtime_service
    return jaxlib.replaced("get_distributed_runtime_service", hosted)


def _claimed(claim: int, wait: float = 2.0) -> list[int] | None:
    """(pid, until, parent) that the host holding the claim wrote in it; it may not have yet (it locks the file, then
    writes): read again for up to `wait` seconds, then None."""
    end = time.monotonic() + wait
    while True:
        held = os.pread(claim, 200, 0).split()
        if len(held) == 3:
            with contextlib.suppress(ValueError):
                return [int(held[0]), float(held[1]), int(held[2])]
        if time.monotonic() > end:
            return None
        time.sleep(0.05)


def serve(bind: str, count: int, heartbeat: int, shutdown: int, grace: float) -> int:
    """The host process: serve until told to shut down, or `grace` seconds after process 0 is gone."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    pidfile = _file(bind.rsplit(":", 1)[-1], "pid")
    claim = os.open(pidfile, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)   # held (flock) while this host lives

    def say(until: float) -> None:   # who serves the port, for whom, and until when (0: while process 0 runs)
        os.ftruncate(claim, 0)
        os.pwrite(claim, f"{os.getpid()} {until} {os.getppid()}".encode(), 0)

    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        held = _claimed(claim)
        print(f"taken {held[0]} {held[2]}" if held else "taken", flush=True)
        return 1
    say(0)
    from jax._src.lib import _jax
    try:
        service = _jax.get_distributed_runtime_service(bind, count, heartbeat_timeout=heartbeat,
                                                       shutdown_timeout=shutdown)
    except Exception as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", flush=True)
        return 1
    print("ready", flush=True)
    said = sys.stdin.buffer.readline()   # b"shutdown\n", or b"" when process 0 is gone
    if said.strip() != b"shutdown":   # say until when it serves: a new run on this port waits for it
        say(time.time() + grace)
        time.sleep(grace)
    service.shutdown()
    with contextlib.suppress(OSError):
        os.unlink(pidfile)
    return 0


if __name__ == "__main__":
    bind_, count_, heartbeat_, shutdown_, grace_ = sys.argv[1:6]
    sys.exit(serve(bind_, int(count_), int(heartbeat_), int(shutdown_), float(grace_)))
