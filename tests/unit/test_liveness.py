"""hpc.liveness with real processes and sockets: a rank's death is told by its closed connection
at once; an interpreter that ends says bye and is not told; a forked child does not keep its
parent's connection open; a node's slurmd answers or does not."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from hpc.liveness import Listener, node_answers
from tests.support.runs import ROOT

HOLDER = """
import os, sys, time
from hpc.liveness import hold
hold(sys.argv[1], sys.argv[2], "node7")
if sys.argv[3] == "fork" and os.fork() == 0:
    time.sleep(60)  # a loader worker that outlives its rank for a while
    os._exit(0)
print("holding", flush=True)
if sys.argv[3] != "exit":
    time.sleep(60)
"""


class Told:
    def __init__(self) -> None:
        self.closed: list[tuple[str, str, float]] = []
        self.event = threading.Event()

    def __call__(self, rank: str, node: str) -> None:
        self.closed.append((rank, node, time.monotonic()))
        self.event.set()


def holder(address: str, rank: str, mode: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, address, rank, mode], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "holding\n"
    return child


def connected(listener: Listener, count: int, timeout_s: float = 10) -> None:
    """Until `count` connections said hello (0: until none is open)."""
    deadline = time.monotonic() + timeout_s
    while (sum(1 for said in listener.peers.values() if said.endswith(b"\n")) < count) if count else listener.peers:
        assert time.monotonic() < deadline, "the holders never said hello"
        time.sleep(0.01)


def test_a_killed_rank_is_told_at_once_and_a_forked_child_does_not_keep_it_alive():
    told = Told()
    listener = Listener(told)
    try:
        killed, forked = holder(listener.address, "3", "sleep"), holder(listener.address, "5", "fork")
        connected(listener, 2)
        for child in (killed, forked):
            child.send_signal(signal.SIGKILL)
            child.wait()
        sent = time.monotonic()
        deadline = sent + 5
        while len(told.closed) < 2:
            assert time.monotonic() < deadline, told.closed
            told.event.wait(0.05)
        assert sorted((rank, node) for rank, node, _ in told.closed) == [("3", "node7"), ("5", "node7")]
        assert max(at for _, _, at in told.closed) - sent < 1.0  # the kernel closed them: no timeout waited for
    finally:
        listener.close()
        subprocess.run(["pkill", "-KILL", "-f", "a loader worker that outlives"], check=False)


def test_an_interpreter_that_ends_says_bye_and_is_not_told():
    told = Told()
    listener = Listener(told)
    try:
        ended = holder(listener.address, "1", "exit")
        assert ended.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while listener.peers:  # its connection read to the end and forgotten
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert told.closed == []
    finally:
        listener.close()


def test_only_a_connection_with_the_listeners_token_is_told():
    told = Told()
    listener = Listener(told)
    try:
        host, port, token = listener.address.rsplit(":", 2)
        for hello in (b"wrong 3 node7\n", b"3 node7\n", token.encode() + b" 3 node7 " + b"x" * 600):
            with socket.create_connection((host, int(port))):
                pass
            connection = socket.create_connection((host, int(port)))
            connection.sendall(hello)
            connection.close()
        with socket.create_connection((host, int(port))) as connection:
            connection.sendall(f"{token} 4 node8\n".encode())
        told.event.wait(5)
        connected(listener, 0)  # every connection read to its end
        assert [(rank, node) for rank, node, _ in told.closed] == [("4", "node8")]  # the others were not the job's ranks
    finally:
        listener.close()


def test_a_slurmd_that_listens_answers_and_a_closed_port_does_not():
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = ("127.0.0.1", server.getsockname()[1])
        assert node_answers(address, timeout_s=2)
    assert not node_answers(address, timeout_s=2)  # nothing listens there now: refused at once
