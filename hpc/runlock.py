"""One start of a local run at a time. `bash RUN_DIR/command.txt` typed while the run still
trains started a second set of ranks in the same run dir: every step trained twice, both
writing the same checkpoints and logs. Two locks in the run dir, taken with flock (released by
the kernel when a process ends, however it ends):

- the launcher (hpc.launching.ranks, what launch.py and command.txt run) holds LAUNCHER_LOCK
  exclusively while its ranks run;
- each rank of a run outside Slurm holds RANKS_LOCK shared for its life, so ranks that outlive a
  killed launcher still count as running (Slurm runs one instance of a job itself).

A new launcher takes its own lock and checks that no rank holds the other; `hpc.status` asks the
same. A file system without flock (some parallel file systems) locks nothing: the check passes,
as before. Standard library only.
"""

from __future__ import annotations

import errno
import fcntl
from pathlib import Path
from typing import IO

LAUNCHER_LOCK = ".launcher.lock"
RANKS_LOCK = ".ranks.lock"
_held: list[IO[bytes]] = []  # this process's locks: open for its life


class RunDirBusy(Exception):
    """Another start of the run still runs (its launcher or its ranks)."""


def _locked(path: Path, how: int) -> IO[bytes] | None:
    """`path` (created) locked `how` without waiting: the open file that holds it; None when
    another process holds a conflicting lock. A file system that cannot lock holds nothing and
    says yes."""
    handle = open(path, "ab")  # noqa: SIM115  # held open: the lock lives as long as the file
    try:
        fcntl.flock(handle.fileno(), how | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            handle.close()
            return None
    return handle


def hold_launch(run_path: Path) -> None:
    """This process is the run's launcher until it ends; RunDirBusy, naming what runs, when
    another launcher or ranks of an earlier start still run."""
    try:
        mine = _locked(run_path / LAUNCHER_LOCK, fcntl.LOCK_EX)
    except OSError:  # a run dir this process cannot write: the run itself will say so
        return
    if mine is None:
        raise RunDirBusy(f"{run_path} is running already; stop it first (python -m hpc.stop {run_path}) or wait for its end")
    if ranks_running(run_path):
        mine.close()
        raise RunDirBusy(f"ranks of an earlier start of {run_path} still run (their launcher is gone); stop them first: python -m hpc.stop {run_path}")
    _held.append(mine)


def hold_rank(run_path: Path) -> None:
    """This rank counts as running until its process ends (a shared lock: all ranks hold it)."""
    try:
        handle = open(run_path / RANKS_LOCK, "ab")  # noqa: SIM115  # held open for the process's life
    except OSError:  # a run dir the rank cannot write to fails where the rank writes its log, in one line
        return
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_SH)  # waits only while a launcher checks (microseconds)
    except OSError:
        handle.close()
        return
    _held.append(handle)


def ranks_running(run_path: Path) -> bool:
    """Whether a rank of the run holds its lock now (a process of any start, on this machine)."""
    if not (run_path / RANKS_LOCK).exists():
        return False
    try:
        probe = _locked(run_path / RANKS_LOCK, fcntl.LOCK_EX)
    except OSError:  # unreadable or read-only: nothing can be told
        return False
    if probe is None:
        return True
    probe.close()
    return False


def release_all() -> None:
    """Let go of this process's locks (a test's; a process's end does it anyway)."""
    while _held:
        _held.pop().close()


__all__ = ["LAUNCHER_LOCK", "RANKS_LOCK", "RunDirBusy", "hold_launch", "hold_rank", "ranks_running", "release_all"]
