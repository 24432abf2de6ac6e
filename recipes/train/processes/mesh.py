"""The main job's mesh: `--mesh fsdp=2,tp=1,ep=1`, multi-host start-up, and each host's part of the batch.

    python -m recipes.train --mesh fsdp=4,tp=2 ...     # axes dp, fsdp, tp, ep; product = the device count
    python -m recipes.train ...                        # default: every device on fsdp

The mesh and its rules are `zoo.sharding`'s; around them:

- `resolve(spec, model_cfg, batch)`: the mesh, checked against the model and the global batch (ValueError naming both
  numbers, before anything compiles).
- `maybe_initialize(flag)`: `jax.distributed.initialize()` with `--distributed` or `JAX_COORDINATOR_ADDRESS`
  (`JAX_NUM_PROCESSES`, `JAX_PROCESS_ID`), before JAX touches a device; process 0 checks its port first (`check_port`)
  and hosts the coordination service in a process of its own (`recipes.train.processes.coordinator`), each client
  reaching it through a relay (`recipes.train.processes.relay`), so a dead process 0 or service ends the others with a
  message.
- `PeerWatch(timeout)`: a process that stops, fails or finishes alone ends the others with one line
  (`--heartbeat-timeout`) instead of leaving them waiting in a collective.
- `put_batch(batch, mesh)`: every process makes the same global batch; each keeps the rows its devices hold
  (`local_rows`) and `jax.make_array_from_process_local_data` assembles the global array.
"""
from __future__ import annotations

import contextlib
import errno
import math
import os
import socket
import threading
import time

import jax
import numpy as np

from recipes.train.processes import coordinator, relay
from zoo import sharding

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"


def wants_distributed(flag: bool) -> bool:
    return bool(flag) or bool(os.environ.get(COORDINATOR_ENV))


def maybe_initialize(flag: bool, timeout: float = 300.0, heartbeat: float = 60.0) -> bool:
    """`jax.distributed.initialize()` with the process count and index from JAX_NUM_PROCESSES / JAX_PROCESS_ID
    when they are set (else JAX's cluster auto-detection); True if it ran. ValueError in one line for a bad
    variable or a start-up JAX refuses; waiting for the coordinator (or, on process 0, for every process to
    connect) is said first and ends after `timeout` seconds with a message (`coordinator_watchdog`): JAX's own
    timeout aborts the process with a C++ stack trace instead. JAX's heartbeat deadline is set past `heartbeat`,
    the one `PeerWatch` keeps, for the same reason."""
    if not wants_distributed(flag):
        return False
    for name, value in (("--coordinator-timeout", timeout), ("--heartbeat-timeout", heartbeat)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value}")
    kwargs = {name: _env_int(var, lowest) for name, var, lowest in (("num_processes", "JAX_NUM_PROCESSES", 1),
                                                                   ("process_id", "JAX_PROCESS_ID", 0))
              if os.environ.get(var)}
    if kwargs.get("process_id", 0) >= kwargs.get("num_processes", float("inf")):
        raise ValueError(f"JAX_PROCESS_ID={kwargs['process_id']} must be less than JAX_NUM_PROCESSES="
                         f"{kwargs['num_processes']} (processes count from 0)")
    where = os.environ.get(COORDINATOR_ENV) or "the cluster's coordinator (detected: SLURM, Open MPI, ...)"
    who = (f"process {kwargs['process_id']} of {kwargs['num_processes']}" if len(kwargs) == 2 else "this process")
    if kwargs.get("process_id") == 0 and os.environ.get(COORDINATOR_ENV):
        check_port(os.environ[COORDINATOR_ENV])
    print(f"distributed: {who} waiting up to {timeout:g} s for {where} and every process (--coordinator-timeout)",
          flush=True)
    # Process 0's coordination service in a process of its own (`recipes.train.processes.coordinator`): it outlives
    # process 0, so that the others end with a message when process 0 dies, not in a C++ abort; and every client reaches
    # it through a relay (`recipes.train.processes.relay`) that ends this process with a message when the service
    # itself dies.
    def lost(why: str) -> None:
        end(f"error: {peer_lost(why, _process_id(kwargs))}", 1)

    with coordinator_watchdog(timeout, where), coordinator.use_hosted(grace=heartbeat + 10, timeout=timeout), \
            relay.use_relay(lost):
        try:   # JAX's own deadline a little later than ours, so that our message is the one a user reads
            jax.distributed.initialize(initialization_timeout=int(math.ceil(timeout)) + 30,
                                       heartbeat_timeout_seconds=int(math.ceil(heartbeat)) + 30, **kwargs)
        except coordinator.Taken:
            raise
        except (ValueError, RuntimeError) as e:
            raise ValueError(f"--distributed: JAX could not start the processes: {first_line(e)}") from None
    return True


def _process_id(kwargs: dict) -> int:
    """This process's index, without asking JAX's backend (which a thread must not start)."""
    if "process_id" in kwargs:
        return kwargs["process_id"]
    from jax._src import distributed
    return distributed.global_state.process_id


def check_port(address: str) -> None:
    """Process 0 serves the coordination service on the port of `address` (on every interface, as JAX binds it,
    or on JAX_COORDINATOR_BIND_ADDRESS): ValueError in one line if another program holds it (gRPC would log
    "Failed to add port" and the process crash). A port left in TIME_WAIT by an earlier run counts as free."""
    bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS") or f"[::]:{address.rsplit(':', 1)[-1]}"
    host, _, port_text = bind.rpartition(":")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"{COORDINATOR_ENV}={address!r}: the port {port_text!r} is not a number") from None
    host = host.strip("[]") or "::"
    error = _bind(host, port)
    held = coordinator.serving(port) if error is not None else None
    if held is not None:   # another process 0, of this run or another, serves it
        raise ValueError(coordinator.taken(port, *held))
    left = coordinator.lingering(port) if error is not None else None
    if left is not None:   # an earlier run's coordination service, serving its last processes a little longer
        print(f"distributed: port {port} is still served by the coordination service of an earlier run (pid "
              f"{left[0]}) for at most {left[1]:.0f} s: waiting for it to end", flush=True)
        end = time.monotonic() + left[1] + 10
        while (error := _bind(host, port)) is not None and time.monotonic() < end:
            time.sleep(0.5)
    if error is not None and error.errno == errno.EAFNOSUPPORT and host == "::":   # no IPv6: JAX falls back too
        error = _bind("0.0.0.0", port)
    if error is not None:
        raise ValueError(f"process 0 cannot serve the coordinator on port {port} ({COORDINATOR_ENV}={address}): "
                         f"{error.strerror or error}; another program holds it (`ss -ltnp 'sport = :{port}'` names "
                         f"it): stop it, or give every process another port in {COORDINATOR_ENV}")


def _bind(host: str, port: int) -> OSError | None:
    """Bind (and release) `host:port` as a server would: the error, or None if it is free."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)   # [::] takes IPv4 too, as gRPC's
            s.bind((host, port))
    except OSError as e:
        return e
    return None


def _env_int(var: str, lowest: int) -> int:
    text = os.environ[var]
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{var}={text!r} is not an integer") from None
    if value < lowest:
        raise ValueError(f"{var}={value} must be >= {lowest}")
    return value


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


@contextlib.contextmanager
def coordinator_watchdog(timeout: float, where: str):
    """Exit the process (code 2, one line) if the block is still running after `timeout` seconds. A thread, since
    the wait is inside JAX's C++ client (which releases the GIL while it waits)."""
    def fire():
        os.write(2, f"error: no coordinator at {where} after {timeout:g} s, or not every process connected "
                    f"(--coordinator-timeout): is process 0 running, is the address reachable from here, and do "
                    f"all processes agree on JAX_NUM_PROCESSES?\n".encode())
        os._exit(2)
    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class PeerWatch:
    """Several processes: each publishes a counter in JAX's coordination service (its key-value store) every
    `timeout / 10` seconds (at most 5) and reads everyone's. This process ends (one line on stderr, exit 1) when
    - a process says it failed (`close(done=False)`: an error on that process): at once;
    - a process's counter has not moved for `timeout` seconds (killed, crashed, stuck in the host), or the
      coordinator has not answered for as long;
    - a process finished the run (`close(done=True)`) and this one is still running `timeout` seconds later (the
      processes disagree on where the run ends: without this, this one would wait in a collective forever).
    A finished process watches on while JAX's shutdown at exit waits for the others (a silent one ends it).
    Without it the others wait in the step's collective (gloo on the CPU has no deadline) until JAX's heartbeat
    aborts them with a C++ stack trace.

    Reading each process's liveness, not the step's progress: a long step, evaluation or checkpoint never trips
    it. The publishing thread needs the GIL every few seconds; JAX releases it while it compiles and runs."""

    PREFIX = "offload_zoo/alive/"

    def __init__(self, timeout: float, *, client=None, process: int | None = None, count: int | None = None,
                 where: str | None = None, clock=time.monotonic, start: bool = True):
        self.timeout, self.interval = timeout, min(5.0, timeout / 10)
        self.client = client if client is not None else _coordination_client()
        self.me = jax.process_index() if process is None else process
        self.n = jax.process_count() if count is None else count
        self.where = where or os.environ.get(COORDINATOR_ENV) or "the coordinator"
        self.clock, self.beats = clock, 0
        now = clock()
        self.seen = {p: (None, now) for p in range(self.n) if p != self.me}   # peer: (what it said, since when)
        self.contact = now                       # the last round trip to the coordinator that answered
        self.said: str | None = None              # "done" or "failed", once this process said it
        self.saying = threading.Lock()            # held while this process says something
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._publish, daemon=True, name="peer-watch-publish"),
                        threading.Thread(target=self._check, daemon=True, name="peer-watch-check")]
        if start and self.client is not None and self.n > 1:
            for t in self.threads:
                t.start()

    def beat(self) -> None:
        """One round: say this process is alive (its counter moves; once it said it finished, nothing), read what
        every process said."""
        self.beats += 1
        try:
            with self.saying:
                if self.said is None:
                    self.client.key_value_set(f"{self.PREFIX}{self.me}", str(self.beats), allow_overwrite=True)
            values = dict(self.client.key_value_dir_get(self.PREFIX))
        except Exception:   # the coordinator did not answer: `contact` says for how long
            return
        now = self.clock()
        self.contact = now
        for key, value in values.items():
            peer = int(key.rsplit("/", 1)[-1])
            if peer in self.seen and value != self.seen[peer][0]:
                self.seen[peer] = (value, now)   # a counter that moved, or "done" / "failed" said

    def verdict(self) -> str | None:
        """Why this process must stop now (the others' state, as last read), or None."""
        now = self.clock()
        if self.said == "done" and now - self.contact > self.timeout:
            return None   # finished, in JAX's shutdown at exit: the coordinator may be gone already, as it ends
        if now - self.contact > self.timeout:
            return (f"the coordinator at {self.where} (process 0) has not answered for {self.timeout:g} s: it exited "
                    f"or was killed (see its log), or the network failed")
        seen = list(self.seen.items())
        # (a failed process is named after one more round: a process stopping on the same error, an agreement of
        # all, prints its own message first)
        failed = [p for p, (said, since) in seen if said == "failed" and now - since >= self.interval]
        silent = [p for p, (said, since) in seen if said not in ("done", "failed") and now - since > self.timeout]
        finished = [p for p, (said, since) in seen if said == "done" and now - since > self.timeout]
        if failed:
            return f"process {', '.join(map(str, failed))} of {self.n} stopped with an error (see its log)"
        if silent:
            return (f"process {', '.join(map(str, silent))} of {self.n} sent no heartbeat for {self.timeout:g} s "
                    f"(--heartbeat-timeout): it exited or was killed (see its log)")
        if finished and self.said != "done":
            return (f"process {', '.join(map(str, finished))} of {self.n} finished the run more than "
                    f"{self.timeout:g} s ago (--heartbeat-timeout) and this one has not: were all processes given "
                    f"the same command?")
        return None

    def _publish(self) -> None:
        while not self.stop.is_set():
            self.beat()
            self.stop.wait(self.interval)

    def _check(self) -> None:
        while not self.stop.wait(self.interval):
            why = self.verdict()
            if why is not None:
                self._fire(why)

    def _fire(self, why: str) -> None:
        if self.stop.is_set():   # this process is ending of its own accord: its message is the one to read
            return
        end(f"error: {peer_lost(why, self.me)}", 1)

    def close(self, done: bool) -> None:
        """Tell the others (best effort) that this process finished (`done`) or failed. A failed process stops
        watching; a finished one watches on through JAX's shutdown at exit, which waits for every process: a
        process that goes silent meanwhile still ends it with a message."""
        if not done:
            self.stop.set()
        if self.client is not None and self.n > 1:
            got = self.saying.acquire(timeout=10)   # no counter of the publishing thread lands after this
            try:
                self.said = "done" if done else "failed"
                with contextlib.suppress(Exception):
                    self.client.key_value_set(f"{self.PREFIX}{self.me}", self.said, allow_overwrite=True)
            finally:
                if got:
                    self.saying.release()


def end(line: str, code: int) -> None:
    """End this process now with one line on stderr, from any thread (no cleanup: the others wait for nothing)."""
    os.write(2, f"{line}\n".encode())
    os._exit(code)


def peer_lost(why: str, process: int | None = None) -> str:
    """The line a process prints when the run cannot go on because another process is gone."""
    me = jax.process_index() if process is None else process
    return (f"{why}; process {me} stops too. Start every process again with --resume to continue from the last "
            f"checkpoint")


def _coordination_client():
    """JAX's client of the coordination service, or None (not started, or not where this JAX keeps it): it has no
    public name; orbax reaches it the same way."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(getattr(distributed, "global_state", None), "client", None)


def check_backend() -> None:
    """ValueError in one line when JAX cannot start its backend (e.g. JAX_PLATFORMS=cuda on a machine without a
    GPU); JAX would raise it from the first call that touches a device, with a traceback."""
    try:
        jax.devices()
    except Exception as e:   # RuntimeError, or an AssertionError for a platform no plugin provides
        why = first_line(e) if str(e).strip() else "no installed JAX plugin provides it"
        raise ValueError(f"JAX cannot start a backend for JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}: "
                         f"{why}") from None


def resolve(spec: str | None, model_cfg, batch: int):
    """The mesh of `spec` over every device (of every process), checked against the model and the global batch."""
    try:
        sizes = sharding.parse_mesh(spec, jax.device_count())    # ValueError: unknown axis, wrong product
    except ValueError as e:
        if jax.default_backend() != "cpu" or "product of the axes" not in str(e):
            raise
        n = math.prod(int(part.split("=")[1]) for part in spec.split(",") if "=" in part)
        raise ValueError(f"{e}. On the CPU, XLA_FLAGS=--xla_force_host_platform_device_count={n} makes {n} fake "
                         f"devices (set before the command: they share the machine's cores and RAM, so use them to "
                         f"check a mesh, not to train fast)") from None
    sharding.check_mesh(model_cfg, sizes, batch=batch)        # ValueError: a model dimension or the batch
    return sharding.make_mesh(sizes)


def describe(mesh) -> str:
    return sharding.format_mesh(sharding.mesh_sizes(mesh))


def local_rows(global_shape: tuple[int, ...], s: jax.sharding.Sharding) -> slice:
    """The rows (first axis) of a `global_shape` array under sharding `s` that this process's devices hold: one
    contiguous range (the data axes are outermost in the mesh, so a process's devices hold adjacent rows)."""
    index = s.addressable_devices_indices_map(global_shape)
    starts = [ix[0].start or 0 for ix in index.values()]
    stops = [global_shape[0] if ix[0].stop is None else ix[0].stop for ix in index.values()]
    lo, hi = min(starts), max(stops)
    held = sum(b - a for a, b in set(zip(starts, stops)))
    if held != hi - lo:
        raise ValueError(f"this process's devices hold non-adjacent rows of the batch: "
                         f"{sorted(set(zip(starts, stops)))}")
    return slice(lo, hi)


def put_batch(batch: dict[str, np.ndarray], mesh) -> dict[str, jax.Array]:
    """Each array of the global `batch` as a jax.Array sharded over the data axes (`zoo.sharding.batch_sharding`);
    with several processes, each contributes only its own rows."""
    out = {}
    for key, x in batch.items():
        s = sharding.batch_sharding(mesh, ndim=x.ndim)
        if jax.process_count() == 1:
            out[key] = jax.device_put(x, s)
        else:
            out[key] = jax.make_array_from_process_local_data(s, x[local_rows(x.shape, s)], x.shape)
    return out
