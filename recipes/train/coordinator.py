"""Several processes: JAX's coordination service hosted in a small process of its own, beside process 0.

`jax.distributed.initialize()` runs the coordination service (the key-value store, the heartbeats, the barriers)
inside process 0. When process 0 dies (SIGKILL, an out-of-memory kill), every other process's JAX client loses the
service at once and aborts the process from C++ ("Terminating process because the JAX distributed service detected
fatal errors", exit -6): no Python code runs, no message is printed. Hosted in a process of its own, the service
outlives process 0: the other processes stay in control and end with one line, through the peers' heartbeat watch
(`recipes.train.mesh.PeerWatch`) or the failed collective, as they do when any other process dies.

`start(bind, count, ...)` starts the host (`python -m recipes.train.coordinator`): it binds the service, says `ready`,
then serves until process 0 says `shutdown` on its stdin (JAX's shutdown at exit), or until process 0 is gone
without saying it (its stdin closes): then it serves `grace` seconds more, long enough for the others to notice and
stop, and exits (a new run on that port waits for it: `lingering`). It ignores SIGINT and SIGTERM (a Ctrl-C to the
process group reaches it too): process 0 decides when it ends. Its own log (the service's C++ log lines) goes to a
file in the temporary directory.

The service is JAX's own (`jaxlib`'s `get_distributed_runtime_service`, as `jax.distributed.initialize` makes it);
`use_hosted` lets `initialize` run as usual with that one call replaced. Where this JAX has no such call, or the
service is asked for mTLS credentials or recoverability, it stays in process 0 (JAX's default).
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import tempfile
import time


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


def lingering(port: int) -> tuple[int, float] | None:
    """(pid, seconds left) of a host of an earlier run still serving `port` after its process 0 ended (it serves
    `grace` seconds more), or None."""
    try:
        with open(_file(port, "pid")) as f:
            pid, until = f.read().split()
        os.kill(int(pid), 0)
        with open(f"/proc/{int(pid)}/cmdline", "rb") as f:
            if b"recipes.train.coordinator" not in f.read():
                return None
    except (OSError, ValueError):
        return None
    return int(pid), max(0.0, float(until) - time.time())


def start(bind: str, count: int, *, heartbeat: int, shutdown: int, grace: float, timeout: float) -> Hosted:
    """Start the host and wait (up to `timeout` seconds) until its service is bound. ValueError in one line if it
    could not start (the port taken since it was checked, ...)."""
    log = _file(bind.rsplit(':', 1)[-1], "log")
    with open(log, "ab") as err:
        proc = subprocess.Popen([sys.executable, "-m", "recipes.train.coordinator", bind, str(count), str(heartbeat),
                                 str(shutdown), str(grace)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=err, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                    os.environ.get("PYTHONPATH")]))})
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
    if line != "ready":
        proc.kill()
        proc.wait()
        raise ValueError(f"the coordination service for {bind} did not start ({line or 'no answer'}; its log: {log})")
    return Hosted(proc, log)


@contextlib.contextmanager
def use_hosted(**options):
    """Within the block, `jax.distributed.initialize()` on process 0 starts the service in a host process (`start`
    with `options`) instead of in this one."""
    try:
        from jax._src import distributed
        lib = distributed._jax
        lib.get_distributed_runtime_service   # noqa: B018  (where this JAX keeps it)
    except (ImportError, AttributeError):
        yield
        return

    class Lib:   # jaxlib's module, with the service's constructor replaced
        def __getattr__(self, name):
            return getattr(lib, name)

        @staticmethod
        def get_distributed_runtime_service(address, num_nodes, **kwargs):
            if any(v for k, v in kwargs.items() if k not in ("heartbeat_timeout", "shutdown_timeout")):
                # mTLS credentials, recoverability: JAX's own service in this process, as configured
                return lib.get_distributed_runtime_service(address, num_nodes, **kwargs)
            return start(address, num_nodes, heartbeat=kwargs.get("heartbeat_timeout") or 100,
                         shutdown=kwargs.get("shutdown_timeout") or 300, **options)

    distributed._jax = Lib()
    try:
        yield
    finally:
        distributed._jax = lib


def serve(bind: str, count: int, heartbeat: int, shutdown: int, grace: float) -> int:
    """The host process: serve until told to shut down, or `grace` seconds after process 0 is gone."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)
    from jax._src.lib import _jax
    try:
        service = _jax.get_distributed_runtime_service(bind, count, heartbeat_timeout=heartbeat,
                                                       shutdown_timeout=shutdown)
    except Exception as e:
        print(f"error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", flush=True)
        return 1
    print("ready", flush=True)
    said = sys.stdin.buffer.readline()   # b"shutdown\n", or b"" when process 0 is gone
    pidfile = _file(bind.rsplit(":", 1)[-1], "pid")
    if said.strip() != b"shutdown":   # say until when it serves: a new run on this port waits for it
        with contextlib.suppress(OSError):
            with open(pidfile, "w") as f:
                f.write(f"{os.getpid()} {time.time() + grace}")
        time.sleep(grace)
    service.shutdown()
    with contextlib.suppress(OSError):
        os.unlink(pidfile)
    return 0


if __name__ == "__main__":
    bind_, count_, heartbeat_, shutdown_, grace_ = sys.argv[1:6]
    sys.exit(serve(bind_, int(count_), int(heartbeat_), int(shutdown_), float(grace_)))
