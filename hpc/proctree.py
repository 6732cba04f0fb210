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


def stat_fields(proc: Path = PROC) -> dict[int, list[str]]:
    """Every process's stat fields after its command's name (which may hold spaces and ')'):
    [state, ppid, pgrp, session, ...]; {} where there is no /proc."""
    found: dict[int, list[str]] = {}
    with contextlib.suppress(OSError):
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                found[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):  # ended meanwhile
                continue
    return found


def parents(proc: Path = PROC) -> dict[int, int]:
    """Every process's parent: {pid: ppid}."""
    return {pid: int(fields[1]) for pid, fields in stat_fields(proc).items() if len(fields) > 1 and fields[1].isdigit()}


def children(pid: int, proc: Path = PROC) -> list[int]:
    """The direct children of `pid` (mpirun's are the local ranks); [] when none or unknown."""
    return sorted(child for child, parent in parents(proc).items() if parent == pid)


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """`pid`'s children, theirs, and so on: parents before their children."""
    below: dict[int, list[int]] = {}
    for child, parent in parents(proc).items():
        below.setdefault(parent, []).append(child)
    found: list[int] = []
    seen, queue = {pid}, sorted(below.get(pid, []))
    while queue:
        each = queue.pop(0)
        if each in seen:  # a torn read of /proc: never twice
            continue
        seen.add(each)
        found.append(each)
        queue.extend(sorted(below.get(each, [])))
    return found


def session_members(session: int, proc: Path = PROC) -> list[int]:
    """The processes of session `session` (mpirun leads its own: its ranks and what they started,
    reparented or not)."""
    return sorted(pid for pid, fields in stat_fields(proc).items() if len(fields) > 3 and fields[3] == str(session))


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every process below it: the tree as it was a moment before (a killed
    parent's children pass to init, out of reach by parentage), the root first (it starts no
    more), then the rest, then whatever of the root's session is left (a process started between
    the reading and the kill stays in the session mpirun leads)."""
    below = descendants(pid)
    for each in (pid, *below):
        _kill(each)
    for each in session_members(pid):
        _kill(each)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
