"""What the rank's main lends a script's run handle (hpc.run) while the script runs (the parts of
the job the handle adopts), and the handle the script started, which tells the rank how the
script ended."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc.env import RankInfo
from hpc.rundir import RunDir

if TYPE_CHECKING:
    from hpc.config.schema import JobConfig
    from trainers.config import CheckpointConfig, TrainerConfig
    from trainers.handle import Handle
    from trainers.preemption import StopFlag


@dataclass
class Host:
    """The job's settings a script's handle adopts: each part of the config it reads, no more."""

    trainer: TrainerConfig  # reporting, the watchdog
    trackers: list[str]
    checkpoint: CheckpointConfig
    sharding: str  # comm.sharding
    requeue: bool  # cluster.requeue: the watchdog may requeue a stalled job
    run_dir: RunDir
    rank: RankInfo
    stop: StopFlag
    signals: tuple[signal.Signals, ...]
    handle: Handle | None = None  # the run handle the script started (hpc.run), for how it ended

    @classmethod
    def of(cls, job: JobConfig, run_dir: RunDir, rank: RankInfo, stop: StopFlag, signals: tuple[signal.Signals, ...]) -> Host:
        return cls(job.trainer, list(job.trackers), job.checkpoint, job.comm.sharding, job.cluster.requeue, run_dir, rank, stop, signals)


# The job a script runs under, for the handle it starts: a context variable, set only while the
# rank's main runs the script (hosted), never a setting kept in a module's global.
_HOSTED: ContextVar[Host | None] = ContextVar("hpc.rank.hosting", default=None)


@contextmanager
def hosted(host: Host) -> Iterator[None]:
    """While a script runs under the rank's main: a handle it starts uses the job's settings."""
    token = _HOSTED.set(host)
    try:
        yield
    finally:
        _HOSTED.reset(token)


def host() -> Host | None:
    """The job the running script was started under (None: a script started by hand)."""
    return _HOSTED.get()


def started(handle: Handle) -> None:
    """The run handle the script started, kept for the rank's main (hpc.rank.script)."""
    found = _HOSTED.get()
    if found is not None:
        found.handle = handle
