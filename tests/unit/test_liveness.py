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

import pytest

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


@pytest.mark.parametrize("slurmd_answers", [True, False])
def test_srun_saying_a_task_was_killed_on_a_node_without_slurmd_is_that_node_lost(slurmd_answers):
    """A lost node's slurmstepd may report its task killed before the rank's connection is seen
    closed: the step's failure is still the node's loss where its slurmd does not answer, and
    srun's words (a task killed: out of memory?) where it does."""
    from hpc.slurm.supervise import StepRecord, StepWatch

    with socket.create_server(("127.0.0.1", 0)) as server:
        slurmd = {"node7": ("127.0.0.1", server.getsockname()[1])}
        if not slurmd_answers:
            server.close()
        record = StepRecord(start=0, attempt=0, nodes_excluded=[], launched=time.time())
        srun = ["sh", "-c", "echo 'srun: error: node7: task 1: Killed' >&2; exit 9"]
        watch = StepWatch(srun, dict(os.environ), record, "local", slurmd)
        assert watch.wait(list, lambda: None) == 9
    if slurmd_answers:
        assert record.failure == "node7: task 1: Killed (SIGKILL: out of memory?)" and watch.lost == []
    else:
        assert record.failure == "node node7 lost (srun: node7: task 1: Killed, its slurmd does not answer)" and watch.lost == ["node7"]
    assert record.first_failed_node == "node7"


def test_a_task_killed_on_a_node_the_probes_then_find_lost_is_said_as_that_nodes_loss(monkeypatch):
    """Its slurmd still answered when srun's word came (it dies last, or its port is held a moment
    longer): the probes that follow find no step starts there, and the failure says the node."""
    from hpc.slurm import slurmctl, supervise

    monkeypatch.setattr(supervise, "probe_nodes", lambda nodes: [node for node in nodes if node == "node7"])
    monkeypatch.setattr(slurmctl, "kill_wait_s", lambda: 0.0)
    with socket.create_server(("127.0.0.1", 0)) as server:
        record = supervise.StepRecord(start=0, attempt=0, nodes_excluded=[], launched=time.time())
        srun = ["sh", "-c", "echo 'srun: error: node7: task 1: Killed' >&2; exec sleep 30"]
        watch = supervise.StepWatch(srun, dict(os.environ), record, "local", {"node7": ("127.0.0.1", server.getsockname()[1])})
        assert watch.wait(lambda: ["node7", "node8"], lambda: None) == -signal.SIGKILL
    assert record.lost_nodes == ["node7"] and watch.lost == []
    assert record.failure == "node node7 lost (node7: task 1: Killed, no step starts there)"
