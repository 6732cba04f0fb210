"""In-process restarts (hpc.rank.parking) on this machine, without Slurm: a warm process with a
light module list (tests/support/warmserver.py), a rank that parks once its client is gone and is
handed to the next client of its place; and the cut that wakes a Gloo collective waiting for a
peer that is alive but silent (a lost node sends no FIN). The whole path on the simulated Slurm,
bit-exact: tests/e2e/test_allocation_restart_slurm.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from benchmarks.simcluster import poll
from hpc.rank import parking
from hpc.rank.warm import stopped
from tests.support.runs import ROOT
from tests.support.warmserver import MODULES, alive, client, said, start_warm

PLACE = parking.SLOT_VARIABLE


def parked_client(job_env, tmp_path, place: str = "0") -> tuple[subprocess.Popen[str], int]:
    """A client whose rank arms, then the client killed as the supervisor kills a step's tasks: the rank's pid."""
    started = client(job_env, tmp=tmp_path, PROBE="park", **{PLACE: place})
    rank = said(started)["pid"]
    assert said(started) == {"armed": True}
    started.kill()
    started.wait()
    poll(lambda: parked(rank), "the rank to park", 20)
    return started, rank


def parked(pid: int) -> bool:
    """A parked rank writes to no task's streams (hpc.rank.warm._park): its stdout is /dev/null."""
    try:
        return os.readlink(f"/proc/{pid}/fd/1") == os.devnull
    except OSError:
        return False


def test_a_rank_whose_client_is_gone_parks_and_runs_again_for_the_next_client_of_its_place(warm, job_env, tmp_path):
    _, rank = parked_client(job_env, tmp_path)
    other = client(job_env, tmp=tmp_path, PROBE_CODE="3", **{PLACE: "1"})  # another place: a fork of its own
    assert said(other)["pid"] != rank and other.wait(timeout=30) == 3
    assert alive(rank)
    again = client(job_env, "x", tmp=tmp_path, PROBE_CODE="5", PROBE_X="the next step's", **{PLACE: "0"})
    now = said(again)
    assert now["pid"] == rank and now["argv"] == ["x"] and now["x"] == "the next step's" and now["cwd"] == str(tmp_path)
    assert now["forked"].startswith("an in-process restart: this process trained the last step too")
    assert again.wait(timeout=30) == 5  # its exit code is the new client's
    poll(lambda: not alive(rank), "the rank to end with its run", 20)


@pytest.fixture
def quick_hold(job_env):
    """A warm process that holds a task for its place's parking rank 1 s (parking.HOLD_VARIABLE)."""
    server = start_warm({**job_env, parking.HOLD_VARIABLE: "1"}, *MODULES)
    assert server.stdout is not None and server.stdout.readline().startswith("hpc-warm: ready warmnode ")
    yield server
    server.kill()
    server.wait()


def test_a_rank_that_does_not_park_in_time_is_ended_and_its_place_gets_a_fork(quick_hold, job_env, tmp_path):
    started = client(job_env, tmp=tmp_path, PROBE="stuck", **{PLACE: "0"})
    stuck = said(started)["pid"]
    # Its `armed` and its client's end come in the same turn of the warm process's loop (stopped
    # meanwhile): the word read with the end is not waited for again, the rank is not forgotten.
    os.kill(quick_hold.pid, signal.SIGSTOP)
    try:
        os.kill(stuck, signal.SIGUSR1)
        assert said(started) == {"armed": True}
        started.kill()
        started.wait()
    finally:
        os.kill(quick_hold.pid, signal.SIGCONT)
    began = time.monotonic()
    again = client(job_env, tmp=tmp_path, PROBE_CODE="0", **{PLACE: "0"})
    assert said(again)["pid"] != stuck and again.wait(timeout=30) == 0
    assert time.monotonic() - began < parking.PARK_WITHIN_S  # held its hold at most, not the whole parking time
    poll(lambda: not alive(stuck), "the stuck rank to be ended", 20)


def test_a_stopped_rank_whose_client_is_gone_is_ended_at_once(warm, job_env, tmp_path):
    """A hung rank (SIGSTOP: the hang path) cannot park: its place gets a fork without waiting."""
    started = client(job_env, tmp=tmp_path, PROBE="park", **{PLACE: "0"})
    hung = said(started)["pid"]
    assert said(started) == {"armed": True}
    os.kill(hung, signal.SIGSTOP)
    poll(lambda: stopped(hung), "the rank stopped", 10)
    started.kill()
    started.wait()
    poll(lambda: not alive(hung), "the hung rank to be ended", 4)  # not parking.PARK_WITHIN_S later


def test_a_parked_rank_ends_with_its_warm_process(warm, job_env, tmp_path):
    _, rank = parked_client(job_env, tmp_path)
    assert warm.stdin is not None
    warm.stdin.close()  # the supervisor is done: no step will take it
    assert warm.wait(timeout=30) == 0
    assert not alive(rank)


GLOO_RANK = """
import datetime, sys, time, torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
dist.all_reduce(torch.ones(2))
print("joined", flush=True)
if rank == 1:
    time.sleep(120)  # alive and silent: a lost node's rank sends no FIN
import threading
from hpc.rank import parking
from hpc.rank.warm import stopped
threading.Timer(0.5, parking.cut_connections).start()
began = time.monotonic()
try:
    dist.all_reduce(torch.ones(2))
except Exception as err:
    print(f"woke {time.monotonic() - began:.2f} {parking.peer_gone(err)}", flush=True)
"""


def test_the_cut_wakes_a_gloo_collective_waiting_for_a_silent_peer(tmp_path):
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ranks = [subprocess.Popen([sys.executable, "-c", GLOO_RANK, str(r), port], env=env, stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        out, _ = ranks[0].communicate(timeout=90)
        woke = out.split("woke ")[1].split()
        assert float(woke[0]) < 30 and woke[1] == "True", out  # the group's timeout is 120 s
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()


CUT = """
import socket, threading
from hpc.rank import parking
with socket.create_server(("127.0.0.1", 0)) as server, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
    connected = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    woke = []
    waiting = threading.Thread(target=lambda: woke.append(connected.recv(1)))
    waiting.start()
    cut = parking.cut_connections()
    waiting.join(timeout=10)
    with socket.create_connection(server.getsockname()):  # the listener still accepts
        pass
    print(cut, woke, unix.fileno() >= 0)
"""


def test_the_cut_shuts_connected_tcp_sockets_and_leaves_listeners_and_unix_sockets():
    """In a process of its own: the cut shuts every TCP connection of the process it runs in."""
    done = subprocess.run([sys.executable, "-c", CUT], env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert done.stdout.split() == ["2", "[b'']", "True"], done.stdout + done.stderr  # both ends of the one connection


@pytest.mark.parametrize(
    ("error", "gone"),
    [
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:50848"), True),
        (RuntimeError("Connection reset by peer"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), False),
        (RuntimeError("[enforce fail at ../third_party/gloo/gloo/transport/tcp/pair.cc:446] op.preamble.length <= op.nbytes. 8 vs 4"), False),
        (ValueError("Connection closed by peer"), False),
    ],
)
def test_a_peer_gone_is_told_from_the_training_s_own_errors(error, gone):
    assert parking.peer_gone(error) is gone


def test_a_rank_that_parks_freezes_nothing_of_its_training(tmp_path, monkeypatch):
    """hpc.rank.main freezes what is left at a rank's end (its exit need not collect it), not
    what a parking rank leaves: that must be freed before its next run (an optimizer and its
    parameters hold each other: only the cyclic collector frees them)."""
    import argparse
    import gc
    import weakref

    from hpc.rank import main as rank_main

    (tmp_path / "config.yaml").write_text("{}\n")
    freed: list[bool] = []

    def training_ends_under_it(run_dir: str) -> dict:
        held = argparse.Namespace()
        held.model = held  # a cycle, reachable from this frame while Parked unwinds
        weakref.finalize(held, freed.append, True)
        parking._state.cutting = True  # its task ended: hpc.rank.parking.begin
        raise parking.Parked

    monkeypatch.setattr(rank_main, "train_rank", training_ends_under_it)
    try:
        rank_main.main([str(tmp_path)])
    except parking.Parked:
        pass
    finally:
        parking._state.cutting = False
    gc.collect()
    assert freed == [True]
