"""Which failures of a rank would repeat on a restart (the job ends) and which need not (counted
against the failure budget, as a killed rank is): hpc.rank.failures, and what abort_job does."""

from __future__ import annotations

import errno
import logging

import pytest

from collectives.base import CollectivesError
from hpc.env import REQUEST_DIR_VARIABLE, RankInfo
from hpc.errors import UserError
from hpc.rank import main as rank_main
from hpc.rank.failures import repeats
from trainers.checkpoint import CheckpointError
from trainers.datasets import DataError
from trainers.guard import DivergedError
from trainers.loader import DataWorkerError
from trainers.task import TaskError

LASTING = [
    TaskError("task.hidden must be > 0"),
    CheckpointError("written by task lm, not classify"),
    DivergedError("3 non-finite steps in a row"),
    DataError("labels outside 0..9"),
    UserError("comm=nccl needs GPUs"),
    CollectivesError("comm=nccl needs a GPU on every rank"),
    FileNotFoundError(errno.ENOENT, "No such file or directory", "/data/x.h5"),
    PermissionError(errno.EACCES, "Permission denied", "/data/x.h5"),
    OSError("Unable to open file (unable to open file: No such file or directory)"),  # h5py without an errno
    TypeError("forward() takes 2 positional arguments but 3 were given"),
    AttributeError("'Tensor' object has no attribute 'sizee'"),
    type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory. Tried to allocate 2.00 GiB"),
    MemoryError(),
]
PASSING = [
    OSError(errno.EIO, "Input/output error"),
    OSError(errno.ESTALE, "Stale file handle"),
    TimeoutError("Gloo: timed out waiting for peers"),
    ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
    RuntimeError("NCCL watchdog: collective operation timeout"),
    DataWorkerError("data worker 1 died (killed by SIGKILL, often the out-of-memory killer)"),
    KeyError("python"),
]


@pytest.mark.parametrize("err", LASTING, ids=lambda e: type(e).__name__)
def test_the_users_deterministic_errors_repeat(err):
    assert repeats(err)


@pytest.mark.parametrize("err", PASSING, ids=lambda e: type(e).__name__)
def test_everything_else_need_not_repeat(err):
    assert not repeats(err)


class Aborted:
    code: int | None = None

    def abort(self, code: int = 1) -> None:
        self.code = code


@pytest.mark.parametrize("err", [TaskError("bad task"), OSError(errno.EIO, "Input/output error")], ids=["repeats", "need-not"])
def test_abort_job_ends_every_rank_and_forbids_restarts_only_for_errors_that_repeat(err, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(REQUEST_DIR_VARIABLE, str(tmp_path))  # as the batch script sets it: the step supervisor reads markers there
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    forbidden: list[bool] = []
    monkeypatch.setattr(rank_main, "forbid_failure_requeue", lambda env: forbidden.append(True) or "77")  # scontrol, not run here
    monkeypatch.setattr(rank_main.logging, "shutdown", lambda: None)  # the test's log capture stays open
    comm = Aborted()
    with caplog.at_level(logging.INFO):
        rank_main.abort_job(err, comm, RankInfo(1, 1, 2, 2, 0, 1, ("node1",), "slurm"))  # type: ignore[arg-type]
    assert comm.code == 1
    lasting = isinstance(err, TaskError)
    assert bool(forbidden) == lasting and bool(list(tmp_path.glob("77.error-*"))) == lasting
    assert ("need not repeat: counted as a failure, like a lost rank" in caplog.text) != lasting
