"""A rank's death seen by its closed connection, not by its heartbeat's silence.

The step supervisor (hpc.slurm.supervise) listens on a TCP port and hands its address to the
step's ranks (HPCTK_LIVENESS=host:port:token); each rank connects from its first instruction and holds
the connection, sending nothing. A rank that dies (SIGKILL, a crash, every process of a node
killed) has its connection closed by its kernel at once; a node that loses power or its network
answers no TCP keepalive probe and its connections fail after KEEPALIVE_S (~15 s). A rank whose
interpreter ends (an exit code, an uncaught exception) says `bye` first and is not asked about.
For any other closed connection (a signal's death, os._exit) the supervisor asks the node's
slurmd (a TCP connect to its port, `node_answers`): a node whose slurmd does not answer is lost,
and its ranks' step can end at once; one that answers lives, and srun reports what its rank did,
as before. Silence stays for hangs (the watchdog's heartbeats).

Standard library only (and hpc.env, a leaf): the rank side runs before torch is imported.
"""

from __future__ import annotations

import atexit
import errno
import os
import secrets
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from hpc.env import task_place

LIVENESS_VARIABLE = "HPCTK_LIVENESS"  # host:port:token of the step supervisor's listener
# Idle before the first probe, between probes, probes missed: a host that stopped answering is
# seen in ~15 s (the heartbeat's silence took as long), while a network blip of a few seconds (a
# subnet manager's sweep, a bond's failover) closes nothing.
KEEPALIVE_S = (5, 2, 5)
SLURMD_ANSWER_S = 2.0  # a live slurmd accepts a connection within milliseconds; a lost node never does
SLURMD_TRIES = 2  # a timed-out connect is tried once more, SLURMD_RETRY_S later
SLURMD_RETRY_S = 0.25
HELLO_LIMIT = 512  # bytes a rank sends in all (token, rank, node, bye)

_held: list[socket.socket] = []
_registered: list[bool] = []


def hold_from_env() -> None:
    """`hold` for a rank srun started under the step supervisor (its rank and node from Slurm)."""
    hold(os.environ.get(LIVENESS_VARIABLE), *task_place(os.environ))


def hold(address: str | None, rank: str, node: str) -> None:
    """Connect this rank to the step supervisor's listener and keep the connection for the
    process's life (closed in forked children: a loader worker outliving its rank must not keep
    it open). Best effort: no listener, no connection, and the rank goes on."""
    if not address or _held:
        return
    os.environ.pop(LIVENESS_VARIABLE, None)  # not for the processes the rank starts: they are not its ranks
    where, _, token = address.rpartition(":")
    host, _, port = where.rpartition(":")
    try:
        connection = socket.create_connection((host, int(port)), timeout=2.0)
        connection.sendall(f"{token} {rank} {node}\n".encode())
    except (OSError, ValueError):
        return
    if not _registered:  # once per process: a parked rank holds a connection again in its next run
        _registered.append(True)
        os.register_at_fork(after_in_child=_let_go_in_child)
        atexit.register(say_bye)
    _held.append(connection)


def say_bye() -> None:
    """The interpreter ends as asked (an exit code, an exception's end): not a death to look into."""
    for connection in _held:
        try:
            connection.sendall(b"bye\n")
        except OSError:
            pass


def let_go() -> None:
    """`bye`, and the connection closed: this process no longer runs the step's rank (a parked
    rank, hpc.rank.parking); its next run holds a connection to the next step's supervisor."""
    say_bye()
    _let_go_in_child()


def _let_go_in_child() -> None:
    for connection in _held:
        connection.close()
    _held.clear()


def node_answers(address: tuple[str, int], timeout_s: float = SLURMD_ANSWER_S, tries: int = SLURMD_TRIES) -> bool:
    """Whether a TCP connection to the address (a node's slurmd) is accepted within timeout_s. A
    refused one is an answer of its host with no slurmd (no step can start there); a timed-out
    one is tried again, `tries` times in all (a blip on the way)."""
    for attempt in range(tries):
        try:
            socket.create_connection(address, timeout=timeout_s).close()
        except (ConnectionRefusedError, UnicodeError):
            return False
        except OSError:
            if attempt + 1 < tries:
                time.sleep(SLURMD_RETRY_S)
            continue
        return True
    return False


def unanswering(nodes: Iterable[str], addresses: Mapping[str, tuple[str, int]]) -> list[str]:
    """The nodes whose slurmd does not answer (`node_answers`), all asked at once; a node whose
    address is unknown is not said to be lost."""
    from concurrent.futures import ThreadPoolExecutor  # the supervisor's side only: not in a rank's first instruction

    asked = [node for node in nodes if node in addresses]
    with ThreadPoolExecutor(max_workers=max(1, min(64, len(asked)))) as pool:
        answers = list(pool.map(lambda node: node_answers(addresses[node]), asked))
    return [node for node, answered in zip(asked, answers, strict=True) if not answered]


def keep_alive(connection: socket.socket) -> None:
    """TCP keepalive on a short fuse: the kernel finds a host that stopped answering."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = KEEPALIVE_S
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):  # Linux; other systems keep their defaults
            connection.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def raise_open_files_limit() -> None:
    """The soft limit of open files up to the hard one (often 1024 against 1048576)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ImportError, ValueError, OSError):
        pass


class Listener:
    """The supervisor's side: accepts the ranks' connections and calls `on_closed(rank, node)`
    from its own thread once for each connection that closes or fails after a hello line with
    its token (the port is open to the network: only the job's ranks, which inherit the token in
    their environment, can have a step ended by a connection they close)."""

    def __init__(self, on_closed: Callable[[str, str], None]) -> None:
        self.on_closed = on_closed
        self.token = secrets.token_hex(16)
        raise_open_files_limit()  # a connection per rank: thousands at scale
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
        except OSError as err:
            if err.errno in (errno.EMFILE, errno.ENFILE):  # the server stays readable: stop listening, not spin
                self.selector.unregister(self.server)
                print(f"hpc-toolkit: liveness: {err.strerror}: ranks connecting from now on are watched by their heartbeats only", file=sys.stderr)
            return
        connection.setblocking(False)
        try:
            keep_alive(connection)
        except OSError:
            pass  # the kernel's defaults, then
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
            try:
                self.on_closed(said[1], said[2])
            except Exception as err:  # noqa: BLE001 - the listener outlives any one rank's news
                print(f"hpc-toolkit: liveness: rank {said[1]} on {said[2]}: {type(err).__name__}: {err}", file=sys.stderr)

    def close(self) -> None:
        self._closing.set()
        self._waker.send(b"x")
        self._thread.join(timeout=5)
        for connection in [*self.peers, self.server, self._wake, self._waker]:
            connection.close()
        self.selector.close()
