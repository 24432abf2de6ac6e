"""Several processes: this process's JAX client reaches the coordination service through a relay of its own, so
that the service's death ends the process with one line instead of a C++ abort.

JAX's client holds a long-polling call open to the coordination service (`PollForError`). When the service's
process dies (killed, crashed, its machine gone), the connection closes, the call fails at once and the client
aborts the process from C++ ("Terminating process because the JAX distributed service detected fatal errors",
SIGABRT, a C++ stack). JAX's hook for that (`missed_heartbeat_callback`) cannot be given a Python function: the
status it passes has no Python type (std::bad_cast, another abort). So the client connects to a port on 127.0.0.1
that this process serves, and each of its connections is carried to the service by two threads. When the
service's side closes or fails, the client's side is held open while the relay asks the service for a new
connection: none (the service is gone) calls `lost(why)` (default: end this process now, one line, exit 1), before
JAX can see anything. A service that still answers closed one connection of its own accord: the client's side is
closed too, as a direct connection would be. Once this process is leaving (`leave()`, at exit: JAX's shutdown,
when the service ends with the run) nothing more is said.

`use_relay(lost)`: within the block, `jax.distributed.initialize()` connects its client through a relay (not when
the client is given mTLS credentials: it checks the address it connects to).
"""
from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
from collections.abc import Callable

from recipes.train.processes import jaxlib

PROBE_TIMEOUT = 10.0   # seconds the service may take to answer a new connection before it counts as gone
# An HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server answers with its SETTINGS frame.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
SETTINGS = 4              # the frame type at byte 3 of a frame's 9-byte header


def _end(why: str) -> None:
    os.write(2, f"error: {why}\n".encode())
    os._exit(1)


def split(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "localhost", int(port)


def gone(target: tuple[str, int], timeout: float = PROBE_TIMEOUT) -> str | None:
    """Why the gRPC server at `target` does not answer a new connection, or None if it does (it sends its
    SETTINGS frame). Accepting the connection is not enough: a killed server's port takes connections for a moment
    while the kernel closes its sockets."""
    try:
        with socket.create_connection(target, timeout=timeout) as s:
            s.sendall(PREFACE)
            head = b""
            while len(head) < 9 and (chunk := s.recv(9 - len(head))):
                head += chunk
    except OSError as e:
        return e.strerror or type(e).__name__
    return None if len(head) == 9 and head[3] == SETTINGS else "it closed a new connection unanswered"


class Relay:
    """Serves 127.0.0.1:`port` (`address`); each connection is carried to `upstream` ("host:port")."""

    def __init__(self, upstream: str, lost: Callable[[str], None] | None = None):
        self.upstream, self.target = upstream, split(upstream)
        self.lost = lost or _end
        self.leaving = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True, name="coordinator-relay").start()

    def leave(self) -> None:
        """This process is ending of its own accord: the service may end first, as it ends with the run."""
        self.leaving.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            try:
                service = socket.create_connection(self.target, timeout=PROBE_TIMEOUT)
            except OSError:   # the service is not up (yet): the client retries, as it would without the relay
                client.close()
                continue
            service.settimeout(None)
            client.settimeout(None)   # (whatever socket.setdefaulttimeout says)
            link = _Link(client, service)
            for sock in (client, service):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._carry, args=(link, client, service, False), daemon=True).start()
            threading.Thread(target=self._carry, args=(link, service, client, True), daemon=True).start()

    def _carry(self, link: _Link, src: socket.socket, dst: socket.socket, from_service: bool) -> None:
        """Bytes from `src` to `dst` until one side closes or fails."""
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = None
            if not data:   # `src` closed or failed
                return self._service_gone(link) if from_service else link.close()
            try:
                dst.sendall(data)
            except OSError:
                return link.close() if from_service else self._service_gone(link)

    def _service_gone(self, link: _Link) -> None:
        """The service's side of `link` closed or failed: is the service still there?"""
        if not link.claim():
            return
        why = None if self.leaving.is_set() else gone(self.target)
        if why is not None and not self.leaving.is_set():
            self.lost(f"the coordination service at {self.upstream} (process 0's) closed its connection and "
                      f"answers no new one ({why}): it was killed or crashed, or the network failed")
        link.shut()


class _Link:
    """One client connection and its connection to the service; closed once."""

    def __init__(self, client: socket.socket, service: socket.socket):
        self.client, self.service = client, service
        self.lock, self.claimed = threading.Lock(), False

    def claim(self) -> bool:
        with self.lock:
            first, self.claimed = not self.claimed, True
            return first

    def close(self) -> None:
        if self.claim():
            self.shut()

    def shut(self) -> None:
        for sock in (self.client, self.service):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def use_relay(lost: Callable[[str], None] | None = None):
    """Within the block, `jax.distributed.initialize()` connects its client through a `Relay` to the service."""
    def relayed(original: Callable) -> Callable:
        def get_distributed_runtime_client(address, node_id, **kwargs):
            if any(v for k, v in kwargs.items() if k.startswith("mtls_") or k == "verify_secure_credentials"):
                return original(address, node_id, **kwargs)
            relay = Relay(address, lost)
            atexit.register(relay.leave)   # runs before JAX's shutdown at exit (registered when JAX was imported)
            return original(relay.address, node_id, **kwargs)
        return get_distributed_runtime_client
    return jaxlib.replaced("get_distributed_runtime_client", relayed)
