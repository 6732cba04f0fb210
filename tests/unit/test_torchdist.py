"""collectives/torchdist.py keeps what an asynchronous collective lent to the backend's worker
threads until those threads let go of it (quiesce): were a worker's reference the last, it would
free a Python tensor from a thread that must take the GIL, and during interpreter exit that aborts
the process. (The end-to-end check, a script's runs under torchrun: tests/mpi/test_torchrun_exit.py.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from collectives.torchdist import TorchDistCollectives, held_elsewhere
from tests.support.ranks import gloo_world_of_one


def test_quiesce_returns_only_once_no_other_owner_holds_a_lent_tensor(tmp_path: Path) -> None:
    with gloo_world_of_one(tmp_path / "store"):
        comm = TorchDistCollectives("gloo", torch.device("cpu"))
        lent = torch.ones(4, requires_grad=True)
        graph = [(lent * lent).sum()]  # autograd's nodes hold `lent` from C++, as a worker would
        assert held_elsewhere(lent)
        comm._lend(lent)
        worker = threading.Timer(0.3, graph.clear)  # the "worker" lets go later, on another thread
        worker.start()
        started = time.monotonic()
        comm.quiesce(timeout_s=30)
        assert not held_elsewhere(lent) and time.monotonic() - started < 20
        worker.join()


def test_what_a_collective_lends_is_kept_only_while_the_backend_holds_it(tmp_path: Path) -> None:
    with gloo_world_of_one(tmp_path / "store"):
        comm = TorchDistCollectives("gloo", torch.device("cpu"))
        buffer = torch.arange(4, dtype=torch.float32)
        deferred = comm.allreduce_async(buffer)
        assert [t for t in comm._lent if t is buffer]  # lent as the work starts
        deferred.wait()
        gathered = comm.allgather(torch.ones(2))
        assert torch.equal(gathered, torch.ones(2)) and torch.equal(buffer, torch.arange(4, dtype=torch.float32))
        comm.quiesce()  # the worker may still hold the last collective's tensors for a moment
        assert comm._lent == []
        # each lending lets go of what the backend no longer holds: a long run's list stays short
        for _ in range(50):
            comm._lend(torch.zeros(1))
        assert len(comm._lent) == 1
