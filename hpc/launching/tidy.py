"""Leaving nothing behind on the login node: a command that runs and submits nothing (refused
input, a dry run) removes the folders it made, up to the ones that existed before it; a reader
that closes our stdout (`launch.py ... | head -1`) ends the command quietly."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from hpc.launching.snapshot import STORE

# The deepest folders that existed when this command started, per run root (see note_run_root).
_EXISTING: set[Path] = set()


def deepest_existing(path: Path) -> Path:
    path = path.absolute()
    while not path.is_dir() and path != path.parent:
        path = path.parent
    return path


def note_run_root(run_root: str | Path) -> None:
    """Before Hydra makes `run_root/<date>/<time>_<name>`: remember how far the tree exists now."""
    _EXISTING.add(deepest_existing(Path(run_root)))


def prune_empty(path: Path) -> None:
    """Remove `path` and then each parent while empty, stopping at a folder that existed when the
    command started (note_run_root); with none noted, only `path` itself. Never removes a
    folder that holds anything (another command's run dir made meanwhile included)."""
    path = path.absolute()
    stops = {p for p in _EXISTING if path.is_relative_to(p)}
    while path not in stops and path != path.parent:
        release_store(path / STORE)  # a run root's frozen files only the discarded run linked
        try:
            path.rmdir()
        except OSError:  # not empty, or gone already (then its parent may still be ours)
            if path.exists():
                return
        if not stops:
            return
        path = path.parent


def release_store(store: Path) -> None:
    """The files of a run root's store of frozen code (hpc.launching.snapshot) that no run dir links
    any more, and the folders that leaves empty, the store's own included. A launch that made a
    file and has not linked it yet finds it gone and copies instead (snapshot._place)."""
    if not store.is_dir():
        return
    for folder, _, files in sorted(os.walk(store), key=lambda entry: -len(entry[0])):  # deepest first
        for name in files:
            try:
                if os.stat(os.path.join(folder, name)).st_nlink == 1:
                    os.unlink(os.path.join(folder, name))
            except OSError:
                continue
        try:
            os.rmdir(folder)
        except OSError:
            continue  # still holds what a run dir links


def end_on_closed_stdout() -> NoReturn:
    """Our stdout's reader went away: exit as `yes | head -1` does (128 + SIGPIPE), without a
    traceback, and without the interpreter failing again when it flushes stdout at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    sys.exit(128 + signal.SIGPIPE)
