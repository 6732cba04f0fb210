"""Processes by parentage, read from /proc: a launcher's ranks, and the whole tree it started,
ended at once. mpirun puts each local rank in a process group of its own, so a signal to
mpirun's group reaches mpirun alone and a SIGKILL to it orphans its ranks (they train on);
ending a run at once means every process below it. Login-node code: no torch."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

PROC = Path("/proc")


def parents(proc: Path = PROC) -> dict[int, int]:
    """Every process's parent: {pid: ppid}; {} where there is no /proc."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:  # field 4 of stat, after the command's name in parentheses (which may hold spaces and ')')
                found[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # ended meanwhile
                continue
    return found


def children(pid: int, proc: Path = PROC) -> list[int]:
    """The direct children of `pid` (mpirun's are the local ranks); [] when none or unknown."""
    return sorted(child for child, parent in parents(proc).items() if parent == pid)


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """`pid`'s children, theirs, and so on: parents before their children."""
    below: dict[int, list[int]] = {}
    for child, parent in parents(proc).items():
        below.setdefault(parent, []).append(child)
    found, queue = [], sorted(below.get(pid, []))
    while queue:
        found.append(queue.pop(0))
        queue.extend(sorted(below.get(found[-1], [])))
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it, as they were a moment before: the tree is read
    first (a killed parent's children pass to init, out of reach), the root killed first (it
    starts no more), then the rest."""
    below = descendants(pid)
    for each in (pid, *below):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(each, signal.SIGKILL)
