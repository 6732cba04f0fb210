"""What the rank's main lends a script's run handle (hpc.run) while the script runs, and the
handle the script started, which tells the rank how the script ended."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc.env import RankInfo
from hpc.rundir import RunDir

if TYPE_CHECKING:
    from hpc.config.schema import JobConfig
    from trainers.handle import Handle
    from trainers.preemption import StopFlag


@dataclass
class Host:
    job: JobConfig
    run_dir: RunDir
    rank: RankInfo
    stop: StopFlag
    signals: tuple[signal.Signals, ...]


_host: Host | None = None
_handle: Handle | None = None


@contextmanager
def hosted(host: Host) -> Iterator[None]:
    """While a script runs under the rank's main: a handle it starts uses the job's settings."""
    global _host, _handle
    _host, _handle = host, None
    try:
        yield
    finally:
        _host = None


def host() -> Host | None:
    return _host


def started(handle: Handle | None) -> None:
    global _handle
    _handle = handle


def started_handle() -> Handle | None:
    """The run handle the script started in this process (None: none)."""
    return _handle
