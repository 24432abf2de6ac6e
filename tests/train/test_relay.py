"""The relay between a process's JAX client and the coordination service (`recipes.train.processes.relay`), on a
stand-in for the service: a loopback server that answers each new connection with an HTTP/2 SETTINGS frame, as gRPC's
does, then echoes. Bytes pass both ways; when the service is gone (its port closed), `lost` is called while the client's
connection is still open (JAX would abort on its close); a connection the service closes while it still answers
new ones is closed on the client's side too, and so is every one once the process is leaving. Each wait is for a
state (an event, a socket's end), with a deadline against a hang."""
from __future__ import annotations

import contextlib
import select
import socket
import threading

import pytest

from recipes.train.processes import relay

FRAME = bytes([0, 0, 0, relay.SETTINGS, 0, 0, 0, 0, 0])   # an empty SETTINGS frame
DEADLINE = 30.0


class Service:
    """Answers every connection with FRAME, then echoes what it receives; `close()` ends it (port and all)."""

    def __init__(self, answer: bool = True):
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.answer, self.conns = answer, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)
            if not self.answer:
                conn.close()
                continue
            conn.sendall(FRAME)
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn):
        with contextlib.suppress(OSError):
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    def drop(self, conn):
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()

    def close(self):
        self.drop(self.server)   # (shutdown first: a plain close leaves the port listening while accept() waits)
        for conn in self.conns:
            self.drop(conn)


def connect(r: relay.Relay) -> socket.socket:
    c = socket.create_connection(relay.split(r.address), timeout=DEADLINE)
    assert recv_exactly(c, len(FRAME)) == FRAME   # the service's greeting, through the relay
    return c


def recv_exactly(c: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n and (chunk := c.recv(n - len(out))):
        out += chunk
    return out


def still_open(c: socket.socket) -> bool:
    """No end of stream (and no data) waiting on `c`."""
    readable, _, _ = select.select([c], [], [], 0)
    return not readable


def test_bytes_pass_both_ways_and_a_gone_service_is_said_while_the_client_is_still_connected():
    service, said, open_then = Service(), threading.Event(), []
    def lost(why):
        open_then.append((why, still_open(client)))
        said.set()
    r = relay.Relay(service.address, lost)
    client = connect(r)
    client.sendall(b"ping")
    assert recv_exactly(client, 4) == b"ping"
    service.close()   # killed: its port and its connections close
    assert said.wait(DEADLINE)
    why, was_open = open_then[0]
    assert was_open, "the client's connection closed before `lost` was called: JAX would have aborted"
    assert why.startswith(f"the coordination service at {service.address} (process 0's) closed its connection and "
                          f"answers no new one (") and why.endswith("it was killed or crashed, or the network failed")


def test_a_connection_the_living_service_closes_is_closed_for_the_client_too():
    service, lost = Service(), []
    r = relay.Relay(service.address, lost.append)
    client = connect(r)
    service.drop(service.conns[0])   # the service ends one connection and goes on serving
    assert client.recv(1) == b""     # the client sees the end, as it would without the relay (and reconnects)
    assert lost == []
    connect(r).close()
    service.close()


def test_nothing_is_said_once_the_process_is_leaving():
    service, lost = Service(), []
    r = relay.Relay(service.address, lost.append)
    client = connect(r)
    r.leave()            # JAX's shutdown at exit: the service ends with the run
    service.close()
    assert client.recv(1) == b""
    assert lost == []


@pytest.mark.parametrize("answer", [False, None])
def test_a_port_that_takes_connections_but_does_not_answer_is_gone(answer):
    """A killed server's port may take a connection for a moment: only its SETTINGS frame says it lives."""
    service = Service(answer=answer is None)
    if answer is None:
        service.close()
    why = relay.gone(relay.split(service.address), timeout=DEADLINE)
    assert why in (("it closed a new connection unanswered", "Connection reset by peer") if answer is False
                   else ("Connection refused",)), why
    live = Service()
    assert relay.gone(relay.split(live.address), timeout=DEADLINE) is None
    live.close()
    service.close()
