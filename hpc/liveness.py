"""A rank's death seen by its closed connection, not by its heartbeat's silence.

The step supervisor (hpc.submit.supervise) listens on a TCP port and hands its address to the
step's ranks (HPCTK_LIVENESS=host:port:token); each rank connects from its first instruction and holds
the connection, sending nothing. A rank that dies (SIGKILL, a crash, every process of a node
killed) has its connection closed by its kernel at once; a node that loses power or its network
answers no TCP keepalive probe and its connections fail within KEEPALIVE_S. A rank whose
interpreter ends (an exit code, an uncaught exception) says `bye` first and is not asked about.
For any other closed connection (a signal's death, os._exit) the supervisor asks the node's
slurmd (a TCP connect to its port, `node_answers`): a node whose slurmd does not answer is lost,
and its ranks' step can end at once; one that answers lives, and srun reports what its rank did,
as before. Silence stays for hangs (the watchdog's heartbeats).

Standard library only: the rank side runs before torch is imported.
"""

from __future__ import annotations

import atexit
import os
import secrets
import selectors
import socket
import threading
from collections.abc import Callable

from hpc.env import slurm_task

LIVENESS_VARIABLE = "HPCTK_LIVENESS"  # host:port:token of the step supervisor's listener
KEEPALIVE_S = (1, 1, 3)  # idle before the first probe, between probes, probes missed: a dead host is seen in ~4 s
SLURMD_ANSWER_S = 2.0
HELLO_LIMIT = 512  # bytes a rank sends in all (token, rank, node, bye)  # a live slurmd accepts a connection within milliseconds; a lost node never does

_held: list[socket.socket] = []


def hold_from_env() -> None:
    """`hold` for a rank srun started under the step supervisor (its rank and node from Slurm)."""
    hold(os.environ.get(LIVENESS_VARIABLE), *slurm_task(os.environ))


def hold(address: str | None, rank: str, node: str) -> None:
    """Connect this rank to the step supervisor's listener and keep the connection for the
    process's life (closed in forked children: a loader worker outliving its rank must not keep
    it open). Best effort: no listener, no connection, and the rank goes on."""
    if not address or _held:
        return
    where, _, token = address.rpartition(":")
    host, _, port = where.rpartition(":")
    try:
        connection = socket.create_connection((host, int(port)), timeout=2.0)
        connection.sendall(f"{token} {rank} {node}\n".encode())
    except (OSError, ValueError):
        return
    _held.append(connection)
    os.register_at_fork(after_in_child=_let_go_in_child)
    atexit.register(say_bye)


def say_bye() -> None:
    """The interpreter ends as asked (an exit code, an exception's end): not a death to look into."""
    for connection in _held:
        try:
            connection.sendall(b"bye\n")
        except OSError:
            pass


def _let_go_in_child() -> None:
    for connection in _held:
        connection.close()
    _held.clear()


def node_answers(address: tuple[str, int], timeout_s: float = SLURMD_ANSWER_S) -> bool:
    """Whether a TCP connection to the address (a node's slurmd) is accepted within timeout_s."""
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError:
        return False
    return True


def keep_alive(connection: socket.socket) -> None:
    """TCP keepalive on a short fuse: the kernel finds a host that stopped answering."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE_S
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):  # Linux; other systems keep their defaults
            connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


class Listener:
    """The supervisor's side: accepts the ranks' connections and calls `on_closed(rank, node)`
    from its own thread once for each connection that closes or fails after a hello line with
    its token (the port is open to the network: only the job's ranks, which inherit the token in
    their environment, can have a step ended by a connection they close)."""

    def __init__(self, on_closed: Callable[[str, str], None]) -> None:
        self.on_closed = on_closed
        self.token = secrets.token_hex(16)
        self.server = socket.create_server(("", 0), backlog=4096)
        self.server.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ, None)
        self._wake, self._waker = socket.socketpair()  # close() wakes the thread at once
        self.selector.register(self._wake, selectors.EVENT_READ, None)
        self.peers: dict[socket.socket, bytes] = {}  # what each connection said so far
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="liveness", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{socket.gethostname()}:{self.server.getsockname()[1]}:{self.token}"

    def _serve(self) -> None:
        while not self._closing.is_set():
            for key, _ in self.selector.select():
                if key.fileobj is self.server:
                    self._accept()
                elif key.fileobj is self._wake:
                    return
                else:
                    self._read(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            connection, _ = self.server.accept()
        except OSError:
            return
        connection.setblocking(False)
        keep_alive(connection)
        self.peers[connection] = b""
        self.selector.register(connection, selectors.EVENT_READ, None)

    def _read(self, connection: socket.socket) -> None:
        try:
            data = connection.recv(256)
        except BlockingIOError:
            return
        except OSError:
            data = b""  # reset, or the keepalive gave up on its host
        if data and len(self.peers[connection]) + len(data) <= HELLO_LIMIT:
            self.peers[connection] += data
            return
        whole = self.peers.pop(connection)
        said = [] if data else whole.decode(errors="replace").split()  # data left over: more than a rank says, not a rank
        self.selector.unregister(connection)
        connection.close()
        if len(said) == 3 and said[0] == self.token and not self._closing.is_set():  # a hello, and no bye after it
            self.on_closed(said[1], said[2])

    def close(self) -> None:
        self._closing.set()
        self._waker.send(b"x")
        self._thread.join(timeout=5)
        for connection in [*self.peers, self.server, self._wake, self._waker]:
            connection.close()
        self.selector.close()
