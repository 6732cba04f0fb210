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
hold(sys.argv[1], sys.argv[2], sys.argv[4])
child = os.fork() if sys.argv[3] == "fork" else -1
if child == 0:
    time.sleep(60)  # a loader worker that outlives its rank for a while
    os._exit(0)
print("holding", child, flush=True)
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


def holder(address: str, rank: str, mode: str, node: str = "node7") -> subprocess.Popen[str]:
    """A process holding a connection (mode fork: and a forked child of it, its pid in `.forked`)."""
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, address, rank, mode, node], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    said = child.stdout.readline().split()
    assert said[0] == "holding", said
    child.forked = int(said[1])  # type: ignore[attr-defined]
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
        if forked.forked > 0:  # type: ignore[attr-defined]
            os.kill(forked.forked, signal.SIGKILL)  # type: ignore[attr-defined]


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


def test_a_step_whose_rank_closed_on_a_node_without_slurmd_is_ended_with_that_node_lost(tmp_path):
    """StepWatch (hpc.slurm.supervise) with a stand-in for srun: a rank's death on a node whose
    slurmd answers is left to srun; one on a node whose slurmd does not is a lost node, and the
    step is ended at once (srun killed) with that node, and only it, lost."""
    from hpc.slurm.supervise import StepRecord, StepWatch

    with socket.create_server(("127.0.0.1", 0)) as live, socket.create_server(("127.0.0.1", 0)) as gone:
        slurmd = {"node7": ("127.0.0.1", gone.getsockname()[1]), "node8": ("127.0.0.1", live.getsockname()[1])}
    with socket.create_server(("127.0.0.1", slurmd["node8"][1])):  # node8's slurmd listens again; node7's never
        record = StepRecord(start=0, attempt=0, nodes_excluded=[], launched=time.time())
        watch = StepWatch(["sleep", "60"], dict(os.environ), record, "local", slurmd)
        on8, on7 = holder(watch.listener.address, "3", "sleep", "node8"), holder(watch.listener.address, "1", "sleep", "node7")
        on8.kill()
        on8.wait()
        assert not watch.failed.wait(1.0) and watch.lost == []  # node8 answers: the rank alone ended
        on7.kill()
        on7.wait()
        code = watch.wait(lambda: ["node7", "node8"], lambda: None)
    assert code == -signal.SIGKILL and record.hung and record.lost_nodes == ["node7"]
    assert record.failure == "node node7 lost (rank 1's connection closed, its slurmd does not answer)"
